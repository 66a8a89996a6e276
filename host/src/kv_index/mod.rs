//! The KV index: engine KV cache events in, per-row prefix overlaps out.
//!
//! Engines report which KV blocks each worker rank holds ([`KvEvent`]:
//! blocks stored under a parent, blocks removed, everything cleared, per
//! storage tier). For each request the index answers, for every row of the
//! selection service, how many of the request's leading blocks the row's
//! rank holds on device, then how many more in host memory, then on disk
//! (Dynamo's tiered overlaps), written straight into the per-row columns the
//! service reads ([`RowOverlaps`](crate::RowOverlaps)).
//!
//! # Feeding events and querying
//!
//! ```
//! use selkie::kv_index::{KvBlockHasher, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
//! use selkie::*;
//!
//! let service = WorkerSelectionService::new(
//!     WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
//!     ServiceConfig::default(),
//! );
//! service.add_worker(WorkerRecord::new(1))?;
//! service.add_worker(WorkerRecord::new(2))?;
//! let hasher = KvBlockHasher::new(16);
//! let mut index = KvIndex::new(16);
//!
//! // Worker 2 reports that it stored the four blocks of a prompt (engine
//! // hashes 100..104; the local hashes are the router's).
//! let prompt: Vec<u32> = (0..64).collect();
//! let mut local = Vec::new();
//! hasher.local_hashes(&prompt, &mut local);
//! let blocks: Vec<StoredBlock> = (100..)
//!     .zip(&local)
//!     .map(|(block_hash, &tokens_hash)| StoredBlock { block_hash, tokens_hash })
//!     .collect();
//! let stored = KvEventData::Stored { parent: None, blocks: &blocks };
//! index.apply(&KvEvent::new(WorkerWithDpRank::new(2, 0), 0, stored))?;
//!
//! // Per request: bring the index to the service's rows (cheap when they
//! // did not change), query, select.
//! let mut overlaps = KvOverlaps::new();
//! index.sync_rows(service.row_layout(), |rank| service.row_of(rank));
//! let columns = index.overlaps_for_tokens(&hasher, &prompt, &mut overlaps)?;
//! let row = service.row_of(WorkerWithDpRank::new(2, 0)).unwrap();
//! assert_eq!(columns.device_blocks[row], 4.0);
//! let request = SelectionRequest::new(prompt.len()).with_row_overlaps(columns);
//! assert_eq!(service.select(&request)?.worker(), WorkerWithDpRank::new(2, 0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Semantics
//!
//! * A block is known by its *sequence hash* (see [`KvBlockHasher`]): the
//!   index derives it from the parent's and the stored block's local hash,
//!   so a request's hashes computed by the router meet the blocks engines
//!   report. Two prefixes whose 64-bit sequence hashes collide are
//!   indistinguishable (odds about `n² / 2⁶⁵` for `n` distinct blocks).
//! * Every worker rank is independent. A store under a parent the rank does
//!   not hold (in the device tier for a device store, in any tier for a
//!   host or disk store) is refused whole ([`KvEventError::UnknownParent`]);
//!   storing a block the rank holds changes nothing; a removal with some
//!   unknown blocks removes the others and reports the rest
//!   ([`KvEventError::UnknownBlocks`]); [`KvEventData::Cleared`] clears only
//!   its own rank and tier. In the device tier these are the answers of
//!   Dynamo's `RadixTree`. Dynamo's lower-tier indexers accept a host or
//!   disk store under a parent the rank does not hold; this index refuses
//!   it, since without the parent the block's place in the sequence is
//!   unknown.
//! * A rank's overlap is exact per block: the number of leading request
//!   blocks it holds on device, then the blocks after those it holds in
//!   host memory, then the blocks after those on disk. A first-block miss
//!   scores nothing. Deliberately unlike Dynamo's `RadixTree`, removing a
//!   block in the middle of a stored run does not forget the rank's later
//!   blocks of that run: they stop counting while the removed block is
//!   missing and count again once it is stored again, as the engine still
//!   holds them (the `RadixTree` under-credits them until they are stored
//!   again; without middle removals the two agree on every query).
//! * Event ids are per rank and consecutive. A gap (an event lost, or
//!   events reordered) drops every block of the rank, since the index can
//!   no longer know them, reports [`KvEventError::EventGap`] and applies the
//!   event to the empty rank; an id at or below the last one applied is
//!   ignored ([`KvEventError::StaleEvent`]). A rank's first event may have
//!   any id. Both are counted in [`KvIndexStats`] and in the
//!   `selkie_kv_events_total` counter (label `outcome`).
//!
//! # Rows
//!
//! Blocks are kept per row of the service, not per worker, so a query
//! writes columns without looking a worker up. [`KvIndex::sync_rows`] takes
//! the service's [`RowLayout`] and its `row_of`: when the layout's epoch
//! changed, every rank is placed again; a rank that had a row and has none
//! any more (its worker left the fleet) is dropped with its blocks, so a
//! row given to another worker never inherits them. Ranks whose events
//! arrive before their worker joins the fleet are kept aside and placed
//! once they get a row; a rank's blocks count from the first
//! [`KvIndex::sync_rows`] after its first event, so a router syncs before
//! every query (when the layout did not change, a sync only places the
//! ranks first seen since the last one).
//! [`KvIndex::remove_worker`] drops a worker's ranks at once.
//!
//! # Memory
//!
//! Unbounded by default; [`KvIndex::with_max_blocks`] bounds the blocks
//! held (summed over ranks), evicting the blocks stored longest ago first
//! and counting them in [`KvIndexStats::evicted_blocks`] and in the
//! `selkie_kv_evicted_blocks_total` counter.
//! [`KvIndex::with_block_capacity`] reserves the block table for the
//! distinct blocks a fleet caches, so that ingestion never stops to grow
//! it ([`ApproxKvIndex::with_block_capacity`] likewise); [`shared_with`]
//! builds a shared index from copies configured so.
//!
//! # Concurrency
//!
//! A [`KvIndex`] is a plain single-writer structure: events take
//! `&mut self`, queries `&self` and a caller-owned [`KvOverlaps`]. For a
//! router whose queries must never wait for ingestion, [`shared`] keeps the
//! index twice: one [`KvIndexWriter`] applies events to one copy and
//! publishes it, any number of [`KvIndexReader`]s query the other; a query
//! enters and leaves its copy with one atomic read-modify-write each and
//! never waits. The protocol is model-checked with loom, with three broken
//! variants that the models catch.
//!
//! # Without engine events
//!
//! For engines that publish no KV events, [`ApproxKvIndex`] learns from the
//! router's own decisions instead (Dynamo's approximate mode): each choice
//! is recorded as the chosen rank holding the prompt's blocks, forgotten a
//! time to live (120 s by default) after it was last recorded.
//!
//! This module must not import the service or the policies: it speaks
//! rows and [`RowOverlaps`](crate::RowOverlaps) only.

