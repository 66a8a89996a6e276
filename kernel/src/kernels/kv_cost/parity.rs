//! The KV cost in `f64`, straight from the formula as Dynamo computes it,
//! and the bound the `f32` kernels keep to it (see the parent module's
//! precision notes); with each row's cost split into its terms
//! ([`KvCostTerms`]). For parity tests, investigations and explanations,
//! never the hot path.
//!
//! This module must not be used for selection.

use super::{available, check, KvCostConfig, KvCostError, KvLoad, KvOverlap, KvRequest};
use crate::lanes::U32Source;
use crate::mask::contains;

/// The bound, in units of `2^-24` times the magnitude, on the difference
/// between [`kv_cost`](super::kv_cost) and Dynamo's `f64` cost (see the precision notes of [the module](super)).
pub const KV_COST_PARITY_ULPS: f64 = 20.0;

/// One row's cost from [`kv_cost_f64_reference`], with the magnitude its
/// parity bound is relative to and the cost's terms.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct KvCostF64 {
    /// The cost, in `f64` (`+inf` for an ineligible row).
    pub cost: f64,
    /// `M`: the taint multiplier times the sum of the absolute values of the
    /// cost's terms (0 for an ineligible row).
    pub magnitude: f64,
    /// What each part of the formula adds to [`cost`](Self::cost) (all 0
    /// for an ineligible row).
    pub terms: KvCostTerms,
}

/// A row's KV cost split into what each part of the formula adds to it:
/// the terms sum to the cost (up to `f64` rounding). See the
/// [module's formula](super) for the names.
///
/// ```
/// use core::num::NonZeroU32;
/// use selkie_kernel::kernels::kv_cost::*;
/// let (prefill, decode, active) = ([0u32, 64], [2u32, 0], [0u32, 0]);
/// let device = [4.0f32, 0.0];
/// let request = KvRequest::new(128, NonZeroU32::new(16).unwrap(), true, WorkerRole::Prefill);
/// let overlap = KvOverlap { device_blocks: Some(&device), ..KvOverlap::default() };
/// let load = KvLoad::new(&prefill[..], &decode[..], &active[..]);
/// let mut out = [KvCostF64::default(); 1];
/// kv_cost_f64_rows(&KvCostConfig::default(), &request, &load, &overlap, &[0b11], &[0], &mut out).unwrap();
/// // row 0: 128/16 - 4 + 2 = 6
/// let t = out[0].terms;
/// assert_eq!((t.prefill, t.credit, t.decode, t.requests, t.taint), (8.0, -4.0, 2.0, 0.0, 0.0));
/// assert_eq!((out[0].cost, t.sum()), (6.0, 6.0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct KvCostTerms {
    /// `prefill_load_scale * raw / block_size`: the prompt's and the rank's
    /// active prefill tokens in blocks, scaled; 0 without prefill tracking
    /// or under the decode formula.
    pub prefill: f64,
    /// The cache credit as it counts, at most 0: the formula clamps the
    /// blocks net of the credit at 0, so this is `-prefill_load_scale *
    /// min(credit, raw / block_size)` (decode formula: `-min(credit,
    /// decode)`).
    pub credit: f64,
    /// `active_decode_blocks + added_decode_blocks`.
    pub decode: f64,
    /// `decode_active_request_weight * active_requests`.
    pub requests: f64,
    /// What the preferred-taint multiplier adds: `(multiplier - 1)` times the
    /// other terms' sum (negative on a preferred rank); 0 without one.
    pub taint: f64,
}

impl KvCostTerms {
    /// The terms' sum: the cost.
    pub fn sum(&self) -> f64 {
        self.prefill + self.credit + self.decode + self.requests + self.taint
    }
}

impl KvCostF64 {
    /// The largest difference [`kv_cost`](super::kv_cost)'s `f32` result may have from
    /// [`cost`](Self::cost): `KV_COST_PARITY_ULPS * 2^-24 * magnitude`, and
    /// never less than `KV_COST_PARITY_ULPS` times `f32`'s smallest step,
    /// `2^-149`: a computation in `f32`'s subnormal range has that absolute
    /// precision, not a relative one (a cost of `5.6e-46` in `f64` is 0 in
    /// `f32`).
    pub fn tolerance(&self) -> f64 {
        let relative = KV_COST_PARITY_ULPS * libm::ldexp(1.0, -24) * self.magnitude;
        relative.max(KV_COST_PARITY_ULPS * libm::ldexp(1.0, -149))
    }

