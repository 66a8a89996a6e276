//! Instruction counts (callgrind) of every kernel, SIMD next to its scalar
//! reference, and of the host's select-and-book path, at 8, 64, 1,024 and
//! 10,000 workers. Budgets: `benches/icount-budgets.toml`, checked by
//! `benches/check_budgets.py` (see BENCHMARKS.md).
//!
//! ```text
//! cargo bench -p selkie-benches --features icount --bench icount
//! ```
//!
//! Inputs are built by the setup function named in each case's id and
//! dropped by the `release` teardown, both outside the measured region; the
//! measured region is the call alone. The host fixtures are boxed, so the
//! harness moves a pointer in and out of the measured function, not the
//! fixture.
//!
//! * `fleet(n)`: load columns read from a real kernel `Fleet` whose tagged
//!   atomic counters hold Dynamo's fixture load as `Booking`s (non-zero
//!   counters), eligibility from the fleet's selectable rows
//!   ([`KernelFixture`]).
//! * `slices(n)`: the same numbers as plain `u32` / `f32` slices: the
//!   pure-kernel cases (the cost column for the pickers is the fleet's KV
//!   cost, computed in setup).
//! * `service_MODE(n)` (`service_random`, ..., `service_prefix_hash`, `service_kv_t0`,
//!   `service_kv_t07`, `service_kv_keyed_t0`): a `WorkerSelectionService`
//!   with that built-in policy ([`HostFixture`]); the measured call is
//!   `select` + drop of the booking. The modes whose request is plain
//!   (random, round-robin, least-loaded, power-of-two, device-aware) send
//!   `SelectionRequest::new(2048)` built in the call, the token count
//!   hidden from the compiler as a router's is; the others build the
//!   fixture's request for their mode. The `kv` cases send row-indexed
//!   overlaps on every worker; `host_kv_keyed_t0` sends them keyed by worker.
//! * `stream(n)`: a KV index holding every event of `vs_dynamo_index`'s
//!   generated stream `n`; `index_stream_queries` runs its first 500
//!   queries.
//!
//! Callgrind runs without cache simulation: only instruction counts are
//! reported and budgeted.

// `#[library_benchmark]` wraps each function in a generated module and
// rejects doc attributes on it, so those modules cannot be documented.
#![allow(missing_docs)]

use iai_callgrind::{library_benchmark, library_benchmark_group, main, Callgrind, LibraryBenchmarkConfig};
use selkie::WorkerWithDpRank;
use selkie_benches::host_fixture::{HostFixture, Mode};
use selkie_benches::index_fixture::IndexFixture;
use selkie_benches::kernel_fixture::KernelFixture;
use selkie_kernel::kernels::device_aware::{
    device_aware, device_aware_reference, DeviceAwareChoice, DeviceAwareConfig,
};
use selkie_kernel::kernels::index::{
    power_of_two, power_of_two_reference, random, random_reference, round_robin, round_robin_reference,
};
use selkie_kernel::kernels::kv_cost::{
    kv_cost, kv_cost_argmin, kv_cost_argmin_reference, kv_cost_reference, CostRange, KvChoice, KvCostError, KvLoad,
    KvOverlap,
};
use selkie_kernel::kernels::least_loaded::{
    least_loaded, least_loaded_reference, least_loaded_weighted, least_loaded_weighted_reference,
};
use selkie_kernel::kernels::pick::{
    first_non_finite, first_non_finite_reference, pick, pick_min, pick_min_reference, pick_reference, pick_softmax,
    pick_softmax_reference,
};
use selkie_kernel::kernels::rendezvous::{
    bounded_rendezvous, bounded_rendezvous_reference, RendezvousPick, DEFAULT_LOAD_FACTOR,
};
use selkie_kernel::KernelError;
use std::hint::black_box;

/// Temperature of the sampling cases.
const T: f32 = 0.7;

type Picked = Result<Option<usize>, KernelError>;

/// Kernel inputs whose load columns the case reads from the fleet.
fn fleet(n: usize) -> KernelFixture {
    KernelFixture::new(n)
}

/// Kernel inputs whose columns the case reads from plain slices.
fn slices(n: usize) -> KernelFixture {
    KernelFixture::new(n)
}

/// Drops the inputs outside the measured region.
fn release<T>(inputs: T) {
    drop(black_box(inputs));
}