mod approx;
mod block_rows;
mod event;
mod hash;
mod query;
mod rows;
mod shared;
mod table;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

pub use approx::{ApproxKvIndex, DEFAULT_APPROX_TTL};
pub use event::{KvEvent, KvEventData, KvEventError, KvQueryError, StorageTier, StoredBlock};
pub use hash::{next_sequence_hash, sequence_hashes_of, KvBlockHasher, KV_HASH_SEED};
pub use query::KvOverlaps;
pub use shared::{shared, shared_bounded, shared_with, KvIndexReader, KvIndexWriter};

use crate::request::RowLayout;
use crate::types::{WorkerId, WorkerWithDpRank};
use block_rows::BlockRows;
use rows::MAX_ROWS;
use table::HashIndex;

/// Blocks of a stored run whose table slots (the rank's and the block
/// table's) are asked into cache before any of them is applied.
const PREFETCH_STRIDE: usize = 16;

/// Blocks a rank's table has room for from its first stored run on (256
/// slots, 6 KiB). An engine reports its cache a request's run at a time and
/// a rank that reports anything soon holds hundreds of blocks: growing a
/// table through 64 and 128 slots to get there cost about a tenth of a
/// fleet's ingestion. A rank that never stores more keeps the 6 KiB. Where
/// the fleet's ranks already hold more on average, a new rank's first run
/// makes room for that average instead: engines of one fleet have caches
/// of one size, and a rank that reports its first blocks after its peers
/// (a new worker, a restarted one) soon holds what they hold.
const RANK_FIRST_ROOM: usize = 200;

