//! The KV cost in `f64`, straight from the formula as Dynamo computes it,
//! and the bound the `f32` kernels keep to it (see the parent module's
//! precision notes). For parity tests and investigations, never the hot path.
//!
//! This module must not be used for selection.

use super::{available, check, KvCostConfig, KvCostError, KvLoad, KvOverlap, KvRequest};
use crate::lanes::U32Source;
use crate::mask::contains;

/// The bound, in units of `2^-24` times the magnitude, on the difference
/// between [`kv_cost`](super::kv_cost) and Dynamo's `f64` cost (see the precision notes of [the module](super)).
pub const KV_COST_PARITY_ULPS: f64 = 20.0;

/// One row's cost from [`kv_cost_f64_reference`], with the magnitude its
/// parity bound is relative to.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct KvCostF64 {
    /// The cost, in `f64` (`+inf` for an ineligible row).
    pub cost: f64,
    /// `M`: the taint multiplier times the sum of the absolute values of the
    /// cost's terms (0 for an ineligible row).
    pub magnitude: f64,
}

impl KvCostF64 {
    /// The largest difference [`kv_cost`](super::kv_cost)'s `f32` result may have from
    /// [`cost`](Self::cost): `KV_COST_PARITY_ULPS * 2^-24 * magnitude`.
    pub fn tolerance(&self) -> f64 {
        KV_COST_PARITY_ULPS * libm::ldexp(1.0, -24) * self.magnitude
    }

    /// Whether `cost` (from [`kv_cost`](super::kv_cost)) is within [`tolerance`](Self::tolerance).
    pub fn admits(&self, cost: f32) -> bool {
        if self.cost.is_infinite() {
            return cost as f64 == self.cost;
        }
        (cost as f64 - self.cost).abs() <= self.tolerance()
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
    let track = request.track_prefill_tokens();
    let k = config.overlap_score_credit_decay as f64;
    let bs = request.block_size().get() as f64;
    let isl = request.isl_tokens() as u64;
    // Per row: (available, active_prefill, decode_cost, active_requests), zero without an observation.
    let load_of = |r: usize| -> (bool, u64, u64, u64) {
        if available(load.load_available, r) {
            let added = overlap
                .added_decode_blocks
                .map_or(request.added_decode_blocks(), |c| c[r]);
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
    };
    let min_prefill = if track && k > 0.0 {
        (0..rows)
            .filter(|&r| contains(mask, r))
            .map(|r| load_of(r).1)
            .min()
            .unwrap_or(0)
    } else {
        0
    };
    let col = |c: Option<&[f32]>, r: usize| c.map_or(0.0, |c| c[r] as f64);
    for (r, o) in out[..rows].iter_mut().enumerate() {
        if !contains(mask, r) {
            *o = KvCostF64 {
                cost: f64::INFINITY,
                magnitude: 0.0,
            };
            continue;
        }
        let (avail, prefill, decode, requests) = load_of(r);
        let decay = if track && k > 0.0 {
            let excess_blocks = prefill.saturating_sub(min_prefill) as f64 / bs;
            1.0 / (1.0 + k * (excess_blocks / request.request_blocks().max(1) as f64))
        } else {
            1.0
        };
        let terms = [
            config.overlap_score_credit as f64 * decay * col(overlap.device_blocks, r),
            config.host_cache_hit_weight as f64 * col(overlap.host_blocks, r),
            config.disk_cache_hit_weight as f64 * col(overlap.disk_blocks, r),
            config.shared_cache_multiplier as f64 * col(overlap.shared_beyond_device, r),
        ];
        let credit = terms[0] + terms[1] + terms[2] + terms[3];
        let credit_abs: f64 = terms.iter().map(|t| t.abs()).sum();
        let decode = decode as f64;
        let req = config.decode_active_request_weight as f64 * requests as f64;
        let decode_formula = request.role().has_decode_label() && !track && config.overlap_score_credit > 0.0;
        let (cost, magnitude) = if decode_formula {
            ((decode - credit).max(0.0) + req, decode + credit_abs + req.abs())
        } else {
            let raw_tokens = if !track {
                0.0
            } else if avail {
                // Dynamo's integer arithmetic; `cached` is a token count.
                let cached = col(overlap.cached_tokens, r);
                let uncached = (isl as f64 - cached).max(0.0);
                prefill as f64 + uncached + cached
            } else {
                isl as f64
            };
            let raw_blocks = raw_tokens / bs;
            let scale = config.prefill_load_scale as f64;
            (
                scale * (raw_blocks - credit).max(0.0) + decode + req,
                scale * (raw_blocks + credit_abs) + decode + req.abs(),
            )
        };
        let m = col(overlap.preferred_taint_multiplier, r);
        *o = match overlap.preferred_taint_multiplier {
            Some(_) => KvCostF64 {
                cost: cost * m,
                magnitude: magnitude * m.abs(),
            },
            None => KvCostF64 { cost, magnitude },
        };
    }
    Ok(())
}
