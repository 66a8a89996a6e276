//! Replica sync wired into the service (feature `nats`): the service
//! reports its own load per worker rank with its [`ReplicaSync`], read
//! from the fleet's counters, and sets the peers' load as each row's remote
//! load (`Fleet::set_remote_load`), which the kernel folds into the row's
//! load counters: the load scans and the admission check count it with
//! nothing more to read.
//!
//! The selection path does nothing for sync: no record, no store, no
//! branch. Off that path, [`WorkerSelectionService::publish_local_load`]
//! reads each row's counters less the remote load it holds (this replica's
//! own load) and reports the worker ranks whose load changed since the
//! last pass; [`WorkerSelectionService::apply_remote_load`] maps
//! [`ReplicaSync::remote_loads`] to rows when the sync's version or the
//! worker table moved, and sets the rows' remote load. The thread of
//! [`WorkerSelectionService::spawn_replica_sync_thread`] (or the caller's
//! own timer) calls both, every batch interval say.
//!
//! # How far replicas can over-admit
//!
//! Each replica admits a request on a worker if its own bookings there
//! plus the peers' load it last applied stay within the worker's
//! admission limit `L`. Its own bookings never pass `L` (its counters hold
//! them), so `R` replicas together hold at most `R x L`: the only bound
//! that always holds. Tighter, the combined load passes `L` by at most
//! what the other `R - 1` replicas booked within one sync delay, the time
//! from a booking to every other replica applying it (the booking
//! replica's `publish_local_load` pass, its sync's batch interval, NATS,
//! the other's `apply_remote_load` pass: a few milliseconds with the
//! defaults). That delay is not bounded: a sync thread or a load thread
//! that is not scheduled (a CPU-starved host) stretches it, and with it
//! the excess, up to `R x L`; so does a replica that has not heard from
//! the others yet (it starts with no view of them). Measured with two
//! replicas, a limit of 8, one worker and sixteen selecting threads on two
//! cores (holding each request 50 to 500 µs, spinning or sleeping; a
//! sample of the combined count every 200 µs for 2 s, after the first
//! 100 ms; three runs of each): the count passed the limit in 1.3 to 3.9%
//! of samples, by one in nearly all, and after a stall reached 14, and in
//! one run `R x L` = 16; in the first 100 ms, before the replicas had
//! heard from each other, it reached 16 in most runs.
//!
//! So the excess is measured: whenever [`apply_remote_load`] finds a
//! row's load (its own bookings plus the peers' just applied) above the
//! worker's admission limit, it counts the row and the excess
//! ([`WorkerSelectionService::replica_over_admission`], and the metrics
//! `selkie_replica_over_admission_total` and
//! `selkie_replica_over_admission_requests_total`).
//!
//! [`apply_remote_load`]: WorkerSelectionService::apply_remote_load
//!
//! This module must not block the selection path or change the local
//! booking: the local counters stay this replica's truth.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use selkie_kernel::fleet::{Outstanding, SlotId, COUNTER_MAX, UNLIMITED};
use selkie_kernel::lanes::{AtomicView, U32Source};

use super::WorkerSelectionService;
use crate::replica::{RemoteLoad, ReplicaSync};
use crate::types::WorkerWithDpRank;

/// The service's side of replica sync.
pub(super) struct ReplicaLink {
    /// The sync, once given.
    sync: OnceLock<Arc<ReplicaSync>>,
    /// What the last passes wrote and reported; one lock, so that reading
    /// a row's own load (its counters less its remote load) never races a
    /// change of its remote load.
    state: Mutex<LinkState>,
    /// Over-admission seen by `apply_remote_load`.
    over: OverCounters,
}

/// The counters behind [`OverAdmission`].
#[derive(Default)]
struct OverCounters {
    rows: AtomicU64,
    requests: AtomicU64,
    most: AtomicU64,
}

/// Over-admission this replica has seen: rows whose load, its own
/// bookings plus the peers' just applied, was above the worker's
/// admission limit ([`WorkerSelectionService::replica_over_admission`];
/// see the `service::replica` docs for why it happens and its bound).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OverAdmission {
    /// Times a row was found above its limit (once per row per
    /// [`apply_remote_load`](WorkerSelectionService::apply_remote_load)
    /// that wrote it).
    pub rows: u64,
    /// The requests above the limit, summed over those times.
    pub requests: u64,
    /// The most requests above the limit seen at once on one row.
    pub most: u64,
}

