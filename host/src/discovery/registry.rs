//! The worker registry: discovery's view of the fleet. It decides which
//! worker rank gets which of the kernel's rows; the fleet handle
//! ([`HostFleet`]) carries the decisions out on the kernel's fleet.
//!
//! Each data-parallel rank of a worker is one fleet row. The registry keeps,
//! per worker, a [`WorkerEntry`]: what the hard filters need (the worker's
//! record, its busy limits, its overload mark) and its rows. Which row holds
//! which worker rank, the per-row masks and the retired rows (kept while
//! bookings hold them) live in the fleet's row index
//! ([`RowIndex`]), which stores the entries and which the registry derefs
//! to.
//!
//! The service holds one master registry behind a mutex, which every change
//! takes; selections never take it: they read an immutable snapshot (a
//! clone of the master behind an `Arc`, published once per change and
//! cached per thread; see the service's `snapshot` module). A registry never
//! books or releases load, and it names nothing above discovery.
//!
//! # Whole snapshots
//!
//! [`WorkerRegistry::sync`] checks a snapshot completely (records, duplicate
//! ids, rows for all of it) before changing anything, and undoes what it
//! did if the fleet still refuses a row part way.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use metrics::Counter;
use selkie_kernel::fleet::{WorkerSpec, UNLIMITED};

use super::record::{BusyThresholds, DeviceKind, WorkerRecord, WorkerState};
use crate::error::DiscoveryError;
use crate::fleet::rows::{self, FleetTraits, RowIndex, RowOwner};
use crate::fleet::{HostFleet, RowHandle};
use crate::types::{DpRank, WorkerId, WorkerWithDpRank};

/// What the registry keeps per worker.
pub(crate) struct WorkerEntry {
    pub(crate) record: WorkerRecord,
    /// `(rank, row)` for each rank, in rank order.
    pub(crate) rows: Vec<(DpRank, RowHandle)>,
    /// Set from outside (`set_overloaded`): skip the worker as overloaded.
    pub(crate) overloaded: AtomicBool,
    /// Active decode blocks above which the worker is busy.
    pub(crate) decode_limit: u64,
    /// Active prefill tokens above which the worker is busy.
    pub(crate) prefill_limit: u64,
    /// `selkie_worker_selections_total{worker=..}`, registered once.
    pub(crate) selections: Counter,
}

impl RowOwner for WorkerEntry {
    #[inline]
    fn worker_id(&self) -> WorkerId {
        self.record.worker_id
    }
    #[inline]
    fn rows(&self) -> &[(DpRank, RowHandle)] {
        &self.rows
    }
    fn traits(&self) -> FleetTraits {
        FleetTraits {
            multi_rank: self.record.data_parallel_size > 1,
            weighted: self.record.capacity_weight != 1.0,
            thresholds: self.decode_limit != u64::MAX || self.prefill_limit != u64::MAX,
        }
    }
    fn is_cpu(&self) -> bool {
        self.record.device == DeviceKind::Cpu
    }
    fn is_overloaded(&self) -> bool {
        self.overloaded.load(Ordering::Relaxed)
    }
    fn is_live(&self) -> bool {
        self.record.state == WorkerState::Live
    }
}

/// What the row index keeps per fleet row: a worker entry, its rank and
/// its row.
pub(crate) type RowMeta = rows::RowMeta<WorkerEntry>;

/// The kernel's description of `record`'s `rank`.
fn row_spec(record: &WorkerRecord, rank: DpRank) -> WorkerSpec {
    WorkerSpec {
        worker_id: record.worker_id,
        dp_rank: rank,
        capacity_weight: record.capacity_weight,
        admission_limit: record.max_active_requests.unwrap_or(UNLIMITED),
    }
}

/// What changed in one [`sync`](crate::WorkerSelectionService::sync).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Workers added.
    pub added: Vec<WorkerId>,
    /// Workers whose record changed.
    pub updated: Vec<WorkerId>,
    /// Workers removed.
    pub removed: Vec<WorkerId>,
}

impl SyncReport {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.updated.is_empty() && self.removed.is_empty()
    }
}

/// What one [`refresh`](crate::WorkerSelectionService::refresh) did: the
/// snapshot it applied, if any, and the records the source refused.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct RefreshReport {
    /// What the applied snapshot changed; `None` when the source reported
    /// no change (and no kept snapshot was applied).
    pub applied: Option<SyncReport>,
    /// The records the source refused since the previous refresh
    /// ([`Discovery::take_refused`](crate::Discovery::take_refused)), each
    /// naming its key or file and worker. The snapshot was applied without
    /// them: their workers keep their last good records.
    pub refused: Vec<DiscoveryError>,
}

