//! Differential target: SIMD least-loaded (plain and weighted) against its
//! scalar reference, on arbitrary columns, masks, lengths and seeds: over
//! slices, and over the fleet's atomic columns (raw values, tagged counters
//! and inverse capacity weights, up to 192 rows so whole 64-row blocks and a
//! tail are read) against the same values as slices.
//!
//! Shared by `fuzz/fuzz_targets/least_loaded_diff.rs` and the regression replay in
//! `kernel/tests/fuzz_regressions.rs` (`#[path]`); see FUZZING.md.

use arbitrary::Arbitrary;
use selkie_kernel::fleet::{capacity_weight_ok, BookLoad, Fleet, WorkerSpec, UNLIMITED};
use selkie_kernel::kernels::least_loaded::{
    least_loaded, least_loaded_reference, least_loaded_weighted, least_loaded_weighted_reference,
};
use selkie_kernel::lanes::{F32Source, U32Source};
use selkie_kernel::Rng;

/// 192 rows: three 64-row blocks, the last one partly occupied.
const GROUPS: usize = 24;

/// `Debug` prints a pasteable reproducer.
#[derive(Arbitrary, Debug)]
pub struct Input {
    pub active: Vec<u32>,
    pub inv_weight: Vec<f32>,
    pub mask: Vec<u64>,
    pub seed: u64,
}

/// SIMD and reference least-loaded (and, where the weights are finite and
/// non-negative, weighted) on one pair of sources: same row, same draws.
fn compare<A, W>(simd_active: &A, simd_inv: &W, active: &[u32], inv: &[f32], input: &Input, what: &str)
where
    A: U32Source + ?Sized,
    W: F32Source + ?Sized,
{
    let (mut a, mut b) = (Rng::new(input.seed), Rng::new(input.seed));
    let simd = least_loaded(simd_active, &input.mask, &mut a);
    let reference = least_loaded_reference(active, &input.mask, &mut b);
    assert_eq!(simd, reference, "{what}: {input:?}");
    assert_eq!(a, b, "{what}: draws differ: {input:?}");

    // Weighted form: NaN weights are excluded by the fleet (weights are
    // validated finite and > 0), so only finite, non-negative weights here.
    if inv.iter().all(|w| w.is_finite() && *w >= 0.0) {
        let simd = least_loaded_weighted(simd_active, simd_inv, &input.mask, &mut a);
        let reference = least_loaded_weighted_reference(active, inv, &input.mask, &mut b);
        assert_eq!(simd, reference, "{what} weighted: {input:?}");
        assert_eq!(a, b, "{what} weighted: draws differ: {input:?}");
    }
}

/// The check the fuzz target runs on every input (panics on a finding).
pub fn check(input: &Input) {
    compare(
        &input.active[..],
        &input.inv_weight[..],
        &input.active,
        &input.inv_weight,
        input,
        "slices",
    );

    // The same kernels over a fleet's atomic columns. Row i holds worker i
    // with dp rank `active[i]` (a raw column of arbitrary values), `active[i]
    // % 4` requests booked (a tagged counter column) and capacity weight
    // `inv_weight[i]` where that is a valid weight (1 otherwise).
    let fleet = Fleet::<GROUPS>::new();
    let n = input.active.len().min(Fleet::<GROUPS>::CAPACITY);
    let mut bookings = Vec::new();
    let mut weights = Vec::with_capacity(n);
    for (row, &value) in input.active[..n].iter().enumerate() {
        let weight = input
            .inv_weight
            .get(row)
            .copied()
            .filter(|&w| capacity_weight_ok(w))
            .unwrap_or(1.0);
        let spec = WorkerSpec {
            worker_id: row as u64,
            dp_rank: value,
            capacity_weight: weight,
            admission_limit: UNLIMITED,
        };
        weights.push(weight);
        let slot = fleet.add(spec).expect("a valid worker in a free row");
        assert_eq!(slot.row as usize, row);
        for _ in 0..value % 4 {
            bookings.push(fleet.book(row, BookLoad::default()).expect("unlimited row"));
        }
    }
    let rows = fleet.scan_rows();
    let ranks: Vec<u32> = (0..rows).map(|r| if r < n { input.active[r] } else { 0 }).collect();
    let requests: Vec<u32> = ranks.iter().map(|v| v % 4).collect();
    let inv: Vec<f32> = (0..rows).map(|r| weights.get(r).map_or(0.0, |w| 1.0 / w)).collect();
    let view = fleet.inv_capacity_weight();
    for (r, w) in inv.iter().enumerate() {
        assert_eq!(
            F32Source::value(&view, r).to_bits(),
            w.to_bits(),
            "row {r}: inverse weight"
        );
    }
    compare(
        &fleet.dp_ranks(),
        &fleet.inv_capacity_weight(),
        &ranks,
        &inv,
        input,
        "fleet raw column",
    );
    compare(
        &fleet.active_requests(),
        &fleet.inv_capacity_weight(),
        &requests,
        &inv,
        input,
        "fleet counters",
    );
    drop(bookings);
    assert!(
        (0..n).all(|r| fleet.outstanding(r).is_some_and(|o| o.requests == 0)),
        "{input:?}"
    );
}
