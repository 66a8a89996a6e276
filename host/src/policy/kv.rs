//! The default KV policy (SPEC §4) on the kernel's `kv_cost` and `pick`.
//!
//! The host's part: scatter the request's sparse overlaps into per-row
//! columns, compute the preferred-taint multipliers (only when the request
//! prefers taints and is not pinned), apply per-request overrides, then let
//! the kernel write one `f32` cost per row and pick. Nothing here allocates.

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use selkie_kernel::kernels::kv_cost::{
    kv_cost, preferred_taint_multiplier as kernel_multiplier, CostRange, KvCostConfig, KvLoad, KvOverlap, KvRequest,
    WorkerRole,
};
use selkie_kernel::kernels::pick::{explain, pick_in_range};
use selkie_kernel::kernels::KernelError;
use selkie_kernel::Rng;

use super::scratch::Scratch;
use super::{Choice, Env, KvRouterConfig};
use crate::error::{SelectionError, WorkerSelectionPolicyError};
use crate::explain::Branch;
use crate::filter::for_each_row;
use crate::request::WorkerOverlap;
use crate::types::WorkerType;

/// Writes the request's overlaps into the scratch's per-row columns.
/// Returns whether any of them landed on a known row.
///
/// Overlaps sorted by worker rank (as an indexer that walks workers in
/// order produces them) are merged with the registry's sorted rank index:
/// a forward walk with galloping, cache-friendly at any density. Unsorted
/// overlaps fall back to one hash lookup each.
pub(crate) fn scatter_overlaps(env: &Env<'_>, s: &mut Scratch) -> bool {
    let o = &mut s.overlap;
    let overlaps = env.req.overlaps;
    let mut put = |row: usize, w: &WorkerOverlap| {
        if row < o.device.len() {
            o.device[row] = w.device_blocks as f32;
            o.cached_tokens[row] = w.cached_tokens as f32;
            // The lower tiers are often empty: write them only when set.
            if w.host_blocks != 0 {
                o.host[row] = w.host_blocks as f32;
                o.any_host = true;
            }
            if w.disk_blocks != 0 {
                o.disk[row] = w.disk_blocks as f32;
                o.any_disk = true;
            }
            if w.shared_blocks != 0 {
                o.shared[row] = w.shared_blocks as f32;
                o.any_shared = true;
            }
            o.touched.push(row as u32);
        }
    };
    if overlaps.windows(2).all(|p| p[0].worker < p[1].worker) {
        let index = env.reg.sorted_ranks();
        let mut pos = 0;
        for w in overlaps {
            // Gallop forward to the first entry >= w.worker, then search.
            let mut step = 1;
            let mut hi = pos;
            while hi < index.len() && index[hi].0 < w.worker {
                pos = hi + 1;
                hi += step;
                step *= 2;
            }
            let hi = hi.min(index.len());
            pos += index[pos..hi].partition_point(|e| e.0 < w.worker);
            if let Some(&(k, row)) = index.get(pos) {
                if k == w.worker {
                    put(row as usize, w);
                    pos += 1;
                }
            }
        }
    } else {
        for w in overlaps {
            if let Some(row) = env.reg.row_of(w.worker) {
                put(row, w);
            }
        }
    }
    !o.touched.is_empty()
}

/// Dynamo's `exp(-tanh(sum of the weights of the preferred taints the
/// worker has))`.
pub(crate) fn preferred_taint_multiplier(preferred: &[(&str, f32)], taints: &BTreeSet<String>) -> f64 {
    let sum: f64 = preferred
        .iter()
        .filter(|(t, _)| taints.contains(*t))
        .map(|(_, w)| f64::from(*w))
        .sum();
    f64::from(kernel_multiplier(sum as f32))
}

fn role(t: WorkerType) -> WorkerRole {
    match t {
        WorkerType::Aggregated => WorkerRole::Aggregated,
        WorkerType::Prefill => WorkerRole::Prefill,
        WorkerType::Decode => WorkerRole::Decode,
    }
}

/// The kernel configuration for this request: the policy's, with the
/// request's overrides.
pub(crate) fn effective_config(cfg: &KvRouterConfig, env: &Env<'_>) -> KvCostConfig {
    let o = env.req.kv_overrides.unwrap_or_default();
    KvCostConfig {
        overlap_score_credit: o.overlap_score_credit.unwrap_or(cfg.overlap_score_credit) as f32,
        overlap_score_credit_decay: cfg.overlap_score_credit_decay as f32,
        prefill_load_scale: o.prefill_load_scale.unwrap_or(cfg.prefill_load_scale) as f32,
        decode_active_request_weight: o
            .decode_active_request_weight
            .unwrap_or(cfg.decode_active_request_weight) as f32,
        host_cache_hit_weight: o.host_cache_hit_weight.unwrap_or(cfg.host_cache_hit_weight) as f32,
        disk_cache_hit_weight: o.disk_cache_hit_weight.unwrap_or(cfg.disk_cache_hit_weight) as f32,
        shared_cache_multiplier: cfg.shared_cache_multiplier as f32,
        router_temperature: env.req.temperature.unwrap_or(cfg.router_temperature) as f32,
    }
}

