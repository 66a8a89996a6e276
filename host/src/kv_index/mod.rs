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
//! index.sync_rows(service.row_layout(), |rank| service.rank_row(rank))?;
//! let columns = index.overlaps_for_tokens(&hasher, &prompt, &mut overlaps)?;
//! let row = service.row_of(WorkerWithDpRank::new(2, 0)).unwrap();
//! assert_eq!(columns.device_blocks[row], 4.0);
//! let request = SelectionRequest::new(prompt.len()).with_row_overlaps(columns);
//! assert_eq!(service.select(&request)?.worker(), WorkerWithDpRank::new(2, 0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # One block size
//!
//! The service's block size ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size),
//! 16 by default) is the one source: build the index and the hasher with
//! it (`KvIndex::new(service.config().block_size)`). Each checks it where
//! it meets the other, before any overlap is counted in the wrong blocks:
//!
//! * [`KvIndex::sync_rows`] takes the service's [`RowLayout`], which
//!   carries the service's block size, and refuses a layout whose block
//!   size is not the index's ([`KvQueryError::BlockSizeMismatch`]);
//! * [`KvIndex::overlaps_for_tokens`] (and [`ApproxKvIndex::record_tokens`])
//!   refuse a [`KvBlockHasher`] of another block size
//!   ([`KvQueryError::HasherBlockSize`]).
//!
//! Queries by hashes ([`KvIndex::overlaps`],
//! [`KvIndex::overlaps_for_local_hashes`]) take the hashes as given: hash
//! them with a hasher of the index's block size.
//!
//! # Semantics
//!
//! * A block is known by its *sequence hash* (see [`KvBlockHasher`]): the
//!   index derives it from the parent's and the stored block's local hash,
//!   so a request's hashes computed by the router meet the blocks engines
//!   report. Two prefixes whose 64-bit sequence hashes collide are
//!   indistinguishable (odds about `n² / 2⁶⁵` for `n` distinct blocks).
//! * Events name blocks by the engine's hash. Every worker rank is
//!   independent. A store under a parent the rank does not hold in any tier
//!   is refused whole ([`KvEventError::UnknownParent`]); a removal with
//!   some unknown blocks removes the others and reports the rest
//!   ([`KvEventError::UnknownBlocks`]); [`KvEventData::Cleared`] clears
//!   only its own rank and tier.
//! * References are counted as engines make them. A block stored again
//!   while the rank holds it in that tier is one copy more (vLLM does not
//!   de-duplicate its cache: two requests that compute the same block hold
//!   two copies, each stored and each removed with its own event): it is
//!   held until removed as many times as stored, and a removal naming a
//!   hash three times removes three copies. Two engine hashes may name one
//!   sequence hash (an engine that keys blocks by more than the router
//!   hashes): the rank holds the block while either does. An engine hash
//!   stored under another sequence hash than before names a new block: the
//!   old one is gone, every copy.
//! * A rank's overlap is exact per block: the number of leading request
//!   blocks it holds on device, then the blocks after those it holds in
//!   host memory, then the blocks after those on disk; a block held in
//!   several tiers counts in the first of them the walk is in. A
//!   first-block miss scores nothing. Deliberately unlike Dynamo's
//!   `RadixTree`, removing a block in the middle of a stored run does not
//!   forget the rank's later blocks of that run: they stop counting while
//!   the removed block is missing and count again once it is stored again,
//!   as the engine still holds them (the `RadixTree` under-credits them
//!   until they are stored again; without middle removals the two agree on
//!   every query).
//!
//! ## Storage tiers
//!
//! Engines offload blocks to host memory or disk and load them back
//! (vLLM's `medium` is `"GPU"` or `"CPU"`), and the events of two tiers are
//! not ordered against each other: a device block's parent may be reported
//! in host memory only, for a while or for good. So a store chains under
//! a parent held in *any* tier, whatever its own tier; refusing it would
//! lose the block, and every later store chained on it, for good.
//!
//! The credit is the walk above: the service weighs each device block by
//! [`KvRouterConfig::overlap_score_credit`](crate::KvRouterConfig), each
//! host block by `host_cache_hit_weight` and each disk block by
//! `disk_cache_hit_weight` (1.0, 0.75 and 0.25 by default, the credits
//! Dynamo 1.7 gives its three tiers). Where selkie differs from Dynamo:
//! Dynamo 1.6 keeps one tree for every tier (a host block credits as a
//! device block); Dynamo's lower-tier indexers accept a host or disk store
//! under a parent the rank does not hold, where selkie refuses a store
//! whose parent the rank holds in no tier (without the parent, the block's
//! place in the sequence, so its sequence hash, is unknown); and a device
//! block after a host-only block of the request does not continue the
//! host run here, since the engine would not use it there: vLLM matches
//! its GPU cache from the first block and looks its offloaded blocks up
//! after the GPU match, loading them to new GPU blocks.
//!
//! ## Event ids and engine incarnations
//!
//! Event ids are per rank and consecutive within an *incarnation* (one run
//! of an engine: vLLM numbers its events from 0 each time it starts). A
//! rank's first event may have any id. Then, for an event's id:
//!
//! * the last id plus one: applied;
//! * further ahead, by at most [`MAX_EVENT_ID_JUMP`]: events were lost, so
//!   the rank's blocks (every tier) are dropped, since the index can no
//!   longer know them; the event is applied to the empty rank and reported
//!   ([`KvEventError::EventGap`]);
//! * further ahead than that: not believed (no engine loses 2³² events;
//!   a corrupted or forged id would otherwise make the rank's real events
//!   stale for good): ignored, the rank keeps its blocks and its last id
//!   ([`KvEventError::EventIdJump`]);
//! * 0, or more than [`MAX_EVENT_ID_JUMP`] below the last: a new
//!   incarnation (the engine restarted): the rank's blocks are dropped and
//!   the event applied to the empty rank (counted in
//!   [`KvIndexStats::restarts`]);
//! * otherwise at or below the last: a duplicate or a late event, ignored
//!   ([`KvEventError::StaleEvent`]).
//!
//! Each outcome is counted in [`KvIndexStats`] and in the
//! `selkie_kv_events_total` counter (label `outcome`).
//!
//! # Rows and the fleet
//!
//! Blocks are kept per row of the service, not per worker, so a query
//! writes columns without looking a worker up. [`KvIndex::sync_rows`] takes
//! the service's [`RowLayout`] and its
//! [`rank_row`](crate::WorkerSelectionService::rank_row) (each rank's row
//! and *tenure*, the layout epoch from which it holds that row): when the
//! layout's epoch changed, every rank is placed again; when it did not,
//! only the ranks first seen since the last sync. A router syncs before
//! every query; a rank's blocks count from the first sync after its first
//! event.
//!
//! A worker that leaves the fleet ends its ranks' incarnations:
//!
//! * a rank that lost its row, or whose worker [`KvIndex::remove_worker`]
//!   names, drops its blocks at once; what its engine reports after that
//!   (late events of the old engine) is held aside and dropped when the
//!   worker returns, unless a new incarnation began since (event id 0);
//! * a rank whose tenure changed (the worker was removed and added again
//!   between two syncs, even onto the same row) starts a new incarnation:
//!   its blocks and event ids are forgotten, unless its current
//!   incarnation began since the last sync (the restarted engine's first
//!   events may arrive before the sync that sees it back). `row_of`
//!   answers without tenures
//!   ([`row_of`](crate::WorkerSelectionService::row_of) works too) cannot
//!   show this case.
//!
//! So a row given to another worker never inherits blocks, and an engine
//! that restarts is credited with what it reports, not with what its
//! previous run held. An engine whose worker merely flaps out of the fleet
//! and back loses its blocks in the index until it stores them again.
//!
//! Ranks whose events arrive before their worker has a row (the router's
//! discovery lags the engine), and ranks whose worker left, are kept
//! aside, *awaiting* a row: at most [`DEFAULT_MAX_AWAITING_RANKS`] (4,096)
//! of them (past it the one waiting longest is dropped, with its blocks;
//! [`KvIndex::with_max_awaiting_ranks`]), for at most
//! [`DEFAULT_AWAITING_RANK_TTL`] (60 s) from the first sync that found it
//! without a row ([`KvIndex::with_awaiting_rank_ttl`]); both drops are
//! counted in [`KvIndexStats::awaiting_ranks_dropped`] and in the
//! `selkie_kv_awaiting_ranks_dropped_total` counter. A dropped rank's next
//! event is its first again.
//!
//! # Memory
//!
//! What the index holds is bounded for any event stream once
//! [`KvIndex::with_max_blocks`] bounds the blocks held (summed over ranks;
//! unbounded by default): past the bound, the blocks stored longest ago
//! are evicted, counted in [`KvIndexStats::evicted_blocks`] and in the
//! `selkie_kv_evicted_blocks_total` counter; a store of more blocks than
//! the bound is refused whole ([`KvEventError::TooManyBlocks`]). The ranks
//! with a row are the service's; those without are bounded as above. A
//! block costs its entry in its rank's table (24 bytes and a control byte
//! a slot, tables up to 7/8 full) and, for a rank with a row, its share of
//! the block table's entry (16 bytes and a control byte a slot, up to 4/5
//! full) and of its row set; copies and aliases add a small count each,
//! only where they occur. Memory is given
//! back: a table holding less than an eighth of its room shrinks (a rank's
//! table keeps the room of its first run, the block table the room
//! [`KvIndex::with_block_capacity`] reserved), and an empty one is freed.
//!
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

