//! The plugin API of custom worker selection, with Dynamo's names and roles:
//! [`WorkerFilter`], [`WorkerScorer`], [`WorkerPicker`], the [`WorkerInputs`]
//! flags, the per-row [`WorkerCandidate`], the picker's [`WorkerInputView`]
//! and the request's [`WorkerSelectionContext`].
//!
//! Differences from Dynamo, on purpose: plugin methods take `&self` and the
//! traits are `Send + Sync`, so one policy instance serves many threads at
//! once without a lock (keep mutable state in atomics or thread-locals).
//!
//! This module defines the contract only; the host enforces it
//! (`crate::policy::composed`).
//!
//! * `inputs`: the signal groups and the views over one selection's rows.
//! * `context`: the request as plugins see it.

mod context;
mod inputs;

use crate::error::WorkerSelectionPolicyError;

pub use context::WorkerSelectionContext;
pub(crate) use inputs::{CandidateData, PickerColumns};
pub use inputs::{
    ScoredWorkerCandidate, WorkerCacheInput, WorkerCandidate, WorkerCandidates, WorkerInputView, WorkerLoadInput,
    WorkerOccupancy,
};

bitflags::bitflags! {
    /// Signal groups a plugin reads. The host computes only the union of what a
    /// policy's components declare, and each component sees only its own.
    ///
    /// ```
    /// use selkie::WorkerInputs;
    /// let both = WorkerInputs::LOAD | WorkerInputs::CACHE;
    /// assert!(both.contains(WorkerInputs::LOAD) && !both.contains(WorkerInputs::OCCUPANCY));
    /// assert_eq!(WorkerInputs::ALL, WorkerInputs::all());
    /// assert!(WorkerInputs::default().is_empty());
    /// ```
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct WorkerInputs: u8 {
        /// Cache overlaps per tier and estimated cached tokens.
        const CACHE = 1 << 0;
        /// Active prefill tokens, decode cost blocks and active requests.
        const LOAD = 1 << 1;
        /// The preferred-taint cost multiplier.
        const PREFERRED_TAINT = 1 << 2;
        /// Active requests (booked ones included) and capacity weight.
        const OCCUPANCY = 1 << 5;
        /// Device kind (CPU or accelerator).
        const DEVICE_AWARE = 1 << 6;
    }
}

impl WorkerInputs {
    /// No optional inputs (identity and cost only): [`empty`](Self::empty).
    pub const NONE: Self = Self::empty();
    /// Every group: [`all`](Self::all).
    pub const ALL: Self = Self::all();
}

/// Removes candidates from the policy's candidate set (a soft exclusion:
/// the host's hard filters have already run).
pub trait WorkerFilter: Send + Sync {
    /// A name for errors and logs.
    fn name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
    /// The signal groups [`keep`](Self::keep) reads.
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }
    /// `true` keeps the candidate.
    fn keep(
        &self,
        context: &WorkerSelectionContext<'_>,
        candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError>;
}

/// Adds one finite, lower-is-better cost to every candidate.
pub trait WorkerScorer: Send + Sync {
    /// A name for errors and logs.
    fn name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
    /// The signal groups [`score`](Self::score) reads.
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }
    /// Writes one contribution per candidate into `costs` (same length as
    /// `candidates`, filled with NaN before the call). The host checks every
    /// value and the running total for finiteness and sums the scorers.
    fn score(
        &self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError>;
}

/// Chooses one candidate after the scorers ran.
pub trait WorkerPicker: Send + Sync {
    /// A name for errors and logs.
    fn name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
    /// The signal groups [`pick`](Self::pick) reads.
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }
    /// Returns an index into `input` (row order is unspecified: look at the
    /// candidates, not at positions).
    fn pick(
        &self,
        context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError>;
}
