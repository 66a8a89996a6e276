//! The row index: which fleet row holds which worker rank, and the per-row
//! facts the selection path reads without touching the workers.
//!
//! Each data-parallel rank of a worker is one fleet row. The index keeps,
//! per row, a [`RowMeta`] (the worker's payload, its rank, its
//! [`RowHandle`]); per worker rank, its row (hashed, and in a flat table
//! for the overlap scatter) and the epoch of that assignment; per row, the row of its worker's first rank; and
//! the row masks the hard filters start from (known rows, CPU rows, rows
//! with a busy threshold, rows marked overloaded), with [`FleetTraits`] that
//! let the selection path skip work.
//!
//! The index is generic over the per-worker payload `E` ([`RowOwner`]):
//! discovery stores its worker entries here, so a selection reaches a row's
//! worker in one pointer step, as before, and the index never names what a
//! worker is. It must not decide which workers exist (discovery does), nor
//! read or book load beyond asking the fleet whether a row is drained.
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
//! Retired rows whose bookings have all ended are freed by [`RowIndex::sweep`]
//! at the start of the next change.

use selkie_kernel::kernels::keyed::DenseRows;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{HostFleet, RowHandle};
use crate::types::{DpRank, WorkerId, WorkerWithDpRank};

/// What the row index needs from the worker that holds rows.
pub(crate) trait RowOwner {
    /// The worker's id.
    fn worker_id(&self) -> WorkerId;
    /// `(rank, row)` for each rank, in rank order.
    fn rows(&self) -> &[(DpRank, RowHandle)];
    /// This worker's share of the [`FleetTraits`].
    fn traits(&self) -> FleetTraits;
    /// Whether the worker runs on CPUs (device-aware policy).
    fn is_cpu(&self) -> bool;
    /// Whether the worker is marked overloaded from outside.
    fn is_overloaded(&self) -> bool;
    /// Whether the worker takes new requests (not draining or cordoned).
    fn is_live(&self) -> bool;
}

/// What the index keeps per fleet row.
pub(crate) struct RowMeta<E> {
    pub(crate) entry: Arc<E>,
    pub(crate) dp_rank: DpRank,
    /// The kernel occupancy this row meta describes (bookings check it).
    pub(crate) handle: RowHandle,
}

impl<E> Clone for RowMeta<E> {
    fn clone(&self) -> Self {
        RowMeta {
            entry: self.entry.clone(),
            dp_rank: self.dp_rank,
            handle: self.handle,
        }
    }
}

impl<E: RowOwner> RowMeta<E> {
    #[inline]
    pub(crate) fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.entry.worker_id(), self.dp_rank)
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

impl FleetTraits {
    /// The traits of a fleet holding the workers of both.
    fn union(self, other: FleetTraits) -> FleetTraits {
        FleetTraits {
            multi_rank: self.multi_rank | other.multi_rank,
            weighted: self.weighted | other.weighted,
            thresholds: self.thresholds | other.thresholds,
        }
    }
}

/// A map keyed by worker ids (or worker ranks), with rustc's Fx hash: one
/// multiply per key word. Ids are not attacker-chosen, and a pinned request
/// looks its worker up here, so SipHash's cost would show. (The overlap
/// scatter uses the flat [`RankTable`] instead.)
pub(crate) type IdMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// Source of row-layout epochs (unique in the process).
static LAYOUT_EPOCHS: AtomicU64 = AtomicU64::new(1);

fn next_layout_epoch() -> u64 {
    LAYOUT_EPOCHS.fetch_add(1, Ordering::Relaxed)
}

