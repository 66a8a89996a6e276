//! The default KV cost's terms as scorers: [`PrefillScorer`],
//! [`DecodeScorer`], [`CacheCreditScorer`] and [`PreferredTaintScorer`].
//!
//! With the default weights, `prefill + decode + cache-credit` inside
//! `preferred-taints` is the default KV policy's cost for the
//! same candidates, with one difference: Dynamo clamps the prefill blocks
//! net of the credit at 0 (`max(0, prefill_blocks - credit)`), and a sum of
//! separate terms cannot. The two agree whenever the credit does not exceed
//! the prefill blocks (with prefill tracked) or the decode blocks (without),
//! which holds while the overlaps lie within the prompt. With a
//! `prefill_load_scale` other than 1, Dynamo also scales the credit; the
//! credit scorer's weights are not scaled.
//!
//! These scorers read only their declared inputs and hold no state.

use std::cell::RefCell;

use serde::{Deserialize, Serialize};

use crate::error::{WorkerSelectionPolicyError, WorkerSelectionPolicyProviderError};
use crate::plugin::{WorkerCandidate, WorkerCandidates, WorkerInputs, WorkerScorer, WorkerSelectionContext};
use crate::policy::KvRouterConfig;
use crate::types::WorkerType;
use crate::KvConfigField;

type R<T> = Result<T, WorkerSelectionPolicyError>;

/// Checks one KV weight with the KV configuration's own check.
fn check(field: KvConfigField, value: f64) -> Result<(), WorkerSelectionPolicyProviderError> {
    field
        .check(value)
        .map_err(|source| WorkerSelectionPolicyProviderError::KvWeight { value, source })
}

fn load<'a>(c: WorkerCandidate<'a>, scorer: &str) -> R<&'a crate::WorkerLoadInput> {
    c.load()
        .ok_or_else(|| WorkerSelectionPolicyError::failed(format!("{scorer} needs WorkerInputs::LOAD")))
}

fn cache<'a>(c: WorkerCandidate<'a>, scorer: &str) -> R<&'a crate::WorkerCacheInput> {
    c.cache()
        .ok_or_else(|| WorkerSelectionPolicyError::failed(format!("{scorer} needs WorkerInputs::CACHE")))
}

/// Parameters of [`PrefillScorer`] (scorer type `prefill`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillParameters {
    /// Weight of the prefill blocks (the KV configuration's, default 1).
    pub prefill_load_scale: f64,
}

impl Default for PrefillParameters {
    fn default() -> Self {
        PrefillParameters {
            prefill_load_scale: KvRouterConfig::default().prefill_load_scale,
        }
    }
}

/// The prefill term of the default KV cost: the prefill blocks a worker
/// rank would hold with this request, `(active_prefill_tokens +
/// max(prompt_tokens, cached_tokens)) / block_size`, times
/// `prefill_load_scale`; 0 when the request's prompt is not tracked as
/// prefill load. The cached part is what [`CacheCreditScorer`] credits back.
///
/// It charges the whole prompt, cached or not: a composed policy with
/// `prefill` and without `cache-credit` ignores every cache. Compose them
/// together (as the default KV cost does) unless that is the aim.
///
/// ```
/// use selkie::*;
/// let scorer = PrefillScorer::new(PrefillParameters { prefill_load_scale: 2.0 })?;
/// assert_eq!(scorer.required_worker_inputs(), WorkerInputs::LOAD | WorkerInputs::CACHE);
/// let err = PrefillScorer::new(PrefillParameters { prefill_load_scale: -1.0 }).unwrap_err();
/// assert_eq!(err.to_string(), "prefill_load_scale must be at least 0, got -1");
/// # Ok::<(), WorkerSelectionPolicyProviderError>(())
/// ```
#[derive(Clone, Debug)]
pub struct PrefillScorer {
    scale: f64,
}

impl PrefillScorer {
    /// The scorer, if `parameters` are within the KV configuration's bounds.
    pub fn new(parameters: PrefillParameters) -> Result<Self, WorkerSelectionPolicyProviderError> {
        check(KvConfigField::PrefillLoadScale, parameters.prefill_load_scale)?;
        Ok(PrefillScorer {
            scale: parameters.prefill_load_scale,
        })
    }
}

impl WorkerScorer for PrefillScorer {
    fn name(&self) -> &'static str {
        "prefill"
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD | WorkerInputs::CACHE
    }
    fn score(&self, ctx: &WorkerSelectionContext<'_>, candidates: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        if !ctx.tracks_prefill_tokens() {
            costs.fill(0.0);
            return Ok(());
        }
        let (isl, bs) = (ctx.prompt_tokens(), f64::from(ctx.block_size()));
        for (cost, c) in costs.iter_mut().zip(candidates.iter()) {
            let tokens = load(c, "prefill")?.active_prefill_tokens() + isl.max(cache(c, "prefill")?.cached_tokens());
            *cost = self.scale * (tokens as f64 / bs);
        }
        Ok(())
    }
}

/// Parameters of [`DecodeScorer`] (scorer type `decode`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecodeParameters {
    /// Blocks charged per active request (the KV configuration's, default 0).
    pub decode_active_request_weight: f64,
}

