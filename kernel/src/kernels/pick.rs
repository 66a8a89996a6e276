//! The pick: from a column of per-row costs (lower is better) to one row.
//!
//! * temperature 0 ([`pick_min`]): the minimum cost, ties uniformly at random
//!   (the argmin core shared with least-loaded);
//! * temperature `T > 0` ([`pick_softmax`]): row `i` with probability
//!   proportional to `exp(-(c_i - c_min) / ((c_max - c_min) * T))`, every row
//!   equally likely when `c_min == c_max`;
//! * [`pick`] dispatches on the temperature; [`explain`] reports the chosen
//!   row's cost and the runner-up, off the hot path.
//!
//! Every pick first checks that each eligible cost is finite and refuses the
//! input with [`KernelError::NonFiniteCost`] naming the first bad row
//! otherwise ([`first_non_finite`]).
//!
//! # The softmax walk (parity with Dynamo's `softmax_sample_index`)
//!
//! ```text
//! c_min, c_max over eligible rows                  (SIMD min / max)
//! u     = rng.unit_f64()                           (exactly one draw if any row is eligible)
//! w_i   = 1 if c_min == c_max, else exp(-(c_i - c_min) / (c_max - c_min) / T)
//! pick  = the first eligible row, in row order, with u * Σw <= w_0 + ... + w_i
//!         (Dynamo: `sample <= cumulative` over normalised probabilities;
//!          `<=`, so u == 0 picks the first eligible row even at weight 0)
//!         or the last eligible row if rounding leaves the walk short.
//! ```
//!
//! The SIMD kernel computes each exponent in base 2, as `(c_min - c) *
//! (log2(e) / ((c_max - c_min) * T))` in `f32`, and the weight with the
//! kernel's own `2^t` (a polynomial evaluated with separate multiplies and
//! adds, so that every SIMD backend computes the same bits, and raising a
//! weight below `2^-126` to it, that is `exp(x)` for `x < -87.3`),
//! sums the weights in `f32` in a fixed order and walks the cumulative sum
//! in `f64`, in two passes over the costs (sum, then walk until the target is
//! reached) with no heap memory. The first pass adds the weights of a mask
//! word's 64 rows lane by lane and reduces them once per word, keeping the
//! first 1,024 word sums on the stack; the walk recomputes weights only in
//! the word where it stops (and in words past those it kept), where it sums
//! each lane group, then walks the lanes of the group that crosses the
//! target. The reference computes
//! Dynamo's procedure in `f64` with `libm::exp`, normalising by the sum first. The two
//! therefore agree to a relative `1e-5` per weight (absolute `1e-12` for
//! weights below about `e^-40`, which cannot move a pick) rather than bit for
//! bit; their picks differ only when the draw lies within about `2e-5` of a
//! cumulative boundary, which the differential tests check exactly.
//!
//! Costs are `f32`, so `c_max - c_min` cannot overflow in the reference. In
//! the SIMD kernel a range that overflows `f32` (costs near `±f32::MAX`) is
//! handled by halving every cost first, which is what Dynamo's `magnitude`
//! rescaling does for `f64`; and when `(c_max - c_min) * T` is not a normal
//! `f32` (an extreme temperature, or costs a few subnormals apart) the
//! exponents are computed per lane in `f64`, so nothing under- or overflows
//! into a NaN or loses its precision.
//!
//! This module must not compute costs or book anything.

use super::argmin::{argmin, argmin_reference, ArgminKey};
use super::KernelError;
use crate::lanes::{F32Source, LANES};
use crate::mask::{contains, count, group_bits, nth};
use crate::simd::{dispatch, exp2_lanes, F32Lanes, Simd, U32Lanes};
use crate::Rng;
use core::mem::MaybeUninit;

/// A cost column as argmin keys.
struct Costs<'a, C: ?Sized>(&'a C);

