//! Replica sync against a real nats-server (feature `nats`).
//!
//! Most tests use the server named by `SELKIE_NATS_URL` (`.ci/run` starts
//! one), each on a subject of its own; the restart test runs its own
//! `nats-server` (`SELKIE_NATS_BIN`, or `nats-server` on the PATH) so that
//! it can kill and restart it. Without them a test prints a `SKIPPED:` line
//! (to the real stderr, past the test harness's capture) and returns.
//! Every wait is bounded by a deadline.

mod servers;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use selkie::*;

/// Short intervals, so that the tests run in a second or two.
fn fast(subject: &str) -> ReplicaSyncOptions {
    ReplicaSyncOptions::default()
        .with_subject(subject)
        .with_batch_interval(Duration::from_millis(2))
        .with_heartbeat_interval(Duration::from_millis(50))
        .with_peer_timeout(Duration::from_millis(600))
        .with_connect_timeout(Duration::from_secs(5))
        .with_max_reconnect_delay(Duration::from_millis(100))
}

fn load(requests: u64, prefill_tokens: u64, decode_blocks: u64) -> RemoteLoad {
    RemoteLoad {
        requests,
        prefill_tokens,
        decode_blocks,
    }
}

/// The load a set of outstanding bookings (worker, prefill, decode) adds up
/// to, non-zero ranks only, in order: what a peer's `remote_loads` must
/// equal.
fn expected(bookings: &BTreeMap<u64, (WorkerWithDpRank, u32, u32)>) -> Vec<(WorkerWithDpRank, RemoteLoad)> {
    let mut sum: BTreeMap<WorkerWithDpRank, RemoteLoad> = BTreeMap::new();
    for &(w, p, d) in bookings.values() {
        let l = sum.entry(w).or_default();
        l.requests += 1;
        l.prefill_tokens += u64::from(p);
        l.decode_blocks += u64::from(d);
    }
    sum.into_iter().collect()
}

const LONG: Duration = Duration::from_secs(10);

#[test]
fn an_unreachable_server_is_a_typed_error_naming_it() {
    // A loopback port nobody listens on (bound, then released).
    let port = servers::ports::free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let options = ReplicaSyncOptions::default().with_connect_timeout(Duration::from_secs(2));
    let err = ReplicaSync::connect(&url, options).unwrap_err();
    assert!(
        matches!(&err, SyncError::Unavailable { server, .. } if *server == url),
        "{err}"
    );
    assert!(err.to_string().starts_with(&format!("NATS server {url}: ")), "{err}");
    let err = ReplicaSync::connect(&url, ReplicaSyncOptions::default().with_subject("a.*")).unwrap_err();
    assert!(
        matches!(err, SyncError::InvalidOption { option: "subject", .. }),
        "{err}"
    );
    let err = ReplicaSync::connect(
        &url,
        ReplicaSyncOptions::default()
            .with_heartbeat_interval(Duration::from_secs(2))
            .with_peer_timeout(Duration::from_secs(1)),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            SyncError::InvalidOption {
                option: "peer_timeout",
                ..
            }
        ),
        "{err}"
    );
}