mod apply;
mod approx;
mod block_rows;
mod event;
mod hash;
mod query;
mod ranks;
mod rows;
mod shared;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use approx::{ApproxKvIndex, DEFAULT_APPROX_TTL};
pub use event::{KvEvent, KvEventData, KvEventError, KvQueryError, StorageTier, StoredBlock};
pub use hash::{next_sequence_hash, sequence_hashes_of, KvBlockHasher, KV_HASH_SEED};
pub use query::KvOverlaps;
pub use ranks::MAX_EVENT_ID_JUMP;
pub use shared::{shared, shared_bounded, shared_with, KvIndexReader, KvIndexWriter};

use crate::request::RowLayout;
use crate::types::{RankRow, WorkerId, WorkerWithDpRank};
use block_rows::BlockRows;
use ranks::{check_event_id, EventOrder, RankBlocks};
use rows::MAX_ROWS;

/// Blocks of a stored run put on the rank's row together (the block
/// table's changes for a streak of blocks moving to one set are made
/// once).
const STRIDE: usize = 16;

/// Blocks a placed rank's table has room for from its first stored run on
/// (256 slots, 6 KiB). An engine reports its cache a request's run at a
/// time and a rank that reports anything soon holds hundreds of blocks:
/// growing a table through 64 and 128 slots to get there cost about a
/// tenth of a fleet's ingestion. A rank that never stores more keeps the
/// 6 KiB. Where the fleet's ranks already hold more on average, a new
/// rank's first run makes room for that average instead: engines of one
/// fleet have caches of one size, and a rank that reports its first
/// blocks after its peers (a new worker, a restarted one) soon holds what
/// they hold. Never more than the index's bound; see
/// [`FIRST_ROOM_AWAITING`] for ranks without a row.
const RANK_FIRST_ROOM: usize = 200;

