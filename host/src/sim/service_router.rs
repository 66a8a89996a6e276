//! The [`Router`] that drives selkie's real selection service: each
//! simulated request becomes a [`SelectionRequest`] whose overlaps come from
//! the simulated caches, exactly as a router fed by KV events would build
//! it, and [`WorkerSelectionService::select`] chooses and books the worker.
//! Prefill completion, output blocks and completion go to the returned
//! [`Selection`], so the service's load columns follow the simulated
//! requests the way they follow real ones.
//!
//! Workers are registered as ids `1..=workers`, each with its ranks; row
//! `r` of the simulated fleet is worker `w + 1`, rank `k` for
//! `(w, k) = fleet.worker_and_rank(r)`.

use std::collections::HashMap;
use std::time::Instant;

use crate::{
    AffinityMode, Selection, SelectionRequest, ServiceConfig, WorkerOverlap, WorkerRecord, WorkerSelectionPolicy,
    WorkerSelectionService, WorkerWithDpRank,
};

use super::router::{RouteError, RouteRequest, Routed, Router};
use super::run::FleetSpec;
use super::SimError;

/// Builds a service running `policy` over the simulated `fleet`, seeded so
/// that a run replays exactly.
pub fn fleet_service(
    policy: WorkerSelectionPolicy,
    fleet: &FleetSpec,
    block_size: u32,
    seed: u64,
) -> Result<WorkerSelectionService, SimError> {
    fleet.validate()?;
    let config = ServiceConfig {
        block_size,
        seed: Some(seed),
        ..ServiceConfig::default()
    };
    let service = WorkerSelectionService::new(policy, config);
    let records = (0..fleet.workers.max(1))
        .map(|w| {
            let model = fleet.worker_model(w);
            let mut record = WorkerRecord::new(u64::from(w) + 1)
                .with_dp(0, model.dp_size)
                .with_capacity_weight(model.capacity_weight as f32);
            if model.cpu {
                record = record.with_device(crate::DeviceKind::Cpu);
            }
            if let Some(limit) = fleet.max_active_requests {
                record = record.with_max_active_requests(limit);
            }
            record
        })
        .collect();
    // One snapshot: registering the workers one by one costs a registry
    // change each.
    service.sync(records)?;
    Ok(service)
}

/// A [`Router`] over a [`WorkerSelectionService`] built by [`fleet_service`].
pub struct ServiceRouter<'s> {
    service: &'s WorkerSelectionService,
    /// The worker rank of each row.
    ranks: Vec<WorkerWithDpRank>,
    /// The first row of each worker (0-based).
    first_rows: Vec<usize>,
    block_size: u32,
    /// Whether requests carry their block hashes (only to a policy that
    /// may read them: the `kv` policy refuses hashes without overlaps, as a
    /// request whose blocks no cache holds has).
    prompt_blocks: bool,
    overlaps: Vec<WorkerOverlap>,
    bookings: HashMap<u64, Selection<'s>>,
    /// Bookings of peer replicas, applied here when they arrive.
    mirrored: HashMap<u64, Selection<'s>>,
    affinity: Option<AffinityMode>,
    session_names: HashMap<u64, String>,
}

impl<'s> ServiceRouter<'s> {
    /// Routes through `service`, whose workers mirror `fleet`.
    pub fn new(service: &'s WorkerSelectionService, fleet: &FleetSpec) -> Self {
        // Rows and ranks are mapped once here, not per overlap entry.
        let ranks = (0..fleet.rows())
            .map(|row| {
                let (worker, rank) = fleet.worker_and_rank(row);
                WorkerWithDpRank::new(u64::from(worker) + 1, rank)
            })
            .collect();
        let first_rows = (0..fleet.workers.max(1)).map(|w| fleet.first_row(w)).collect();
        ServiceRouter {
            service,
            ranks,
            first_rows,
            block_size: service.config().block_size,
            prompt_blocks: service.policy().reads_prompt_blocks(),
            overlaps: Vec::with_capacity(fleet.rows()),
            bookings: HashMap::new(),
            mirrored: HashMap::new(),
            affinity: None,
            session_names: HashMap::new(),
        }
    }

