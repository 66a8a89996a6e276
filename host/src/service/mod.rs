//! The selection service: the object a router holds, one per routing
//! partition. It owns the kernel fleet, the worker registry, the policy and
//! the session table, and runs every request through
//! hard filters → policy → booking.
//!
//! # Concurrency
//!
//! Discovery changes go to a master registry under a mutex and bump a
//! version number. Selection never takes that lock on its fast path: each
//! thread keeps an immutable snapshot (`Arc<WorkerRegistry>`) of the master
//! per service, and only reloads it (under the mutex, once per change) when
//! the version moved. A stale snapshot is harmless: the rows it may name
//! are intersected with the fleet's live rows, and every booking names the
//! row's `SlotId`, so a row that was reused since refuses the booking and
//! the selection rescans. Booking is the kernel's lock-free protocol. With
//! the built-in policies a warm thread allocates nothing per request.
//!
//! What takes a lock or allocates is listed on [`WorkerSelectionService`].
//!
//! The service is the top of the host's layers (below only the
//! configuration file and the simulator): it passes the thread's scratch to
//! the policy and asks it to `choose` or give its `costs`, and it never
//! reaches into a policy's internals. [`DiscoveryPoller`] (`poller`) drives
//! a discovery source into a service on its own thread.

mod fast;
#[cfg(test)]
mod input_tests;
mod poller;
#[cfg(feature = "nats")]
mod replica;
mod run;
mod selection;
mod session;
mod snapshot;
#[cfg(test)]
mod tests;

use snapshot::SERVICE_IDS;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrics::Counter;
use selkie_kernel::lanes::U32Source;

use crate::discovery::registry::{RefreshReport, SyncReport, WorkerRegistry};
use crate::discovery::{BusyThresholds, Discovery, WorkerRecord, WorkerState};
use crate::error::{DiscoveryError, SelectionError};
use crate::filter::{eligible_rows, is_busy, Rejections};
use crate::fleet::HostFleet;
use crate::plugin::WorkerSelectionContext;
use crate::policy::scratch::{with_scratch, Scratch};
use crate::policy::{Env, ReadyRows, WorkerSelectionPolicy};
use crate::request::{RowLayout, SelectionRequest};
use crate::types::{RankRow, WorkerId, WorkerWithDpRank};
use session::SessionTable;

pub use poller::{DiscoveryHealth, DiscoveryPoller};
#[cfg(feature = "nats")]
pub use replica::{OverAdmission, ReplicaSyncThread};

use crate::explain::Explanation;

impl Preview {
    /// The worker rank the request would go to (as
    /// [`Selection::worker`]).
    pub fn worker(&self) -> WorkerWithDpRank {
        self.worker
    }

    /// Why, with the runner-up (as [`Selection::explanation`]).
    pub fn explanation(&self) -> &Explanation {
        &self.explanation
    }
}
pub use selection::{Booked, FleetHandle, OwnedSelection, Preview, RankStatus, Selection, WorkerStatus};

