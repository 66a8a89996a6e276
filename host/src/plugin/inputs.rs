//! What plugins read about each candidate: the per-group values
//! ([`WorkerLoadInput`], [`WorkerCacheInput`], [`WorkerOccupancy`]), the
//! host-owned row they come from, and the views that restrict each
//! component to the groups it declared ([`WorkerCandidate`],
//! [`WorkerCandidates`], [`WorkerInputView`]).
//!
//! Views borrow the host's scratch: creating or iterating them copies
//! nothing and allocates nothing.

use super::WorkerInputs;
use crate::discovery::DeviceKind;
use crate::types::WorkerWithDpRank;

/// Active-load values of one worker rank ([`WorkerInputs::LOAD`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerLoadInput {
    pub(crate) available: bool,
    pub(crate) active_prefill_tokens: usize,
    pub(crate) decode_cost_blocks: f64,
    pub(crate) active_requests: usize,
}

impl WorkerLoadInput {
    /// Whether a load observation exists for this row.
    pub fn is_available(&self) -> bool {
        self.available
    }
    /// Tokens in this rank's prefill stage.
    pub fn active_prefill_tokens(&self) -> usize {
        self.active_prefill_tokens
    }
    /// Active decode blocks plus the blocks this request would add.
    pub fn decode_cost_blocks(&self) -> f64 {
        self.decode_cost_blocks
    }
    /// Requests in flight, booked ones included.
    pub fn active_requests(&self) -> usize {
        self.active_requests
    }
}

/// Cache overlap of one worker rank ([`WorkerInputs::CACHE`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerCacheInput {
    pub(crate) device_blocks: f64,
    pub(crate) host_blocks: f64,
    pub(crate) disk_blocks: f64,
    pub(crate) shared_blocks: f64,
    pub(crate) cached_tokens: usize,
}

impl WorkerCacheInput {
    /// Device-resident prefix overlap, in KV blocks.
    pub fn device_overlap_blocks(&self) -> f64 {
        self.device_blocks
    }
    /// Host-tier overlap, in KV blocks.
    pub fn host_overlap_blocks(&self) -> f64 {
        self.host_blocks
    }
    /// Disk-tier overlap, in KV blocks.
    pub fn disk_overlap_blocks(&self) -> f64 {
        self.disk_blocks
    }
    /// Shared-cache blocks beyond the device overlap.
    pub fn shared_blocks(&self) -> f64 {
        self.shared_blocks
    }
    /// Estimated cached prompt tokens.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }
}

/// Occupancy of one worker rank ([`WorkerInputs::OCCUPANCY`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerOccupancy {
    pub(crate) active_requests: u32,
    pub(crate) capacity_weight: f32,
}

impl WorkerOccupancy {
    /// Requests in flight, booked ones included.
    pub fn active_requests(&self) -> u32 {
        self.active_requests
    }
    /// The worker's capacity weight.
    pub fn capacity_weight(&self) -> f32 {
        self.capacity_weight
    }
}

/// Host-owned row data, materialised once per selection for the union of
/// the policy's declared inputs.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CandidateData {
    pub(crate) worker: WorkerWithDpRank,
    pub(crate) row: usize,
    pub(crate) load: WorkerLoadInput,
    pub(crate) cache: WorkerCacheInput,
    pub(crate) occupancy: WorkerOccupancy,
    pub(crate) preferred_taint_multiplier: Option<f64>,
    pub(crate) device: DeviceKind,
}

/// One candidate row, restricted to the inputs its reader declared.
#[derive(Clone, Copy)]
pub struct WorkerCandidate<'a> {
    data: &'a CandidateData,
    inputs: WorkerInputs,
}

impl<'a> WorkerCandidate<'a> {
    pub(crate) fn new(data: &'a CandidateData, inputs: WorkerInputs) -> Self {
        WorkerCandidate { data, inputs }
    }
    /// Worker and rank (always available).
    pub fn worker(self) -> WorkerWithDpRank {
        self.data.worker
    }
    /// Load, if [`WorkerInputs::LOAD`] was declared.
    pub fn load(self) -> Option<&'a WorkerLoadInput> {
        self.inputs.contains(WorkerInputs::LOAD).then_some(&self.data.load)
    }
    /// Cache overlap, if [`WorkerInputs::CACHE`] was declared.
    pub fn cache(self) -> Option<&'a WorkerCacheInput> {
        self.inputs.contains(WorkerInputs::CACHE).then_some(&self.data.cache)
    }
    /// Occupancy, if [`WorkerInputs::OCCUPANCY`] was declared.
    pub fn occupancy(self) -> Option<&'a WorkerOccupancy> {
        self.inputs
            .contains(WorkerInputs::OCCUPANCY)
            .then_some(&self.data.occupancy)
    }
    /// Preferred-taint multiplier, if [`WorkerInputs::PREFERRED_TAINT`] was
    /// declared and the request prefers taints (and is not pinned).
    pub fn preferred_taint_multiplier(self) -> Option<f64> {
        if self.inputs.contains(WorkerInputs::PREFERRED_TAINT) {
            self.data.preferred_taint_multiplier
        } else {
            None
        }
    }
    /// Device kind, if [`WorkerInputs::DEVICE_AWARE`] was declared.
    pub fn device(self) -> Option<DeviceKind> {
        self.inputs
            .contains(WorkerInputs::DEVICE_AWARE)
            .then_some(self.data.device)
    }
}

