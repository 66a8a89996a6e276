//! The default KV policy on the kernel's `kv_cost` and `pick`.
//!
//! The host's part: scatter the request's sparse overlaps into per-row
//! columns, compute the preferred-taint multipliers (only when the request
//! prefers taints and is not pinned), apply per-request overrides, then let
//! the kernel write one `f32` cost per row and pick. Nothing here allocates.
//!
//! An explained choice's terms (`terms`) are the kernel's `f64` formula
//! for the chosen and the runner-up rows, on the same inputs read again.
//!
//! With a switching margin (`KvRouterConfig::switch_margin`,
//! `switch_margin_relative`), the eligible row holding the request's
//! longest cached prefix keeps the request unless the cheapest row is
//! cheaper by more than the margin, before the temperature's pick; the
//! policy's per-row dwell counters bound how many requests in a row a row
//! keeps that way (`max_dwell`).

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};

use selkie_kernel::kernels::keyed::scatter_keyed;
use selkie_kernel::kernels::kv_cost::{
    kv_cost, kv_cost_argmin, kv_cost_f64_rows, preferred_taint_multiplier as kernel_multiplier, CostRange,
    KvCostConfig, KvCostError, KvCostF64, KvLoad, KvOverlap, KvRequest, WorkerRole,
};
use selkie_kernel::kernels::pick::{explain, pick_in_range};
use selkie_kernel::kernels::KernelError;
use selkie_kernel::lanes::AtomicView;
use selkie_kernel::Rng;

use super::rank_inputs::{rank_columns, rank_inputs, shared_hits_column};
use super::scratch::{OverlapColumns, Scratch};
use super::{Choice, Env, KvRouterConfig, ScatteredTokens};
use crate::error::{SelectionError, WorkerSelectionPolicyError};
use crate::explain::{Branch, CostTerms};
use crate::filter::for_each_row;
use crate::types::WorkerType;

/// Writes the request's worker-keyed overlaps into the scratch's per-row
/// columns. Returns whether any of them landed on a known row.
///
/// Each entry is mapped to its row through the row index's id-indexed array
/// (else its flat table) and writes two columns (device blocks, cached
/// tokens), eight entries at a time by the kernel's `scatter_keyed` when
/// the entries are many; the lower tiers are
/// written in a second pass, only when some entry has one. What is written
/// is cleared by `reset`: row by row from a list when the entries are few
/// against the rows, else the written columns whole (the kernel's
/// `clear_column`, cheaper than keeping the list).
///
/// Inlined into each instance of [`overlap_view`] (the `kv` policy's and
/// the others'), as it was into the one instance there was before the
/// `kv` policy got its own: a call here costs a keyed selection about ten
/// instructions.
#[inline(always)]
pub(crate) fn scatter_overlaps(env: &Env<'_>, o: &mut OverlapColumns) -> bool {
    let limit = o.device.len().min(env.rows);
    let overlaps = env.req.overlaps;
    let table = env.reg.rank_lookup();
    let by_list = overlaps.len().saturating_mul(OverlapColumns::CLEAR_RATIO) < limit;
    let (device, cached) = (&mut o.device[..limit], &mut o.cached_tokens[..limit]);
    let (written, lower) = if by_list {
        let mut lower = 0;
        for w in overlaps {
            let row = table.row(w.worker) as usize;
            if row < limit {
                device[row] = w.device_blocks as f32;
                cached[row] = w.cached_tokens as f32;
                lower |= w.host_blocks | w.disk_blocks | w.shared_blocks;
                o.touched.push(row as u32);
            }
        }
        (o.touched.len(), lower)
    } else {
        let mut probe = |id, rank| table.probe(id, rank);
        let out = scatter_keyed(overlaps, table.dense(), &mut probe, device, cached);
        o.dirty = limit;
        (out.written, out.lower_tiers)
    };
    if lower != 0 {
        let (host, disk, shared) = (&mut o.host[..limit], &mut o.disk[..limit], &mut o.shared[..limit]);
        for w in overlaps {
            if (w.host_blocks | w.disk_blocks | w.shared_blocks) == 0 {
                continue;
            }
            let row = table.row(w.worker) as usize;
            if row < limit {
                host[row] = w.host_blocks as f32;
                disk[row] = w.disk_blocks as f32;
                shared[row] = w.shared_blocks as f32;
                o.any_host |= w.host_blocks != 0;
                o.any_disk |= w.disk_blocks != 0;
                o.any_shared |= w.shared_blocks != 0;
            }
        }
        o.any_lower = true;
    }
    written != 0
}

