//! What a router hands selkie for one request: [`SelectionRequest`] and the
//! cache overlaps it may carry, keyed by worker rank ([`WorkerOverlap`]) or
//! indexed by the service's rows ([`RowOverlaps`], what a KV indexer that
//! mirrors the service's row layout produces).
//!
//! Everything is borrowed, so building a request allocates nothing.

use std::ops::Range;

use crate::types::{WorkerId, WorkerWithDpRank};

/// Cache overlap between the request's prompt and one worker rank (the
/// kernel's type: the kernel reads its fields where they lie, see
/// [`selkie_kernel::worker`]).
///
/// Build one with [`WorkerOverlap::device`] or field by field; the
/// `block_size` it is counted in must be the service's
/// ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size), 16 by
/// default): [`check_request`](crate::WorkerSelectionService::check_request)
/// finds overlaps counted in another.
pub use selkie_kernel::worker::WorkerOverlap;

/// The service's row layout at one moment: which epoch of the row
/// assignment (worker rank -> row) it is, how many rows a per-row
/// column must cover, and the service's block size (the tokens of the
/// blocks its columns count, [`ServiceConfig::block_size`](crate::ServiceConfig::block_size)).
///
/// Read it with
/// [`WorkerSelectionService::row_layout`](crate::WorkerSelectionService::row_layout)
/// *before* reading rows with
/// [`row_of`](crate::WorkerSelectionService::row_of); a selection whose
/// [`RowOverlaps`] carry another epoch than the service's is refused with
/// [`SelectionError::StaleRowLayout`](crate::SelectionError::StaleRowLayout),
/// so a row given to another worker in between never credits the wrong
/// worker. The epoch changes only when a worker rank gets or loses a row
/// (workers added or removed, ranks changed), not on state or load changes.
///
/// The block size travels with the layout so that a KV index meets the
/// service's where it syncs to its rows:
/// [`KvIndex::sync_rows`](crate::kv_index::KvIndex::sync_rows) refuses a
/// layout whose block size is not the index's, before any query could
/// count its blocks in the service's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowLayout {
    pub(crate) epoch: u64,
    /// At most the fleet's capacity (16,384 rows).
    rows: u32,
    block_size: u32,
}

impl RowLayout {
    /// The layout of epoch `epoch` over `rows` rows (at most `u32::MAX`,
    /// far past any fleet) of blocks of `block_size` tokens.
    pub(crate) const fn new(epoch: u64, rows: usize, block_size: u32) -> Self {
        RowLayout {
            epoch,
            rows: if rows > u32::MAX as usize {
                u32::MAX
            } else {
                rows as u32
            },
            block_size,
        }
    }

    /// The epoch of the row assignment.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Rows every column of a [`RowOverlaps`] must cover (at least; longer
    /// columns are fine). It only grows within one epoch.
    pub fn rows(&self) -> usize {
        self.rows as usize
    }

    /// Tokens per block of the service the layout is of
    /// ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size)).
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
}

