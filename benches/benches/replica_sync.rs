//! What replica sync costs the selection path: select + release with sync
//! on against off, in one run, on one service; the messages sync
//! publishes at 100,000 selections per second; and what one `record_*`
//! call costs (a booking and its release, the queue never full).
//!
//! ```sh
//! SELKIE_NATS_URL=nats://127.0.0.1:4222 cargo bench -p selkie-benches --features nats --bench replica_sync
//! ```
//!
//! The service has a `ReplicaSync` (connected to the server), and a peer's
//! bookings on a tenth of the workers are applied as their rows' remote
//! load. "On": its sync thread runs every millisecond (reporting the
//! service's own load read from the fleet's counters, applying the
//! peers'). "Off": the thread is stopped, which leaves the selection path
//! exactly as without sync (selecting never looks at the sync). Batches of
//! 20,000 selections alternate between the two (which goes first
//! alternates too), 40 pairs; the ratio reported is the median of the
//! pairs' ratios. One service, not two: two fleets of 10,000 rows built
//! one after the other differ in selection time by up to 30% (where their
//! memory lies), more than what is measured here. Without
//! `SELKIE_NATS_URL` it prints why and measures nothing.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use selkie::{
    ReplicaSync, ReplicaSyncOptions, SelectionRequest, ServiceConfig, WorkerRecord, WorkerSelectionPolicy,
    WorkerSelectionService, WorkerWithDpRank,
};

const PER_BATCH: u32 = 20_000;
const PAIRS: usize = 40;

fn service(policy: WorkerSelectionPolicy, workers: u64) -> Arc<WorkerSelectionService> {
    let s = WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(3),
            ..ServiceConfig::default()
        },
    );
    for id in 0..workers {
        s.add_worker(WorkerRecord::new(id)).expect("the fleet has room");
    }
    Arc::new(s)
}

fn subject(what: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("selkie-bench.{what}.{}-{nanos}", std::process::id())
}

/// Time of one batch of select + release on `s`.
fn batch(s: &WorkerSelectionService, req: &SelectionRequest<'_>) -> Duration {
    let start = Instant::now();
    for _ in 0..PER_BATCH {
        black_box(s.select(req).expect("the fleet admits")).finish();
    }
    start.elapsed()
}

/// Time of one batch on `on` with its sync thread running (started before
/// the batch, stopped after it).
fn synced_batch(on: &Arc<WorkerSelectionService>, req: &SelectionRequest<'_>) -> Duration {
    let thread = on
        .spawn_replica_sync_thread(Duration::from_millis(1))
        .expect("a thread starts");
    let took = batch(on, req);
    drop(thread);
    took
}