    /// Passes each request's session to the service with this affinity
    /// (`None`, the default: requests carry no session).
    pub fn with_session_affinity(mut self, affinity: Option<AffinityMode>) -> Self {
        self.affinity = affinity;
        self
    }

    /// Requests booked and not yet released (its own and its peers').
    pub fn outstanding(&self) -> usize {
        self.bookings.len() + self.mirrored.len()
    }

    /// A peer booked request `id` of `input_tokens` prompt tokens on `row`:
    /// book the same load there (pinned to the row's rank). `false` when
    /// the rank refuses it (at its admission limit).
    fn mirror_book(&mut self, id: u64, row: usize, input_tokens: u32, output_tokens: u32) -> bool {
        let req = SelectionRequest::new(input_tokens as usize)
            .pinned_to_rank(self.ranks[row])
            .with_expected_output_tokens(output_tokens);
        match self.service.select(&req) {
            Ok(selection) => {
                self.mirrored.insert(id, selection);
                true
            }
            Err(_) => false,
        }
    }

    /// A peer's request `id` finished its prefill.
    fn mirror_prefill(&mut self, id: u64) {
        if let Some(s) = self.mirrored.get_mut(&id) {
            s.prefill_complete();
        }
    }

    /// A peer released request `id`.
    fn mirror_release(&mut self, id: u64) {
        if let Some(s) = self.mirrored.remove(&id) {
            s.finish();
        }
    }

    fn rank_of(&self, row: u32) -> WorkerWithDpRank {
        self.ranks[row as usize]
    }

    fn row_of(&self, w: WorkerWithDpRank) -> usize {
        self.first_rows[w.worker_id.saturating_sub(1) as usize] + w.dp_rank as usize
    }
}

impl Router for ServiceRouter<'_> {
    fn block_size(&self) -> Option<u32> {
        Some(self.block_size)
    }

    fn select(&mut self, request: &RouteRequest<'_>) -> Result<Routed, RouteError> {
        let mut overlaps = std::mem::take(&mut self.overlaps);
        overlaps.clear();
        overlaps.extend(
            request
                .overlaps
                .iter()
                .map(|o| WorkerOverlap::device(self.rank_of(o.row), o.blocks, self.block_size)),
        );
        let mut req = SelectionRequest::new(request.input_tokens as usize)
            .with_overlaps(&overlaps)
            .with_prompt_blocks(if self.prompt_blocks { request.prompt_blocks } else { &[] })
            .with_expected_output_tokens(request.output_tokens);
        if let (Some(mode), Some(session)) = (self.affinity, request.session) {
            let name = self
                .session_names
                .entry(session)
                .or_insert_with(|| format!("session-{session}"));
            req = req.with_session(name, mode);
        }
        let started = Instant::now();
        let result = self.service.select(&req);
        let selection_ns = started.elapsed().as_nanos() as u64;
        self.overlaps = overlaps;
        let selection = result.map_err(|e| RouteError(e.to_string()))?;
        let row = self.row_of(selection.worker());
        self.bookings.insert(request.id, selection);
        Ok(Routed { row, selection_ns })
    }

    fn prefill_complete(&mut self, id: u64) {
        if let Some(s) = self.bookings.get_mut(&id) {
            s.prefill_complete();
        }
    }

    fn output_block(&mut self, id: u64) {
        if let Some(s) = self.bookings.get_mut(&id) {
            // A worker cannot vanish mid-simulation; nothing to handle.
            let _ = s.add_output_block();
        }
    }

    fn release(&mut self, id: u64) {
        if let Some(s) = self.bookings.remove(&id) {
            s.finish();
        }
    }
}

/// A booking change one replica sends its peers.
#[derive(Clone, Copy, Debug)]
enum Sync {
    Book {
        row: usize,
        input_tokens: u32,
        output_tokens: u32,
    },
    Prefill,
    Release,
}