impl<C: F32Source + ?Sized> ArgminKey for Costs<'_, C> {
    type Key = f32;
    // The fused KV scan's bound: a KV cost column draws as the scan does.
    const FEW_CELLS: usize = super::kv_cost::FEW_TIE_CELLS;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn rows(&self) -> usize {
        self.0.rows()
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key(&self, row: usize) -> f32 {
        self.0.value(row)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys<S: Simd>(&self, s: S, group: usize) -> S::F32 {
        self.0.lanes(s, group)
    }
}

dispatch! {
    /// The first eligible row, in row order, whose cost is NaN or infinite (SIMD).
    ///
    /// ```
    /// use selkie_kernel::kernels::pick::first_non_finite;
    /// let costs = [1.0f32, f32::NAN, f32::INFINITY];
    /// assert_eq!(first_non_finite(&costs[..], &[0b101]), Some(2)); // row 1 is not eligible
    /// ```
    pub fn first_non_finite / first_non_finite_on [C: F32Source + ?Sized] (costs: &C, mask: &[u64])
        -> Option<usize>
        = |s| non_finite_in(s, costs, mask)
}

/// The body of [`first_non_finite`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn non_finite_in<S: Simd, C: F32Source + ?Sized>(s: S, costs: &C, mask: &[u64]) -> Option<usize> {
    let rows = costs.rows();
    let groups = rows / LANES;
    for g in 0..groups {
        let bits = group_bits(mask, g);
        if bits != 0 {
            let bad = !costs.lanes(s, g).is_finite().bits() & bits;
            if bad != 0 {
                return Some(g * LANES + bad.trailing_zeros() as usize);
            }
        }
    }
    (groups * LANES..rows).find(|&r| contains(mask, r) && !costs.value(r).is_finite())
}

/// Scalar reference of [`first_non_finite`].
pub fn first_non_finite_reference<C: F32Source + ?Sized>(costs: &C, mask: &[u64]) -> Option<usize> {
    (0..costs.rows()).find(|&r| contains(mask, r) && !costs.value(r).is_finite())
}

dispatch! {
    /// Temperature-0 pick (SIMD): the eligible row of minimum cost, ties
    /// uniformly at random.
    ///
    /// `Err(NonFiniteCost)` if an eligible cost is NaN or infinite (no draw);
    /// `Ok(None)` if no row is eligible. Makes one `rng.below` draw iff several
    /// eligible rows hold the minimum (`-0.0` and `0.0` tie).
    ///
    /// ```
    /// use selkie_kernel::{kernels::pick::pick_min, Rng};
    /// let costs = [3.0f32, 1.5, 2.0];
    /// assert_eq!(pick_min(&costs[..], &[0b111], &mut Rng::new(1)), Ok(Some(1)));
    /// ```
    pub fn pick_min / pick_min_on [C: F32Source + ?Sized] (costs: &C, mask: &[u64], rng: &mut Rng)
        -> Result<Option<usize>, KernelError>
        = |s| pick_min_in(s, costs, mask, rng)
}

/// The body of [`pick_min`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn pick_min_in<S: Simd, C: F32Source + ?Sized>(
    s: S,
    costs: &C,
    mask: &[u64],
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    if let Some(row) = non_finite_in(s, costs, mask) {
        return Err(KernelError::NonFiniteCost { row });
    }
    Ok(argmin(s, &Costs(costs), mask, rng))
}

/// Scalar reference of [`pick_min`]: same result, same draws.
pub fn pick_min_reference<C: F32Source + ?Sized>(
    costs: &C,
    mask: &[u64],
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    if let Some(row) = first_non_finite_reference(costs, mask) {
        return Err(KernelError::NonFiniteCost { row });
    }
    Ok(argmin_reference(&Costs(costs), mask, rng))
}

/// Picks a row at `temperature`: `0` takes [`pick_min`], a finite `T > 0`
/// samples with [`pick_softmax`]; a negative, NaN or infinite temperature is
/// `Err(BadTemperature)` (checked first, no draw).
///
/// ```
/// use selkie_kernel::{kernels::pick::pick, KernelError, Rng};
/// let costs = [2.0f32, 1.0, 4.0];
/// let mut rng = Rng::new(11);
/// assert_eq!(pick(&costs[..], &[0b111], 0.0, &mut rng), Ok(Some(1)));
/// assert!(pick(&costs[..], &[0b111], 0.7, &mut rng).unwrap().is_some());
/// assert_eq!(pick(&costs[..], &[0b111], -1.0, &mut rng), Err(KernelError::BadTemperature));
/// ```
#[inline]
pub fn pick<C: F32Source + ?Sized>(
    costs: &C,
    mask: &[u64],
    temperature: f32,
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    if temperature == 0.0 {
        pick_min(costs, mask, rng)
    } else {
        pick_softmax(costs, mask, temperature, rng)
    }
}