/// A request's cache overlaps as per-row columns, indexed by the service's
/// rows: column `[row]` is the overlap with the worker rank in `row`
/// ([`WorkerSelectionService::row_of`](crate::WorkerSelectionService::row_of)).
///
/// The KV policy reads these columns as they are: nothing is copied,
/// translated or cleared per request. Every column given must be at least
/// [`RowLayout::rows`] long (else the selection fails with
/// [`SelectionError::OverlapColumnTooShort`](crate::SelectionError::OverlapColumnTooShort),
/// which names the column); rows without overlap hold 0. A missing
/// optional column counts as all zeros; without `cached_tokens` no tokens
/// count as cached (neither in the cost nor in the prefill tokens booked).
///
/// ```
/// use selkie::*;
/// let service = WorkerSelectionService::new(
///     WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
///     ServiceConfig::default(),
/// );
/// service.add_worker(WorkerRecord::new(1))?;
/// service.add_worker(WorkerRecord::new(2))?;
/// let layout = service.row_layout(); // first the layout, then the rows
/// let mut device = vec![0.0f32; layout.rows()];
/// let mut cached = vec![0.0f32; layout.rows()];
/// let row = service.row_of(WorkerWithDpRank::new(2, 0)).unwrap();
/// (device[row], cached[row]) = (64.0, 1024.0);
/// let overlaps = RowOverlaps::new(layout, &device).with_cached_tokens(&cached);
/// let req = SelectionRequest::new(1024).with_row_overlaps(overlaps);
/// assert_eq!(service.select(&req)?.worker(), WorkerWithDpRank::new(2, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowOverlaps<'a> {
    /// The layout the columns were computed against.
    pub layout: RowLayout,
    /// Prompt blocks resident on the device, per row.
    pub device_blocks: &'a [f32],
    /// Estimated prompt tokens already cached, per row.
    pub cached_tokens: Option<&'a [f32]>,
    /// Prompt blocks in the host (CPU-pinned) tier, per row.
    pub host_blocks: Option<&'a [f32]>,
    /// Prompt blocks in the disk tier, per row.
    pub disk_blocks: Option<&'a [f32]>,
    /// Shared-cache blocks beyond the device overlap, per row.
    pub shared_blocks: Option<&'a [f32]>,
}

impl<'a> RowOverlaps<'a> {
    /// Device-tier overlaps computed against `layout`; no other tier.
    pub fn new(layout: RowLayout, device_blocks: &'a [f32]) -> Self {
        RowOverlaps {
            layout,
            device_blocks,
            cached_tokens: None,
            host_blocks: None,
            disk_blocks: None,
            shared_blocks: None,
        }
    }

    /// Sets the cached tokens per row.
    pub fn with_cached_tokens(mut self, c: &'a [f32]) -> Self {
        self.cached_tokens = Some(c);
        self
    }

    /// Sets the host-tier blocks per row.
    pub fn with_host_blocks(mut self, c: &'a [f32]) -> Self {
        self.host_blocks = Some(c);
        self
    }

    /// Sets the disk-tier blocks per row.
    pub fn with_disk_blocks(mut self, c: &'a [f32]) -> Self {
        self.disk_blocks = Some(c);
        self
    }

    /// Sets the shared-cache blocks beyond the device overlap per row.
    pub fn with_shared_blocks(mut self, c: &'a [f32]) -> Self {
        self.shared_blocks = Some(c);
        self
    }

    /// Cached tokens on `row` (0 without the column).
    #[inline]
    pub(crate) fn cached_tokens_at(&self, row: usize) -> usize {
        self.cached_tokens.and_then(|c| c.get(row)).map_or(0, |&t| t as usize)
    }
}

/// A hard constraint on where a request may go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pin {
    /// Any rank of this worker.
    Worker(WorkerId),
    /// Exactly this rank of this worker.
    Rank(WorkerWithDpRank),
}

impl Pin {
    /// The pinned worker.
    pub fn worker_id(&self) -> WorkerId {
        match self {
            Pin::Worker(w) => *w,
            Pin::Rank(r) => r.worker_id,
        }
    }
}

/// How strongly a session sticks to its worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AffinityMode {
    /// Always the session's worker while it is registered and live and the
    /// session is remembered (if the worker is overloaded the request fails
    /// with [`crate::SelectionError::PinnedWorkerOverloaded`]); once the
    /// worker is removed, draining or cordoned, or the session was forgotten
    /// (idle past `session_idle_timeout`, or evicted from a full session
    /// table, see `ServiceConfig::max_sessions`), the next request is routed
    /// normally and rebinds the session.
    Hard,
    /// The session's worker when it is eligible, not busy and admits the
    /// booking (under its admission limit); otherwise a normal selection
    /// over the rest of the fleet, which rebinds the session.
    Soft,
}