fn col(on: bool, c: &[f32], rows: usize) -> Option<&[f32]> {
    on.then(|| &c[..rows])
}

fn non_finite(row: usize) -> SelectionError {
    WorkerSelectionPolicyError::NonFiniteCost {
        scorer_index: 0,
        scorer: "kv",
        row,
    }
    .into()
}

/// Writes every row's KV cost into `s.costs` (`+inf` on ineligible rows);
/// returns the effective configuration and the rows covered.
pub(crate) fn fill_costs(
    env: &Env<'_>,
    s: &mut Scratch,
    cfg: &KvRouterConfig,
    worker_type: WorkerType,
) -> Result<(KvCostConfig, usize, CostRange), SelectionError> {
    let kcfg = effective_config(cfg, env);
    if kcfg.validate().is_err() {
        return Err(SelectionError::InvalidRequest(
            "KV cost weights (the policy's, with the request's overrides) must be finite and >= 0, tier weights <= 1",
        ));
    }
    let isl =
        u32::try_from(env.req.isl_tokens).map_err(|_| SelectionError::InvalidRequest("isl_tokens exceeds u32"))?;
    let block_size = NonZeroU32::new(env.ctx.block_size()).ok_or(SelectionError::InvalidRequest("block_size is 0"))?;
    let kreq = KvRequest::new(isl, block_size, env.req.track_prefill_tokens, role(worker_type))
        .with_added_decode_blocks(isl.div_ceil(block_size.get()));

    let fleet = env.view;
    let (prefill, decode, active) = (
        fleet.active_prefill_tokens(),
        fleet.active_decode_blocks(),
        fleet.active_requests(),
    );
    let rows = env.rows;
    let has_overlap = scatter_overlaps(env, s);
    let taints = !env.pinned && !env.req.preferred_taints.is_empty();
    if taints {
        let Scratch { mask, taint, .. } = &mut *s;
        for_each_row(mask, rows, |row| {
            taint[row] = env.reg.row(row).map_or(1.0, |m| {
                preferred_taint_multiplier(env.req.preferred_taints, &m.entry.record.taints) as f32
            });
        });
    }
    let Scratch {
        mask,
        costs,
        overlap,
        taint,
        ..
    } = &mut *s;
    let kover = KvOverlap {
        device_blocks: col(has_overlap, &overlap.device, rows),
        cached_tokens: col(has_overlap, &overlap.cached_tokens, rows),
        host_blocks: col(overlap.any_host, &overlap.host, rows),
        disk_blocks: col(overlap.any_disk, &overlap.disk, rows),
        shared_beyond_device: col(overlap.any_shared, &overlap.shared, rows),
        added_decode_blocks: None,
        preferred_taint_multiplier: taints.then(|| &taint[..rows]),
    };
    let load = KvLoad::new(&prefill, &decode, &active);
    let result = kv_cost(&kcfg, &kreq, &load, &kover, mask, &mut costs[..rows]);
    overlap.reset();
    let range = result.map_err(|_| SelectionError::InvalidRequest("KV cost inputs rejected by the kernel"))?;
    Ok((kcfg, rows, range))
}

pub(crate) fn choose(
    env: &Env<'_>,
    s: &mut Scratch,
    rng: &mut Rng,
    cfg: &KvRouterConfig,
    worker_type: WorkerType,
) -> Result<Choice, SelectionError> {
    let (kcfg, rows, range) = fill_costs(env, s, cfg, worker_type)?;
    let Scratch { mask, costs, .. } = &mut *s;
    let t = kcfg.router_temperature;
    // `kv_cost` returned the eligible range while writing the costs: the pick
    // skips its own finiteness and min/max passes (non-finite ranges fall
    // back to the checked pick inside `pick_in_range`).
    let row = match pick_in_range(&costs[..rows], mask, range, t, rng) {
        Ok(Some(row)) => row,
        Ok(None) => return Err(SelectionError::AllEligibleWorkersOverloaded),
        Err(KernelError::NonFiniteCost { row }) => return Err(non_finite(row)),
        Err(_) => return Err(SelectionError::InvalidRequest("temperature must be finite and >= 0")),
    };
    let cost = f64::from(costs[row]);
    let runner_up = if env.explain {
        explain(&costs[..rows], mask, row)
            .and_then(|o| o.runner_up)
            .map(|(r, c)| (r, f64::from(c)))
    } else {
        None
    };
    Ok(Choice {
        row,
        cost,
        runner_up,
        branch: if t == 0.0 { Branch::KvMinimum } else { Branch::KvSoftmax },
        candidates: selkie_kernel::mask::count(mask, rows),
        temperature: f64::from(t),
    })
}
