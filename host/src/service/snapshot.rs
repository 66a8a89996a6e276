//! Per-thread registry snapshots: how selection reads discovery's data
//! without taking a lock (see the module docs of `service`).
//!
//! Writers change the master registry under its mutex and bump the
//! service's version; a reader compares the version with its thread's
//! cached snapshot and reloads only when it moved. This module must not
//! select or book.

use std::cell::{Cell, RefCell};
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
pub(super) const CACHED_SNAPSHOTS: usize = 8;

/// A service id no service has: the hot entry is empty.
const NO_SERVICE: u64 = u64::MAX;

/// The snapshot this thread read last, checked before the cache: two
/// comparisons, no borrow flag, no search, no destructor to register.
///
/// `snapshot` points into an `Arc` that the thread's cache holds. The
/// cache drops an entry only (a) when it changes, which empties this entry
/// first and happens only while no reader on this thread holds the entry
/// (`readers` is 0), or (b) at thread exit, where the cache's destructor
/// empties this entry first.
struct HotSnapshot {
    id: Cell<u64>,
    version: Cell<u64>,
    snapshot: Cell<*const WorkerRegistry>,
    /// Selections on this thread reading through `snapshot` now (more
    /// than one when a plugin selects from inside a selection).
    readers: Cell<usize>,
}

impl HotSnapshot {
    fn set(&self, id: u64, version: u64, snapshot: &Arc<WorkerRegistry>) {
        self.id.set(id);
        self.version.set(version);
        self.snapshot.set(Arc::as_ptr(snapshot));
    }

    fn clear(&self) {
        self.id.set(NO_SERVICE);
    }
}

/// A weak reference to the hot entry's snapshot, for the crate's tests to
/// check that no selection nested in a reader dropped it.
#[cfg(test)]
fn held_weakly(snapshot: *const WorkerRegistry) -> std::sync::Weak<WorkerRegistry> {
    // SAFETY: `snapshot` came from `Arc::as_ptr` of an `Arc` the thread's
    // cache holds (the hot entry is not empty); `ManuallyDrop` leaves its
    // count as it was.
    let arc = std::mem::ManuallyDrop::new(unsafe { Arc::from_raw(snapshot) });
    Arc::downgrade(&arc)
}

/// A read of the thread's snapshot through its hot entry, counted among
/// the entry's readers until dropped (also when the reader panics): while
/// it lives the thread's cache keeps the snapshot. Not `Send` (the raw
/// pointer sees to it): the count it undoes is its thread's.
pub(super) struct HotRead {
    snapshot: *const WorkerRegistry,
    #[cfg(test)]
    held: std::sync::Weak<WorkerRegistry>,
}

impl HotRead {
    /// The snapshot.
    #[inline(always)]
    pub(super) fn registry(&self) -> &WorkerRegistry {
        // SAFETY: `snapshot` was the hot entry's, for this service's
        // current version, so it points into an `Arc` the thread's cache
        // holds (see `HotSnapshot`); this read is counted among the
        // entry's readers until it is dropped, which keeps the cache from
        // dropping that `Arc`, and the registry behind an `Arc` is never
        // written. The borrow cannot outlive `self`.
        unsafe { &*self.snapshot }
    }
}

impl Drop for HotRead {
    #[inline(always)]
    fn drop(&mut self) {
        #[cfg(test)]
        assert!(
            self.held.strong_count() > 0,
            "a snapshot was dropped while a selection read it"
        );
        HOT.with(|hot| hot.readers.set(hot.readers.get() - 1));
    }
}

/// The thread's cache; dropping it (at thread exit) empties the hot entry.
struct Cache(SnapshotCache);

impl Drop for Cache {
    fn drop(&mut self) {
        HOT.with(HotSnapshot::clear);
    }
}

thread_local! {
    static HOT: HotSnapshot = const {
        HotSnapshot {
            id: Cell::new(NO_SERVICE),
            version: Cell::new(0),
            snapshot: Cell::new(std::ptr::null()),
            readers: Cell::new(0),
        }
    };
    static SNAPSHOTS: RefCell<Cache> = const { RefCell::new(Cache(Vec::new())) };
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
    /// the registry changed. The fast path reads one atomic and the
    /// thread's hot entry, and touches no shared reference count.
    #[inline(always)]
    pub(super) fn with_snapshot<R>(&self, f: impl FnOnce(&WorkerRegistry) -> R) -> R {
        match self.hot_snapshot() {
            Some(hot) => f(hot.registry()),
            None => self.with_reloaded_snapshot(f),
        }
    }

    /// The thread's snapshot through its hot entry, if that holds this
    /// service's current one. The entry is read, and its reader counted,
    /// in one short access of the thread-local: the caller then reads
    /// the snapshot in its own code (a selection inlines into its caller).
    #[inline(always)]
    pub(super) fn hot_snapshot(&self) -> Option<HotRead> {
        let v = self.version.load(Ordering::Acquire);
        HOT.with(|hot| {
            if hot.id.get() != self.id || hot.version.get() != v {
                return None;
            }
            hot.readers.set(hot.readers.get() + 1);
            let snapshot = hot.snapshot.get();
            Some(HotRead {
                #[cfg(test)]
                held: held_weakly(snapshot),
                snapshot,
            })
        })
    }

    /// [`with_snapshot`](Self::with_snapshot) when the hot entry does not
    /// hold the current snapshot: the thread's cache, else a new one.
    #[inline(never)]
    pub(super) fn with_reloaded_snapshot<R>(&self, f: impl FnOnce(&WorkerRegistry) -> R) -> R {
        let v = self.version.load(Ordering::Acquire);
        HOT.with(|hot| self.with_cached_snapshot(v, hot, f))
    }

    /// [`with_snapshot`](Self::with_snapshot) past the hot entry: the
    /// thread's cache, else the current snapshot (cached for the next
    /// selection when no reader on this thread holds the cache).
    #[inline(never)]
    fn with_cached_snapshot<R>(&self, v: u64, hot: &HotSnapshot, f: impl FnOnce(&WorkerRegistry) -> R) -> R {
        SNAPSHOTS.with(|cell| {
            if let Ok(cache) = cell.try_borrow() {
                if let Some((_, _, snap)) = cache.0.iter().find(|(id, ver, _)| *id == self.id && *ver == v) {
                    hot.set(self.id, v, snap);
                    return f(snap);
                }
            }
            let (ver, snap) = self.current_snapshot();
            if hot.readers.get() == 0 {
                if let Ok(mut cache) = cell.try_borrow_mut() {
                    hot.clear();
                    let cache = &mut cache.0;
                    cache.retain(|(id, _, _)| *id != self.id);
                    if cache.len() >= CACHED_SNAPSHOTS {
                        cache.remove(0);
                    }
                    cache.push((self.id, ver, snap.clone()));
                    hot.set(self.id, ver, &snap);
                }
            }
            f(&snap)
        })
    }
}