/// The worker registry (see the module docs).
///
/// Cloned into immutable snapshots for the selection path (see
/// `service`): a snapshot may be stale, so every row it names is booked
/// with its `SlotId` and a reused row refuses the booking.
#[derive(Clone)]
pub(crate) struct WorkerRegistry {
    /// The workers and their rows.
    index: RowIndex<WorkerEntry>,
    defaults: BusyThresholds,
    overloaded_marks: usize,
}

/// Read access to the row index (rows, ranks, masks, workers).
impl Deref for WorkerRegistry {
    type Target = RowIndex<WorkerEntry>;
    #[inline]
    fn deref(&self) -> &RowIndex<WorkerEntry> {
        &self.index
    }
}

impl WorkerRegistry {
    pub(crate) fn new(defaults: BusyThresholds) -> Self {
        WorkerRegistry {
            index: RowIndex::new(),
            defaults,
            overloaded_marks: 0,
        }
    }

    pub(crate) fn any_overloaded_mark(&self) -> bool {
        self.overloaded_marks > 0
    }

    /// A worker's selection counter, registered with the metrics recorder.
    /// Registered before any row is taken: a recorder that panics must not
    /// interrupt a change half way (see `sync`).
    fn selections_counter(worker_id: WorkerId) -> Counter {
        metrics::counter!("selkie_worker_selections_total", "worker" => worker_id.to_string())
    }

    /// Builds an entry; calls nothing outside the crate.
    fn make_entry(
        &self,
        record: WorkerRecord,
        rows: Vec<(DpRank, RowHandle)>,
        overloaded: bool,
        selections: Counter,
    ) -> WorkerEntry {
        let t = record.busy_thresholds.unwrap_or(self.defaults);
        WorkerEntry {
            decode_limit: t.active_decode_blocks.unwrap_or(u64::MAX),
            prefill_limit: t.prefill_limit(record.max_num_batched_tokens),
            selections,
            overloaded: AtomicBool::new(overloaded),
            record,
            rows,
        }
    }

    /// Checks that `changes` fit in the fleet before anything is changed.
    ///
    /// After the change the fleet holds: the rows it holds now, less the rows
    /// given up that no booking holds (a row given up with a booking on it
    /// stays, retired), plus one row per rank of `changes` that is neither a
    /// row of that worker now nor one of its retired rows. With `whole`,
    /// `changes` is a whole snapshot: every worker it does not name gives up
    /// its rows. The first change that does not fit is named.
    fn check_fits(&self, fleet: &HostFleet, changes: &[WorkerRecord], whole: bool) -> Result<(), DiscoveryError> {
        let by_id: HashMap<WorkerId, &WorkerRecord> = changes.iter().map(|r| (r.worker_id, r)).collect();
        let mut held = self.index.rows_held();
        for e in self.index.workers() {
            let keeps = match by_id.get(&e.record.worker_id) {
                Some(r) => r.dp_ranks(),
                None if whole => 0..0,
                None => continue,
            };
            held -= e
                .rows
                .iter()
                .filter(|&&(rank, h)| !keeps.contains(&rank) && fleet.is_drained(h))
                .count();
        }
        for r in changes {
            let now = self.index.get(r.worker_id).map(|e| e.record.dp_ranks());
            let new = r
                .dp_ranks()
                .filter(|&rank| {
                    !now.as_ref().is_some_and(|n| n.contains(&rank))
                        && !self.index.is_retired(WorkerWithDpRank::new(r.worker_id, rank))
                })
                .count();
            if held + new > HostFleet::CAPACITY {
                return Err(DiscoveryError::FleetFull {
                    worker_id: r.worker_id,
                    needed: new,
                    free: HostFleet::CAPACITY.saturating_sub(held),
                    retired: self.index.retired_rows(),
                    capacity: HostFleet::CAPACITY,
                });
            }
            held += new;
        }
        Ok(())
    }