#[derive(Default)]
struct LinkState {
    /// The versions `apply_remote_load` last applied.
    versions: Option<(u64, u64)>,
    /// The slots it left a remote load on.
    slots: Vec<SlotId>,
    /// Per row, the occupancy generation and own load `publish_local_load`
    /// last reported ([`NO_WORKER`] for none): 16 bytes a row, read every
    /// pass...
    reported: Vec<(u32, Outstanding)>,
    /// ...and the worker rank it reported them for, read on a change only.
    reported_workers: Vec<WorkerWithDpRank>,
    /// Scratch for one report: worker ranks no longer on a row (zero)...
    gone: Vec<(WorkerWithDpRank, RemoteLoad)>,
    /// ...and those whose load changed, sent after them (a worker rank
    /// that moved rows ends with its load).
    changed: Vec<(WorkerWithDpRank, RemoteLoad)>,
}

/// A generation no occupancy has (they have 29 bits): a row reported
/// without a worker.
const NO_WORKER: u32 = u32::MAX;

impl ReplicaLink {
    pub(super) fn new() -> Self {
        ReplicaLink {
            sync: OnceLock::new(),
            state: Mutex::new(LinkState::default()),
            over: OverCounters::default(),
        }
    }

    /// The sync, if one was given.
    #[inline]
    pub(super) fn sync(&self) -> Option<&Arc<ReplicaSync>> {
        self.sync.get()
    }

    fn state(&self) -> MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn remote(load: Outstanding) -> RemoteLoad {
    RemoteLoad {
        requests: u64::from(load.requests),
        prefill_tokens: u64::from(load.prefill_tokens),
        decode_blocks: u64::from(load.decode_blocks),
    }
}

fn clamp(v: u64) -> u32 {
    v.min(COUNTER_MAX as u64) as u32
}

impl WorkerSelectionService {
    /// Shares this service's load with other router replicas through
    /// `sync` (feature `nats`), and lets the peers' load count here:
    /// [`publish_local_load`](Self::publish_local_load) reports this
    /// replica's load per worker rank (read from the fleet's counters: the
    /// selections themselves record nothing), and
    /// [`apply_remote_load`](Self::apply_remote_load) writes the peers'
    /// load into the fleet, where least-loaded, power-of-two, KV cost and
    /// the admission limit count it.
    /// [`spawn_replica_sync_thread`](Self::spawn_replica_sync_thread) calls
    /// both periodically.
    ///
    /// One sync per service (one routing partition); `Err` gives `sync`
    /// back if the service already has one. Bookings made before the call
    /// count too: the counters hold them.
    pub fn set_replica_sync(&self, sync: Arc<ReplicaSync>) -> Result<(), Arc<ReplicaSync>> {
        self.replica.sync.set(sync)
    }

    /// The replica sync given to [`set_replica_sync`](Self::set_replica_sync).
    pub fn replica_sync(&self) -> Option<&Arc<ReplicaSync>> {
        self.replica.sync()
    }