/// Sync on against off for one policy and fleet size; prints one line.
fn on_vs_off(url: &str, name: &str, policy: fn() -> WorkerSelectionPolicy, workers: u64) {
    let subject = subject("cost");
    let on = service(policy(), workers);
    let options = ReplicaSyncOptions::default().with_subject(subject.as_str());
    let sync = Arc::new(ReplicaSync::connect(url, options.clone()).expect("nats-server reachable"));
    on.set_replica_sync(Arc::clone(&sync)).expect("one sync per service");
    let peer = ReplicaSync::connect(url, options).expect("nats-server reachable");
    let loaded = workers / 10;
    for id in 0..loaded {
        peer.record_book(id + 1, WorkerWithDpRank::new(id * 10, 0), 256, 16);
    }
    let start = Instant::now();
    while sync.remote_loads().len() < loaded as usize {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the peer's bookings never arrived"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(on.apply_remote_load(), "the peer's load is applied");
    // One report pass with nothing changed: what the sync thread reads
    // every period.
    on.publish_local_load();
    const PASSES: u32 = 200;
    let start = Instant::now();
    for _ in 0..PASSES {
        assert_eq!(black_box(on.publish_local_load()), 0, "nothing changed");
    }
    let pass = start.elapsed() / PASSES;
    let req = SelectionRequest::new(2_048);
    for _ in 0..3 {
        batch(&on, &req);
        synced_batch(&on, &req);
    }
    let (mut ratios, mut t_off, mut t_on) = (Vec::with_capacity(PAIRS), Duration::ZERO, Duration::ZERO);
    for i in 0..PAIRS {
        let (a, b) = if i % 2 == 0 {
            let a = batch(&on, &req);
            (a, synced_batch(&on, &req))
        } else {
            let b = synced_batch(&on, &req);
            (batch(&on, &req), b)
        };
        ratios.push(b.as_secs_f64() / a.as_secs_f64());
        t_off += a;
        t_on += b;
    }
    ratios.sort_by(f64::total_cmp);
    let n = (PAIRS as u32 * PER_BATCH) as f64;
    println!(
        "{name:<13} {workers:>6} workers: on / off {:.3} (median of {PAIRS} pairs; on {:.0} ns, off {:.0} ns per select + release; \
         one report pass {:.1} µs)",
        ratios[PAIRS / 2],
        t_on.as_nanos() as f64 / n,
        t_off.as_nanos() as f64 / n,
        pass.as_secs_f64() * 1e6,
    );
}

/// ns per `record_*` call: rounds of 2,048 `record_book` +
/// `record_release` pairs (half the default queue of 8,192, so none is
/// dropped), timed, each followed by an untimed wait for the sync thread
/// to drain them; the median of 40 batches of 25 rounds.
fn record_cost(url: &str) {
    let options = ReplicaSyncOptions::default().with_subject(subject("record").as_str());
    let sync = ReplicaSync::connect(url, options).expect("nats-server reachable");
    let w = WorkerWithDpRank::new(1, 0);
    let mut id = 0u64;
    let mut batch = || {
        let mut took = Duration::ZERO;
        for _ in 0..25 {
            let start = Instant::now();
            for _ in 0..2_048 {
                black_box(sync.record_book(id, w, 100, 2));
                black_box(sync.record_release(id));
                id += 1;
            }
            took += start.elapsed();
            // The sync thread drains the queue every millisecond.
            std::thread::sleep(Duration::from_millis(3));
        }
        took.as_nanos() as f64 / (25.0 * 4_096.0)
    };
    for _ in 0..3 {
        batch();
    }
    let mut ns: Vec<f64> = (0..40).map(|_| batch()).collect();
    ns.sort_by(f64::total_cmp);
    println!(
        "record_book + record_release: {:.1} ns per call (median of 40 batches of 102,400 calls; {} dropped)",
        ns[20],
        sync.stats().dropped
    );
}

/// Messages published while selecting at `rate` per second for a second,
/// each request held for 10 ms (`rate / 100` in flight).
fn messages_at(url: &str, rate: f64) {
    let s = service(WorkerSelectionPolicy::least_loaded(), 1_024);
    let options = ReplicaSyncOptions::default().with_subject(subject("rate").as_str());
    let sync = Arc::new(ReplicaSync::connect(url, options).expect("nats-server reachable"));
    s.set_replica_sync(Arc::clone(&sync)).expect("one sync per service");
    let thread = s
        .spawn_replica_sync_thread(Duration::from_millis(1))
        .expect("a thread starts");
    let req = SelectionRequest::new(2_048);
    let in_flight = (rate / 100.0) as usize;
    let mut held = std::collections::VecDeque::with_capacity(in_flight + 1);
    let before = sync.stats();
    let start = Instant::now();
    let mut done = 0u64;
    while start.elapsed().as_secs_f64() < 1.0 {
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        while done < due {
            held.push_back(s.select(&req).expect("the fleet admits"));
            if held.len() > in_flight {
                drop(held.pop_front());
            }
            done += 1;
        }
        std::hint::spin_loop();
    }
    let elapsed = start.elapsed().as_secs_f64();
    // The last report and batch go out.
    std::thread::sleep(Duration::from_millis(20));
    let after = sync.stats();
    drop(held);
    drop(thread);
    let batches = after.published_batches - before.published_batches;
    let events = after.published_events - before.published_events;
    println!(
        "at {:.0} selections/s (1,024 workers, least-loaded, {in_flight} in flight): {:.0} messages/s, \
         {:.0} load changes per message, {} dropped",
        done as f64 / elapsed,
        batches as f64 / elapsed,
        events as f64 / batches.max(1) as f64,
        after.dropped - before.dropped,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let Some(url) = std::env::var("SELKIE_NATS_URL").ok().filter(|u| !u.trim().is_empty()) else {
        println!("SKIPPED: replica_sync measures against a running nats-server: set SELKIE_NATS_URL");
        return;
    };
    let url = url.trim();
    if std::env::args().any(|a| a == "record") {
        // `cargo bench ... -- record`: the record_* cost alone.
        record_cost(url);
        return;
    }
    println!("replica sync: selection time with sync on against off, one run");
    for workers in [1_024, 10_000] {
        on_vs_off(url, "least-loaded", WorkerSelectionPolicy::least_loaded, workers);
        on_vs_off(url, "power-of-two", WorkerSelectionPolicy::power_of_two, workers);
    }
    println!("replica sync: messages published");
    messages_at(url, 100_000.0);
    println!("replica sync: record_* cost");
    record_cost(url);
}
