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
    overlaps: Vec<WorkerOverlap>,
    bookings: HashMap<u64, Selection<'s>>,
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
            overlaps: Vec::with_capacity(fleet.rows()),
            bookings: HashMap::new(),
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

    /// Requests booked and not yet released.
    pub fn outstanding(&self) -> usize {
        self.bookings.len()
    }

    fn rank_of(&self, row: u32) -> WorkerWithDpRank {
        self.ranks[row as usize]
    }

    fn row_of(&self, w: WorkerWithDpRank) -> usize {
        self.first_rows[w.worker_id.saturating_sub(1) as usize] + w.dp_rank as usize
    }
}

impl Router for ServiceRouter<'_> {
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
            .with_prompt_blocks(request.prompt_blocks)
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
