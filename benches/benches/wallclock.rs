//! Wall-clock time (criterion) of one select + book + release through the
//! host's `WorkerSelectionService`, for every built-in mode and the default
//! KV policy at temperature 0 and 0.7, at 2, 32, 1,024, 2,048 and 10,000
//! workers. The fixture is `selkie_benches::host_fixture`.
//!
//! ```text
//! cargo bench -p selkie-benches --bench wallclock
//! ```
//!
//! Timings on a shared machine are noisy, so after criterion's own output
//! the bench prints a summary read back from criterion's estimates of this
//! run: each case's median, its time per worker, and its ratio to `random`
//! at the same worker count (the targets are ratios within one run).
//! Short by design: 1 s warm-up, 2 s measurement, 20 samples per case.
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use criterion::{BenchmarkId, Criterion};
use selkie_benches::host_fixture::{HostFixture, Mode};

/// Worker counts of Dynamo's `worker_selection` bench.
const WORKER_COUNTS: [usize; 5] = [2, 32, 1_024, 2_048, 10_000];
/// Criterion's group name (a directory under its output directory).
const GROUP: &str = "select_book_release";

/// One measured configuration: a mode and, for `kv`, a temperature.
#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    mode: Mode,
    temperature: f64,
}

/// Every case; `random` first (the summary's reference).
const CASES: [Case; 8] = [
    case("random", Mode::Random, 0.0),
    case("round-robin", Mode::RoundRobin, 0.0),
    case("least-loaded", Mode::LeastLoaded, 0.0),
    case("power-of-two", Mode::PowerOfTwo, 0.0),
    case("device-aware-weighted", Mode::DeviceAwareWeighted, 0.0),
    case("direct", Mode::Direct, 0.0),
    case("kv-t0", Mode::Kv, 0.0),
    case("kv-t0.7", Mode::Kv, 0.7),
];

const fn case(name: &'static str, mode: Mode, temperature: f64) -> Case {
    Case {
        name,
        mode,
        temperature,
    }
}

fn main() {
    let started = SystemTime::now();
    let output = criterion_home();
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .output_directory(&output)
        .configure_from_args();
    {
        let mut group = c.benchmark_group(GROUP);
        for &n in &WORKER_COUNTS {
            for case in CASES {
                let fixture = HostFixture::new(case.mode, n, case.temperature);
                group.bench_with_input(BenchmarkId::new(case.name, n), &fixture, |b, f| {
                    b.iter(|| f.select_and_release())
                });
            }
        }
        group.finish();
    }
    c.final_summary();
    summary(&output, started);
}

/// Where criterion writes its estimates: `<target dir>/criterion`, found
/// from this executable's path (`<target>/<profile>/deps/wallclock-*`), or
/// `$CRITERION_HOME` when set.
fn criterion_home() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.ancestors().nth(3).map(|t| t.join("criterion")))
        .unwrap_or_else(|| PathBuf::from("target/criterion"))
}

/// Prints this run's medians and ratios to `random`, from criterion's
/// `new/estimates.json` files written since `started`. Prints nothing when a
/// case has no such estimate (`cargo test --benches` times nothing; a filter
/// skips cases), so figures of different runs are never mixed.
fn summary(output: &Path, started: SystemTime) {
    let median = |case: &Case, n: usize| {
        let file = output
            .join(GROUP)
            .join(case.name)
            .join(n.to_string())
            .join("new/estimates.json");
        let fresh = std::fs::metadata(&file)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= started);
        if !fresh {
            return None;
        }
        std::fs::read_to_string(file).ok().and_then(|json| median_ns(&json))
    };
    let mut rows = Vec::new();
    for &n in &WORKER_COUNTS {
        let Some(reference) = median(&CASES[0], n) else {
            return;
        };
        for case in &CASES {
            let Some(ns) = median(case, n) else { return };
            rows.push((n, case.name, ns, ns / reference));
        }
    }
    println!();
    println!("select + book + release, median of this run (ratio = time / random at the same worker count):");
    println!(
        "{:>7} {:<22} {:>12} {:>12} {:>9}",
        "workers", "mode", "ns/select", "ns/worker", "x random"
    );
    for (n, name, ns, ratio) in rows {
        println!("{n:>7} {name:<22} {ns:>12.1} {:>12.3} {ratio:>8.2}x", ns / n as f64);
    }
}

/// The median's point estimate (ns) in criterion's `estimates.json`.
fn median_ns(json: &str) -> Option<f64> {
    let rest = &json[json.find("\"median\"")?..];
    let rest = &rest[rest.find("\"point_estimate\":")? + "\"point_estimate\":".len()..];
    let end = rest.find([',', '}'])?;
    rest[..end].trim().parse().ok()
}