    /// Whether `cost` (from [`kv_cost`](super::kv_cost)) is within [`tolerance`](Self::tolerance).
    pub fn admits(&self, cost: f32) -> bool {
        if self.cost.is_infinite() {
            return cost as f64 == self.cost;
        }
        (cost as f64 - self.cost).abs() <= self.tolerance()
    }

    /// An ineligible row's.
    const INELIGIBLE: KvCostF64 = KvCostF64 {
        cost: f64::INFINITY,
        magnitude: 0.0,
        terms: KvCostTerms {
            prefill: 0.0,
            credit: 0.0,
            decode: 0.0,
            requests: 0.0,
            taint: 0.0,
        },
    };
}

/// The `f64` formula over one call's inputs (see [`kv_cost_f64_reference`]).
struct F64Formula<'a, 'l, L: U32Source + ?Sized> {
    config: &'a KvCostConfig,
    request: &'a KvRequest,
    load: &'a KvLoad<'l, L>,
    overlap: &'a KvOverlap<'l>,
    mask: &'a [u64],
    /// Rows of the columns.
    rows: usize,
    /// The least eligible active prefill, when the decay is on.
    min_prefill: u64,
}

impl<'a, 'l, L: U32Source + ?Sized> F64Formula<'a, 'l, L> {
    fn new(
        config: &'a KvCostConfig,
        request: &'a KvRequest,
        load: &'a KvLoad<'l, L>,
        overlap: &'a KvOverlap<'l>,
        mask: &'a [u64],
        rows: usize,
    ) -> Self {
        let mut f = F64Formula {
            config,
            request,
            load,
            overlap,
            mask,
            rows,
            min_prefill: 0,
        };
        if f.decays() {
            f.min_prefill = (0..rows)
                .filter(|&r| contains(mask, r))
                .map(|r| f.load_of(r).1)
                .min()
                .unwrap_or(0);
        }
        f
    }

    fn decays(&self) -> bool {
        self.request.track_prefill_tokens() && self.config.overlap_score_credit_decay > 0.0
    }

    /// Row `r`'s (available, active_prefill, decode_cost, active_requests),
    /// zero without an observation.
    fn load_of(&self, r: usize) -> (bool, u64, u64, u64) {
        let (load, overlap) = (self.load, self.overlap);
        if available(load.load_available, r) {
            let added = overlap
                .added_decode_blocks
                .map_or(self.request.added_decode_blocks(), |c| c[r]);
            let decode = load.active_decode_blocks.value(r) as u64 + added as u64;
            (
                true,
                load.active_prefill_tokens.value(r) as u64,
                decode,
                load.active_requests.value(r) as u64,
            )
        } else {
            (false, 0, 0, 0)
        }
    }

