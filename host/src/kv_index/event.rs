//! The engine KV cache events the index consumes, and the errors it answers
//! them with.
//!
//! The shapes are those of Dynamo's `KvCacheEvent` / `RouterEvent`, borrowed
//! rather than owned so feeding an event allocates nothing on the caller's
//! side. This module holds plain data only.

use std::fmt;

use thiserror::Error;

use crate::types::{DpRank, WorkerId, WorkerWithDpRank};

/// Where a worker holds a block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StorageTier {
    /// Accelerator memory (Dynamo's `Device`).
    #[default]
    Device,
    /// Pinned host memory (Dynamo's `HostPinned`).
    Host,
    /// Local disk (Dynamo's `Disk`).
    Disk,
}

impl StorageTier {
    /// A short lowercase label, as used in messages and metrics.
    pub const fn as_str(&self) -> &'static str {
        match self {
            StorageTier::Device => "device",
            StorageTier::Host => "host",
            StorageTier::Disk => "disk",
        }
    }

    pub(crate) const fn bit(&self) -> u8 {
        match self {
            StorageTier::Device => super::rows::DEVICE,
            StorageTier::Host => super::rows::HOST,
            StorageTier::Disk => super::rows::DISK,
        }
    }
}

impl fmt::Display for StorageTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One block of a [`KvEventData::Stored`] event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's hash of the block (Dynamo's `ExternalSequenceBlockHash`):
    /// how later events (a child's parent, a removal) name it.
    pub block_hash: u64,
    /// The block's local hash (Dynamo's `tokens_hash`), as
    /// [`KvBlockHasher::local_hashes`](super::KvBlockHasher::local_hashes)
    /// computes it for a request.
    pub tokens_hash: u64,
}

/// What happened to a rank's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEventData<'a> {
    /// `blocks` were stored, in order, each the child of the one before; the
    /// first is the child of `parent` (an engine block hash the rank holds)
    /// or, without a parent, the first block of a sequence.
    Stored {
        /// The engine hash of the first block's parent.
        parent: Option<u64>,
        /// The blocks, in sequence order.
        blocks: &'a [StoredBlock],
    },
    /// Blocks (engine hashes) were evicted.
    Removed {
        /// The evicted blocks' engine hashes.
        blocks: &'a [u64],
    },
    /// Every block of the rank in the event's tier was dropped.
    Cleared,
}

/// One KV cache event of one worker rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvEvent<'a> {
    /// The rank that emitted it.
    pub worker: WorkerWithDpRank,
    /// The rank's event id: consecutive per rank and engine incarnation,
    /// from 0 (see the module documentation).
    pub event_id: u64,
    /// The tier the event is about.
    pub tier: StorageTier,
    /// What happened.
    pub data: KvEventData<'a>,
}

impl<'a> KvEvent<'a> {
    /// A device-tier event.
    pub const fn new(worker: WorkerWithDpRank, event_id: u64, data: KvEventData<'a>) -> Self {
        KvEvent {
            worker,
            event_id,
            tier: StorageTier::Device,
            data,
        }
    }

    /// The same event about another tier.
    pub const fn in_tier(mut self, tier: StorageTier) -> Self {
        self.tier = tier;
        self
    }
}

