//! Replica sync wired into the service (feature `nats`): each booking is
//! recorded with the service's [`ReplicaSync`], and the peers' load is
//! set as each row's remote load (`Fleet::set_remote_load`), which the
//! kernel folds into the row's load counters: the load scans and the
//! admission check count it with nothing more to read.
//!
//! The selection path only records each booking, prefill completion and
//! release with the `ReplicaSync` (a few stores into the calling thread's
//! own ring: no lock, no read-modify-write, no allocation once the thread
//! has its ring, no I/O), which also hands out the booking's id. The peers' load reaches the fleet off that path:
//! [`WorkerSelectionService::apply_remote_load`], called by the thread of
//! [`WorkerSelectionService::spawn_remote_load_applier`] (or by the
//! caller's own timer), maps [`ReplicaSync::remote_loads`] to rows when the
//! sync's version or the worker table moved, and sets the rows' remote
//! load.
//!
//! This module must not block the selection path or change the local
//! booking: the local counters stay this replica's truth.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use selkie_kernel::fleet::{Outstanding, SlotId, COUNTER_MAX};

use super::WorkerSelectionService;
use crate::replica::ReplicaSync;
use crate::types::WorkerWithDpRank;

/// The service's side of replica sync.
pub(super) struct ReplicaLink {
    /// The sync, once given.
    sync: OnceLock<Arc<ReplicaSync>>,
    /// What the applier last wrote.
    applied: Mutex<Applied>,
}

/// The applier's memory: the versions it last applied and the slots it
/// left a remote load on.
#[derive(Default)]
struct Applied {
    versions: Option<(u64, u64)>,
    slots: Vec<SlotId>,
}

impl ReplicaLink {
    pub(super) fn new() -> Self {
        ReplicaLink {
            sync: OnceLock::new(),
            applied: Mutex::new(Applied::default()),
        }
    }

    /// Records a booking made on `worker`; the id to release it with (0:
    /// no replica sync).
    #[inline]
    pub(super) fn record_book(&self, worker: WorkerWithDpRank, prefill_tokens: u32, decode_blocks: u32) -> u64 {
        match self.sync.get() {
            None => 0,
            Some(sync) => sync.record_new_book(worker, prefill_tokens, decode_blocks),
        }
    }

    /// The sync, if one was given.
    #[inline]
    pub(super) fn sync(&self) -> Option<&Arc<ReplicaSync>> {
        self.sync.get()
    }
}

fn clamp(v: u64) -> u32 {
    v.min(COUNTER_MAX as u64) as u32
}

impl WorkerSelectionService {
    /// Shares this service's bookings with other router replicas through
    /// `sync` (feature `nats`), and lets the peers' load count here: each
    /// booking from now on is recorded (`record_book`, then
    /// `record_prefill_complete` and `record_release` from its
    /// [`Booked`](super::Booked)), and [`apply_remote_load`](Self::apply_remote_load)
    /// writes the peers' load into the fleet, where least-loaded,
    /// power-of-two, KV cost and the admission limit count it.
    ///
    /// One sync per service (one routing partition); `Err` gives `sync`
    /// back if the service already has one. Bookings made before the call
    /// are not recorded.
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
        let mut applied = self.replica.applied.lock().unwrap_or_else(PoisonError::into_inner);
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

    /// Starts a thread that calls [`apply_remote_load`](Self::apply_remote_load)
    /// every `period` (a millisecond matches the sync's default batch
    /// interval), until the returned guard is dropped or the service is.
    pub fn spawn_remote_load_applier(self: &Arc<Self>, period: Duration) -> std::io::Result<RemoteLoadApplier> {
        let stop = Arc::new(AtomicBool::new(false));
        let service: Weak<Self> = Arc::downgrade(self);
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("selkie-remote-load".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        match service.upgrade() {
                            Some(service) => {
                                service.apply_remote_load();
                            }
                            None => return,
                        }
                        std::thread::park_timeout(period);
                    }
                })?
        };
        Ok(RemoteLoadApplier {
            stop,
            thread: Some(thread),
        })
    }
}

/// The thread of [`WorkerSelectionService::spawn_remote_load_applier`]:
/// stopped and joined on drop.
#[derive(Debug)]
pub struct RemoteLoadApplier {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for RemoteLoadApplier {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}