/// A rank without a row makes the room of [`RANK_FIRST_ROOM`] at its first
/// run only while at most this many ranks await a row (ranks joining one
/// by one, as a fleet grows); past it (a fleet starting at once, a flood of
/// ranks that never get a row) it makes room for what it stores, and for
/// the rest once it gets a row.
const FIRST_ROOM_AWAITING: usize = 64;

/// The most ranks without a row the index keeps by default (see
/// [`KvIndex::with_max_awaiting_ranks`]).
pub const DEFAULT_MAX_AWAITING_RANKS: usize = 4_096;

/// How long by default a rank may wait for a row before the index drops
/// it (see [`KvIndex::with_awaiting_rank_ttl`]).
pub const DEFAULT_AWAITING_RANK_TTL: Duration = Duration::from_secs(60);

/// A rank's row in a synced layout and, if known, its tenure there.
type Placement = (u32, Option<u64>);

/// A map keyed by worker ranks, with rustc's Fx hash (one multiply per key
/// word): worker ids come from the fleet's own engines, not from clients.
type RankMap<V> = rustc_hash::FxHashMap<WorkerWithDpRank, V>;

/// What `row_of` answers for a rank in [`KvIndex::sync_rows`]: its row as
/// [`WorkerSelectionService::row_of`](crate::WorkerSelectionService::row_of)
/// answers (`Option<usize>`), or its row and tenure as
/// [`WorkerSelectionService::rank_row`](crate::WorkerSelectionService::rank_row)
/// answers (`Option<RankRow>`; then the index also notices a worker that
/// left the fleet and came back between two syncs).
pub trait RowAnswer: sealed::Sealed {
    /// The row and, if known, the tenure.
    fn row_and_tenure(self) -> Option<(usize, Option<u64>)>;
}

