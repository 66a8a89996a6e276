//! selkie against dynamo-kv-router 1.6.1, side by side in one run, on
//! Dynamo's own `worker_selection` bench fixture (SPEC §6): 2, 32, 1,024,
//! 2,048 and 10,000 workers, temperature 0 and 0.7.
//!
//! ```text
//! cargo bench -p selkie-benches --features dynamo --bench vs_dynamo
//! ```
//!
//! It first runs the parity check (`selkie_benches::vs_dynamo::parity`) for
//! every worker count and exits non-zero if any cost, temperature-0 pick or
//! temperature-0.7 sampling check disagrees with Dynamo. Then, per worker
//! count and temperature, it times Dynamo's
//! `DefaultWorkerSelector::select_worker` (exactly the call Dynamo's bench
//! times) and selkie's equivalent, which does the same per-request work:
//! eligibility, scatter the request's sparse overlap into dense per-request
//! columns (clearing them first), compute every row's KV cost, pick. selkie
//! reads its load columns from a kernel `Fleet` holding the fixture's load as
//! bookings (the ratio column); the same call over plain slices is timed
//! too. Two more tables split selkie's call into its stages, per source.
//!
//! Timing is a hand-rolled loop rather than criterion, because the point is
//! ratios measured in one run: the calls being compared take turns in
//! batches of about a millisecond (the order rotates every round) for
//! [`ROUNDS`] rounds, and the table reports each call's median batch time
//! per call and the ratio of the medians. Dynamo's crate is the one on
//! crates.io, built with this workspace's bench profile (thin LTO, one
//! codegen unit, no `target-cpu`: selkie's kernel picks its SIMD backend at
//! run time).
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use selkie_benches::vs_dynamo::{parity, DynamoFixture, LoadSource, SelkieFixture, TEMPERATURES, WORKER_COUNTS};

/// Timed rounds per comparison; each round times one batch of each call.
const ROUNDS: usize = 101;
/// Target wall time of one batch.
const BATCH: Duration = Duration::from_millis(1);
/// Picks per sampler in the temperature-0.7 parity check.
const PARITY_SAMPLES: usize = 1_000;

/// SPEC §6 targets: (temperature, minimum speed-up, maximum ns per worker),
/// for 1,024 workers and more.
const TARGETS: [(f32, f64, f64); 2] = [(0.0, 50.0, 0.5), (0.7, 30.0, 1.0)];

fn main() -> ExitCode {
    println!("parity with dynamo-kv-router 1.6.1 (every worker's cost, T=0 picks, T=0.7 sampling):");
    for &n in &WORKER_COUNTS {
        match parity::check(n, PARITY_SAMPLES) {
            Ok(report) => println!("  ok  {report}"),
            Err(e) => {
                eprintln!("  PARITY FAILED at {n} workers: {e}");
                return ExitCode::FAILURE;
            }
        }
    }

    println!();
    for source in LoadSource::ALL {
        println!("selkie/{}: {}", source.name(), source.describe());
    }
    println!("per call: median of {ROUNDS} interleaved batches of ~{BATCH:?}; ratio = dynamo / selkie(fleet)");
    println!();
    println!(
        "{:>7} {:>4} {:>13} {:>13} {:>8} {:>13} {:>13}  target (>= 1,024 workers)",
        "workers", "T", "dynamo ns/op", "selkie ns/op", "ratio", "selkie ns/wkr", "slices ns/op"
    );
    for &n in &WORKER_COUNTS {
        let dynamo = DynamoFixture::new(n);
        let mut fleet = SelkieFixture::new(n, LoadSource::Fleet);
        let mut slices = SelkieFixture::new(n, LoadSource::Slices);
        for &t in &TEMPERATURES {
            let selector = DynamoFixture::selector(t as f64);
            let [d, s, p] = time_interleaved([
                &mut batch(|| {
                    black_box(dynamo.select(&selector));
                }),
                &mut batch(|| {
                    black_box(fleet.select(black_box(t)));
                }),
                &mut batch(|| {
                    black_box(slices.select(black_box(t)));
                }),
            ]);
            let ratio = d / s;
            let per_worker = s / n as f64;
            println!(
                "{n:>7} {t:>4.1} {d:>13.1} {s:>13.1} {ratio:>7.1}x {per_worker:>13.3} {p:>13.1}  {}",
                target_verdict(n, t, ratio, per_worker)
            );
        }
    }

    for source in LoadSource::ALL {
        println!();
        println!(
            "selkie/{} by stage, ns per call (ns per worker in parentheses):",
            source.name()
        );
        println!(
            "{:>7} {:>22} {:>22} {:>22} {:>22}",
            "workers", "eligibility+scatter", "kv_cost", "pick T=0", "pick T=0.7"
        );
        for &n in &WORKER_COUNTS {
            let mut f = SelkieFixture::new(n, source);
            f.scatter_hits();
            f.cost_rows();
            let scatter = time_one(|| f.scatter_hits());
            let cost = time_one(|| {
                black_box(f.cost_rows());
            });
            let pick0 = time_one(|| {
                black_box(f.pick_row(0.0));
            });
            let pick7 = time_one(|| {
                black_box(f.pick_row(0.7));
            });
            let cell = |ns: f64| format!("{ns:.1} ({:.3})", ns / n as f64);
            println!(
                "{n:>7} {:>22} {:>22} {:>22} {:>22}",
                cell(scatter),
                cell(cost),
                cell(pick0),
                cell(pick7)
            );
        }
    }
    ExitCode::SUCCESS
}