/// Options out of range are refused by `connect` before anything starts,
/// naming the option and its bound: none of them may reach the thread
/// (a zero batch interval panicked it), the queue (a capacity that rounds
/// to nothing dropped every delta) or an allocation (a batch capacity of
/// `usize::MAX` panicked `connect`).
#[test]
fn out_of_range_options_are_refused_naming_the_option_and_its_bound() {
    // Nobody listens there: an option that passed validation would be
    // refused as `Unavailable` instead.
    let url = format!("nats://127.0.0.1:{}", servers::ports::free_port());
    let base = || ReplicaSyncOptions::default().with_connect_timeout(Duration::from_millis(200));
    let cases: Vec<(&str, ReplicaSyncOptions, &str)> = vec![
        (
            "batch_interval",
            base().with_batch_interval(Duration::ZERO),
            "at least 100µs",
        ),
        (
            "batch_interval",
            base().with_batch_interval(Duration::MAX),
            "at most 10s",
        ),
        (
            "batch_max_events",
            base().with_batch_max_events(usize::MAX),
            "at most 8192",
        ),
        ("batch_max_events", base().with_batch_max_events(0), "at least 1"),
        (
            "queue_capacity",
            base().with_queue_capacity(usize::MAX),
            "at most 1048576",
        ),
        ("queue_capacity", base().with_queue_capacity(0), "at least 1"),
        (
            "heartbeat_interval",
            base().with_heartbeat_interval(Duration::MAX),
            "at most 3600s",
        ),
        (
            "peer_timeout",
            base()
                .with_heartbeat_interval(Duration::from_secs(1))
                .with_peer_timeout(Duration::MAX),
            "at most 3600s",
        ),
        (
            "connect_timeout",
            base().with_connect_timeout(Duration::ZERO),
            "more than zero",
        ),
        (
            "max_reconnect_delay",
            base().with_max_reconnect_delay(Duration::MAX),
            "at most 3600s",
        ),
    ];
    let mut wrong = Vec::new();
    for (option, options, bound) in cases {
        let got = std::panic::catch_unwind(|| ReplicaSync::connect(&url, options.clone()).map(drop));
        match got {
            Ok(Err(SyncError::InvalidOption {
                option: named,
                requirement,
                value,
            })) if named == option && requirement.contains(bound) => {
                assert!(!value.is_empty(), "{option}: the value is named");
            }
            Ok(Err(err)) => wrong.push(format!("{option} ({bound}): refused as: {err}")),
            Ok(Ok(())) => wrong.push(format!("{option} ({bound}): accepted")),
            Err(_) => wrong.push(format!("{option} ({bound}): connect panicked")),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_booking_appears_at_the_peer_and_leaves_on_release() {
    let Some(url) = servers::nats_url("a_booking_appears_at_the_peer_and_leaves_on_release") else {
        return;
    };
    let subject = servers::unique_subject("book");
    let a = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let b = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    assert_ne!(a.replica_id(), b.replica_id());
    let w = WorkerWithDpRank::new(7, 1);
    let v0 = b.version();
    assert!(a.record_book(1, w, 1000, 8));
    servers::wait_until("B sees A's booking", LONG, || b.remote_load(w) == load(1, 1000, 8));
    assert!(b.version() > v0);
    assert_eq!(b.remote_loads(), [(w, load(1, 1000, 8))]);
    assert_eq!(
        a.remote_load(w),
        RemoteLoad::default(),
        "a replica ignores its own messages"
    );

    assert!(a.record_prefill_complete(1));
    servers::wait_until("B sees the prefill complete", LONG, || {
        b.remote_load(w) == load(1, 0, 8)
    });

    // B's own booking reaches A; B's view of A is unchanged.
    assert!(b.record_book(9, w, 10, 1));
    servers::wait_until("A sees B's booking", LONG, || a.remote_load(w) == load(1, 10, 1));
    assert_eq!(b.remote_load(w), load(1, 0, 8));

    assert!(a.record_release(1));
    servers::wait_until("B sees the release", LONG, || b.remote_loads().is_empty());
    // A release of a booking A no longer holds is not even published.
    assert!(a.record_release(1));
    assert!(a.record_release(12345));
    assert!(a.record_book(2, w, 1, 1));
    servers::wait_until("B sees booking 2", LONG, || b.remote_load(w) == load(1, 1, 1));
    // A counts a batch once the client took it, which B may beat.
    servers::wait_until("A counts its deltas", LONG, || a.stats().published_events == 4);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.published_events, 4, "book, prefill, release, book: {sa:?}");
    // B's subscription may reach the server after A's first batch: B's
    // snapshot of A (asked for at start) then holds it, and B applies the
    // other three (its load above is the same either way).
    assert_eq!((sb.unknown, sb.peers), (0, 1), "{sb:?}");
    assert!(
        sb.applied == 4 || (sb.applied == 3 && sb.snapshots_received >= 1),
        "every delta applied once, or covered by a snapshot: {sb:?}"
    );
    assert_eq!(sa.dropped + sb.dropped, 0);
}

#[test]
fn batches_carry_every_delta_exactly_once() {
    let Some(url) = servers::nats_url("batches_carry_every_delta_exactly_once") else {
        return;
    };
    let subject = servers::unique_subject("batches");
    let a = ReplicaSync::connect(&url, fast(&subject).with_batch_max_events(16)).unwrap();
    let b = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let mut outstanding = BTreeMap::new();
    let mut deltas = 0u64;
    for id in 0..3000u64 {
        let w = WorkerWithDpRank::new(id % 5, (id % 2) as u32);
        let (p, d) = (100 + (id % 7) as u32, 1 + (id % 3) as u32);
        assert!(a.record_book(id, w, p, d));
        outstanding.insert(id, (w, p, d));
        deltas += 1;
        if id % 3 == 0 {
            assert!(a.record_prefill_complete(id));
            outstanding.get_mut(&id).unwrap().1 = 0;
            deltas += 1;
        }
        if id % 4 == 1 {
            assert!(a.record_release(id));
            outstanding.remove(&id);
            deltas += 1;
        }
    }
    servers::wait_until("B applied every delta", LONG, || b.stats().applied == deltas);
    assert_eq!(b.remote_loads(), expected(&outstanding));
    servers::wait_until("A counts its deltas", LONG, || a.stats().published_events == deltas);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.published_events, deltas, "{sa:?}");
    assert!(
        sa.published_batches >= deltas.div_ceil(16) && sa.published_batches < deltas,
        "{deltas} deltas in batches of at most 16 took {} batches",
        sa.published_batches
    );
    assert_eq!((sa.dropped, sb.skipped, sb.unknown), (0, 0, 0), "{sa:?} {sb:?}");
}

#[test]
fn a_full_queue_drops_and_counts_without_blocking() {
    let Some(url) = servers::nats_url("a_full_queue_drops_and_counts_without_blocking") else {
        return;
    };
    let subject = servers::unique_subject("full");
    let a = ReplicaSync::connect(&url, fast(&subject).with_queue_capacity(4)).unwrap();
    let b = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let w = WorkerWithDpRank::new(3, 0);
    let total = 20_000u64;
    let start = Instant::now();
    let queued = (0..total).filter(|&id| a.record_book(id, w, 1, 1)).count() as u64;
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "{total} record_book calls took {took:?}");
    let dropped = a.stats().dropped;
    assert!(dropped > 0, "a queue of 4 never filled in {total} calls");
    assert_eq!(queued + dropped, total, "every delta is queued or counted as dropped");
    servers::wait_until("B has every queued booking", LONG, || {
        b.remote_load(w).requests == queued
    });
    servers::wait_until("A counts every queued booking as published", LONG, || {
        a.stats().published_events == queued
    });
}

