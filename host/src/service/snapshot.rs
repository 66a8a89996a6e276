//! Per-thread registry snapshots: how selection reads discovery's data
//! without taking a lock (see the module docs of `service`).
//!
//! Writers change the master registry under its mutex and bump the
//! service's version; a reader compares the version with its thread's
//! cached snapshot and reloads only when it moved. This module must not
//! select or book.
//!
//! # The hot entry
//!
//! Each thread keeps the snapshot it read last in a hot entry: the
//! service's id, the version, and the `Arc` itself, in `Cell`s. A
//! selection *takes* the `Arc` out of the entry (a plain move: no
//! reference count is touched, no atomic operation) and puts it back when
//! it is done, so while it reads, the snapshot is its own and nothing on
//! the thread can drop it. A selection nested in another on the same
//! thread (a plugin that selects) finds the entry empty and takes the slow
//! path: the thread's cache, or the service's current snapshot. When the
//! outer selection puts its snapshot back, it keeps whatever a nested one
//! left in the entry (a newer snapshot) and drops its own instead (the
//! one case that touches a reference count). A selection that panics puts
//! its snapshot back as it unwinds.
//!
//! The entry needs no destructor of its own (so reading it costs no
//! check of a destructor's state): it is emptied at thread exit by the
//! thread's cache, whose destructor is registered on the slow path that
//! first fills the entry, and after which nothing fills it again (the slow
//! path caches nothing once the cache is gone).

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
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
/// comparisons and a move, no search, no reference count (see the module
/// docs).
struct HotSnapshot {
    id: Cell<u64>,
    version: Cell<u64>,
    /// `None` while a selection on this thread holds it (or before the
    /// first one).
    snapshot: Cell<Option<Arc<WorkerRegistry>>>,
}

impl HotSnapshot {
    fn set(&self, id: u64, version: u64, snapshot: Arc<WorkerRegistry>) {
        self.id.set(id);
        self.version.set(version);
        self.snapshot.set(Some(snapshot));
    }

    fn clear(&self) {
        self.id.set(NO_SERVICE);
        drop(self.snapshot.take());
    }
}

/// A read of the thread's snapshot taken out of its hot entry; dropping it
/// (also when the reader panics) puts the snapshot back, unless a
/// selection nested in this one left another there.
///
/// When the entry is empty at that point, its id and version are still
/// this read's: they change only with the snapshot (`set`, which fills
/// the entry) or at thread exit (`clear`), and a selection nested in this
/// one puts back what it took before this one ends. Not `Send`: dropped on
/// another thread it would fill that thread's entry under that thread's
/// id and version.
pub(super) struct HotRead {
    /// Always `Some` until dropped.
    snapshot: Option<Arc<WorkerRegistry>>,
    _this_thread: PhantomData<*const ()>,
}

impl HotRead {
    /// The snapshot.
    #[inline(always)]
    pub(super) fn registry(&self) -> &WorkerRegistry {
        match &self.snapshot {
            Some(snapshot) => snapshot,
            None => unreachable!("a hot read holds its snapshot until dropped"),
        }
    }
}

impl Drop for HotRead {
    #[inline(always)]
    fn drop(&mut self) {
        HOT.with(|hot| {
            let newer = hot.snapshot.replace(self.snapshot.take());
            if newer.is_some() {
                keep_newer(hot, newer);
            }
        });
    }
}

/// A selection nested in a hot read reloaded the hot entry: its snapshot
/// (newer, or another service's) stays, the read's own is dropped.
#[cold]
#[inline(never)]
fn keep_newer(hot: &HotSnapshot, newer: Option<Arc<WorkerRegistry>>) {
    drop(hot.snapshot.replace(newer));
}

thread_local! {
    /// No destructor (`ManuallyDrop`): the cache's empties it (see the
    /// module docs).
    static HOT: ManuallyDrop<HotSnapshot> = const {
        ManuallyDrop::new(HotSnapshot {
            id: Cell::new(NO_SERVICE),
            version: Cell::new(0),
            snapshot: Cell::new(None),
        })
    };
    static SNAPSHOTS: RefCell<Cache> = const { RefCell::new(Cache(Vec::new())) };
}

/// The thread's cache; dropping it (at thread exit) empties the hot entry.
struct Cache(SnapshotCache);

impl Drop for Cache {
    fn drop(&mut self) {
        HOT.with(|hot| hot.clear());
    }
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

    /// The thread's snapshot taken out of its hot entry, if that holds
    /// this service's current one (and no selection on this thread holds
    /// it now). The entry is read in one short access of the
    /// thread-local: the caller then reads the snapshot in its own code (a
    /// selection inlines into its caller).
    #[inline(always)]
    pub(super) fn hot_snapshot(&self) -> Option<HotRead> {
        let v = self.version.load(Ordering::Acquire);
        HOT.with(|hot| {
            if hot.id.get() != self.id || hot.version.get() != v {
                return None;
            }
            let snapshot = hot.snapshot.take()?;
            #[cfg(test)]
            self.check_hot(v, &snapshot);
            Some(HotRead {
                snapshot: Some(snapshot),
                _this_thread: PhantomData,
            })
        })
    }

    /// The crate's tests: the hot entry held the snapshot this service
    /// published for version `v`, never another service's or version's.
    /// A change and a reload on another thread may have published a newer
    /// version since `v` was read: only `v`'s own snapshot can be compared.
    #[cfg(test)]
    fn check_hot(&self, v: u64, snapshot: &Arc<WorkerRegistry>) {
        let published = self.published.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(
            published.0 > v || (published.0 == v && Arc::ptr_eq(&published.1, snapshot)),
            "the hot entry of service {} version {v} held another snapshot (published: version {})",
            self.id,
            published.0
        );
    }

    /// [`with_snapshot`](Self::with_snapshot) when the hot entry does not
    /// hold the current snapshot (or a selection on this thread holds it):
    /// the thread's cache, else the current snapshot, cached for the next
    /// selection when the cache is free.
    #[inline(never)]
    pub(super) fn with_reloaded_snapshot<R>(&self, f: impl FnOnce(&WorkerRegistry) -> R) -> R {
        if SNAPSHOTS.try_with(|_| ()).is_err() {
            // The thread is exiting and its cache is gone: read the
            // current snapshot, cache nothing.
            return f(&self.current_snapshot().1);
        }
        let v = self.version.load(Ordering::Acquire);
        SNAPSHOTS.with(|cell| {
            if let Ok(cache) = cell.try_borrow() {
                if let Some((_, _, snap)) = cache.0.iter().find(|(id, ver, _)| *id == self.id && *ver == v) {
                    HOT.with(|hot| hot.set(self.id, v, snap.clone()));
                    return f(snap);
                }
            }
            let (ver, snap) = self.current_snapshot();
            // Not while a selection nested in this closure's caller reads
            // the cache (it is borrowed then).
            if let Ok(mut cache) = cell.try_borrow_mut() {
                let cache = &mut cache.0;
                cache.retain(|(id, _, _)| *id != self.id);
                if cache.len() >= CACHED_SNAPSHOTS {
                    cache.remove(0);
                }
                cache.push((self.id, ver, snap.clone()));
                HOT.with(|hot| hot.set(self.id, ver, snap.clone()));
            }
            f(&snap)
        })
    }
}