/// Whether a row meets SPEC §6 (which sets targets from 1,024 workers up).
fn target_verdict(n: usize, t: f32, ratio: f64, per_worker: f64) -> String {
    let Some(&(_, speedup, ns)) = TARGETS.iter().find(|(tt, _, _)| *tt == t) else {
        return String::new();
    };
    if n < 1_024 {
        return "-".into();
    }
    let ok = |b: bool| if b { "met" } else { "MISSED" };
    format!(
        ">= {speedup}x {}, <= {ns} ns/wkr {}",
        ok(ratio >= speedup),
        ok(per_worker <= ns)
    )
}

/// A timer for `f`: given `k`, calls `f` `k` times and returns ns per call.
/// The loop is generic over `f`, so only the batch call is dynamic.
fn batch(mut f: impl FnMut()) -> impl FnMut(usize) -> f64 {
    move |k| {
        let start = Instant::now();
        for _ in 0..k {
            f();
        }
        start.elapsed().as_nanos() as f64 / k as f64
    }
}

/// Median ns per call of each timer, timed in turns (the order rotates
/// every round) after a warm-up.
fn time_interleaved<const K: usize>(mut timers: [&mut dyn FnMut(usize) -> f64; K]) -> [f64; K] {
    let sizes: [usize; K] = core::array::from_fn(|i| batch_size(&mut *timers[i]));
    let mut samples: [Vec<f64>; K] = core::array::from_fn(|_| Vec::with_capacity(ROUNDS));
    for round in 0..ROUNDS {
        for j in 0..K {
            let i = (round + j) % K;
            samples[i].push(timers[i](sizes[i]));
        }
    }
    core::array::from_fn(|i| median(&mut samples[i]))
}

/// Median ns per call of `f` alone.
fn time_one(f: impl FnMut()) -> f64 {
    let [ns] = time_interleaved([&mut batch(f)]);
    ns
}

/// Calls per batch so that a batch takes about [`BATCH`], after a 50 ms
/// warm-up.
fn batch_size(timer: &mut dyn FnMut(usize) -> f64) -> usize {
    let warm_until = Instant::now() + Duration::from_millis(50);
    let mut k = 1;
    let mut ns = timer(k);
    while Instant::now() < warm_until {
        ns = timer(k);
        if ns * (k as f64) < 1e5 {
            k *= 2;
        }
    }
    ((BATCH.as_nanos() as f64 / ns) as usize).max(1)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