/// Worker rank -> row as a flat open-addressing table (linear probing,
/// at most half full): one multiply, a shift and usually one compare per
/// lookup, with no pointer chasing.
///
/// When every worker id and DP rank is small (the array below holds at
/// most `DENSE_PER_RANK` entries per worker rank, plus `DENSE_SLACK`: ids
/// handed out by a counter, say), every rank is also kept in an array
/// indexed by `id * ranks + rank` (the kernel's
/// [`DenseRows`]): two bounds checks and one load per lookup, no hashing,
/// and eight lookups in one gather for the overlap scatter. Other ids and
/// ranks go through the table.
#[derive(Clone, Default)]
pub(crate) struct RankTable {
    /// `(worker id, rank, row)`; `row == u32::MAX` marks an empty slot.
    slots: Vec<(u64, u32, u32)>,
    /// `64 - log2(slots.len())`.
    shift: u32,
    /// Row of rank `r` of worker `id` at `id * dense_ranks + r`
    /// (`u32::MAX`: none), or empty.
    dense: Vec<u32>,
    /// Ranks per worker in `dense` (the largest rank + 1).
    dense_ranks: u32,
}

impl RankTable {
    const EMPTY: u32 = u32::MAX;
    /// Array entries allowed per worker rank (4 bytes each).
    const DENSE_PER_RANK: usize = 4;
    /// Array entries allowed beyond that, for small fleets.
    const DENSE_SLACK: usize = 64;

    fn build(rows: &IdMap<WorkerWithDpRank, u32>) -> Self {
        if rows.is_empty() {
            return RankTable::default();
        }
        let len = (rows.len() * 2).next_power_of_two().max(8);
        let mut t = RankTable {
            slots: vec![(0, 0, Self::EMPTY); len],
            shift: 64 - len.trailing_zeros(),
            dense: Vec::new(),
            dense_ranks: 1,
        };
        for (w, &row) in rows {
            let mask = len - 1;
            let mut i = t.home(*w);
            while t.slots[i].2 != Self::EMPTY {
                i = (i + 1) & mask;
            }
            t.slots[i] = (w.worker_id, w.dp_rank, row);
        }
        let max_id = rows.keys().map(|w| w.worker_id).max().unwrap_or(0);
        let ranks = u64::from(rows.keys().map(|w| w.dp_rank).max().unwrap_or(0)) + 1;
        let bound = rows
            .len()
            .saturating_mul(Self::DENSE_PER_RANK)
            .saturating_add(Self::DENSE_SLACK)
            .min(DenseRows::MAX_LEN) as u64;
        if let Some(len) = max_id
            .checked_add(1)
            .and_then(|w| w.checked_mul(ranks))
            .filter(|&len| len <= bound)
        {
            t.dense = vec![Self::EMPTY; len as usize];
            t.dense_ranks = ranks as u32;
            for (w, &row) in rows {
                t.dense[(w.worker_id * ranks + u64::from(w.dp_rank)) as usize] = row;
            }
        }
        t
    }

    #[inline(always)]
    fn home(&self, w: WorkerWithDpRank) -> usize {
        let k = w.worker_id ^ u64::from(w.dp_rank).rotate_left(32);
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline]
    fn get(&self, w: WorkerWithDpRank) -> Option<usize> {
        let row = self.lookup().row(w);
        (row != Self::EMPTY).then_some(row as usize)
    }

    /// The table as a per-request reader.
    #[inline]
    fn lookup(&self) -> RankLookup<'_> {
        RankLookup {
            dense: DenseRows::new(&self.dense, self.dense_ranks).unwrap_or(DenseRows::none()),
            table: self,
        }
    }

    /// The probe of the open-addressing table; `EMPTY` if `w` has no row.
    fn probe(&self, w: WorkerWithDpRank) -> u32 {
        if self.slots.is_empty() {
            return Self::EMPTY;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(w);
        loop {
            let (id, rank, row) = self.slots[i];
            if row == Self::EMPTY || (id == w.worker_id && rank == w.dp_rank) {
                return row;
            }
            i = (i + 1) & mask;
        }
    }
}

/// Worker rank -> row lookups for one request's overlap entries, with the
/// id-indexed array at hand (see [`RankTable`]).
#[derive(Clone, Copy)]
pub(crate) struct RankLookup<'a> {
    dense: DenseRows<'a>,
    table: &'a RankTable,
}

impl<'a> RankLookup<'a> {
    /// The row of `w`, or `u32::MAX` (above every row) if it has none: a
    /// caller's one bounds check covers both.
    #[inline(always)]
    pub(crate) fn row(&self, w: WorkerWithDpRank) -> u32 {
        match self.dense.row_of(w.worker_id, w.dp_rank) {
            Some(row) => row,
            None => self.table.probe(w),
        }
    }