/// The overlap columns a policy reads for this request, over `env.rows`
/// rows: the request's [`RowOverlaps`](crate::RowOverlaps) as they are
/// (checked against the snapshot's row layout and length), or the
/// worker-keyed overlaps scattered into `o` (the caller then calls
/// `o.reset()`). `None` for a column that is all zeros.
pub(crate) struct OverlapView<'a> {
    pub(crate) device: Option<&'a [f32]>,
    pub(crate) cached_tokens: Option<&'a [f32]>,
    pub(crate) host: Option<&'a [f32]>,
    pub(crate) disk: Option<&'a [f32]>,
    pub(crate) shared: Option<&'a [f32]>,
    /// The columns are the scratch's (reset them after use).
    pub(crate) scattered: bool,
}

///
/// `KV`: the caller is the `kv` policy, which refuses a request carrying
/// block hashes and no overlaps at all (it reads overlaps, not hashes),
/// checked only where no overlap was written, so never on a request that
/// has some.
pub(crate) fn overlap_view<'a, const KV: bool>(
    env: &Env<'a>,
    o: &'a mut OverlapColumns,
) -> Result<OverlapView<'a>, SelectionError> {
    let rows = env.rows;
    if let Some(r) = env.req.row_overlaps {
        let found = env.reg.layout_epoch();
        if r.layout.epoch != found {
            return Err(SelectionError::StaleRowLayout {
                expected: r.layout.epoch,
                found,
            });
        }
        let check = |column: &'static str, c: Option<&'a [f32]>| match c {
            Some(c) if c.len() < rows => Err(SelectionError::OverlapColumnTooShort {
                column,
                len: c.len(),
                rows,
            }),
            c => Ok(c.map(|c| &c[..rows])),
        };
        return Ok(OverlapView {
            device: check("device_blocks", Some(r.device_blocks))?,
            cached_tokens: check("cached_tokens", r.cached_tokens)?,
            host: check("host_blocks", r.host_blocks)?,
            disk: check("disk_blocks", r.disk_blocks)?,
            shared: check("shared_blocks", r.shared_blocks)?,
            scattered: false,
        });
    }
    let any = scatter_overlaps(env, o);
    if KV && !any && env.req.overlaps.is_empty() && !env.req.prompt_blocks.is_empty() {
        // Nothing was written: nothing to reset.
        return Err(SelectionError::PromptBlocksUnused { policy: "kv" });
    }
    let o = &*o;
    Ok(OverlapView {
        device: col(any, &o.device, rows),
        cached_tokens: col(any, &o.cached_tokens, rows),
        host: col(o.any_host, &o.host, rows),
        disk: col(o.any_disk, &o.disk, rows),
        shared: col(o.any_shared, &o.shared, rows),
        scattered: true,
    })
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
        shared_cache_multiplier: o.shared_cache_multiplier.unwrap_or(cfg.shared_cache_multiplier) as f32,
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

