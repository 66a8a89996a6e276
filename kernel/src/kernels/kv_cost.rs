//! The default KV cost (parity with `dynamo-kv-router`
//! 1.6.1's default worker selector): one cost per eligible row, lower is
//! better, written into a caller-provided column for the pick.
//!
//! ```text
//! per request:  min_prefill = min over eligible rows of active_prefill   (only if the decay is on)
//! per row:      (every load signal reads 0 on a row without a load observation)
//!   decay   = 1 / (1 + k * ((active_prefill - min_prefill) / block_size / max(request_blocks, 1)))
//!             if track_prefill and k > 0, else 1
//!   credit  = overlap_score_credit * decay * device
//!           + host_w * host + disk_w * disk + shared_multiplier * shared_beyond_device
//!   decode  = active_decode_blocks + added_decode_blocks
//!   req     = decode_active_request_weight * active_requests
//!   decode formula (see WorkerRole):  cost = max(0, decode - credit) + req
//!   otherwise:  raw  = 0                                   if not track_prefill
//!                    = active_prefill + max(isl, cached)   if a load observation exists
//!                    = isl                                 if not
//!               cost = prefill_load_scale * max(0, raw / block_size - credit) + decode + req
//!   cost   *= preferred_taint_multiplier (when the request has preferred taints)
//!   ineligible rows: +inf
//! ```
//!
//! `active_prefill + max(isl, cached)` is Dynamo's
//! `(active_prefill + isl.saturating_sub(cached)).saturating_add(cached)`:
//! the two are equal for integers, and the former rounds once instead of
//! twice. `max(0, x)` maps NaN to 0, as Dynamo's `f64::max(x, 0.0)` does.
//!
//! # Details that follow Dynamo rather than the formula's shorthand
//!
//! * A row without a load observation (`load_available` clear) reads *all*
//!   its load signals as 0, as Dynamo's defaulted `WorkerLoadProjection` does:
//!   active prefill (so it pulls `min_prefill` to 0 and has no decay), decode
//!   blocks, added blocks and active requests.
//! * The decay's excess is a saturating `active_prefill - min_prefill`.
//! * The decode formula applies to every role whose Dynamo selector label is
//!   `"decode"`: [`WorkerRole::Decode`] *and* [`WorkerRole::Aggregated`]
//!   (`WorkerType::default_selector_label`), when prefill is not tracked and
//!   `overlap_score_credit > 0`.
//! * The blocks a request would add are per row in Dynamo
//!   (`additional_active_blocks`); [`KvOverlap::added_decode_blocks`] carries
//!   them, and [`KvRequest::with_added_decode_blocks`] is the uniform fallback.
//!
//! # SIMD, reference, and precision
//!
//! [`kv_cost`] (eight `f32` lanes) and [`kv_cost_reference`] (scalar `f32`)
//! perform the same IEEE operations in the same order, with no fused
//! multiply-add, so they agree bit for bit on every target, build and SIMD
//! backend
//! ([`kv_cost`] finishes a partial last lane group with the reference's row
//! function). [`kv_cost_f64_reference`] evaluates the formula above directly
//! in `f64`, as Dynamo does, for the parity tests.
//!
//! The `f32` cost differs from Dynamo's `f64` one by at most
//! [`KV_COST_PARITY_ULPS`]` * 2^-24 * M` (about `1.2e-6 * M`; at least that
//! many of `f32`'s smallest steps, `2^-149`, where the computation falls in
//! `f32`'s subnormal range), where `M` is the
//! *magnitude* of the row's computation: the taint multiplier times the sum of
//! the absolute values of the terms (`scale * (raw_blocks + each credit term)
//! + decode + req`; [`KvCostF64::magnitude`]). Every term is produced by at
//! most 17 rounded operations (integer conversions included: the deepest
//! chain is the decay's seven, times credit and overlap, three additions, the
//! subtraction, scale, two additions and the taint), and the standard error
//! bound for a sum of such terms is `γ_17 · M`; 20 leaves room for the `f32`
//! rounding of Dynamo's `f64` configuration weights, overlap estimates and
//! taint multiplier. When the credit does not cancel most of the prefill
//! blocks (`M <= 0.8 |cost|`, e.g. no cache hit, or a hit smaller than the
//! load) this is within the 1e-6 relative bound of the parity tests; under heavy cancellation the
//! relative error of the small difference can be larger, but the absolute
//! error stays below `1.2e-6 * M`, which is what decides orderings between
//! rows. The bound assumes every intermediate is below `f32::MAX` (costs up to
//! about `3e38`).
//!
//! This module must not pick, book or allocate; it reads columns and writes
//! one output column.

