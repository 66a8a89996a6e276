//! `selkie serve --kv-events` end to end: publishers that connect like
//! vLLM's send recorded vLLM 0.32 messages over real ZMQ sockets; the
//! router's choices and `/metrics` show them. Gaps with and without a
//! replay endpoint (a ROUTER stub answering as vLLM's), engine restarts
//! (at sequence 0, and with their first message lost), duplicates, bad
//! frames, a block-size mismatch, and a worker that
//! refuses connections.

mod support;

use bytes::Bytes;
use selkie::router::kv_events::KvEventsSpec;
use selkie::router::PolicySpec;
use support::ports::free_port;
use support::stub_engine::{StubConfig, StubEngine};
use support::{eventually, post, router, scrape, url};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const SEQ0: &[u8] = include_bytes!("fixtures/vllm-0.32/seq-0.msgpack");
const SEQ1: &[u8] = include_bytes!("fixtures/vllm-0.32/seq-1.msgpack");
const SEQ2: &[u8] = include_bytes!("fixtures/vllm-0.32/seq-2.msgpack");
const SEQ14: &[u8] = include_bytes!("fixtures/vllm-0.32/seq-14.msgpack");
const SEQ16: &[u8] = include_bytes!("fixtures/vllm-0.32/seq-16.msgpack");

fn message(frames: Vec<Vec<u8>>) -> ZmqMessage {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).unwrap()
}

fn frames(seq: u64, payload: &[u8]) -> ZmqMessage {
    message(vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()])
}