    /// Row `r`'s cost, magnitude and terms (ineligible past the columns
    /// or outside the mask).
    fn row(&self, r: usize) -> KvCostF64 {
        if r >= self.rows || !contains(self.mask, r) {
            return KvCostF64::INELIGIBLE;
        }
        let (config, request, overlap) = (self.config, self.request, self.overlap);
        let track = request.track_prefill_tokens();
        let k = config.overlap_score_credit_decay as f64;
        let bs = request.block_size().get() as f64;
        let isl = request.isl_tokens() as u64;
        let col = |c: Option<&[f32]>| c.map_or(0.0, |c| c[r] as f64);
        let (avail, prefill, decode, requests) = self.load_of(r);
        let decay = if self.decays() {
            let excess_blocks = prefill.saturating_sub(self.min_prefill) as f64 / bs;
            1.0 / (1.0 + k * (excess_blocks / request.request_blocks().max(1) as f64))
        } else {
            1.0
        };
        let terms = [
            config.overlap_score_credit as f64 * decay * col(overlap.device_blocks),
            config.host_cache_hit_weight as f64 * col(overlap.host_blocks),
            config.disk_cache_hit_weight as f64 * col(overlap.disk_blocks),
            config.shared_cache_multiplier as f64 * col(overlap.shared_beyond_device),
        ];
        let credit = terms[0] + terms[1] + terms[2] + terms[3];
        let credit_abs: f64 = terms.iter().map(|t| t.abs()).sum();
        let decode = decode as f64;
        let req = config.decode_active_request_weight as f64 * requests as f64;
        let decode_formula = request.role().has_decode_label() && !track && config.overlap_score_credit > 0.0;
        let (cost, magnitude, mut parts) = if decode_formula {
            let net = (decode - credit).max(0.0);
            let parts = KvCostTerms {
                prefill: 0.0,
                credit: net - decode,
                decode,
                requests: req,
                taint: 0.0,
            };
            (net + req, decode + credit_abs + req.abs(), parts)
        } else {
            let raw_tokens = if !track {
                0.0
            } else if avail {
                // Dynamo's integer arithmetic; `cached` is a token count.
                let cached = col(overlap.cached_tokens);
                let uncached = (isl as f64 - cached).max(0.0);
                prefill as f64 + uncached + cached
            } else {
                isl as f64
            };
            let raw_blocks = raw_tokens / bs;
            let scale = config.prefill_load_scale as f64;
            let net = scale * (raw_blocks - credit).max(0.0);
            let parts = KvCostTerms {
                prefill: scale * raw_blocks,
                credit: net - scale * raw_blocks,
                decode,
                requests: req,
                taint: 0.0,
            };
            (
                net + decode + req,
                scale * (raw_blocks + credit_abs) + decode + req.abs(),
                parts,
            )
        };
        match overlap.preferred_taint_multiplier {
            Some(_) => {
                let m = col(overlap.preferred_taint_multiplier);
                parts.taint = cost * m - cost;
                KvCostF64 {
                    cost: cost * m,
                    magnitude: magnitude * m.abs(),
                    terms: parts,
                }
            }
            None => KvCostF64 {
                cost,
                magnitude,
                terms: parts,
            },
        }
    }
}

/// The KV cost formula evaluated directly in `f64`, as Dynamo does:
/// integer token and block arithmetic, then `f64` (the configuration and
/// overlap values are the `f32` inputs, widened exactly). For the parity
/// tests and for checking [`kv_cost`](super::kv_cost) against Dynamo's numbers; not fast.
///
/// Errors as [`kv_cost`](super::kv_cost). Writes `out[row]` for `row` in `0..rows`.
pub fn kv_cost_f64_reference<L: U32Source + ?Sized>(
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    out: &mut [KvCostF64],
) -> Result<(), KvCostError> {
    let rows = check(config, load, overlap, out.len())?;
    let f = F64Formula::new(config, request, load, overlap, mask, rows);
    for (r, o) in out[..rows].iter_mut().enumerate() {
        *o = f.row(r);
    }
    Ok(())
}

/// [`kv_cost_f64_reference`] for the listed rows only: `out[i]` is row
/// `rows[i]`'s cost, magnitude and terms (`+inf` and no terms for a row
/// outside `mask` or past the columns). For explaining a choice without
/// costing every row: one pass over the eligible rows' prefill load when
/// the decay is on, then only the listed rows.
///
/// Errors as [`kv_cost`](super::kv_cost) (the output column is `out`,
/// which must hold `rows.len()` entries).
pub fn kv_cost_f64_rows<L: U32Source + ?Sized>(
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    overlap: &KvOverlap<'_>,
    mask: &[u64],
    rows: &[usize],
    out: &mut [KvCostF64],
) -> Result<(), KvCostError> {
    // No output column of the fleet's length: only `out` against `rows`.
    let n = check(config, load, overlap, usize::MAX)?;
    if out.len() < rows.len() {
        return Err(KvCostError::ColumnTooShort {
            column: super::KvColumn::Output,
            rows: rows.len(),
            len: out.len(),
        });
    }
    let f = F64Formula::new(config, request, load, overlap, mask, n);
    for (o, &r) in out.iter_mut().zip(rows) {
        *o = f.row(r);
    }
    Ok(())
}