mod config;
mod fast;
mod fused;
mod inputs;
mod parity;

pub use config::{KvConfigError, KvConfigField, KvConfigProblem, KvCostConfig};
#[cfg(test)]
pub(crate) use fused::kv_cost_argmin_on;
pub(crate) use fused::FEW_TIE_CELLS;
pub use fused::{kv_cost_argmin, kv_cost_argmin_reference, KvChoice};
pub use inputs::{KvLoad, KvOverlap, KvRequest, WorkerRole};
pub use parity::{kv_cost_f64_reference, kv_cost_f64_rows, KvCostF64, KvCostTerms, KV_COST_PARITY_ULPS};

use crate::lanes::{F32Source, U32Source, LANES};
use crate::mask::{contains, group_bits};
use crate::simd::{dispatch, F32Lanes, Simd, U32Lanes};

/// A column [`kv_cost`] found too short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvColumn {
    /// [`KvLoad::active_decode_blocks`].
    ActiveDecodeBlocks,
    /// [`KvLoad::active_requests`].
    ActiveRequests,
    /// [`KvOverlap::device_blocks`].
    DeviceBlocks,
    /// [`KvOverlap::cached_tokens`].
    CachedTokens,
    /// [`KvOverlap::host_blocks`].
    HostBlocks,
    /// [`KvOverlap::disk_blocks`].
    DiskBlocks,
    /// [`KvOverlap::shared_beyond_device`].
    SharedBeyondDevice,
    /// [`KvOverlap::added_decode_blocks`].
    AddedDecodeBlocks,
    /// [`KvOverlap::preferred_taint_multiplier`].
    PreferredTaintMultiplier,
    /// The output column.
    Output,
}

/// Why [`kv_cost`] refused its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCostError {
    /// The configuration is invalid.
    Config(KvConfigError),
    /// A column has fewer rows than `active_prefill_tokens`.
    ColumnTooShort {
        /// Which column.
        column: KvColumn,
        /// Rows scanned (the length of `active_prefill_tokens`).
        rows: usize,
        /// The column's length.
        len: usize,
    },
    /// An eligible row's cost is NaN or infinite, and the costs' range is
    /// not finite ([`kv_cost_argmin`] only: the checked pick refuses it).
    NonFiniteCost {
        /// The first such row, in row order.
        row: usize,
    },
}

impl core::fmt::Display for KvCostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            KvCostError::Config(e) => write!(f, "invalid KV cost configuration: {e}"),
            KvCostError::ColumnTooShort { column, rows, len } => {
                write!(f, "KV cost column {column:?} has {len} rows, scan needs {rows}")
            }
            KvCostError::NonFiniteCost { row } => write!(f, "row {row} has a non-finite KV cost"),
        }
    }
}

/// The cost range over the eligible rows, for the pick.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostRange {
    /// Smallest eligible cost (`+inf` when no row is eligible). NaN costs are
    /// ignored (the pick rejects them).
    pub min: f32,
    /// Largest eligible cost (`-inf` when no row is eligible).
    pub max: f32,
}

impl CostRange {
    const EMPTY: CostRange = CostRange {
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
    };

    #[cfg_attr(not(debug_assertions), inline(always))]
    fn add(&mut self, c: f32) {
        if c < self.min {
            self.min = c;
        }
        if c > self.max {
            self.max = c;
        }
    }
}