/// A request's session, for session affinity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionAffinity<'a> {
    /// Session id.
    pub id: &'a str,
    /// Hard or soft affinity.
    pub mode: AffinityMode,
}

/// The decode blocks a request would add to each worker rank's load, in
/// the KV cost and in its booking.
///
/// Dynamo charges each rank the request's complete prompt blocks minus the
/// blocks that rank's active requests already hold
/// (`additional_active_blocks`), and nothing when the request carries no
/// block hashes (a decode pool); selkie's default charges
/// `ceil(isl_tokens / block_size)` on every rank. The booking of the chosen
/// rank adds the same number of decode blocks the cost charged it.
///
/// ```
/// use selkie::{AddedBlocks, WorkerWithDpRank};
/// let held = [(WorkerWithDpRank::new(1, 0), 0), (WorkerWithDpRank::new(2, 0), 64)];
/// let added = AddedBlocks::PerRank { blocks: &held, others: 64 };
/// assert_eq!(added.on(WorkerWithDpRank::new(1, 0), 64), 0);
/// assert_eq!(added.on(WorkerWithDpRank::new(3, 0), 64), 64);
/// assert_eq!(AddedBlocks::Prompt.on(WorkerWithDpRank::new(1, 0), 64), 64);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AddedBlocks<'a> {
    /// `ceil(isl_tokens / block_size)` on every rank.
    #[default]
    Prompt,
    /// The same number on every rank (0: Dynamo's charge for a request
    /// without block hashes).
    Uniform(u32),
    /// Per rank, in any order; a rank not listed adds `others`. A rank
    /// listed twice takes its last entry.
    PerRank {
        /// `(rank, blocks)` pairs.
        blocks: &'a [(WorkerWithDpRank, u32)],
        /// The blocks of every rank not in `blocks`.
        others: u32,
    },
}

impl AddedBlocks<'_> {
    /// The blocks added on `worker`, for a request of `prompt_blocks`
    /// (`ceil(isl_tokens / block_size)`). A linear search of a
    /// [`PerRank`](Self::PerRank) list (the selection reads a per-row
    /// column instead).
    pub fn on(&self, worker: WorkerWithDpRank, prompt_blocks: u32) -> u32 {
        match *self {
            AddedBlocks::Prompt => prompt_blocks,
            AddedBlocks::Uniform(n) => n,
            AddedBlocks::PerRank { blocks, others } => blocks
                .iter()
                .rev()
                .find(|(w, _)| *w == worker)
                .map_or(others, |&(_, n)| n),
        }
    }
}