    /// The id-indexed array (the ranks it covers).
    #[inline(always)]
    pub(crate) fn dense(&self) -> DenseRows<'a> {
        self.dense
    }

    /// The row of a rank the array does not cover, from the table
    /// (`u32::MAX`: none).
    #[inline]
    pub(crate) fn probe(&self, worker_id: u64, dp_rank: u32) -> u32 {
        self.table.probe(WorkerWithDpRank::new(worker_id, dp_rank))
    }
}

/// The row index (see the module docs), holding workers of type `E`.
///
/// Cloned into immutable snapshots for the selection path: a snapshot may
/// be stale, so every row it names is booked with its `SlotId` and a reused
/// row refuses the booking.
pub(crate) struct RowIndex<E> {
    workers: IdMap<WorkerId, Arc<E>>,
    /// Row of each worker rank, stored inline (the overlap scatter looks
    /// one up per overlap entry without touching the worker entries).
    rank_rows: IdMap<WorkerWithDpRank, u32>,
    /// The same as a flat open-addressing table, rebuilt with the masks:
    /// what the overlap scatter reads, a few instructions per entry.
    rank_table: RankTable,
    /// Per worker rank with a row, the layout epoch from which it holds
    /// it (see [`tenure_of`](Self::tenure_of)).
    tenures: IdMap<WorkerWithDpRank, u64>,
    /// Epoch of the row assignment: a fresh number whenever a worker rank
    /// gets or loses a row (see [`layout_epoch`](Self::layout_epoch)).
    layout_epoch: u64,
    /// Per row: the row of its worker's first rank (per-worker load sums).
    leaders: Vec<u32>,
    rows: Vec<Option<RowMeta<E>>>,
    traits: FleetTraits,
    /// Rows of CPU workers (device-aware policy).
    cpu_rows: Vec<u64>,
    /// Rows of workers marked overloaded.
    overloaded_rows: Vec<u64>,
    /// Rows of live workers (the hard filters' starting set), and how many.
    live_rows: Vec<u64>,
    live_count: usize,
    /// Live rows not marked overloaded: the eligible set of a request
    /// without constraints, as a mask and as a sorted list.
    ready_rows: Vec<u64>,
    ready_list: Vec<u32>,
    /// The ready rows are exactly the live rows, there is at least one, no
    /// worker has a busy threshold, and the ready mask covers the scan:
    /// a request without constraints may take them as they are (kept per
    /// change, so the selection path reads one flag).
    ready_exact: bool,
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
    /// Inside a batch of changes: derived data is recomputed once at the end.
    deferred: bool,
}

impl<E> Clone for RowIndex<E> {
    fn clone(&self) -> Self {
        RowIndex {
            workers: self.workers.clone(),
            rank_rows: self.rank_rows.clone(),
            rank_table: self.rank_table.clone(),
            tenures: self.tenures.clone(),
            layout_epoch: self.layout_epoch,
            leaders: self.leaders.clone(),
            rows: self.rows.clone(),
            traits: self.traits,
            cpu_rows: self.cpu_rows.clone(),
            overloaded_rows: self.overloaded_rows.clone(),
            live_rows: self.live_rows.clone(),
            live_count: self.live_count,
            ready_rows: self.ready_rows.clone(),
            ready_list: self.ready_list.clone(),
            ready_exact: self.ready_exact,
            threshold_rows: self.threshold_rows.clone(),
            scan_rows: self.scan_rows,
            retired: self.retired.clone(),
            deferred: self.deferred,
        }
    }
}

impl<E: RowOwner> RowIndex<E> {
    pub(crate) fn new() -> Self {
        RowIndex {
            workers: IdMap::default(),
            rank_rows: IdMap::default(),
            rank_table: RankTable::default(),
            tenures: IdMap::default(),
            layout_epoch: next_layout_epoch(),
            leaders: Vec::new(),
            rows: Vec::new(),
            traits: FleetTraits::default(),
            cpu_rows: Vec::new(),
            overloaded_rows: Vec::new(),
            live_rows: Vec::new(),
            live_count: 0,
            ready_rows: Vec::new(),
            ready_list: Vec::new(),
            ready_exact: false,
            threshold_rows: Vec::new(),
            scan_rows: 0,
            retired: IdMap::default(),
            deferred: false,
        }
    }