/// The multiplier Dynamo applies for the request's preferred taints:
/// `exp(-tanh(s))`, `s` the sum of the weights of the preferred taints the
/// worker has (0 for none: multiplier 1). In `[1/e, e]`; positive weights
/// lower the cost. Computed in `f64` and rounded once.
///
/// ```
/// use selkie_kernel::kernels::kv_cost::preferred_taint_multiplier;
/// assert_eq!(preferred_taint_multiplier(0.0), 1.0);
/// assert!(preferred_taint_multiplier(0.5) < 1.0);
/// ```
pub fn preferred_taint_multiplier(sum_of_weights: f32) -> f32 {
    libm::exp(-libm::tanh(sum_of_weights as f64)) as f32
}

/// Per-request constants shared by the SIMD kernel and the reference.
#[derive(Clone, Copy)]
struct Prepared {
    bs: f32,
    rb1: f32,
    isl: f32,
    credit: f32,
    decay_k: f32,
    scale: f32,
    req_w: f32,
    host_w: f32,
    disk_w: f32,
    shared_m: f32,
    added: u32,
    track: bool,
    decay_on: bool,
    decode_formula: bool,
    req_on: bool,
    min_prefill: u32,
}

impl Prepared {
    fn new(config: &KvCostConfig, request: &KvRequest) -> Self {
        let track = request.track_prefill_tokens();
        Prepared {
            bs: request.block_size().get() as f32,
            rb1: request.request_blocks().max(1) as f32,
            isl: request.isl_tokens() as f32,
            credit: config.overlap_score_credit,
            decay_k: config.overlap_score_credit_decay,
            scale: config.prefill_load_scale,
            req_w: config.decode_active_request_weight,
            host_w: config.host_cache_hit_weight,
            disk_w: config.disk_cache_hit_weight,
            shared_m: config.shared_cache_multiplier,
            added: request.added_decode_blocks(),
            track,
            decay_on: track && config.overlap_score_credit_decay > 0.0,
            decode_formula: request.role().has_decode_label() && !track && config.overlap_score_credit > 0.0,
            req_on: config.decode_active_request_weight != 0.0,
            min_prefill: 0,
        }
    }
}

/// `max(0, x)` with NaN mapped to 0 (Dynamo's `x.max(0.0)`).
#[cfg_attr(not(debug_assertions), inline(always))]
fn clamp0(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// Lane-wise [`clamp0`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn clamp0_lanes<S: Simd>(s: S, x: S::F32) -> S::F32 {
    let zero = s.splat_f32(0.0);
    x.cmp_gt(zero).blend(x, zero)
}

/// One row's inputs, as the scalar row function reads them.
struct RowInputs {
    available: bool,
    prefill: u32,
    decode: u32,
    requests: u32,
    added: u32,
    device: Option<f32>,
    cached: f32,
    host: Option<f32>,
    disk: Option<f32>,
    shared: Option<f32>,
    taint: Option<f32>,
}

/// The scalar cost of one row: the reference's definition, also used by the
/// SIMD kernel for a partial last lane group.
#[inline]
fn row_cost(p: &Prepared, r: &RowInputs) -> f32 {
    let (prefill, decode, requests, added) = if r.available {
        (r.prefill, r.decode, r.requests, r.added)
    } else {
        (0, 0, 0, 0)
    };
    let eff = if p.decay_on {
        let excess = prefill.max(p.min_prefill) - p.min_prefill;
        let norm = excess as f32 / p.bs / p.rb1;
        p.credit * (1.0 / (1.0 + p.decay_k * norm))
    } else {
        p.credit
    };
    let mut credit = match r.device {
        Some(d) => eff * d,
        None => 0.0,
    };
    if let Some(h) = r.host {
        credit += p.host_w * h;
    }
    if let Some(d) = r.disk {
        credit += p.disk_w * d;
    }
    if let Some(s) = r.shared {
        credit += p.shared_m * s;
    }
    let decode_cost = decode as f32 + added as f32;
    let mut cost = if p.decode_formula {
        clamp0(decode_cost - credit)
    } else {
        let raw_blocks = if !p.track {
            0.0
        } else if r.available {
            let uncached_or_cached = if r.cached > p.isl { r.cached } else { p.isl };
            (prefill as f32 + uncached_or_cached) / p.bs
        } else {
            p.isl / p.bs
        };
        p.scale * clamp0(raw_blocks - credit) + decode_cost
    };
    if p.req_on {
        cost += p.req_w * requests as f32;
    }
    match r.taint {
        Some(m) => cost * m,
        None => cost,
    }
}