#[test]
fn a_silent_peer_is_expired_within_the_timeout() {
    let Some(url) = servers::nats_url("a_silent_peer_is_expired_within_the_timeout") else {
        return;
    };
    let subject = servers::unique_subject("expiry");
    let timeout = Duration::from_millis(600);
    let a = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let b = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let w = WorkerWithDpRank::new(1, 0);
    for id in 0..3 {
        a.record_book(id, w, 10, 1);
    }
    servers::wait_until("B sees A's bookings", LONG, || b.remote_load(w) == load(3, 30, 3));
    assert_eq!(b.stats().peers, 1);
    // A stops: no release, no heartbeat.
    drop(a);
    let stopped = Instant::now();
    std::thread::sleep(timeout / 3);
    let (early, at) = (b.remote_load(w), stopped.elapsed());
    // A's last heartbeat may be up to one interval (50 ms) before the drop;
    // a check this thread made late (a busy machine) proves nothing.
    if at < timeout - Duration::from_millis(100) {
        assert_eq!(
            early,
            load(3, 30, 3),
            "expired {at:?} after A stopped, before the timeout"
        );
    }
    servers::wait_until("B expires silent A", LONG, || b.remote_loads().is_empty());
    let took = stopped.elapsed();
    // A's last heartbeat may be up to one interval before the drop; B checks
    // once per interval; allow scheduling slack on a busy machine.
    assert!(
        took < timeout + Duration::from_millis(50) * 2 + Duration::from_millis(700),
        "expired after {took:?}, timeout {timeout:?}"
    );
    let s = b.stats();
    assert_eq!((s.peers_expired, s.peers), (1, 0), "{s:?}");
}