/// A map keyed by worker ranks, with rustc's Fx hash (one multiply per key
/// word): worker ids come from the fleet's own engines, not from clients.
type RankMap<V> = rustc_hash::FxHashMap<WorkerWithDpRank, V>;

/// A block a rank holds: its sequence hash, the tiers it is in and when
/// the rank last stored it (a store counter, for eviction), the last two
/// packed in one word (16 bytes in all: the per-rank tables hold one per
/// block per rank).
#[derive(Clone, Copy, Debug, Default)]
struct HeldBlock {
    sequence: u64,
    /// `stored_at << 3 | tiers`.
    stamp: u64,
}

impl HeldBlock {
    fn new(sequence: u64, tiers: u8, stored_at: u64) -> Self {
        HeldBlock {
            sequence,
            stamp: stored_at << 3 | u64::from(tiers),
        }
    }

    fn tiers(&self) -> u8 {
        (self.stamp & 7) as u8
    }

    fn set_tiers(&mut self, tiers: u8) {
        self.stamp = self.stamp & !7 | u64::from(tiers);
    }

    /// The store counter when the rank last stored the block (61 bits: at
    /// a billion stores a second, 73 years).
    fn stored_at(&self) -> u64 {
        self.stamp >> 3
    }

    fn set_stored_at(&mut self, stored_at: u64) {
        self.stamp = stored_at << 3 | (self.stamp & 7);
    }
}

/// One worker rank's view: its row and its blocks by engine hash.
#[derive(Debug, Default)]
struct RankBlocks {
    /// The rank's row in the synced layout.
    row: Option<u32>,
    /// Whether the rank ever had a row (losing it means leaving the fleet).
    had_row: bool,
    /// The last event id applied.
    last_event: Option<u64>,
    /// Engine hash -> block: a dense table (grown past 7/8 full), as only
    /// events read it; 25 bytes per slot (a 24-byte entry and its control
    /// byte), one entry per block the rank holds.
    blocks: HashIndex<HeldBlock, true>,
}

/// Counts of what the index did, since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvIndexStats {
    /// Events applied in full.
    pub events_applied: u64,
    /// Stores refused whole: parent not held.
    pub unknown_parent: u64,
    /// Stores refused whole: a block is its own parent.
    pub self_parent: u64,
    /// Removals that named blocks the rank did not hold.
    pub unknown_blocks: u64,
    /// Event-id gaps (each dropped a rank's blocks).
    pub event_gaps: u64,
    /// Stale events ignored.
    pub stale_events: u64,
    /// Ranks dropped because their worker left the fleet or was removed.
    pub ranks_removed: u64,
    /// Blocks evicted, coldest first, to stay within the configured bound
    /// ([`KvIndex::with_max_blocks`]).
    pub evicted_blocks: u64,
}

/// Cached handles of `selkie_kv_events_total` (building a metric key per
/// event would cost more than applying most events).
struct EventCounters {
    applied: metrics::Counter,
    unknown_parent: metrics::Counter,
    self_parent: metrics::Counter,
    unknown_blocks: metrics::Counter,
    event_gap: metrics::Counter,
    stale_event: metrics::Counter,
    evicted: metrics::Counter,
}