/// Checks the configuration and every column's length; returns the row count.
fn check<L: U32Source + ?Sized>(
    config: &KvCostConfig,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    out_len: usize,
) -> Result<usize, KvCostError> {
    config.validate().map_err(KvCostError::Config)?;
    let rows = load.active_prefill_tokens.rows();
    let lens = [
        (KvColumn::ActiveDecodeBlocks, Some(load.active_decode_blocks.rows())),
        (KvColumn::ActiveRequests, Some(load.active_requests.rows())),
        (KvColumn::DeviceBlocks, overlap.device_blocks.map(<[f32]>::len)),
        (KvColumn::CachedTokens, overlap.cached_tokens.map(<[f32]>::len)),
        (KvColumn::HostBlocks, overlap.host_blocks.map(<[f32]>::len)),
        (KvColumn::DiskBlocks, overlap.disk_blocks.map(<[f32]>::len)),
        (
            KvColumn::SharedBeyondDevice,
            overlap.shared_beyond_device.map(<[f32]>::len),
        ),
        (
            KvColumn::AddedDecodeBlocks,
            overlap.added_decode_blocks.map(<[u32]>::len),
        ),
        (
            KvColumn::PreferredTaintMultiplier,
            overlap.preferred_taint_multiplier.map(<[f32]>::len),
        ),
        (KvColumn::Output, Some(out_len)),
    ];
    for (column, len) in lens {
        if let Some(len) = len {
            if len < rows {
                return Err(KvCostError::ColumnTooShort { column, rows, len });
            }
        }
    }
    Ok(rows)
}

/// Whether row `row` has a load observation.
#[cfg_attr(not(debug_assertions), inline(always))]
fn available(load_available: Option<&[u64]>, row: usize) -> bool {
    load_available.is_none_or(|m| contains(m, row))
}

/// The scalar inputs of row `row`.
#[inline]
fn row_inputs<L: U32Source + ?Sized>(
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    p: &Prepared,
    row: usize,
) -> RowInputs {
    RowInputs {
        available: available(load.load_available, row),
        prefill: load.active_prefill_tokens.value(row),
        decode: load.active_decode_blocks.value(row),
        requests: load.active_requests.value(row),
        added: overlap.added_decode_blocks.map_or(p.added, |c| c[row]),
        device: overlap.device_blocks.map(|c| c[row]),
        cached: overlap.cached_tokens.map_or(0.0, |c| c[row]),
        host: overlap.host_blocks.map(|c| c[row]),
        disk: overlap.disk_blocks.map(|c| c[row]),
        shared: overlap.shared_beyond_device.map(|c| c[row]),
        taint: overlap.preferred_taint_multiplier.map(|c| c[row]),
    }
}

impl Prepared {
    /// The scalar references' per-request constants: the least eligible
    /// active prefill (when the decay is on) found row by row.
    fn scalar<L: U32Source + ?Sized>(
        config: &KvCostConfig,
        request: &KvRequest,
        load: &KvLoad<'_, L>,
        mask: &[u64],
        rows: usize,
    ) -> Self {
        let mut p = Prepared::new(config, request);
        if p.decay_on {
            p.min_prefill = (0..rows)
                .filter(|&r| contains(mask, r))
                .map(|r| {
                    if available(load.load_available, r) {
                        load.active_prefill_tokens.value(r)
                    } else {
                        0
                    }
                })
                .min()
                .unwrap_or(0);
        }
        p
    }
}

/// Scalar reference of [`kv_cost`]: the same operations in the same order,
/// bit-identical results.
pub fn kv_cost_reference<L: U32Source + ?Sized>(
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    out: &mut [f32],
) -> Result<CostRange, KvCostError> {
    let rows = check(config, load, overlap, out.len())?;
    let p = Prepared::scalar(config, request, load, mask, rows);
    let mut range = CostRange::EMPTY;
    for (row, o) in out[..rows].iter_mut().enumerate() {
        *o = if contains(mask, row) {
            let c = row_cost(&p, &row_inputs(load, overlap, &p, row));
            range.add(c);
            c
        } else {
            f32::INFINITY
        };
    }
    Ok(range)
}