#[test]
fn a_late_replica_gets_existing_loads_by_snapshot() {
    let Some(url) = servers::nats_url("a_late_replica_gets_existing_loads_by_snapshot") else {
        return;
    };
    let subject = servers::unique_subject("late");
    // Heartbeats far apart: only the start-up snapshot request can bring
    // the late replica up to date in time. The queue holds the whole burst
    // recorded below (30,000 deltas at once).
    let slow = |s: &str| {
        fast(s)
            .with_heartbeat_interval(Duration::from_secs(20))
            .with_peer_timeout(Duration::from_secs(60))
            .with_queue_capacity(1 << 15)
    };
    let a = ReplicaSync::connect(&url, slow(&subject)).unwrap();
    let b = ReplicaSync::connect(&url, slow(&subject)).unwrap();
    // More bookings than fit one message of the server's (default 1 MiB)
    // payload: the snapshot comes in parts.
    let mut from_a = BTreeMap::new();
    let mut events = 0;
    for id in 0..25_000u64 {
        let w = WorkerWithDpRank::new(id % 11, 0);
        assert!(a.record_book(id, w, 1 + id as u32 % 1000, 2));
        from_a.insert(id, (w, 1 + id as u32 % 1000, 2));
        events += 1;
        if id % 5 == 0 {
            assert!(a.record_release(id));
            from_a.remove(&id);
            events += 1;
        }
    }
    let mut from_b = BTreeMap::new();
    for id in 0..3u64 {
        let w = WorkerWithDpRank::new(100, id as u32);
        assert!(b.record_book(id, w, 5, 5));
        from_b.insert(id, (w, 5, 5));
    }
    servers::wait_until("A's and B's deltas are out", LONG, || {
        a.stats().published_events == events && b.stats().published_events == 3
    });
    servers::wait_until("B has A's bookings", LONG, || b.remote_loads() == expected(&from_a));

    let c = ReplicaSync::connect(&url, slow(&subject)).unwrap();
    let mut both = from_a.clone();
    both.extend(from_b.iter().map(|(id, b)| (id + 1_000_000, *b)));
    servers::wait_until("the late replica has both peers' loads", Duration::from_secs(5), || {
        c.remote_loads() == expected(&both)
    });
    let s = c.stats();
    assert_eq!((s.snapshots_received, s.peers, s.applied), (2, 2, 0), "{s:?}");
    assert_eq!(a.stats().published_events, events, "no new deltas were needed");
}