/// Scalar reference of [`pick`].
pub fn pick_reference<C: F32Source + ?Sized>(
    costs: &C,
    mask: &[u64],
    temperature: f32,
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    if temperature == 0.0 {
        pick_min_reference(costs, mask, rng)
    } else {
        pick_softmax_reference(costs, mask, temperature, rng)
    }
}

/// Whether `t` is a temperature the softmax accepts: finite and `> 0`.
#[inline]
fn softmax_temperature_ok(t: f32) -> bool {
    t.is_finite() && t > 0.0
}

/// How the SIMD kernel turns a lane group of costs into weights; built once
/// per pick from `c_min`, `c_max` and `T` (see [`SoftmaxLanes::new`]).
///
/// A weight is `exp(x) = 2^(x log2 e)`: the kernel computes the base-2
/// exponent `t = (c_min - c) * (log2 e / ((c_max - c_min) T))` directly, one
/// subtraction and one multiplication per lane, and then `2^t`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SoftmaxLanes {
    /// Costs are multiplied by this first (1, or 0.5 when `c_max - c_min`
    /// overflows `f32`).
    pre: f32,
    /// `c_min * pre`.
    min: f32,
    /// `log2(e) / ((c_max - c_min) * pre * T)` when that product is a normal
    /// `f32` (the fast path); 0 when it under- or overflows, and the
    /// exponent is computed per lane in `f64` instead (an extreme
    /// temperature or a subnormal cost range).
    inv: f32,
    /// `c_min` and `(c_max - c_min) * T` in `f64`, for that slow path.
    min64: f64,
    denom64: f64,
    /// Whether `c_min == c_max` (every weight 1).
    flat: bool,
}

impl SoftmaxLanes {
    /// Prepares weights for costs in `[c_min, c_max]` (both finite) at
    /// temperature `t` (finite, `> 0`).
    pub(crate) fn new(c_min: f32, c_max: f32, t: f32) -> Self {
        let mut pre = 1.0f32;
        let mut range = c_max - c_min;
        if !range.is_finite() {
            pre = 0.5;
            range = c_max * 0.5 - c_min * 0.5;
        }
        let denom = range * t;
        let inv = if denom.is_normal() {
            core::f32::consts::LOG2_E / denom
        } else {
            0.0
        };
        SoftmaxLanes {
            pre,
            min: c_min * pre,
            inv,
            min64: c_min as f64,
            denom64: (c_max as f64 - c_min as f64) * t as f64,
            flat: c_min == c_max,
        }
    }

    /// The weights of one lane group: `exp(x)` with `x = -(c - c_min) / ((c_max - c_min) T)`,
    /// 1 everywhere when `c_min == c_max`, 0 on lanes whose bit is clear.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn weights<S: Simd>(&self, s: S, costs: S::F32, bits: u8) -> S::F32 {
        let on = s.lane_mask(bits).cast_f32();
        if self.flat {
            return on & s.splat_f32(1.0);
        }
        let t = if self.inv != 0.0 {
            self.fast_exponent(s, costs)
        } else {
            let c = costs.to_array();
            s.load_f32(&core::array::from_fn(|i| self.slow_exponent(c[i])))
        };
        on & exp2_lanes(s, t)
    }

    /// Whether [`weights_all`](Self::weights_all) applies: the costs are not
    /// all equal and every exponent is one subtraction and one
    /// multiplication.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn unmasked(&self) -> bool {
        !self.flat && self.inv != 0.0
    }

    /// Whether costs are halved first (a range that overflows `f32`).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn halved(&self) -> bool {
        self.pre != 1.0
    }

    /// [`weights`](Self::weights) of a lane group whose lanes are all
    /// eligible, when [`unmasked`](Self::unmasked) and `HALVED ==
    /// self.halved()`: the same bits, without the lane mask (the caller
    /// chooses `HALVED` once per pass, not per group).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn weights_all<S: Simd, const HALVED: bool>(&self, s: S, costs: S::F32) -> S::F32 {
        let d = if HALVED {
            s.splat_f32(self.min) - costs * s.splat_f32(self.pre)
        } else {
            s.splat_f32(self.min) - costs
        };
        exp2_lanes(s, d * s.splat_f32(self.inv))
    }

    /// The base-2 exponent `(c_min - c) * inv` per lane (`inv != 0`).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn fast_exponent<S: Simd>(&self, s: S, costs: S::F32) -> S::F32 {
        let d = if self.pre == 1.0 {
            s.splat_f32(self.min) - costs
        } else {
            s.splat_f32(self.min) - costs * s.splat_f32(self.pre)
        };
        d * s.splat_f32(self.inv)
    }

    /// The base-2 exponent on the slow path, per lane in `f64`.
    #[inline]
    fn slow_exponent(&self, c: f32) -> f32 {
        ((self.min64 - c as f64) / self.denom64 * core::f64::consts::LOG2_E) as f32
    }

    /// [`weights`](Self::weights) for one eligible cost, operation for
    /// operation: the lanes must equal it bit for bit on every backend.
    #[cfg(test)]
    pub(crate) fn weight_scalar(&self, c: f32) -> f32 {
        if self.flat {
            return 1.0;
        }
        let t = if self.inv != 0.0 {
            let d = if self.pre == 1.0 {
                self.min - c
            } else {
                self.min - c * self.pre
            };
            d * self.inv
        } else {
            self.slow_exponent(c)
        };
        crate::simd::exp2_scalar(t)
    }
}

