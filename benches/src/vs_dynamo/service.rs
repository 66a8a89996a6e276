//! selkie's public path: a [`Scenario`] loaded into a
//! [`selkie::WorkerSelectionService`] (KV policy, default weights, block size
//! 16), and the measured call, [`ServiceFixture::select`]: build the request,
//! `select` (hard filters, overlap scatter, KV cost, pick, book) and drop the
//! returned selection (release), everything a router pays per request.
//!
//! # The overlap input
//!
//! [`OverlapInput`], [`overlap_input`] and [`kv_request`] are the one place
//! that decides how the request's overlaps reach the service, in either of
//! two forms ([`OverlapForm`]): per-row columns (`RowOverlaps`, through
//! `SelectionRequest::with_row_overlaps`, as a KV indexer would hand them
//! over), or one `WorkerOverlap` per worker with a cache hit, in a shuffled
//! order (`SelectionRequest::with_overlaps`, what a router holding
//! Dynamo-style `OverlapScores` passes). Every selkie-service row of the
//! benchmark, the parity check included, goes through them.
//!
//! # How the load gets there
//!
//! Only through the public API: pinned selections whose bookings are held
//! for the fixture's lifetime. A booking holds its request's prompt blocks
//! as decode blocks (`ceil(isl / 16)`) and its uncached prompt tokens as
//! prefill tokens (`isl - cached`, the pinned request's own overlap entry
//! setting `cached`), so a worker of `R` requests, `P` prefill tokens and
//! `D >= ceil(P / 16)` decode blocks is `R` pinned bookings whose prompts
//! add up to `D` blocks, the first one carrying the prefill tokens. Two
//! scenario shapes the service cannot hold exactly are held as an
//! equivalent load instead, with the same KV costs (the parity check
//! verifies every cost):
//!
//! * load with no requests (Dynamo's fixture at ids that are multiples of
//!   17) is held by one request, as the kernel path does; no cost term reads
//!   active requests at the default `decode_active_request_weight` of 0;
//! * more prefill than decode blocks (`P > 16 * D`, Dynamo's fixture from
//!   id 128 on, where prefill grows as `16 * id` and decode blocks wrap at
//!   127) is held as `P = 0`, `D + P / 16` decode blocks. A row's cost is
//!   `P / 16 + D + (isl / 16 - credit)` whenever the credit does not exceed
//!   the prompt's blocks (true of every scenario: overlaps are prefixes of
//!   the prompt) and the credit decay is off (the default), so moving whole
//!   blocks from prefill to decode changes no cost.
//!
//! # The request's own blocks
//!
//! The service adds the request's prompt blocks (`ceil(isl / 16)` = 128) to
//! every row's decode term, as Dynamo's scheduler does when it projects a
//! request onto a worker (`additional_active_blocks`); Dynamo's bench
//! fixture leaves that projection at 0. A uniform shift changes neither the
//! temperature-0 pick nor the softmax (which Dynamo and selkie both
//! normalise by the cost range), and [`ServiceFixture::costs`] removes it,
//! so the parity check compares like with like.
//!
//! This module must not know about Dynamo.

use std::sync::Arc;

use selkie::{
    KvRouterConfig, OwnedSelection, RowLayout, RowOverlaps, SelectionRequest, ServiceConfig, WorkerOverlap,
    WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType, WorkerWithDpRank,
};

use super::{Scenario, BLOCK_SIZE, PROMPT_TOKENS};
use crate::SplitMix64;

/// How the request's overlaps reach the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverlapForm {
    /// Per-row columns for the service's row layout
    /// (`SelectionRequest::with_row_overlaps`).
    Rows,
    /// One `WorkerOverlap` per worker with a hit, keyed by worker id, in a
    /// shuffled order (`SelectionRequest::with_overlaps`).
    Keyed,
}

impl OverlapForm {
    /// Both forms.
    pub const ALL: [OverlapForm; 2] = [OverlapForm::Rows, OverlapForm::Keyed];
}

/// The request's overlaps in both forms: per-row columns (what a KV
/// indexer produces), for the row layout they were computed against, and
/// the same hits keyed by worker. Empty: nothing cached.
pub struct OverlapInput {
    layout: RowLayout,
    device_blocks: Vec<f32>,
    cached_tokens: Vec<f32>,
    keyed: Vec<WorkerOverlap>,
}

/// The seed of the keyed overlaps' order.
const KEYED_ORDER_SEED: u64 = 0x0ede_7ed5;

