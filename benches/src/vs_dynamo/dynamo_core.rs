//! The second anchor, Dynamo's side: its full selection path,
//! `SelectionCore::select_and_reserve` then `free_reservation`, set up the
//! way dynamo-kv-router 1.6.1's own `benches/selection_core.rs` sets up its
//! `no_hints` cases: a local core (`SelectionCore::try_new_local`, one
//! indexer thread, KV events on, no router queue) with the reference
//! selection policy, workers `1..=n` of block size 16 registered through
//! `upsert_worker`, nothing cached, and a current-thread tokio runtime that
//! blocks on each request. One measured call, [`DynamoCore::select_and_free`],
//! is one iteration of Dynamo's bench: a fresh selection id, a request for
//! the 256-token prompt `1..=256` (or another length, [`DynamoCore::with_prompt`],
//! or given tokens, [`DynamoCore::with_tokens`]), the booked selection and its
//! release. [`DynamoCore::apply_events`] feeds the core's indexer a fleet's
//! engine events, for a prompt its workers hold.
//!
//! Built only with the `dynamo-core` feature. This module must not know
//! about selkie.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::{LocalBlockHash, RouterEvent, RoutingConstraints};
use dynamo_kv_router::services::selection::{
    PromptRequest, SelectAndReserveRequest, SelectionCacheConfig, SelectionCore, WorkerRequest,
};
use dynamo_kv_router::{KvRouterConfig, RoutingPartitionId, WorkerSelectionPolicy};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use super::BLOCK_SIZE;

/// Worker counts of Dynamo's `selection_core` bench.
pub const CORE_WORKER_COUNTS: [u64; 3] = [8, 64, 512];
/// Prompt length of its request, in tokens (the prompt is `1..=256`).
pub const CORE_PROMPT_TOKENS: u32 = 256;

/// A local `SelectionCore` of `n` idle workers and the runtime that drives it.
pub struct DynamoCore {
    runtime: Runtime,
    core: SelectionCore,
    /// Numbers the selection ids, as Dynamo's bench does.
    sequence: u64,
    /// The prompt's token ids.
    prompt: Vec<u32>,
}

impl DynamoCore {
    /// The core with workers `1..=workers` registered.
    ///
    /// # Panics
    /// If the runtime or the core cannot be built, or a worker is refused.
    pub fn new(workers: u64) -> Self {
        Self::with_prompt(workers, CORE_PROMPT_TOKENS)
    }

    /// The core with workers `1..=workers` registered, requests for the
    /// prompt `1..=prompt_tokens`.
    ///
    /// # Panics
    /// As [`new`](Self::new).
    pub fn with_prompt(workers: u64, prompt_tokens: u32) -> Self {
        Self::with_tokens(workers, (1..=prompt_tokens).collect())
    }

    /// The core with workers `1..=workers` registered, requests for the
    /// prompt `tokens`.
    ///
    /// # Panics
    /// As [`new`](Self::new).
    pub fn with_tokens(workers: u64, tokens: Vec<u32>) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
        let config = KvRouterConfig {
            use_kv_events: true,
            router_queue_threshold: None,
            ..Default::default()
        };
        let core = SelectionCore::try_new_local(
            config,
            1,
            CancellationToken::new(),
            SelectionCacheConfig::default(),
            Arc::new(|config, role, _| WorkerSelectionPolicy::reference(config.clone(), role.default_selector_label())),
        )
        .expect("a local selection core");
        runtime.block_on(async {
            for worker_id in 1..=workers {
                let worker = WorkerRequest {
                    worker_id,
                    endpoint: Some(format!("http://worker-{worker_id}:8000")),
                    kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", 40_000 + worker_id)),
                    block_size: Some(BLOCK_SIZE),
                    max_num_batched_tokens: Some(8192),
                    ..WorkerRequest::default()
                };
                core.upsert_worker(worker).await.expect("the core registers the worker");
            }
        });
        DynamoCore {
            runtime,
            core,
            sequence: 0,
            prompt: tokens,
        }
    }

    /// Applies `events` to the core's indexer (its workers are `1..=n`),
    /// then waits until a query of `local_hashes` (a prompt's local block
    /// hashes) credits `expected` blocks in all (the indexer applies events
    /// on its own thread).
    ///
    /// # Panics
    /// If the core has no partition for its requests' model and routing
    /// group, or the credit is not reached within 60 s.
    pub fn apply_events(&mut self, events: Vec<RouterEvent>, local_hashes: &[u64], expected: u64) {
        let key = RoutingPartitionId::new("default", "default");
        let partition = self.core.partition(&key).expect("the workers' partition");
        let hashes: Vec<LocalBlockHash> = local_hashes.iter().map(|&h| LocalBlockHash(h)).collect();
        self.runtime.block_on(async {
            for event in events {
                partition.indexer().apply_event(event).await;
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let scores = partition
                    .indexer()
                    .find_matches(hashes.clone())
                    .await
                    .expect("Dynamo's indexer answers");
                let credited: u64 = scores.scores.values().map(|&s| u64::from(s)).sum();
                if credited == expected {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "Dynamo's indexer credits {credited} blocks, not {expected}"
                );
                tokio::task::yield_now().await;
            }
        });
    }

    /// The measured call: select and reserve a worker for the prompt, then
    /// free the reservation. Returns the worker chosen.
    ///
    /// # Panics
    /// If Dynamo refuses either call.
    #[inline]
    pub fn select_and_free(&mut self) -> u64 {
        self.sequence += 1;
        let id = format!("bench-{}", self.sequence);
        let request = reserve_request(id.clone(), &self.prompt);
        let core = &self.core;
        self.runtime.block_on(async {
            let response = core.select_and_reserve(request).await.expect("Dynamo reserves");
            core.free_reservation(&id).await.expect("Dynamo frees");
            response.worker_id
        })
    }
}

/// The request of Dynamo's bench: default model and routing group, the
/// prompt's token ids, nothing else.
fn reserve_request(selection_id: String, prompt: &[u32]) -> SelectAndReserveRequest {
    SelectAndReserveRequest {
        model_name: "default".to_string(),
        routing_group: "default".to_string(),
        selection_id: Some(selection_id),
        prompt: PromptRequest {
            token_ids: Some(prompt.to_vec()),
            ..PromptRequest::default()
        },
        router_config_override: None,
        expected_output_tokens: None,
        priority_jump: None,
        strict_priority: None,
        session_id: None,
        session_context: None,
        affinity_target: None,
        pinned_worker: None,
        allowed_worker_ids: None,
        routing_constraints: RoutingConstraints::default(),
    }
}