impl Default for DecodeParameters {
    fn default() -> Self {
        DecodeParameters {
            decode_active_request_weight: KvRouterConfig::default().decode_active_request_weight,
        }
    }
}

/// The decode term of the default KV cost: the worker rank's active decode
/// blocks plus the blocks this request adds, plus
/// `decode_active_request_weight` per active request.
///
/// ```
/// use selkie::*;
/// let scorer = DecodeScorer::new(DecodeParameters::default())?;
/// assert_eq!(scorer.required_worker_inputs(), WorkerInputs::LOAD);
/// let err = DecodeScorer::new(DecodeParameters { decode_active_request_weight: f64::NAN }).unwrap_err();
/// assert!(err.to_string().starts_with("decode_active_request_weight must be finite"), "{err}");
/// # Ok::<(), WorkerSelectionPolicyProviderError>(())
/// ```
#[derive(Clone, Debug)]
pub struct DecodeScorer {
    request_weight: f64,
}

impl DecodeScorer {
    /// The scorer, if `parameters` are within the KV configuration's bounds.
    pub fn new(parameters: DecodeParameters) -> Result<Self, WorkerSelectionPolicyProviderError> {
        check(
            KvConfigField::DecodeActiveRequestWeight,
            parameters.decode_active_request_weight,
        )?;
        Ok(DecodeScorer {
            request_weight: parameters.decode_active_request_weight,
        })
    }
}

impl WorkerScorer for DecodeScorer {
    fn name(&self) -> &'static str {
        "decode"
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }
    fn score(&self, _: &WorkerSelectionContext<'_>, candidates: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        for (cost, c) in costs.iter_mut().zip(candidates.iter()) {
            let l = load(c, "decode")?;
            *cost = l.decode_cost_blocks() + self.request_weight * l.active_requests() as f64;
        }
        Ok(())
    }
}

/// Parameters of [`CacheCreditScorer`] (scorer type `cache-credit`), with
/// the KV configuration's names, defaults and bounds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheCreditParameters {
    /// Credit per device-cached block (default 1).
    pub overlap_score_credit: f64,
    /// Decay of the device credit with a rank's prefill backlog above the
    /// least-loaded candidate's (default 0: none).
    pub overlap_score_credit_decay: f64,
    /// Credit per host-cached block (default 0.75, at most 1).
    pub host_cache_hit_weight: f64,
    /// Credit per disk-cached block (default 0.25, at most 1).
    pub disk_cache_hit_weight: f64,
    /// Credit per shared-cache block beyond the device overlap (default 0,
    /// at most 1).
    pub shared_cache_multiplier: f64,
}

impl Default for CacheCreditParameters {
    fn default() -> Self {
        let d = KvRouterConfig::default();
        CacheCreditParameters {
            overlap_score_credit: d.overlap_score_credit,
            overlap_score_credit_decay: d.overlap_score_credit_decay,
            host_cache_hit_weight: d.host_cache_hit_weight,
            disk_cache_hit_weight: d.disk_cache_hit_weight,
            shared_cache_multiplier: d.shared_cache_multiplier,
        }
    }
}

/// The cache credit of the default KV cost, subtracted: `-(credit * decay *
/// device + host_weight * host + disk_weight * disk + shared_multiplier *
/// shared)` in blocks, where `decay = 1 / (1 + k * excess_prefill_blocks /
/// request_blocks)` with prefill tracked and `k > 0`, else 1.
///
/// As in Dynamo, without prefill tracking the credit only offsets decode
/// blocks, and only in aggregated and decode pools with a device credit
/// above 0; elsewhere it is 0.
///
/// ```
/// use selkie::*;
/// let scorer = CacheCreditScorer::new(CacheCreditParameters::default())?;
/// assert_eq!(scorer.required_worker_inputs(), WorkerInputs::CACHE);
/// let bad = CacheCreditParameters { host_cache_hit_weight: 1.5, ..Default::default() };
/// let err = CacheCreditScorer::new(bad).unwrap_err();
/// assert_eq!(err.to_string(), "host_cache_hit_weight must be at most 1, got 1.5");
/// # Ok::<(), WorkerSelectionPolicyProviderError>(())
/// ```
#[derive(Clone, Debug)]
pub struct CacheCreditScorer {
    p: CacheCreditParameters,
}

impl CacheCreditScorer {
    /// The scorer, if `parameters` are within the KV configuration's bounds.
    pub fn new(parameters: CacheCreditParameters) -> Result<Self, WorkerSelectionPolicyProviderError> {
        let p = parameters;
        check(KvConfigField::OverlapScoreCredit, p.overlap_score_credit)?;
        check(KvConfigField::OverlapScoreCreditDecay, p.overlap_score_credit_decay)?;
        check(KvConfigField::HostCacheHitWeight, p.host_cache_hit_weight)?;
        check(KvConfigField::DiskCacheHitWeight, p.disk_cache_hit_weight)?;
        check(KvConfigField::SharedCacheMultiplier, p.shared_cache_multiplier)?;
        Ok(CacheCreditScorer { p })
    }
}