dispatch! {
    /// The default KV cost of every row (SIMD): writes `out[row]` for `row` in
    /// `0..rows` (`rows` = the length of `active_prefill_tokens`), `+inf` on
    /// ineligible rows, and returns the eligible rows' [`CostRange`]. See the
    /// module docs for the formula and its precision.
    ///
    /// Errors: an invalid `config`, or a column (the output included) shorter
    /// than `rows`. Nothing is written then.
    ///
    /// ```
    /// use core::num::NonZeroU32;
    /// use selkie_kernel::kernels::kv_cost::{kv_cost, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole};
    /// let (prefill, decode, active) = ([0u32, 64], [2u32, 0], [0u32, 0]);
    /// let device = [4.0f32, 0.0];
    /// let request = KvRequest::new(128, NonZeroU32::new(16).unwrap(), true, WorkerRole::Prefill);
    /// let overlap = KvOverlap { device_blocks: Some(&device), ..KvOverlap::default() };
    /// let mut cost = [0.0f32; 2];
    /// let load = KvLoad::new(&prefill[..], &decode[..], &active[..]);
    /// let range = kv_cost(&KvCostConfig::default(), &request, &load, &overlap, &[0b11], &mut cost).unwrap();
    /// // row 0: 128/16 - 4 + 2 = 6; row 1: (64 + 128)/16 - 0 + 0 = 12
    /// assert_eq!(cost, [6.0, 12.0]);
    /// assert_eq!((range.min, range.max), (6.0, 12.0));
    /// ```
    pub fn kv_cost / kv_cost_on [L: U32Source + ?Sized] (
        config: &KvCostConfig,
        request: &KvRequest,
        load: &KvLoad<'_, L>,
        overlap: &KvOverlap<'_>,
        mask: &[u64],
        out: &mut [f32],
    ) -> Result<CostRange, KvCostError>
        = |s| kv_cost_in(s, config, request, load, overlap, mask, out)
}

/// The body of [`kv_cost`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn kv_cost_in<S: Simd, L: U32Source + ?Sized>(
    s: S,
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    out: &mut [f32],
) -> Result<CostRange, KvCostError> {
    let rows = check(config, load, overlap, out.len())?;
    let p = prepare(s, config, request, load, mask, rows);
    let groups = rows / LANES;
    let avail_bits = |g: usize| load.load_available.map_or(0xFF, |m| group_bits(m, g));
    let mut lo = s.splat_f32(f32::INFINITY);
    let mut hi = s.splat_f32(f32::NEG_INFINITY);
    let inf = s.splat_f32(f32::INFINITY);
    // Whole mask words in the loop compiled for the call's shape, when it
    // has one (see `fast`); the rest group by group.
    let words = groups / 8;
    let mut start = 0;
    if let Some(plan) = fast::Plan::new(&p, load, overlap, words) {
        plan.write(s, mask, out, &mut lo, &mut hi);
        start = words * 8;
    }
    for g in start..groups {
        let bits = group_bits(mask, g);
        let dst: &mut [f32; LANES] = (&mut out[g * LANES..][..LANES])
            .try_into()
            .unwrap_or_else(|_| unreachable!());
        if bits == 0 {
            *dst = [f32::INFINITY; LANES];
            continue;
        }
        let on = s.lane_mask(bits).cast_f32();
        let c = on.blend(cost_lanes(s, &p, load, overlap, g, avail_bits(g)), inf);
        lo = c.cmp_lt(lo).blend(c, lo);
        hi = (on & c.cmp_gt(hi)).blend(c, hi);
        *dst = c.to_array();
    }
    let mut range = CostRange::EMPTY;
    for c in lo.to_array() {
        if c < range.min {
            range.min = c;
        }
    }
    for c in hi.to_array() {
        if c > range.max {
            range.max = c;
        }
    }
    for (row, o) in out[..rows].iter_mut().enumerate().skip(groups * LANES) {
        *o = if contains(mask, row) {
            let c = row_cost(&p, &row_inputs(load, overlap, &p, row));
            range.add(c);
            c
        } else {
            f32::INFINITY
        };
    }
    Ok(range)
}