impl RowAnswer for Option<usize> {
    fn row_and_tenure(self) -> Option<(usize, Option<u64>)> {
        self.map(|row| (row, None))
    }
}

impl RowAnswer for Option<RankRow> {
    fn row_and_tenure(self) -> Option<(usize, Option<u64>)> {
        self.map(|r| (r.row, Some(r.tenure)))
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for Option<usize> {}
    impl Sealed for Option<crate::types::RankRow> {}
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
    /// Stores refused whole: more blocks than the index may hold.
    pub too_many_blocks: u64,
    /// Removals that named blocks the rank did not hold.
    pub unknown_blocks: u64,
    /// Event-id gaps (each dropped a rank's blocks).
    pub event_gaps: u64,
    /// Stale events ignored.
    pub stale_events: u64,
    /// Events ignored because their id was too far ahead to believe.
    pub event_id_jumps: u64,
    /// Incarnations ended by a new one (event id 0, an id far below the
    /// last, a worker that left the fleet and came back): each dropped a
    /// rank's blocks.
    pub restarts: u64,
    /// Ranks dropped because their worker left the fleet or was removed.
    pub ranks_removed: u64,
    /// Ranks without a row dropped past the bound on their number or age
    /// ([`KvIndex::with_max_awaiting_ranks`],
    /// [`KvIndex::with_awaiting_rank_ttl`]).
    pub awaiting_ranks_dropped: u64,
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
    too_many_blocks: metrics::Counter,
    unknown_blocks: metrics::Counter,
    event_gap: metrics::Counter,
    stale_event: metrics::Counter,
    event_id_jump: metrics::Counter,
    restart: metrics::Counter,
    evicted: metrics::Counter,
    awaiting_dropped: metrics::Counter,
}

impl EventCounters {
    fn new() -> Self {
        let c = |outcome: &'static str| metrics::counter!("selkie_kv_events_total", "outcome" => outcome);
        EventCounters {
            applied: c("applied"),
            unknown_parent: c("unknown_parent"),
            self_parent: c("self_parent"),
            too_many_blocks: c("too_many_blocks"),
            unknown_blocks: c("unknown_blocks"),
            event_gap: c("event_gap"),
            stale_event: c("stale_event"),
            event_id_jump: c("event_id_jump"),
            restart: c("restart"),
            evicted: metrics::counter!("selkie_kv_evicted_blocks_total"),
            awaiting_dropped: metrics::counter!("selkie_kv_awaiting_ranks_dropped_total"),
        }
    }
}

/// A rank in the queue of ranks without a row.
#[derive(Clone, Copy, Debug)]
struct Awaiting {
    /// The rank's ticket (the entry is stale once the rank's differs).
    ticket: u64,
    /// The sync at which it was first seen without a row (`None`: since
    /// the last sync).
    since: Option<Instant>,
    rank: WorkerWithDpRank,
}

/// Which rows hold which KV blocks, fed by engine events (see the module
/// documentation).
pub struct KvIndex {
    block_size: u32,
    /// Sequence hash -> rows holding the block.
    blocks: BlockRows,
    ranks: RankMap<RankBlocks>,
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
    /// Ranks without a row, oldest first (stale entries skipped), how many
    /// are valid, and the next ticket.
    awaiting: VecDeque<Awaiting>,
    awaiting_count: usize,
    next_ticket: u64,
    max_awaiting: usize,
    awaiting_ttl: Duration,
    /// Ranks with a row.
    placed: usize,
    /// Blocks the block table was reserved for (it never shrinks below).
    block_capacity: usize,
    /// Syncs so far.
    syncs: u64,
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
    /// An empty index for blocks of `block_size` tokens: the service's
    /// ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size)),
    /// which [`sync_rows`](Self::sync_rows) checks, and the hasher's, which
    /// [`overlaps_for_tokens`](Self::overlaps_for_tokens) checks (see the
    /// module documentation). The size also turns device blocks into the
    /// cached-token estimate of a query.
    pub fn new(block_size: u32) -> Self {
        KvIndex {
            block_size,
            blocks: BlockRows::default(),
            ranks: RankMap::default(),
            layout: None,
            stats: KvIndexStats::default(),
            counters: EventCounters::new(),
            held: 0,
            max_blocks: usize::MAX,
            stores: 0,
            coldest: VecDeque::new(),
            awaiting: VecDeque::new(),
            awaiting_count: 0,
            next_ticket: 1,
            max_awaiting: DEFAULT_MAX_AWAITING_RANKS,
            awaiting_ttl: DEFAULT_AWAITING_RANK_TTL,
            placed: 0,
            block_capacity: 0,
            syncs: 0,
        }
    }

