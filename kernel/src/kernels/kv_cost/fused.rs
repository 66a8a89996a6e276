//! The KV cost and the temperature-0 pick in one pass: [`kv_cost_argmin`]
//! computes each lane group's costs in registers and keeps only what the
//! argmin needs, with no cost column.
//!
//! ```text
//! best = +inf; ties = 0; tie groups = []       (a bounded list, in row order)
//! per lane group g (the partial last one padded with +inf):
//!     c    = cost lanes; hi = max(hi, c)                           (NaN ignored)
//!     if no eligible lane has c <= best: next           (the common case; NaN never is)
//!     m = min of the group's eligible lanes
//!     m <  best: best = m, ties = 0, tie groups = []
//!     ties += #lanes == best; remember (g, those lanes) while there is room
//! best, hi not both finite: refuse (NonFiniteCost) if an eligible cost is,
//!     as the checked pick does
//! k = 0 if ties == 1 else rng.below(ties)                        (the same draw)
//! the k-th tie: from the remembered groups, or by recomputing the groups
//! after the last remembered one (only when more groups tie than fit)
//! ```
//!
//! `hi` only decides whether the finiteness check runs (which reads eligible
//! rows only): the one-shape loops of `fast` fold a partly eligible group's
//! ineligible lanes into it too, instead of masking them per group.
//!
//! The result, the draw and the error are those of [`kv_cost`] followed by
//! [`pick_in_range`](crate::kernels::pick::pick_in_range) at temperature 0,
//! which the differential tests check.
//!
//! This module must not book or allocate.

use super::fast::Plan;
use super::{
    check, cost_lanes, prepare, row_cost, row_inputs, CostRange, KvCostConfig, KvCostError, KvLoad, KvOverlap,
    KvRequest, Prepared,
};
use crate::lanes::{U32Source, LANES};
use crate::mask::{contains, group_bits};
use crate::simd::{dispatch, F32Lanes, Simd, U32Lanes};
use crate::Rng;
use core::mem::MaybeUninit;

/// The row [`kv_cost_argmin`] chose and its cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvChoice {
    /// The chosen row.
    pub row: usize,
    /// Its KV cost (the least eligible cost).
    pub cost: f32,
}

/// Lane groups holding ties at the running minimum that the pass remembers
/// on the stack (row order; 1 KiB, left uninitialised until written, so a
/// call that ties little pays nothing for the room): past them, the k-th
/// tie is found by recomputing the later groups' costs. 128 groups hold an
/// idle fleet of 1,024 rows.
const REMEMBERED_TIE_GROUPS: usize = 128;

dispatch! {
    /// The default KV cost of every eligible row and the temperature-0 pick
    /// over it, in one pass without a cost column (SIMD): the eligible row of
    /// least cost, ties uniformly at random, and its cost.
    ///
    /// The same row, draw and errors as [`kv_cost`](super::kv_cost) into a
    /// column followed by
    /// [`pick_in_range`](crate::kernels::pick::pick_in_range) at
    /// temperature 0: one `rng.below` draw iff several eligible rows share the
    /// least cost; `Ok(None)` when no row is eligible (or every eligible cost
    /// is NaN); [`KvCostError::NonFiniteCost`] when an eligible cost is
    /// infinite (naming the first NaN or infinite eligible row); the
    /// configuration and column checks of `kv_cost`.
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

/// The running minimum and its ties.
pub(super) struct Ties {
    pub(super) best: f32,
    count: usize,
    /// The remembered groups: those below `listed` are written.
    groups: [MaybeUninit<(u32, u8)>; REMEMBERED_TIE_GROUPS],
    /// Groups remembered; once the room is full, later tie groups are
    /// only counted.
    listed: usize,
}

impl Ties {
    /// Folds in group `g`'s costs `c` (NaN on ineligible lanes `!bits`),
    /// some eligible lane of which is `<= best`. Inlined, so that a loop
    /// keeps its vector registers (a call clobbers them all). Two lane
    /// compares decide the common cases (a tie with `best`, or nothing); only
    /// a new minimum goes through the lanes one by one.
    #[inline(always)]
    pub(super) fn fold_lanes<S: Simd>(&mut self, s: S, g: usize, c: S::F32, bits: u8) {
        if c.cmp_lt(s.splat_f32(self.best)).bits() & bits != 0 {
            self.lower(c.to_array(), bits);
        }
        let eq = c.cmp_eq(s.splat_f32(self.best)).bits() & bits;
        self.tie(g, eq);
    }

    /// The group's eligible costs `c` (lanes `bits`) hold one below `best`:
    /// it becomes the least of them, with no ties yet.
    #[inline(always)]
    fn lower(&mut self, c: [f32; LANES], bits: u8) {
        let mut m = f32::INFINITY;
        let mut b = bits;
        while b != 0 {
            let lane = b.trailing_zeros() as usize;
            b &= b - 1;
            if c[lane] < m {
                m = c[lane];
            }
        }
        self.best = m;
        self.count = 0;
        self.listed = 0;
    }

    /// The remembered tie groups, in row order.
    fn listed(&self) -> &[(u32, u8)] {
        let written = &self.groups[..self.listed];
        // SAFETY: `remember`, the only writer of entries, writes an entry
        // before it moves `listed` past it; `lower` and `TieRun` only set
        // `listed` to 0 or to a count `remember` reached. `MaybeUninit<T>`
        // has `T`'s size and alignment, so the written prefix is a
        // `[(u32, u8)]`.
        unsafe { &*(core::ptr::from_ref(written) as *const [(u32, u8)]) }
    }

    /// Counts group `g`'s lanes `eq` tied at `best` and remembers the group
    /// while there is room.
    #[inline(always)]
    fn tie(&mut self, g: usize, eq: u8) {
        if eq == 0 {
            return;
        }
        remember(&mut self.groups, &mut self.count, &mut self.listed, g, eq);
    }
}

/// Counts group `g`'s tied lanes `eq` into `count` and, while there is
/// room, writes the group at `listed` and moves `listed` on (the one way
/// [`Ties`] and [`TieRun`] fill the room).
#[inline(always)]
fn remember(
    groups: &mut [MaybeUninit<(u32, u8)>; REMEMBERED_TIE_GROUPS],
    count: &mut usize,
    listed: &mut usize,
    g: usize,
    eq: u8,
) {
    *count += eq.count_ones() as usize;
    if let Some(slot) = groups.get_mut(*listed) {
        *slot = MaybeUninit::new((g as u32, eq));
        *listed += 1;
    }
}

/// [`Ties`] as a loop runs over it: the minimum and the counts in locals
/// (registers), written back by [`finish`](Self::finish).
pub(super) struct TieRun<'a> {
    ties: &'a mut Ties,
    pub(super) best: f32,
    count: usize,
    listed: usize,
}

