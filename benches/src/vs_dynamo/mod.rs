//! selkie against dynamo-kv-router 1.6.1, on Dynamo's own `worker_selection`
//! bench fixture and on seeded random fleets: the fleet states
//! ([`Scenario`]), the drivers (Dynamo's [`DynamoFixture`], selkie's kernel
//! path [`SelkieFixture`] and its public service [`ServiceFixture`]), the
//! [`parity`] check that runs before any timing, and the [`report`] tables.
//! With the `dynamo-core` feature, `DynamoCore` drives Dynamo's full
//! selection path (`SelectionCore`), the second anchor. Built only with the
//! `dynamo` feature.
//!
//! The fixture, for worker `id` in `0..n`: cached tokens `(id % 32) * 64`,
//! overlap blocks `cached / 16`, active prefill tokens `id * 16`, active
//! decode blocks `id % 127`, active requests `id % 17`, one data-parallel
//! rank, 131,072 KV blocks; one request of 2,048 prompt tokens, block size 16,
//! default cost config (no credit decay), temperature 0 or 0.7. The random
//! fleets ([`Scenario::random`]) keep the request and draw everything else.
//!
//! This module builds inputs, checks results and formats tables; it
//! measures nothing.

mod dynamo;
#[cfg(feature = "dynamo-core")]
mod dynamo_core;
pub mod parity;
pub mod report;
mod scenario;
mod selkie;
mod service;

pub use self::dynamo::{base_request, DynamoFixture};
#[cfg(feature = "dynamo-core")]
pub use self::dynamo_core::{DynamoCore, CORE_PROMPT_TOKENS, CORE_WORKER_COUNTS};
pub use self::scenario::{
    CacheHit, Case, Scenario, ScenarioWorker, RANDOM_HIT_PERCENT, RANDOM_MAX_REQUESTS, RANDOM_MAX_REQUEST_BLOCKS,
};
pub use self::selkie::{BenchFleet, LoadSource, OverlapHit, SelkieFixture, FLEET_GROUPS};
pub use self::service::{kv_request, overlap_input, OverlapForm, OverlapInput, ServiceFixture};

/// Prompt length of the fixture's request, in tokens.
pub const PROMPT_TOKENS: u32 = 2_048;
/// KV block size, in tokens.
pub const BLOCK_SIZE: u32 = 16;
/// KV blocks per worker (Dynamo's `total_kv_blocks`; no cost term reads it).
pub const TOTAL_KV_BLOCKS: u64 = 131_072;
/// Worker counts Dynamo's bench measures.
pub const WORKER_COUNTS: [usize; 5] = [2, 32, 1_024, 2_048, 10_000];
/// Worker counts of the random fleets.
pub const RANDOM_WORKER_COUNTS: [usize; 2] = [1_024, 10_000];
/// Seed of the random fleets (the same for every size).
pub const RANDOM_SEED: u64 = 0x5e1c_1e00_d1a0;
/// Temperatures Dynamo's bench measures.
pub const TEMPERATURES: [f32; 2] = [0.0, 0.7];

/// A stored run of selkie's blocks under `parent` as Dynamo's stored-event
/// data: each block's engine hash and local hash, no multimodal extras (the
/// KV index benches and their parity test feed both indexes the same runs).
pub fn dynamo_stored(
    parent: Option<u64>,
    blocks: impl IntoIterator<Item = ::selkie::kv_index::StoredBlock>,
) -> dynamo_kv_router::protocols::KvCacheEventData {
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash,
    };
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalSequenceBlockHash),
        start_position: None,
        blocks: blocks
            .into_iter()
            .map(|b| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(b.block_hash),
                tokens_hash: LocalBlockHash(b.tokens_hash),
                mm_extra_info: None,
            })
            .collect(),
    })
}

/// Every scenario the side-by-side bench measures: Dynamo's fixture at
/// [`WORKER_COUNTS`], then the random fleets at [`RANDOM_WORKER_COUNTS`].
pub fn scenarios() -> impl Iterator<Item = (Case, usize)> {
    let fixture = WORKER_COUNTS.into_iter().map(|n| (Case::Fixture, n));
    let random = RANDOM_WORKER_COUNTS
        .into_iter()
        .map(|n| (Case::Random { seed: RANDOM_SEED }, n));
    fixture.chain(random)
}

impl Case {
    /// This case's fleet of `n` workers.
    pub fn build(self, n: usize) -> Scenario {
        match self {
            Case::Fixture => Scenario::fixture(n),
            Case::Random { seed } => Scenario::random(n, seed),
        }
    }
}

/// Every driver of one scenario: Dynamo's selector, selkie's kernel path on
/// each [`LoadSource`] (in [`LoadSource::ALL`] order), and selkie's public
/// service, all holding the same state.
pub struct Drivers {
    /// Dynamo's `DefaultWorkerSelector` inputs.
    pub dynamo: DynamoFixture,
    /// selkie's kernel path, one per load source.
    pub kernel: Vec<SelkieFixture>,
    /// selkie's public service.
    pub service: ServiceFixture,
}

impl Drivers {
    /// Builds every driver from `scenario`.
    pub fn new(scenario: &Scenario) -> Self {
        Drivers {
            dynamo: DynamoFixture::new(scenario),
            kernel: LoadSource::ALL
                .iter()
                .map(|&source| SelkieFixture::new(scenario, source))
                .collect(),
            service: ServiceFixture::new(scenario),
        }
    }
}