/// Builds the kernel's inputs for this request (the fleet's load columns,
/// the overlap columns, the preferred-taint multipliers) and runs `kernel`
/// on them with `kcfg` (the policy's configuration with the request's
/// overrides, checked here) and the scratch's cost column.
fn with_kernel_inputs<R>(
    env: &Env<'_>,
    s: &mut Scratch,
    kcfg: &KvCostConfig,
    worker_type: WorkerType,
    kernel: impl FnOnce(&KvRequest, &KvLoad<'_, AtomicView<'_>>, &KvOverlap<'_>, &mut [f32]) -> R,
) -> Result<R, SelectionError> {
    if kcfg.validate().is_err() {
        return Err(SelectionError::InvalidRequest(
            "KV cost weights (the policy's, with the request's overrides) must be finite and >= 0, tier weights <= 1",
        ));
    }
    let isl =
        u32::try_from(env.req.isl_tokens).map_err(|_| SelectionError::InvalidRequest("isl_tokens exceeds u32"))?;
    let block_size = NonZeroU32::new(env.ctx.block_size()).ok_or(SelectionError::InvalidRequest("block_size is 0"))?;
    let inputs = rank_inputs(env)?;

    let fleet = env.view;
    let (prefill, decode, active) = (
        fleet.active_prefill_tokens(),
        fleet.active_decode_blocks(),
        fleet.active_requests(),
    );
    let rows = env.rows;
    let taints = !env.pinned && !env.req.preferred_taints.is_empty();
    if taints {
        let taint = &mut s.taint;
        for_each_row(env.mask, rows, |row| {
            taint[row] = env.reg.row(row).map_or(1.0, |m| {
                preferred_taint_multiplier(env.req.preferred_taints, &m.entry.record.taints) as f32
            });
        });
    }
    let Scratch {
        costs,
        overlap,
        taint,
        added,
        observed,
        shared_hits,
        ..
    } = &mut *s;
    let columns = rank_columns(env, inputs, isl.div_ceil(block_size.get()), added, observed);
    let kreq = KvRequest::new(isl, block_size, env.req.track_prefill_tokens, role(worker_type))
        .with_added_decode_blocks(columns.uniform_added);
    let view = overlap_view::<true>(env, overlap)?;
    let shared = shared_hits_column(env, inputs, view.device, shared_hits).or(view.shared);
    let kover = KvOverlap {
        device_blocks: view.device,
        cached_tokens: view.cached_tokens,
        host_blocks: view.host,
        disk_blocks: view.disk,
        shared_beyond_device: shared,
        added_decode_blocks: columns.added,
        preferred_taint_multiplier: taints.then(|| &taint[..rows]),
    };
    let load = KvLoad {
        load_available: columns.observed,
        ..KvLoad::new(&prefill, &decode, &active)
    };
    let result = kernel(&kreq, &load, &kover, &mut costs[..rows]);
    if view.scattered {
        overlap.reset();
    }
    Ok(result)
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
    let range = column_costs(env, s, &kcfg, worker_type)?;
    Ok((kcfg, env.rows, range))
}

/// Writes every row's KV cost under `kcfg` into `s.costs`; returns the
/// eligible range.
fn column_costs(
    env: &Env<'_>,
    s: &mut Scratch,
    kcfg: &KvCostConfig,
    worker_type: WorkerType,
) -> Result<CostRange, SelectionError> {
    let mask = env.mask;
    with_kernel_inputs(env, s, kcfg, worker_type, |kreq, load, kover, costs| {
        kv_cost(kcfg, kreq, load, kover, mask, costs)
    })?
    .map_err(|_| SelectionError::InvalidRequest("KV cost inputs rejected by the kernel"))
}

/// The KV cost of each of `rows` split into the formula's terms, into
/// `out` (one per row; the kernel's `f64` formula, on the inputs the cost
/// was computed from, read again): `prefill`, `cache-credit`, `decode` (its
/// decode blocks and per-request weight, as the `decode` scorer counts
/// them) and, when the request's preferred taints apply, `preferred-taints`.
/// Inputs the cost would refuse are refused alike.
fn rows_terms(
    env: &Env<'_>,
    s: &mut Scratch,
    cfg: &KvRouterConfig,
    worker_type: WorkerType,
    rows: &[usize],
    out: &mut [KvCostF64],
) -> Result<impl Fn(&KvCostF64) -> CostTerms, SelectionError> {
    let kcfg = effective_config(cfg, env);
    let mask = env.mask;
    with_kernel_inputs(env, s, &kcfg, worker_type, |kreq, load, kover, _| {
        kv_cost_f64_rows(&kcfg, kreq, load, kover, mask, rows, out)
    })?
    .map_err(|_| SelectionError::InvalidRequest("KV cost inputs rejected by the kernel"))?;
    let taints = !env.pinned && !env.req.preferred_taints.is_empty();
    Ok(move |c: &KvCostF64| {
        let mut t = CostTerms::new();
        t.push("prefill", c.terms.prefill);
        t.push("cache-credit", c.terms.credit);
        t.push("decode", c.terms.decode + c.terms.requests);
        if taints {
            t.push("preferred-taints", c.terms.taint);
        }
        t
    })
}

/// The terms ([`rows_terms`]) of `row` and of `runner_up`.
pub(crate) fn terms(
    env: &Env<'_>,
    s: &mut Scratch,
    cfg: &KvRouterConfig,
    worker_type: WorkerType,
    row: usize,
    runner_up: Option<usize>,
) -> Option<(CostTerms, Option<CostTerms>)> {
    let both = [row, runner_up.unwrap_or(row)];
    let rows = &both[..1 + usize::from(runner_up.is_some())];
    let mut out = [KvCostF64::default(); 2];
    let named = rows_terms(env, s, cfg, worker_type, rows, &mut out).ok()?;
    Some((named(&out[0]), runner_up.map(|_| named(&out[1]))))
}

/// The terms ([`rows_terms`]) of every row of `env.mask`, with its row.
pub(crate) fn all_terms(
    env: &Env<'_>,
    s: &mut Scratch,
    cfg: &KvRouterConfig,
    worker_type: WorkerType,
) -> Result<Vec<(usize, CostTerms)>, SelectionError> {
    let mut rows = Vec::new();
    for_each_row(env.mask, env.rows, |r| rows.push(r));
    let mut out = vec![KvCostF64::default(); rows.len()];
    let named = rows_terms(env, s, cfg, worker_type, &rows, &mut out)?;
    Ok(rows.into_iter().zip(&out).map(|(r, c)| (r, named(c))).collect())
}

/// Temperature 0 without an explanation: the kernel's cost and argmin in
/// one pass, no cost column.
fn choose_minimum(
    env: &Env<'_>,
    s: &mut Scratch,
    rng: &mut Rng,
    kcfg: &KvCostConfig,
    worker_type: WorkerType,
) -> Result<Choice, SelectionError> {
    let mask = env.mask;
    let result = with_kernel_inputs(env, s, kcfg, worker_type, |kreq, load, kover, _| {
        kv_cost_argmin(kcfg, kreq, load, kover, mask, rng).map(|c| c.map(|c| (c, scattered_tokens(env, kover, c.row))))
    })?;
    let (choice, cached_tokens) = match result {
        Ok(Some(c)) => c,
        Ok(None) => return Err(SelectionError::AllEligibleWorkersOverloaded),
        Err(KvCostError::NonFiniteCost { row }) => return Err(non_finite(row)),
        Err(_) => return Err(SelectionError::InvalidRequest("KV cost inputs rejected by the kernel")),
    };
    Ok(Choice {
        row: choice.row,
        cost: f64::from(choice.cost),
        runner_up: None,
        branch: Branch::KvMinimum,
        candidates: env.candidates(),
        temperature: f64::from(kcfg.router_temperature),
        cached_tokens,
    })
}

/// The request's cached tokens on `row` as the cost read them, where they
/// came from worker-keyed overlaps scattered into the scratch (which is
/// cleared before the booking); [`ScatteredTokens::NONE`] for per-row
/// overlaps (the booking reads their column) and for a request without
/// overlaps.
#[inline(always)]
fn scattered_tokens(env: &Env<'_>, kover: &KvOverlap<'_>, row: usize) -> ScatteredTokens {
    if env.req.row_overlaps.is_some() || env.req.overlaps.is_empty() {
        return ScatteredTokens::NONE;
    }
    ScatteredTokens::from_column(kover.cached_tokens.and_then(|c| c.get(row)).map_or(0.0, |&t| t))
}

/// The eligible row holding the request's longest cached prefix on its
/// device (most device blocks; ties to the lower cost in `costs`, then the
/// lower row). `None` when no eligible row holds any.
fn longest_prefix_row(env: &Env<'_>, costs: &[f32]) -> Option<usize> {
    let (mask, rows) = (env.mask, env.rows.min(costs.len()));
    let mut best: Option<(f32, usize)> = None;
    let mut consider = |row: usize, blocks: f32| {
        if blocks > 0.0 && row < rows && selkie_kernel::mask::contains(mask, row) {
            let better = best.is_none_or(|(b, r)| {
                blocks > b || (blocks == b && (costs[row] < costs[r] || (costs[row] == costs[r] && row < r)))
            });
            if better {
                best = Some((blocks, row));
            }
        }
    };
    match env.req.row_overlaps {
        Some(r) => {
            for_each_row(mask, rows, |row| {
                if let Some(&b) = r.device_blocks.get(row) {
                    consider(row, b);
                }
            });
        }
        None => {
            for o in env.req.overlaps {
                if let Some(row) = env.reg.table_row_of(o.worker) {
                    consider(row, o.device_blocks as f32);
                }
            }
        }
    }
    best.map(|(_, row)| row)
}

/// The switching margin (`cfg.has_switch_margin()`): the row holding the
/// request's longest cached prefix keeps it when its cost is within the
/// margin of the cheapest (before any temperature draw). A holder that is
/// not itself the cheapest keeps at most `cfg.max_dwell` requests in a row
/// that way (`dwell`: one counter per row, taken by compare-and-swap, so the
/// bound holds under concurrent selections; a holder that is the cheapest
/// restarts its count). `Some` when the holder keeps the request; `None`
/// when the choice is left to the normal pick.
fn held_by_margin(env: &Env<'_>, cfg: &KvRouterConfig, costs: &[f32], min: f32, dwell: &[AtomicU32]) -> Option<Choice> {
    let home = longest_prefix_row(env, costs)?;
    let cost = costs[home];
    let saving = f64::from(cost) - f64::from(min);
    let margin = cfg
        .switch_margin
        .max(cfg.switch_margin_relative * f64::from(cost).abs());
    if saving > margin {
        return None;
    }
    let counter = dwell.get(home)?;
    let preview = env.ctx.is_preview();
    let room = |held: u32| (held < cfg.max_dwell).then_some(held + 1);
    let kept = if saving <= 0.0 {
        // The holder is among the cheapest: it wins on its cost.
        if !preview {
            counter.store(0, Ordering::Relaxed);
        }
        true
    } else if preview {
        room(counter.load(Ordering::Relaxed)).is_some()
    } else if counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, room).is_ok() {
        true
    } else {
        // The dwell is used up: this request goes to the normal pick, and
        // the count starts again.
        counter.store(0, Ordering::Relaxed);
        false
    };
    kept.then(|| Choice {
        row: home,
        cost: f64::from(cost),
        runner_up: None,
        branch: Branch::KvHeld,
        candidates: env.candidates(),
        temperature: 0.0,
        cached_tokens: ScatteredTokens::NONE,
    })
}

