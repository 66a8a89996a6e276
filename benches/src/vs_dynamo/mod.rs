//! selkie against dynamo-kv-router 1.6.1's `DefaultWorkerSelector`, on
//! Dynamo's own `worker_selection` bench fixture (SPEC §6): the two drivers,
//! [`DynamoFixture`] and [`SelkieFixture`], and the [`parity`] check that runs
//! before any timing. Built only with the `dynamo` feature.
//!
//! The fixture, for worker `id` in `0..n`: cached tokens `(id % 32) * 64`,
//! overlap blocks `cached / 16`, active prefill tokens `id * 16`, active
//! decode blocks `id % 127`, active requests `id % 17`, one data-parallel
//! rank, 131,072 KV blocks; one request of 2,048 prompt tokens, block size 16,
//! default cost config (no credit decay), temperature 0 or 0.7.
//!
//! This module builds inputs and checks results; it measures nothing.

mod dynamo;
pub mod parity;
mod selkie;

pub use self::dynamo::DynamoFixture;
pub use self::selkie::{BenchFleet, LoadSource, OverlapHit, SelkieFixture, FLEET_GROUPS};

/// Prompt length of the fixture's request, in tokens.
pub const PROMPT_TOKENS: u32 = 2_048;
/// KV block size, in tokens.
pub const BLOCK_SIZE: u32 = 16;
/// KV blocks per worker (Dynamo's `total_kv_blocks`; no cost term reads it).
pub const TOTAL_KV_BLOCKS: u64 = 131_072;
/// Worker counts Dynamo's bench measures.
pub const WORKER_COUNTS: [usize; 5] = [2, 32, 1_024, 2_048, 10_000];
/// Temperatures Dynamo's bench measures.
pub const TEMPERATURES: [f32; 2] = [0.0, 0.7];

/// One worker of the fixture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixtureWorker {
    /// Tokens of the request's prompt cached on the worker.
    pub cached_tokens: u32,
    /// Prompt tokens the worker is prefilling.
    pub active_prefill_tokens: u32,
    /// KV blocks the worker's running requests hold.
    pub active_decode_blocks: u32,
    /// Requests the worker is running.
    pub active_requests: u32,
}

impl FixtureWorker {
    /// Worker `id`'s values (see the module docs).
    pub fn of(id: u32) -> Self {
        let (cached_tokens, active_prefill_tokens, active_decode_blocks, active_requests) =
            crate::dynamo_fixture_worker(id);
        FixtureWorker {
            cached_tokens,
            active_prefill_tokens,
            active_decode_blocks,
            active_requests,
        }
    }

    /// Overlap blocks, `cached_tokens / BLOCK_SIZE` (exact for the fixture).
    pub fn overlap_blocks(&self) -> f32 {
        self.cached_tokens as f32 / BLOCK_SIZE as f32
    }
}