    /// Bounds the blocks the index holds (a block held by two ranks counts
    /// twice): past `max_blocks`, the blocks stored longest ago go first,
    /// counted in [`KvIndexStats::evicted_blocks`] and in the
    /// `selkie_kv_evicted_blocks_total` counter. An evicted block is
    /// forgotten as if removed: it and (until it is stored again) the
    /// rank's blocks after it stop counting, a store under it is refused
    /// and a removal of it reports it unknown. A store of more than
    /// `max_blocks` blocks is refused whole
    /// ([`KvEventError::TooManyBlocks`]). Unbounded by default.
    pub fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks;
        self
    }

    /// Bounds the ranks kept without a row (ranks whose events arrive
    /// before their worker joins the fleet, and ranks whose worker left):
    /// past `max_ranks`, the one without a row longest goes, with its
    /// blocks, counted in [`KvIndexStats::awaiting_ranks_dropped`] and in
    /// the `selkie_kv_awaiting_ranks_dropped_total` counter. Default
    /// [`DEFAULT_MAX_AWAITING_RANKS`]; at least 1 (0 counts as 1).
    pub fn with_max_awaiting_ranks(mut self, max_ranks: usize) -> Self {
        self.max_awaiting = max_ranks.max(1);
        self
    }

    /// Bounds how long a rank is kept without a row, measured from the
    /// first sync that found it without one: a sync drops (with its
    /// blocks) every rank without a row for `ttl` or longer, counted as
    /// [`with_max_awaiting_ranks`](Self::with_max_awaiting_ranks) counts.
    /// Default [`DEFAULT_AWAITING_RANK_TTL`].
    pub fn with_awaiting_rank_ttl(mut self, ttl: Duration) -> Self {
        self.awaiting_ttl = ttl;
        self
    }

    /// Makes room in the block table for `blocks` distinct blocks, as
    /// `HashMap::with_capacity` does: up to there the table never grows.
    /// An index that grows to its size instead doubles its table as it
    /// fills, each time moving every block into a new table that starts
    /// cold in cache, inside the event that filled it; a router that knows
    /// how many blocks its fleet caches (the engines' KV capacity summed
    /// over ranks bounds the distinct blocks) reserves them here. The
    /// memory is taken now: 17 bytes a slot (a 16-byte entry and its
    /// control byte), the smallest power of two of slots that holds
    /// `blocks` at 4/5 full (what the table grown to that size would
    /// take). It never shrinks below that.
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
        self.block_capacity = blocks;
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

    /// Worker ranks the index tracks (with a row or awaiting one).
    pub fn rank_count(&self) -> usize {
        self.ranks.len()
    }

    /// Worker ranks the index tracks without a row.
    pub fn awaiting_rank_count(&self) -> usize {
        self.awaiting_count
    }

    /// Blocks `worker` holds in `tier`.
    pub fn rank_blocks(&self, worker: WorkerWithDpRank, tier: StorageTier) -> usize {
        self.ranks.get(&worker).map_or(0, |r| {
            r.blocks.iter().filter(|(_, b)| b.tiers() & tier.bit() != 0).count()
        })
    }

