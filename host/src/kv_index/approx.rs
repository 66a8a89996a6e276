//! The approximate index (see [`ApproxKvIndex`]).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::event::{KvEvent, KvEventData, KvQueryError, StoredBlock};
use super::hash::{sequence_hashes_of, KvBlockHasher};
use super::query::KvOverlaps;
use super::{KvIndex, RowAnswer};
use crate::request::{RowLayout, RowOverlaps};
use crate::types::{WorkerId, WorkerWithDpRank};

/// Dynamo's default time to live of a recorded block in approximate mode.
pub const DEFAULT_APPROX_TTL: Duration = Duration::from_secs(120);

/// The approximate index: for engines that publish no KV events, the index
/// learns from the router's own decisions (Dynamo's approximate mode).
///
/// Each routing decision is recorded as "this rank now holds the request's
/// prompt blocks", and each recorded block is forgotten a time to live after
/// it was last recorded (120 s by default, as in Dynamo). A later request
/// sharing a recorded prefix then scores that prefix on the rank that
/// served it, as if the engine had reported storing it.
///
/// ```
/// use std::time::{Duration, Instant};
/// use selkie::kv_index::{ApproxKvIndex, KvBlockHasher, KvOverlaps};
/// use selkie::*;
///
/// let service = WorkerSelectionService::new(
///     WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
///     ServiceConfig::default(),
/// );
/// service.add_worker(WorkerRecord::new(1))?;
/// service.add_worker(WorkerRecord::new(2))?;
/// let hasher = KvBlockHasher::new(16);
/// let mut index = ApproxKvIndex::new(16).with_ttl(Duration::from_secs(120));
/// let mut out = KvOverlaps::new();
/// let prompt: Vec<u32> = (0..512).collect();
/// let now = Instant::now();
///
/// // Per request: sync to the service's rows (cheap when they did not
/// // change), query, route, then record the decision.
/// index.sync_rows(service.row_layout(), |rank| service.row_of(rank))?;
/// let columns = index.overlaps_for_tokens(&hasher, &prompt, &mut out, now)?;
/// let chosen = service.select(&SelectionRequest::new(prompt.len()).with_row_overlaps(columns))?;
/// index.record_tokens(chosen.worker(), &hasher, &prompt, now)?;
///
/// // The next request with the same prompt scores its 32 blocks there.
/// index.sync_rows(service.row_layout(), |rank| service.row_of(rank))?;
/// let columns = index.overlaps_for_tokens(&hasher, &prompt, &mut out, now)?;
/// let row = service.row_of(chosen.worker()).unwrap();
/// assert_eq!(columns.device_blocks[row], 32.0);
///
/// // Two minutes later the record has expired.
/// let later = now + Duration::from_secs(121);
/// let columns = index.overlaps_for_tokens(&hasher, &prompt, &mut out, later)?;
/// assert_eq!(columns.device_blocks[row], 0.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A [`KvIndex`] fed by the router's own decisions instead of engine
/// events.
///
/// Recorded blocks are device-tier blocks of the chosen rank. Expiry runs
/// at every record and query (`now` is the caller's clock; a `now` earlier
/// than one given before counts as that one). As with [`KvIndex`], call
/// [`sync_rows`](Self::sync_rows) before each query: a rank recorded for
/// the first time gets its row there.
#[derive(Debug)]
pub struct ApproxKvIndex {
    index: KvIndex,
    ttl: Duration,
    /// When each (rank, sequence hash) was last recorded.
    recorded: HashMap<(WorkerWithDpRank, u64), Instant>,
    /// Records in the order they were made: `(expiry, rank, sequence hash)`;
    /// an entry whose block was recorded again later is skipped.
    expiry: VecDeque<(Instant, WorkerWithDpRank, u64)>,
    /// The next synthetic event id of each rank.
    next_id: HashMap<WorkerWithDpRank, u64>,
    /// The latest `now` seen.
    clock: Option<Instant>,
    /// Scratch: the blocks of one record, and sequence hashes.
    blocks: Vec<StoredBlock>,
    hashes: Vec<u64>,
    local: Vec<u64>,
    removed: Vec<u64>,
}

