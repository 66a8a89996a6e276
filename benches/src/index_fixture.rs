//! The KV index in the path: a service and a [`KvIndex`] fed with a fleet's
//! engine events, and the request a router builds from a prompt's tokens
//! (hash, query the index, select, book, release). Building happens here,
//! outside every measured region.

use selkie::kv_index::{KvBlockHasher, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::{
    KvRouterConfig, SelectionRequest, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService,
    WorkerType, WorkerWithDpRank,
};

/// Tokens per block.
pub const INDEX_BLOCK_SIZE: u32 = 16;
/// Blocks of the system prompt every worker holds.
pub const SYSTEM_BLOCKS: u32 = 64;
/// Shared prompts after the system prompt (worker `w` holds `w % 64`).
pub const SHARED_PROMPTS: u32 = 64;
/// Blocks of each shared prompt.
pub const SHARED_BLOCKS: u32 = 32;
/// Blocks of each worker's own continuation of its shared prompt.
pub const OWN_BLOCKS: u32 = 16;
/// Tokens of the measured prompt: the system prompt, shared prompt 1, then
/// tokens nobody holds.
pub const PROMPT_TOKENS: u32 = 2048;

/// `n` tokens of stream `stream` (distinct streams never share a block).
fn tokens(stream: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| stream.wrapping_mul(1_000_003).wrapping_add(i)).collect()
}

/// A service of `n` workers with a KV index of what they hold.
pub struct IndexFixture {
    /// The KV policy's service over the fleet.
    pub service: WorkerSelectionService,
    /// What the fleet's engines reported, synced to the service's rows.
    pub index: KvIndex,
    /// The router's block hasher (the engines' block size).
    pub hasher: KvBlockHasher,
    /// The measured prompt's tokens.
    pub prompt: Vec<u32>,
    /// The fleet's stored events, in the order the index applied them (for
    /// feeding another index the same fleet).
    pub runs: Vec<FleetRun>,
    out: KvOverlaps,
}

/// One stored event of the fixture's fleet.
pub struct FleetRun {
    /// The worker (DP rank 0).
    pub worker: u64,
    /// Its event id.
    pub event_id: u64,
    /// The sequence hash of the block before the run, if any.
    pub parent: Option<u64>,
    /// The run's blocks.
    pub blocks: Vec<StoredBlock>,
}

impl IndexFixture {
    /// # Panics
    /// If the service refuses a worker or the index an event.
    pub fn new(n: usize) -> Self {
        let service = WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig {
                block_size: INDEX_BLOCK_SIZE,
                seed: Some(42),
                ..ServiceConfig::default()
            },
        );
        service
            .sync((0..n as u64).map(WorkerRecord::new).collect())
            .expect("the fleet has room");
        let hasher = KvBlockHasher::new(INDEX_BLOCK_SIZE);
        let bs = INDEX_BLOCK_SIZE;
        let system = tokens(0, SYSTEM_BLOCKS * bs);
        let mut index = KvIndex::new(INDEX_BLOCK_SIZE);
        let (mut local, mut seq) = (Vec::new(), Vec::new());
        let mut runs = Vec::new();
        for w in 0..n as u32 {
            let mut held = system.clone();
            held.extend(tokens(1 + w % SHARED_PROMPTS, SHARED_BLOCKS * bs));
            held.extend(tokens(1_000 + w, OWN_BLOCKS * bs));
            // The hashers append: each worker's blocks start from empty.
            local.clear();
            seq.clear();
            hasher.local_hashes(&held, &mut local);
            hasher.sequence_hashes(&held, &mut seq);
            let blocks: Vec<StoredBlock> = seq
                .iter()
                .zip(&local)
                .map(|(&block_hash, &tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect();
            // Engines report a request's blocks in runs: 32 blocks per event.
            for (id, run) in blocks.chunks(32).enumerate() {
                let parent = (id > 0).then(|| blocks[id * 32 - 1].block_hash);
                let data = KvEventData::Stored { parent, blocks: run };
                index
                    .apply(&KvEvent::new(WorkerWithDpRank::new(u64::from(w), 0), id as u64, data))
                    .expect("a fleet's events in order");
                runs.push(FleetRun {
                    worker: u64::from(w),
                    event_id: id as u64,
                    parent,
                    blocks: run.to_vec(),
                });
            }
        }
        index
            .sync_rows(service.row_layout(), |r| service.row_of(r))
            .expect("the index has the service's block size");
        let mut prompt = system;
        prompt.extend(tokens(1 + 1, SHARED_BLOCKS * bs));
        prompt.extend(tokens(u32::MAX / 2, PROMPT_TOKENS - prompt.len() as u32));
        let mut fixture = IndexFixture {
            service,
            index,
            hasher,
            prompt,
            runs,
            out: KvOverlaps::new(),
        };
        fixture.select_and_release();
        fixture
    }

    /// The measured path: hash the prompt, query the index, select, book and
    /// release; returns the worker chosen.
    ///
    /// # Panics
    /// If the index is not synced or the selection fails.
    #[inline]
    pub fn select_and_release(&mut self) -> WorkerWithDpRank {
        let columns = self
            .index
            .overlaps_for_tokens(&self.hasher, &self.prompt, &mut self.out)
            .expect("the index is synced to the service");
        let request = SelectionRequest::new(self.prompt.len()).with_row_overlaps(columns);
        let selection = self.service.select(&request).expect("an idle fleet admits");
        selection.worker()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_hold_the_system_prompt_and_their_shared_prompt() {
        // 128 workers: 1 and 65 hold shared prompt 1 (the prompt's), so the
        // prompt's system and shared blocks; every other worker only the
        // system prompt's.
        let n = 128;
        let mut f = IndexFixture::new(n);
        let prompt = f.prompt.clone();
        f.index
            .overlaps_for_tokens(&f.hasher, &prompt, &mut f.out)
            .expect("the index is synced");
        for w in 0..n {
            let row = f
                .service
                .row_of(WorkerWithDpRank::new(w as u64, 0))
                .expect("every worker has a row");
            let expected = if w % SHARED_PROMPTS as usize == 1 {
                SYSTEM_BLOCKS + SHARED_BLOCKS
            } else {
                SYSTEM_BLOCKS
            };
            assert_eq!(f.out.tiers(row), (expected, 0, 0), "worker {w}");
        }
    }
}