    /// Whether `rank` holds the block of engine hash `block_hash` (in any
    /// tier).
    pub(crate) fn holds(&self, rank: WorkerWithDpRank, block_hash: u64) -> bool {
        self.ranks
            .get(&rank)
            .is_some_and(|r| r.blocks.get(block_hash).is_some())
    }

    /// Heap bytes of the block-to-rows table and the per-rank tables, as
    /// allocated (an estimate: the fingerprint table's control bytes are
    /// counted one per slot, the rank table and the queues are left out).
    pub fn heap_bytes(&self) -> usize {
        self.blocks.heap_bytes() + self.ranks.values().map(RankBlocks::heap_bytes).sum::<usize>()
    }

    /// Places the index on the service's rows: `layout` from
    /// [`WorkerSelectionService::row_layout`](crate::WorkerSelectionService::row_layout)
    /// and `row_of` answering as
    /// [`WorkerSelectionService::rank_row`](crate::WorkerSelectionService::rank_row)
    /// (or as [`row_of`](crate::WorkerSelectionService::row_of), which
    /// cannot tell a worker that left and came back between two syncs;
    /// read the layout first). When the layout is the one already synced,
    /// only ranks first seen since are placed; otherwise every rank is: a
    /// rank that lost its row is dropped with its blocks, and one that
    /// left and came back starts a new incarnation (see the module
    /// documentation). Ranks without a row for longer than the bound
    /// ([`with_awaiting_rank_ttl`](Self::with_awaiting_rank_ttl)) are
    /// dropped.
    ///
    /// This is where the index meets the service, so this is where their
    /// block sizes are checked: a layout whose
    /// [`block_size`](RowLayout::block_size) is not the index's is refused
    /// with [`KvQueryError::BlockSizeMismatch`], changing nothing (the
    /// check runs when the layout is new to the index, not on the
    /// repeated syncs to a layout already synced).
    pub fn sync_rows<A: RowAnswer>(
        &mut self,
        layout: RowLayout,
        mut row_of: impl FnMut(WorkerWithDpRank) -> A,
    ) -> Result<(), KvQueryError> {
        self.sync_rows_at(layout, |rank| row_of(rank).row_and_tenure(), Instant::now(), true)
    }

    /// Refuses `layout` if its block size is not the index's.
    fn check_layout(&self, layout: RowLayout) -> Result<(), KvQueryError> {
        if layout.block_size() == self.block_size {
            Ok(())
        } else {
            Err(KvQueryError::BlockSizeMismatch {
                index: self.block_size,
                service: layout.block_size(),
            })
        }
    }

    /// Refuses `hasher` if its block size is not the index's (one
    /// comparison on a query's path; the error is built out of line).
    #[inline]
    pub(crate) fn check_hasher(&self, hasher: &KvBlockHasher) -> Result<(), KvQueryError> {
        if hasher.block_size() == self.block_size {
            Ok(())
        } else {
            Err(self.hasher_mismatch(hasher))
        }
    }

    #[cold]
    #[inline(never)]
    fn hasher_mismatch(&self, hasher: &KvBlockHasher) -> KvQueryError {
        KvQueryError::HasherBlockSize {
            hasher: hasher.block_size(),
            index: self.block_size,
        }
    }

    /// [`sync_rows`](Self::sync_rows) at `now`, reporting through
    /// `metrics` only if `report` (a shared index's second copy replays a
    /// sync at the first one's time, reporting nothing).
    fn sync_rows_at(
        &mut self,
        layout: RowLayout,
        mut row_of: impl FnMut(WorkerWithDpRank) -> Option<(usize, Option<u64>)>,
        now: Instant,
        report: bool,
    ) -> Result<(), KvQueryError> {
        if self.layout != Some(layout) {
            self.check_layout(layout)?;
        }
        self.syncs += 1;
        let mut answer = |rank| {
            row_of(rank)
                .filter(|&(r, _)| r < MAX_ROWS)
                .map(|(r, tenure)| (r as u32, tenure))
        };
        if self.layout == Some(layout) {
            // Only ranks first without a row since the last sync can have
            // one: the rest found none in this layout already.
            for rank in self.awaiting_since_last_sync() {
                if let Some((row, tenure)) = answer(rank) {
                    self.place(rank, row, tenure, report);
                }
            }
        } else {
            self.layout = Some(layout);
            let moves: Vec<(WorkerWithDpRank, Option<Placement>)> = self
                .ranks
                .iter()
                .filter_map(|(&rank, state)| {
                    let new = answer(rank);
                    let moved = match (state.row, new) {
                        (None, None) => false,
                        (Some(old), Some((row, tenure))) => {
                            old != row || tenure.zip(state.tenure).is_some_and(|(t, old)| t != old)
                        }
                        _ => true,
                    };
                    moved.then_some((rank, new))
                })
                .collect();
            // Take every moving rank off its old row before any takes a new
            // one: a row may pass from one rank to another in the same
            // change.
            for &(rank, new) in &moves {
                self.unplace(rank, new.map(|(_, tenure)| tenure), report);
            }
            for (rank, new) in moves {
                if let Some((row, tenure)) = new {
                    self.place(rank, row, tenure, report);
                }
            }
        }
        self.stamp_awaiting(now);
        self.expire_awaiting(now, report);
        self.blocks.shrink(self.block_capacity);
        Ok(())
    }