    /// Takes a row for each of `ranks` of `record`: the rank's retired row if
    /// it has one (its counters intact), a new row otherwise. On a full fleet
    /// the rows taken are given back.
    fn take_rows(
        &mut self,
        fleet: &HostFleet,
        record: &WorkerRecord,
        ranks: impl Iterator<Item = DpRank>,
    ) -> Result<Vec<(DpRank, RowHandle)>, DiscoveryError> {
        // `validate` bounds the ranks by the fleet's capacity.
        let ranks: Vec<DpRank> = ranks.collect();
        let mut rows = Vec::with_capacity(ranks.len());
        for &rank in &ranks {
            let spec = row_spec(record, rank);
            let taken = match self.index.take_retired(WorkerWithDpRank::new(record.worker_id, rank)) {
                Some(h) => {
                    fleet.update_row(h, &spec, record.state);
                    Some(h)
                }
                None => fleet.add_row(spec, record.state),
            };
            match taken {
                Some(h) => rows.push((rank, h)),
                None => {
                    let taken = rows.len();
                    for (rank, h) in rows {
                        self.index.release_row(fleet, record.worker_id, rank, h);
                    }
                    return Err(DiscoveryError::FleetFull {
                        worker_id: record.worker_id,
                        needed: ranks.len(),
                        free: taken,
                        retired: self.index.retired_rows(),
                        capacity: HostFleet::CAPACITY,
                    });
                }
            }
        }
        Ok(rows)
    }

    /// Adds a worker: one fleet row per rank.
    pub(crate) fn add(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        if self.index.get(record.worker_id).is_some() {
            return Err(DiscoveryError::DuplicateWorker {
                worker_id: record.worker_id,
            });
        }
        self.index.sweep(fleet);
        self.check_fits(fleet, std::slice::from_ref(&record), false)?;
        let (id, ranks) = (record.worker_id, record.data_parallel_size);
        self.add_checked(fleet, record)?;
        tracing::info!(worker = id, ranks, "worker added");
        Ok(())
    }

    /// Adds a checked record. Between taking fleet rows and indexing them it
    /// calls no code outside the crate (metrics, tracing), so a panic there
    /// cannot leave rows taken and unindexed; logging is the caller's.
    fn add_checked(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        let selections = Self::selections_counter(record.worker_id);
        let rows = self.take_rows(fleet, &record, record.dp_ranks())?;
        let entry = self.make_entry(record, rows, false, selections);
        self.index.add_rows(entry);
        Ok(())
    }

    /// Replaces a worker's record. The rows of ranks it keeps are kept (with
    /// their in-flight load); ranks it drops give up their rows (retired while
    /// booked); new ranks get rows.
    pub(crate) fn update(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        if self.index.get(record.worker_id).is_none() {
            return Err(DiscoveryError::UnknownWorker {
                worker_id: record.worker_id,
            });
        }
        self.index.sweep(fleet);
        self.check_fits(fleet, std::slice::from_ref(&record), false)?;
        let (id, state) = (record.worker_id, record.state);
        self.update_checked(fleet, record)?;
        tracing::info!(worker = id, ?state, "worker updated");
        Ok(())
    }

    fn update_checked(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        let Some(old) = self.index.get(record.worker_id).cloned() else {
            return Err(DiscoveryError::UnknownWorker {
                worker_id: record.worker_id,
            });
        };
        let id = record.worker_id;
        let overloaded = old.overloaded.load(Ordering::Relaxed);
        let selections = Self::selections_counter(id);
        let (now, new) = (old.record.dp_ranks(), record.dp_ranks());
        let (kept, dropped): (Vec<_>, Vec<_>) = old.rows.iter().partition(|(rank, _)| new.contains(rank));
        for &(rank, h) in &dropped {
            self.index.forget_row(id, rank, h);
            self.index.release_row(fleet, id, rank, h);
        }
        let rows = match self.take_rows(fleet, &record, new.clone().filter(|r| !now.contains(r))) {
            Ok(taken) => {
                for &(rank, h) in &kept {
                    fleet.update_row(h, &row_spec(&record, rank), record.state);
                }
                let mut rows = kept;
                rows.extend(taken);
                rows.sort_unstable_by_key(|&(rank, _)| rank);
                rows
            }
            Err(e) => {
                // Give the dropped ranks back their rows (revived, or new
                // ones where they were free) and keep the old record.
                let back = self.take_rows(fleet, &old.record, dropped.iter().map(|&(rank, _)| rank));
                let mut rows = kept;
                let restored = back.map(|back| rows.extend(back)).is_ok();
                rows.sort_unstable_by_key(|&(rank, _)| rank);
                if rows.is_empty() {
                    self.index.remove_worker(id);
                    if overloaded {
                        self.overloaded_marks -= 1;
                    }
                    self.index.recompute_traits();
                } else {
                    let entry = self.make_entry(old.record.clone(), rows, overloaded, old.selections.clone());
                    self.index.add_rows(entry);
                }
                if !restored {
                    tracing::error!(worker = id, "cannot restore the rows of a refused update");
                }
                return Err(e);
            }
        };
        let entry = self.make_entry(record, rows, overloaded, selections);
        self.index.add_rows(entry);
        Ok(())
    }