/// Settings of a [`WorkerSelectionService`].
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceConfig {
    /// Tokens per KV block (default 16): the one source of the block size.
    /// A [`KvIndex`](crate::kv_index::KvIndex) and a
    /// [`KvBlockHasher`](crate::kv_index::KvBlockHasher) are built with it;
    /// each is checked against it where they meet: the index's
    /// [`sync_rows`](crate::kv_index::KvIndex::sync_rows) refuses the
    /// service's [`row_layout`](WorkerSelectionService::row_layout) of
    /// another block size, its token queries refuse a hasher of another,
    /// and [`check_request`](WorkerSelectionService::check_request) refuses
    /// overlaps and block hashes past the prompt at this size.
    pub block_size: u32,
    /// Busy thresholds for workers whose record has none.
    pub default_busy_thresholds: BusyThresholds,
    /// A request's LoRA adapter must be loaded on the worker (default
    /// `false`: as Dynamo, prefer workers that have it, else any worker,
    /// which loads it lazily).
    pub lora_required: bool,
    /// Sessions idle longer than this forget their worker (default 10 min).
    pub session_idle_timeout: Duration,
    /// Sessions remembered at most (default 65,536; rounded up to a power
    /// of two of 8-session buckets, at most 4,194,304). Size it at about
    /// 1.2x the sessions live at once: each session may sit in one of two
    /// buckets, and a new session whose two buckets are both full of live
    /// sessions evicts the least recently used of them
    /// (`selkie_session_evictions_total`); at 75% of the capacity 99.9% of
    /// live sessions are kept, at 90% 99%. The table takes about 40 bytes
    /// per session, allocated on the first session-carrying request.
    pub max_sessions: usize,
    /// Seed for every random choice (`None`: seeded per thread from the
    /// clock). With a seed, single-threaded runs replay exactly.
    pub seed: Option<u64>,
    /// Bookings tried (each after a rescan without the refused row) before
    /// reporting overload (default 4).
    pub max_booking_attempts: u32,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            block_size: 16,
            default_busy_thresholds: BusyThresholds::NONE,
            lora_required: false,
            session_idle_timeout: Duration::from_secs(600),
            max_sessions: 65_536,
            seed: None,
            max_booking_attempts: 4,
        }
    }
}

/// Worker selection for one routing partition. See the crate docs for a
/// walk-through.
///
/// # Locks and allocations
///
/// Selection and booking take no lock and, with the built-in policies,
/// allocate nothing once a thread is warm. The exceptions:
///
/// * A change of the workers takes the master registry's mutex; the first
///   selection on each thread after a change takes it too, to reload its
///   snapshot (the master is cloned into a new snapshot once per change,
///   shared by every thread).
/// * A request that carries a session takes the session table's locks. The
///   table is a fixed array of 8-entry buckets, each behind its own mutex,
///   keyed by a 64-bit hash of the session id: the lookup locks the
///   session's first bucket and, when the session is not there, its second;
///   binding it after the booking locks both, in index order. Each critical
///   section compares at most 8 hashes per bucket and writes at most one
///   entry, and no lock is shared by all sessions: two requests wait for
///   each other only when their sessions share a bucket. The table is
///   allocated whole on the first bind; new sessions allocate nothing after
///   that.
/// * A thread's first selection allocates its scratch buffers, a custom
///   policy's plugins allocate what they allocate, and
///   [`costs`](WorkerSelectionService::costs) returns a `Vec`.
pub struct WorkerSelectionService {
    fleet: HostFleet,
    /// The master registry; changes happen here.
    master: Mutex<WorkerRegistry>,
    /// Bumped (under `master`) by every change.
    version: crossbeam_utils::CachePadded<AtomicU64>,
    /// The last snapshot built, and the version it reflects.
    published: Mutex<(u64, Arc<WorkerRegistry>)>,
    /// Identifies this service in the per-thread snapshot caches.
    id: u64,
    policy: WorkerSelectionPolicy,
    /// How the policy takes a plain request's eligible rows as the
    /// snapshot's ready rows (the fast path's first check and its draw,
    /// kept here as one byte).
    ready_rows: ReadyRows,
    config: ServiceConfig,
    sessions: SessionTable,
    /// The last snapshot `refresh` could not apply, retried by later
    /// refreshes.
    /// With the registry version after its refusal: any later change of
    /// the workers drops it.
    refused: Mutex<Option<(u64, Vec<WorkerRecord>)>>,
    seed_counter: AtomicU64,
    /// The seed mixed once, for the streams of a seeded service
    /// (`config.seed`).
    seed_base: Option<u64>,
    /// `log2` of the block size and the mask of a block's tokens, when it
    /// is a power of two (so not 0): a booking's blocks are then a shift,
    /// not a division.
    block_shift: Option<(u32, u64)>,
    selections: Counter,
    rejections: Rejections,
    /// The cost terms of the last explained selections.
    explained: crate::explain::TermsLog,
    /// Booking sync with other router replicas (feature `nats`).
    #[cfg(feature = "nats")]
    replica: replica::ReplicaLink,
}