/// `scenario`'s cache hits in the form [`kv_request`] takes: device blocks
/// and cached tokens per row of `service`'s current row layout (worker `id`
/// of the scenario is worker id `first_id + id`, rank 0).
pub fn overlap_input(service: &WorkerSelectionService, scenario: Option<&Scenario>, first_id: u64) -> OverlapInput {
    let layout = service.row_layout();
    let mut device_blocks = vec![0.0; layout.rows()];
    let mut cached_tokens = vec![0.0; layout.rows()];
    let mut keyed = Vec::new();
    for (id, hit) in scenario.into_iter().flat_map(|s| s.hits()) {
        let worker = WorkerWithDpRank::new(first_id + u64::from(id), 0);
        let row = service.row_of(worker).expect("every scenario worker has a row");
        device_blocks[row] = hit.device_blocks as f32;
        cached_tokens[row] = hit.cached_tokens as f32;
        keyed.push(WorkerOverlap {
            worker,
            device_blocks: hit.device_blocks,
            cached_tokens: hit.cached_tokens,
            ..WorkerOverlap::default()
        });
    }
    // A router's overlap map comes in no particular order: Fisher-Yates.
    let mut rng = SplitMix64::new(KEYED_ORDER_SEED);
    for i in (1..keyed.len()).rev() {
        keyed.swap(i, rng.below(i as u64 + 1) as usize);
    }
    OverlapInput {
        layout,
        device_blocks,
        cached_tokens,
        keyed,
    }
}

/// The measured request: `isl_tokens` prompt tokens, `overlaps` in `form`,
/// the router temperature. Built per call; it borrows the overlaps and
/// allocates nothing.
#[inline]
pub fn kv_request(
    isl_tokens: u32,
    overlaps: &OverlapInput,
    form: OverlapForm,
    temperature: f32,
) -> SelectionRequest<'_> {
    let request = SelectionRequest::new(isl_tokens as usize);
    let request = match form {
        OverlapForm::Rows => request.with_row_overlaps(
            RowOverlaps::new(overlaps.layout, &overlaps.device_blocks).with_cached_tokens(&overlaps.cached_tokens),
        ),
        OverlapForm::Keyed => request.with_overlaps(&overlaps.keyed),
    };
    request.with_temperature(f64::from(temperature))
}

/// A service holding a scenario's load, with the scenario's request.
pub struct ServiceFixture {
    service: Arc<WorkerSelectionService>,
    /// The bookings that hold the scenario's load; dropping them releases it.
    held: Vec<OwnedSelection>,
    overlaps: OverlapInput,
    isl_tokens: u32,
    /// Worker ids are `first_id..first_id + workers`.
    first_id: u64,
    workers: usize,
}

impl ServiceFixture {
    /// `scenario`'s workers (ids `0..n`, one rank each) and load, and its
    /// request (2,048 prompt tokens, its overlaps). Makes one warm-up
    /// selection, so a measured call allocates nothing.
    ///
    /// # Panics
    /// If the service refuses a worker or a booking, or holds other than
    /// the load it was given.
    pub fn new(scenario: &Scenario) -> Self {
        let mut fixture = Self::with_workers(0, scenario.len(), PROMPT_TOKENS, Some(scenario));
        for (id, w) in scenario.workers().iter().enumerate() {
            let load = ServiceLoad::of(w.active_prefill_tokens, w.active_decode_blocks, w.active_requests);
            fixture.hold(id as u64, load);
        }
        fixture.select(0.0);
        fixture
    }

    /// `n` idle workers with ids `first_id..first_id + n`, and a request of
    /// `isl_tokens` prompt tokens with no overlaps (nothing is cached).
    ///
    /// # Panics
    /// If the service refuses a worker.
    pub fn idle(first_id: u64, n: usize, isl_tokens: u32) -> Self {
        let fixture = Self::with_workers(first_id, n, isl_tokens, None);
        fixture.select(0.0);
        fixture
    }