// Kept out of line: inlined into the policy dispatch, its cost kernel's
// code depends on everything else the dispatch inlines.
#[inline(never)]
pub(crate) fn choose(
    env: &Env<'_>,
    s: &mut Scratch,
    rng: &mut Rng,
    cfg: &KvRouterConfig,
    worker_type: WorkerType,
    dwell: &[AtomicU32],
) -> Result<Choice, SelectionError> {
    let kcfg = effective_config(cfg, env);
    let margin = cfg.has_switch_margin();
    if kcfg.router_temperature == 0.0 && !env.explain && !margin {
        return choose_minimum(env, s, rng, &kcfg, worker_type);
    }
    let mask = env.mask;
    let t = kcfg.router_temperature;
    // The pick runs where the cost column is written, before the scratch's
    // overlap columns are cleared: the chosen row's cached tokens are read
    // there.
    with_kernel_inputs(env, s, &kcfg, worker_type, |kreq, load, kover, costs| {
        let range = kv_cost(&kcfg, kreq, load, kover, mask, costs)
            .map_err(|_| SelectionError::InvalidRequest("KV cost inputs rejected by the kernel"))?;
        let costs = &*costs;
        if margin && range.min.is_finite() && range.max.is_finite() {
            if let Some(mut held) = held_by_margin(env, cfg, costs, range.min, dwell) {
                held.temperature = f64::from(t);
                held.cached_tokens = scattered_tokens(env, kover, held.row);
                if env.explain {
                    held.runner_up = explain(costs, mask, held.row)
                        .and_then(|o| o.runner_up)
                        .map(|(r, c)| (r, f64::from(c)));
                }
                return Ok(held);
            }
        }
        // `kv_cost` returned the eligible range while writing the costs: the
        // pick skips its own finiteness and min/max passes (non-finite ranges
        // fall back to the checked pick inside `pick_in_range`).
        let row = match pick_in_range(costs, mask, range, t, rng) {
            Ok(Some(row)) => row,
            Ok(None) => return Err(SelectionError::AllEligibleWorkersOverloaded),
            Err(KernelError::NonFiniteCost { row }) => return Err(non_finite(row)),
            Err(_) => return Err(SelectionError::InvalidRequest("temperature must be finite and >= 0")),
        };
        if margin && !env.ctx.is_preview() {
            // The chosen row won on its cost: its dwell starts again.
            if let Some(c) = dwell.get(row) {
                c.store(0, Ordering::Relaxed);
            }
        }
        let runner_up = if env.explain {
            explain(costs, mask, row)
                .and_then(|o| o.runner_up)
                .map(|(r, c)| (r, f64::from(c)))
        } else {
            None
        };
        Ok(Choice {
            row,
            cost: f64::from(costs[row]),
            runner_up,
            branch: if t == 0.0 { Branch::KvMinimum } else { Branch::KvSoftmax },
            candidates: env.candidates(),
            temperature: f64::from(t),
            cached_tokens: scattered_tokens(env, kover, row),
        })
    })?
}
