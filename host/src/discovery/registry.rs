//! The worker registry: discovery's view of the fleet, and the one place that
//! adds, updates and removes the kernel's rows.
//!
//! Each data-parallel rank of a worker is one fleet row. The registry keeps,
//! per row, what the hard filters need (the worker's record, its rank, its
//! busy limits) and, per worker, its rows. It is changed under the service's
//! write lock and read under its read lock; it never books or releases load.
//!
//! # Retired rows
//!
//! A worker that leaves while requests are in flight on it must not forget
//! them: if it comes back before they finish, its admission limit must still
//! count them. So a row given up while a booking holds load on it (the
//! worker removed, or the rank dropped by an update) is *retired*: cordoned
//! in the fleet (no new bookings), absent from the worker table, and kept
//! with its counters and generation. If the same worker rank is added again
//! meanwhile, it gets that row back, and the old bookings release into it.
//! Retired rows whose bookings have all ended are freed at the start of the
//! next change.
//!
//! # Whole snapshots
//!
//! [`WorkerRegistry::sync`] checks a snapshot completely (records, duplicate
//! ids, rows for all of it) before changing anything, and undoes what it
//! did if the fleet still refuses a row part way.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use metrics::Counter;

use super::record::{BusyThresholds, WorkerRecord, WorkerState};
use crate::error::DiscoveryError;
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

/// What the registry keeps per fleet row.
#[derive(Clone)]
pub(crate) struct RowMeta {
    pub(crate) entry: Arc<WorkerEntry>,
    pub(crate) dp_rank: DpRank,
    /// The kernel occupancy this row meta describes (bookings check it).
    pub(crate) handle: RowHandle,
}

impl RowMeta {
    pub(crate) fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.entry.record.worker_id, self.dp_rank)
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

/// Facts about the whole fleet that let the selection path skip work.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FleetTraits {
    /// Some worker has more than one rank.
    pub(crate) multi_rank: bool,
    /// Some worker has a capacity weight other than 1.
    pub(crate) weighted: bool,
    /// Some worker has a busy threshold.
    pub(crate) thresholds: bool,
}