impl ApproxKvIndex {
    /// An empty index of blocks of `block_size` tokens, with
    /// [`DEFAULT_APPROX_TTL`].
    pub fn new(block_size: u32) -> Self {
        ApproxKvIndex {
            index: KvIndex::new(block_size),
            ttl: DEFAULT_APPROX_TTL,
            recorded: HashMap::new(),
            expiry: VecDeque::new(),
            next_id: HashMap::new(),
            clock: None,
            blocks: Vec::new(),
            hashes: Vec::new(),
            local: Vec::new(),
            removed: Vec::new(),
        }
    }

    /// Sets the time to live of a recorded block.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Reserves the block table for `blocks` distinct blocks (see
    /// [`KvIndex::with_block_capacity`]).
    pub fn with_block_capacity(mut self, blocks: usize) -> Self {
        self.index = self.index.with_block_capacity(blocks);
        self
    }

    /// The underlying index (what has been recorded and not expired as of
    /// the last record or query).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Places the index on the service's rows (see [`KvIndex::sync_rows`],
    /// which refuses a layout of another block size).
    pub fn sync_rows<A: RowAnswer>(
        &mut self,
        layout: RowLayout,
        row_of: impl FnMut(WorkerWithDpRank) -> A,
    ) -> Result<(), KvQueryError> {
        self.index.sync_rows(layout, row_of)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.index.block_size()
    }