    /// Sets the peers' current load (from the replica sync) as the remote
    /// load of their worker ranks' rows, if the sync's version or the
    /// worker table changed since the last call; zeroes it on the rows no
    /// longer loaded.
    /// Returns whether it wrote. Off the selection path: it allocates, and
    /// takes no lock a selection waits on. Without a replica sync it does
    /// nothing.
    pub fn apply_remote_load(&self) -> bool {
        let Some(sync) = self.replica.sync() else {
            return false;
        };
        let mut applied = self.replica.state();
        // The sync's version before its loads (see `ReplicaSync::version`),
        // the registry's before reading it.
        let versions = (sync.version(), self.version.load(Ordering::Acquire));
        if applied.versions == Some(versions) {
            return false;
        }
        let loads = sync.remote_loads();
        // The rows from this thread's snapshot of the registry, without its
        // lock, so that selections reloading their snapshot never wait for
        // this pass. A slot gone stale meanwhile is refused by the kernel;
        // a row retired meanwhile (its remote load cleared by the retire)
        // may get it back here, and the next pass clears it again: its
        // worker is no longer named.
        let named: Vec<(SlotId, Outstanding)> = self.with_snapshot(|reg| {
            loads
                .iter()
                .filter_map(|&(worker, load)| {
                    let slot = reg.row_of(worker).and_then(|row| reg.row(row))?.handle.slot;
                    let load = Outstanding {
                        requests: clamp(load.requests),
                        prefill_tokens: clamp(load.prefill_tokens),
                        decode_blocks: clamp(load.decode_blocks),
                    };
                    Some((slot, load))
                })
                .collect()
        });
        let mut slots = Vec::with_capacity(named.len());
        for (slot, load) in named {
            if self.fleet.set_remote_load(slot, load).is_ok() {
                slots.push(slot);
                self.count_over_admission(slot);
            }
        }
        slots.sort_unstable_by_key(|s| (s.row, s.generation));
        for &slot in &applied.slots {
            if slots
                .binary_search_by_key(&(slot.row, slot.generation), |s| (s.row, s.generation))
                .is_err()
            {
                // No peer load any more (or the worker left: then the slot
                // is stale and there is nothing to take back).
                let _ = self.fleet.set_remote_load(slot, Outstanding::default());
            }
        }
        applied.slots = slots;
        applied.versions = Some(versions);
        true
    }

    /// Counts `slot`'s row if its load (this replica's bookings and the
    /// remote load just set) is above its worker's admission limit.
    fn count_over_admission(&self, slot: SlotId) {
        let row = slot.row as usize;
        let Some(limit) = self
            .fleet
            .worker(row)
            .filter(|w| w.slot == slot && w.admission_limit != UNLIMITED)
            .map(|w| w.admission_limit)
        else {
            return;
        };
        let held = self.fleet.outstanding(row).unwrap_or_default().requests;
        if held <= limit {
            return;
        }
        let excess = u64::from(held - limit);
        let over = &self.replica.over;
        over.rows.fetch_add(1, Ordering::Relaxed);
        over.requests.fetch_add(excess, Ordering::Relaxed);
        over.most.fetch_max(excess, Ordering::Relaxed);
        metrics::counter!("selkie_replica_over_admission_total").increment(1);
        metrics::counter!("selkie_replica_over_admission_requests_total").increment(excess);
    }

    /// The over-admission this replica has seen so far: rows whose load
    /// (its own bookings plus the peers', as just applied by
    /// [`apply_remote_load`](Self::apply_remote_load)) was above their
    /// worker's admission limit. Replicas over-admit by what the others
    /// booked within one sync delay, which CPU starvation stretches: see
    /// the `service::replica` module docs.
    pub fn replica_over_admission(&self) -> OverAdmission {
        let over = &self.replica.over;
        OverAdmission {
            rows: over.rows.load(Ordering::Relaxed),
            requests: over.requests.load(Ordering::Relaxed),
            most: over.most.load(Ordering::Relaxed),
        }
    }