    /// Removes a worker and its rows. A row that a booking still holds load
    /// on is retired, not freed: cordoned, invisible to selection, and given
    /// back with its counters if the same worker rank is added again before
    /// its bookings end; once they end it is freed by a later change.
    pub(crate) fn remove(&mut self, fleet: &HostFleet, worker_id: WorkerId) -> Result<(), DiscoveryError> {
        self.remove_entry(fleet, worker_id)?;
        tracing::info!(worker = worker_id, "worker removed");
        self.index.sweep(fleet);
        self.index.recompute_traits();
        Ok(())
    }

    fn remove_entry(&mut self, fleet: &HostFleet, worker_id: WorkerId) -> Result<Arc<WorkerEntry>, DiscoveryError> {
        let Some(old) = self.index.remove_worker(worker_id) else {
            return Err(DiscoveryError::UnknownWorker { worker_id });
        };
        if old.overloaded.load(Ordering::Relaxed) {
            self.overloaded_marks -= 1;
        }
        for &(rank, h) in &old.rows {
            self.index.forget_row(worker_id, rank, h);
            self.index.release_row(fleet, worker_id, rank, h);
        }
        Ok(old)
    }

    /// Changes a worker's state (live, draining, cordoned).
    pub(crate) fn set_state(
        &mut self,
        fleet: &HostFleet,
        worker_id: WorkerId,
        state: WorkerState,
    ) -> Result<(), DiscoveryError> {
        let Some(old) = self.index.get(worker_id) else {
            return Err(DiscoveryError::UnknownWorker { worker_id });
        };
        let mut record = old.record.clone();
        record.state = state;
        self.update(fleet, record)
    }

    /// Marks a worker overloaded (or clears the mark).
    pub(crate) fn set_overloaded(&mut self, worker_id: WorkerId, overloaded: bool) -> Result<(), DiscoveryError> {
        let Some(e) = self.index.get(worker_id) else {
            return Err(DiscoveryError::UnknownWorker { worker_id });
        };
        let was = e.overloaded.swap(overloaded, Ordering::Relaxed);
        if was != overloaded {
            tracing::info!(worker = worker_id, overloaded, "overload mark changed");
        }
        match (was, overloaded) {
            (false, true) => self.overloaded_marks += 1,
            (true, false) => self.overloaded_marks -= 1,
            _ => {}
        }
        if was != overloaded {
            // Not inside `sync`: the index defers it to the end.
            self.index.recompute_overloaded_rows();
        }
        Ok(())
    }

