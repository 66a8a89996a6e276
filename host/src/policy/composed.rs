//! Custom policies: run the filters, scorers and picker of a
//! [`WorkerSelectionPolicy`](super::WorkerSelectionPolicy) and enforce the
//! selection contract, step by step:
//!
//! 1. Materialise one [`CandidateData`] per eligible row, computing only the
//!    union of the declared input groups.
//! 2. Filters, in declaration order per candidate; none left is
//!    [`SelectionError::AllEligibleWorkersFiltered`].
//! 3. Scorers, each writing into a NaN-filled buffer; every contribution and
//!    running total must be finite ([`WorkerSelectionPolicyError::NonFiniteCost`]
//!    names the scorer and the row).
//! 4. The picker; a row past the table is
//!    [`WorkerSelectionPolicyError::InvalidPickerRow`].
//!
//! An explained choice also keeps each scorer's contributions (one more
//! copy per scorer), for its explanation's terms.
//!
//! Every plugin call runs under `catch_unwind`: a panic becomes
//! [`WorkerSelectionPolicyError::PluginPanicked`] for this request only.
//! Buffers come from the thread's scratch; nothing is allocated once warm.

use selkie_kernel::lanes::{F32Source, U32Source};

use super::scratch::Scratch;
use super::{Choice, Composed, Env, ScatteredTokens};
use crate::contain::contain_message;
use crate::error::{PluginKind, SelectionError, WorkerSelectionPolicyError};
use crate::explain::{Branch, CostTerms};
use crate::filter::for_each_row;
use crate::plugin::{
    CandidateData, PickerColumns, ScoredWorkerCandidate, WorkerCacheInput, WorkerCandidate, WorkerCandidates,
    WorkerInputView, WorkerInputs, WorkerLoadInput, WorkerOccupancy,
};

/// Runs one plugin call, turning a panic into an error.
pub(crate) fn guarded<T>(
    kind: PluginKind,
    name: &'static str,
    f: impl FnOnce() -> Result<T, WorkerSelectionPolicyError>,
) -> Result<T, WorkerSelectionPolicyError> {
    contain_message(f).unwrap_or_else(|message| {
        tracing::error!(plugin = name, kind = kind.as_str(), %message, "plugin panicked");
        Err(WorkerSelectionPolicyError::PluginPanicked { kind, name, message })
    })
}

/// Fills `s.candidates` with the eligible rows' declared signals.
pub(crate) fn materialize(env: &Env<'_>, s: &mut Scratch, inputs: WorkerInputs) -> Result<(), SelectionError> {
    let want_cache = inputs.contains(WorkerInputs::CACHE);
    let want_taint =
        inputs.contains(WorkerInputs::PREFERRED_TAINT) && !env.pinned && !env.req.preferred_taints.is_empty();
    let want_load = inputs.contains(WorkerInputs::LOAD);
    let want_occ = inputs.contains(WorkerInputs::OCCUPANCY);
    let request_blocks = env.ctx.request_blocks() as f64;
    let fleet = env.view;
    let (active, prefill, decode, weight) = (
        fleet.active_requests(),
        fleet.active_prefill_tokens(),
        fleet.active_decode_blocks(),
        fleet.capacity_weight(),
    );
    let mask = env.mask;
    let inputs = super::rank_inputs::rank_inputs(env)?;
    let Scratch {
        candidates,
        overlap,
        added,
        observed,
        shared_hits,
        ..
    } = s;
    let columns = super::rank_inputs::rank_columns(env, inputs, request_blocks as u32, added, observed);
    let view = if want_cache {
        Some(super::kv::overlap_view::<false>(env, overlap)?)
    } else {
        None
    };
    let shared = view
        .as_ref()
        .and_then(|v| super::rank_inputs::shared_hits_column(env, inputs, v.device, shared_hits).or(v.shared));
    let at = |c: Option<&[f32]>, row: usize| c.map_or(0.0, |c| c[row]);
    candidates.clear();
    for_each_row(mask, env.rows, |row| {
        let Some(meta) = env.reg.row(row) else { return };
        let mut c = CandidateData {
            worker: meta.worker(),
            row,
            device: meta.entry.record.device,
            ..Default::default()
        };
        if want_load {
            // A rank without a load observation reads Dynamo's defaulted
            // load: every signal 0, nothing added.
            let observed = columns.observed.is_none_or(|m| selkie_kernel::mask::contains(m, row));
            c.load = if observed {
                let added = columns.added.map_or(columns.uniform_added, |a| a[row]);
                WorkerLoadInput {
                    available: true,
                    active_prefill_tokens: U32Source::value(&prefill, row) as usize,
                    decode_cost_blocks: f64::from(U32Source::value(&decode, row)) + f64::from(added),
                    active_requests: U32Source::value(&active, row) as usize,
                }
            } else {
                WorkerLoadInput::default()
            };
        }
        if want_occ {
            c.occupancy = WorkerOccupancy {
                active_requests: U32Source::value(&active, row),
                capacity_weight: F32Source::value(&weight, row),
            };
        }
        if let Some(v) = &view {
            c.cache = WorkerCacheInput {
                device_blocks: at(v.device, row) as f64,
                host_blocks: at(v.host, row) as f64,
                disk_blocks: at(v.disk, row) as f64,
                shared_blocks: at(shared, row) as f64,
                cached_tokens: at(v.cached_tokens, row) as usize,
            };
        }
        if want_taint {
            c.preferred_taint_multiplier = Some(super::kv::preferred_taint_multiplier(
                env.req.preferred_taints,
                &meta.entry.record.taints,
            ));
        }
        candidates.push(c);
    });
    if view.is_some_and(|v| v.scattered) {
        overlap.reset();
    }
    Ok(())
}