impl WorkerSelectionService {
    /// A service with no workers, running `policy`.
    pub fn new(policy: WorkerSelectionPolicy, config: ServiceConfig) -> Self {
        WorkerSelectionService {
            fleet: HostFleet::new(),
            master: Mutex::new(WorkerRegistry::new(config.default_busy_thresholds)),
            version: crossbeam_utils::CachePadded::new(AtomicU64::new(1)),
            published: Mutex::new((0, Arc::new(WorkerRegistry::new(config.default_busy_thresholds)))),
            id: SERVICE_IDS.fetch_add(1, Ordering::Relaxed),
            selections: metrics::counter!("selkie_selections_total", "policy" => policy.name()),
            rejections: Rejections::register(),
            explained: crate::explain::TermsLog::new(),
            sessions: SessionTable::new(config.session_idle_timeout, config.max_sessions),
            refused: Mutex::new(None),
            seed_counter: AtomicU64::new(0),
            seed_base: config.seed.map(run::seed_base),
            // `None` for a block size of 0 (not a power of two), which
            // every selection refuses.
            block_shift: config
                .block_size
                .is_power_of_two()
                .then(|| (config.block_size.trailing_zeros(), config.block_size as u64 - 1)),
            #[cfg(feature = "nats")]
            replica: replica::ReplicaLink::new(),
            ready_rows: policy.ready_rows(),
            policy,
            config,
        }
    }

    /// The policy.
    pub fn policy(&self) -> &WorkerSelectionPolicy {
        &self.policy
    }

