//! [`WorkerSelectionContext`]: the request as filters, scorers and pickers
//! see it. Read-only; borrowed for one selection.

use crate::request::{Pin, SelectionRequest, SessionAffinity};
use crate::types::{WorkerType, WorkerWithDpRank};

/// Request-level values available to filters, scorers and pickers.
pub struct WorkerSelectionContext<'a> {
    pub(crate) request: &'a SelectionRequest<'a>,
    pub(crate) block_size: u32,
    pub(crate) worker_type: WorkerType,
    pub(crate) preview: bool,
}

impl WorkerSelectionContext<'_> {
    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.request.isl_tokens
    }
    /// Prompt length in KV blocks (`ceil(tokens / block_size)`).
    pub fn request_blocks(&self) -> u64 {
        self.request.request_blocks(self.block_size)
    }
    /// Tokens per KV block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Whether the prompt counts as prefill load.
    pub fn tracks_prefill_tokens(&self) -> bool {
        self.request.track_prefill_tokens
    }
    /// The pin the request carries (a worker, or one rank of it).
    pub fn pin(&self) -> Option<Pin> {
        self.request.pin
    }
    /// The exact worker rank the request is pinned to, if it is pinned to
    /// one rank (Dynamo's `pinned_worker`).
    pub fn pinned_worker(&self) -> Option<WorkerWithDpRank> {
        match self.request.pin {
            Some(Pin::Rank(w)) => Some(w),
            _ => None,
        }
    }
    /// The request's raw cache overlaps (per worker rank), as the router
    /// supplied them. Per-candidate values are on
    /// [`WorkerCandidate::cache`](crate::WorkerCandidate::cache) for components that declare
    /// [`WorkerInputs::CACHE`](crate::WorkerInputs::CACHE).
    pub fn overlaps(&self) -> &[crate::WorkerOverlap] {
        self.request.overlaps
    }
    /// The request's session, if any.
    pub fn session(&self) -> Option<SessionAffinity<'_>> {
        self.request.session
    }
    /// The request's router temperature override.
    pub fn router_temperature_override(&self) -> Option<f64> {
        self.request.temperature
    }
    /// The LoRA adapter the request needs.
    pub fn lora(&self) -> Option<&str> {
        self.request.lora
    }
    /// Expected output length, if the request carries one.
    pub fn expected_output_tokens(&self) -> Option<u32> {
        self.request.expected_output_tokens
    }
    /// The pool's role.
    pub fn worker_type(&self) -> WorkerType {
        self.worker_type
    }
    /// Whether this is a preview ([`crate::WorkerSelectionService::peek`]):
    /// nothing will be booked, so a plugin must not advance its own state.
    pub fn is_preview(&self) -> bool {
        self.preview
    }
}