/// Several router replicas, each a [`ServiceRouter`] over its own service:
/// requests go to them in turn, and each replica's bookings, prefill
/// completions and releases reach its peers after a fixed delay (or never),
/// as replica sync over a message bus would deliver them. Output-block
/// growth is not synced (as Dynamo's replica sync does not).
pub struct ReplicatedRouter<'s> {
    replicas: Vec<ServiceRouter<'s>>,
    delay_ms: Option<f64>,
    /// Changes in flight: (due time, request, change, sender), in due order
    /// (one delay for all, sent in time order).
    pending: std::collections::VecDeque<(f64, u64, Sync, usize)>,
    owner: HashMap<u64, usize>,
    next: usize,
    now_ms: f64,
    /// Peer bookings a replica refused (its rank at the admission limit).
    refused: usize,
}

impl<'s> ReplicatedRouter<'s> {
    /// Replicas over `replicas` (at least one), syncing after `delay_ms`
    /// (`None`: never).
    pub fn new(replicas: Vec<ServiceRouter<'s>>, delay_ms: Option<f64>) -> Self {
        assert!(!replicas.is_empty(), "at least one replica");
        ReplicatedRouter {
            replicas,
            delay_ms,
            pending: std::collections::VecDeque::new(),
            owner: HashMap::new(),
            next: 0,
            now_ms: 0.0,
            refused: 0,
        }
    }

    /// Delivers every change still in flight (the end of a run).
    pub fn flush(&mut self) {
        self.advance_to(f64::INFINITY);
    }

    /// Requests booked and not yet released, over all replicas.
    pub fn outstanding(&self) -> usize {
        self.replicas.iter().map(ServiceRouter::outstanding).sum()
    }

    /// Peer bookings refused by a replica's admission limit.
    pub fn refused_peer_bookings(&self) -> usize {
        self.refused
    }

    fn send(&mut self, id: u64, change: Sync, from: usize) {
        if let Some(d) = self.delay_ms {
            self.pending.push_back((self.now_ms + d, id, change, from));
        }
    }
}

impl Router for ReplicatedRouter<'_> {
    fn block_size(&self) -> Option<u32> {
        self.replicas.first().and_then(ServiceRouter::block_size)
    }

    fn select(&mut self, request: &RouteRequest<'_>) -> Result<Routed, RouteError> {
        let i = self.next % self.replicas.len();
        self.next = self.next.wrapping_add(1);
        let routed = self.replicas[i].select(request)?;
        self.owner.insert(request.id, i);
        self.send(
            request.id,
            Sync::Book {
                row: routed.row,
                input_tokens: request.input_tokens,
                output_tokens: request.output_tokens,
            },
            i,
        );
        Ok(routed)
    }

    fn prefill_complete(&mut self, id: u64) {
        if let Some(&i) = self.owner.get(&id) {
            self.replicas[i].prefill_complete(id);
            self.send(id, Sync::Prefill, i);
        }
    }

    fn output_block(&mut self, id: u64) {
        if let Some(&i) = self.owner.get(&id) {
            self.replicas[i].output_block(id);
        }
    }

    fn release(&mut self, id: u64) {
        if let Some(i) = self.owner.remove(&id) {
            self.replicas[i].release(id);
            self.send(id, Sync::Release, i);
        }
    }

    fn advance_to(&mut self, now_ms: f64) {
        self.now_ms = self.now_ms.max(now_ms);
        while let Some(&(due, id, change, from)) = self.pending.front() {
            if due > now_ms {
                break;
            }
            self.pending.pop_front();
            for (j, peer) in self.replicas.iter_mut().enumerate() {
                if j == from {
                    continue;
                }
                match change {
                    Sync::Book {
                        row,
                        input_tokens,
                        output_tokens,
                    } => {
                        if !peer.mirror_book(id, row, input_tokens, output_tokens) {
                            self.refused += 1;
                        }
                    }
                    Sync::Prefill => peer.mirror_prefill(id),
                    Sync::Release => peer.mirror_release(id),
                }
            }
        }
    }
}