/// A hasher for worker ids: one multiply and a fold (ids are not
/// attacker-chosen, and the overlap scatter looks one up per overlap entry
/// on the selection path, so SipHash's cost would show).
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let m = (self.0 as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (m as u64) ^ ((m >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v;
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
}

type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The worker registry (see the module docs).
///
/// Cloned into immutable snapshots for the selection path (see
/// `service`): a snapshot may be stale, so every row it names is booked
/// with its `SlotId` and a reused row refuses the booking.
#[derive(Clone)]
pub(crate) struct WorkerRegistry {
    workers: IdMap<WorkerId, Arc<WorkerEntry>>,
    /// Row of each worker rank, stored inline (the overlap scatter looks
    /// one up per overlap entry without touching the worker entries).
    rank_rows: IdMap<WorkerWithDpRank, u32>,
    /// The same, sorted by worker rank, for merging with sorted overlaps.
    sorted_ranks: Vec<(WorkerWithDpRank, u32)>,
    /// Per row: the row of its worker's first rank (per-worker load sums).
    leaders: Vec<u32>,
    rows: Vec<Option<RowMeta>>,
    defaults: BusyThresholds,
    traits: FleetTraits,
    overloaded_marks: usize,
    /// Rows of CPU workers (device-aware policy).
    cpu_rows: Vec<u64>,
    /// Rows this registry has a [`RowMeta`] for.
    known_rows: Vec<u64>,
    /// Rows of workers marked overloaded (`set_overloaded`).
    overloaded_rows: Vec<u64>,
    /// Rows of workers with a busy threshold (checked against their load).
    threshold_rows: Vec<u64>,
    /// One past the highest row with a [`RowMeta`], in whole lane groups:
    /// the rows a selection on this snapshot scans. It shrinks when the top
    /// rows go, and a refused add never raises it.
    scan_rows: usize,
    /// Rows given up (worker removed, rank dropped) while bookings held load
    /// on them: cordoned in the fleet, absent from `rows`, freed once drained,
    /// and given back if the same worker rank returns first.
    retired: IdMap<WorkerWithDpRank, RowHandle>,
    /// Inside `sync`: derived data is recomputed once at the end.
    deferred: bool,
}

impl WorkerRegistry {
    pub(crate) fn new(defaults: BusyThresholds) -> Self {
        WorkerRegistry {
            workers: IdMap::default(),
            rank_rows: IdMap::default(),
            sorted_ranks: Vec::new(),
            leaders: Vec::new(),
            rows: Vec::new(),
            defaults,
            traits: FleetTraits::default(),
            overloaded_marks: 0,
            cpu_rows: Vec::new(),
            known_rows: Vec::new(),
            overloaded_rows: Vec::new(),
            threshold_rows: Vec::new(),
            scan_rows: 0,
            retired: IdMap::default(),
            deferred: false,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.workers.len()
    }

    pub(crate) fn get(&self, worker_id: WorkerId) -> Option<&Arc<WorkerEntry>> {
        self.workers.get(&worker_id)
    }

    pub(crate) fn row(&self, row: usize) -> Option<&RowMeta> {
        self.rows.get(row).and_then(Option::as_ref)
    }

    #[inline]
    pub(crate) fn row_of(&self, w: WorkerWithDpRank) -> Option<usize> {
        self.rank_rows.get(&w).map(|&r| r as usize)
    }

    /// Every worker rank and its row, sorted by worker rank.
    pub(crate) fn sorted_ranks(&self) -> &[(WorkerWithDpRank, u32)] {
        &self.sorted_ranks
    }

    fn index_rank(&mut self, w: WorkerWithDpRank, row: usize) {
        self.rank_rows.insert(w, row as u32);
        match self.sorted_ranks.binary_search_by_key(&w, |e| e.0) {
            Ok(i) => self.sorted_ranks[i].1 = row as u32,
            Err(i) => self.sorted_ranks.insert(i, (w, row as u32)),
        }
    }

    fn unindex_rank(&mut self, w: WorkerWithDpRank) {
        self.rank_rows.remove(&w);
        if let Ok(i) = self.sorted_ranks.binary_search_by_key(&w, |e| e.0) {
            self.sorted_ranks.remove(i);
        }
    }

    pub(crate) fn traits(&self) -> FleetTraits {
        self.traits
    }

    /// The row of `row`'s worker's first rank.
    #[inline]
    pub(crate) fn leader(&self, row: usize) -> Option<usize> {
        self.leaders.get(row).map(|&l| l as usize)
    }

    /// Rows with a worker in this registry, as mask words.
    pub(crate) fn known_rows(&self) -> &[u64] {
        &self.known_rows
    }

    /// Rows of CPU workers, as mask words.
    pub(crate) fn cpu_rows(&self) -> &[u64] {
        &self.cpu_rows
    }

    pub(crate) fn any_overloaded_mark(&self) -> bool {
        self.overloaded_marks > 0
    }

    /// Rows of workers marked overloaded, as mask words.
    pub(crate) fn overloaded_rows(&self) -> &[u64] {
        &self.overloaded_rows
    }

    /// Rows of workers with a busy threshold, as mask words.
    pub(crate) fn threshold_rows(&self) -> &[u64] {
        &self.threshold_rows
    }

    /// The rows a selection on this registry scans (see the field).
    #[inline]
    pub(crate) fn scan_rows(&self) -> usize {
        self.scan_rows
    }

    pub(crate) fn workers(&self) -> impl Iterator<Item = &Arc<WorkerEntry>> {
        self.workers.values()
    }

    fn make_entry(&self, record: WorkerRecord, rows: Vec<(DpRank, RowHandle)>, overloaded: bool) -> WorkerEntry {
        let t = record.busy_thresholds.unwrap_or(self.defaults);
        WorkerEntry {
            decode_limit: t.active_decode_blocks.unwrap_or(u64::MAX),
            prefill_limit: t.prefill_limit(record.max_num_batched_tokens),
            selections: metrics::counter!("selkie_worker_selections_total", "worker" => record.worker_id.to_string()),
            overloaded: AtomicBool::new(overloaded),
            record,
            rows,
        }
    }

    fn install(&mut self, entry: WorkerEntry) {
        let entry = Arc::new(entry);
        for &(rank, h) in &entry.rows {
            if self.rows.len() <= h.row {
                self.rows.resize(h.row + 1, None);
            }
            self.rows[h.row] = Some(RowMeta {
                entry: entry.clone(),
                dp_rank: rank,
                handle: h,
            });
            self.index_rank(WorkerWithDpRank::new(entry.record.worker_id, rank), h.row);
        }
        self.workers.insert(entry.record.worker_id, entry);
        self.recompute_traits();
    }

    fn recompute_traits(&mut self) {
        if self.deferred {
            return;
        }
        let mut t = FleetTraits::default();
        let words = selkie_kernel::mask::words_for(self.rows.len());
        self.cpu_rows.clear();
        self.cpu_rows.resize(words, 0);
        self.known_rows.clear();
        self.known_rows.resize(words, 0);
        self.leaders.clear();
        self.leaders.resize(self.rows.len(), 0);
        self.threshold_rows.clear();
        self.threshold_rows.resize(words, 0);
        let mut top = 0;
        for (row, m) in self.rows.iter().enumerate() {
            if let Some(m) = m {
                self.known_rows[row / 64] |= 1 << (row % 64);
                self.leaders[row] = m.entry.rows[0].1.row as u32;
                top = row + 1;
            }
        }
        self.scan_rows = selkie_kernel::lanes::padded_rows(top);
        for e in self.workers.values() {
            if e.record.device == super::DeviceKind::Cpu {
                for &(_, h) in &e.rows {
                    self.cpu_rows[h.row / 64] |= 1 << (h.row % 64);
                }
            }
            if e.decode_limit != u64::MAX || e.prefill_limit != u64::MAX {
                for &(_, h) in &e.rows {
                    self.threshold_rows[h.row / 64] |= 1 << (h.row % 64);
                }
            }
            t.multi_rank |= e.record.data_parallel_size > 1;
            t.weighted |= e.record.capacity_weight != 1.0;
            t.thresholds |= e.decode_limit != u64::MAX || e.prefill_limit != u64::MAX;
        }
        self.traits = t;
        self.recompute_overloaded_rows();
    }

    /// Rebuilds the overloaded-rows mask from the workers' marks.
    fn recompute_overloaded_rows(&mut self) {
        self.overloaded_rows.clear();
        self.overloaded_rows
            .resize(selkie_kernel::mask::words_for(self.rows.len()), 0);
        for e in self.workers.values() {
            if e.overloaded.load(Ordering::Relaxed) {
                for &(_, h) in &e.rows {
                    self.overloaded_rows[h.row / 64] |= 1 << (h.row % 64);
                }
            }
        }
    }

    /// Rows held now: every registered rank, and every retired row.
    fn rows_held(&self) -> usize {
        self.workers.values().map(|e| e.rows.len()).sum::<usize>() + self.retired.len()
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
        let mut held = self.rows_held();
        for e in self.workers.values() {
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
            let now = self.workers.get(&r.worker_id).map(|e| e.record.dp_ranks());
            let new = r
                .dp_ranks()
                .filter(|&rank| {
                    !now.as_ref().is_some_and(|n| n.contains(&rank))
                        && !self.retired.contains_key(&WorkerWithDpRank::new(r.worker_id, rank))
                })
                .count();
            if held + new > HostFleet::CAPACITY {
                return Err(DiscoveryError::FleetFull {
                    worker_id: r.worker_id,
                    needed: new,
                    free: HostFleet::CAPACITY.saturating_sub(held),
                    retired: self.retired.len(),
                    capacity: HostFleet::CAPACITY,
                });
            }
            held += new;
        }
        Ok(())
    }

    /// Frees the retired rows whose bookings have all ended.
    fn sweep(&mut self, fleet: &HostFleet) {
        self.retired.retain(|w, h| {
            let drained = fleet.is_drained(*h);
            if drained {
                fleet.remove_row(*h);
                tracing::debug!(worker = %w, row = h.row, "retired row freed");
            }
            !drained
        });
    }

    /// Gives up a row of `worker_id`'s `rank` (already out of `rows` and the
    /// rank index): retired while a booking holds load on it, freed otherwise.
    /// The row is cordoned first, so no booking can start on it between the
    /// check and the removal.
    fn release_row(&mut self, fleet: &HostFleet, worker_id: WorkerId, rank: DpRank, h: RowHandle) {
        fleet.retire_row(h);
        if fleet.is_drained(h) {
            fleet.remove_row(h);
        } else {
            self.retired.insert(WorkerWithDpRank::new(worker_id, rank), h);
        }
    }

    /// Drops a row from the registry's tables (not from the fleet).
    fn forget_row(&mut self, worker_id: WorkerId, rank: DpRank, h: RowHandle) {
        if let Some(slot) = self.rows.get_mut(h.row) {
            *slot = None;
        }
        self.unindex_rank(WorkerWithDpRank::new(worker_id, rank));
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
            let taken = match self.retired.remove(&WorkerWithDpRank::new(record.worker_id, rank)) {
                Some(h) => {
                    fleet.update_row(h, record);
                    Some(h)
                }
                None => fleet.add_row(record, rank),
            };
            match taken {
                Some(h) => rows.push((rank, h)),
                None => {
                    let taken = rows.len();
                    for (rank, h) in rows {
                        self.release_row(fleet, record.worker_id, rank, h);
                    }
                    return Err(DiscoveryError::FleetFull {
                        worker_id: record.worker_id,
                        needed: ranks.len(),
                        free: taken,
                        retired: self.retired.len(),
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
        if self.workers.contains_key(&record.worker_id) {
            return Err(DiscoveryError::DuplicateWorker {
                worker_id: record.worker_id,
            });
        }
        self.sweep(fleet);
        self.check_fits(fleet, std::slice::from_ref(&record), false)?;
        self.add_checked(fleet, record)
    }

    fn add_checked(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        let rows = self.take_rows(fleet, &record, record.dp_ranks())?;
        let entry = self.make_entry(record, rows, false);
        tracing::info!(
            worker = entry.record.worker_id,
            ranks = entry.rows.len(),
            "worker added"
        );
        self.install(entry);
        Ok(())
    }

    /// Replaces a worker's record. The rows of ranks it keeps are kept (with
    /// their in-flight load); ranks it drops give up their rows (retired while
    /// booked); new ranks get rows.
    pub(crate) fn update(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        if !self.workers.contains_key(&record.worker_id) {
            return Err(DiscoveryError::UnknownWorker {
                worker_id: record.worker_id,
            });
        }
        self.sweep(fleet);
        self.check_fits(fleet, std::slice::from_ref(&record), false)?;
        self.update_checked(fleet, record)
    }

    fn update_checked(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        let Some(old) = self.workers.get(&record.worker_id).cloned() else {
            return Err(DiscoveryError::UnknownWorker {
                worker_id: record.worker_id,
            });
        };
        let id = record.worker_id;
        let overloaded = old.overloaded.load(Ordering::Relaxed);
        let (now, new) = (old.record.dp_ranks(), record.dp_ranks());
        let (kept, dropped): (Vec<_>, Vec<_>) = old.rows.iter().partition(|(rank, _)| new.contains(rank));
        for &(rank, h) in &dropped {
            self.forget_row(id, rank, h);
            self.release_row(fleet, id, rank, h);
        }
        let rows = match self.take_rows(fleet, &record, new.clone().filter(|r| !now.contains(r))) {
            Ok(taken) => {
                for &(_, h) in &kept {
                    fleet.update_row(h, &record);
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
                match back {
                    Ok(back) => rows.extend(back),
                    Err(_) => tracing::error!(worker = id, "cannot restore the rows of a refused update"),
                }
                rows.sort_unstable_by_key(|&(rank, _)| rank);
                if rows.is_empty() {
                    self.workers.remove(&id);
                    if overloaded {
                        self.overloaded_marks -= 1;
                    }
                    self.recompute_traits();
                } else {
                    let entry = self.make_entry(old.record.clone(), rows, overloaded);
                    self.install(entry);
                }
                return Err(e);
            }
        };
        let entry = self.make_entry(record, rows, overloaded);
        tracing::info!(worker = entry.record.worker_id, state = ?entry.record.state, "worker updated");
        self.install(entry);
        Ok(())
    }

    /// Removes a worker and its rows. A row that a booking still holds load
    /// on is retired, not freed: cordoned, invisible to selection, and given
    /// back with its counters if the same worker rank is added again before
    /// its bookings end; once they end it is freed by a later change.
    pub(crate) fn remove(&mut self, fleet: &HostFleet, worker_id: WorkerId) -> Result<(), DiscoveryError> {
        self.remove_entry(fleet, worker_id)?;
        self.sweep(fleet);
        self.recompute_traits();
        Ok(())
    }

    fn remove_entry(&mut self, fleet: &HostFleet, worker_id: WorkerId) -> Result<Arc<WorkerEntry>, DiscoveryError> {
        let Some(old) = self.workers.remove(&worker_id) else {
            return Err(DiscoveryError::UnknownWorker { worker_id });
        };
        if old.overloaded.load(Ordering::Relaxed) {
            self.overloaded_marks -= 1;
        }
        for &(rank, h) in &old.rows {
            self.forget_row(worker_id, rank, h);
            self.release_row(fleet, worker_id, rank, h);
        }
        tracing::info!(worker = worker_id, "worker removed");
        Ok(old)
    }

    /// Changes a worker's state (live, draining, cordoned).
    pub(crate) fn set_state(
        &mut self,
        fleet: &HostFleet,
        worker_id: WorkerId,
        state: WorkerState,
    ) -> Result<(), DiscoveryError> {
        let Some(old) = self.workers.get(&worker_id) else {
            return Err(DiscoveryError::UnknownWorker { worker_id });
        };
        let mut record = old.record.clone();
        record.state = state;
        self.update(fleet, record)
    }

    /// Marks a worker overloaded (or clears the mark).
    pub(crate) fn set_overloaded(&mut self, worker_id: WorkerId, overloaded: bool) -> Result<(), DiscoveryError> {
        let Some(e) = self.workers.get(&worker_id) else {
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
        if was != overloaded && !self.deferred {
            self.recompute_overloaded_rows();
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
        self.sweep(fleet);
        self.check_fits(fleet, &snapshot, true)?;
        self.deferred = true;
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
        self.deferred = false;
        self.recompute_traits();
        match applied {
            Ok(result) => result,
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
            .workers
            .keys()
            .copied()
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
            match self.workers.get(&r.worker_id) {
                None => adds.push(r),
                Some(e) if e.record != r => {
                    let (now, new) = (e.record.dp_ranks(), r.dp_ranks());
                    let needs = new.clone().filter(|k| !now.contains(k)).count() as i64;
                    let frees = now.filter(|k| !new.contains(k)).count() as i64;
                    updates.push((needs - frees, r));
                }
                Some(_) => {}
            }
        }
        updates.sort_by_key(|(net, r)| (*net, r.worker_id));
        for (_, r) in updates {
            let old = self.workers[&r.worker_id].record.clone();
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
    fn undo(&mut self, fleet: &HostFleet, undo: Vec<Undo>) {
        for step in undo.into_iter().rev() {
            let result = match step {
                Undo::Added(id) => self.remove_entry(fleet, id).map(drop),
                Undo::Updated(old) => self.update_checked(fleet, old),
                Undo::Removed(old) => {
                    let id = old.record.worker_id;
                    let overloaded = old.overloaded.load(Ordering::Relaxed);
                    self.add_checked(fleet, old.record.clone())
                        .and_then(|()| self.set_overloaded(id, overloaded))
                }
            };
            if let Err(e) = result {
                tracing::error!(error = %e, "cannot undo part of a refused discovery snapshot");
            }
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
