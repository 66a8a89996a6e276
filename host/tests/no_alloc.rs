//! The default selection path allocates nothing once a thread is warm
//!: a counting global allocator watches this test's thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use selkie::*;

struct Counting;

/// Bytes allocated and not yet freed, by every thread of this process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The tests of this binary run one at a time: one of them measures the
/// whole process's heap.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

thread_local! {
    static WATCH: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCH.with(Cell::get) {
            COUNT.with(|c| c.set(c.get() + 1));
        }
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(0));
    WATCH.with(|w| w.set(true));
    f();
    WATCH.with(|w| w.set(false));
    COUNT.with(Cell::get)
}

#[test]
fn default_selection_path_does_not_allocate() {
    let _serial = serial();
    let policies = [
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        WorkerSelectionPolicy::kv(
            KvRouterConfig {
                router_temperature: 0.5,
                ..KvRouterConfig::default()
            },
            WorkerType::Prefill,
        ),
        WorkerSelectionPolicy::least_loaded(),
        WorkerSelectionPolicy::power_of_two(),
        WorkerSelectionPolicy::random(),
        WorkerSelectionPolicy::round_robin(),
    ];
    for policy in policies {
        let name = policy.name();
        let s = WorkerSelectionService::new(policy, ServiceConfig::default());
        for id in 0..100 {
            s.add_worker(WorkerRecord::new(id).with_dp(0, 1 + (id % 3) as u32))
                .unwrap();
        }
        let ov: Vec<WorkerOverlap> = (0..50)
            .map(|i| WorkerOverlap::device(WorkerWithDpRank::new(i * 2, 0), i as u32 % 7, 16))
            .collect();
        let prefs = [("rack-a", 0.5f32)];
        let req = SelectionRequest::new(2048)
            .with_overlaps(&ov)
            .with_preferred_taints(&prefs);
        for _ in 0..3 {
            drop(s.select(&req).unwrap()); // warm the thread's scratch
        }
        let n = allocations(|| {
            for _ in 0..1000 {
                let mut sel = s.select(&req).unwrap();
                sel.prefill_complete();
                sel.add_output_block().unwrap();
                drop(sel);
                let _ = s.peek(&req).unwrap();
            }
        });
        assert_eq!(n, 0, "{name}: {n} allocations in 1000 selections");
    }
}

/// Requests with a session, new sessions and returning ones, hard and soft,
/// allocate nothing once the session table exists: it is keyed by a hash of
/// the session id and never stores the id.
#[test]
fn session_requests_do_not_allocate() {
    let _serial = serial();
    let s = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
    for id in 0..16 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let ids: Vec<String> = (0..2_000).map(|i| format!("session-{i}")).collect();
    // The first bind allocates the table; the first selections the scratch.
    for mode in [AffinityMode::Hard, AffinityMode::Soft] {
        for _ in 0..3 {
            drop(s.select(&SelectionRequest::new(64).with_session("warm", mode)).unwrap());
        }
    }
    let n = allocations(|| {
        for (i, id) in ids.iter().enumerate() {
            let mode = if i % 2 == 0 {
                AffinityMode::Hard
            } else {
                AffinityMode::Soft
            };
            let req = SelectionRequest::new(64).with_session(id, mode);
            let first = s.select(&req).unwrap().worker();
            let again = s.select(&req).unwrap().worker();
            assert_eq!(first, again, "{id} returns to its worker");
        }
    });
    assert_eq!(n, 0, "{n} allocations in 4000 session requests");
}

/// Replica sync's `record_*` calls (feature `nats`) allocate nothing,
/// whether the delta is queued or dropped from a full queue. Needs the
/// nats-server named by `SELKIE_NATS_URL` (`.ci/run` starts one).
#[cfg(feature = "nats")]
#[test]
fn replica_sync_recording_does_not_allocate() {
    let _serial = serial();
    use std::io::Write;
    let Some(url) = std::env::var("SELKIE_NATS_URL").ok().filter(|u| !u.trim().is_empty()) else {
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED: replica_sync_recording_does_not_allocate: replica sync tests need SELKIE_NATS_URL (a running nats-server; .ci/run starts one)"
        );
        return;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let subject = format!("selkie-test.no-alloc.{}-{nanos}", std::process::id());
    let w = WorkerWithDpRank::new(1, 0);
    for capacity in [1 << 16, 4] {
        let options = ReplicaSyncOptions::default()
            .with_subject(subject.as_str())
            .with_queue_capacity(capacity);
        let sync = ReplicaSync::connect(url.trim(), options).unwrap();
        sync.record_book(0, w, 1, 1);
        let n = allocations(|| {
            for id in 0..10_000 {
                sync.record_book(id, w, 100, 2);
                sync.record_prefill_complete(id);
                sync.record_release(id);
            }
        });
        assert_eq!(n, 0, "queue of {capacity}: {n} allocations in 30 000 record_* calls");
        if capacity == 4 {
            assert!(sync.stats().dropped > 0, "the small queue never filled");
        }
    }
}