    /// Forgets every record of `worker_id` (a worker that left the fleet);
    /// returns how many of its ranks the index dropped.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        self.recorded.retain(|(rank, _), _| rank.worker_id != worker_id);
        self.next_id.retain(|rank, _| rank.worker_id != worker_id);
        self.index.remove_worker(worker_id)
    }

    /// Records that `rank` was chosen for a request whose prompt blocks have
    /// the local hashes `local_hashes` (from the first block on): the rank
    /// holds them from `now` until `now` plus the time to live.
    pub fn record(&mut self, rank: WorkerWithDpRank, local_hashes: &[u64], now: Instant) {
        let now = self.tick(now);
        let mut hashes = std::mem::take(&mut self.hashes);
        hashes.clear();
        sequence_hashes_of(local_hashes, &mut hashes);
        self.record_chain(rank, local_hashes, &hashes, now);
        self.hashes = hashes;
    }

    /// [`record`](Self::record) for a prompt given by its tokens; a hasher
    /// of another block size than the index's is refused
    /// ([`KvQueryError::HasherBlockSize`]), recording nothing.
    pub fn record_tokens(
        &mut self,
        rank: WorkerWithDpRank,
        hasher: &KvBlockHasher,
        tokens: &[u32],
        now: Instant,
    ) -> Result<(), KvQueryError> {
        self.index.check_hasher(hasher)?;
        let mut local = std::mem::take(&mut self.local);
        local.clear();
        hasher.local_hashes(tokens, &mut local);
        self.record(rank, &local, now);
        self.local = local;
        Ok(())
    }

    fn record_chain(&mut self, rank: WorkerWithDpRank, local: &[u64], seq: &[u64], now: Instant) {
        if seq.is_empty() {
            return;
        }
        let until = now + self.ttl;
        // One stored event per run of blocks the rank does not hold yet,
        // under the block before it: a block the rank holds is recorded
        // again, not stored again (the index counts a block stored twice as
        // two copies, each removed on its own). Every block's expiry moves
        // on.
        let mut start = 0;
        while start < seq.len() {
            if self.index.holds(rank, seq[start]) {
                start += 1;
                continue;
            }
            let end = (start..seq.len())
                .find(|&i| self.index.holds(rank, seq[i]))
                .unwrap_or(seq.len());
            self.blocks.clear();
            self.blocks.extend(
                seq[start..end]
                    .iter()
                    .zip(&local[start..end])
                    .map(|(&block_hash, &tokens_hash)| StoredBlock {
                        block_hash,
                        tokens_hash,
                    }),
            );
            let id = self.next_id.entry(rank).or_insert(0);
            let event = KvEvent::new(
                rank,
                *id,
                KvEventData::Stored {
                    parent: start.checked_sub(1).map(|p| seq[p]),
                    blocks: &self.blocks,
                },
            );
            *id += 1;
            // The parent is held (the run starts after a held block or at
            // the root); a gap cannot occur since this index numbers the
            // events itself.
            let _ = self.index.apply(&event);
            start = end;
        }
        for &h in seq {
            self.recorded.insert((rank, h), until);
            self.expiry.push_back((until, rank, h));
        }
    }

    /// Forgets the blocks whose time to live ended by `now`; returns how
    /// many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let now = self.tick(now);
        let mut expired = 0;
        while let Some(&(until, rank, hash)) = self.expiry.front() {
            if until > now {
                break;
            }
            self.expiry.pop_front();
            // Recorded again since: a later entry holds its expiry.
            if self.recorded.get(&(rank, hash)) != Some(&until) {
                continue;
            }
            self.recorded.remove(&(rank, hash));
            self.removed.clear();
            self.removed.push(hash);
            let id = self.next_id.entry(rank).or_insert(0);
            let event = KvEvent::new(rank, *id, KvEventData::Removed { blocks: &self.removed });
            *id += 1;
            // A block the index dropped on its own (its worker left, or the
            // memory bound evicted it) is already gone.
            let _ = self.index.apply(&event);
            expired += 1;
        }
        expired
    }

    /// The overlaps of a request by its sequence hashes after expiring what
    /// ended by `now` (see [`KvIndex::overlaps`]).
    ///
    /// # Errors
    /// As [`KvIndex::overlaps`].
    pub fn overlaps<'o>(
        &mut self,
        sequence_hashes: &[u64],
        out: &'o mut KvOverlaps,
        now: Instant,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        self.expire(now);
        self.index.overlaps(sequence_hashes, out)
    }

    /// [`overlaps`](Self::overlaps) for a prompt given by its tokens.
    ///
    /// # Errors
    /// As [`KvIndex::overlaps`].
    pub fn overlaps_for_tokens<'o>(
        &mut self,
        hasher: &KvBlockHasher,
        tokens: &[u32],
        out: &'o mut KvOverlaps,
        now: Instant,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        self.expire(now);
        self.index.overlaps_for_tokens(hasher, tokens, out)
    }

    /// Blocks recorded and not yet expired, over all ranks.
    pub fn recorded_blocks(&self) -> usize {
        self.recorded.len()
    }

    fn tick(&mut self, now: Instant) -> Instant {
        let now = self.clock.map_or(now, |c| c.max(now));
        self.clock = Some(now);
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerWithDpRank = WorkerWithDpRank::new(1, 0);
    const B: WorkerWithDpRank = WorkerWithDpRank::new(2, 0);

    fn synced(index: &mut ApproxKvIndex) {
        let rows = [A, B];
        index
            .sync_rows(RowLayout::new(1, 2, 16), |r| rows.iter().position(|&x| x == r))
            .unwrap();
    }

    /// Device blocks of rows A and B for a query by local hashes.
    fn overlaps(index: &mut ApproxKvIndex, local: &[u64], now: Instant) -> [f32; 2] {
        synced(index);
        let mut seq = Vec::new();
        sequence_hashes_of(local, &mut seq);
        let mut out = KvOverlaps::new();
        let c = index.overlaps(&seq, &mut out, now).expect("synced");
        [c.device_blocks[0], c.device_blocks[1]]
    }

    /// A reserved table keeps its size while the records fill it, and
    /// scores as an unreserved one.
    #[test]
    fn a_reserved_approximate_index_records_without_growing() {
        let t0 = Instant::now();
        let mut index = ApproxKvIndex::new(16).with_block_capacity(200);
        let mut grown = ApproxKvIndex::new(16);
        let slots = index.index().blocks.table_capacity();
        assert!(slots >= 200, "{slots} slots reserved for 200 blocks");
        synced(&mut index);
        synced(&mut grown);
        let chain: Vec<u64> = (1..=200).collect();
        index.record(A, &chain, t0);
        grown.record(A, &chain, t0);
        index.record(B, &chain[..50], t0);
        grown.record(B, &chain[..50], t0);
        assert_eq!(overlaps(&mut index, &chain, t0), [200.0, 50.0]);
        assert_eq!(overlaps(&mut index, &chain, t0), overlaps(&mut grown, &chain, t0));
        assert_eq!(index.index().blocks.table_capacity(), slots);
    }

    #[test]
    fn a_recorded_prefix_scores_until_its_time_to_live_ends() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(120);
        let mut index = ApproxKvIndex::new(16).with_ttl(ttl);
        index.record(A, &[10, 11, 12], t0);
        assert_eq!(overlaps(&mut index, &[10, 11, 12, 13], t0), [3.0, 0.0]);
        assert_eq!(overlaps(&mut index, &[10, 99], t0), [1.0, 0.0]);
        assert_eq!(overlaps(&mut index, &[11, 12], t0), [0.0, 0.0], "not a prefix");
        let just_before = t0 + ttl - Duration::from_millis(1);
        assert_eq!(overlaps(&mut index, &[10, 11, 12], just_before), [3.0, 0.0]);
        assert_eq!(overlaps(&mut index, &[10, 11, 12], t0 + ttl), [0.0, 0.0]);
        assert_eq!(index.recorded_blocks(), 0);
        assert_eq!(index.index().block_count(), 0);
    }

    #[test]
    fn recording_again_extends_only_the_blocks_recorded() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut index = ApproxKvIndex::new(16).with_ttl(ttl);
        index.record(A, &[10, 11, 12], t0);
        // A shorter request with the same prefix, 5 s later, on the same rank.
        index.record(A, &[10, 11], t0 + Duration::from_secs(5));
        index.record(B, &[10], t0 + Duration::from_secs(5));
        let at = t0 + Duration::from_secs(12);
        assert_eq!(overlaps(&mut index, &[10, 11, 12], at), [2.0, 1.0]);
        assert_eq!(
            overlaps(&mut index, &[10, 11, 12], t0 + Duration::from_secs(15)),
            [0.0, 0.0]
        );
    }

    #[test]
    fn a_clock_that_goes_back_counts_as_the_latest() {
        let t0 = Instant::now();
        let mut index = ApproxKvIndex::new(16).with_ttl(Duration::from_secs(1));
        index.record(A, &[10], t0);
        assert_eq!(index.expire(t0 + Duration::from_secs(2)), 1);
        // Recorded "in the past": it still lives a full time to live from
        // the latest clock seen.
        index.record(A, &[10], t0);
        assert_eq!(
            overlaps(&mut index, &[10], t0 + Duration::from_millis(2500)),
            [1.0, 0.0]
        );
        assert_eq!(overlaps(&mut index, &[10], t0 + Duration::from_secs(3)), [0.0, 0.0]);
    }

    #[test]
    fn a_removed_worker_is_forgotten_and_its_expiries_are_harmless() {
        let t0 = Instant::now();
        let mut index = ApproxKvIndex::new(16).with_ttl(Duration::from_secs(1));
        index.record(A, &[10, 11], t0);
        index.record(B, &[10, 11], t0);
        assert_eq!(index.remove_worker(1), 1, "A's one rank");
        assert_eq!(overlaps(&mut index, &[10, 11], t0), [0.0, 2.0]);
        assert_eq!(index.expire(t0 + Duration::from_secs(1)), 2, "B's two blocks");
        assert_eq!(overlaps(&mut index, &[10, 11], t0 + Duration::from_secs(1)), [0.0, 0.0]);
    }
}