// ---- least-loaded ---------------------------------------------------------

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn least_loaded_simd(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = black_box(least_loaded(black_box(&f.active[..]), black_box(&f.mask), &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn least_loaded_scalar(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = black_box(least_loaded_reference(
        black_box(&f.active[..]),
        black_box(&f.mask),
        &mut f.rng,
    ));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn least_loaded_fleet_simd(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = {
        let active = f.fleet.active_requests();
        black_box(least_loaded(black_box(&active), black_box(&f.mask), &mut f.rng))
    };
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn least_loaded_fleet_scalar(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = {
        let active = f.fleet.active_requests();
        black_box(least_loaded_reference(
            black_box(&active),
            black_box(&f.mask),
            &mut f.rng,
        ))
    };
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn weighted_fleet_simd(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = {
        let (active, inv) = (f.fleet.active_requests(), f.fleet.inv_capacity_weight());
        black_box(least_loaded_weighted(&active, &inv, black_box(&f.mask), &mut f.rng))
    };
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn weighted_fleet_scalar(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = {
        let (active, inv) = (f.fleet.active_requests(), f.fleet.inv_capacity_weight());
        black_box(least_loaded_weighted_reference(
            &active,
            &inv,
            black_box(&f.mask),
            &mut f.rng,
        ))
    };
    (row, f)
}

library_benchmark_group!(
    name = least_loaded_group;
    benchmarks = least_loaded_simd, least_loaded_scalar, least_loaded_fleet_simd, least_loaded_fleet_scalar,
        weighted_fleet_simd, weighted_fleet_scalar
);

// ---- index modes: random, round-robin, power-of-two -----------------------

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn random_simd(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = black_box(random(f.fleet.scan_rows(), black_box(&f.mask), &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn random_scalar(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = black_box(random_reference(f.fleet.scan_rows(), black_box(&f.mask), &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn round_robin_simd(f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let ticket = u64::from(f.fleet.next_ticket());
    let row = black_box(round_robin(f.fleet.scan_rows(), black_box(&f.mask), ticket));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn round_robin_scalar(f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let ticket = u64::from(f.fleet.next_ticket());
    let row = black_box(round_robin_reference(f.fleet.scan_rows(), black_box(&f.mask), ticket));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn power_of_two_simd(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = {
        let active = f.fleet.active_requests();
        black_box(power_of_two(black_box(&active), black_box(&f.mask), &mut f.rng))
    };
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn power_of_two_scalar(mut f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = {
        let active = f.fleet.active_requests();
        black_box(power_of_two_reference(
            black_box(&active),
            black_box(&f.mask),
            &mut f.rng,
        ))
    };
    (row, f)
}

library_benchmark_group!(
    name = index_group;
    benchmarks = random_simd, random_scalar, round_robin_simd, round_robin_scalar, power_of_two_simd,
        power_of_two_scalar
);

// ---- KV cost, and KV cost + pick ------------------------------------------

/// The fleet's KV cost columns into `f.costs` (SIMD or reference).
#[inline(always)]
fn fleet_kv_cost(f: &mut KernelFixture, simd: bool) -> CostRange {
    let fleet = &*f.fleet;
    let (p, d, a) = (
        fleet.active_prefill_tokens(),
        fleet.active_decode_blocks(),
        fleet.active_requests(),
    );
    let load = KvLoad::new(&p, &d, &a);
    let overlap = KvOverlap {
        device_blocks: Some(&f.device_blocks),
        cached_tokens: Some(&f.cached_tokens),
        ..KvOverlap::default()
    };
    let (mask, out) = (black_box(&f.mask[..]), black_box(&mut f.costs[..]));
    let range = if simd {
        kv_cost(&f.config, &f.request, &load, &overlap, mask, out)
    } else {
        kv_cost_reference(&f.config, &f.request, &load, &overlap, mask, out)
    };
    range.expect("the fixture's columns are consistent")
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn kv_cost_simd(mut f: KernelFixture) -> (CostRange, KernelFixture) {
    let range = black_box(fleet_kv_cost(&mut f, true));
    (range, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn kv_cost_scalar(mut f: KernelFixture) -> (CostRange, KernelFixture) {
    let range = black_box(fleet_kv_cost(&mut f, false));
    (range, f)
}

/// The slices' KV cost into `f.costs` (SIMD or reference).
#[inline(always)]
fn slices_kv_cost(f: &mut KernelFixture, simd: bool) -> CostRange {
    let load = KvLoad::new(&f.prefill[..], &f.decode[..], &f.active[..]);
    let overlap = KvOverlap {
        device_blocks: Some(&f.device_blocks),
        cached_tokens: Some(&f.cached_tokens),
        ..KvOverlap::default()
    };
    let (mask, out) = (black_box(&f.mask[..]), black_box(&mut f.costs[..]));
    let range = if simd {
        kv_cost(&f.config, &f.request, &load, &overlap, mask, out)
    } else {
        kv_cost_reference(&f.config, &f.request, &load, &overlap, mask, out)
    };
    range.expect("the fixture's columns are consistent")
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn kv_cost_slices_simd(mut f: KernelFixture) -> (CostRange, KernelFixture) {
    let range = black_box(slices_kv_cost(&mut f, true));
    (range, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn kv_cost_slices_scalar(mut f: KernelFixture) -> (CostRange, KernelFixture) {
    let range = black_box(slices_kv_cost(&mut f, false));
    (range, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn kv_pick_t0_simd(mut f: KernelFixture) -> (Picked, KernelFixture) {
    fleet_kv_cost(&mut f, true);
    let row = black_box(pick(black_box(&f.costs[..]), &f.mask, 0.0, &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn kv_pick_t0_scalar(mut f: KernelFixture) -> (Picked, KernelFixture) {
    fleet_kv_cost(&mut f, false);
    let row = black_box(pick_reference(black_box(&f.costs[..]), &f.mask, 0.0, &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn kv_pick_t07_simd(mut f: KernelFixture) -> (Picked, KernelFixture) {
    fleet_kv_cost(&mut f, true);
    let row = black_box(pick(black_box(&f.costs[..]), &f.mask, T, &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn kv_pick_t07_scalar(mut f: KernelFixture) -> (Picked, KernelFixture) {
    fleet_kv_cost(&mut f, false);
    let row = black_box(pick_reference(black_box(&f.costs[..]), &f.mask, T, &mut f.rng));
    (row, f)
}

/// The fleet's KV cost and the temperature-0 pick in one pass (SIMD or
/// reference), no cost column.
#[inline(always)]
fn fleet_kv_cost_argmin(f: &mut KernelFixture, simd: bool) -> Result<Option<KvChoice>, KvCostError> {
    let fleet = &*f.fleet;
    let (p, d, a) = (
        fleet.active_prefill_tokens(),
        fleet.active_decode_blocks(),
        fleet.active_requests(),
    );
    let load = KvLoad::new(&p, &d, &a);
    let overlap = KvOverlap {
        device_blocks: Some(&f.device_blocks),
        cached_tokens: Some(&f.cached_tokens),
        ..KvOverlap::default()
    };
    let mask = black_box(&f.mask[..]);
    if simd {
        kv_cost_argmin(&f.config, &f.request, &load, &overlap, mask, &mut f.rng)
    } else {
        kv_cost_argmin_reference(&f.config, &f.request, &load, &overlap, mask, &mut f.rng)
    }
}

#[library_benchmark]
#[benches::workers(args = [1024, 10000], setup = fleet, teardown = release)]
fn kv_cost_argmin_fleet_simd(mut f: KernelFixture) -> (Result<Option<KvChoice>, KvCostError>, KernelFixture) {
    let choice = black_box(fleet_kv_cost_argmin(&mut f, true));
    (choice, f)
}

#[library_benchmark]
#[benches::workers(args = [1024, 10000], setup = fleet, teardown = release)]
fn kv_cost_argmin_fleet_scalar(mut f: KernelFixture) -> (Result<Option<KvChoice>, KvCostError>, KernelFixture) {
    let choice = black_box(fleet_kv_cost_argmin(&mut f, false));
    (choice, f)
}

library_benchmark_group!(
    name = kv_group;
    benchmarks = kv_cost_simd, kv_cost_scalar, kv_cost_slices_simd, kv_cost_slices_scalar, kv_pick_t0_simd, kv_pick_t0_scalar, kv_pick_t07_simd,
        kv_pick_t07_scalar, kv_cost_argmin_fleet_simd, kv_cost_argmin_fleet_scalar
);

// ---- pickers over a cost column --------------------------------------------

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn first_non_finite_simd(f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = black_box(first_non_finite(black_box(&f.costs[..]), black_box(&f.mask)));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn first_non_finite_scalar(f: KernelFixture) -> (Option<usize>, KernelFixture) {
    let row = black_box(first_non_finite_reference(black_box(&f.costs[..]), black_box(&f.mask)));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn pick_min_simd(mut f: KernelFixture) -> (Picked, KernelFixture) {
    let row = black_box(pick_min(black_box(&f.costs[..]), black_box(&f.mask), &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn pick_min_scalar(mut f: KernelFixture) -> (Picked, KernelFixture) {
    let row = black_box(pick_min_reference(
        black_box(&f.costs[..]),
        black_box(&f.mask),
        &mut f.rng,
    ));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn pick_softmax_simd(mut f: KernelFixture) -> (Picked, KernelFixture) {
    let row = black_box(pick_softmax(black_box(&f.costs[..]), black_box(&f.mask), T, &mut f.rng));
    (row, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = slices, teardown = release)]
fn pick_softmax_scalar(mut f: KernelFixture) -> (Picked, KernelFixture) {
    let row = black_box(pick_softmax_reference(
        black_box(&f.costs[..]),
        black_box(&f.mask),
        T,
        &mut f.rng,
    ));
    (row, f)
}

library_benchmark_group!(
    name = pick_group;
    benchmarks = first_non_finite_simd, first_non_finite_scalar, pick_min_simd, pick_min_scalar,
        pick_softmax_simd, pick_softmax_scalar
);

// ---- device-aware weighted -------------------------------------------------

type DeviceAwarePicked = Result<Option<DeviceAwareChoice>, KernelError>;

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn device_aware_simd(mut f: KernelFixture) -> (DeviceAwarePicked, KernelFixture) {
    let choice = {
        let active = f.fleet.active_requests();
        let config = DeviceAwareConfig::default();
        black_box(device_aware(
            black_box(&active),
            black_box(&f.cache_hits[..]),
            &f.is_cpu,
            black_box(&f.mask),
            &config,
            &mut f.rng,
        ))
    };
    (choice, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn device_aware_scalar(mut f: KernelFixture) -> (DeviceAwarePicked, KernelFixture) {
    let choice = {
        let active = f.fleet.active_requests();
        let config = DeviceAwareConfig::default();
        black_box(device_aware_reference(
            black_box(&active),
            black_box(&f.cache_hits[..]),
            &f.is_cpu,
            black_box(&f.mask),
            &config,
            &mut f.rng,
        ))
    };
    (choice, f)
}

library_benchmark_group!(name = device_aware_group; benchmarks = device_aware_simd, device_aware_scalar);

// ---- bounded-load rendezvous (prefix hashing) ------------------------------

type RendezvousPicked = Result<Option<RendezvousPick>, KernelError>;

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn rendezvous_simd(f: KernelFixture) -> (RendezvousPicked, KernelFixture) {
    let choice = {
        let (active, salts) = (f.fleet.active_requests(), f.fleet.rendezvous_salts());
        black_box(bounded_rendezvous(
            black_box(0x5EED_F00D),
            black_box(&active),
            black_box(&salts),
            black_box(&f.mask),
            DEFAULT_LOAD_FACTOR,
        ))
    };
    (choice, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = fleet, teardown = release)]
fn rendezvous_scalar(f: KernelFixture) -> (RendezvousPicked, KernelFixture) {
    let choice = {
        let (active, salts) = (f.fleet.active_requests(), f.fleet.rendezvous_salts());
        black_box(bounded_rendezvous_reference(
            black_box(0x5EED_F00D),
            black_box(&active),
            black_box(&salts),
            black_box(&f.mask),
            DEFAULT_LOAD_FACTOR,
        ))
    };
    (choice, f)
}

library_benchmark_group!(name = rendezvous_group; benchmarks = rendezvous_simd, rendezvous_scalar);

// ---- the host: select + book, then drop of the booking ---------------------

fn service_random(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::Random, n, 0.0))
}
fn service_round_robin(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::RoundRobin, n, 0.0))
}
fn service_least_loaded(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::LeastLoaded, n, 0.0))
}
fn service_power_of_two(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::PowerOfTwo, n, 0.0))
}
fn service_device_aware(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::DeviceAwareWeighted, n, 0.0))
}
fn service_prefix_hash(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::PrefixHash, n, 0.0))
}
fn service_direct(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::Direct, n, 0.0))
}
fn service_kv_t0(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::Kv, n, 0.0))
}
fn service_kv_t07(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::Kv, n, f64::from(T)))
}
/// `kv` at temperature 0 with the overlaps keyed by worker rank (mapped to
/// rows through the row index's table) instead of row columns.
fn service_kv_keyed_t0(n: usize) -> Box<HostFixture> {
    Box::new(HostFixture::new(Mode::Kv, n, 0.0).worker_keyed())
}

/// The measured host call.
#[inline(always)]
fn select_and_release(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    let worker = black_box(f.select_and_release());
    (worker, f)
}

/// The measured host call of a mode whose request is plain, built as a
/// router builds it (`HostFixture::select_plain_and_release`).
#[inline(always)]
fn select_plain_and_release(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    let worker = black_box(f.select_plain_and_release());
    (worker, f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_random, teardown = release)]
fn host_random(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_plain_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_round_robin, teardown = release)]
fn host_round_robin(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_plain_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_least_loaded, teardown = release)]
fn host_least_loaded(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_plain_and_release(f)
}

/// Least-loaded with one worker marked overloaded (`set_overloaded`): the
/// marks are a mask of the registry snapshot, so one mark must not turn
/// every selection into a per-row busy check.
fn service_least_loaded_marked(n: usize) -> Box<HostFixture> {
    let f = Box::new(HostFixture::new(Mode::LeastLoaded, n, 0.0));
    f.service.set_overloaded(1, true).expect("worker 1 is registered");
    f.select_and_release(); // warm the new registry snapshot
    f
}

#[library_benchmark]
#[benches::workers(args = [1024, 10000], setup = service_least_loaded_marked, teardown = release)]
fn host_least_loaded_marked(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_plain_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_power_of_two, teardown = release)]
fn host_power_of_two(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_plain_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_device_aware, teardown = release)]
fn host_device_aware(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_plain_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_prefix_hash, teardown = release)]
fn host_prefix_hash(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_direct, teardown = release)]
fn host_direct(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_kv_t0, teardown = release)]
fn host_kv_t0(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [8, 64, 1024, 10000], setup = service_kv_t07, teardown = release)]
fn host_kv_t07(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_and_release(f)
}

#[library_benchmark]
#[benches::workers(args = [1024, 10000], setup = service_kv_keyed_t0, teardown = release)]
fn host_kv_keyed_t0(f: Box<HostFixture>) -> (WorkerWithDpRank, Box<HostFixture>) {
    select_and_release(f)
}

/// The KV index in the path: tokens to a booked and released worker
/// (`IndexFixture`: hash the 2,048-token prompt, query the index, select,
/// book, release) on a fleet whose engines reported what they hold.
fn service_kv_index(n: usize) -> Box<IndexFixture> {
    Box::new(IndexFixture::new(n))
}

#[library_benchmark]
#[benches::workers(args = [1024], setup = service_kv_index, teardown = release)]
fn host_kv_index_t0(mut f: Box<IndexFixture>) -> (WorkerWithDpRank, Box<IndexFixture>) {
    let worker = black_box(f.select_and_release());
    (worker, f)
}

/// The KV index's queries on a generated stream of `vs_dynamo_index`'s
/// family (`benches/src/index_streams.rs`): `stream(0)` branching on 8
/// workers, `stream(2)` on 1,000; every event applied in setup, as that
/// bench builds the index. Measured: the stream's first 500 queries (1 to
/// 160 blocks each, by local hashes), one output reused.
struct StreamQueries {
    index: selkie::kv_index::KvIndex,
    queries: Vec<Vec<u64>>,
    out: selkie::kv_index::KvOverlaps,
}

/// Queries a `StreamQueries` case runs.
const STREAM_QUERIES: usize = 500;

fn stream(which: usize) -> Box<StreamQueries> {
    use selkie_benches::index_streams::{feed, Stream, FAMILY};
    let stream = Stream::generate(&FAMILY[which]);
    let service = stream.service(16);
    let mut index = selkie::kv_index::KvIndex::new(16);
    feed(&stream.index_events(), &mut index, Some(&service));
    let mut out = selkie::kv_index::KvOverlaps::new();
    let queries: Vec<Vec<u64>> = stream.queries.iter().take(STREAM_QUERIES).cloned().collect();
    // One query first, so the columns are sized outside the measured call.
    index
        .overlaps_for_local_hashes(&queries[0], &mut out)
        .expect("rows are synced");
    Box::new(StreamQueries { index, queries, out })
}

#[library_benchmark]
#[benches::streams(args = [0, 2], setup = stream, teardown = release)]
fn index_stream_queries(mut f: Box<StreamQueries>) -> Box<StreamQueries> {
    let StreamQueries { index, queries, out } = &mut *f;
    for q in queries.iter() {
        let columns = index.overlaps_for_local_hashes(q, out).expect("rows are synced");
        black_box(columns.device_blocks.len());
    }
    f
}

library_benchmark_group!(
    name = host_group;
    benchmarks = host_random, host_round_robin, host_least_loaded, host_least_loaded_marked, host_power_of_two,
        host_device_aware, host_prefix_hash, host_direct, host_kv_t0, host_kv_t07, host_kv_keyed_t0, host_kv_index_t0,
        index_stream_queries
);

main!(
    config = LibraryBenchmarkConfig::default().tool(Callgrind::with_args(["--cache-sim=no"]));
    library_benchmark_groups = least_loaded_group, index_group, kv_group, pick_group, device_aware_group,
        rendezvous_group, host_group
);