/// The per-request constants, with the decay's `min_prefill` (one SIMD pass
/// over the eligible rows' prefill load, only when the decay is on).
#[cfg_attr(not(debug_assertions), inline(always))]
fn prepare<S: Simd, L: U32Source + ?Sized>(
    s: S,
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    mask: &[u64],
    rows: usize,
) -> Prepared {
    let mut p = Prepared::new(config, request);
    let groups = rows / LANES;
    let avail_bits = |g: usize| load.load_available.map_or(0xFF, |m| group_bits(m, g));
    if p.decay_on {
        let mut m = s.splat_u32(u32::MAX);
        for g in 0..groups {
            let bits = group_bits(mask, g);
            if bits != 0 {
                let prefill = load.active_prefill_tokens.lanes(s, g) & s.lane_mask(avail_bits(g));
                m = m.min(prefill | !s.lane_mask(bits));
            }
        }
        let mut min = m.reduce_min();
        for r in groups * LANES..rows {
            if contains(mask, r) {
                let v = if available(load.load_available, r) {
                    load.active_prefill_tokens.value(r)
                } else {
                    0
                };
                min = min.min(v);
            }
        }
        // No eligible row: nothing reads it; Dynamo uses 0.
        p.min_prefill = if min == u32::MAX && !(0..rows).any(|r| contains(mask, r)) {
            0
        } else {
            min
        };
    }
    p
}

/// One full lane group of costs: [`row_cost`] lane-wise, operation for
/// operation.
#[cfg_attr(not(debug_assertions), inline(always))]
fn cost_lanes<S: Simd, L: U32Source + ?Sized>(
    s: S,
    p: &Prepared,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    g: usize,
    avail_bits: u8,
) -> S::F32 {
    let avail = s.lane_mask(avail_bits);
    let f = |c: &[f32]| c.lanes(s, g);
    let prefill = load.active_prefill_tokens.lanes(s, g) & avail;
    let decode = load.active_decode_blocks.lanes(s, g) & avail;
    let added = overlap
        .added_decode_blocks
        .map_or(s.splat_u32(p.added), |c| c.lanes(s, g))
        & avail;
    let one = s.splat_f32(1.0);
    let eff = if p.decay_on {
        let m = s.splat_u32(p.min_prefill);
        let excess = (prefill.max(m) - m).to_f32();
        let norm = excess / s.splat_f32(p.bs) / s.splat_f32(p.rb1);
        s.splat_f32(p.credit) * (one / (one + s.splat_f32(p.decay_k) * norm))
    } else {
        s.splat_f32(p.credit)
    };
    let mut credit = match overlap.device_blocks {
        Some(c) => eff * f(c),
        None => s.splat_f32(0.0),
    };
    if let Some(c) = overlap.host_blocks {
        credit = credit + s.splat_f32(p.host_w) * f(c);
    }
    if let Some(c) = overlap.disk_blocks {
        credit = credit + s.splat_f32(p.disk_w) * f(c);
    }
    if let Some(c) = overlap.shared_beyond_device {
        credit = credit + s.splat_f32(p.shared_m) * f(c);
    }
    let decode_cost = decode.to_f32() + added.to_f32();
    let mut cost = if p.decode_formula {
        clamp0_lanes(s, decode_cost - credit)
    } else {
        let raw_blocks = if !p.track {
            s.splat_f32(0.0)
        } else {
            let isl = s.splat_f32(p.isl);
            let cached = overlap.cached_tokens.map_or(s.splat_f32(0.0), f);
            let with_load = (prefill.to_f32() + cached.cmp_gt(isl).blend(cached, isl)) / s.splat_f32(p.bs);
            avail.cast_f32().blend(with_load, s.splat_f32(p.isl / p.bs))
        };
        s.splat_f32(p.scale) * clamp0_lanes(s, raw_blocks - credit) + decode_cost
    };
    if p.req_on {
        let requests = load.active_requests.lanes(s, g) & avail;
        cost = cost + s.splat_f32(p.req_w) * requests.to_f32();
    }
    match overlap.preferred_taint_multiplier {
        Some(c) => cost * f(c),
        None => cost,
    }
}