    /// Workers with rows.
    pub(crate) fn len(&self) -> usize {
        self.workers.len()
    }

    pub(crate) fn get(&self, worker_id: WorkerId) -> Option<&Arc<E>> {
        self.workers.get(&worker_id)
    }

    pub(crate) fn workers(&self) -> impl Iterator<Item = &Arc<E>> {
        self.workers.values()
    }

    #[inline]
    pub(crate) fn row(&self, row: usize) -> Option<&RowMeta<E>> {
        self.rows.get(row).and_then(Option::as_ref)
    }

    #[inline]
    pub(crate) fn row_of(&self, w: WorkerWithDpRank) -> Option<usize> {
        self.rank_rows.get(&w).map(|&r| r as usize)
    }

    /// The row of `w` through the flat table (the selection path's
    /// lookup; equal to [`row_of`](Self::row_of) outside a batch).
    #[inline]
    pub(crate) fn table_row_of(&self, w: WorkerWithDpRank) -> Option<usize> {
        self.rank_table.get(w)
    }

    /// The flat table as a reader for many lookups in a row (the overlap
    /// scatter's).
    #[inline]
    pub(crate) fn rank_lookup(&self) -> RankLookup<'_> {
        self.rank_table.lookup()
    }

    /// The epoch of the row assignment: it changes whenever a worker rank
    /// gets or loses a row, and never otherwise. Epochs are unique in the
    /// process, so two indexes never share one once either has changed.
    #[inline]
    pub(crate) fn layout_epoch(&self) -> u64 {
        self.layout_epoch
    }

    /// The layout epoch from which `w` holds its row: a rank that leaves
    /// the fleet and comes back, even onto the same row, holds it from a
    /// new epoch.
    #[inline]
    pub(crate) fn tenure_of(&self, w: WorkerWithDpRank) -> Option<u64> {
        self.tenures.get(&w).copied()
    }

    fn index_rank(&mut self, w: WorkerWithDpRank, row: usize) {
        let before = self.rank_rows.insert(w, row as u32);
        if before != Some(row as u32) {
            self.layout_epoch = next_layout_epoch();
        }
        if before.is_none() {
            self.tenures.insert(w, self.layout_epoch);
        }
    }

    fn unindex_rank(&mut self, w: WorkerWithDpRank) {
        if self.rank_rows.remove(&w).is_some() {
            self.tenures.remove(&w);
            self.layout_epoch = next_layout_epoch();
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

    /// Rows of CPU workers, as mask words.
    pub(crate) fn cpu_rows(&self) -> &[u64] {
        &self.cpu_rows
    }

    /// Rows of workers marked overloaded, as mask words.
    pub(crate) fn overloaded_rows(&self) -> &[u64] {
        &self.overloaded_rows
    }

    /// Rows of live workers, as mask words, and their count: what a
    /// selection starts from (kept per change, not read per request).
    #[inline]
    pub(crate) fn live_rows(&self) -> (&[u64], usize) {
        (&self.live_rows, self.live_count)
    }

    /// Live rows not marked overloaded, as mask words and as a sorted list
    /// (the eligible rows of a request without constraints).
    #[inline]
    pub(crate) fn ready_rows(&self) -> (&[u64], &[u32]) {
        (&self.ready_rows, &self.ready_list)
    }

    /// Whether a request without constraints may take the ready rows as
    /// they are: they are exactly the live rows, at least one, no worker
    /// has a busy threshold, and [`ready_rows`](Self::ready_rows)' mask
    /// covers [`scan_rows`](Self::scan_rows).
    #[inline]
    pub(crate) fn ready_exact(&self) -> bool {
        self.ready_exact
    }

    /// Rows of workers with a busy threshold, as mask words.
    pub(crate) fn threshold_rows(&self) -> &[u64] {
        &self.threshold_rows
    }

    /// The rows a selection on this index scans (see the field).
    #[inline]
    pub(crate) fn scan_rows(&self) -> usize {
        self.scan_rows
    }

    /// Puts a worker in the index, with a [`RowMeta`] for each of its rows
    /// (replacing the worker of the same id, if any).
    pub(crate) fn add_rows(&mut self, entry: E) {
        let entry = Arc::new(entry);
        let id = entry.worker_id();
        for &(rank, h) in entry.rows() {
            if self.rows.len() <= h.row {
                self.rows.resize(h.row + 1, None);
            }
            self.rows[h.row] = Some(RowMeta {
                entry: entry.clone(),
                dp_rank: rank,
                handle: h,
            });
            self.index_rank(WorkerWithDpRank::new(id, rank), h.row);
        }
        self.workers.insert(id, entry);
        self.recompute_traits();
    }

    /// Takes a worker out of the worker table; its rows stay until each is
    /// forgotten ([`forget_row`](Self::forget_row)).
    pub(crate) fn remove_worker(&mut self, worker_id: WorkerId) -> Option<Arc<E>> {
        self.workers.remove(&worker_id)
    }

    /// Starts (`true`) or ends a batch of changes: inside one, the masks and
    /// traits are recomputed only when the batch ends.
    pub(crate) fn set_deferred(&mut self, deferred: bool) {
        self.deferred = deferred;
    }

    /// Rebuilds the masks, leaders, scan length and traits from the
    /// workers (not inside a batch).
    pub(crate) fn recompute_traits(&mut self) {
        if self.deferred {
            return;
        }
        let mut t = FleetTraits::default();
        let words = selkie_kernel::mask::words_for(self.rows.len());
        self.cpu_rows.clear();
        self.cpu_rows.resize(words, 0);
        self.leaders.clear();
        self.leaders.resize(self.rows.len(), 0);
        self.threshold_rows.clear();
        self.threshold_rows.resize(words, 0);
        let mut top = 0;
        for (row, m) in self.rows.iter().enumerate() {
            if let Some(m) = m {
                self.leaders[row] = m.entry.rows()[0].1.row as u32;
                top = row + 1;
            }
        }
        self.scan_rows = selkie_kernel::lanes::padded_rows(top);
        self.rank_table = RankTable::build(&self.rank_rows);
        for e in self.workers.values() {
            let wt = e.traits();
            if e.is_cpu() {
                for &(_, h) in e.rows() {
                    self.cpu_rows[h.row / 64] |= 1 << (h.row % 64);
                }
            }
            if wt.thresholds {
                for &(_, h) in e.rows() {
                    self.threshold_rows[h.row / 64] |= 1 << (h.row % 64);
                }
            }
            t = t.union(wt);
        }
        self.traits = t;
        self.recompute_overloaded_rows();
    }

    /// Rebuilds the overloaded-rows mask from the workers' marks, and the
    /// live and ready rows from their states (not inside a batch).
    pub(crate) fn recompute_overloaded_rows(&mut self) {
        if self.deferred {
            return;
        }
        self.overloaded_rows.clear();
        self.overloaded_rows
            .resize(selkie_kernel::mask::words_for(self.rows.len()), 0);
        let words = selkie_kernel::mask::words_for(self.rows.len());
        self.live_rows.clear();
        self.live_rows.resize(words, 0);
        for e in self.workers.values() {
            let live = e.is_live();
            for &(_, h) in e.rows() {
                if e.is_overloaded() {
                    self.overloaded_rows[h.row / 64] |= 1 << (h.row % 64);
                }
                if live {
                    self.live_rows[h.row / 64] |= 1 << (h.row % 64);
                }
            }
        }
        self.live_count = selkie_kernel::mask::count(&self.live_rows, self.rows.len());
        self.ready_rows.clear();
        self.ready_rows
            .extend(self.live_rows.iter().zip(&self.overloaded_rows).map(|(l, o)| l & !o));
        self.ready_list.clear();
        for (i, &w) in self.ready_rows.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                self.ready_list.push((i * 64 + w.trailing_zeros() as usize) as u32);
                w &= w - 1;
            }
        }
        self.ready_exact = !self.traits.thresholds
            && !self.ready_list.is_empty()
            && self.ready_list.len() == self.live_count
            && self.ready_rows.len() >= selkie_kernel::mask::words_for(self.scan_rows);
    }

    /// Rows held now: every indexed rank, and every retired row.
    pub(crate) fn rows_held(&self) -> usize {
        self.workers.values().map(|e| e.rows().len()).sum::<usize>() + self.retired.len()
    }

    /// Rows kept for removed workers (or dropped ranks) until their
    /// bookings end.
    pub(crate) fn retired_rows(&self) -> usize {
        self.retired.len()
    }

    /// Whether `w` has a retired row.
    pub(crate) fn is_retired(&self, w: WorkerWithDpRank) -> bool {
        self.retired.contains_key(&w)
    }

    /// Takes `w`'s retired row back (its counters intact), if it has one.
    pub(crate) fn take_retired(&mut self, w: WorkerWithDpRank) -> Option<RowHandle> {
        self.retired.remove(&w)
    }

    /// Frees the retired rows whose bookings have all ended.
    pub(crate) fn sweep(&mut self, fleet: &HostFleet) {
        self.retired.retain(|w, h| {
            let drained = fleet.is_drained(*h);
            if drained {
                fleet.remove_row(*h);
                tracing::debug!(worker = %w, row = h.row, "retired row freed");
            }
            !drained
        });
    }

    /// Gives up a row of `worker_id`'s `rank` (already forgotten, or never
    /// indexed): retired while a booking holds load on it, freed otherwise.
    /// The row is cordoned first, so no booking can start on it between the
    /// check and the removal.
    pub(crate) fn release_row(&mut self, fleet: &HostFleet, worker_id: WorkerId, rank: DpRank, h: RowHandle) {
        fleet.retire_row(h);
        if fleet.is_drained(h) {
            fleet.remove_row(h);
        } else {
            self.retired.insert(WorkerWithDpRank::new(worker_id, rank), h);
        }
    }

    /// Drops a row from the index's tables (not from the fleet).
    pub(crate) fn forget_row(&mut self, worker_id: WorkerId, rank: DpRank, h: RowHandle) {
        if let Some(slot) = self.rows.get_mut(h.row) {
            *slot = None;
        }
        self.unindex_rank(WorkerWithDpRank::new(worker_id, rank));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flat table (with or without its id-indexed array) answers
    /// exactly as the map it was built from, for present and absent ranks.
    #[test]
    fn the_rank_table_answers_as_its_map() {
        let fleets: [Vec<(u64, u32)>; 4] = [
            // Small ids, one rank each: the array holds every worker.
            (0..100).map(|id| (id, 0)).collect(),
            // Small ids with data-parallel ranks (ranks > 0 are probed).
            (0..40).flat_map(|id| (0..3).map(move |r| (id * 2, r))).collect(),
            // Ids too spread out for the array.
            (0..50).map(|id| (id * 1_000_003 + 7, id as u32 % 2)).collect(),
            // Small ids, none of them with a rank 0.
            (0..20).map(|id| (id, 1)).collect(),
        ];
        for (f, ranks) in fleets.iter().enumerate() {
            let mut map = IdMap::default();
            for (row, &(id, rank)) in ranks.iter().enumerate() {
                map.insert(WorkerWithDpRank::new(id, rank), (row * 3 + 1) as u32);
            }
            let table = RankTable::build(&map);
            let near = ranks.iter().flat_map(|r| [r.0, r.0 + 1]);
            for id in (0..300).chain(near).chain([u64::MAX, u64::from(u32::MAX) + 1]) {
                for rank in 0..4 {
                    let w = WorkerWithDpRank::new(id, rank);
                    assert_eq!(table.get(w), map.get(&w).map(|&r| r as usize), "fleet {f}: {w:?}");
                }
            }
        }
        let mut map = IdMap::default();
        map.insert(WorkerWithDpRank::new(5, 0), 9);
        assert!(!RankTable::build(&map).dense.is_empty(), "a small id uses the array");
        map.insert(WorkerWithDpRank::new(1 << 40, 0), 10);
        assert!(RankTable::build(&map).dense.is_empty(), "a large id does not");
    }
}