/// The selection path of a service wired to replica sync (a peer's load
/// applied to the rows' counters; the service's own load reported off
/// that path) allocates nothing either, for the policies that scan.
#[cfg(feature = "nats")]
#[test]
fn selection_with_replica_sync_does_not_allocate() {
    let _serial = serial();
    use std::io::Write;
    use std::sync::Arc;
    let Some(url) = std::env::var("SELKIE_NATS_URL").ok().filter(|u| !u.trim().is_empty()) else {
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED: selection_with_replica_sync_does_not_allocate: replica sync tests need SELKIE_NATS_URL (a running nats-server; .ci/run starts one)"
        );
        return;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let subject = format!("selkie-test.no-alloc-wired.{}-{nanos}", std::process::id());
    let peer = ReplicaSync::connect(url.trim(), ReplicaSyncOptions::default().with_subject(subject.as_str())).unwrap();
    let policies = [
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        WorkerSelectionPolicy::least_loaded(),
        WorkerSelectionPolicy::power_of_two(),
    ];
    for (i, policy) in policies.into_iter().enumerate() {
        let name = policy.name();
        let s = WorkerSelectionService::new(policy, ServiceConfig::default());
        for id in 0..100 {
            s.add_worker(WorkerRecord::new(id)).unwrap();
        }
        let sync = Arc::new(
            ReplicaSync::connect(url.trim(), ReplicaSyncOptions::default().with_subject(subject.as_str())).unwrap(),
        );
        s.set_replica_sync(Arc::clone(&sync)).unwrap();
        let booking = 1000 * (i as u64 + 1);
        peer.record_book(booking, WorkerWithDpRank::new(3, 0), 100, 2);
        let start = std::time::Instant::now();
        while sync.remote_load(WorkerWithDpRank::new(3, 0)).requests == 0 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "the peer's load never arrived"
            );
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(s.apply_remote_load());
        let req = SelectionRequest::new(2048);
        for _ in 0..3 {
            drop(s.select(&req).unwrap());
        }
        let n = allocations(|| {
            for _ in 0..1000 {
                let mut sel = s.select(&req).unwrap();
                sel.prefill_complete();
                drop(sel);
            }
        });
        assert_eq!(n, 0, "{name}: {n} allocations in 1000 selections with replica sync");
        peer.record_release(booking);
    }
}

/// What a forged peer makes replica sync hold is bounded by
/// `max_peer_rows`, and all of it is given back when the peer expires:
/// the process's live heap returns to where it was. Needs the
/// nats-server named by `SELKIE_NATS_URL`.
#[cfg(feature = "nats")]
#[test]
fn forged_bookings_memory_is_bounded_and_given_back_on_expiry() {
    use std::io::Write;
    use std::time::{Duration, Instant};
    let _serial = serial();
    let Some(url) = std::env::var("SELKIE_NATS_URL").ok().filter(|u| !u.trim().is_empty()) else {
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED: forged_bookings_memory_is_bounded_and_given_back_on_expiry: replica sync tests need SELKIE_NATS_URL (a running nats-server; .ci/run starts one)"
        );
        return;
    };
    let url = url.trim();
    let wait = |what: &str, done: &mut dyn FnMut() -> bool| {
        let start = Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "timed out waiting until {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let subject = format!("selkie-test.memory.{}-{nanos}", std::process::id());
    const ROWS: usize = 50_000;
    let options = ReplicaSyncOptions::default()
        .with_subject(subject.as_str())
        .with_heartbeat_interval(Duration::from_millis(50))
        .with_peer_timeout(Duration::from_millis(600))
        .with_max_peer_rows(ROWS);
    let a = ReplicaSync::connect(url, options).unwrap();
    let addr = url.trim_start_matches("nats://");
    let mut forger = std::net::TcpStream::connect(addr).unwrap();
    forger.write_all(b"CONNECT {\"verbose\":false}\r\n").unwrap();
    let batch = |b: u64| {
        let deltas: Vec<String> = (b * 1000..(b + 1) * 1000)
            .map(|id| format!(r#"{{"B":[{id},[{},0,4096,64]]}}"#, id % 997))
            .collect();
        let m = format!(r#"{{"r":66,"i":1,"s":{},"m":{{"d":[{}]}}}}"#, b + 1, deltas.join(","));
        let mut frame = format!("PUB {subject} {}\r\n", m.len()).into_bytes();
        frame.extend_from_slice(m.as_bytes());
        frame.extend_from_slice(b"\r\n");
        frame
    };
    // Warm the client's buffers with one round first (kept: they are the
    // client's, not the peer's), then measure from an empty table. `a`'s
    // subscription was written when `connect` returned, but the server
    // registers it in its own time and a publication on another connection
    // can come first (a peer of its own would answer `a`'s snapshot
    // request; the forger does not): the warm-up batch goes again every
    // 250 ms until `a` has it.
    forger.write_all(&batch(0)).unwrap();
    let mut sent = Instant::now();
    wait("the warm-up batch is applied", &mut || {
        if a.stats().applied >= 1_000 {
            return true;
        }
        if sent.elapsed() > Duration::from_millis(250) {
            forger.write_all(&batch(0)).unwrap();
            sent = Instant::now();
        }
        false
    });
    wait("the warm-up peer expires", &mut || a.stats().peers == 0);
    std::thread::sleep(Duration::from_millis(100));
    let warm = a.stats().applied;
    let before = LIVE.load(Ordering::Relaxed);
    for b in 0..80 {
        forger.write_all(&batch(b)).unwrap();
    }
    wait("every forged batch is applied", &mut || {
        a.stats().applied == warm + 80_000
    });
    let s = a.stats();
    assert_eq!(s.peer_rows, ROWS as u64, "{s:?}");
    let held = LIVE.load(Ordering::Relaxed) - before;
    wait("the silent forger's peer expires", &mut || a.stats().peers == 0);
    std::thread::sleep(Duration::from_millis(100));
    let after = LIVE.load(Ordering::Relaxed) - before;
    let _ = writeln!(
        std::io::stderr(),
        "\nforged bookings: {ROWS} held (80,000 sent): +{} KB live heap ({} bytes a row); after expiry {:+} KB",
        held / 1024,
        held / ROWS as isize,
        after / 1024
    );
    assert!(held > 0 && held < 200 * ROWS as isize, "{held} bytes for {ROWS} rows");
    assert!(after < 512 * 1024, "{after} bytes still held after the peer expired");
}