#[test]
fn a_server_restart_keeps_recording_fast_and_peers_converge_again() {
    let Some(mut nats) = servers::OwnNats::find() else {
        servers::skip("a_server_restart_keeps_recording_fast_and_peers_converge_again: needs a nats-server binary (SELKIE_NATS_BIN or `nats-server` on the PATH; Debian: nats-server)");
        return;
    };
    nats.start();
    let url = nats.url();
    let subject = servers::unique_subject("restart");
    // The outage below is shorter than the peer timeout: the loads come
    // back by snapshot, not by expiry and rejoining.
    let options = fast(&subject).with_peer_timeout(Duration::from_secs(30));
    let a = ReplicaSync::connect(&url, options.clone()).unwrap();
    let b = ReplicaSync::connect(&url, options).unwrap();
    let mut from_a = BTreeMap::new();
    for id in 0..10u64 {
        let w = WorkerWithDpRank::new(id % 3, 0);
        a.record_book(id, w, 100, 1);
        from_a.insert(id, (w, 100, 1));
    }
    servers::wait_until("B sees A's bookings", LONG, || b.remote_loads() == expected(&from_a));

    nats.kill();
    // Recording while the server is gone returns at once, every time.
    let mut slowest = Duration::ZERO;
    let mut record = |f: &mut dyn FnMut() -> bool| {
        let start = Instant::now();
        f();
        slowest = slowest.max(start.elapsed());
    };
    for round in 0..20u64 {
        for id in 100 + round * 10..110 + round * 10 {
            let w = WorkerWithDpRank::new(id % 4, 1);
            record(&mut || a.record_book(id, w, 7, 3));
            from_a.insert(id, (w, 7, 3));
        }
        record(&mut || a.record_release(round));
        from_a.remove(&round);
        record(&mut || a.record_prefill_complete(100 + round * 10));
        from_a.get_mut(&(100 + round * 10)).unwrap().1 = 0;
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut from_b = BTreeMap::new();
    for id in 0..4u64 {
        let w = WorkerWithDpRank::new(50, 0);
        record(&mut || b.record_book(id, w, 1, 1));
        from_b.insert(id, (w, 1, 1));
    }
    // The outage lasts about 200 ms: a call that waited on the server would
    // take that long; one that returns at once takes microseconds (the
    // bound leaves room for a descheduled thread on a busy machine).
    assert!(
        slowest < Duration::from_millis(100),
        "a record_* call took {slowest:?} with the server down"
    );
    assert_eq!(a.stats().dropped, 0);

    nats.start();
    servers::wait_until("B converges to A's bookings", LONG, || {
        b.remote_loads() == expected(&from_a)
    });
    servers::wait_until("A converges to B's bookings", LONG, || {
        a.remote_loads() == expected(&from_b)
    });
    let (sa, sb) = (a.stats(), b.stats());
    assert!(sa.reconnects >= 1 && sb.reconnects >= 1, "{sa:?} {sb:?}");
    assert!(
        sa.snapshots_received >= 1 && sb.snapshots_received >= 1,
        "{sa:?} {sb:?}"
    );
    assert_eq!(sb.peers_expired, 0, "{sb:?}");
    // And deltas flow again.
    a.record_release(105);
    from_a.remove(&105);
    servers::wait_until("B sees a delta after the restart", LONG, || {
        b.remote_loads() == expected(&from_a)
    });
}

// Trust and bounds: a publisher on the subject that is not a replica (a
// bare NATS client, `servers::RawNats`) tries what a fault probe found it
// could do. With a signing key it changes nothing; without one the bounds
// hold.

const KEY: &[u8; 32] = b"selkie test partition key, 32 B!";

/// A message as a forger writes it (no send time, no signature).
fn forged(replica: u64, incarnation: u64, seq: u64, body: &str) -> String {
    format!(r#"{{"r":{replica},"i":{incarnation},"s":{seq},"m":{body}}}"#)
}

/// A load report of `requests` on worker `id`, rank 0, as a batch body.
fn report_body(id: u64, requests: u64) -> String {
    format!(r#"{{"d":[{{"L":[{id},0,[{requests},0,0]]}}]}}"#)
}

#[test]
fn a_forged_load_counts_within_the_cap_and_not_at_all_with_a_key() {
    let Some(url) = servers::nats_url("a_forged_load_counts_within_the_cap_and_not_at_all_with_a_key") else {
        return;
    };
    let (open, signed) = (
        servers::unique_subject("forged-open"),
        servers::unique_subject("forged-signed"),
    );
    let cap = load(64, 1 << 20, 1 << 20);
    let u = ReplicaSync::connect(&url, fast(&open).with_max_peer_load(cap)).unwrap();
    let a = ReplicaSync::connect(&url, fast(&signed).with_signing_key(KEY)).unwrap();
    let mut forger = servers::RawNats::connect(&url);
    for id in 1..=4u64 {
        let m = forged(777, 1, id, &report_body(id, 100_000));
        forger.publish(&open, m.as_bytes());
        forger.publish(&signed, m.as_bytes());
        // A signature that is not the key's.
        let bad = servers::RawNats::header("Selkie-Signature", &"ab".repeat(32));
        forger.publish_with_headers(&signed, &bad, m.as_bytes());
    }
    forger.flush();
    servers::wait_until("the open replica counts the forged load, capped", LONG, || {
        (1..=4).all(|id| u.remote_load(WorkerWithDpRank::new(id, 0)) == load(64, 0, 0))
    });
    assert!(u.stats().capped >= 4, "{:?}", u.stats());
    servers::wait_until("the signed replica refuses every forged message", LONG, || {
        let r = a.stats().refused;
        r.unsigned == 4 && r.bad_signature == 4
    });
    assert!(a.remote_loads().is_empty(), "{:?}", a.remote_loads());
    assert_eq!(a.stats().peers, 0);
}

#[test]
fn one_peers_huge_report_never_erases_anothers_load() {
    let Some(url) = servers::nats_url("one_peers_huge_report_never_erases_anothers_load") else {
        return;
    };
    let subject = servers::unique_subject("saturate");
    let a = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let b = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    let w = WorkerWithDpRank::new(9, 0);
    for id in 0..5 {
        assert!(b.record_book(id, w, 0, 0));
    }
    servers::wait_until("A counts B's 5 bookings", LONG, || a.remote_load(w).requests == 5);
    let applied = a.stats().applied;
    let mut forger = servers::RawNats::connect(&url);
    forger.publish(&subject, forged(31, 1, 1, &report_body(9, u64::MAX)).as_bytes());
    forger.publish(&subject, forged(31, 1, 2, &report_body(9, 0)).as_bytes());
    forger.flush();
    servers::wait_until("A applied both reports", LONG, || a.stats().applied == applied + 2);
    assert_eq!(
        a.remote_load(w).requests,
        5,
        "B's load survives a peer's u64::MAX then 0"
    );
    assert!(b.record_release(0));
    servers::wait_until("A sees B's release", LONG, || a.remote_load(w).requests == 4);
}

#[test]
fn forged_heartbeats_keep_at_most_max_peers_alive_and_none_with_a_key() {
    let Some(url) = servers::nats_url("forged_heartbeats_keep_at_most_max_peers_alive_and_none_with_a_key") else {
        return;
    };
    let (open, signed) = (
        servers::unique_subject("beats-open"),
        servers::unique_subject("beats-signed"),
    );
    let u = ReplicaSync::connect(&url, fast(&open).with_max_peers(4)).unwrap();
    let a = ReplicaSync::connect(&url, fast(&signed).with_signing_key(KEY)).unwrap();
    let mut forger = servers::RawNats::connect(&url);
    // Heartbeats from 100 made-up replicas, past the peer timeout (600 ms).
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1_000) {
        for id in 1000..1100u64 {
            let m = forged(id, 1, 0, r#""h""#);
            forger.publish(&open, m.as_bytes());
            forger.publish(&signed, m.as_bytes());
        }
        forger.flush();
        assert!(u.stats().peers <= 4, "{:?}", u.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
    let (su, sa) = (u.stats(), a.stats());
    assert_eq!(su.peers, 4, "{su:?}");
    assert!(su.refused.peers_full >= 96, "{su:?}");
    assert_eq!(sa.peers, 0, "{sa:?}");
    assert!(sa.refused.unsigned >= 100, "{sa:?}");
    // The forger stops: the made-up peers go within the timeout.
    servers::wait_until("the made-up peers expire", LONG, || u.stats().peers == 0);
}

/// Reads messages on `subject` until one from `replica`; returns its
/// incarnation (what a forger reads off the subject).
fn incarnation_of(reader: &mut servers::RawNats, replica: u64) -> u64 {
    let start = Instant::now();
    while start.elapsed() < LONG {
        let Some(m) = reader.next_message(LONG) else { break };
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        if v["r"].as_u64() == Some(replica) {
            return v["i"].as_u64().unwrap();
        }
    }
    panic!("no message from replica {replica}");
}

#[test]
fn a_sequence_number_far_ahead_in_a_real_peers_name_freezes_nothing() {
    let Some(url) = servers::nats_url("a_sequence_number_far_ahead_in_a_real_peers_name_freezes_nothing") else {
        return;
    };
    for signed in [false, true] {
        let subject = servers::unique_subject("freeze");
        let options = if signed {
            fast(&subject).with_signing_key(KEY)
        } else {
            fast(&subject)
        };
        let mut reader = servers::RawNats::connect(&url);
        reader.subscribe(&subject);
        let a = ReplicaSync::connect(&url, options.clone()).unwrap();
        let b = ReplicaSync::connect(&url, options).unwrap();
        let w = WorkerWithDpRank::new(4, 0);
        assert!(b.record_book(1, w, 0, 0));
        servers::wait_until("A counts B's booking", LONG, || a.remote_load(w).requests == 1);
        let incarnation = incarnation_of(&mut reader, b.replica_id());
        let mut forger = servers::RawNats::connect(&url);
        let m = forged(b.replica_id(), incarnation, u64::MAX, r#"{"d":[{"R":1}]}"#);
        forger.publish(&subject, m.as_bytes());
        forger.flush();
        for id in 2..=10 {
            assert!(b.record_book(id, w, 0, 0));
        }
        servers::wait_until("A counts B's later bookings", LONG, || a.remote_load(w).requests == 10);
        let (sa, sb) = (a.stats(), b.stats());
        if signed {
            assert_eq!(sb.id_conflicts, 0, "refused unread: {sb:?}");
            assert!(sa.refused.unsigned >= 1, "{sa:?}");
        } else {
            assert!(sb.id_conflicts >= 1 && sb.reincarnations >= 1, "B noticed: {sb:?}");
        }
    }
}

#[test]
fn snapshot_parts_that_never_end_are_bounded_in_rows_and_age() {
    let Some(url) = servers::nats_url("snapshot_parts_that_never_end_are_bounded_in_rows_and_age") else {
        return;
    };
    let subject = servers::unique_subject("parts");
    let a = ReplicaSync::connect(&url, fast(&subject).with_max_peer_rows(2_000)).unwrap();
    let mut forger = servers::RawNats::connect(&url);
    let part = |n: u32, first: u64| {
        let rows: Vec<String> = (first..first + 500).map(|id| format!("[{id},[1,0,100,1]]")).collect();
        forged(
            55,
            1,
            0,
            &format!(r#"{{"s":{{"n":{n},"l":false,"b":[{}]}}}}"#, rows.join(",")),
        )
    };
    for n in 0..20u32 {
        forger.publish(&subject, part(n, u64::from(n) * 500).as_bytes());
    }
    forger.flush();
    servers::wait_until("A refuses the oversized snapshot", LONG, || {
        a.stats().refused.snapshot_too_large >= 1
    });
    assert!(a.stats().peer_rows <= 2_000, "{:?}", a.stats());
    // An empty part that is not a lone part 0 drops the snapshot.
    forger.publish(&subject, part(0, 0).as_bytes());
    forger.publish(
        &subject,
        forged(55, 1, 0, r#"{"s":{"n":1,"l":false,"b":[]}}"#).as_bytes(),
    );
    forger.flush();
    servers::wait_until("A refuses the empty part", LONG, || {
        a.stats().refused.snapshot_malformed >= 1
    });
    // A snapshot that never ends, from a peer that stays alive, is
    // dropped after the peer timeout (600 ms).
    forger.publish(&subject, part(0, 0).as_bytes());
    forger.flush();
    servers::wait_until("A holds the unfinished snapshot", LONG, || a.stats().peer_rows == 500);
    let start = Instant::now();
    while a.stats().refused.snapshot_expired == 0 {
        assert!(
            start.elapsed() < LONG,
            "the snapshot was never dropped: {:?}",
            a.stats()
        );
        forger.publish(&subject, forged(55, 1, 0, r#""h""#).as_bytes());
        forger.flush();
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = a.stats();
    assert_eq!((s.peers, s.peer_rows), (1, 0), "{s:?}");
    assert!(a.remote_loads().is_empty());
}

#[test]
fn forged_bookings_are_bounded_and_go_when_their_peer_expires() {
    let Some(url) = servers::nats_url("forged_bookings_are_bounded_and_go_when_their_peer_expires") else {
        return;
    };
    let subject = servers::unique_subject("bookings");
    let a = ReplicaSync::connect(&url, fast(&subject).with_max_peer_rows(10_000)).unwrap();
    let mut forger = servers::RawNats::connect(&url);
    for batch in 0..30u64 {
        let deltas: Vec<String> = (batch * 1000..(batch + 1) * 1000)
            .map(|id| format!(r#"{{"B":[{id},[{},0,4096,64]]}}"#, id % 97))
            .collect();
        let m = forged(66, 1, batch + 1, &format!(r#"{{"d":[{}]}}"#, deltas.join(",")));
        forger.publish(&subject, m.as_bytes());
    }
    forger.flush();
    servers::wait_until("A applied every forged batch", LONG, || a.stats().applied == 30_000);
    let s = a.stats();
    assert_eq!((s.peer_rows, s.refused_rows), (10_000, 20_000), "{s:?}");
    let held: u64 = a.remote_loads().iter().map(|(_, l)| l.requests).sum();
    assert_eq!(held, 10_000);
    servers::wait_until("the silent forger's peer expires", LONG, || {
        let s = a.stats();
        (s.peers, s.peer_rows) == (0, 0)
    });
    assert!(a.remote_loads().is_empty());
}

#[test]
fn snapshot_requests_are_answered_at_most_once_per_interval() {
    let Some(url) = servers::nats_url("snapshot_requests_are_answered_at_most_once_per_interval") else {
        return;
    };
    for signed in [false, true] {
        let subject = servers::unique_subject("amplify");
        let options = if signed {
            fast(&subject).with_signing_key(KEY)
        } else {
            fast(&subject)
        };
        let victim = ReplicaSync::connect(&url, options).unwrap();
        for id in 0..2_000u64 {
            assert!(victim.record_book(id, WorkerWithDpRank::new(id % 50, 0), 1000, 8));
        }
        servers::wait_until("the victim's bookings are out", LONG, || {
            victim.stats().published_events == 2_000
        });
        let before = victim.stats().snapshots_sent;
        let mut forger = servers::RawNats::connect(&url);
        let start = Instant::now();
        for i in 0..2_000u64 {
            forger.publish(&subject, forged(9_000 + i % 7, 1, 0, r#"{"q":null}"#).as_bytes());
            if i % 100 == 99 {
                forger.flush();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        forger.flush();
        // The requests already in are answered by at most one more.
        std::thread::sleep(Duration::from_millis(200));
        let took = start.elapsed();
        let s = victim.stats();
        let sent = s.snapshots_sent - before;
        let allowed = if signed { 0 } else { (took.as_millis() / 100) as u64 + 2 };
        let _ = writeln!(
            std::io::stderr(),
            "\nsnapshot amplification ({}): 2,000 requests in {took:?}: {sent} snapshots of 2,000 bookings sent, \
             {} deferred, {} refused",
            if signed { "signed" } else { "open" },
            s.snapshots_deferred,
            s.refused.total()
        );
        assert!(
            sent <= allowed,
            "{sent} snapshots for 2,000 requests in {took:?}: {s:?}"
        );
        if !signed {
            assert!(sent >= 1, "the requests were answered: {s:?}");
        }
    }
}

/// Captured signed messages replayed by someone without the key: an old
/// incarnation's batch does not reset the live replica's table, and a
/// message older than the peer timeout is refused outright.
#[test]
fn replayed_signed_messages_change_nothing() {
    let Some(url) = servers::nats_url("replayed_signed_messages_change_nothing") else {
        return;
    };
    let subject = servers::unique_subject("replay");
    let options = fast(&subject).with_signing_key(KEY);
    let a = ReplicaSync::connect(&url, options.clone()).unwrap();
    let mut recorder = servers::RawNats::connect(&url);
    recorder.subscribe(&subject);
    let w = WorkerWithDpRank::new(3, 0);
    let old = ReplicaSync::connect(&url, options.clone().with_replica_id(42)).unwrap();
    for id in 0..3 {
        assert!(old.record_book(id, w, 0, 0));
    }
    servers::wait_until("A counts the old incarnation's 3 bookings", LONG, || {
        a.remote_load(w).requests == 3
    });
    drop(old);
    // Everything replica 42's first incarnation said, signatures included.
    let mut captured = Vec::new();
    let start = Instant::now();
    while let Some(m) = recorder.next_message(Duration::from_millis(300).saturating_sub(start.elapsed())) {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        if v["r"].as_u64() == Some(42) {
            captured.push(m);
        }
    }
    assert!(
        captured.iter().any(|m| m.payload.windows(5).any(|w| w == br#"{"d":"#)),
        "a batch was captured"
    );
    let new = ReplicaSync::connect(&url, options.with_replica_id(42)).unwrap();
    assert!(new.record_book(10, w, 0, 0));
    servers::wait_until("A counts only the new incarnation's booking", LONG, || {
        a.remote_load(w).requests == 1
    });
    let mut forger = servers::RawNats::connect(&url);
    let replay = |forger: &mut servers::RawNats| {
        for m in &captured {
            forger.publish_with_headers(&subject, m.headers.as_deref().unwrap(), &m.payload);
        }
        forger.flush();
    };
    replay(&mut forger);
    servers::wait_until("A refuses the replayed messages", LONG, || {
        a.stats().refused.replayed >= captured.len() as u64
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(a.remote_load(w).requests, 1, "the replay reset nothing");
    // Past the peer timeout (600 ms) the captured messages are stale.
    std::thread::sleep(Duration::from_millis(700));
    replay(&mut forger);
    servers::wait_until("A refuses them as stale", LONG, || a.stats().refused.stale >= 1);
    assert_eq!(a.remote_load(w).requests, 1);
    assert_eq!(new.stats().id_conflicts, 0, "{:?}", new.stats());
}

#[test]
fn a_connected_sync_reports_itself_running() {
    let Some(url) = servers::nats_url("a_connected_sync_reports_itself_running") else {
        return;
    };
    let subject = servers::unique_subject("health");
    let a = ReplicaSync::connect(&url, fast(&subject)).unwrap();
    assert_eq!(a.health(), SyncHealth::Running);
    assert!(a.record_book(1, WorkerWithDpRank::new(1, 0), 1, 1));
}