#[cfg(test)]
dispatch! {
    /// [`SoftmaxLanes::weights`] of one lane group, for the tests.
    #[allow(dead_code)]
    fn softmax_weights / softmax_weights_on [] (lanes: &SoftmaxLanes, costs: [f32; LANES], bits: u8) -> [f32; LANES]
        = |s| lanes.weights(s, s.load_f32(&costs), bits).to_array()
}

#[cfg(test)]
dispatch! {
    /// [`SoftmaxLanes::weights_all`] of one lane group, for the tests.
    #[allow(dead_code)]
    fn softmax_weights_all / softmax_weights_all_on [] (lanes: &SoftmaxLanes, costs: [f32; LANES]) -> [f32; LANES]
        = |s| if lanes.halved() {
            lanes.weights_all::<_, true>(s, s.load_f32(&costs)).to_array()
        } else {
            lanes.weights_all::<_, false>(s, s.load_f32(&costs)).to_array()
        }
}

/// The eligible rows' cost range as the SIMD kernel sees it: `(min, max,
/// last eligible row)`, `None` when no row is eligible. Costs are finite.
#[cfg_attr(not(debug_assertions), inline(always))]
fn range_and_last<S: Simd, C: F32Source + ?Sized>(s: S, costs: &C, mask: &[u64]) -> Option<(f32, f32, usize)> {
    let rows = costs.rows();
    let groups = rows / LANES;
    let mut lo = s.splat_f32(f32::INFINITY);
    let mut hi = s.splat_f32(f32::NEG_INFINITY);
    let mut last = None;
    for g in 0..groups {
        let bits = group_bits(mask, g);
        if bits != 0 {
            let on = s.lane_mask(bits).cast_f32();
            let c = costs.lanes(s, g);
            lo = on.blend(c, lo).cmp_lt(lo).blend(c, lo);
            hi = on.blend(c, hi).cmp_gt(hi).blend(c, hi);
            last = Some(g * LANES + 7 - bits.leading_zeros() as usize);
        }
    }
    let mut min = lo
        .to_array()
        .into_iter()
        .fold(f32::INFINITY, |a, b| if b < a { b } else { a });
    let mut max = hi
        .to_array()
        .into_iter()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    for r in groups * LANES..rows {
        if contains(mask, r) {
            let c = costs.value(r);
            if c < min {
                min = c;
            }
            if c > max {
                max = c;
            }
            last = Some(r);
        }
    }
    last.map(|l| (min, max, l))
}

/// One lane group of costs, the partial last group padded with `pad` (whose
/// lanes the caller masks off).
#[cfg_attr(not(debug_assertions), inline(always))]
fn cost_lanes<S: Simd, C: F32Source + ?Sized>(s: S, costs: &C, g: usize, pad: f32) -> S::F32 {
    let rows = costs.rows();
    if (g + 1) * LANES <= rows {
        costs.lanes(s, g)
    } else {
        let mut a = [pad; LANES];
        for (i, v) in a.iter_mut().enumerate() {
            let r = g * LANES + i;
            if r < rows {
                *v = costs.value(r);
            }
        }
        s.load_f32(&a)
    }
}