impl EventCounters {
    fn new() -> Self {
        let c = |outcome: &'static str| metrics::counter!("selkie_kv_events_total", "outcome" => outcome);
        EventCounters {
            applied: c("applied"),
            unknown_parent: c("unknown_parent"),
            self_parent: c("self_parent"),
            unknown_blocks: c("unknown_blocks"),
            event_gap: c("event_gap"),
            stale_event: c("stale_event"),
            evicted: metrics::counter!("selkie_kv_evicted_blocks_total"),
        }
    }
}

/// Which rows hold which KV blocks, fed by engine events (see the module
/// documentation).
pub struct KvIndex {
    block_size: u32,
    /// Sequence hash -> rows holding the block.
    blocks: BlockRows,
    ranks: RankMap<RankBlocks>,
    /// Ranks first seen since the last [`sync_rows`](Self::sync_rows).
    unplaced: Vec<WorkerWithDpRank>,
    layout: Option<RowLayout>,
    stats: KvIndexStats,
    counters: EventCounters,
    /// Blocks held, summed over ranks, and the most allowed.
    held: usize,
    max_blocks: usize,
    /// Stores so far (the clock of `stored_at`).
    stores: u64,
    /// `(stored_at, rank, engine hash)` of stores, oldest first, while the
    /// index is bounded; entries whose block was stored again since, or is
    /// gone, are skipped.
    coldest: VecDeque<(u64, WorkerWithDpRank, u64)>,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("block_size", &self.block_size)
            .field("blocks", &self.blocks.len())
            .field("ranks", &self.ranks.len())
            .field("layout", &self.layout)
            .field("stats", &self.stats)
            .finish()
    }
}

impl KvIndex {
    /// An empty index for blocks of `block_size` tokens (the size only
    /// turns device blocks into the cached-token estimate of a query).
    pub fn new(block_size: u32) -> Self {
        KvIndex {
            block_size,
            blocks: BlockRows::default(),
            ranks: RankMap::default(),
            unplaced: Vec::new(),
            layout: None,
            stats: KvIndexStats::default(),
            counters: EventCounters::new(),
            held: 0,
            max_blocks: usize::MAX,
            stores: 0,
            coldest: VecDeque::new(),
        }
    }