impl<'a> TieRun<'a> {
    pub(super) fn new(ties: &'a mut Ties) -> Self {
        let (best, count, listed) = (ties.best, ties.count, ties.listed);
        TieRun {
            ties,
            best,
            count,
            listed,
        }
    }

    /// [`Ties::fold_lanes`] for a loop that has already compared: `le`
    /// (not 0) are the eligible lanes (`bits`) of group `g` whose costs `c`
    /// are `<= best` (`best_lanes` splat). Without a lane below `best`
    /// those are exactly the ties (a NaN lane is in neither), so the common
    /// case needs no equality compare. Returns whether `best` went down.
    #[inline(always)]
    pub(super) fn fold_le<S: Simd>(&mut self, s: S, g: usize, c: S::F32, best_lanes: S::F32, le: u8, bits: u8) -> bool {
        let lowered = c.cmp_lt(best_lanes).bits() & bits != 0;
        let eq = if lowered {
            self.ties.lower(c.to_array(), bits);
            (self.best, self.count, self.listed) = (self.ties.best, 0, 0);
            c.cmp_eq(s.splat_f32(self.best)).bits() & bits
        } else {
            le
        };
        remember(&mut self.ties.groups, &mut self.count, &mut self.listed, g, eq);
        lowered
    }

    /// Writes the minimum and the counts back.
    pub(super) fn finish(self) {
        (self.ties.best, self.ties.count, self.ties.listed) = (self.best, self.count, self.listed);
    }
}

/// The `k`-th set bit of `bits` (`k < bits.count_ones()`).
#[inline]
fn nth_bit(mut bits: u8, k: usize) -> usize {
    for _ in 0..k {
        bits &= bits - 1;
    }
    bits.trailing_zeros() as usize
}

/// The body of [`kv_cost_argmin`].
#[inline(always)]
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
    let groups = rows.div_ceil(LANES);
    let group = |g: usize| group_costs(s, &p, load, overlap, mask, rows, g);
    let mut ties = Ties {
        best: f32::INFINITY,
        count: 0,
        groups: [const { MaybeUninit::uninit() }; REMEMBERED_TIE_GROUPS],
        listed: 0,
    };
    let mut hi = s.splat_f32(f32::NEG_INFINITY);
    // The full lane groups in one loop compiled for the call's shape, when
    // it has one (see `fast`); the rest group by group.
    let mut start = 0;
    let words = rows / LANES / 8;
    if let Some(plan) = Plan::new(&p, load, overlap, words) {
        plan.scan(s, mask, &mut ties, &mut hi);
        start = words * 8;
    }
    let mut best = s.splat_f32(ties.best);
    for g in start..groups {
        let (bits, c) = group(g);
        if bits == 0 {
            continue;
        }
        // `max` keeps `hi` where a lane is NaN: ineligible lanes and NaN
        // costs are ignored, as `kv_cost`'s range ignores them.
        hi = c.max(hi);
        if c.cmp_le(best).bits() != 0 {
            // Inlined: a fleet where most rows tie (idle workers, nothing
            // cached) comes here for every group.
            ties.fold_lanes(s, g, c, bits);
            best = s.splat_f32(ties.best);
        }
    }
    let hi = hi
        .to_array()
        .into_iter()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    let range = CostRange {
        min: ties.best,
        max: hi,
    };
    if range.min > range.max || (range.min.is_nan() || range.max.is_nan()) {
        return Ok(None);
    }
    if !(range.min.is_finite() && range.max.is_finite()) {
        if let Some(row) = first_non_finite(&p, load, overlap, mask, rows) {
            return Err(KvCostError::NonFiniteCost { row });
        }
        // Every eligible cost is finite: `hi` took an ineligible lane's cost
        // (the one-shape loops fold whole groups), and the ties stand; or a
        // live column changed since the pass and no finite minimum was seen.
        if !range.min.is_finite() {
            return Ok(settle(&p, load, overlap, mask, rows));
        }
    }
    let mut k = if ties.count > 1 {
        rng.below(ties.count as u64) as usize
    } else {
        0
    };
    let listed = ties.listed();
    for &(g, eq) in listed {
        let c = eq.count_ones() as usize;
        if k < c {
            return Ok(Some(KvChoice {
                row: g as usize * LANES + nth_bit(eq, k),
                cost: range.min,
            }));
        }
        k -= c;
    }
    // More groups tied than were remembered: recompute the later ones.
    let after = listed.last().map_or(0, |&(g, _)| g as usize + 1);
    let target = s.splat_f32(range.min);
    for g in after..groups {
        let (bits, c) = group(g);
        let eq = c.cmp_eq(target).bits() & bits;
        let n = eq.count_ones() as usize;
        if k < n {
            return Ok(Some(KvChoice {
                row: g * LANES + nth_bit(eq, k),
                cost: range.min,
            }));
        }
        k -= n;
    }
    // Fewer ties than the pass counted: a live column (the fleet's load)
    // changed between the passes.
    Ok(settle(&p, load, overlap, mask, rows))
}