dispatch! {
    /// Softmax pick at temperature `temperature > 0` (SIMD). See the module docs
    /// for the walk and how it matches Dynamo.
    ///
    /// `Err(BadTemperature)` unless the temperature is finite and `> 0`;
    /// `Err(NonFiniteCost)` if an eligible cost is NaN or infinite (neither
    /// draws); `Ok(None)` if no row is eligible (no draw). Otherwise makes exactly
    /// one `rng.unit_f64` draw, even with a single eligible row, as Dynamo does.
    ///
    /// ```
    /// use selkie_kernel::{kernels::pick::pick_softmax, Rng};
    /// let costs = [10.0f32, 0.0, 10.0];
    /// // At a low temperature the cheap row is almost always chosen.
    /// let row = pick_softmax(&costs[..], &[0b111], 0.01, &mut Rng::new(4)).unwrap();
    /// assert_eq!(row, Some(1));
    /// ```
    pub fn pick_softmax / pick_softmax_on [C: F32Source + ?Sized]
        (costs: &C, mask: &[u64], temperature: f32, rng: &mut Rng) -> Result<Option<usize>, KernelError>
        = |s| pick_softmax_in(s, costs, mask, temperature, rng)
}

/// The body of [`pick_softmax`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn pick_softmax_in<S: Simd, C: F32Source + ?Sized>(
    s: S,
    costs: &C,
    mask: &[u64],
    temperature: f32,
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    if !softmax_temperature_ok(temperature) {
        return Err(KernelError::BadTemperature);
    }
    if let Some(row) = non_finite_in(s, costs, mask) {
        return Err(KernelError::NonFiniteCost { row });
    }
    match range_and_last(s, costs, mask) {
        Some((c_min, c_max, last)) => Ok(Some(softmax_walk(s, costs, mask, c_min, c_max, last, temperature, rng))),
        None => Ok(None),
    }
}

/// Picks from costs whose eligible range the caller already knows, skipping
/// the finiteness and min/max passes: at temperature 0 the tie and find
/// passes of the argmin, above it the softmax's sum and walk. This is the KV
/// policy's path: [`kv_cost`](super::kv_cost::kv_cost) returns the range
/// while it writes the costs.
///
/// The caller guarantees every eligible cost is finite and within `range`
/// (`range.min <= c <= range.max`); `range` is empty (`min > max`) iff no
/// row is eligible, and then `Ok(None)` is returned. Draws and errors as
/// [`pick`]: a temperature that is neither 0 nor finite and `> 0` is
/// `Err(BadTemperature)`, even when no row is eligible.
///
/// ```
/// use selkie_kernel::kernels::kv_cost::CostRange;
/// use selkie_kernel::{kernels::pick::pick_in_range, Rng};
/// let costs = [3.0f32, 1.5, 2.0];
/// let range = CostRange { min: 1.5, max: 3.0 };
/// assert_eq!(pick_in_range(&costs[..], &[0b111], range, 0.0, &mut Rng::new(1)), Ok(Some(1)));
/// ```
#[inline]
pub fn pick_in_range<C: F32Source + ?Sized>(
    costs: &C,
    mask: &[u64],
    range: super::kv_cost::CostRange,
    temperature: f32,
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    pick_in_range_on(crate::simd::Backend::active(), costs, mask, range, temperature, rng)
}

dispatch! {
    /// The body of [`pick_in_range`], dispatched after its checks.
    #[allow(dead_code)]
    fn pick_in_range_checked / pick_in_range_on_checked [C: F32Source + ?Sized]
        (costs: &C, mask: &[u64], range: super::kv_cost::CostRange, temperature: f32, last: usize, rng: &mut Rng)
        -> Option<usize>
        = |s| if temperature == 0.0 {
            argmin(s, &Costs(costs), mask, rng)
        } else {
            Some(softmax_walk(s, costs, mask, range.min, range.max, last, temperature, rng))
        }
}