    fn with_workers(first_id: u64, n: usize, isl_tokens: u32, scenario: Option<&Scenario>) -> Self {
        let config = ServiceConfig {
            block_size: BLOCK_SIZE,
            seed: Some(0x5e1c_1e5e),
            ..ServiceConfig::default()
        };
        let policy = WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated);
        let service = Arc::new(WorkerSelectionService::new(policy, config));
        let records = (first_id..first_id + n as u64).map(WorkerRecord::new).collect();
        service.sync(records).expect("the service has room for every worker");
        let overlaps = overlap_input(&service, scenario, first_id);
        ServiceFixture {
            service,
            held: Vec::new(),
            overlaps,
            isl_tokens,
            first_id,
            workers: n,
        }
    }

    /// Books `load` on worker `id` with pinned selections and checks the
    /// service holds exactly that.
    fn hold(&mut self, id: u64, load: ServiceLoad) {
        let rank = WorkerWithDpRank::new(id, 0);
        for (k, blocks) in load.split_decode_blocks().enumerate() {
            let isl = blocks * BLOCK_SIZE;
            let prefill = if k == 0 { load.prefill_tokens } else { 0 };
            let cached = [WorkerOverlap {
                worker: rank,
                cached_tokens: isl - prefill,
                ..WorkerOverlap::default()
            }];
            let req = SelectionRequest::new(isl as usize)
                .with_overlaps(&cached)
                .pinned_to_worker(id);
            let booking = self.service.select_owned(&req).expect("an unlimited worker admits");
            self.held.push(booking);
        }
        let status = self.service.worker_status(id).expect("the worker is registered");
        let r = status.ranks[0];
        assert_eq!(
            (r.active_requests, r.active_prefill_tokens, r.active_decode_blocks),
            (load.requests, load.prefill_tokens, load.decode_blocks),
            "worker {id} holds its load"
        );
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The measured call: build the request, select and book a worker at
    /// `temperature`, release the booking. Returns the worker chosen.
    ///
    /// # Panics
    /// If the selection fails (no scenario overloads a worker).
    #[inline]
    pub fn select(&self, temperature: f32) -> u64 {
        self.select_as(OverlapForm::Rows, temperature)
    }

    /// [`select`](Self::select) with the overlaps in `form`.
    ///
    /// # Panics
    /// If the selection fails (no scenario overloads a worker).
    #[inline]
    pub fn select_as(&self, form: OverlapForm, temperature: f32) -> u64 {
        let req = kv_request(self.isl_tokens, &self.overlaps, form, temperature);
        let selection = self.service.select(&req).expect("the service admits every request");
        let worker = selection.worker().worker_id;
        drop(selection);
        worker
    }

    /// Every worker's KV cost for the request as the service computes it
    /// (the same costs at every temperature), less the request's own prompt
    /// blocks (see the module docs); index `i` is worker `first_id + i`.
    pub fn costs(&self, form: OverlapForm) -> Vec<f32> {
        let req = kv_request(self.isl_tokens, &self.overlaps, form, 0.0);
        let shift = self.isl_tokens.div_ceil(BLOCK_SIZE) as f32;
        let costs = self.service.costs(&req).expect("every worker is eligible");
        assert_eq!(costs.len(), self.workers, "one cost per worker");
        costs
            .iter()
            .enumerate()
            .map(|(i, &(w, c))| {
                assert_eq!(w.worker_id, self.first_id + i as u64, "costs come in worker order");
                // The service widened its `f32` cost; narrowing is exact.
                c as f32 - shift
            })
            .collect()
    }

    /// Total (requests, prefill tokens, decode blocks) the service's workers
    /// hold.
    pub fn outstanding(&self) -> (u64, u64, u64) {
        let mut total = (0, 0, 0);
        for id in self.first_id..self.first_id + self.workers as u64 {
            let status = self.service.worker_status(id).expect("every worker is known");
            for r in status.ranks {
                total.0 += u64::from(r.active_requests);
                total.1 += u64::from(r.active_prefill_tokens);
                total.2 += u64::from(r.active_decode_blocks);
            }
        }
        total
    }

    /// Releases the held load.
    pub fn release_held(&mut self) {
        self.held.clear();
    }
}

/// The load one worker holds in the service (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ServiceLoad {
    requests: u32,
    prefill_tokens: u32,
    decode_blocks: u32,
}

impl ServiceLoad {
    /// The service's equivalent of a worker with `requests`,
    /// `prefill_tokens` and `decode_blocks`.
    fn of(prefill_tokens: u32, decode_blocks: u32, requests: u32) -> Self {
        let busy = prefill_tokens > 0 || decode_blocks > 0;
        let requests = if busy { requests.max(1) } else { requests };
        if prefill_tokens.div_ceil(BLOCK_SIZE) <= decode_blocks {
            return ServiceLoad {
                requests,
                prefill_tokens,
                decode_blocks,
            };
        }
        assert_eq!(
            prefill_tokens % BLOCK_SIZE,
            0,
            "prefill beyond the decode blocks is moved to decode in whole blocks"
        );
        ServiceLoad {
            requests,
            prefill_tokens: 0,
            decode_blocks: decode_blocks + prefill_tokens / BLOCK_SIZE,
        }
    }

    /// Each held request's prompt blocks: they add up to `decode_blocks`,
    /// and the first covers the prefill tokens.
    fn split_decode_blocks(self) -> impl Iterator<Item = u32> {
        let first_min = self.prefill_tokens.div_ceil(BLOCK_SIZE);
        let n = self.requests.max(1);
        let extra = self.decode_blocks - first_min;
        let (each, rest) = (extra / n, extra % n);
        (0..self.requests).map(move |k| if k == 0 { first_min + each + rest } else { each })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_load_splits_into_bookings() {
        let load = ServiceLoad::of(100, 20, 3);
        assert_eq!(load.split_decode_blocks().collect::<Vec<_>>(), [7 + 4 + 1, 4, 4]);
        let moved = ServiceLoad::of(16 * 200, 73, 0);
        assert_eq!(
            moved,
            ServiceLoad {
                requests: 1,
                prefill_tokens: 0,
                decode_blocks: 273
            }
        );
        assert_eq!(ServiceLoad::of(0, 0, 0).split_decode_blocks().count(), 0);
    }

    #[test]
    fn the_service_holds_a_random_fleet_exactly() {
        let scenario = Scenario::random(64, 3);
        let mut f = ServiceFixture::new(&scenario);
        let w = scenario.workers();
        let sum = |g: fn(&super::super::ScenarioWorker) -> u32| w.iter().map(|w| u64::from(g(w))).sum::<u64>();
        assert_eq!(
            f.outstanding(),
            (
                sum(|w| w.active_requests),
                sum(|w| w.active_prefill_tokens),
                sum(|w| w.active_decode_blocks)
            )
        );
        f.select(0.7);
        f.release_held();
        assert_eq!(f.outstanding(), (0, 0, 0));
    }
}