impl WorkerScorer for CacheCreditScorer {
    fn name(&self) -> &'static str {
        "cache-credit"
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        if self.p.overlap_score_credit_decay > 0.0 {
            WorkerInputs::CACHE | WorkerInputs::LOAD
        } else {
            WorkerInputs::CACHE
        }
    }
    fn score(&self, ctx: &WorkerSelectionContext<'_>, candidates: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        let p = &self.p;
        let track = ctx.tracks_prefill_tokens();
        let offsets_decode = ctx.worker_type() != WorkerType::Prefill && p.overlap_score_credit > 0.0;
        if !track && !offsets_decode {
            costs.fill(0.0);
            return Ok(());
        }
        let k = p.overlap_score_credit_decay;
        let decays = track && k > 0.0;
        let prefill = |c: WorkerCandidate<'_>| load(c, "cache-credit").map(|l| l.active_prefill_tokens());
        let mut min_prefill = usize::MAX;
        if decays {
            for c in candidates.iter() {
                min_prefill = min_prefill.min(prefill(c)?);
            }
        }
        let bs = f64::from(ctx.block_size());
        let request_blocks = ctx.request_blocks().max(1) as f64;
        for (cost, c) in costs.iter_mut().zip(candidates.iter()) {
            let decay = if decays {
                let excess = (prefill(c)? - min_prefill) as f64 / bs;
                1.0 / (1.0 + k * (excess / request_blocks))
            } else {
                1.0
            };
            let o = cache(c, "cache-credit")?;
            *cost = -(p.overlap_score_credit * decay * o.device_overlap_blocks()
                + p.host_cache_hit_weight * o.host_overlap_blocks()
                + p.disk_cache_hit_weight * o.disk_overlap_blocks()
                + p.shared_cache_multiplier * o.shared_blocks());
        }
        Ok(())
    }
}

thread_local! {
    /// Contribution buffers of [`PreferredTaintScorer`], reused across
    /// selections (taken out while in use, so nested scorers get their own).
    static BUFFERS: RefCell<Vec<Vec<f64>>> = const { RefCell::new(Vec::new()) };
}

fn with_buffer<T>(len: usize, fill: f64, f: impl FnOnce(&mut [f64]) -> T) -> T {
    let mut b = BUFFERS.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    b.clear();
    b.resize(len, fill);
    let out = f(&mut b);
    BUFFERS.with(|p| p.borrow_mut().push(b));
    out
}

/// The preferred-taint multiplier of the default KV cost: the sum of the
/// inner scorers, times each candidate's multiplier (`exp(-tanh(sum of the
/// weights of the request's preferred taints the worker has))`, at most 1,
/// so preferred workers cost less). Without preferred taints (or when the
/// request is pinned) the multiplier is 1: the sum as it is.
///
/// The inner scorers' contributions must be finite: the first that is not
/// is [`WorkerSelectionPolicyError::NonFiniteCost`] with the inner scorer's
/// position and name. Each inner scorer sees the inputs it declared.
///
/// ```
/// use selkie::*;
/// let scorer = PreferredTaintScorer::new(vec![
///     Box::new(PrefillScorer::new(PrefillParameters::default())?),
///     Box::new(DecodeScorer::new(DecodeParameters::default())?),
/// ]);
/// assert_eq!(scorer.required_worker_inputs(), WorkerInputs::PREFERRED_TAINT | WorkerInputs::LOAD | WorkerInputs::CACHE);
/// # Ok::<(), WorkerSelectionPolicyProviderError>(())
/// ```
pub struct PreferredTaintScorer {
    inner: Vec<(WorkerInputs, Box<dyn WorkerScorer>)>,
}

impl PreferredTaintScorer {
    /// The multiplier applied to the sum of `inner`.
    pub fn new(inner: Vec<Box<dyn WorkerScorer>>) -> Self {
        PreferredTaintScorer {
            inner: inner.into_iter().map(|s| (s.required_worker_inputs(), s)).collect(),
        }
    }
}

impl WorkerScorer for PreferredTaintScorer {
    fn name(&self) -> &'static str {
        "preferred-taints"
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        self.inner
            .iter()
            .fold(WorkerInputs::PREFERRED_TAINT, |a, (i, _)| a | *i)
    }
    fn score(&self, ctx: &WorkerSelectionContext<'_>, candidates: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        costs.fill(0.0);
        for (scorer_index, (inputs, scorer)) in self.inner.iter().enumerate() {
            with_buffer(candidates.len(), f64::NAN, |contrib| {
                scorer.score(ctx, candidates.restricted(*inputs), contrib)?;
                for (row, (t, &x)) in costs.iter_mut().zip(contrib.iter()).enumerate() {
                    if !x.is_finite() {
                        return Err(WorkerSelectionPolicyError::NonFiniteCost {
                            scorer_index,
                            scorer: scorer.name(),
                            row,
                        });
                    }
                    *t += x;
                }
                Ok(())
            })?;
        }
        for (cost, c) in costs.iter_mut().zip(candidates.iter()) {
            *cost *= c.preferred_taint_multiplier().unwrap_or(1.0);
        }
        Ok(())
    }
}