/// [`pick_in_range`] on backend `backend`.
#[inline]
pub(crate) fn pick_in_range_on<C: F32Source + ?Sized>(
    backend: crate::simd::Backend,
    costs: &C,
    mask: &[u64],
    range: super::kv_cost::CostRange,
    temperature: f32,
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    // As `pick`, the temperature is checked before anything else.
    if temperature != 0.0 && !softmax_temperature_ok(temperature) {
        return Err(KernelError::BadTemperature);
    }
    if range.min.partial_cmp(&range.max).is_none_or(|o| o.is_gt()) {
        return Ok(None);
    }
    if !(range.min.is_finite() && range.max.is_finite()) {
        return pick(costs, mask, temperature, rng);
    }
    let last = if temperature == 0.0 {
        0
    } else {
        match last_eligible(mask, costs.rows()) {
            Some(last) => last,
            None => return Ok(None),
        }
    };
    Ok(pick_in_range_on_checked(
        backend,
        costs,
        mask,
        range,
        temperature,
        last,
        rng,
    ))
}

/// The last set row of `mask` below `rows`.
fn last_eligible(mask: &[u64], rows: usize) -> Option<usize> {
    let words = rows.div_ceil(64).min(mask.len());
    (0..words).rev().find_map(|w| {
        let mut word = mask[w];
        if (w + 1) * 64 > rows {
            word &= (1u64 << (rows - w * 64)) - 1;
        }
        (word != 0).then(|| w * 64 + 63 - word.leading_zeros() as usize)
    })
}

/// Rows per mask word: the softmax sums weights a word at a time.
const WORD_ROWS: usize = 64;
const GROUPS_PER_WORD: usize = WORD_ROWS / LANES;

/// The eligible rows of mask word `w` below `rows`.
#[cfg_attr(not(debug_assertions), inline(always))]
fn word_bits(mask: &[u64], rows: usize, w: usize) -> u64 {
    let word = mask.get(w).copied().unwrap_or(0);
    if (w + 1) * WORD_ROWS > rows {
        word & ((1u64 << (rows - w * WORD_ROWS)) - 1)
    } else {
        word
    }
}

/// What the softmax's two passes read: the weights' parameters, the costs,
/// the eligible rows and the least cost.
struct Weights<'a, C: ?Sized> {
    lanes: SoftmaxLanes,
    costs: &'a C,
    mask: &'a [u64],
    rows: usize,
    c_min: f32,
}

impl<C: F32Source + ?Sized> Weights<'_, C> {
    /// The eligible bits and weights of lane group `g`, `None` when no row
    /// of it is eligible (a function, not a closure: closures do not inherit
    /// the AVX2 entry point's target features when LLVM declines to inline
    /// them).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn group<S: Simd>(&self, s: S, g: usize) -> Option<(u8, S::F32)> {
        if g * LANES >= self.rows {
            return None;
        }
        let mut bits = group_bits(self.mask, g);
        if (g + 1) * LANES > self.rows {
            bits &= (1u8 << (self.rows - g * LANES)) - 1;
        }
        if bits == 0 {
            None
        } else {
            let costs = cost_lanes(s, self.costs, g, self.c_min);
            Some((bits, self.lanes.weights(s, costs, bits)))
        }
    }

    /// The sum of mask word `w`'s weights (eligible bits `bits`, not 0): the
    /// word's lane groups added lane by lane in row order, then the lanes
    /// reduced. A word whose 64 rows are all eligible skips the lane masks
    /// (`HALVED` is `lanes.halved()`).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn word_sum<S: Simd, const HALVED: bool>(&self, s: S, w: usize, bits: u64) -> f32 {
        let first = w * GROUPS_PER_WORD;
        let mut acc = s.splat_f32(0.0);
        if bits == u64::MAX && self.lanes.unmasked() {
            for c in self.costs.lanes8(s, first) {
                acc = acc + self.lanes.weights_all::<S, HALVED>(s, c);
            }
        } else {
            for g in first..first + GROUPS_PER_WORD {
                if let Some((_, wts)) = self.group(s, g) {
                    acc = acc + wts;
                }
            }
        }
        acc.reduce_add()
    }

    /// [`word_sum`](Self::word_sum) with `HALVED` read from the lanes.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn word_sum_any<S: Simd>(&self, s: S, w: usize, bits: u64) -> f32 {
        if self.lanes.halved() {
            self.word_sum::<S, true>(s, w, bits)
        } else {
            self.word_sum::<S, false>(s, w, bits)
        }
    }

    /// The first pass: the sum of every word's weights in `f64`, the first
    /// words' sums kept in `sums` (`HALVED` is `lanes.halved()`, chosen once
    /// for the pass).
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn first_pass<S: Simd, const HALVED: bool>(&self, s: S, sums: &mut WordSums) -> f64 {
        let mut total = 0.0f64;
        for w in 0..self.rows.div_ceil(WORD_ROWS) {
            let bits = word_bits(self.mask, self.rows, w);
            if bits != 0 {
                let ws = self.word_sum::<S, HALVED>(s, w, bits);
                if let Some(slot) = sums.get_mut(w) {
                    slot.write(ws);
                }
                total += ws as f64;
            }
        }
        total
    }

    /// The walk inside mask word `w` (eligible bits `bits`, not 0), whose
    /// sum crosses `target` from `cum`: group sums, then the lanes of the
    /// group that crosses it. If rounding leaves the word's own walk short
    /// of the target (its group sums can add up a little below the word's
    /// sum), the word's last eligible row.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn walk_word<S: Simd>(&self, s: S, w: usize, bits: u64, mut cum: f64, target: f64) -> usize {
        let first = w * GROUPS_PER_WORD;
        for g in first..first + GROUPS_PER_WORD {
            let Some((gbits, wts)) = self.group(s, g) else {
                continue;
            };
            let gs = wts.reduce_add() as f64;
            if target <= cum + gs {
                let wts = wts.to_array();
                let mut b = gbits;
                while b != 0 {
                    let lane = b.trailing_zeros() as usize;
                    b &= b - 1;
                    cum += wts[lane] as f64;
                    if target <= cum {
                        return g * LANES + lane;
                    }
                }
            } else {
                cum += gs;
            }
        }
        w * WORD_ROWS + 63 - bits.leading_zeros() as usize
    }
}

