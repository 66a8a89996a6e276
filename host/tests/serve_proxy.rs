//! `selkie serve` in front of stub engines: completions and chat,
//! streaming and not, token-id, text and chat prompts; the bytes a client
//! gets are the engine's; every decision is the policy's; bookings follow
//! each response and end at 0.

mod support;

use std::time::Duration;

use selkie::router::{PolicySpec, ServeConfig, Server};
use support::stub_engine::{answer, Fault, StubConfig, StubEngine};
use support::{eventually, get, post, router, scrape, url, wait_unbooked};

/// Every request shape the router proxies: (path, body).
fn requests() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    for stream in [false, true] {
        v.push((
            "/v1/completions",
            format!(r#"{{"model":"tiny","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18],"max_tokens":5,"stream":{stream}}}"#),
        ));
        v.push((
            "/v1/completions",
            format!(r#"{{"model":"tiny","prompt":"hello world the cat sat on the mat again and again","max_tokens":4,"stream":{stream}}}"#),
        ));
        v.push((
            "/v1/completions",
            format!(r#"{{"model":"tiny","prompt":"the cat","max_tokens":3,"stream":{stream},"stream_options":{{"include_usage":true}}}}"#),
        ));
        v.push((
            "/v1/chat/completions",
            format!(r#"{{"model":"tiny","messages":[{{"role":"system","content":"the cat sat"}},{{"role":"user","content":"hello world"}}],"max_tokens":6,"stream":{stream}}}"#),
        ));
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_is_proxied_byte_for_byte_and_released() {
    let dir = support::temp_dir("shapes");
    let (tokenizer, template) = support::tokenizer_and_template(&dir);
    let a = StubEngine::start(StubConfig::new("a")).await;
    let b = StubEngine::start(StubConfig::new("b")).await;
    let engines = [&a, &b];
    for policy in ["kv", "prefix-hash", "round-robin", "least-loaded"] {
        let server = router(&[a.url(), b.url()], |c| {
            c.policy = PolicySpec::parse(policy).unwrap();
            c.tokenizer = Some(tokenizer.clone());
            c.chat_template = Some(template.clone());
        })
        .await;
        let r = url(&server);
        for (path, body) in requests() {
            let reply = post(&r, path, body.clone(), &[]).await;
            assert_eq!(
                reply.status,
                200,
                "{policy} {path} {body}: {:?}",
                String::from_utf8_lossy(&reply.body())
            );
            assert!(reply.error.is_none(), "{:?}", reply.error);
            let worker = reply.header("x-selkie-worker").expect("x-selkie-worker").to_owned();
            let engine = engines.iter().find(|e| e.url() == worker).expect("a known engine");
            let expected = answer(engine.config(), path, body.as_bytes());
            assert_eq!(
                reply.body(),
                expected.body(),
                "{policy} {path} {body}: not the engine's bytes"
            );
            assert_eq!(reply.header("content-type"), Some(expected.content_type));
            assert_eq!(
                reply.header("x-stub-engine"),
                Some(engine.config().name.as_str()),
                "engine headers pass through"
            );
            // The same request straight to the engine: the same bytes.
            let direct = post(&engine.url(), path, body.clone(), &[]).await;
            assert_eq!(direct.body(), reply.body());
        }
        let s = wait_unbooked(&r).await;
        assert_eq!(s.booked(), (0.0, 0.0, 0.0), "{policy}: bookings left\n{}", s.text);
        assert_eq!(
            s.sum("selkie_unhashed_requests_total"),
            0.0,
            "{policy}: every prompt was hashed\n{}",
            s.text
        );
        assert_eq!(s.sum("selkie_selections_total"), 8.0, "{policy}\n{}", s.text);
        assert_eq!(s.sum("selkie_refusals_total"), 0.0);
        assert_eq!(
            s.value("selkie_http_requests_total", r#"endpoint="completions",status="200""#),
            6.0
        );
        assert_eq!(
            s.value(
                "selkie_http_requests_total",
                r#"endpoint="chat_completions",status="200""#
            ),
            2.0
        );
        server.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_each_chunk_as_it_arrives() {
    let mut config = StubConfig::new("slow");
    config.chunk_delay = Duration::from_millis(150);
    let e = StubEngine::start(config).await;
    let server = router(&[e.url()], |_| {}).await;
    let body = r#"{"model":"tiny","prompt":[1,2,3],"max_tokens":8,"stream":true}"#;
    let reply = post(&url(&server), "/v1/completions", body, &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.body(),
        answer(e.config(), "/v1/completions", body.as_bytes()).body()
    );
    let first = reply.chunks[0].0 - reply.sent;
    let last = reply.chunks.last().unwrap().0 - reply.sent;
    assert!(
        reply.chunks.len() >= 8,
        "one chunk per event, got {}",
        reply.chunks.len()
    );
    assert!(
        first < Duration::from_millis(500),
        "first chunk after {first:?}: buffered"
    );
    assert!(last >= Duration::from_millis(1000), "last chunk after {last:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_decides() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let b = StubEngine::start(StubConfig::new("b")).await;
    let prompt = |first: u32| {
        let ids: Vec<String> = (first..first + 64).map(|i| i.to_string()).collect();
        format!(r#"{{"model":"tiny","prompt":[{}],"max_tokens":2}}"#, ids.join(","))
    };
    // Round-robin alternates.
    let server = router(&[a.url(), b.url()], |c| {
        c.policy = PolicySpec::parse("round-robin").unwrap()
    })
    .await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        let reply = post(&url(&server), "/v1/completions", prompt(1), &[]).await;
        seen.push(reply.header("x-selkie-worker").unwrap().to_owned());
    }
    assert_ne!(seen[0], seen[1]);
    assert_eq!(seen[0], seen[2]);
    assert_eq!(seen[1], seen[3]);
    server.shutdown().await;
    // kv (its index learns from its own decisions) and prefix-hash keep a
    // prompt where it went, and spread other prompts.
    for policy in ["kv", "prefix-hash"] {
        let server = router(&[a.url(), b.url()], |c| c.policy = PolicySpec::parse(policy).unwrap()).await;
        let mut homes = std::collections::BTreeSet::new();
        // Twelve prompts: prefix-hash's homes depend on the workers' ids
        // (their random ports), and six all landed on one worker in about
        // one run of 32; twelve do in one of 2,048.
        for first in (0..12u32).map(|i| 1 + 1000 * i) {
            let home = post(&url(&server), "/v1/completions", prompt(first), &[]).await;
            let home = home.header("x-selkie-worker").unwrap().to_owned();
            for _ in 0..3 {
                let again = post(&url(&server), "/v1/completions", prompt(first), &[]).await;
                assert_eq!(
                    again.header("x-selkie-worker").unwrap(),
                    home,
                    "{policy}: the same prompt moved"
                );
            }
            homes.insert(home);
        }
        assert_eq!(homes.len(), 2, "{policy}: twelve prompts all on one worker");
        let s = scrape(&url(&server)).await;
        if policy == "kv" {
            assert!(s.value("selkie_kv_index_blocks", "") >= 4.0, "{}", s.text);
            assert!(
                s.value("selkie_selections_total", r#"policy="kv",branch="kv-minimum""#) == 48.0,
                "{}",
                s.text
            );
        } else {
            assert!(
                s.value(
                    "selkie_selections_total",
                    r#"policy="prefix-hash",branch="prefix-hash""#
                ) == 48.0,
                "{}",
                s.text
            );
        }
        server.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_follow_the_response() {
    let e = StubEngine::start(StubConfig::new("e")).await;
    let server = router(&[e.url()], |c| {
        c.block_size = 4;
        c.policy = PolicySpec::parse("least-loaded").unwrap();
    })
    .await;
    let r = url(&server);
    // 8 prompt tokens = 2 blocks of 4; 10 output tokens.
    let body = r#"{"model":"tiny","prompt":[1,2,3,4,5,6,7,8],"max_tokens":10,"stream":true}"#;
    // Held before the first token: the prompt is booked, not prefilled.
    e.set_fault(Fault::HoldAfter(0));
    let stream = tokio::spawn({
        let r = r.clone();
        async move { post(&r, "/v1/completions", body, &[]).await }
    });
    eventually("the request is booked", async || scrape(&r).await.booked().0 == 1.0).await;
    assert_eq!(scrape(&r).await.booked(), (1.0, 8.0, 2.0));
    e.release();
    let reply = stream.await.unwrap();
    assert_eq!(reply.status, 200);
    // Held after 6 tokens: prefilled, 2 + ceil(14 / 4) - 2 = 4 blocks.
    e.set_fault(Fault::None);
    let e2 = StubEngine::start(StubConfig::new("e2")).await;
    e2.set_fault(Fault::HoldAfter(6));
    let server2 = router(&[e2.url()], |c| c.block_size = 4).await;
    let r2 = url(&server2);
    let stream = tokio::spawn({
        let r2 = r2.clone();
        async move { post(&r2, "/v1/completions", body, &[]).await }
    });
    eventually("six tokens counted", async || {
        scrape(&r2).await.booked() == (1.0, 0.0, 4.0)
    })
    .await;
    e2.release();
    let reply = stream.await.unwrap();
    assert_eq!(
        reply.body(),
        answer(e2.config(), "/v1/completions", body.as_bytes()).body()
    );
    assert_eq!(wait_unbooked(&r2).await.booked(), (0.0, 0.0, 0.0));
    assert_eq!(wait_unbooked(&r).await.booked(), (0.0, 0.0, 0.0));
    server.shutdown().await;
    server2.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let mut c = StubConfig::new("b");
    c.model = "other".into();
    let b = StubEngine::start(c).await;
    let server = router(&[a.url(), b.url()], |_| {}).await;
    let r = url(&server);
    eventually("both engines' models", async || {
        get(&r, "/v1/models").await.json()["data"].as_array().map(|d| d.len()) == Some(2)
    })
    .await;
    let models = get(&r, "/v1/models").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny", "other"]);
    // Each model goes to the engine that serves it.
    for (model, engine) in [("tiny", &a), ("other", &b)] {
        for _ in 0..4 {
            let body = format!(r#"{{"model":"{model}","prompt":[1,2,3]}}"#);
            let reply = post(&r, "/v1/completions", body, &[]).await;
            assert_eq!(reply.header("x-selkie-worker"), Some(engine.url().as_str()));
        }
    }
    let health = get(&r, "/health").await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["workers"], 2);
    let s = scrape(&r).await;
    assert_eq!(s.value("selkie_workers", ""), 2.0);
    assert_eq!(s.value("selkie_limit", r#"bound="max_body_bytes""#), (16 << 20) as f64);
    assert_eq!(s.value("selkie_limit", r#"bound="max_concurrent_requests""#), 256.0);
    for family in [
        "selkie_selection_seconds",
        "selkie_inflight_requests",
        "selkie_refusals_total",
        "selkie_upstream_errors_total",
        "selkie_unhashed_requests_total",
        "selkie_request_bytes_total",
        "selkie_response_bytes_total",
        "selkie_bound_hits_total",
        "selkie_retries_total",
    ] {
        assert!(s.text.contains(family), "{family} missing:\n{}", s.text);
    }
    assert!(s.value("selkie_selection_seconds_count", "") >= 8.0, "{}", s.text);
    assert!(s.value("selkie_response_bytes_total", "") > 0.0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_without_what_they_need_are_routed_by_load_and_counted() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let server = router(&[a.url()], |c| c.policy = PolicySpec::parse("kv").unwrap()).await;
    let r = url(&server);
    let cases = [
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":"hello world"}"#,
            "no_tokenizer",
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#,
            "no_chat_template",
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":["a","b"]}"#,
            "batch_prompt",
        ),
    ];
    for (path, body, _) in cases {
        assert_eq!(post(&r, path, body, &[]).await.status, 200);
    }
    let s = wait_unbooked(&r).await;
    for (_, _, reason) in cases {
        assert_eq!(
            s.value("selkie_unhashed_requests_total", &format!(r#"reason="{reason}""#)),
            1.0,
            "{}",
            s.text
        );
    }
    server.shutdown().await;
    // Over max_prompt_tokens: routed by load, counted, the bound hit counted.
    let server = router(&[a.url()], |c| c.limits.max_prompt_tokens = 4).await;
    let r = url(&server);
    assert_eq!(
        post(&r, "/v1/completions", r#"{"model":"tiny","prompt":[1,2,3,4,5]}"#, &[])
            .await
            .status,
        200
    );
    let s = wait_unbooked(&r).await;
    assert_eq!(
        s.value("selkie_unhashed_requests_total", r#"reason="prompt_too_long""#),
        1.0
    );
    assert_eq!(s.value("selkie_bound_hits_total", r#"bound="max_prompt_tokens""#), 1.0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_may_name_its_worker() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let b = StubEngine::start(StubConfig::new("b")).await;
    let server = router(&[a.url(), b.url()], |c| c.policy = PolicySpec::parse("direct").unwrap()).await;
    let r = url(&server);
    let body = r#"{"model":"tiny","prompt":[1]}"#;
    for engine in [&a, &b, &a] {
        let reply = post(&r, "/v1/completions", body, &[("x-selkie-worker", &engine.url())]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-selkie-worker"), Some(engine.url().as_str()));
    }
    let missing = post(&r, "/v1/completions", body, &[]).await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.json()["error"]["code"], "worker_not_named");
    let unknown = post(
        &r,
        "/v1/completions",
        body,
        &[("x-selkie-worker", "http://127.0.0.1:1")],
    )
    .await;
    assert_eq!(unknown.status, 400);
    assert_eq!(unknown.json()["error"]["code"], "worker_not_named");
    assert_eq!(wait_unbooked(&r).await.booked(), (0.0, 0.0, 0.0));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_file_is_reloaded() {
    let dir = support::temp_dir("reload");
    let a = StubEngine::start(StubConfig::new("a")).await;
    let b = StubEngine::start(StubConfig::new("b")).await;
    let file = dir.join("workers.yaml");
    // A file that does not parse stops the start, naming it.
    std::fs::write(&file, "workers: [").unwrap();
    let mut c = ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        workers_file: Some(file.clone()),
        ..ServeConfig::default()
    };
    c.limits.max_connections = 64;
    c.limits.max_concurrent_requests = 64;
    let err = Server::start(c).await.err().expect("refused").to_string();
    assert!(err.contains("workers.yaml"), "{err}");
    std::fs::write(&file, format!("workers:\n  - {}\n", a.url())).unwrap();
    let server = router(&[], |c| {
        c.workers_file = Some(file.clone());
        c.discovery_interval = Duration::from_millis(50);
    })
    .await;
    let r = url(&server);
    let body = r#"{"model":"tiny","prompt":[1]}"#;
    assert_eq!(
        post(&r, "/v1/completions", body, &[]).await.header("x-selkie-worker"),
        Some(a.url().as_str())
    );
    std::fs::write(
        &file,
        format!("workers:\n  - url: {}\n    max_active_requests: 4\n", b.url()),
    )
    .unwrap();
    eventually("b replaces a", async || {
        post(&r, "/v1/completions", body, &[]).await.header("x-selkie-worker") == Some(b.url().as_str())
    })
    .await;
    // A broken file changes nothing.
    std::fs::write(&file, "workers: [").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        post(&r, "/v1/completions", body, &[]).await.header("x-selkie-worker"),
        Some(b.url().as_str())
    );
    // No workers at all: 503.
    std::fs::write(&file, "workers: []\n").unwrap();
    eventually("no workers", async || {
        post(&r, "/v1/completions", body, &[]).await.status == 503
    })
    .await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_open_streams_and_stops_accepting() {
    let mut config = StubConfig::new("slow");
    config.chunk_delay = Duration::from_millis(100);
    let e = StubEngine::start(config).await;
    let server = router(&[e.url()], |_| {}).await;
    let r = url(&server);
    let body = r#"{"model":"tiny","prompt":[1,2,3],"max_tokens":10,"stream":true}"#;
    let stream = tokio::spawn({
        let r = r.clone();
        async move { post(&r, "/v1/completions", body, &[]).await }
    });
    eventually("the stream is open", async || e.open() == 1).await;
    let addr = server.local_addr();
    server.shutdown().await;
    let reply = stream.await.unwrap();
    assert_eq!(reply.status, 200);
    assert!(reply.error.is_none(), "{:?}", reply.error);
    assert_eq!(
        reply.body(),
        answer(e.config(), "/v1/completions", body.as_bytes()).body(),
        "the open stream finished whole"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting after shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_threads_share_the_router_its_bounds_and_its_shutdown() {
    let e = StubEngine::start(StubConfig::new("a")).await;
    let server = router(&[e.url()], |c| {
        c.threads = Some(3);
        c.limits.max_concurrent_requests = 2;
    })
    .await;
    let r = url(&server);
    let body = r#"{"model":"tiny","prompt":[1,2,3],"max_tokens":4}"#;
    // Each request on a connection of its own: the kernel spreads them
    // over the three listeners.
    for _ in 0..30 {
        let reply = post(&r, "/v1/completions", body, &[]).await;
        assert_eq!(reply.status, 200, "{:?}", String::from_utf8_lossy(&reply.body()));
    }
    let s = wait_unbooked(&r).await;
    let per_thread: Vec<f64> = (0..3)
        .map(|t| s.value("selkie_http_connections_total", &format!("thread=\"{t}\"")))
        .collect();
    assert!(
        per_thread.iter().filter(|&&n| n > 0.0).count() >= 2,
        "connections by serving thread: {per_thread:?}"
    );
    assert!(per_thread.iter().sum::<f64>() >= 30.0, "{per_thread:?}");
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));

    // Two streams held by the engine fill the router's bound, whichever
    // threads took them; then every thread refuses.
    e.set_fault(Fault::HoldAfter(1));
    let stream = r#"{"model":"tiny","prompt":[1,2,3],"max_tokens":4,"stream":true}"#;
    let held: Vec<_> = (0..2)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { post(&r, "/v1/completions", stream, &[]).await })
        })
        .collect();
    eventually("the engine holds two streams", async || {
        e.open() == 2 && scrape(&r).await.booked().0 == 2.0
    })
    .await;
    for _ in 0..12 {
        let reply = post(&r, "/v1/completions", body, &[]).await;
        assert_eq!(
            reply.status, 503,
            "a thread with a bound of its own let a request through"
        );
    }
    e.release();
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(wait_unbooked(&r).await.booked(), (0.0, 0.0, 0.0));

    let addr = server.local_addr();
    server.shutdown().await;
    for _ in 0..12 {
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "a serving thread still accepts after shutdown"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_tokenizer_text_prefixes_keep_their_worker() {
    let a = StubEngine::start(StubConfig::new("tiny")).await;
    let b = StubEngine::start(StubConfig::new("tiny")).await;
    let server = router(&[a.url(), b.url()], |c| {
        c.policy = PolicySpec::parse("prefix-hash").unwrap();
        c.text_as_bytes = true;
    })
    .await;
    let r = url(&server);
    let mut seen = std::collections::BTreeMap::<usize, std::collections::BTreeSet<String>>::new();
    for round in 0..4 {
        for prefix in 0..6 {
            let system = format!("system prompt number {prefix}: ").repeat(12);
            let completion = serde_json::json!({"model": "tiny", "prompt": format!("{system}question {round}")});
            let chat = serde_json::json!({"model": "tiny", "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": format!("question {round}")}]});
            for (path, body) in [("/v1/completions", completion), ("/v1/chat/completions", chat)] {
                let reply = post(&r, path, body.to_string(), &[]).await;
                assert_eq!(reply.status, 200);
                let worker = reply.header("x-selkie-worker").unwrap().to_owned();
                seen.entry(prefix * 2 + usize::from(path.contains("chat")))
                    .or_default()
                    .insert(worker);
            }
        }
    }
    for (key, workers) in &seen {
        assert_eq!(workers.len(), 1, "prompts {key} went to {workers:?}");
    }
    let s = wait_unbooked(&r).await;
    assert_eq!(s.sum("selkie_unhashed_requests_total"), 0.0, "{}", s.text);
    assert_eq!(s.booked(), (0.0, 0.0, 0.0));
    server.shutdown().await;

    // Byte pieces stand in for a tokenizer, never beside one.
    let refused = Server::start(ServeConfig {
        workers: vec![a.url()],
        listen: "127.0.0.1:0".parse().unwrap(),
        text_as_bytes: true,
        tokenizer: Some("tokenizer.json".into()),
        ..ServeConfig::default()
    })
    .await;
    let Err(e) = refused else {
        panic!("started with both a tokenizer and text as bytes")
    };
    assert!(e.to_string().contains("--text-as-bytes"), "{e}");
}