/// Inputs of the KV cost that Dynamo's scheduler derives per worker rank
/// from its own request tracking and passes with each request, for a router
/// that has them (see the host docs' list of differences from Dynamo).
/// Set with [`SelectionRequest::with_rank_inputs`]; the default changes
/// nothing.
///
/// ```
/// use selkie::*;
/// let service = WorkerSelectionService::new(
///     WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Prefill),
///     ServiceConfig::default(),
/// );
/// service.add_worker(WorkerRecord::new(1))?;
/// service.add_worker(WorkerRecord::new(2))?;
/// // Worker 1 decodes 100 blocks and its active requests already hold the
/// // whole prompt; worker 2 decodes 80 and would add 64 blocks.
/// let mut running = Vec::new();
/// for (worker, n) in [(1, 100), (2, 80)] {
///     let one_block = SelectionRequest::new(16)
///         .pinned_to_rank(WorkerWithDpRank::new(worker, 0))
///         .with_track_prefill_tokens(false);
///     for _ in 0..n {
///         running.push(service.select(&one_block)?);
///     }
/// }
/// let held = [(WorkerWithDpRank::new(1, 0), 0), (WorkerWithDpRank::new(2, 0), 64)];
/// let inputs = KvRankInputs {
///     added_blocks: AddedBlocks::PerRank { blocks: &held, others: 64 },
///     ..KvRankInputs::default()
/// };
/// let req = SelectionRequest::new(1024).with_rank_inputs(&inputs);
/// // 64 + 100 + 0 against 64 + 80 + 64: worker 1, as Dynamo picks.
/// assert_eq!(service.peek(&req)?.worker(), WorkerWithDpRank::new(1, 0));
/// // Without the per-rank blocks both add 64: worker 2.
/// assert_eq!(service.peek(&SelectionRequest::new(1024))?.worker(), WorkerWithDpRank::new(2, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvRankInputs<'a> {
    /// The decode blocks the request would add on each rank.
    pub added_blocks: AddedBlocks<'a>,
    /// Ranks without a load observation: Dynamo's defaulted load, every
    /// load signal read as 0 (the whole prompt charged as prefill, no
    /// decode blocks, none added, no active requests). Their bookings
    /// still count in selkie's fleet.
    pub unobserved_load: &'a [WorkerWithDpRank],
    /// Prompt blocks held in a shared cache, as sorted, non-overlapping,
    /// non-empty half-open ranges of block positions (Dynamo's
    /// `SharedCacheHits`): every rank is credited
    /// `shared_cache_multiplier * (hits at positions >= its device overlap)`,
    /// in place of the per-entry [`WorkerOverlap::shared_blocks`].
    pub shared_cache_hits: &'a [Range<u32>],
}

impl KvRankInputs<'_> {
    /// Whether [`shared_cache_hits`](Self::shared_cache_hits) is sorted,
    /// non-overlapping and without empty ranges.
    pub fn shared_cache_hits_are_valid(&self) -> bool {
        self.shared_cache_hits.iter().all(|r| r.start < r.end)
            && self.shared_cache_hits.windows(2).all(|w| w[0].end <= w[1].start)
    }

    /// Shared-cache hits at block positions `>= from` (Dynamo's
    /// `SharedCacheHits::hits_beyond`).
    ///
    /// ```
    /// use selkie::KvRankInputs;
    /// let hits = [0..4, 10..12];
    /// let inputs = KvRankInputs { shared_cache_hits: &hits, ..KvRankInputs::default() };
    /// assert_eq!(inputs.shared_hits_beyond(0), 6);
    /// assert_eq!(inputs.shared_hits_beyond(2), 4);
    /// assert_eq!(inputs.shared_hits_beyond(11), 1);
    /// ```
    pub fn shared_hits_beyond(&self, from: u32) -> u32 {
        self.shared_cache_hits
            .iter()
            .map(|r| if r.end <= from { 0 } else { r.end - r.start.max(from) })
            .sum()
    }
}

/// Per-request overrides of the KV cost weights; `None` keeps the
/// policy's value.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvCostOverrides {
    /// `overlap_score_credit`.
    pub overlap_score_credit: Option<f64>,
    /// `prefill_load_scale`.
    pub prefill_load_scale: Option<f64>,
    /// `decode_active_request_weight`.
    pub decode_active_request_weight: Option<f64>,
    /// `host_cache_hit_weight`.
    pub host_cache_hit_weight: Option<f64>,
    /// `disk_cache_hit_weight`.
    pub disk_cache_hit_weight: Option<f64>,
    /// `shared_cache_multiplier` (the credit per shared-cache hit beyond the
    /// device overlap).
    pub shared_cache_multiplier: Option<f64>,
}