/// Word sums whose first pass the softmax remembers on the stack (4 KiB:
/// 65,536 rows), so that the walk recomputes weights only in the word where
/// it stops; past them it recomputes every word it walks.
const REMEMBERED_WORD_SUMS: usize = 1024;

/// The remembered word sums, left uninitialised until the first pass
/// writes them (a call pays nothing for the room it does not use): the
/// first pass writes the sum of every word with an eligible row, and the
/// walk reads only those words.
type WordSums = [MaybeUninit<f32>; REMEMBERED_WORD_SUMS];

/// The softmax draw and walk over eligible rows whose range is
/// `[c_min, c_max]` and whose last row is `last` (one `unit_f64` draw).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(debug_assertions), inline(always))]
fn softmax_walk<S: Simd, C: F32Source + ?Sized>(
    s: S,
    costs: &C,
    mask: &[u64],
    c_min: f32,
    c_max: f32,
    last: usize,
    temperature: f32,
    rng: &mut Rng,
) -> usize {
    let rows = costs.rows();
    let u = rng.unit_f64();
    if c_min == c_max {
        // Every weight is 1: the walk ends at the k-th eligible row with
        // k = max(ceil(u * n), 1) - 1, computed exactly.
        let n = count(mask, rows);
        let target = u * n as f64;
        let k = (libm::ceil(target) as usize).max(1) - 1;
        return nth(mask, rows, k.min(n - 1)).unwrap_or(last);
    }
    let weights = Weights {
        lanes: SoftmaxLanes::new(c_min, c_max, temperature),
        costs,
        mask,
        rows,
        c_min,
    };
    let words = rows.div_ceil(WORD_ROWS);
    // Pass 1: the total, as a sum of per-word f32 sums in f64, remembering
    // the first words' sums (0 for a word without eligible rows).
    let mut sums: WordSums = [const { MaybeUninit::uninit() }; REMEMBERED_WORD_SUMS];
    let total = if weights.lanes.halved() {
        weights.first_pass::<S, true>(s, &mut sums)
    } else {
        weights.first_pass::<S, false>(s, &mut sums)
    };
    let target = u * total;
    // Pass 2: walk the word sums (remembered, or recomputed past them) to
    // the word that crosses the target, then its groups and their lanes in
    // row order.
    let mut cum = 0.0f64;
    for w in 0..words {
        let bits = word_bits(mask, rows, w);
        if bits == 0 {
            continue;
        }
        let ws = match sums.get(w) {
            // SAFETY: the first pass wrote the sum of every word with an
            // eligible row (`word_bits` of the same immutable mask and row
            // count is not 0), and this is such a word.
            Some(ws) => unsafe { ws.assume_init() },
            None => weights.word_sum_any(s, w, bits),
        } as f64;
        if target > cum + ws {
            cum += ws;
            continue;
        }
        return weights.walk_word(s, w, bits, cum, target);
    }
    last
}