/// Why an event was refused, in whole or in part. Each variant names the
/// worker, the rank and the event id.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvEventError {
    /// A store under a parent block the rank does not hold (in any tier):
    /// the whole event was refused, nothing stored.
    #[error(
        "worker {worker_id} rank {dp_rank}: event {event_id} stores {blocks} blocks under parent {parent:#018x}, \
         which the rank does not hold; nothing was stored"
    )]
    UnknownParent {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The event.
        event_id: u64,
        /// The parent's engine hash.
        parent: u64,
        /// Blocks the event carried.
        blocks: usize,
    },
    /// A store of more blocks than the index may hold
    /// ([`KvIndex::with_max_blocks`](super::KvIndex::with_max_blocks)):
    /// refused whole, nothing stored (most of it would be evicted at once,
    /// and the rest are the run's last blocks, which no request can reach
    /// without its first).
    #[error(
        "worker {worker_id} rank {dp_rank}: event {event_id} stores {blocks} blocks, more than the index holds \
         ({max_blocks}); nothing was stored"
    )]
    TooManyBlocks {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The event.
        event_id: u64,
        /// Blocks the event carried.
        blocks: usize,
        /// The index's bound.
        max_blocks: usize,
    },
    /// A store whose blocks include its own parent: refused whole.
    #[error("worker {worker_id} rank {dp_rank}: event {event_id} stores its parent {parent:#018x} as its own child; nothing was stored")]
    SelfParent {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The event.
        event_id: u64,
        /// The parent's engine hash.
        parent: u64,
    },
    /// A removal naming blocks the rank does not hold in the event's tier:
    /// the blocks it does hold were removed, these were not.
    #[error(
        "worker {worker_id} rank {dp_rank}: event {event_id} removes {unknown} {tier} blocks the rank does not hold \
         (first {first:#018x}); the others were removed"
    )]
    UnknownBlocks {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The event.
        event_id: u64,
        /// The tier.
        tier: StorageTier,
        /// How many of the event's hashes were unknown.
        unknown: usize,
        /// The first unknown hash.
        first: u64,
    },
    /// Events of the rank were lost: the rank's blocks (every tier) were
    /// dropped, since the index can no longer know them, and this event was
    /// then applied to the empty rank.
    #[error(
        "worker {worker_id} rank {dp_rank}: event {event_id} follows event {last}, {missing} events missing; \
         the rank's blocks were dropped"
    )]
    EventGap {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The event that revealed the gap.
        event_id: u64,
        /// The last event applied before it.
        last: u64,
        /// Events missing in between.
        missing: u64,
    },
    /// An event id more than [`MAX_EVENT_ID_JUMP`](super::MAX_EVENT_ID_JUMP)
    /// past the last one applied: not believed (no engine loses that many
    /// events), so ignored; the rank keeps its blocks and its last id.
    #[error(
        "worker {worker_id} rank {dp_rank}: event {event_id} is more than {max_jump} past event {last}; \
         it was ignored"
    )]
    EventIdJump {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The event.
        event_id: u64,
        /// The last event applied.
        last: u64,
        /// The largest step believed.
        max_jump: u64,
    },
    /// An event id at or below one already applied (a duplicate or a late
    /// event; not 0, which starts a new incarnation): ignored.
    #[error("worker {worker_id} rank {dp_rank}: event {event_id} arrived after event {last}; it was ignored")]
    StaleEvent {
        /// The worker.
        worker_id: WorkerId,
        /// The rank.
        dp_rank: DpRank,
        /// The stale event.
        event_id: u64,
        /// The last event applied.
        last: u64,
    },
}

impl KvEventError {
    /// A short lowercase label, as used in metrics.
    pub const fn as_str(&self) -> &'static str {
        match self {
            KvEventError::UnknownParent { .. } => "unknown_parent",
            KvEventError::TooManyBlocks { .. } => "too_many_blocks",
            KvEventError::EventIdJump { .. } => "event_id_jump",
            KvEventError::SelfParent { .. } => "self_parent",
            KvEventError::UnknownBlocks { .. } => "unknown_blocks",
            KvEventError::EventGap { .. } => "event_gap",
            KvEventError::StaleEvent { .. } => "stale_event",
        }
    }
}

/// Why a query got no overlaps.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvQueryError {
    /// The index was never given the service's rows
    /// ([`KvIndex::sync_rows`](super::KvIndex::sync_rows)).
    #[error("the KV index has no row layout yet: call sync_rows with the service's layout first")]
    NoRowLayout,
    /// The service's block size is not the index's: every overlap would
    /// count blocks of one size as blocks of the other. Build the index with
    /// the service's [`ServiceConfig::block_size`](crate::ServiceConfig::block_size).
    /// Reported by [`KvIndex::sync_rows`](super::KvIndex::sync_rows), which
    /// then changes nothing.
    #[error(
        "the KV index counts blocks of {index} tokens but the service blocks of {service}: build the index with the \
         service's block size"
    )]
    BlockSizeMismatch {
        /// The index's block size.
        index: u32,
        /// The service's ([`RowLayout::block_size`](crate::RowLayout::block_size)).
        service: u32,
    },
    /// The hasher's block size is not the index's: the request's blocks
    /// would not be the blocks the index holds. Reported by the queries and
    /// records that take a hasher.
    #[error(
        "the block hasher cuts blocks of {hasher} tokens but the KV index holds blocks of {index}: hash with the \
         index's block size"
    )]
    HasherBlockSize {
        /// The hasher's block size.
        hasher: u32,
        /// The index's.
        index: u32,
    },
}