/// Materialises, filters and scores: leaves the surviving candidates in
/// `s.candidates` and their summed costs in `s.total`.
pub(crate) fn score(env: &Env<'_>, s: &mut Scratch, c: &Composed) -> Result<(), SelectionError> {
    materialize(env, s, c.inputs)?;
    let ctx = env.ctx;
    let Scratch {
        candidates,
        filtered,
        total,
        contrib,
        terms,
        ..
    } = s;
    if !c.filters.is_empty() {
        filtered.clear();
        'rows: for cand in candidates.iter() {
            for f in &c.filters {
                let keep = guarded(PluginKind::Filter, f.name, || {
                    f.plugin.keep(ctx, WorkerCandidate::new(cand, f.inputs))
                })?;
                if !keep {
                    continue 'rows;
                }
            }
            filtered.push(*cand);
        }
        std::mem::swap(candidates, filtered);
    }
    let cands: &[CandidateData] = candidates;
    let n = cands.len();
    if n == 0 {
        return Err(if c.filters.is_empty() {
            SelectionError::AllEligibleWorkersOverloaded
        } else {
            SelectionError::AllEligibleWorkersFiltered
        });
    }
    total.clear();
    total.resize(n, 0.0);
    terms.clear();
    for (scorer_index, scorer) in c.scorers.iter().enumerate() {
        contrib.clear();
        contrib.resize(n, f64::NAN);
        guarded(PluginKind::Scorer, scorer.name, || {
            scorer
                .plugin
                .score(ctx, WorkerCandidates::new(cands, scorer.inputs), contrib)
        })?;
        for (row, (t, &x)) in total.iter_mut().zip(contrib.iter()).enumerate() {
            let sum = *t + x;
            if !x.is_finite() || !sum.is_finite() {
                return Err(WorkerSelectionPolicyError::NonFiniteCost {
                    scorer_index,
                    scorer: scorer.name,
                    row,
                }
                .into());
            }
            *t = sum;
        }
        if env.explain {
            terms.extend_from_slice(contrib);
        }
    }
    Ok(())
}

/// The contributions of each scorer to the cost of candidate `i`, as the
/// last explained [`score`] kept them.
pub(crate) fn terms_at(s: &Scratch, c: &Composed, i: usize) -> Option<CostTerms> {
    let n = s.candidates.len();
    if i >= n || s.terms.len() != n * c.scorers.len() {
        return None;
    }
    let mut t = CostTerms::new();
    for (k, scorer) in c.scorers.iter().enumerate() {
        t.push(scorer.name, s.terms[k * n + i]);
    }
    Some(t)
}

/// [`terms_at`] of the candidates in `row` and in `runner_up`.
pub(crate) fn terms(
    s: &Scratch,
    c: &Composed,
    row: usize,
    runner_up: Option<usize>,
) -> Option<(CostTerms, Option<CostTerms>)> {
    let of = |row: usize| terms_at(s, c, s.candidates.iter().position(|cand| cand.row == row)?);
    Some((of(row)?, runner_up.and_then(of)))
}

pub(crate) fn choose(env: &Env<'_>, s: &mut Scratch, c: &Composed) -> Result<Choice, SelectionError> {
    score(env, s, c)?;
    let (p_inputs, picker) = (&c.picker.inputs, &c.picker);
    let Scratch {
        candidates: cands,
        total,
        scored,
        loads,
        caches,
        ..
    } = s;
    let n = cands.len();
    let taint = p_inputs.contains(WorkerInputs::PREFERRED_TAINT);
    scored.clear();
    scored.extend(cands.iter().zip(total.iter()).map(|(c, &cost)| ScoredWorkerCandidate {
        worker: c.worker,
        cost,
        preferred_taint_multiplier: if taint { c.preferred_taint_multiplier } else { None },
    }));
    let want_load = p_inputs.contains(WorkerInputs::LOAD);
    let want_cache = p_inputs.contains(WorkerInputs::CACHE);
    loads.clear();
    caches.clear();
    if want_load {
        loads.extend(cands.iter().map(|c| c.load));
    }
    if want_cache {
        caches.extend(cands.iter().map(|c| c.cache));
    }
    let columns = PickerColumns {
        scored,
        load: want_load.then_some(&loads[..]),
        cache: want_cache.then_some(&caches[..]),
    };
    let view = WorkerInputView::new(cands, total, columns, *p_inputs);
    let pick = guarded(PluginKind::Picker, picker.name, || picker.plugin.pick(env.ctx, view))?;
    if pick >= n {
        return Err(WorkerSelectionPolicyError::InvalidPickerRow {
            row: pick,
            candidate_count: n,
        }
        .into());
    }
    let runner_up = if env.explain {
        (0..n)
            .filter(|&i| i != pick)
            .min_by(|&a, &b| total[a].total_cmp(&total[b]))
            .map(|i| (cands[i].row, total[i]))
    } else {
        None
    };
    Ok(Choice {
        row: cands[pick].row,
        cost: total[pick],
        runner_up,
        branch: Branch::Picker,
        candidates: n,
        temperature: 0.0,
        cached_tokens: ScatteredTokens::NONE,
    })
}