/// The candidate batch a scorer scores, restricted to its declared inputs.
#[derive(Clone, Copy)]
pub struct WorkerCandidates<'a> {
    rows: &'a [CandidateData],
    inputs: WorkerInputs,
}

impl<'a> WorkerCandidates<'a> {
    pub(crate) fn new(rows: &'a [CandidateData], inputs: WorkerInputs) -> Self {
        WorkerCandidates { rows, inputs }
    }
    /// The same batch, restricted further to `inputs` (for a scorer that
    /// runs scorers of its own).
    pub(crate) fn restricted(self, inputs: WorkerInputs) -> Self {
        WorkerCandidates {
            rows: self.rows,
            inputs: self.inputs & inputs,
        }
    }
    /// Number of candidates (the length of the cost buffer).
    pub fn len(self) -> usize {
        self.rows.len()
    }
    /// Whether there are no candidates.
    pub fn is_empty(self) -> bool {
        self.rows.is_empty()
    }
    /// One candidate.
    pub fn get(self, row: usize) -> Option<WorkerCandidate<'a>> {
        self.rows.get(row).map(|d| WorkerCandidate::new(d, self.inputs))
    }
    /// All candidates, in row order.
    pub fn iter(self) -> impl ExactSizeIterator<Item = WorkerCandidate<'a>> + Clone {
        self.rows.iter().map(move |d| WorkerCandidate::new(d, self.inputs))
    }
}

/// One candidate and its total cost after all scorers ran (Dynamo's
/// `ScoredWorkerCandidate`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScoredWorkerCandidate {
    pub(crate) worker: WorkerWithDpRank,
    pub(crate) cost: f64,
    pub(crate) preferred_taint_multiplier: Option<f64>,
}

impl ScoredWorkerCandidate {
    /// Worker and rank.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.worker
    }
    /// Sum of the scorers' contributions (0 without scorers).
    pub fn cost(&self) -> f64 {
        self.cost
    }
    /// The preferred-taint multiplier, when the picker declared
    /// [`WorkerInputs::PREFERRED_TAINT`] and the request prefers taints.
    pub fn preferred_taint_multiplier(&self) -> Option<f64> {
        self.preferred_taint_multiplier
    }
}

/// Index-aligned columns of the picker's declared inputs.
#[derive(Clone, Copy)]
pub(crate) struct PickerColumns<'a> {
    pub(crate) scored: &'a [ScoredWorkerCandidate],
    pub(crate) load: Option<&'a [WorkerLoadInput]>,
    pub(crate) cache: Option<&'a [WorkerCacheInput]>,
}

/// What the picker sees: the candidates with their summed costs, as
/// index-aligned columns (row `i` of every column is the same worker rank).
#[derive(Clone, Copy)]
pub struct WorkerInputView<'a> {
    rows: &'a [CandidateData],
    costs: &'a [f64],
    columns: PickerColumns<'a>,
    inputs: WorkerInputs,
}

impl<'a> WorkerInputView<'a> {
    pub(crate) fn new(
        rows: &'a [CandidateData],
        costs: &'a [f64],
        columns: PickerColumns<'a>,
        inputs: WorkerInputs,
    ) -> Self {
        debug_assert_eq!(rows.len(), costs.len());
        debug_assert_eq!(rows.len(), columns.scored.len());
        WorkerInputView {
            rows,
            costs,
            columns,
            inputs,
        }
    }
    /// Number of candidates.
    pub fn len(self) -> usize {
        self.rows.len()
    }
    /// Whether there are no candidates.
    pub fn is_empty(self) -> bool {
        self.rows.is_empty()
    }
    /// The candidates and their total costs (Dynamo's `candidates()`).
    pub fn candidates(self) -> &'a [ScoredWorkerCandidate] {
        self.columns.scored
    }
    /// Total cost of each candidate, index-aligned.
    pub fn costs(self) -> &'a [f64] {
        self.costs
    }
    /// Load of each candidate, if the picker declared [`WorkerInputs::LOAD`].
    pub fn load(self) -> Option<&'a [WorkerLoadInput]> {
        self.columns.load
    }
    /// Cache overlap of each candidate, if the picker declared [`WorkerInputs::CACHE`].
    pub fn cache(self) -> Option<&'a [WorkerCacheInput]> {
        self.columns.cache
    }
    /// One candidate's declared signals.
    pub fn candidate(self, row: usize) -> Option<WorkerCandidate<'a>> {
        self.rows.get(row).map(|d| WorkerCandidate::new(d, self.inputs))
    }
    /// All candidates' declared signals, index-aligned with [`costs`](Self::costs).
    pub fn iter(self) -> impl ExactSizeIterator<Item = WorkerCandidate<'a>> + Clone {
        self.rows.iter().map(move |d| WorkerCandidate::new(d, self.inputs))
    }
}