    /// Drops the blocks of every rank of `worker_id` (the worker left the
    /// fleet): they stop counting at once. Events its engine reports after
    /// this count only if they start a new incarnation (event id 0), or
    /// once the worker is back in the fleet. Returns how many ranks lost
    /// their blocks.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        self.remove_worker_reporting(worker_id, true)
    }

    /// [`remove_worker`](Self::remove_worker), reporting through `metrics`
    /// only if `report`.
    fn remove_worker_reporting(&mut self, worker_id: WorkerId, report: bool) -> usize {
        let ranks: Vec<WorkerWithDpRank> = self
            .ranks
            .iter()
            .filter(|(r, state)| r.worker_id == worker_id && !state.departed)
            .map(|(&r, _)| r)
            .collect();
        for &rank in &ranks {
            self.unplace(rank, None, report);
        }
        self.shrink_ranks();
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
        if !self.ranks.contains_key(&rank) {
            self.ranks.insert(rank, RankBlocks::new(self.syncs));
            self.await_row(rank, report);
        }
        let syncs = self.syncs;
        let state = self.ranks.get_mut(&rank).expect("the rank was just made");
        let held_before = state.blocks.len();
        let mut gap = None;
        match check_event_id(state.last_event, event_id) {
            EventOrder::Stale { last } => {
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
            EventOrder::Jump { last } => {
                self.stats.event_id_jumps += 1;
                if report {
                    self.counters.event_id_jump.increment(1);
                }
                return Err(KvEventError::EventIdJump {
                    worker_id,
                    dp_rank,
                    event_id,
                    last,
                    max_jump: MAX_EVENT_ID_JUMP,
                });
            }
            EventOrder::First => state.began = syncs,
            EventOrder::Next => {}
            EventOrder::Gap { missing } => {
                gap = Some(KvEventError::EventGap {
                    worker_id,
                    dp_rank,
                    event_id,
                    last: state.last_event.unwrap_or(0),
                    missing,
                });
                self.clear_rank(rank, 0b111);
                self.stats.event_gaps += 1;
                if report {
                    self.counters.event_gap.increment(1);
                }
            }
            EventOrder::Restart => {
                self.restart(rank, report);
            }
        }
        let state = self.ranks.get_mut(&rank).expect("an event keeps its rank");
        state.last_event = Some(event_id);
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
        self.blocks.shrink(self.block_capacity);
        match &outcome {
            Ok(()) => self.stats.events_applied += 1,
            Err(KvEventError::UnknownParent { .. }) => self.stats.unknown_parent += 1,
            Err(KvEventError::SelfParent { .. }) => self.stats.self_parent += 1,
            Err(KvEventError::TooManyBlocks { .. }) => self.stats.too_many_blocks += 1,
            Err(_) => self.stats.unknown_blocks += 1,
        }
        if report {
            let counter = match &outcome {
                Ok(()) => &self.counters.applied,
                Err(KvEventError::UnknownParent { .. }) => &self.counters.unknown_parent,
                Err(KvEventError::SelfParent { .. }) => &self.counters.self_parent,
                Err(KvEventError::TooManyBlocks { .. }) => &self.counters.too_many_blocks,
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
}
