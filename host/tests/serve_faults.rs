//! `selkie serve` when things go wrong: an engine that dies mid-stream,
//! refuses connections, stalls or answers 500; a client that leaves
//! mid-stream; and every refusal the router makes, each with its status,
//! its JSON body, and nothing booked or forwarded.

mod support;

use std::io::{Read, Write};
use std::time::Duration;

use selkie::router::PolicySpec;
use support::stub_engine::{answer, Fault, StubConfig, StubEngine};
use support::{dead_url, eventually, post, router, scrape, url, wait_unbooked, Reply};

const STREAM: &str = r#"{"model":"tiny","prompt":[1,2,3,4,5,6],"max_tokens":8,"stream":true}"#;
const PLAIN: &str = r#"{"model":"tiny","prompt":[1,2,3,4,5,6],"max_tokens":8}"#;

fn events(reply: &Reply) -> usize {
    String::from_utf8_lossy(&reply.body()).matches("data: ").count()
}

/// The refusal's status and JSON body.
fn assert_refused(reply: &Reply, status: u16, code: &str) {
    assert_eq!(reply.status, status, "{:?}", String::from_utf8_lossy(&reply.body()));
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let v = reply.json();
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(!v["error"]["message"].as_str().unwrap().is_empty(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_mid_stream() {
    let mut config = StubConfig::new("e");
    config.chunk_delay = Duration::from_millis(20);
    let e = StubEngine::start(config).await;
    e.set_fault(Fault::DieAfter(3));
    let server = router(&[e.url()], |_| {}).await;
    let r = url(&server);
    let reply = post(&r, "/v1/completions", STREAM, &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(events(&reply), 3, "the events sent before the engine died");
    let whole = answer(e.config(), "/v1/completions", STREAM.as_bytes()).body();
    assert!(whole.starts_with(&reply.body()), "the bytes that came are the engine's");
    assert!(reply.error.is_some(), "the client sees the stream cut, not a clean end");
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0), "{}", s.text);
    assert_eq!(s.value("selkie_upstream_errors_total", r#"kind="body""#), 1.0);
    // The router goes on serving.
    e.set_fault(Fault::None);
    assert_eq!(post(&r, "/v1/completions", STREAM, &[]).await.body(), whole);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_once_on_the_next_choice_and_booked_once() {
    let (dead, _held) = dead_url();
    let b = StubEngine::start(StubConfig::new("b")).await;
    b.set_fault(Fault::HoldAfter(1));
    let server = router(&[dead.clone(), b.url()], |c| {
        c.policy = PolicySpec::parse("least-loaded").unwrap()
    })
    .await;
    let r = url(&server);
    let mut held = Vec::new();
    for i in 1..=4 {
        let rc = r.clone();
        held.push(tokio::spawn(
            async move { post(&rc, "/v1/completions", STREAM, &[]).await },
        ));
        eventually("the stream is held", async || b.open() == i).await;
        let s = scrape(&r).await;
        // Booked once, on the engine that took it; nothing on the dead one.
        assert_eq!(
            s.value("selkie_inflight_requests", &format!(r#"worker="{dead}",rank="0""#)),
            0.0,
            "{}",
            s.text
        );
        assert_eq!(
            s.value("selkie_inflight_requests", &format!(r#"worker="{}",rank="0""#, b.url())),
            i as f64
        );
        assert_eq!(s.booked().0, i as f64);
    }
    b.release();
    for h in held {
        let reply = h.await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-selkie-worker"), Some(b.url().as_str()));
        assert_eq!(
            reply.body(),
            answer(b.config(), "/v1/completions", STREAM.as_bytes()).body()
        );
    }
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    assert!(s.value("selkie_retries_total", "") >= 1.0, "{}", s.text);
    assert_eq!(
        s.value("selkie_retries_total", ""),
        s.value("selkie_upstream_errors_total", r#"kind="connect""#)
    );
    server.shutdown().await;

    // Every worker refuses: 502 after one retry, nothing booked.
    let dead: Vec<_> = (0..3).map(|_| dead_url()).collect();
    let urls: Vec<String> = dead.iter().map(|(url, _)| url.clone()).collect();
    let server = router(&urls, |_| {}).await;
    let r = url(&server);
    let reply = post(&r, "/v1/completions", PLAIN, &[]).await;
    assert_refused(&reply, 502, "upstream_unreachable");
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    assert_eq!(
        s.value("selkie_upstream_errors_total", r#"kind="connect""#),
        2.0,
        "one try and one retry"
    );
    assert_eq!(s.value("selkie_retries_total", ""), 1.0);
    assert_eq!(
        s.value("selkie_refusals_total", r#"reason="upstream_unreachable""#),
        1.0
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_stalls() {
    let e = StubEngine::start(StubConfig::new("e")).await;
    let server = router(&[e.url()], |c| {
        c.limits.stream_idle_timeout = Duration::from_millis(300);
        c.limits.response_timeout = Duration::from_millis(300);
    })
    .await;
    let r = url(&server);
    // Silent mid-stream: cut after the idle timeout.
    e.set_fault(Fault::StallAfter(2));
    let reply = post(&r, "/v1/completions", STREAM, &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(events(&reply), 2);
    assert!(reply.error.is_some(), "the stream is cut");
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    assert_eq!(s.value("selkie_upstream_errors_total", r#"kind="stall""#), 1.0);
    assert_eq!(
        s.value("selkie_bound_hits_total", r#"bound="stream_idle_timeout""#),
        1.0
    );
    eventually("the engine's connection is closed", async || e.open() == 0).await;
    // Silent before the head: 504.
    e.set_fault(Fault::HeadDelay(Duration::from_secs(2)));
    let reply = post(&r, "/v1/completions", PLAIN, &[]).await;
    assert_refused(&reply, 504, "upstream_timeout");
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    assert_eq!(s.value("selkie_upstream_errors_total", r#"kind="timeout""#), 1.0);
    assert_eq!(s.value("selkie_bound_hits_total", r#"bound="response_timeout""#), 1.0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_answers_500() {
    let e = StubEngine::start(StubConfig::new("e")).await;
    e.set_fault(Fault::Status500);
    let server = router(&[e.url()], |_| {}).await;
    let r = url(&server);
    let reply = post(&r, "/v1/completions", PLAIN, &[]).await;
    assert_eq!(reply.status, 500, "the engine's status passes through");
    let direct = post(&e.url(), "/v1/completions", PLAIN, &[]).await;
    assert_eq!(reply.body(), direct.body(), "the engine's body passes through");
    assert_eq!(reply.header("x-selkie-worker"), Some(e.url().as_str()));
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    assert_eq!(s.value("selkie_upstream_errors_total", r#"kind="status_5xx""#), 1.0);
    assert_eq!(
        s.value("selkie_http_requests_total", r#"endpoint="completions",status="500""#),
        1.0
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream() {
    use http_body_util::BodyExt;
    let e = StubEngine::start(StubConfig::new("e")).await;
    e.set_fault(Fault::HoldAfter(2));
    let server = router(&[e.url()], |_| {}).await;
    let r = url(&server);
    let request = hyper::Request::post(format!("{r}/v1/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(STREAM.as_bytes())))
        .unwrap();
    let client = support::client();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut got = Vec::new();
    while String::from_utf8_lossy(&got).matches("data: ").count() < 2 {
        let frame = body.frame().await.unwrap().unwrap();
        got.extend_from_slice(&frame.into_data().unwrap());
    }
    assert_eq!(scrape(&r).await.booked().0, 1.0);
    drop(body);
    drop(client);
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0), "{}", s.text);
    assert_eq!(s.value("selkie_client_disconnects_total", ""), 1.0);
    eventually("the engine's stream is closed too", async || e.open() == 0).await;
    assert_eq!(e.completed(), 0, "the engine did not finish the abandoned stream");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_has_its_status_and_body_and_books_nothing() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let server = router(&[a.url()], |c| c.limits.max_body_bytes = 1024).await;
    let r = url(&server);
    eventually("the engine's models are known", async || {
        support::get(&r, "/v1/models").await.json()["data"][0]["id"] == "tiny"
    })
    .await;
    let cases: [(&str, String, u16, &str); 10] = [
        ("/v1/completions", "{not json".into(), 400, "malformed_json"),
        ("/v1/completions", "".into(), 400, "malformed_json"),
        ("/v1/completions", r#"{"prompt":"hi"}"#.into(), 400, "missing_model"),
        ("/v1/completions", r#"{"model":"tiny"}"#.into(), 400, "missing_prompt"),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny","prompt":"hi"}"#.into(),
            400,
            "missing_prompt",
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":{"a":1}}"#.into(),
            400,
            "invalid_field",
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":"x","stream":"yes"}"#.into(),
            400,
            "invalid_field",
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"tiny","prompt":"{}"}}"#, "x".repeat(2000)),
            413,
            "body_too_large",
        ),
        (
            "/v1/completions",
            r#"{"model":"llama-9000","prompt":"hi"}"#.into(),
            404,
            "model_not_found",
        ),
        ("/v1/nothing", "{}".into(), 404, "not_found"),
    ];
    for (path, body, status, code) in cases {
        let reply = post(&r, path, body, &[]).await;
        assert_refused(&reply, status, code);
    }
    let wrong_method = support::get(&r, "/v1/completions").await;
    assert_refused(&wrong_method, 405, "method_not_allowed");
    // Over the limit without a Content-Length (chunked): 413 too.
    let status = raw_request(
        server.local_addr(),
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
        &[&[b'x'; 700][..], &[b'x'; 700][..]],
        None,
    );
    assert_eq!(status, 413);
    assert_eq!(a.generations(), 0, "no refused request reached the engine");
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    assert_eq!(
        s.value("selkie_refusals_total", r#"reason="malformed_json""#),
        2.0,
        "{}",
        s.text
    );
    assert_eq!(s.value("selkie_refusals_total", r#"reason="body_too_large""#), 2.0);
    assert_eq!(s.value("selkie_bound_hits_total", r#"bound="max_body_bytes""#), 2.0);
    assert_eq!(s.sum("selkie_selections_total"), 0.0, "nothing was selected");
    server.shutdown().await;

    // A body that does not come in time: 408.
    let server = router(&[a.url()], |c| c.limits.body_read_timeout = Duration::from_millis(200)).await;
    let status = raw_request(
        server.local_addr(),
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\"",
        &[],
        Some(Duration::from_secs(3)),
    );
    assert_eq!(status, 408);
    let s = scrape(&url(&server)).await;
    assert_eq!(s.value("selkie_bound_hits_total", r#"bound="body_read_timeout""#), 1.0);
    server.shutdown().await;
    assert_eq!(a.generations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_refusals_carry_retry_after() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let b = StubEngine::start(StubConfig::new("b")).await;
    a.set_fault(Fault::HoldAfter(1));
    b.set_fault(Fault::HoldAfter(1));
    // Every worker at its admission limit: 429.
    let server = router(&[a.url(), b.url()], |c| {
        c.max_active = Some(1);
        c.retry_after = Duration::from_secs(2);
    })
    .await;
    let r = url(&server);
    let mut held = Vec::new();
    for _ in 0..2 {
        let rc = r.clone();
        held.push(tokio::spawn(
            async move { post(&rc, "/v1/completions", STREAM, &[]).await },
        ));
    }
    eventually("both engines hold a stream", async || a.open() == 1 && b.open() == 1).await;
    let reply = post(&r, "/v1/completions", STREAM, &[]).await;
    assert_refused(&reply, 429, "workers_at_capacity");
    assert_eq!(reply.header("retry-after"), Some("2"));
    assert_eq!(a.generations() + b.generations(), 2);
    assert_eq!(scrape(&r).await.booked().0, 2.0, "the refused request booked nothing");
    a.release();
    b.release();
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(wait_unbooked(&r).await.booked(), (0.0, 0.0, 0.0));
    server.shutdown().await;

    // The router at its own bound: 503.
    let c2 = StubEngine::start(StubConfig::new("c")).await;
    c2.set_fault(Fault::HoldAfter(1));
    let server = router(&[c2.url()], |c| c.limits.max_concurrent_requests = 1).await;
    let r = url(&server);
    let first = tokio::spawn({
        let r = r.clone();
        async move { post(&r, "/v1/completions", STREAM, &[]).await }
    });
    // Held by the engine and booked by this router: the stream is the
    // first request's.
    eventually("the engine holds a stream", async || {
        c2.open() == 1 && scrape(&r).await.booked().0 == 1.0
    })
    .await;
    let reply = post(&r, "/v1/completions", STREAM, &[]).await;
    assert_refused(&reply, 503, "router_at_capacity");
    assert_eq!(reply.header("retry-after"), Some("1"));
    let s = scrape(&r).await;
    assert_eq!(
        s.value("selkie_bound_hits_total", r#"bound="max_concurrent_requests""#),
        1.0
    );
    c2.release();
    assert_eq!(first.await.unwrap().status, 200);
    // /health and /metrics are not proxied requests: they still answer.
    assert_eq!(support::get(&r, "/health").await.status, 200);
    server.shutdown().await;

    // No worker at all: 503.
    let dir = support::temp_dir("none");
    let file = dir.join("workers.json");
    std::fs::write(&file, r#"{"workers": []}"#).unwrap();
    let server = router(&[], |c| c.workers_file = Some(file)).await;
    let reply = post(&url(&server), "/v1/completions", PLAIN, &[]).await;
    assert_refused(&reply, 503, "no_workers");
    assert!(reply.header("retry-after").is_some());
    server.shutdown().await;
}

/// Writes `head` and `chunks` (chunked encoding when the head says so)
/// to `addr` and returns the response's status.
fn raw_request(addr: std::net::SocketAddr, head: &[u8], chunks: &[&[u8]], wait: Option<Duration>) -> u16 {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(head).unwrap();
    let chunked = String::from_utf8_lossy(head).contains("chunked");
    for c in chunks {
        if chunked {
            let _ = s.write_all(format!("{:x}\r\n", c.len()).as_bytes());
            let _ = s.write_all(c);
            let _ = s.write_all(b"\r\n");
        } else {
            let _ = s.write_all(c);
        }
    }
    if chunked {
        let _ = s.write_all(b"0\r\n\r\n");
    }
    if let Some(w) = wait {
        s.set_read_timeout(Some(w)).unwrap();
    }
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap();
    let line = String::from_utf8_lossy(&buf[..n]);
    line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}
