//! selkie against dynamo-kv-router 1.6.1, side by side in one run.
//!
//! ```text
//! cargo bench -p selkie-benches --features dynamo --bench vs_dynamo
//! cargo bench -p selkie-benches --features dynamo-core --bench vs_dynamo   # + Dynamo's full path
//! ```
//!
//! **Selector anchor.** Dynamo's `DefaultWorkerSelector::select_worker`
//! (exactly the call Dynamo's `worker_selection` bench times) against
//! selkie on the same state and request, in two scenarios: Dynamo's own
//! fixture (2, 32, 1,024, 2,048 and 10,000 workers) and seeded random fleets
//! (1,024 and 10,000 workers, varied loads, overlaps on 60% of workers), at
//! temperature 0 and 0.7. selkie is timed two ways:
//!
//! * **public API**: one select + book + release through
//!   `selkie::WorkerSelectionService` (KV policy), what a router pays, with
//!   the request's overlaps in two forms: per-row columns
//!   (`SelectionRequest::with_row_overlaps`, what a KV indexer hands over)
//!   and **worker-keyed** (`SelectionRequest::with_overlaps`, one entry per
//!   worker with a hit, in a shuffled order: what a router holding
//!   Dynamo-style `OverlapScores` passes);
//! * **kernel path**: the kernel calls alone on a kernel `Fleet` holding the
//!   same load (eligibility, overlap scatter, `kv_cost`, pick), and the same
//!   on plain slices.
//!
//! **Full-path anchor** (feature `dynamo-core`). Dynamo's
//! `SelectionCore::select_and_reserve` + `free_reservation`, as its
//! `selection_core` bench runs it (8, 64 and 512 idle workers, a 256-token
//! prompt, nothing cached), against selkie's public API on the same fleet
//! and prompt.
//!
//! Before timing anything, the parity check
//! (`selkie_benches::vs_dynamo::parity`) runs on every scenario and the bench
//! exits non-zero if any cost, temperature-0 pick or temperature-0.7
//! sampling check of any selkie path disagrees with Dynamo.
//!
//! Output (stdout, Markdown): the summary table first (every case, Dynamo
//! against selkie's public API, the target verdict), then the parity lines
//! and the detail tables. Progress goes to stderr.
//!
//! Timing is a hand-rolled loop rather than criterion, because the point is
//! ratios measured in one run: the calls being compared take turns in
//! batches of about a millisecond (the order rotates every round) for
//! [`ROUNDS`] rounds, and the tables report each call's median batch time
//! per call and the ratio of the medians. Dynamo's crate is the one on
//! crates.io, built with this workspace's bench profile (thin LTO, one
//! codegen unit, no `target-cpu`: selkie's kernel picks its SIMD backend at
//! run time).
use std::hint::black_box;
use std::process::ExitCode;
use std::time::Duration;

use selkie_benches::timing::{batch, Timing};

use selkie_benches::vs_dynamo::report::{self, CoreRow, SelectorRow, Table};
use selkie_benches::vs_dynamo::{
    parity, scenarios, Drivers, DynamoFixture, LoadSource, OverlapForm, Scenario, SelkieFixture, BLOCK_SIZE,
    PROMPT_TOKENS, RANDOM_HIT_PERCENT, RANDOM_SEED, TEMPERATURES, WORKER_COUNTS,
};

/// Timed rounds per comparison; each round times one batch of each call.
const ROUNDS: usize = 101;
/// Target wall time of one batch.
const BATCH: Duration = Duration::from_millis(1);
/// The timing loop of the run.
const TIMING: Timing = Timing {
    rounds: ROUNDS,
    batch: BATCH,
};
/// Picks per sampler in the temperature-0.7 parity check.
const PARITY_SAMPLES: usize = 1_000;

fn main() -> ExitCode {
    let mut cases: Vec<(Scenario, Drivers)> = Vec::new();
    let mut parity_lines = Vec::new();
    for (case, n) in scenarios() {
        progress(format_args!("building and checking {case}, {n} workers"));
        let scenario = case.build(n);
        let mut drivers = Drivers::new(&scenario);
        match parity::check_drivers(&scenario, &mut drivers, PARITY_SAMPLES) {
            Ok(report) => parity_lines.push(format!("- ok: {report}")),
            Err(e) => {
                eprintln!("PARITY FAILED on {case} at {n} workers: {e}");
                return ExitCode::FAILURE;
            }
        }
        cases.push((scenario, drivers));
    }

    let mut rows = Vec::new();
    for (scenario, drivers) in &mut cases {
        for &t in &TEMPERATURES {
            progress(format_args!(
                "timing {}, {} workers, T={t}",
                scenario.case(),
                scenario.len()
            ));
            rows.push(time_selectors(scenario, drivers, t));
        }
    }
    drop(cases);
    let core = time_core();

    println!("# selkie vs dynamo-kv-router 1.6.1");
    println!();
    println!(
        "Per call: median of {ROUNDS} interleaved batches of ~{BATCH:?}, one run; ratio = Dynamo / selkie. \
         Public API = select + book + release through `selkie::WorkerSelectionService`."
    );
    println!();
    println!("## Summary: Dynamo against selkie's public API");
    println!();
    print!("{}", report::summary(&rows, &core));
    println!();
    println!("## Parity with Dynamo (checked before timing; every worker's cost, T=0 picks, T=0.7 sampling)");
    println!();
    for line in &parity_lines {
        println!("{line}");
    }
    println!();
    println!("## Selector: `DefaultWorkerSelector::select_worker` against selkie, public API and kernel path");
    println!();
    println!(
        "fixture: Dynamo's `worker_selection` fixture; random: seed {RANDOM_SEED:#x}, 0-48 requests per worker \
         of 1-512 blocks each, up to two prefilling, overlaps on {RANDOM_HIT_PERCENT}% of workers (1-128 blocks). \
         Request: {PROMPT_TOKENS} prompt tokens, block size {BLOCK_SIZE}."
    );
    for source in LoadSource::ALL {
        println!("kernel path on {}: {}", source.name(), source.describe());
    }
    println!();
    print!("{}", report::selector_details(&rows));
    print_core(&core);
    print_stages();
    ExitCode::SUCCESS
}

