//! The simulator's view of a router: given one request and the cache overlap
//! each worker rank reports for it, pick a rank and book the request there;
//! later, tell the router when the prefill ends, as output blocks grow, and
//! when the request completes.
//!
//! [`Router`] is what the event loop calls. The implementation that matters
//! is [`super::service_router`], which drives selkie's real selection
//! service; this module only defines the contract.

use std::fmt;

/// The prefix overlap of one request on one rank, as a router's KV indexer
/// would report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowOverlap {
    /// The rank (row of the simulated fleet).
    pub row: u32,
    /// Leading prompt blocks resident in that rank's cache.
    pub blocks: u32,
}

/// One request, as the router sees it.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Identifies the booking in later calls.
    pub id: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens the request will generate (a router may know an estimate).
    pub output_tokens: u32,
    /// Overlaps for the ranks that have any.
    pub overlaps: &'a [RowOverlap],
    /// The prompt's block hashes, in order (what prefix hashing keys by).
    pub prompt_blocks: &'a [u64],
    /// The multi-turn session, if any.
    pub session: Option<u64>,
}

/// Where a request went, and how long the router took to decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routed {
    /// The chosen rank.
    pub row: usize,
    /// Time spent in the selection call itself, in nanoseconds.
    pub selection_ns: u64,
}

/// A router refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteError(pub String);

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RouteError {}

/// What the event loop needs from a router.
pub trait Router {
    /// Picks a rank for `request` and books it there.
    fn select(&mut self, request: &RouteRequest<'_>) -> Result<Routed, RouteError>;
    /// The request's prefill finished on its rank.
    fn prefill_complete(&mut self, id: u64);
    /// The request filled one more output block.
    fn output_block(&mut self, id: u64);
    /// The request completed: release its booking.
    fn release(&mut self, id: u64);
    /// Simulated time has reached `now_ms` (called before every event's
    /// calls; never goes back). Default: nothing to do.
    fn advance_to(&mut self, now_ms: f64) {
        let _ = now_ms;
    }
    /// The block size the router counts overlaps in, if it has one (a
    /// selection service's): [`simulate`](super::run::simulate) refuses a
    /// workload of another. Default: `None`, any workload.
    fn block_size(&self) -> Option<u32> {
        None
    }
}
