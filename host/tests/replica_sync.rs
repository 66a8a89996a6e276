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
    let port = servers::free_port();
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
    let url = format!("nats://127.0.0.1:{}", servers::free_port());
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