    /// Reports this replica's own load on each worker rank whose load
    /// changed since the last call to the replica sync
    /// ([`ReplicaSync::report_load`]), read from the fleet: each row's
    /// counters less the remote load set on it.
    ///
    /// A worker rank removed from the fleet while this replica's bookings
    /// still hold its row keeps being reported until they end (its peers
    /// count them as before), then at zero once its row is freed.
    ///
    /// Off the selection path: it reads every live row's requests counter,
    /// and the other two where this replica holds a request (2 to 4 µs a
    /// pass for 1,024 rows, 18 to 34 µs for 10,000 on the machine the
    /// benchmarks ran on), and takes no lock a selection waits on. Returns
    /// the reports made (a worker rank that moved rows counts twice).
    /// Without a replica sync it does nothing.
    pub fn publish_local_load(&self) -> usize {
        let Some(sync) = self.replica.sync() else {
            return 0;
        };
        let mut state = self.replica.state();
        let LinkState {
            reported,
            reported_workers,
            gone,
            changed,
            ..
        } = &mut *state;
        self.with_snapshot(|reg| {
            let rows = reg.scan_rows();
            let requests = self.fleet.active_requests();
            if reported.len() < rows {
                reported.resize(rows, (NO_WORKER, Outstanding::default()));
                reported_workers.resize(rows, WorkerWithDpRank::new(0, 0));
            }
            for (row, last) in reported.iter_mut().enumerate() {
                let (generation, load) = match (row < rows).then(|| reg.row(row)).flatten() {
                    Some(meta) => (meta.handle.slot.generation, self.own_load(&requests, row)),
                    // Its worker rank was removed, but the row still holds
                    // the same occupancy (retired, draining this replica's
                    // bookings): reported on until it is freed.
                    None if last.0 != NO_WORKER && self.fleet.slot_id(row).is_some_and(|s| s.generation == last.0) => {
                        (last.0, self.own_load(&requests, row))
                    }
                    None => (NO_WORKER, Outstanding::default()),
                };
                if (generation, load) == *last {
                    continue;
                }
                let worker = &mut reported_workers[row];
                if generation != last.0 {
                    // A new occupant, or none: the last one's report is
                    // withdrawn (and stands again below if it is the same
                    // worker rank, back on this row or moved to another).
                    if last.0 != NO_WORKER {
                        gone.push((*worker, RemoteLoad::default()));
                    }
                    if let Some(meta) = reg.row(row).filter(|_| generation != NO_WORKER) {
                        *worker = meta.worker();
                    }
                }
                if generation != NO_WORKER {
                    changed.push((*worker, remote(load)));
                }
                *last = (generation, load);
            }
            // Rows past the snapshot's are kept while they drain.
            while reported.len() > rows && reported.last().is_some_and(|r| r.0 == NO_WORKER) {
                reported.pop();
                reported_workers.pop();
            }
        });
        let n = gone.len() + changed.len();
        if n > 0 {
            sync.report_loads(gone.drain(..).chain(changed.drain(..)));
        }
        n
    }

    /// `row`'s load booked by this replica: its counters less the remote
    /// load set on it. The caller holds the link's lock, so
    /// `apply_remote_load` does not change the remote load meanwhile; a
    /// worker's removal or a new occupant may (they zero it), and then the
    /// row is misreported for one pass. A row where this replica holds no
    /// request holds none of its prefill tokens or decode blocks either:
    /// their counters are not read (the requests' column alone is a third
    /// of the lines a selection writes).
    fn own_load(&self, requests: &AtomicView<'_>, row: usize) -> Outstanding {
        let remote = self.fleet.remote_load(row);
        if row < requests.rows() && requests.value(row) <= remote.requests {
            return Outstanding::default();
        }
        let total = self.fleet.outstanding(row).unwrap_or_default();
        Outstanding {
            requests: total.requests.saturating_sub(remote.requests),
            prefill_tokens: total.prefill_tokens.saturating_sub(remote.prefill_tokens),
            decode_blocks: total.decode_blocks.saturating_sub(remote.decode_blocks),
        }
    }

    /// Starts a thread that calls [`publish_local_load`](Self::publish_local_load)
    /// and [`apply_remote_load`](Self::apply_remote_load) every `period`
    /// (a millisecond matches the sync's default batch interval), until the
    /// returned guard is dropped or the service is.
    pub fn spawn_replica_sync_thread(self: &Arc<Self>, period: Duration) -> std::io::Result<ReplicaSyncThread> {
        let stop = Arc::new(AtomicBool::new(false));
        let service: Weak<Self> = Arc::downgrade(self);
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("selkie-replica-load".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        match service.upgrade() {
                            Some(service) => {
                                service.publish_local_load();
                                service.apply_remote_load();
                            }
                            None => return,
                        }
                        std::thread::park_timeout(period);
                    }
                })?
        };
        Ok(ReplicaSyncThread {
            stop,
            thread: Some(thread),
        })
    }
}

/// The thread of [`WorkerSelectionService::spawn_replica_sync_thread`]:
/// stopped and joined on drop.
#[derive(Debug)]
pub struct ReplicaSyncThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for ReplicaSyncThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}