/// One request to route.
///
/// ```
/// use selkie::{SelectionRequest, WorkerOverlap, WorkerWithDpRank};
/// let overlaps = [WorkerOverlap::device(WorkerWithDpRank::new(3, 0), 8, 16)];
/// let req = SelectionRequest::new(2048).with_overlaps(&overlaps).with_temperature(0.5);
/// assert_eq!(req.isl_tokens, 2048);
/// ```
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct SelectionRequest<'a> {
    /// Prompt length in tokens.
    pub isl_tokens: usize,
    /// Cache overlaps, for the workers that have any, in any order (each
    /// entry is mapped to its row through a flat table, a few instructions
    /// per entry).
    pub overlaps: &'a [WorkerOverlap],
    /// Cache overlaps indexed by row; when set, the policies read these
    /// and not [`overlaps`](Self::overlaps).
    pub row_overlaps: Option<RowOverlaps<'a>>,
    /// Only these workers may serve the request (`None`: any).
    pub allowed_worker_ids: Option<&'a [WorkerId]>,
    /// A worker or rank the request must go to.
    pub pin: Option<Pin>,
    /// Taints the worker must all carry.
    pub required_taints: &'a [&'a str],
    /// Taints that make a worker cheaper (positive weight) or dearer
    /// (negative weight) under the KV policy.
    pub preferred_taints: &'a [(&'a str, f32)],
    /// LoRA adapter the request needs.
    pub lora: Option<&'a str>,
    /// Session affinity.
    pub session: Option<SessionAffinity<'a>>,
    /// Whether the request's prompt tokens count as prefill load.
    pub track_prefill_tokens: bool,
    /// Router temperature override.
    pub temperature: Option<f64>,
    /// KV cost weight overrides.
    pub kv_overrides: Option<KvCostOverrides>,
    /// Expected output length, if known (passed to plugins).
    pub expected_output_tokens: Option<u32>,
    /// Cache hits a row needs to count as a full hit under the device-aware
    /// policy (0: the policy's
    /// [`DeviceAwareConfig::required_cache_hits`](crate::DeviceAwareConfig::required_cache_hits),
    /// itself 0, no cache preference, by default). A row's hits are its
    /// overlap's `device_blocks`.
    pub required_cache_hits: u32,
    /// The prompt's block hashes, in order (as the KV index hashes them,
    /// at the service's block size): the prefix-hash policy keys the
    /// request by the leading ones. Nothing looks them up in a KV index:
    /// the `kv` policy reads overlaps, and refuses a request that carries
    /// hashes and no overlaps
    /// ([`SelectionError::PromptBlocksUnused`](crate::SelectionError::PromptBlocksUnused)).
    pub prompt_blocks: &'a [u64],
    /// The prefix-hash policy's key, when the caller hashes the prompt
    /// itself (takes precedence over [`prompt_blocks`](Self::prompt_blocks)).
    pub prefix_key: Option<u64>,
    /// Per-rank KV cost inputs a router tracks itself (see
    /// [`KvRankInputs`]); `None`: selkie's defaults.
    pub rank_inputs: Option<&'a KvRankInputs<'a>>,
    /// Fill in the runner-up in the selection's explanation (one more pass).
    pub explain: bool,
}

impl<'a> SelectionRequest<'a> {
    /// A request of `isl_tokens` prompt tokens and nothing else.
    pub const fn new(isl_tokens: usize) -> Self {
        SelectionRequest {
            isl_tokens,
            overlaps: &[],
            row_overlaps: None,
            allowed_worker_ids: None,
            pin: None,
            required_taints: &[],
            preferred_taints: &[],
            lora: None,
            session: None,
            track_prefill_tokens: true,
            temperature: None,
            kv_overrides: None,
            expected_output_tokens: None,
            required_cache_hits: 0,
            prompt_blocks: &[],
            prefix_key: None,
            rank_inputs: None,
            explain: false,
        }
    }

    /// Sets the cache overlaps.
    pub fn with_overlaps(mut self, overlaps: &'a [WorkerOverlap]) -> Self {
        self.overlaps = overlaps;
        self
    }

    /// Sets the cache overlaps as per-row columns (see [`RowOverlaps`]);
    /// they take precedence over [`with_overlaps`](Self::with_overlaps).
    pub fn with_row_overlaps(mut self, overlaps: RowOverlaps<'a>) -> Self {
        self.row_overlaps = Some(overlaps);
        self
    }