/// A recorded message with its timestamp replaced: what another engine
/// process sends for the same events.
fn restamped(payload: &[u8], ts: f64) -> Vec<u8> {
    let rmpv::Value::Array(mut fields) = rmpv::decode::read_value(&mut &payload[..]).unwrap() else {
        panic!("a payload is an array")
    };
    fields[0] = rmpv::Value::F64(ts);
    let v = rmpv::Value::Array(fields);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

/// The tokens of the first recorded prompt (512 tokens, 16 blocks of 32).
fn prompt_tokens() -> Vec<u64> {
    let v = rmpv::decode::read_value(&mut &SEQ0[..]).unwrap();
    let event = &v.as_array().unwrap()[1].as_array().unwrap()[0];
    let map = event.as_map().unwrap();
    let tokens = map.iter().find(|(k, _)| k.as_str() == Some("token_ids")).unwrap();
    tokens
        .1
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// A vLLM-like replay socket: answers a start sequence number with the
/// messages it has from there, then the end marker.
async fn replay_stub(port: u16, messages: Vec<(u64, &'static [u8])>) {
    let mut s = zeromq::RouterSocket::new();
    s.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    tokio::spawn(async move {
        while let Ok(request) = s.recv().await {
            let f = request.into_vec();
            let id = f[0].clone();
            let start = u64::from_be_bytes(f[2].as_ref().try_into().unwrap());
            for (seq, payload) in messages.iter().filter(|(s, _)| *s >= start) {
                let reply = vec![
                    id.to_vec(),
                    vec![],
                    b"kv".to_vec(),
                    seq.to_be_bytes().to_vec(),
                    payload.to_vec(),
                ];
                s.send(message(reply)).await.unwrap();
            }
            let end = vec![
                id.to_vec(),
                vec![],
                b"kv".to_vec(),
                u64::MAX.to_be_bytes().to_vec(),
                vec![],
            ];
            s.send(message(end)).await.unwrap();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_over_zmq_drive_overlaps_and_metrics() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let b = StubEngine::start(StubConfig::new("b")).await;
    let (pa, pb, pr) = (free_port(), free_port(), free_port());
    replay_stub(pr, vec![(1, SEQ1), (2, SEQ16)]).await;
    let specs = vec![
        KvEventsSpec::parse(&format!("{}=tcp://127.0.0.1:{pa},mode=bind", a.url())).unwrap(),
        KvEventsSpec::parse(&format!(
            "{}=tcp://127.0.0.1:{pb},mode=bind,replay=tcp://127.0.0.1:{pr},topic=kv",
            b.url()
        ))
        .unwrap(),
    ];
    let server = router(&[a.url(), b.url()], |c| {
        c.policy = PolicySpec::parse("kv").unwrap();
        c.block_size = 32;
        c.kv_events = specs;
    })
    .await;
    let r = url(&server);
    // The engines connect, as vLLM's publisher does when its endpoint
    // names a host.
    let mut pub_a = zeromq::PubSocket::new();
    pub_a.connect(&format!("tcp://127.0.0.1:{pa}")).await.unwrap();
    let mut pub_b = zeromq::PubSocket::new();
    pub_b.connect(&format!("tcp://127.0.0.1:{pb}")).await.unwrap();
    let (la, lb) = (a.url(), b.url());
    let refused = |w: &str, reason: &str| format!("worker=\"{w}\",reason=\"{reason}\"");
    // Bad frames (a single frame) until both subscriptions are up: counted,
    // the subscribers go on.
    eventually("bad frames counted", async || {
        pub_a.send(message(vec![b"kv".to_vec()])).await.unwrap();
        pub_b.send(message(vec![b"kv".to_vec()])).await.unwrap();
        let s = scrape(&r).await;
        s.value("selkie_kv_events_refused_total", &refused(&la, "frame_count")) >= 1.0
            && s.value("selkie_kv_events_refused_total", &refused(&lb, "frame_count")) >= 1.0
    })
    .await;
    pub_b.send(frames(0, b"\x93\xcb")).await.unwrap();

    // Engine b stores the prompt's 16 blocks: the kv policy sends the
    // prompt there, every time.
    pub_b.send(frames(0, SEQ0)).await.unwrap();
    eventually("b's blocks indexed", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 16.0
    })
    .await;
    let body =
        serde_json::json!({"model": a.config().model.clone(), "prompt": prompt_tokens(), "max_tokens": 1}).to_string();
    for _ in 0..4 {
        let reply = post(&r, "/v1/completions", body.clone(), &[]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header("x-selkie-worker"),
            Some(lb.as_str()),
            "the engine holding the prefix"
        );
        // All 16 blocks of 32 tokens predicted cached there.
        assert_eq!(reply.header("x-selkie-predicted-cached-tokens"), Some("512"));
    }
    let s = scrape(&r).await;
    assert_eq!(s.value("selkie_kv_events_refused_total", &refused(&lb, "msgpack")), 1.0);
    assert_eq!(
        s.value(
            "selkie_kv_events_received_total",
            &format!("worker=\"{lb}\",event=\"stored\"")
        ),
        1.0
    );
    assert_eq!(
        s.value("selkie_kv_events_messages_total", &format!("worker=\"{lb}\"")),
        1.0
    );

    // Engine a: the same blocks, then a gap (seq 5 after 0) with no replay
    // endpoint: a's blocks stop counting.
    pub_a.send(frames(0, SEQ0)).await.unwrap();
    eventually("a's blocks indexed", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 32.0
    })
    .await;
    pub_a.send(frames(5, SEQ14)).await.unwrap();
    eventually("a's gap drops a's blocks", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 16.0
    })
    .await;
    let s = scrape(&r).await;
    let wa = format!("worker=\"{la}\"");
    assert_eq!(s.value("selkie_kv_events_gaps_total", &wa), 1.0);
    assert_eq!(s.value("selkie_kv_events_replay_failures_total", &wa), 1.0);

    // Engine b: a gap (seq 3 after 0) filled from its replay endpoint:
    // seq 1 stores 8 blocks, seq 2 removes one, seq 3 removes another.
    pub_b.send(frames(3, SEQ14)).await.unwrap();
    eventually("b's gap replayed", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 22.0
    })
    .await;
    let s = scrape(&r).await;
    let wb = format!("worker=\"{lb}\"");
    assert_eq!(s.value("selkie_kv_events_gaps_total", &wb), 1.0);
    assert_eq!(s.value("selkie_kv_events_replayed_total", &wb), 2.0);
    assert_eq!(s.value("selkie_kv_events_replay_failures_total", &wb), 0.0);

    // Engine b restarts: sequence 0 again, its old blocks are gone (this
    // store's parent with them: refused by the index).
    pub_b.send(frames(0, SEQ2)).await.unwrap();
    eventually("b's restart", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 0.0
    })
    .await;
    assert_eq!(scrape(&r).await.value("selkie_kv_events_restarts_total", &wb), 1.0);

    // The restarted process stores the prompt again (message 1); then it
    // restarts once more, and its message 0 goes out before the router's
    // socket joins: the first one heard is 1 again, with other bytes. A
    // restart, not a duplicate: b's blocks are dropped.
    pub_b.send(frames(1, SEQ0)).await.unwrap();
    eventually("b's store after its restart", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 16.0
    })
    .await;
    pub_b.send(frames(1, SEQ1)).await.unwrap();
    eventually("b's second restart, its message 0 lost", async || {
        scrape(&r).await.value("selkie_kv_events_restarts_total", &wb) == 2.0
    })
    .await;
    // The same message read twice is a duplicate, not a third restart.
    pub_b.send(frames(1, SEQ1)).await.unwrap();
    eventually("b's duplicate", async || {
        scrape(&r).await.value("selkie_kv_events_duplicates_total", &wb) == 1.0
    })
    .await;
    let s = scrape(&r).await;
    assert_eq!(s.value("selkie_kv_events_restarts_total", &wb), 2.0);
    // Message 1's store chains under a parent of the process before: gone.
    assert_eq!(
        s.value("selkie_kv_index_blocks", ""),
        0.0,
        "the blocks before the restart are dropped"
    );

    // A store of 16-token blocks to a router of 32: refused, counted.
    let other = rmpv::Value::Array(vec![
        rmpv::Value::F64(0.0),
        rmpv::Value::Array(vec![rmpv::Value::Array(vec![
            "BlockStored".into(),
            rmpv::Value::Array(vec![1.into()]),
            rmpv::Value::Nil,
            rmpv::Value::Array((0..16).map(rmpv::Value::from).collect()),
            16.into(),
        ])]),
        0.into(),
    ]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(&mut payload, &other).unwrap();
    pub_a.send(frames(6, &payload)).await.unwrap();
    eventually("block size mismatch counted", async || {
        scrape(&r)
            .await
            .value("selkie_kv_events_refused_total", &refused(&la, "block_size"))
            == 1.0
    })
    .await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_file_labels_name_event_endpoints() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let port = free_port();
    let dir = support::temp_dir("kv-events-labels");
    let file = dir.join("workers.yaml");
    let entry = |port: u16| {
        format!(
            "workers:\n  - url: {}\n    labels:\n      kv_events: \"tcp://127.0.0.1:{port},mode=bind\"\n",
            a.url()
        )
    };
    std::fs::write(&file, entry(port)).unwrap();
    let server = router(&[], |c| {
        c.policy = PolicySpec::parse("kv").unwrap();
        c.block_size = 32;
        c.workers_file = Some(file.clone());
    })
    .await;
    let r = url(&server);
    let mut publisher = zeromq::PubSocket::new();
    publisher.connect(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    let mut seq = 0;
    eventually("the labelled endpoint's events indexed", async || {
        // Resent until the subscription is up (a new engine each time:
        // sequence 0 starts it clean).
        publisher.send(frames(0, SEQ0)).await.unwrap();
        seq += 1;
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 16.0
    })
    .await;
    assert!(seq >= 1);
    // The label goes away: the endpoint is closed (its port can be bound
    // again).
    drop(publisher);
    std::fs::write(&file, format!("workers:\n  - url: {}\n", a.url())).unwrap();
    eventually("the endpoint closed", async || {
        std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
    })
    .await;
    server.shutdown().await;
}

/// A router that does not use KV events (none named at start, or text
/// hashed as bytes) does not follow a label the workers file adds later:
/// it counts the worker in `selkie_kv_events_labels_unused` and leaves the
/// endpoint alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_added_to_a_router_without_kv_events_are_counted_not_followed() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    for text_as_bytes in [false, true] {
        let port = free_port();
        let dir = support::temp_dir(&format!("kv-events-unused-{text_as_bytes}"));
        let file = dir.join("workers.yaml");
        let plain = format!("workers:\n  - url: {}\n", a.url());
        std::fs::write(&file, &plain).unwrap();
        let server = router(&[], |c| {
            c.policy = PolicySpec::parse("kv").unwrap();
            c.block_size = 32;
            c.workers_file = Some(file.clone());
            c.text_as_bytes = text_as_bytes;
        })
        .await;
        let r = url(&server);
        assert_eq!(scrape(&r).await.value("selkie_kv_events_labels_unused", ""), 0.0);
        std::fs::write(
            &file,
            format!("{plain}    labels:\n      kv_events: \"tcp://127.0.0.1:{port},mode=bind\"\n"),
        )
        .unwrap();
        eventually("the label counted as unused", async || {
            scrape(&r).await.value("selkie_kv_events_labels_unused", "") == 1.0
        })
        .await;
        // Not followed: nothing bound the endpoint's port.
        tokio::time::sleep(2 * selkie::router::kv_events::LABEL_POLL_PERIOD).await;
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "text as bytes {text_as_bytes}: the router opened the endpoint"
        );
        std::fs::write(&file, &plain).unwrap();
        eventually("the label gone", async || {
            scrape(&r).await.value("selkie_kv_events_labels_unused", "") == 0.0
        })
        .await;
        server.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refusing_connections_loses_its_blocks() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    // Nothing listens at `dead`: an engine that died after telling its
    // blocks.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let pd = free_port();
    let specs = vec![KvEventsSpec::parse(&format!("{dead}=tcp://127.0.0.1:{pd},mode=bind")).unwrap()];
    let server = router(&[a.url(), dead.clone()], |c| {
        c.policy = PolicySpec::parse("kv").unwrap();
        c.block_size = 32;
        c.kv_events = specs;
    })
    .await;
    let r = url(&server);
    let mut publisher = zeromq::PubSocket::new();
    publisher.connect(&format!("tcp://127.0.0.1:{pd}")).await.unwrap();
    eventually("the dead engine's blocks indexed", async || {
        publisher.send(frames(0, SEQ0)).await.unwrap();
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 16.0
    })
    .await;
    let body =
        serde_json::json!({"model": a.config().model.clone(), "prompt": prompt_tokens(), "max_tokens": 1}).to_string();
    // Chosen for its blocks, refused, retried on a: no prediction for a.
    let reply = post(&r, "/v1/completions", body.clone(), &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-selkie-worker"), Some(a.url().as_str()));
    assert_eq!(reply.header("x-selkie-predicted-cached-tokens"), None);
    eventually("the dead engine's blocks dropped", async || {
        scrape(&r).await.value("selkie_kv_index_blocks", "") == 0.0
    })
    .await;
    assert_eq!(
        scrape(&r)
            .await
            .value("selkie_kv_events_unreachable_total", &format!("worker=\"{dead}\"")),
        1.0
    );
    // Nothing is predicted cached anywhere now (a choice of the dead
    // engine is retried on a, without a prediction).
    for _ in 0..4 {
        let reply = post(&r, "/v1/completions", body.clone(), &[]).await;
        assert_eq!(reply.header("x-selkie-worker"), Some(a.url().as_str()));
        assert_ne!(reply.header("x-selkie-predicted-cached-tokens"), Some("512"));
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connecting_subscriber_waits_for_the_engine_and_follows_its_restart() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let port = free_port();
    // The engine binds (its endpoint names `*`); the router connects, and
    // starts before the engine is up.
    let specs = vec![KvEventsSpec::parse(&format!("{}=tcp://127.0.0.1:{port},mode=connect", a.url())).unwrap()];
    let server = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        router(&[a.url()], |c| {
            c.policy = PolicySpec::parse("kv").unwrap();
            c.block_size = 32;
            c.kv_events = specs;
        }),
    )
    .await
    .expect("the router started while the engine's endpoint was down");
    let r = url(&server);
    let wa = format!("worker=\"{}\"", a.url());
    let mut seen = 0.0;
    for life in 1..=2 {
        // The port of the process before may linger a moment (the zeromq
        // crate binds without SO_REUSEADDR): bind until it is free.
        let mut engine = zeromq::PubSocket::new();
        eventually(&format!("engine process {life} bound"), async || {
            let bound = engine.bind(&format!("tcp://127.0.0.1:{port}")).await.is_ok();
            if !bound {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            bound
        })
        .await;
        eventually(&format!("engine process {life}'s store indexed"), async || {
            // Sequence 0 (each process numbers from 0, with its own
            // timestamps), resent until the router has connected and
            // subscribed.
            engine.send(frames(0, &restamped(SEQ0, f64::from(life)))).await.unwrap();
            let s = scrape(&r).await;
            s.value("selkie_kv_index_blocks", "") == 16.0 && s.value("selkie_kv_events_messages_total", &wa) > seen
        })
        .await;
        seen = scrape(&r).await.value("selkie_kv_events_messages_total", &wa);
        // The engine process ends; a new one binds the same endpoint.
        let _ = engine.close().await;
    }
    server.shutdown().await;
}