/// One row's softmax weight as the reference computes it, in `f64`:
/// `exp(-(c - c_min) / ((c_max - c_min) * T))`, or 1 when `c_min == c_max`.
pub(crate) fn softmax_weight_reference(c: f32, c_min: f32, c_max: f32, t: f32) -> f64 {
    if c_min == c_max {
        return 1.0;
    }
    let (c, lo, hi, t) = (c as f64, c_min as f64, c_max as f64, t as f64);
    libm::exp(-(c - lo) / ((hi - lo) * t))
}

/// Scalar reference of [`pick_softmax`]: Dynamo's procedure in `f64` (weights,
/// sequential sum, normalised probabilities, `u <= cumulative`), the same
/// single draw. Agrees with the SIMD kernel up to rounding (see module docs).
pub fn pick_softmax_reference<C: F32Source + ?Sized>(
    costs: &C,
    mask: &[u64],
    temperature: f32,
    rng: &mut Rng,
) -> Result<Option<usize>, KernelError> {
    if !softmax_temperature_ok(temperature) {
        return Err(KernelError::BadTemperature);
    }
    if let Some(row) = first_non_finite_reference(costs, mask) {
        return Err(KernelError::NonFiniteCost { row });
    }
    let eligible = || (0..costs.rows()).filter(|&r| contains(mask, r));
    let Some(last) = eligible().next_back() else {
        return Ok(None);
    };
    let c_min = eligible().map(|r| costs.value(r)).fold(f32::INFINITY, f32::min);
    let c_max = eligible().map(|r| costs.value(r)).fold(f32::NEG_INFINITY, f32::max);
    let u = rng.unit_f64();
    let n = eligible().count();
    let weight = |r: usize| {
        if c_min == c_max {
            1.0 / n as f64
        } else {
            softmax_weight_reference(costs.value(r), c_min, c_max, temperature)
        }
    };
    let sum: f64 = eligible().map(weight).sum();
    let mut cum = 0.0f64;
    for r in eligible() {
        cum += weight(r) / sum;
        if u <= cum {
            return Ok(Some(r));
        }
    }
    Ok(Some(last))
}

/// Why a row was chosen: its cost and the best of the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PickOutcome {
    /// The chosen row.
    pub row: usize,
    /// Its cost.
    pub cost: f32,
    /// The cheapest other eligible row and its cost (the first in row order
    /// on ties), `None` when the chosen row was the only eligible one.
    pub runner_up: Option<(usize, f32)>,
}

impl PickOutcome {
    /// How much more the runner-up costs than the chosen row (negative when a
    /// softmax pick took a costlier row); `None` without a runner-up.
    pub fn margin(&self) -> Option<f32> {
        self.runner_up.map(|(_, c)| c - self.cost)
    }
}

/// Explains a pick after the fact: the chosen row's cost and the runner-up.
/// A plain scalar scan, meant for tracing and debugging, never for the hot
/// path. `None` if `chosen` is out of range or not eligible.
///
/// ```
/// use selkie_kernel::kernels::pick::explain;
/// let costs = [5.0f32, 2.0, 3.0];
/// let why = explain(&costs[..], &[0b111], 1).unwrap();
/// assert_eq!((why.cost, why.runner_up, why.margin()), (2.0, Some((2, 3.0)), Some(1.0)));
/// ```
pub fn explain<C: F32Source + ?Sized>(costs: &C, mask: &[u64], chosen: usize) -> Option<PickOutcome> {
    if chosen >= costs.rows() || !contains(mask, chosen) {
        return None;
    }
    let mut runner_up: Option<(usize, f32)> = None;
    for r in (0..costs.rows()).filter(|&r| r != chosen && contains(mask, r)) {
        let c = costs.value(r);
        if runner_up.is_none_or(|(_, best)| c < best) {
            runner_up = Some((r, c));
        }
    }
    Some(PickOutcome {
        row: chosen,
        cost: costs.value(chosen),
        runner_up,
    })
}
