//! `selkie serve` as the process users run: options checked at start,
//! graceful shutdown on SIGTERM (exit 0), and 10,000 streams open at once.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::stub_engine::{answer, Fault, StubConfig, StubEngine};
use support::{eventually, post, scrape, wait_unbooked};

/// A `selkie serve` process and the URL it listens on.
struct Router {
    child: Child,
    url: String,
}

impl Router {
    /// Starts `selkie serve --port 0 ARGS` and waits for its address.
    fn start(args: &[&str]) -> Router {
        let mut child = Command::new(env!("CARGO_BIN_EXE_selkie"))
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start selkie serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("selkie serve exited before listening").unwrap();
            if let Some(rest) = line.strip_prefix("selkie serve: listening on ") {
                break rest.split(' ').next().unwrap().to_owned();
            }
        };
        // Keep draining its stderr so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Router { child, url }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args(["-s", name, &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -s {name}");
    }

    /// Waits up to `limit` for the process to exit; its status code.
    fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Resident memory, from /proc (Linux), in KiB.
    fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `selkie serve ARGS`'s exit code and stderr, for options refused at start.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_selkie"))
        .args(["serve", "--port", "0"])
        .args(args)
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn options_are_checked_at_start() {
    let (code, err) = refused(&[]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no workers"), "{err}");
    let w = ["--worker", "http://127.0.0.1:9"];
    for (args, needle) in [
        (&["--block-size", "3"][..], "--block-size = 3"),
        (&["--max-body-bytes", "0"][..], "--max-body-bytes = 0"),
        (&["--connect-timeout", "0"][..], "--connect-timeout = 0"),
        (&["--max-connections", "4000000"][..], "open files"),
        (&["--policy", "fastest"][..], "least-loaded"),
        (&["--policy", "kv:{router_temperature: -1}"][..], "router_temperature"),
        (
            &["--tokenizer", "/nonexistent/tokenizer.json"][..],
            "tokenizer /nonexistent/tokenizer.json",
        ),
    ] {
        let all: Vec<&str> = w.iter().chain(args).copied().collect();
        let (code, err) = refused(&all);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} does not say {needle:?}");
    }
    let (code, err) = refused(&["--worker", "https://127.0.0.1:9"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("the scheme must be http"), "{err}");
    let (code, err) = refused(&["--worker", "http://127.0.0.1:9", "--connect-timeout", "-1"]);
    assert_eq!(code, Some(2), "clap refuses it: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_open_streams_then_exits_0() {
    let mut config = StubConfig::new("slow");
    config.chunk_delay = Duration::from_millis(100);
    let e = StubEngine::start(config).await;
    let mut router = Router::start(&["--worker", &e.url(), "--shutdown-timeout", "10"]);
    let url = router.url.clone();
    let body = r#"{"model":"tiny","prompt":[1,2,3],"max_tokens":12,"stream":true}"#;
    let stream = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "/v1/completions", body, &[]).await }
    });
    eventually("the stream is open", async || e.open() == 1).await;
    router.signal("TERM");
    let reply = stream.await.unwrap();
    assert_eq!(reply.status, 200);
    assert!(reply.error.is_none(), "{:?}", reply.error);
    assert_eq!(
        reply.body(),
        answer(e.config(), "/v1/completions", body.as_bytes()).body()
    );
    assert_eq!(
        router.wait(Duration::from_secs(5)),
        Some(0),
        "exit status after SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cuts_streams_past_the_deadline_and_exits_0() {
    let e = StubEngine::start(StubConfig::new("held")).await;
    e.set_fault(Fault::HoldAfter(1));
    let mut router = Router::start(&["--worker", &e.url(), "--shutdown-timeout", "0.5"]);
    // The client holds the head and the first event before the signal: a
    // stream whose head has not reached the client by the deadline is cut
    // too, but then the client sees no response at all.
    let request = hyper::Request::post(format!("{}/v1/completions", router.url))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"tiny","prompt":[1,2,3],"stream":true}"#,
        )))
        .unwrap();
    let response = support::client().request(request).await.expect("the stream's head");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a first event").expect("a first event");
    assert!(first.is_data());
    assert_eq!(e.open(), 1);
    let signalled = Instant::now();
    router.signal("TERM");
    assert_eq!(router.wait(Duration::from_secs(5)), Some(0));
    let took = signalled.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "exited after {took:?}"
    );
    let rest = tokio::time::timeout(Duration::from_secs(5), body.collect())
        .await
        .expect("the body ends once the router exits");
    assert!(rest.is_err(), "the held stream was cut, not ended");
    eventually("the engine's connection closed", async || e.open() == 0).await;
}

/// 10,000 streams through one router process at once: each is booked
/// while open, each ends byte-identical, and the bookings go back to 0.
/// Clients speak HTTP/2 to the router (16 connections), so the router
/// holds 10,000 connections to the engine and few from clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_concurrent_streams() {
    const STREAMS: usize = 10_000;
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    if limit < STREAMS as u64 + 1024 {
        support_skip(&format!(
            "the open-files limit is {limit}: 10,000 streams need about 11,000"
        ));
        return;
    }
    let e = StubEngine::start(StubConfig::new("e")).await;
    e.set_fault(Fault::HoldAfter(1));
    let router = Router::start(&[
        "--worker",
        &e.url(),
        "--policy",
        "least-loaded",
        "--max-concurrent-requests",
        "10000",
        "--max-connections",
        "256",
        "--max-streams-per-connection",
        "1024",
        "--max-idle-per-worker",
        "16",
    ]);
    let url = router.url.clone();
    let clients: Vec<_> = (0..16)
        .map(|_| {
            Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http::<Full<Bytes>>()
        })
        .collect();
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(STREAMS);
    for i in 0..STREAMS {
        let client = clients[i % clients.len()].clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let body = format!(r#"{{"model":"tiny","prompt":[{i},1,2],"max_tokens":3,"stream":true}}"#);
            let request = hyper::Request::post(format!("{url}/v1/completions"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.clone())))
                .unwrap();
            let response = client.request(request).await.expect("a stream");
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("the whole stream")
                .to_bytes();
            (status, body, bytes)
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = scrape(&router.url).await;
        if s.value("selkie_open_responses", "") as usize == STREAMS {
            assert_eq!(s.booked().0 as usize, STREAMS, "every open stream is booked");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {STREAMS} streams opened",
            s.value("selkie_open_responses", "")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let opened = started.elapsed();
    assert_eq!(e.open() as usize, STREAMS);
    let rss = router.rss_kib();
    eprintln!("{STREAMS} streams open after {opened:?}; router RSS {rss:?} KiB");
    e.release();
    for t in tasks {
        let (status, body, bytes) = t.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            bytes.as_ref(),
            answer(e.config(), "/v1/completions", body.as_bytes()).body().as_slice()
        );
    }
    let s = wait_unbooked(&router.url).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0), "{}", s.text);
    assert_eq!(
        s.value("selkie_http_requests_total", r#"endpoint="completions",status="200""#) as usize,
        STREAMS
    );
    assert_eq!(s.sum("selkie_refusals_total"), 0.0);
}

fn support_skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\nSKIPPED: {why}");
}