/// The last resort when a live column changed between the passes so that
/// the chosen tie vanished: the first eligible row of least cost as this
/// single pass computes it (each row's cost once, NaN ignored), or `None`
/// when no eligible row has a cost that is not NaN. Never reached for columns
/// that do not change during the call, so the kernel and its reference
/// still agree on every immutable input.
#[cold]
#[inline(never)]
fn settle<L: U32Source + ?Sized>(
    p: &Prepared,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    rows: usize,
) -> Option<KvChoice> {
    let mut best: Option<KvChoice> = None;
    for row in (0..rows).filter(|&r| contains(mask, r)) {
        let cost = row_cost(p, &row_inputs(load, overlap, p, row));
        if best.is_none_or(|b| cost < b.cost) {
            best = Some(KvChoice { row, cost });
        }
    }
    best.filter(|b| !b.cost.is_nan())
}

/// The eligible bits of lane group `g` and its costs, NaN on ineligible
/// lanes (which every comparison and `max` then ignore, as they ignore NaN
/// costs) (a function, not a closure: closures do not inherit the entry
/// point's target features when LLVM declines to inline them).
#[inline(always)]
fn group_costs<S: Simd, L: U32Source + ?Sized>(
    s: S,
    p: &Prepared,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    rows: usize,
    g: usize,
) -> (u8, S::F32) {
    let full = rows / LANES;
    let nan = s.splat_f32(f32::NAN);
    let mut bits = group_bits(mask, g);
    if g >= full {
        bits &= ((1u16 << (rows - g * LANES)) - 1) as u8;
    }
    if bits == 0 {
        return (0, nan);
    }
    let c = if g < full {
        let avail = load.load_available.map_or(0xFF, |m| group_bits(m, g));
        cost_lanes(s, p, load, overlap, g, avail)
    } else {
        s.load_f32(&tail_costs(p, load, overlap, g, bits))
    };
    (bits, s.lane_mask(bits).cast_f32().blend(c, nan))
}

/// The costs of the partial last lane group `g` (its eligible rows `bits`),
/// `+inf` elsewhere: the reference's row function, as `kv_cost` does.
#[cold]
#[inline(never)]
fn tail_costs<L: U32Source + ?Sized>(
    p: &Prepared,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    g: usize,
    bits: u8,
) -> [f32; LANES] {
    core::array::from_fn(|lane| {
        if bits >> lane & 1 == 1 {
            row_cost(p, &row_inputs(load, overlap, p, g * LANES + lane))
        } else {
            f32::INFINITY
        }
    })
}

/// For a non-finite cost range: the first eligible row whose cost is NaN or
/// infinite, as the checked pick names it (`None` only if a live column
/// changed since the range was computed and every cost is finite now).
#[cold]
#[inline(never)]
fn first_non_finite<L: U32Source + ?Sized>(
    p: &Prepared,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    rows: usize,
) -> Option<usize> {
    (0..rows).find(|&r| contains(mask, r) && !row_cost(p, &row_inputs(load, overlap, p, r)).is_finite())
}

/// Scalar reference of [`kv_cost_argmin`]: [`kv_cost_reference`](super::kv_cost_reference)'s
/// row costs and the reference argmin (least cost, NaN ignored; one draw
/// over the ties), recomputing each row's cost per pass instead of storing
/// a column.
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
    let ties = eligible().filter(|&r| cost(r) == min).count();
    let k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    Ok(eligible()
        .filter(|&r| cost(r) == min)
        .nth(k)
        .map(|row| KvChoice { row, cost: min }))
}
