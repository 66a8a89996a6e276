//! The KV cost and the temperature-0 pick in one pass: [`kv_cost_argmin`]
//! computes each lane group's costs in registers and keeps only what the
//! argmin needs, with no cost column.
//!
//! ```text
//! per mask word of whole lane groups:
//!     c    = each group's cost lanes; hi = max(hi, c)              (NaN ignored)
//!     the word's lane-wise least cost (ineligible lanes +inf, NaN passed
//!     over) goes to the argmin's pass-1 state (`argmin::Least`)
//! the rows past the last whole lane group: their costs one by one
//! min, hi not both finite: refuse (NonFiniteCost) if an eligible cost is,
//!     as the checked pick does
//! the rest is the argmin's (`argmin::pick_least`): the tie cells, the
//! rejection draw, the tie count and the k-th tie, reading single rows'
//! and words' costs again (computed the same way) where it needs them
//! ```
//!
//! `hi` only decides whether the finiteness check runs (which reads eligible
//! rows only): the one-shape loops of `fast` fold a partly eligible group's
//! ineligible lanes into it too, instead of masking them per group.
//!
//! The result, the draws and the error are those of [`kv_cost`](super::kv_cost)
//! followed by [`pick_in_range`](crate::kernels::pick::pick_in_range) at
//! temperature 0 (the argmin over the cost column), which the differential
//! tests check.
//!
//! This module must not book or allocate.

use super::fast::Plan;
use super::{
    check, cost_lanes, prepare, row_cost, row_inputs, CostRange, KvCostConfig, KvCostError, KvLoad, KvOverlap,
    KvRequest, Prepared,
};
use crate::kernels::argmin::{
    argmin_reference_by, least_room, pick_in_one_word, pick_least, ArgminKey, Least, REMEMBERED_WORDS,
};
use crate::lanes::{U32Source, LANES};
use crate::mask::{contains, group_bits};
use crate::simd::{dispatch, F32Lanes, Simd, U32Lanes};
use crate::Rng;

/// The row [`kv_cost_argmin`] chose and its cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvChoice {
    /// The chosen row.
    pub row: usize,
    /// Its KV cost (the least eligible cost).
    pub cost: f32,
}

dispatch! {
    /// The default KV cost of every eligible row and the temperature-0 pick
    /// over it, in one pass without a cost column (SIMD): the eligible row of
    /// least cost, ties uniformly at random, and its cost.
    ///
    /// The same row, draws and errors as [`kv_cost`](super::kv_cost) into a
    /// column followed by
    /// [`pick_in_range`](crate::kernels::pick::pick_in_range) at
    /// temperature 0 (no draw when one eligible row has the least cost);
    /// `Ok(None)` when no row is eligible (or every eligible cost is NaN);
    /// [`KvCostError::NonFiniteCost`] when an eligible cost is infinite
    /// (naming the first NaN or infinite eligible row); the configuration
    /// and column checks of `kv_cost`.
    ///
    /// ```
    /// use core::num::NonZeroU32;
    /// use selkie_kernel::kernels::kv_cost::{kv_cost_argmin, KvChoice, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole};
    /// use selkie_kernel::Rng;
    /// let (prefill, decode, active) = ([0u32, 64], [2u32, 0], [0u32, 0]);
    /// let device = [4.0f32, 0.0];
    /// let request = KvRequest::new(128, NonZeroU32::new(16).unwrap(), true, WorkerRole::Prefill);
    /// let overlap = KvOverlap { device_blocks: Some(&device), ..KvOverlap::default() };
    /// let load = KvLoad::new(&prefill[..], &decode[..], &active[..]);
    /// let config = KvCostConfig::default();
    /// let choice = kv_cost_argmin(&config, &request, &load, &overlap, &[0b11], &mut Rng::new(1)).unwrap();
    /// // costs: row 0 = 128/16 - 4 + 2 = 6, row 1 = (64 + 128)/16 = 12
    /// assert_eq!(choice, Some(KvChoice { row: 0, cost: 6.0 }));
    /// ```
    pub fn kv_cost_argmin / kv_cost_argmin_on [L: U32Source + ?Sized] (
        config: &KvCostConfig,
        request: &KvRequest,
        load: &KvLoad<'_, L>,
        overlap: &KvOverlap<'_>,
        mask: &[u64],
        rng: &mut Rng,
    ) -> Result<Option<KvChoice>, KvCostError>
        = |s| kv_cost_argmin_in(s, config, request, load, overlap, mask, rng)
}

