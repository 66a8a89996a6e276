//! The worker registry: discovery's view of the fleet, and the one place that
//! adds, updates and removes the kernel's rows.
//!
//! Each data-parallel rank of a worker is one fleet row. The registry keeps,
//! per row, what the hard filters need (the worker's record, its rank, its
//! busy limits) and, per worker, its rows. It is changed under the service's
//! write lock and read under its read lock; it never books or releases load.

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

    fn add_rows(fleet: &HostFleet, record: &WorkerRecord) -> Result<Vec<(DpRank, RowHandle)>, DiscoveryError> {
        let mut rows = Vec::with_capacity(record.data_parallel_size as usize);
        for rank in record.dp_ranks() {
            match fleet.add_row(record, rank) {
                Some(h) => rows.push((rank, h)),
                None => {
                    for &(_, h) in &rows {
                        fleet.remove_row(h);
                    }
                    return Err(DiscoveryError::FleetFull {
                        worker_id: record.worker_id,
                        needed: record.data_parallel_size as usize,
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
        let rows = Self::add_rows(fleet, &record)?;
        let entry = self.make_entry(record, rows, false);
        tracing::info!(
            worker = entry.record.worker_id,
            ranks = entry.rows.len(),
            "worker added"
        );
        self.install(entry);
        Ok(())
    }

    /// Replaces a worker's record. Rows are kept (with their in-flight load)
    /// when the ranks are unchanged; otherwise the old rows are removed and
    /// new ones added.
    pub(crate) fn update(&mut self, fleet: &HostFleet, record: WorkerRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        let Some(old) = self.workers.get(&record.worker_id).cloned() else {
            return Err(DiscoveryError::UnknownWorker {
                worker_id: record.worker_id,
            });
        };
        let overloaded = old.overloaded.load(Ordering::Relaxed);
        let rows = if old.record.dp_ranks() == record.dp_ranks() {
            for &(_, h) in &old.rows {
                fleet.update_row(h, &record);
            }
            old.rows.clone()
        } else {
            let rows = Self::add_rows(fleet, &record)?;
            for &(rank, h) in &old.rows {
                fleet.remove_row(h);
                self.rows[h.row] = None;
                self.unindex_rank(WorkerWithDpRank::new(old.record.worker_id, rank));
            }
            rows
        };
        let entry = self.make_entry(record, rows, overloaded);
        tracing::info!(worker = entry.record.worker_id, state = ?entry.record.state, "worker updated");
        self.install(entry);
        Ok(())
    }

    /// Removes a worker and its rows. Bookings on them stay valid and release
    /// into nothing (the kernel's generation check).
    pub(crate) fn remove(&mut self, fleet: &HostFleet, worker_id: WorkerId) -> Result<(), DiscoveryError> {
        let Some(old) = self.workers.remove(&worker_id) else {
            return Err(DiscoveryError::UnknownWorker { worker_id });
        };
        if old.overloaded.load(Ordering::Relaxed) {
            self.overloaded_marks -= 1;
        }
        for &(rank, h) in &old.rows {
            fleet.remove_row(h);
            self.rows[h.row] = None;
            self.unindex_rank(WorkerWithDpRank::new(worker_id, rank));
        }
        self.recompute_traits();
        tracing::info!(worker = worker_id, "worker removed");
        Ok(())
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
    /// The snapshot is checked first (valid records, no duplicate ids), so a
    /// bad snapshot changes nothing. A full fleet can still stop it part way;
    /// the report then covers what was done before the error.
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
        self.deferred = true;
        let result = self.apply_snapshot(fleet, snapshot, &ids);
        self.deferred = false;
        self.recompute_traits();
        result
    }

    fn apply_snapshot(
        &mut self,
        fleet: &HostFleet,
        snapshot: Vec<WorkerRecord>,
        ids: &HashMap<WorkerId, ()>,
    ) -> Result<SyncReport, DiscoveryError> {
        let mut report = SyncReport::default();
        let gone: Vec<WorkerId> = self
            .workers
            .keys()
            .copied()
            .filter(|id| !ids.contains_key(id))
            .collect();
        for id in gone {
            self.remove(fleet, id)?;
            report.removed.push(id);
        }
        for r in snapshot {
            match self.workers.get(&r.worker_id) {
                None => {
                    report.added.push(r.worker_id);
                    self.add(fleet, r)?;
                }
                Some(e) if e.record != r => {
                    report.updated.push(r.worker_id);
                    self.update(fleet, r)?;
                }
                Some(_) => {}
            }
        }
        report.added.sort_unstable();
        report.updated.sort_unstable();
        report.removed.sort_unstable();
        Ok(report)
    }
}