    /// Restricts the request to `ids`.
    pub fn with_allowed_workers(mut self, ids: &'a [WorkerId]) -> Self {
        self.allowed_worker_ids = Some(ids);
        self
    }

    /// Pins the request to any rank of `worker_id` (direct routing).
    pub fn pinned_to_worker(mut self, worker_id: WorkerId) -> Self {
        self.pin = Some(Pin::Worker(worker_id));
        self
    }

    /// Pins the request to one rank.
    pub fn pinned_to_rank(mut self, worker: WorkerWithDpRank) -> Self {
        self.pin = Some(Pin::Rank(worker));
        self
    }

    /// Requires taints.
    pub fn with_required_taints(mut self, taints: &'a [&'a str]) -> Self {
        self.required_taints = taints;
        self
    }

    /// Prefers taints.
    pub fn with_preferred_taints(mut self, taints: &'a [(&'a str, f32)]) -> Self {
        self.preferred_taints = taints;
        self
    }

    /// Requires a LoRA adapter.
    pub fn with_lora(mut self, adapter: &'a str) -> Self {
        self.lora = Some(adapter);
        self
    }

    /// Sets the session.
    pub fn with_session(mut self, id: &'a str, mode: AffinityMode) -> Self {
        self.session = Some(SessionAffinity { id, mode });
        self
    }

    /// Sets whether prefill tokens are tracked.
    pub fn with_track_prefill_tokens(mut self, track: bool) -> Self {
        self.track_prefill_tokens = track;
        self
    }

    /// Overrides the router temperature.
    pub fn with_temperature(mut self, t: f64) -> Self {
        self.temperature = Some(t);
        self
    }

    /// Overrides KV cost weights.
    pub fn with_kv_overrides(mut self, o: KvCostOverrides) -> Self {
        self.kv_overrides = Some(o);
        self
    }

    /// Sets the expected output length.
    pub fn with_expected_output_tokens(mut self, n: u32) -> Self {
        self.expected_output_tokens = Some(n);
        self
    }

    /// Sets the prompt's block hashes, in order (the prefix-hash policy
    /// keys the request by its configured number of leading blocks). For
    /// the `kv` policy, look them up in a
    /// [`KvIndex`](crate::kv_index::KvIndex) and pass its overlaps
    /// ([`with_row_overlaps`](Self::with_row_overlaps)) instead: it refuses
    /// hashes without overlaps
    /// ([`SelectionError::PromptBlocksUnused`](crate::SelectionError::PromptBlocksUnused)).
    /// See [`WorkerSelectionPolicy::reads_prompt_blocks`](crate::WorkerSelectionPolicy::reads_prompt_blocks).
    pub fn with_prompt_blocks(mut self, blocks: &'a [u64]) -> Self {
        self.prompt_blocks = blocks;
        self
    }

    /// Sets the prefix-hash policy's key directly, for a caller that hashes
    /// the prompt's prefix itself (KubeAI hashes its first characters).
    pub fn with_prefix_key(mut self, key: u64) -> Self {
        self.prefix_key = Some(key);
        self
    }

    /// Sets the cache hits the device-aware policy requires.
    pub fn with_required_cache_hits(mut self, n: u32) -> Self {
        self.required_cache_hits = n;
        self
    }

    /// Sets the per-rank KV cost inputs (see [`KvRankInputs`]).
    pub fn with_rank_inputs(mut self, inputs: &'a KvRankInputs<'a>) -> Self {
        self.rank_inputs = Some(inputs);
        self
    }

    /// Asks for the runner-up in the explanation.
    pub fn explained(mut self) -> Self {
        self.explain = true;
        self
    }

    /// `ceil(isl_tokens / block_size)`.
    pub fn request_blocks(&self, block_size: u32) -> u64 {
        (self.isl_tokens as u64).div_ceil(block_size.max(1) as u64)
    }
}