    /// Bounds the blocks the index holds (a block held by two ranks counts
    /// twice): past `max_blocks`, the blocks stored longest ago go first,
    /// counted in [`KvIndexStats::evicted_blocks`] and in the
    /// `selkie_kv_evicted_blocks_total` counter. An evicted block is
    /// forgotten as if removed: it and (until it is stored again) the
    /// rank's blocks after it stop counting, a store under it is refused
    /// and a removal of it reports it unknown.
    pub fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks;
        self
    }

    /// Makes room in the block table for `blocks` distinct blocks, as
    /// `HashMap::with_capacity` does: up to there the table never grows.
    /// An index that grows to its size instead doubles its table as it
    /// fills, each time moving every block into a new table that starts
    /// cold in cache, inside the event that filled it (from 65,536 to
    /// 131,072 slots, a third of a millisecond on a current server core);
    /// a router that knows how many blocks its fleet caches (the engines'
    /// KV capacity summed over ranks bounds the distinct blocks) reserves
    /// them here. The memory is taken now: 16 bytes a slot, the smallest
    /// power of two of slots that holds `blocks` at 4/5 full (what the
    /// table grown to that size would take).
    ///
    /// # Panics
    /// "capacity overflow" where no table could hold `blocks` (as
    /// `HashMap::with_capacity`; a table too large for memory aborts the
    /// allocation, as the standard collections do).
    ///
    /// ```
    /// use selkie::kv_index::KvIndex;
    ///
    /// let index = KvIndex::new(16).with_block_capacity(100_000);
    /// assert!(index.heap_bytes() >= 100_000 * 16);
    /// assert_eq!(index.block_count(), 0);
    /// ```
    pub fn with_block_capacity(mut self, blocks: usize) -> Self {
        self.blocks.reserve(blocks);
        self
    }

    /// Blocks held, summed over ranks (the quantity
    /// [`with_max_blocks`](Self::with_max_blocks) bounds).
    pub fn held_blocks(&self) -> usize {
        self.held
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The layout the index last synced to.
    pub fn row_layout(&self) -> Option<RowLayout> {
        self.layout
    }

    /// What the index did so far.
    pub fn stats(&self) -> KvIndexStats {
        self.stats
    }

    /// Distinct blocks (sequence hashes) some placed rank holds.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Worker ranks the index tracks.
    pub fn rank_count(&self) -> usize {
        self.ranks.len()
    }

    /// Blocks `worker` holds in `tier`.
    pub fn rank_blocks(&self, worker: WorkerWithDpRank, tier: StorageTier) -> usize {
        self.ranks.get(&worker).map_or(0, |r| {
            r.blocks.iter().filter(|(_, b)| b.tiers() & tier.bit() != 0).count()
        })
    }

    /// Heap bytes of the block-to-rows table and the per-rank tables, as
    /// allocated (an estimate: the fingerprint table's control bytes are
    /// counted one per slot, the rank table is left out).
    pub fn heap_bytes(&self) -> usize {
        self.blocks.heap_bytes() + self.ranks.values().map(|r| r.blocks.heap_bytes()).sum::<usize>()
    }

    /// Places the index on the service's rows: `layout` from
    /// [`WorkerSelectionService::row_layout`](crate::WorkerSelectionService::row_layout)
    /// and `row_of` answering as
    /// [`WorkerSelectionService::row_of`](crate::WorkerSelectionService::row_of)
    /// (read the layout first). When the layout is the one already synced,
    /// only ranks first seen since are placed; otherwise every rank is, and
    /// a rank that lost its row is dropped with its blocks.
    pub fn sync_rows(&mut self, layout: RowLayout, mut row_of: impl FnMut(WorkerWithDpRank) -> Option<usize>) {
        let row = |r: Option<usize>| r.filter(|&r| r < MAX_ROWS).map(|r| r as u32);
        if self.layout == Some(layout) {
            for rank in std::mem::take(&mut self.unplaced) {
                let new = row(row_of(rank));
                self.place(rank, new);
            }
            return;
        }
        self.layout = Some(layout);
        self.unplaced.clear();
        let moves: Vec<(WorkerWithDpRank, Option<u32>)> = self
            .ranks
            .iter()
            .map(|(&rank, state)| (rank, row(row_of(rank)), state.row))
            .filter(|&(_, new, old)| new != old)
            .map(|(rank, new, _)| (rank, new))
            .collect();
        // Take every moving rank off its old row before any takes a new one:
        // a row may pass from one rank to another in the same change.
        for &(rank, _) in &moves {
            self.unindex_rank(rank);
        }
        for (rank, new) in moves {
            self.place(rank, new);
        }
    }

    /// Drops every rank of `worker_id` and its blocks (the worker left the
    /// fleet); returns how many ranks were dropped.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        let ranks: Vec<WorkerWithDpRank> = self
            .ranks
            .keys()
            .filter(|r| r.worker_id == worker_id)
            .copied()
            .collect();
        for &rank in &ranks {
            self.unindex_rank(rank);
            if let Some(state) = self.ranks.remove(&rank) {
                self.held -= state.blocks.len();
            }
            self.stats.ranks_removed += 1;
        }
        self.unplaced.retain(|r| r.worker_id != worker_id);
        ranks.len()
    }

    /// Applies one event (see the module documentation for what is refused
    /// and why). On an error the index is still consistent: the error says
    /// what was and was not applied.
    pub fn apply(&mut self, event: &KvEvent<'_>) -> Result<(), KvEventError> {
        self.apply_reporting(event, true)
    }

    /// [`apply`](Self::apply), reporting through `metrics` and `tracing`
    /// only if `report` (a second copy replaying an event reports nothing).
    fn apply_reporting(&mut self, event: &KvEvent<'_>, report: bool) -> Result<(), KvEventError> {
        let rank = event.worker;
        let (worker_id, dp_rank, event_id) = (rank.worker_id, rank.dp_rank, event.event_id);
        let state = match self.ranks.get_mut(&rank) {
            Some(state) => state,
            None => {
                self.unplaced.push(rank);
                self.ranks.entry(rank).or_default()
            }
        };
        let held_before = state.blocks.len();
        let mut gap = None;
        if let Some(last) = state.last_event {
            if event_id <= last {
                self.stats.stale_events += 1;
                if report {
                    self.counters.stale_event.increment(1);
                }
                return Err(KvEventError::StaleEvent {
                    worker_id,
                    dp_rank,
                    event_id,
                    last,
                });
            }
            if event_id != last + 1 {
                gap = Some(KvEventError::EventGap {
                    worker_id,
                    dp_rank,
                    event_id,
                    last,
                    missing: event_id - last - 1,
                });
            }
        }
        state.last_event = Some(event_id);
        if gap.is_some() {
            self.clear_rank(rank, 0b111);
            self.stats.event_gaps += 1;
            if report {
                self.counters.event_gap.increment(1);
            }
        }
        let outcome = match event.data {
            KvEventData::Stored { parent, blocks } => self.store(rank, event, parent, blocks),
            KvEventData::Removed { blocks } => self.remove(rank, event, blocks),
            KvEventData::Cleared => {
                self.clear_rank(rank, event.tier.bit());
                Ok(())
            }
        };
        let held_after = self.ranks.get(&rank).map_or(0, |s| s.blocks.len());
        self.held = self.held + held_after - held_before;
        self.evict_coldest(report);
        match &outcome {
            Ok(()) => self.stats.events_applied += 1,
            Err(KvEventError::UnknownParent { .. }) => self.stats.unknown_parent += 1,
            Err(KvEventError::SelfParent { .. }) => self.stats.self_parent += 1,
            Err(_) => self.stats.unknown_blocks += 1,
        }
        if report {
            let counter = match &outcome {
                Ok(()) => &self.counters.applied,
                Err(KvEventError::UnknownParent { .. }) => &self.counters.unknown_parent,
                Err(KvEventError::SelfParent { .. }) => &self.counters.self_parent,
                Err(_) => &self.counters.unknown_blocks,
            };
            counter.increment(1);
            if let Err(e) = &outcome {
                tracing::debug!(error = %e, "KV event refused in whole or in part");
            }
            if let Some(gap) = &gap {
                tracing::warn!(error = %gap, "KV event gap");
            }
        }
        match gap {
            Some(gap) => Err(gap),
            None => outcome,
        }
    }

    fn store(
        &mut self,
        rank: WorkerWithDpRank,
        event: &KvEvent<'_>,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), KvEventError> {
        let (worker_id, dp_rank, event_id) = (rank.worker_id, rank.dp_rank, event.event_id);
        let tier = event.tier.bit();
        let rows = self.layout.map_or(0, |l| l.rows);
        // What the other ranks hold, and how many they are (read only while
        // this one holds nothing, so counts nothing in `held`).
        let (peers_hold, peers) = (self.held, self.ranks.len() - 1);
        let state = self.ranks.get_mut(&rank).expect("the rank was created by apply");
        if let Some(parent) = parent {
            if blocks.iter().any(|b| b.block_hash == parent) {
                return Err(KvEventError::SelfParent {
                    worker_id,
                    dp_rank,
                    event_id,
                    parent,
                });
            }
        }
        let mut chain = match parent {
            None => None,
            Some(parent) => {
                let needed = if event.tier == StorageTier::Device { tier } else { 0b111 };
                match state.blocks.get(parent) {
                    Some(held) if held.tiers() & needed != 0 => Some(held.sequence),
                    _ => {
                        return Err(KvEventError::UnknownParent {
                            worker_id,
                            dp_rank,
                            event_id,
                            parent,
                            blocks: blocks.len(),
                        })
                    }
                }
            }
        };
        // One growth of the rank's table for the whole run, if any; on the
        // first, room for a few runs at once, or for what its peers hold.
        let first_run = if state.blocks.len() == 0 && !blocks.is_empty() {
            RANK_FIRST_ROOM.max(peers_hold / peers.max(1))
        } else {
            0
        };
        state.blocks.reserve(blocks.len().max(first_run));
        // The run in strides: first every block's sequence hash, with its
        // slots in the rank's table and the block table asked into cache,
        // then the blocks applied, so that the tables' cache misses overlap
        // instead of coming one after another.
        let mut sequences = [0u64; PREFETCH_STRIDE];
        for stride in blocks.chunks(PREFETCH_STRIDE) {
            for (block, slot) in stride.iter().zip(&mut sequences) {
                let sequence = chain.map_or(block.tokens_hash, |p| next_sequence_hash(p, block.tokens_hash));
                chain = Some(sequence);
                *slot = sequence;
                state.blocks.prefetch(block.block_hash);
                if state.row.is_some() {
                    self.blocks.prefetch(sequence);
                }
            }
            // The stride's blocks this rank now holds in `tier`, put on its
            // row together (in order, before any removal that follows them).
            let (mut fresh, mut fresh_len) = ([0u64; PREFETCH_STRIDE], 0);
            for (block, &sequence) in stride.iter().zip(&sequences) {
                let held = state
                    .blocks
                    .get_or_insert(block.block_hash, HeldBlock::new(sequence, 0, 0));
                if self.max_blocks != usize::MAX {
                    held.set_stored_at(self.stores);
                    self.coldest.push_back((self.stores, rank, block.block_hash));
                    self.stores += 1;
                }
                if held.sequence != sequence {
                    // The engine reused a hash for another block: the old one is gone.
                    if let Some(row) = state.row {
                        self.blocks.insert_all(&fresh[..fresh_len], row, tier, rows);
                        fresh_len = 0;
                        for t in [rows::DEVICE, rows::HOST, rows::DISK] {
                            if held.tiers() & t != 0 {
                                self.blocks.remove(held.sequence, row, t);
                            }
                        }
                    }
                    *held = HeldBlock::new(sequence, 0, held.stored_at());
                }
                if held.tiers() & tier == 0 {
                    held.set_tiers(held.tiers() | tier);
                    if state.row.is_some() {
                        fresh[fresh_len] = sequence;
                        fresh_len += 1;
                    }
                }
            }
            if let Some(row) = state.row {
                self.blocks.insert_all(&fresh[..fresh_len], row, tier, rows);
            }
        }
        Ok(())
    }

    fn remove(&mut self, rank: WorkerWithDpRank, event: &KvEvent<'_>, hashes: &[u64]) -> Result<(), KvEventError> {
        let tier = event.tier.bit();
        let state = self.ranks.get_mut(&rank).expect("the rank was created by apply");
        let (mut unknown, mut first) = (0usize, None);
        for &hash in hashes {
            match state.blocks.get_mut(hash) {
                Some(held) if held.tiers() & tier != 0 => {
                    held.set_tiers(held.tiers() & !tier);
                    let sequence = held.sequence;
                    if held.tiers() == 0 {
                        state.blocks.remove(hash);
                    }
                    if let Some(row) = state.row {
                        self.blocks.remove(sequence, row, tier);
                    }
                }
                _ => {
                    unknown += 1;
                    first.get_or_insert(hash);
                }
            }
        }
        match first {
            None => Ok(()),
            Some(first) => Err(KvEventError::UnknownBlocks {
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                event_id: event.event_id,
                tier: event.tier,
                unknown,
                first,
            }),
        }
    }

    /// Drops the rank's blocks in the tiers of `tiers` (bits).
    fn clear_rank(&mut self, rank: WorkerWithDpRank, tiers: u8) {
        let Some(state) = self.ranks.get_mut(&rank) else { return };
        let row = state.row;
        state.blocks.retain(|_, held| {
            if let Some(row) = row {
                for t in [rows::DEVICE, rows::HOST, rows::DISK] {
                    if held.tiers() & tiers & t != 0 {
                        self.blocks.remove(held.sequence, row, t);
                    }
                }
            }
            held.set_tiers(held.tiers() & !tiers);
            held.tiers() != 0
        });
    }

    /// Takes the rank's blocks off its row (the rank keeps them).
    fn unindex_rank(&mut self, rank: WorkerWithDpRank) {
        let Some(state) = self.ranks.get_mut(&rank) else { return };
        let Some(row) = state.row.take() else { return };
        for (_, held) in state.blocks.iter() {
            for t in [rows::DEVICE, rows::HOST, rows::DISK] {
                if held.tiers() & t != 0 {
                    self.blocks.remove(held.sequence, row, t);
                }
            }
        }
    }

    /// Evicts the blocks stored longest ago until at most `max_blocks` are
    /// held.
    fn evict_coldest(&mut self, report: bool) {
        while self.held > self.max_blocks {
            let Some((stored_at, rank, hash)) = self.coldest.pop_front() else {
                break;
            };
            let Some(state) = self.ranks.get_mut(&rank) else {
                continue;
            };
            if state.blocks.get(hash).is_none_or(|h| h.stored_at() != stored_at) {
                continue; // stored again since, or gone
            }
            let held = state.blocks.remove(hash).expect("just seen");
            if let Some(row) = state.row {
                for t in [rows::DEVICE, rows::HOST, rows::DISK] {
                    if held.tiers() & t != 0 {
                        self.blocks.remove(held.sequence, row, t);
                    }
                }
            }
            self.held -= 1;
            self.stats.evicted_blocks += 1;
            if report {
                self.counters.evicted.increment(1);
            }
        }
        // Skipped entries pile up when blocks are stored again or removed:
        // rebuild the queue from the blocks held once it is twice too long.
        if self.max_blocks != usize::MAX && self.coldest.len() > 2 * self.held + 1024 {
            let mut live: Vec<(u64, WorkerWithDpRank, u64)> = self
                .ranks
                .iter()
                .flat_map(|(&rank, state)| state.blocks.iter().map(move |(hash, h)| (h.stored_at(), rank, hash)))
                .collect();
            live.sort_unstable_by_key(|e| e.0);
            self.coldest = live.into();
        }
    }

    /// Puts an unplaced rank on `row`, or drops it if it had a row before
    /// and has none now.
    fn place(&mut self, rank: WorkerWithDpRank, row: Option<u32>) {
        let rows = self.layout.map_or(0, |l| l.rows);
        let Some(state) = self.ranks.get_mut(&rank) else { return };
        debug_assert!(state.row.is_none(), "placing a placed rank");
        match row {
            Some(row) => {
                state.row = Some(row);
                state.had_row = true;
                // Device blocks a stride at a time (their slots in the block
                // table asked into cache, then put on the row together);
                // the lower tiers block by block.
                let (mut device, mut n) = ([0u64; PREFETCH_STRIDE], 0);
                for (_, held) in state.blocks.iter() {
                    if held.tiers() & rows::DEVICE != 0 {
                        self.blocks.prefetch(held.sequence);
                        device[n] = held.sequence;
                        n += 1;
                        if n == PREFETCH_STRIDE {
                            self.blocks.insert_all(&device, row, rows::DEVICE, rows);
                            n = 0;
                        }
                    }
                    for t in [rows::HOST, rows::DISK] {
                        if held.tiers() & t != 0 {
                            self.blocks.insert(held.sequence, row, t, rows);
                        }
                    }
                }
                self.blocks.insert_all(&device[..n], row, rows::DEVICE, rows);
            }
            None if state.had_row => {
                self.held -= state.blocks.len();
                self.ranks.remove(&rank);
                self.stats.ranks_removed += 1;
            }
            None => {}
        }
    }
}
