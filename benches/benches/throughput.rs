//! Concurrent select + book + release throughput against one shared
//! `WorkerSelectionService`, on 1 and 2 threads, and their ratio (target:
//! 2 threads ≥ 1.6× the 1-thread throughput, nothing lost).
//!
//! ```text
//! cargo bench -p selkie-benches --bench throughput
//! ```
//!
//! Per case, a fixed number of operations (sized so a run takes about
//! [`RUN`]) is split evenly across the threads (`std::thread::scope`); each
//! operation is one select + book + drop of the booking, and must succeed.
//! The 1- and 2-thread runs alternate for [`ROUNDS`] rounds and the table
//! reports the median of each and their ratio, so both sides see the same
//! machine load. Afterwards every worker's counters must equal the load the
//! fixture holds, and zero once that is released. The fixture is
//! `selkie_benches::host_fixture`.
//!
//! It also counts heap allocations (a counting global allocator) over
//! [`ALLOC_PROBE`] selections on a warm thread, per case (target: none on
//! the selection path).
use std::alloc::{GlobalAlloc, Layout, System};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use selkie_benches::host_fixture::{HostFixture, Mode};

/// Workers of every case.
const WORKERS: [usize; 2] = [1_024, 10_000];
/// Rounds of (1 thread, 2 threads).
const ROUNDS: usize = 7;
/// Target wall time of one run.
const RUN: Duration = Duration::from_millis(150);
/// Target: minimum 2-thread / 1-thread throughput ratio.
const TARGET_RATIO: f64 = 1.6;

/// Selections whose allocations are counted, per case.
const ALLOC_PROBE: usize = 1_000;

/// The system allocator, counting every allocation and reallocation.
struct CountingAllocator;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments, so
// `System`'s guarantees hold; the counter has no effect on the memory.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (the caller's contract).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Allocations made by [`ALLOC_PROBE`] selections on this (warm) thread.
/// Only this thread selects meanwhile, so the global count is its own.
fn allocations_per_probe(fixture: &HostFixture) -> usize {
    fixture.select_and_release();
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..ALLOC_PROBE {
        std::hint::black_box(fixture.select_and_release());
    }
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

/// The cases: a name, the mode, the temperature (kv only).
const CASES: [(&str, Mode, f64); 6] = [
    ("random", Mode::Random, 0.0),
    ("round-robin", Mode::RoundRobin, 0.0),
    ("power-of-two", Mode::PowerOfTwo, 0.0),
    ("least-loaded", Mode::LeastLoaded, 0.0),
    ("kv-t0", Mode::Kv, 0.0),
    ("kv-t0.7", Mode::Kv, 0.7),
];

fn main() -> ExitCode {
    // `cargo test --benches` runs bench targets with no `--bench` flag: build
    // and check one small case only.
    let quick = !std::env::args().any(|a| a == "--bench");
    println!(
        "select + book + release on one shared service, ops/s (median of {ROUNDS} alternating rounds of ~{RUN:?})"
    );
    println!(
        "{:>7} {:<14} {:>13} {:>13} {:>9} {:>7}  target (2 threads >= {TARGET_RATIO}x)",
        "workers", "mode", "1 thread", "2 threads", "ratio", "allocs"
    );
    let mut ok = true;
    for &n in &WORKERS {
        for &(name, mode, t) in &CASES {
            let mut fixture = HostFixture::new(mode, n, t);
            let held = fixture.outstanding();
            let allocs = allocations_per_probe(&fixture);
            if allocs != 0 {
                ok = false;
            }
            let (one, two) = if quick {
                (run(&fixture, 1, 100).1, run(&fixture, 2, 100).1)
            } else {
                compare(&fixture)
            };
            let ratio = two / one;
            let verdict = match (quick, ratio >= TARGET_RATIO) {
                (true, _) => "(smoke test, 100 operations: not a measurement)",
                (false, true) => "met",
                (false, false) => "MISSED",
            };
            println!("{n:>7} {name:<14} {one:>13.0} {two:>13.0} {ratio:>8.2}x {allocs:>7}  {verdict}");
            let after = fixture.outstanding();
            fixture.release_held();
            let released = fixture.outstanding();
            if allocs != 0 {
                eprintln!("  ALLOCATED: {allocs} allocations in {ALLOC_PROBE} selections");
            }
            if after != held || released != (0, 0, 0) {
                eprintln!("  LOST BOOKINGS: held {held:?}, after the runs {after:?}, after release {released:?}");
                ok = false;
            }
            if quick {
                break;
            }
        }
        if quick {
            break;
        }
    }
    println!(
        "allocs = heap allocations in {ALLOC_PROBE} selections on a warm thread; no allocation, and every counter \
         back to the held load after the runs and to zero after its release: {ok}"
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Median ops/s on 1 and on 2 threads, alternating.
fn compare(fixture: &HostFixture) -> (f64, f64) {
    let ops = calibrate(fixture);
    let (mut one, mut two) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            one.push(run(fixture, 1, ops).1);
            two.push(run(fixture, 2, ops).1);
        } else {
            two.push(run(fixture, 2, ops).1);
            one.push(run(fixture, 1, ops).1);
        }
    }
    (median(&mut one), median(&mut two))
}

/// Operations per run so that one thread takes about [`RUN`] (even, at
/// least 2).
fn calibrate(fixture: &HostFixture) -> usize {
    let mut ops = 64;
    loop {
        let (elapsed, _) = run(fixture, 1, ops);
        if elapsed >= Duration::from_millis(20) {
            let per_op = elapsed.as_secs_f64() / ops as f64;
            return ((RUN.as_secs_f64() / per_op) as usize).max(2) & !1;
        }
        ops *= 4;
    }
}

/// `ops` select + book + release split across `threads`; returns the wall
/// time and ops/s. Panics if any selection fails.
fn run(fixture: &HostFixture, threads: usize, ops: usize) -> (Duration, f64) {
    let done = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..ops / threads {
                    std::hint::black_box(fixture.select_and_release());
                }
                done.fetch_add(ops / threads, Ordering::Relaxed);
            });
        }
    });
    let elapsed = start.elapsed();
    let done = done.into_inner();
    assert_eq!(done, ops / threads * threads, "every operation completed");
    (elapsed, done as f64 / elapsed.as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