    /// Makes the registry equal `snapshot`: adds, updates and removes.
    ///
    /// A snapshot applies whole or not at all. It is checked first (valid
    /// records, no duplicate ids, and rows for all of it: the rows its
    /// removals and rank changes free against the rows its additions need),
    /// so a snapshot that cannot apply changes nothing. Should the fleet
    /// still refuse a row part way, the changes already made are undone.
    pub(crate) fn sync(
        &mut self,
        fleet: &HostFleet,
        snapshot: Vec<WorkerRecord>,
    ) -> Result<SyncReport, DiscoveryError> {
        let mut ids = HashMap::with_capacity(snapshot.len());
        for r in &snapshot {
            r.validate()?;
            if ids.insert(r.worker_id, ()).is_some() {
                return Err(DiscoveryError::DuplicateInSnapshot { worker_id: r.worker_id });
            }
        }
        self.index.sweep(fleet);
        self.check_fits(fleet, &snapshot, true)?;
        self.index.set_deferred(true);
        let mut undo = Vec::new();
        // A panic part way (a metrics recorder or tracing subscriber called
        // while applying) is undone like an error, then resumed: the
        // snapshot applies whole or not at all either way.
        let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.apply_snapshot(fleet, snapshot, &ids, &mut undo)
        }));
        let failed = !matches!(applied, Ok(Ok(_)));
        if failed {
            self.undo(fleet, undo);
        }
        self.index.set_deferred(false);
        self.index.recompute_traits();
        match applied {
            Ok(Ok(report)) => {
                tracing::info!(
                    added = report.added.len(),
                    updated = report.updated.len(),
                    removed = report.removed.len(),
                    "discovery snapshot applied"
                );
                Ok(report)
            }
            Ok(Err(e)) => Err(e),
            Err(payload) => std::panic::resume_unwind(payload),
        }
    }

    fn apply_snapshot(
        &mut self,
        fleet: &HostFleet,
        snapshot: Vec<WorkerRecord>,
        ids: &HashMap<WorkerId, ()>,
        undo: &mut Vec<Undo>,
    ) -> Result<SyncReport, DiscoveryError> {
        let mut report = SyncReport::default();
        let gone: Vec<WorkerId> = self
            .index
            .workers()
            .map(|e| e.record.worker_id)
            .filter(|id| !ids.contains_key(id))
            .collect();
        for id in gone {
            undo.push(Undo::Removed(self.remove_entry(fleet, id)?));
            report.removed.push(id);
        }
        // Rows freed first: updates in order of the rows they need (those
        // that drop ranks before those that add them), then new workers.
        // `check_fits` has counted the whole snapshot, so in this order no
        // step needs a row that a later step would free.
        let mut updates = Vec::new();
        let mut adds = Vec::new();
        for r in snapshot {
            match self.index.get(r.worker_id) {
                None => adds.push(r),
                Some(e) if e.record != r => {
                    // Rows it needs and rows it frees, counted as
                    // `check_fits` counts them: a new rank with a retired
                    // row needs none, a dropped rank still booked frees none.
                    let (now, new) = (e.record.dp_ranks(), r.dp_ranks());
                    let needs = new
                        .clone()
                        .filter(|&k| !now.contains(&k) && !self.index.is_retired(WorkerWithDpRank::new(r.worker_id, k)))
                        .count() as i64;
                    let frees = e
                        .rows
                        .iter()
                        .filter(|&&(k, h)| !new.contains(&k) && fleet.is_drained(h))
                        .count() as i64;
                    updates.push((needs - frees, r));
                }
                Some(_) => {}
            }
        }
        updates.sort_by_key(|(net, r)| (*net, r.worker_id));
        for (_, r) in updates {
            let old = self
                .index
                .get(r.worker_id)
                .map(|e| e.record.clone())
                .ok_or(DiscoveryError::UnknownWorker { worker_id: r.worker_id })?;
            let id = r.worker_id;
            self.update_checked(fleet, r)?;
            undo.push(Undo::Updated(old));
            report.updated.push(id);
        }
        for r in adds {
            let id = r.worker_id;
            self.add_checked(fleet, r)?;
            undo.push(Undo::Added(id));
            report.added.push(id);
        }
        report.added.sort_unstable();
        report.updated.sort_unstable();
        report.removed.sort_unstable();
        Ok(report)
    }

    /// Reverts the changes of a snapshot that failed part way, newest first.
    /// Removed workers come back on their retired rows (bookings intact) or
    /// on new rows where theirs were free.
    ///
    /// Each step runs under its own panic guard (a metrics recorder or
    /// tracing subscriber that panicked once may panic again), so every
    /// step is tried.
    fn undo(&mut self, fleet: &HostFleet, undo: Vec<Undo>) {
        for step in undo.into_iter().rev() {
            let undone = crate::contain::contain_message(|| match step {
                Undo::Added(id) => self.remove_entry(fleet, id).map(drop),
                Undo::Updated(old) => self.update_checked(fleet, old),
                Undo::Removed(old) => {
                    let id = old.record.worker_id;
                    let overloaded = old.overloaded.load(Ordering::Relaxed);
                    self.add_checked(fleet, old.record.clone())
                        .and_then(|()| self.set_overloaded(id, overloaded))
                }
            });
            let failure = match undone {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e.to_string(),
                Err(panic) => format!("panicked: {panic}"),
            };
            let _ = crate::contain::contain(|| {
                tracing::error!(error = %failure, "cannot undo part of a refused discovery snapshot");
            });
        }
    }
}

/// One change of a snapshot, as [`WorkerRegistry::undo`] reverts it.
enum Undo {
    /// The worker was added.
    Added(WorkerId),
    /// The worker's record was replaced; this was the old one.
    Updated(WorkerRecord),
    /// The worker was removed; this was its entry.
    Removed(Arc<WorkerEntry>),
}
