//! Instruction counts (callgrind) of the kernels, SIMD against the scalar
//! reference, at 8, 64, 1,024 and 10,000 workers. Inputs are built in setup
//! functions, outside the measured region. Budgets: `icount-budgets.toml`.
use iai_callgrind::{library_benchmark, library_benchmark_group, main};
use selkie_benches::{all_eligible, fixture_active};
use selkie_kernel::kernels::least_loaded::{least_loaded, least_loaded_reference};
use selkie_kernel::Rng;
use std::hint::black_box;

fn active_fleet(n: usize) -> (Vec<u32>, Vec<u64>, Rng) {
    (fixture_active(n), all_eligible(n), Rng::new(42))
}

type Inputs = (Vec<u32>, Vec<u64>, Rng);

/// Drops the inputs outside the measured region.
fn release<T>(inputs: T) {
    drop(black_box(inputs));
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = active_fleet, teardown = release)]
fn least_loaded_simd((active, mask, mut rng): Inputs) -> (Option<usize>, Inputs) {
    let row = black_box(least_loaded(black_box(&active[..]), black_box(&mask), &mut rng));
    (row, (active, mask, rng))
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = active_fleet, teardown = release)]
fn least_loaded_scalar((active, mask, mut rng): Inputs) -> (Option<usize>, Inputs) {
    let row = black_box(least_loaded_reference(black_box(&active[..]), black_box(&mask), &mut rng));
    (row, (active, mask, rng))
}

library_benchmark_group!(name = least_loaded_group; benchmarks = least_loaded_simd, least_loaded_scalar);
main!(library_benchmark_groups = least_loaded_group);
