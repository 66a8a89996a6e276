//! What the KV cost reads: the request, the pool's role, the load columns
//! and the per-request overlap columns.
//!
//! This module must not compute costs: only describe their inputs.

use core::num::NonZeroU32;

/// The role of the worker pool being scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WorkerRole {
    /// Prefill and decode in one worker. Dynamo labels this pool `"decode"`
    /// for its default selector, so it takes the decode formula like
    /// [`WorkerRole::Decode`].
    #[default]
    Aggregated,
    /// Prefill workers of a disaggregated deployment.
    Prefill,
    /// Decode workers of a disaggregated deployment.
    Decode,
}

impl WorkerRole {
    /// Whether Dynamo's selector sees this pool as `"decode"` (every role but
    /// prefill), which enables the decode formula.
    pub const fn has_decode_label(self) -> bool {
        !matches!(self, WorkerRole::Prefill)
    }
}

/// The per-request inputs of the KV cost.
///
/// ```
/// use core::num::NonZeroU32;
/// use selkie_kernel::kernels::kv_cost::{KvRequest, WorkerRole};
/// let req = KvRequest::new(33, NonZeroU32::new(16).unwrap(), true, WorkerRole::Prefill);
/// assert_eq!(req.request_blocks(), 3);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRequest {
    isl_tokens: u32,
    block_size: NonZeroU32,
    request_blocks: u32,
    added_decode_blocks: u32,
    track_prefill_tokens: bool,
    role: WorkerRole,
}

impl KvRequest {
    /// A request of `isl_tokens` prompt tokens for KV blocks of `block_size`
    /// tokens, adding no decode blocks (see
    /// [`with_added_decode_blocks`](Self::with_added_decode_blocks)).
    pub const fn new(isl_tokens: u32, block_size: NonZeroU32, track_prefill_tokens: bool, role: WorkerRole) -> Self {
        KvRequest {
            isl_tokens,
            block_size,
            request_blocks: isl_tokens.div_ceil(block_size.get()),
            added_decode_blocks: 0,
            track_prefill_tokens,
            role,
        }
    }
    /// The decode blocks the request would add on every row that has a load
    /// observation, when no per-row [`KvOverlap::added_decode_blocks`] column
    /// is given.
    pub const fn with_added_decode_blocks(mut self, blocks: u32) -> Self {
        self.added_decode_blocks = blocks;
        self
    }
    /// Prompt tokens.
    pub const fn isl_tokens(&self) -> u32 {
        self.isl_tokens
    }
    /// Tokens per KV block.
    pub const fn block_size(&self) -> NonZeroU32 {
        self.block_size
    }
    /// `ceil(isl_tokens / block_size)`.
    pub const fn request_blocks(&self) -> u32 {
        self.request_blocks
    }
    /// The uniform added decode blocks.
    pub const fn added_decode_blocks(&self) -> u32 {
        self.added_decode_blocks
    }
    /// Whether prefill tokens are tracked (Dynamo's `track_prefill_tokens`).
    pub const fn track_prefill_tokens(&self) -> bool {
        self.track_prefill_tokens
    }
    /// The pool's role.
    pub const fn role(&self) -> WorkerRole {
        self.role
    }
}

/// The load columns the KV cost reads (the fleet's, or plain slices), all
/// of the same source type.
pub struct KvLoad<'a, L: ?Sized> {
    /// Prefill tokens in flight per row. Its length is the number of rows.
    pub active_prefill_tokens: &'a L,
    /// Decode blocks in use per row.
    pub active_decode_blocks: &'a L,
    /// Requests in flight per row.
    pub active_requests: &'a L,
    /// Rows that have a load observation; `None`: all of them. A row without
    /// one reads every load signal as 0 (rows past the mask have none).
    pub load_available: Option<&'a [u64]>,
}

impl<L: ?Sized> Clone for KvLoad<'_, L> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<L: ?Sized> Copy for KvLoad<'_, L> {}

impl<'a, L: ?Sized> KvLoad<'a, L> {
    /// Load columns where every row has an observation.
    pub const fn new(active_prefill_tokens: &'a L, active_decode_blocks: &'a L, active_requests: &'a L) -> Self {
        KvLoad {
            active_prefill_tokens,
            active_decode_blocks,
            active_requests,
            load_available: None,
        }
    }
}

/// The per-request overlap columns, index-aligned with the load columns.
/// `None` means 0 on every row (1 for the taint multiplier) and skips that
/// term's work. Values are expected finite and non-negative.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvOverlap<'a> {
    /// Device-tier overlap blocks (the effective overlap when the request
    /// carries no per-tier overlaps).
    pub device_blocks: Option<&'a [f32]>,
    /// Estimated cached tokens.
    pub cached_tokens: Option<&'a [f32]>,
    /// Host-tier overlap blocks.
    pub host_blocks: Option<&'a [f32]>,
    /// Disk-tier overlap blocks.
    pub disk_blocks: Option<&'a [f32]>,
    /// Shared-cache hits beyond the device prefix.
    pub shared_beyond_device: Option<&'a [f32]>,
    /// Decode blocks the request would add on each row (overrides
    /// [`KvRequest::added_decode_blocks`]).
    pub added_decode_blocks: Option<&'a [u32]>,
    /// Per-row multiplier from the request's preferred taints, precomputed by
    /// the host with [`preferred_taint_multiplier`](super::preferred_taint_multiplier).
    pub preferred_taint_multiplier: Option<&'a [f32]>,
}
