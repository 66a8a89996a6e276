//! Dynamo's side: a [`Scenario`] built the way dynamo-kv-router 1.6.1's own
//! bench builds its `worker_selection` fixture (`benches/worker_selection.rs`,
//! `fixture_with_preferred_taints` with no taints), the call it measures, and
//! a way to read back the exact `f64` cost Dynamo gave a worker.
//!
//! # Reading Dynamo's costs
//!
//! Nothing public returns per-worker costs: `select_worker` returns only the
//! chosen worker. But for a non-pinned, non-decode selection Dynamo logs the
//! chosen worker's cost as a structured `f64` field,
//! `tracing::info!(router_mode = "kv", .., logit = cost, .., "Selected worker")`
//! (`scheduling/selector/mod.rs`, `log_selection`). [`DynamoFixture::cost_of`]
//! runs the real `DefaultWorkerSelector` at temperature 0 on the same request
//! with worker `id` as the only candidate (a one-entry worker map, so each
//! call is O(1) rather than a scan of a 10,000-entry allowlist), under a
//! scoped subscriber that keeps only that field, and returns it: Dynamo's own
//! arithmetic, bit for bit. Narrowing the candidates changes no cost term in
//! any scenario: the only term that depends on the eligible set is the
//! credit decay's minimum active prefill, and the decay is off
//! (`overlap_score_credit_decay = 0`, Dynamo's default and its fixture's
//! `direct` group). [`DynamoFixture::choose_with_cost`] reads the cost of the
//! worker an unrestricted selection picks the same way.
//!
//! This module must not know about selkie.

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dynamo_kv_router::protocols::{RoutingConstraints, WorkerId, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
use dynamo_kv_router::test_utils::SimpleWorkerConfig;
use dynamo_kv_router::{
    DefaultWorkerSelector, KvRouterConfig, SchedulingRequest, WorkerLoadProjection, WorkerSelectionInput,
    WorkerSelector,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

use super::{Scenario, BLOCK_SIZE, PROMPT_TOKENS, TOTAL_KV_BLOCKS};

/// A scenario as Dynamo sees it: the worker map and the request.
pub struct DynamoFixture {
    workers: HashMap<WorkerId, SimpleWorkerConfig>,
    request: SchedulingRequest,
}

impl DynamoFixture {
    /// Builds the worker map and the request for `scenario`'s workers
    /// (worker `id` is `scenario.workers()[id]`), as Dynamo's bench does:
    /// an overlap entry for each worker with a cache hit, a load entry for
    /// every worker.
    pub fn new(scenario: &Scenario) -> Self {
        let n = scenario.len();
        let mut workers = HashMap::with_capacity(n);
        let mut overlap = OverlapSignals::default();
        let mut request = base_request(PROMPT_TOKENS as usize);
        request.expected_output_tokens = Some(256);
        for (id, f) in scenario.workers().iter().enumerate() {
            let worker_id = WorkerId::from(id as u32);
            let w = WorkerWithDpRank::from_worker_id(worker_id);
            workers.insert(
                worker_id,
                SimpleWorkerConfig {
                    total_kv_blocks: Some(TOTAL_KV_BLOCKS),
                    ..Default::default()
                },
            );
            if let Some(hit) = f.hit {
                // Dynamo's bench: `cached as f64 / block_size as f64`, the
                // device blocks for every scenario.
                overlap.effective_overlap_blocks.insert(w, f64::from(hit.device_blocks));
                overlap.effective_cached_tokens.insert(w, hit.cached_tokens as usize);
            }
            request.worker_loads.insert(
                w,
                WorkerLoadProjection {
                    active_prefill_tokens: f.active_prefill_tokens as usize,
                    active_decode_blocks: f.active_decode_blocks as usize,
                    active_requests: f.active_requests as usize,
                    ..Default::default()
                },
            );
        }
        request.overlap = overlap;
        DynamoFixture { workers, request }
    }

    /// Dynamo's default selector (`DefaultWorkerSelector`, label "prefill",
    /// default config) at `temperature`, as its bench constructs it.
    pub fn selector(temperature: f64) -> DefaultWorkerSelector {
        DefaultWorkerSelector::new(
            Some(KvRouterConfig {
                router_temperature: temperature,
                overlap_score_credit_decay: 0.0,
                ..Default::default()
            }),
            "prefill",
        )
    }

    /// The measured call: exactly what Dynamo's bench times per iteration.
    #[inline]
    pub fn select(&self, selector: &DefaultWorkerSelector) -> u64 {
        let workers = black_box(&self.workers);
        let request = black_box(&self.request);
        selector
            .select_worker(WorkerSelectionInput::configured(
                workers,
                request,
                request.eligibility(),
                BLOCK_SIZE,
            ))
            .expect("Dynamo selects a worker")
            .worker
            .worker_id
    }

    /// One selection over every worker at `selector`'s temperature: the
    /// chosen worker and the exact cost Dynamo logged for it.
    pub fn choose_with_cost(&self, selector: &DefaultWorkerSelector) -> (u64, f64) {
        let (worker, cost) = capture_logit(|| self.select(selector));
        (worker, cost.expect("Dynamo logged the chosen worker's cost"))
    }

    /// Dynamo's exact cost for worker `id` (see the module docs): one
    /// temperature-0 selection whose only candidate is `id`, on the same
    /// request.
    pub fn cost_of(&self, id: u32) -> f64 {
        let worker_id = WorkerId::from(id);
        let only = HashMap::from([(worker_id, self.workers[&worker_id].clone())]);
        let selector = Self::selector(0.0);
        let (chosen, cost) = capture_logit(|| {
            selector
                .select_worker(WorkerSelectionInput::configured(
                    &only,
                    &self.request,
                    self.request.eligibility(),
                    BLOCK_SIZE,
                ))
                .expect("Dynamo selects the only worker")
                .worker
                .worker_id
        });
        assert_eq!(chosen, worker_id, "worker {id} was the only candidate");
        cost.expect("Dynamo logged the chosen worker's cost")
    }
}

/// Runs `f` under a subscriber that keeps the last `logit` field any event
/// carried, then restores the callsite interest cache so that Dynamo's timed
/// calls afterwards skip their `info!` exactly as they do with no subscriber.
fn capture_logit<R>(f: impl FnOnce() -> R) -> (R, Option<f64>) {
    let capture = LogitCapture::default();
    let last = Arc::clone(&capture.last);
    let r = tracing::subscriber::with_default(capture, f);
    tracing::callsite::rebuild_interest_cache();
    let bits = last.load(Ordering::Relaxed);
    (r, (bits != NONE).then(|| f64::from_bits(bits)))
}

/// "No logit seen" (a NaN payload no cost can have).
const NONE: u64 = 0x7FF8_DEAD_BEEF_0001;

/// A subscriber interested only in events with a `logit` field.
struct LogitCapture {
    last: Arc<AtomicU64>,
}

impl Default for LogitCapture {
    fn default() -> Self {
        LogitCapture {
            last: Arc::new(AtomicU64::new(NONE)),
        }
    }
}

fn has_logit(meta: &Metadata<'_>) -> bool {
    meta.is_event() && meta.fields().field("logit").is_some()
}

impl Subscriber for LogitCapture {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if has_logit(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }
    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        has_logit(meta)
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        event.record(&mut LogitVisitor(&self.last));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

struct LogitVisitor<'a>(&'a AtomicU64);

impl Visit for LogitVisitor<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        if field.name() == "logit" {
            self.0.store(value.to_bits(), Ordering::Relaxed);
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

/// A query-only request of `isl_tokens` prompt tokens and nothing else (no
/// overlaps, loads, constraints or overrides): what the fixtures fill in.
pub fn base_request(isl_tokens: usize) -> SchedulingRequest {
    SchedulingRequest {
        mode: ScheduleMode::QueryOnly { request_id: None },
        token_seq: None,
        isl_tokens,
        lora_name: None,
        expected_output_tokens: None,
        affinity_target: None,
        pinned_worker: None,
        allowed_worker_ids: None,
        routing_constraints: RoutingConstraints {
            required_taints: HashSet::new(),
            preferred_taints: HashMap::new(),
        },
        router_config_override: None,
        track_prefill_tokens: true,
        priority_jump: 0.0,
        strict_priority: 0,
        policy_class: None,
        session_context: None,
        overlap: OverlapSignals::default(),
        kv_transfer_candidates: None,
        retain_kv_transfer_chain: false,
        shared_cache_hits: None,
        worker_loads: Default::default(),
        resp_tx: None,
    }
}
