//! A worker rank's identity ([`WorkerWithDpRank`]) and a request's cache
//! overlap keyed by it ([`WorkerOverlap`]): plain data, the entries a
//! request hands
//! [`scatter_keyed`](crate::kernels::keyed::scatter_keyed).
//!
//! [`WorkerOverlap`] lives in the kernel for its
//! [`KeyedOverlap`] implementation: the scatter's gathers read its fields
//! by byte offset, a promise only `unsafe` code can make, and it is made
//! here, beside the kernel that relies on it, where the kernel's tests (and
//! Miri) run the scatter over this very type. The host re-exports both
//! types and implements nothing unsafe for them.
//!
//! This module must not read the fleet or choose rows.

use core::fmt;
use core::mem::offset_of;

use crate::kernels::keyed::KeyedOverlap;

/// One routable row: a worker and one of its data-parallel ranks.
///
/// Each rank of a worker is a separate row of the fleet and can be chosen on
/// its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WorkerWithDpRank {
    /// The worker (its id as discovery reports it).
    pub worker_id: u64,
    /// The data-parallel rank within it.
    pub dp_rank: u32,
}

impl WorkerWithDpRank {
    /// A worker and rank.
    pub const fn new(worker_id: u64, dp_rank: u32) -> Self {
        WorkerWithDpRank { worker_id, dp_rank }
    }

    /// Rank 0 of `worker_id` (workers without data parallelism).
    pub const fn from_worker_id(worker_id: u64) -> Self {
        WorkerWithDpRank { worker_id, dp_rank: 0 }
    }
}

impl fmt::Display for WorkerWithDpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/dp{}", self.worker_id, self.dp_rank)
    }
}

/// Cache overlap between the request's prompt and one worker rank.
///
/// Rows without an entry have no overlap.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerOverlap {
    /// The worker rank.
    pub worker: WorkerWithDpRank,
    /// Prompt blocks resident on the device (or the effective overlap
    /// estimate when the request carries no per-tier overlaps).
    pub device_blocks: u32,
    /// Prompt blocks in the host (CPU-pinned) tier.
    pub host_blocks: u32,
    /// Prompt blocks in the disk tier.
    pub disk_blocks: u32,
    /// Shared-cache blocks beyond the device overlap.
    pub shared_blocks: u32,
    /// Estimated prompt tokens already cached on this worker.
    pub cached_tokens: u32,
}

impl WorkerOverlap {
    /// `device_blocks` of overlap on `worker`, `cached_tokens = blocks *
    /// block_size` (saturating).
    ///
    /// `block_size` must be the one the request's prompt is divided by
    /// (the selection service's): a selection takes the overlap as given,
    /// so 96 blocks at 32 tokens credit a 2,048-token prompt with 3,072
    /// cached tokens.
    ///
    /// ```
    /// use selkie_kernel::worker::{WorkerOverlap, WorkerWithDpRank};
    /// let o = WorkerOverlap::device(WorkerWithDpRank::new(7, 1), 12, 16);
    /// assert_eq!((o.device_blocks, o.cached_tokens, o.host_blocks), (12, 192, 0));
    /// ```
    pub fn device(worker: WorkerWithDpRank, device_blocks: u32, block_size: u32) -> Self {
        WorkerOverlap {
            worker,
            device_blocks,
            cached_tokens: device_blocks.saturating_mul(block_size),
            ..Default::default()
        }
    }
}

// SAFETY: each offset is that of the field its accessor returns (the worker
// id's and the rank's are the `worker` field's plus theirs within it), the
// id a `u64` and the rest `u32`s, all plain integers of a struct with no
// other fields, so never padding.
unsafe impl KeyedOverlap for WorkerOverlap {
    const WORKER_ID_AT: usize = offset_of!(WorkerOverlap, worker) + offset_of!(WorkerWithDpRank, worker_id);
    const DP_RANK_AT: usize = offset_of!(WorkerOverlap, worker) + offset_of!(WorkerWithDpRank, dp_rank);
    const DEVICE_BLOCKS_AT: usize = offset_of!(WorkerOverlap, device_blocks);
    const HOST_BLOCKS_AT: usize = offset_of!(WorkerOverlap, host_blocks);
    const DISK_BLOCKS_AT: usize = offset_of!(WorkerOverlap, disk_blocks);
    const SHARED_BLOCKS_AT: usize = offset_of!(WorkerOverlap, shared_blocks);
    const CACHED_TOKENS_AT: usize = offset_of!(WorkerOverlap, cached_tokens);
    #[inline(always)]
    fn worker_id(&self) -> u64 {
        self.worker.worker_id
    }
    #[inline(always)]
    fn dp_rank(&self) -> u32 {
        self.worker.dp_rank
    }
    #[inline(always)]
    fn device_blocks(&self) -> u32 {
        self.device_blocks
    }
    #[inline(always)]
    fn host_blocks(&self) -> u32 {
        self.host_blocks
    }
    #[inline(always)]
    fn disk_blocks(&self) -> u32 {
        self.disk_blocks
    }
    #[inline(always)]
    fn shared_blocks(&self) -> u32 {
        self.shared_blocks
    }
    #[inline(always)]
    fn cached_tokens(&self) -> u32 {
        self.cached_tokens
    }
}