    /// The settings.
    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    /// The master registry (slow paths only: status, retarget, costs).
    pub(crate) fn read_registry(&self) -> MutexGuard<'_, WorkerRegistry> {
        self.master.lock().unwrap_or_else(PoisonError::into_inner)
    }

    // ---- discovery ---------------------------------------------------

    /// Adds a worker (one fleet row per data-parallel rank).
    pub fn add_worker(&self, record: WorkerRecord) -> Result<(), DiscoveryError> {
        self.change(|reg, fleet| reg.add(fleet, record))
    }

    /// Replaces a worker's record (in-flight load is kept when its ranks are
    /// unchanged).
    pub fn update_worker(&self, record: WorkerRecord) -> Result<(), DiscoveryError> {
        self.change(|reg, fleet| reg.update(fleet, record))
    }

    /// Removes a worker. Its outstanding [`Selection`]s stay valid and
    /// release nothing into the row's next occupant.
    pub fn remove_worker(&self, worker_id: WorkerId) -> Result<(), DiscoveryError> {
        self.change(|reg, fleet| reg.remove(fleet, worker_id))
    }

    /// Makes a worker live, draining or cordoned.
    pub fn set_worker_state(&self, worker_id: WorkerId, state: WorkerState) -> Result<(), DiscoveryError> {
        self.change(|reg, fleet| reg.set_state(fleet, worker_id, state))
    }

    /// Marks a worker overloaded (skipped as overloaded by the hard
    /// filters) or clears the mark, e.g. from an external load monitor.
    pub fn set_overloaded(&self, worker_id: WorkerId, overloaded: bool) -> Result<(), DiscoveryError> {
        self.change(|reg, _| reg.set_overloaded(worker_id, overloaded))
    }

    /// Sets load on `worker`'s rank that this service did not book: for
    /// example the requests an engine reports running or waiting beyond
    /// the ones booked here (`selkie serve` scrapes them from the engines'
    /// metrics). It counts as in-flight requests, as this service's
    /// bookings do: for the load policies and the admission limits (the
    /// KV cost reads in-flight requests only through
    /// `decode_active_request_weight`, 0 by default); `requests` of 0
    /// takes it back.
    ///
    /// It is written where replica sync writes its peers' load, so it is
    /// refused while a replica sync is attached (use one or the other).
    /// Returns whether it was written: not when the rank has no row, its
    /// row changed hands, or a replica sync is attached.
    ///
    /// ```
    /// use selkie::{SelectionRequest, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerWithDpRank};
    /// let service = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
    /// service.add_worker(WorkerRecord::new(1))?;
    /// service.add_worker(WorkerRecord::new(2))?;
    /// // Worker 1's engine holds 5 requests this service never booked.
    /// assert!(service.set_external_load(WorkerWithDpRank::new(1, 0), 5));
    /// assert_eq!(service.peek(&SelectionRequest::new(64))?.worker.worker_id, 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_external_load(&self, worker: WorkerWithDpRank, requests: u64) -> bool {
        #[cfg(feature = "nats")]
        if self.replica.sync().is_some() {
            return false;
        }
        let Some(slot) =
            self.with_snapshot(|reg| reg.row_of(worker).and_then(|row| reg.row(row)).map(|r| r.handle.slot))
        else {
            return false;
        };
        let load = selkie_kernel::fleet::Outstanding {
            requests: requests.min(u64::from(selkie_kernel::fleet::COUNTER_MAX)) as u32,
            prefill_tokens: 0,
            decode_blocks: 0,
        };
        self.fleet.set_remote_load(slot, load).is_ok()
    }

    /// Makes the worker table equal `snapshot` (adds, updates, removes).
    ///
    /// The snapshot applies whole or not at all: it is refused, changing
    /// nothing, if a record is invalid, an id repeats, or the fleet has too
    /// few rows for it. A removed worker's rows that bookings still hold are
    /// kept out of rotation until those bookings end; if the worker comes
    /// back first, it gets them back with their load.
    pub fn sync(&self, snapshot: Vec<WorkerRecord>) -> Result<SyncReport, DiscoveryError> {
        self.change(|reg, fleet| reg.sync(fleet, snapshot))
    }

    /// Polls `source` once and applies its snapshot if it changed; takes the
    /// records the source refused ([`Discovery::take_refused`]).
    ///
    /// Refused records never fail a refresh: the snapshot holds the other
    /// records and applies as usual, and the refusals come back in the
    /// [`RefreshReport`] (a [`DiscoveryPoller`] logs and counts them). They
    /// are taken only when the refresh succeeds, so a refresh that fails
    /// leaves them with the source for the next one.
    ///
    /// A snapshot that [`sync`](Self::sync) refuses changes nothing; the
    /// service keeps it and tries it again on every later refresh whose
    /// poll reports no change, until it applies (e.g. once the bookings that
    /// held the rows it needs have ended), the source delivers a newer one,
    /// or the workers are changed some other way (then it is dropped). The
    /// source is told when a snapshot it delivered is refused
    /// ([`Discovery::snapshot_refused`]).
    pub fn refresh(&self, source: &mut dyn Discovery) -> Result<RefreshReport, DiscoveryError> {
        let refused = || self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        let (snapshot, fresh) = match source.poll()? {
            Some(snapshot) => (snapshot, true),
            // Retried only while nothing else changed the workers since it
            // was refused (a direct change, or a newer snapshot, wins).
            None => match refused().take() {
                Some((version, kept)) if version == self.version.load(Ordering::Acquire) => (kept, false),
                _ => {
                    return Ok(RefreshReport {
                        applied: None,
                        refused: source.take_refused(),
                    })
                }
            },
        };
        let kept = snapshot.clone();
        match self.sync(snapshot) {
            Ok(report) => {
                *refused() = None;
                Ok(RefreshReport {
                    applied: Some(report),
                    refused: source.take_refused(),
                })
            }
            Err(e) => {
                *refused() = Some((self.version.load(Ordering::Acquire), kept));
                if fresh {
                    source.snapshot_refused(&e);
                }
                Err(e)
            }
        }
    }

    /// Registered workers, by id.
    pub fn workers(&self) -> Vec<WorkerRecord> {
        let reg = self.read_registry();
        let mut v: Vec<_> = reg.workers().map(|e| e.record.clone()).collect();
        v.sort_by_key(|r| r.worker_id);
        v
    }

    /// A worker's record, per-rank load and overload state.
    pub fn worker_status(&self, worker_id: WorkerId) -> Option<WorkerStatus> {
        let reg = self.read_registry();
        let e = reg.get(worker_id)?;
        let f = &self.fleet;
        let ranks: Vec<RankStatus> = e
            .rows
            .iter()
            .map(|&(dp_rank, h)| RankStatus {
                dp_rank,
                active_requests: f.active_requests().value(h.row),
                active_prefill_tokens: f.active_prefill_tokens().value(h.row),
                active_decode_blocks: f.active_decode_blocks().value(h.row),
                busy: reg.row(h.row).is_some_and(|m| is_busy(m, f, h.row)),
            })
            .collect();
        let overloaded = e.overloaded.load(Ordering::Relaxed) || (!ranks.is_empty() && ranks.iter().all(|r| r.busy));
        Some(WorkerStatus {
            record: e.record.clone(),
            ranks,
            overloaded,
        })
    }

    /// A service for one routing partition from a policy factory (as
    /// [`WorkerSelectionConfig::resolve`](crate::WorkerSelectionConfig::resolve)
    /// returns): calls the factory once.
    ///
    /// ```
    /// use selkie::*;
    /// let config = WorkerSelectionConfig::from_yaml_str("prefill: p\ninstances:\n  - { name: p, type: power-of-two }")?;
    /// let factory = config.resolve(&WorkerSelectionPolicyRegistry::new(), WorkerType::Prefill)?;
    /// let service = WorkerSelectionService::from_factory(
    ///     &factory,
    ///     &KvRouterConfig::default(),
    ///     WorkerType::Prefill,
    ///     RoutingPartitionRef::model("llama"),
    ///     ServiceConfig::default(),
    /// );
    /// assert_eq!(service.policy().name(), "power-of-two");
    /// # Ok::<(), selkie::ConfigError>(())
    /// ```
    pub fn from_factory(
        factory: &crate::WorkerSelectionPolicyFactory,
        kv_config: &crate::KvRouterConfig,
        worker_type: crate::WorkerType,
        partition: crate::RoutingPartitionRef<'_>,
        config: ServiceConfig,
    ) -> Self {
        Self::new(factory(kv_config, worker_type, partition), config)
    }

    // ---- rows --------------------------------------------------------

    /// The row layout selections use now: its epoch and the rows a
    /// [`RowOverlaps`](crate::RowOverlaps) column must cover. Read it
    /// before [`row_of`](Self::row_of) (see [`RowLayout`]). Lock-free on a
    /// warm thread.
    ///
    /// ```
    /// use selkie::*;
    /// let service = WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default());
    /// let before = service.row_layout();
    /// service.add_worker(WorkerRecord::new(7))?;
    /// let after = service.row_layout();
    /// assert_ne!(before.epoch(), after.epoch(), "a worker got a row");
    /// assert!(after.rows() > service.row_of(WorkerWithDpRank::new(7, 0)).unwrap());
    /// service.set_worker_state(7, WorkerState::Draining)?;
    /// assert_eq!(service.row_layout().epoch(), after.epoch(), "state changes keep the rows");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn row_layout(&self) -> RowLayout {
        self.with_snapshot(|reg| RowLayout::new(reg.layout_epoch(), reg.scan_rows(), self.config.block_size))
    }

    /// The row of a worker rank in the current layout, the index of its
    /// value in a [`RowOverlaps`](crate::RowOverlaps) column; `None` if the
    /// rank has no row.
    pub fn row_of(&self, worker: WorkerWithDpRank) -> Option<usize> {
        self.with_snapshot(|reg| reg.row_of(worker))
    }

    /// [`row_of`](Self::row_of) with the rank's tenure: the layout epoch
    /// from which it holds its row. A rank removed and added again gets a
    /// new tenure, even on the same row, so a reader that kept per-rank
    /// state across two reads (the KV index's
    /// [`sync_rows`](crate::kv_index::KvIndex::sync_rows)) can tell a
    /// worker that left and came back between them.
    ///
    /// ```
    /// use selkie::*;
    /// let service = WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default());
    /// service.add_worker(WorkerRecord::new(7))?;
    /// let rank = WorkerWithDpRank::new(7, 0);
    /// let before = service.rank_row(rank).unwrap();
    /// service.remove_worker(7)?;
    /// service.add_worker(WorkerRecord::new(7))?;
    /// let after = service.rank_row(rank).unwrap();
    /// assert_ne!(before.tenure, after.tenure, "it left and came back");
    /// assert_eq!(Some(after.row), service.row_of(rank));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rank_row(&self, worker: WorkerWithDpRank) -> Option<RankRow> {
        self.with_snapshot(|reg| {
            let row = reg.row_of(worker)?;
            Some(RankRow {
                row,
                tenure: reg.tenure_of(worker).unwrap_or(0),
            })
        })
    }

    // ---- sessions ----------------------------------------------------

    /// Forgets a session's worker; returns whether it was bound.
    pub fn end_session(&self, session_id: &str) -> bool {
        self.sessions.end(session_id)
    }

    /// The worker a session is bound to, if any and not idle past the timeout.
    pub fn session_worker(&self, session_id: &str) -> Option<WorkerWithDpRank> {
        self.sessions.get(session_id, Instant::now())
    }

    /// Drops idle sessions now; returns how many remain. Selections keep
    /// running meanwhile (the sweep locks one 8-session bucket at a time).
    pub fn expire_sessions(&self) -> usize {
        self.sessions.expire(Instant::now())
    }

    /// The most sessions the service remembers at once (see
    /// [`ServiceConfig::max_sessions`]).
    pub fn session_capacity(&self) -> usize {
        self.sessions.capacity()
    }

    // ---- selection ---------------------------------------------------

    /// Chooses a worker for `req` and books the request on it.
    ///
    /// The booking (request, prefill tokens, decode blocks) is released when
    /// the returned [`Selection`] is dropped.
    #[inline]
    pub fn select<'s>(&'s self, req: &SelectionRequest<'_>) -> Result<Selection<'s>, SelectionError> {
        self.run_select(req, move || self)
    }

    /// As [`select`](Self::select), for a booking that must outlive the
    /// borrow (moved into an async task or another thread). Costs one
    /// reference-count increment on the service's `Arc`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use selkie::*;
    /// let service = Arc::new(WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default()));
    /// service.add_worker(WorkerRecord::new(1))?;
    /// let booking: OwnedSelection = service.select_owned(&SelectionRequest::new(32))?;
    /// std::thread::spawn(move || {
    ///     // ... stream the response ...
    ///     booking.finish();
    /// })
    /// .join()
    /// .unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn select_owned(self: &Arc<Self>, req: &SelectionRequest<'_>) -> Result<OwnedSelection, SelectionError> {
        self.run_select(req, move || Arc::clone(self))
    }

    /// The worker [`select`](Self::select) would choose now, booking nothing
    /// and advancing no cursor (plugins see
    /// [`WorkerSelectionContext::is_preview`]). Always explained.
    ///
    /// It draws the random numbers the thread's next selection will draw
    /// and leaves them to it: a seeded service's sequence of selections is
    /// the same with previews between them or without, and the next
    /// `select` on this thread chooses the previewed worker unless the
    /// fleet changed or another thread selected in between.
    ///
    /// ```
    /// use selkie::*;
    /// let service = WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default());
    /// for id in 0..8 {
    ///     service.add_worker(WorkerRecord::new(id))?;
    /// }
    /// let preview = service.peek(&SelectionRequest::new(64))?;
    /// assert_eq!(service.select(&SelectionRequest::new(64))?.worker(), preview.worker);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn peek(&self, req: &SelectionRequest<'_>) -> Result<Preview, SelectionError> {
        self.run_peek(req)
    }

    /// Checks what a selection takes as given: every cache overlap of `req`
    /// within its prompt, at the service's block size
    /// ([`ServiceConfig::block_size`]). Each overlap's `device_blocks`,
    /// `host_blocks`, `disk_blocks` and `shared_blocks` must be at most the
    /// prompt's blocks (`ceil(isl_tokens / block_size)`) and its
    /// `cached_tokens` at most `isl_tokens`, for the entries of
    /// [`overlaps`](SelectionRequest::overlaps) and for every row of
    /// [`row_overlaps`](SelectionRequest::row_overlaps). The request's
    /// [`prompt_blocks`](SelectionRequest::prompt_blocks) must be at most
    /// the prompt's blocks too (more are hashes cut at a smaller block
    /// size: [`SelectionError::PromptBlocksPastPrompt`]). A selection does
    /// not check this (it costs a pass over the overlaps): an overlap built
    /// for another block size is scored as it is. Call it where requests are
    /// built, in tests or while bringing a router up.
    ///
    /// Overlaps from a [`KvIndex`](crate::kv_index::KvIndex) are in the
    /// service's blocks by construction: the index refuses to sync to a
    /// service of another block size.
    ///
    /// ```
    /// use selkie::*;
    /// let service = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
    /// let w = WorkerWithDpRank::new(2, 0);
    /// // 96 of the prompt's 128 blocks of 16 tokens: fine.
    /// let ok = [WorkerOverlap::device(w, 96, 16)];
    /// assert!(service.check_request(&SelectionRequest::new(2048).with_overlaps(&ok)).is_ok());
    /// // The same 96 blocks counted at 32 tokens: 3,072 cached tokens of a 2,048-token prompt.
    /// let wrong = [WorkerOverlap::device(w, 96, 32)];
    /// let err = service.check_request(&SelectionRequest::new(2048).with_overlaps(&wrong)).unwrap_err();
    /// assert!(matches!(
    ///     err,
    ///     SelectionError::OverlapPastPrompt { column: "cached_tokens", value: 3072, limit: 2048, .. }
    /// ));
    /// ```
    pub fn check_request(&self, req: &SelectionRequest<'_>) -> Result<(), SelectionError> {
        let blocks = req.request_blocks(self.config.block_size);
        let tokens = req.isl_tokens as u64;
        if req.prompt_blocks.len() as u64 > blocks {
            return Err(SelectionError::PromptBlocksPastPrompt {
                hashes: req.prompt_blocks.len() as u64,
                limit: blocks,
                block_size: self.config.block_size,
            });
        }
        let check =
            |worker: Option<WorkerWithDpRank>, row: Option<usize>, column: &'static str, value: u64, limit: u64| {
                if value > limit {
                    Err(SelectionError::OverlapPastPrompt {
                        worker,
                        row,
                        column,
                        value,
                        limit,
                    })
                } else {
                    Ok(())
                }
            };
        for o in req.overlaps {
            let w = Some(o.worker);
            check(w, None, "device_blocks", u64::from(o.device_blocks), blocks)?;
            check(w, None, "host_blocks", u64::from(o.host_blocks), blocks)?;
            check(w, None, "disk_blocks", u64::from(o.disk_blocks), blocks)?;
            check(w, None, "shared_blocks", u64::from(o.shared_blocks), blocks)?;
            check(w, None, "cached_tokens", u64::from(o.cached_tokens), tokens)?;
        }
        if let Some(r) = &req.row_overlaps {
            let columns = [
                ("device_blocks", Some(r.device_blocks), blocks),
                ("host_blocks", r.host_blocks, blocks),
                ("disk_blocks", r.disk_blocks, blocks),
                ("shared_blocks", r.shared_blocks, blocks),
                ("cached_tokens", r.cached_tokens, tokens),
            ];
            for (column, values, limit) in columns {
                for (row, &v) in values.unwrap_or_default().iter().enumerate() {
                    // A NaN or a negative count is past any limit too.
                    if !(v >= 0.0 && f64::from(v) <= limit as f64) {
                        let value = if v > 0.0 { f64::from(v).ceil() as u64 } else { u64::MAX };
                        return check(self.row_worker(row), Some(row), column, value, limit);
                    }
                }
            }
        }
        Ok(())
    }

    /// The worker rank in `row` of the current layout, if any.
    fn row_worker(&self, row: usize) -> Option<WorkerWithDpRank> {
        self.with_snapshot(|reg| reg.row(row).map(|m| m.worker()))
    }

    /// Every eligible row's cost as the policy sees it now, in worker
    /// order, booking nothing: the KV cost for the `kv` policy, the summed
    /// scorer costs for a custom policy (after its filters), in-flight
    /// requests per unit of weight for the load modes. Hard filters and pins
    /// apply; session affinity does not. For debugging and tests: it
    /// allocates the result.
    pub fn costs(&self, req: &SelectionRequest<'_>) -> Result<Vec<(WorkerWithDpRank, f64)>, SelectionError> {
        self.with_snapshot(|reg| self.costs_with(reg, req, false, |env, s, out| self.policy.costs(env, s, out)))
    }

    /// Every eligible row's cost split into its terms, as
    /// [`costs`](Self::costs) gives their sums, in worker order: the KV
    /// formula's for the `kv` policy, each scorer's contribution for a
    /// composed one (see [`CostTerms`](crate::CostTerms)); empty for the
    /// load modes, whose cost is one number. For debugging and tests: it
    /// allocates the result, and works the KV terms out in `f64` row by row.
    ///
    /// ```
    /// use selkie::*;
    /// let policy = WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated);
    /// let service = WorkerSelectionService::new(policy, ServiceConfig::default());
    /// service.add_worker(WorkerRecord::new(1))?;
    /// service.add_worker(WorkerRecord::new(2))?;
    /// let overlaps = [WorkerOverlap::device(WorkerWithDpRank::new(2, 0), 12, 16)];
    /// let request = SelectionRequest::new(256).with_overlaps(&overlaps);
    /// let terms = service.cost_terms(&request)?;
    /// assert_eq!(terms[1].0, WorkerWithDpRank::new(2, 0));
    /// assert_eq!(terms[1].1.to_string(), "prefill 16.0000 + cache-credit -12.0000 + decode 16.0000");
    /// assert_eq!(terms[1].1.sum(), service.costs(&request)?[1].1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cost_terms(
        &self,
        req: &SelectionRequest<'_>,
    ) -> Result<Vec<(WorkerWithDpRank, crate::CostTerms)>, SelectionError> {
        self.with_snapshot(|reg| self.costs_with(reg, req, true, |env, s, out| self.policy.cost_terms(env, s, out)))
    }

    /// Runs `f` (`costs` or `cost_terms` of the policy) on the eligible
    /// rows of `req`; `explain`: the policy keeps what it explains with.
    fn costs_with<T>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        explain: bool,
        f: impl FnOnce(&Env<'_>, &mut Scratch, &mut Vec<(WorkerWithDpRank, T)>) -> Result<(), SelectionError>,
    ) -> Result<Vec<(WorkerWithDpRank, T)>, SelectionError> {
        with_scratch(|s| {
            let rows = reg.scan_rows();
            s.prepare(rows);
            #[cfg(test)]
            tests::hooks::after_rows_read(rows);
            let Scratch { mask: words, aux, .. } = &mut *s;
            let mut mask = std::mem::take(words);
            let outcome = {
                eligible_rows(
                    reg,
                    &self.fleet,
                    rows,
                    req,
                    req.pin,
                    self.config.lora_required,
                    &self.rejections,
                    &mut mask,
                    aux,
                )
            };
            let result =
                outcome.and_then(|outcome| self.costs_on(reg, req, s, &mask, rows, outcome.pinned, explain, f));
            s.mask = mask;
            result
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn costs_on<T>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        s: &mut Scratch,
        mask: &[u64],
        rows: usize,
        pinned: bool,
        explain: bool,
        f: impl FnOnce(&Env<'_>, &mut Scratch, &mut Vec<(WorkerWithDpRank, T)>) -> Result<(), SelectionError>,
    ) -> Result<Vec<(WorkerWithDpRank, T)>, SelectionError> {
        {
            let ctx = WorkerSelectionContext {
                request: req,
                block_size: self.config.block_size,
                worker_type: self.policy.worker_type,
                preview: true,
            };
            let env = Env {
                reg,
                fleet: &self.fleet,
                mask,
                list: None,
                view: self.fleet.view(rows),
                req,
                ctx: &ctx,
                rows,
                pinned,
                explain,
            };
            let mut out = Vec::new();
            f(&env, s, &mut out)?;
            out.sort_by_key(|(w, _)| *w);
            Ok(out)
        }
    }
}
