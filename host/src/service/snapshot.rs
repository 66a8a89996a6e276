//! Per-thread registry snapshots: how selection reads discovery's data
//! without taking a lock (see the module docs of `service`).
//!
//! Writers change the master registry under its mutex and bump the
//! service's version; a reader compares the version with its thread's
//! cached snapshot and reloads only when it moved. This module must not
//! select or book.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use super::WorkerSelectionService;
use crate::discovery::registry::WorkerRegistry;
use crate::fleet::HostFleet;

/// Source of service ids (keys of the per-thread caches).
pub(super) static SERVICE_IDS: AtomicU64 = AtomicU64::new(0);

/// Snapshots a thread holds: `(service id, version, snapshot)`, most
/// recently used last.
type SnapshotCache = Vec<(u64, u64, Arc<WorkerRegistry>)>;

/// Services one thread keeps a snapshot for before evicting the oldest.
const CACHED_SNAPSHOTS: usize = 8;

thread_local! {
    static SNAPSHOTS: RefCell<SnapshotCache> = const { RefCell::new(Vec::new()) };
}

impl WorkerSelectionService {
    /// Applies a change to the master registry and publishes it.
    ///
    /// The version moves even if `f` panics (a change undone part way may
    /// have moved workers to other rows): selections then reload.
    pub(super) fn change<R>(&self, f: impl FnOnce(&mut WorkerRegistry, &HostFleet) -> R) -> R {
        struct Bump<'a>(&'a AtomicU64);
        impl Drop for Bump<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Release);
            }
        }
        let mut master = self.read_registry();
        let _bump = Bump(&self.version);
        f(&mut master, &self.fleet)
    }

    /// The current snapshot (slow path: after a change).
    pub(super) fn current_snapshot(&self) -> (u64, Arc<WorkerRegistry>) {
        let master = self.read_registry();
        let v = self.version.load(Ordering::Acquire);
        let mut p = self.published.lock().unwrap_or_else(PoisonError::into_inner);
        if p.0 != v {
            *p = (v, Arc::new(master.clone()));
        }
        (p.0, p.1.clone())
    }

    /// Runs `f` with this thread's snapshot of the registry, reloading it if
    /// the registry changed. The fast path reads one atomic and touches no
    /// shared reference count.
    pub(super) fn with_snapshot<R>(&self, f: impl FnOnce(&WorkerRegistry) -> R) -> R {
        let v = self.version.load(Ordering::Acquire);
        SNAPSHOTS.with(|cell| {
            if let Ok(cache) = cell.try_borrow() {
                if let Some((_, _, snap)) = cache.iter().find(|(id, ver, _)| *id == self.id && *ver == v) {
                    return f(snap);
                }
            }
            let (ver, snap) = self.current_snapshot();
            if let Ok(mut cache) = cell.try_borrow_mut() {
                cache.retain(|(id, _, _)| *id != self.id);
                if cache.len() >= CACHED_SNAPSHOTS {
                    cache.remove(0);
                }
                cache.push((self.id, ver, snap.clone()));
            }
            f(&snap)
        })
    }
}