/// Dynamo's selector, selkie's public API and selkie's kernel path on each
/// load source, in turns, at temperature `t`.
fn time_selectors(scenario: &Scenario, drivers: &mut Drivers, t: f32) -> SelectorRow {
    let selector = DynamoFixture::selector(f64::from(t));
    let Drivers {
        dynamo,
        kernel,
        service,
    } = drivers;
    let [fleet, slices] = &mut kernel[..] else {
        unreachable!("one kernel driver per load source")
    };
    let [dynamo_ns, public_ns, keyed_ns, kernel_ns, slices_ns] = TIMING.interleaved([
        &mut batch(|| {
            black_box(dynamo.select(&selector));
        }),
        &mut batch(|| {
            black_box(service.select_as(OverlapForm::Rows, black_box(t)));
        }),
        &mut batch(|| {
            black_box(service.select_as(OverlapForm::Keyed, black_box(t)));
        }),
        &mut batch(|| {
            black_box(fleet.select(black_box(t)));
        }),
        &mut batch(|| {
            black_box(slices.select(black_box(t)));
        }),
    ]);
    SelectorRow {
        case: scenario.case(),
        workers: scenario.len(),
        temperature: t,
        dynamo_ns,
        public_ns,
        keyed_ns,
        kernel_ns,
        slices_ns,
    }
}

/// The full-path anchor, when built with `dynamo-core`.
#[cfg(feature = "dynamo-core")]
fn time_core() -> Vec<CoreRow> {
    use selkie_benches::vs_dynamo::{DynamoCore, ServiceFixture, CORE_PROMPT_TOKENS, CORE_WORKER_COUNTS};
    CORE_WORKER_COUNTS
        .iter()
        .map(|&n| {
            progress(format_args!("timing the full path, {n} workers"));
            let mut dynamo = DynamoCore::new(n);
            let selkie = ServiceFixture::idle(1, n as usize, CORE_PROMPT_TOKENS);
            let [dynamo_ns, public_ns] = TIMING.interleaved([
                &mut batch(|| {
                    black_box(dynamo.select_and_free());
                }),
                &mut batch(|| {
                    black_box(selkie.select(black_box(0.0)));
                }),
            ]);
            CoreRow {
                workers: n,
                dynamo_ns,
                public_ns,
            }
        })
        .collect()
}

#[cfg(not(feature = "dynamo-core"))]
fn time_core() -> Vec<CoreRow> {
    Vec::new()
}

fn print_core(core: &[CoreRow]) {
    println!();
    println!("## Full path: Dynamo's `SelectionCore` against selkie's public API");
    println!();
    if core.is_empty() {
        println!("(not built: add `--features dynamo-core`)");
        return;
    }
    println!(
        "Dynamo: `select_and_reserve` + `free_reservation` on a local core (`try_new_local`, KV events on, \
         no router queue), current-thread tokio runtime, `block_on` per request, as its `selection_core` bench \
         (`no_hints`). selkie: select + book + release. Both: workers 1..=n idle, block size {BLOCK_SIZE}, \
         prompt of 256 tokens, nothing cached, T = 0."
    );
    println!();
    print!("{}", report::core_details(core));
}

/// selkie's kernel path split into its stages, per load source, on
/// Dynamo's fixture.
fn print_stages() {
    for source in LoadSource::ALL {
        println!();
        println!(
            "## Kernel path on {} by stage, Dynamo's fixture: ns per call (ns per worker)",
            source.name()
        );
        println!();
        let mut table = Table::new(&["workers", "eligibility+scatter", "kv_cost", "pick T=0", "pick T=0.7"]);
        for &n in &WORKER_COUNTS {
            progress(format_args!(
                "timing the kernel stages on {}, {n} workers",
                source.name()
            ));
            let mut f = SelkieFixture::new(&Scenario::fixture(n), source);
            f.scatter_hits();
            f.cost_rows();
            let scatter = TIMING.one(|| f.scatter_hits());
            let cost = TIMING.one(|| {
                black_box(f.cost_rows());
            });
            let pick0 = TIMING.one(|| {
                black_box(f.pick_row(0.0));
            });
            let pick7 = TIMING.one(|| {
                black_box(f.pick_row(0.7));
            });
            let cell = |ns: f64| format!("{ns:.1} ({:.3})", ns / n as f64);
            table.row(vec![n.to_string(), cell(scatter), cell(cost), cell(pick0), cell(pick7)]);
        }
        print!("{}", table.render());
    }
}

fn progress(what: std::fmt::Arguments<'_>) {
    eprintln!("vs_dynamo: {what}");
}