/// The cost column the argmin reads, computed where it is read: a row's
/// cost by the reference's row function, a lane group's by
/// [`cost_lanes`] (the same bits).
struct Costs<'a, 'p, L: ?Sized> {
    p: &'p Prepared,
    load: &'p KvLoad<'a, L>,
    overlap: &'p KvOverlap<'a>,
    rows: usize,
    /// The call's fast shape, if it has one: whole words read again by the
    /// argmin take its loops' costs (the same bits, fewer instructions).
    plan: Option<Plan<'a>>,
}

/// Tie cells the fused scan's argmin counts rather than draws over: a word
/// it reads again costs its eight groups' costs, about what eight tries
/// cost. The KV cost column's argmin takes the same bound, so that both draw
/// alike.
pub(crate) const FEW_TIE_CELLS: usize = 8;

impl<L: U32Source + ?Sized> ArgminKey for Costs<'_, '_, L> {
    type Key = f32;
    const FEW_CELLS: usize = FEW_TIE_CELLS;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn rows(&self) -> usize {
        self.rows
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key(&self, row: usize) -> f32 {
        row_cost(self.p, &row_inputs(self.load, self.overlap, self.p, row))
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key_in<S: Simd>(&self, s: S, row: usize) -> f32 {
        // The row's lane group in registers: the same bits as the row alone
        // (the differential tests check), in fewer instructions.
        let g = row / LANES;
        let lanes = match &self.plan {
            Some(plan) if g / 8 < plan.words() => plan.group_costs(s, g),
            _ => self.keys(s, g),
        };
        lanes.to_array()[row % LANES]
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys<S: Simd>(&self, s: S, group: usize) -> S::F32 {
        let avail = self.load.load_available.map_or(0xFF, |m| group_bits(m, group));
        cost_lanes(s, self.p, self.load, self.overlap, group, avail)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys8<S: Simd>(&self, s: S, first_group: usize) -> [S::F32; 8] {
        match &self.plan {
            Some(plan) if first_group / 8 < plan.words() => plan.word_costs(s, first_group / 8),
            _ => core::array::from_fn(|i| self.keys(s, first_group + i)),
        }
    }
}

/// The body of [`kv_cost_argmin`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn kv_cost_argmin_in<S: Simd, L: U32Source + ?Sized>(
    s: S,
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    rng: &mut Rng,
) -> Result<Option<KvChoice>, KvCostError> {
    let rows = check(config, load, overlap, usize::MAX)?;
    let p = prepare(s, config, request, load, mask, rows);
    let planned = (rows / LANES / 8).min(REMEMBERED_WORDS);
    let costs = Costs {
        p: &p,
        load,
        overlap,
        rows,
        plan: Plan::new(&p, load, overlap, planned),
    };
    let groups = rows / LANES;
    let words = groups.div_ceil(8);
    if words <= 1 {
        return one_word(s, &costs, mask, rng);
    }
    let mut room = least_room::<S, f32>();
    let mut least = Least::new(s, &mut room);
    let mut hi = s.splat_f32(f32::NEG_INFINITY);
    // The whole mask words in one loop compiled for the call's shape, when
    // it has one (see `fast`); the rest word by word.
    let mut start = 0;
    if let Some(plan) = &costs.plan {
        plan.least(s, mask, &mut least, &mut hi);
        start = planned;
    }
    least.fold_from(s, start);
    let inf = s.splat_f32(f32::INFINITY);
    for w in start..words {
        let mut lo = inf;
        for g in w * 8..(w * 8 + 8).min(groups) {
            let bits = group_bits(mask, g);
            if bits == 0 {
                continue;
            }
            let c = s
                .lane_mask(bits)
                .cast_f32()
                .blend(costs.keys(s, g), s.splat_f32(f32::NAN));
            // NaN on ineligible lanes: `max` and `min` (the costs first)
            // pass over them, as over NaN costs.
            hi = c.max(hi);
            lo = c.min(lo);
        }
        least.push(s, lo, lo);
    }
    let mut min = least.min();
    let mut max = hi
        .to_array()
        .into_iter()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    // The rows past the last whole lane group, one by one.
    for row in (groups * LANES..rows).filter(|&r| contains(mask, r)) {
        let c = costs.key(row);
        if c < min {
            min = c;
        }
        if c > max {
            max = c;
        }
    }
    let range = CostRange { min, max };
    if range.min > range.max || (range.min.is_nan() || range.max.is_nan()) {
        return Ok(None);
    }
    if !(range.min.is_finite() && range.max.is_finite()) {
        if let Some(row) = first_non_finite(&costs, mask) {
            return Err(KvCostError::NonFiniteCost { row });
        }
        // Every eligible cost is finite: `hi` took an ineligible lane's cost
        // (the one-shape loops fold whole groups), and the minimum stands;
        // or a live column changed since the pass and no finite minimum was
        // seen: the argmin's last resort decides.
    }
    Ok(pick_least(s, &costs, mask, &least, range.min, rng).map(|row| KvChoice { row, cost: range.min }))
}

/// [`kv_cost_argmin_in`] for at most one mask word of whole lane groups (at
/// most 71 rows): each group's costs computed once, kept for the argmin.
#[cfg_attr(not(debug_assertions), inline(always))]
fn one_word<S: Simd, L: U32Source + ?Sized>(
    s: S,
    costs: &Costs<'_, '_, L>,
    mask: &[u64],
    rng: &mut Rng,
) -> Result<Option<KvChoice>, KvCostError> {
    let groups = costs.rows / LANES;
    let nan = s.splat_f32(f32::NAN);
    // A whole word in the call's fast shape through its loop's costs.
    let raw = match &costs.plan {
        Some(plan) if plan.words() == 1 => plan.word_costs(s, 0),
        _ => core::array::from_fn(|g| if g < groups { costs.keys(s, g) } else { nan }),
    };
    let keys: [S::F32; 8] = core::array::from_fn(|g| {
        let bits = if g < groups { group_bits(mask, g) } else { 0 };
        // NaN on ineligible lanes: passed over by `min` and `max`.
        s.lane_mask(bits).cast_f32().blend(raw[g], nan)
    });
    let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
    let (mut lo, mut hi) = (s.splat_f32(f32::INFINITY), s.splat_f32(f32::NEG_INFINITY));
    for &c in &keys {
        (lo, hi) = (c.min(lo), c.max(hi));
    }
    for (l, h) in lo.to_array().into_iter().zip(hi.to_array()) {
        min = if l < min { l } else { min };
        max = if h > max { h } else { max };
    }
    for row in (groups * LANES..costs.rows).filter(|&r| contains(mask, r)) {
        let c = costs.key(row);
        min = if c < min { c } else { min };
        max = if c > max { c } else { max };
    }
    if min > max || min.is_nan() || max.is_nan() {
        return Ok(None);
    }
    if !(min.is_finite() && max.is_finite()) {
        // Every lane of `keys` is an eligible row's cost or NaN: the range
        // is what the checked pick sees.
        let row = first_non_finite(costs, mask).unwrap_or(0);
        return Err(KvCostError::NonFiniteCost { row });
    }
    Ok(pick_in_one_word(s, costs, mask, &keys, min, rng).map(|row| KvChoice { row, cost: min }))
}

/// For a non-finite cost range: the first eligible row whose cost is NaN or
/// infinite, as the checked pick names it (`None` only if a live column
/// changed since the range was computed and every cost is finite now).
#[cold]
#[inline(never)]
fn first_non_finite<L: U32Source + ?Sized>(costs: &Costs<'_, '_, L>, mask: &[u64]) -> Option<usize> {
    (0..costs.rows).find(|&r| contains(mask, r) && !costs.key(r).is_finite())
}

/// Scalar reference of [`kv_cost_argmin`]: [`kv_cost_reference`](super::kv_cost_reference)'s
/// row costs and the reference argmin over them, recomputing each row's
/// cost where it is read instead of storing a column.
pub fn kv_cost_argmin_reference<L: U32Source + ?Sized>(
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    rng: &mut Rng,
) -> Result<Option<KvChoice>, KvCostError> {
    let rows = check(config, load, overlap, usize::MAX)?;
    let p = Prepared::scalar(config, request, load, mask, rows);
    let cost = |r: usize| row_cost(&p, &row_inputs(load, overlap, &p, r));
    let eligible = || (0..rows).filter(|&r| contains(mask, r));
    let mut range = CostRange::EMPTY;
    for c in eligible().map(cost) {
        range.add(c);
    }
    let CostRange { min, max } = range;
    if min > max || min.is_nan() || max.is_nan() {
        return Ok(None);
    }
    if !(min.is_finite() && max.is_finite()) {
        let row = eligible().find(|&r| !cost(r).is_finite()).unwrap_or(0);
        return Err(KvCostError::NonFiniteCost { row });
    }
    Ok(argmin_reference_by(rows, mask, f32::INFINITY, FEW_TIE_CELLS, cost, rng).map(|row| KvChoice { row, cost: min }))
}
