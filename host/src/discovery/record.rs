//! What discovery knows about one worker: [`WorkerRecord`] and its parts.
//!
//! A record is plain, serialisable data (JSON or TOML in a discovery file).
//! It says nothing about load: load lives in the kernel's fleet columns.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::error::DiscoveryError;
use crate::types::{DpRank, WorkerId};

/// Whether a worker takes new requests: the kernel's own state type, so
/// the state a record asks for is the state its fleet rows get.
pub use selkie_kernel::fleet::WorkerState;

/// Whether a worker runs on an accelerator or on CPUs (device-aware routing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A GPU or other accelerator.
    #[default]
    Accelerator,
    /// A CPU-only worker.
    Cpu,
}

/// Load levels above which a worker is *busy*: the hard filters skip it and
/// it counts as overloaded. A threshold is exceeded when the value is
/// strictly greater than it. `None` disables a threshold.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct BusyThresholds {
    /// Maximum active decode blocks (KV blocks held by running requests).
    pub active_decode_blocks: Option<u64>,
    /// Maximum active prefill tokens.
    pub active_prefill_tokens: Option<u64>,
    /// Maximum active prefill tokens as a fraction of the worker's batch
    /// budget (`max_num_batched_tokens`); ignored for workers without one.
    pub prefill_token_fraction: Option<f64>,
}

impl BusyThresholds {
    /// No thresholds.
    pub const NONE: BusyThresholds = BusyThresholds {
        active_decode_blocks: None,
        active_prefill_tokens: None,
        prefill_token_fraction: None,
    };

    /// Whether any threshold is set.
    pub fn is_set(&self) -> bool {
        self.active_decode_blocks.is_some()
            || self.active_prefill_tokens.is_some()
            || self.prefill_token_fraction.is_some()
    }

    /// The effective token limit for prefill tokens: the smaller of the
    /// absolute and the fractional limit (`u64::MAX` when neither applies).
    pub(crate) fn prefill_limit(&self, max_num_batched_tokens: Option<u64>) -> u64 {
        let abs = self.active_prefill_tokens.unwrap_or(u64::MAX);
        let frac = match (self.prefill_token_fraction, max_num_batched_tokens) {
            // `tokens > frac * budget` for integer tokens is `tokens > floor(frac * budget)`.
            (Some(f), Some(b)) => (f * b as f64).floor().clamp(0.0, u64::MAX as f64) as u64,
            _ => u64::MAX,
        };
        abs.min(frac)
    }
}

fn default_size() -> u32 {
    1
}
fn default_weight() -> f32 {
    1.0
}

/// One worker as discovery reports it.
///
/// ```
/// use selkie::WorkerRecord;
/// let w = WorkerRecord::new(7).with_dp(0, 4).with_taint("gpu=h200").with_lora("sql-adapter");
/// assert_eq!(w.dp_ranks(), 0..4);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRecord {
    /// The worker's id.
    pub worker_id: WorkerId,
    /// First data-parallel rank.
    #[serde(default)]
    pub data_parallel_start_rank: DpRank,
    /// Number of data-parallel ranks (each becomes one fleet row).
    #[serde(default = "default_size")]
    pub data_parallel_size: u32,
    /// Relative capacity (1.0 = one standard worker); least-loaded divides
    /// in-flight requests by it. Must be finite and positive, and not so
    /// small that its reciprocal overflows (`f32` subnormals are refused).
    #[serde(default = "default_weight")]
    pub capacity_weight: f32,
    /// Most requests a rank may hold at once (`None`: unlimited). Enforced
    /// atomically by the kernel's booking.
    #[serde(default)]
    pub max_active_requests: Option<u32>,
    /// Tokens one forward pass may batch; the base of
    /// [`BusyThresholds::prefill_token_fraction`].
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    /// Taints the worker carries (requests can require or prefer them).
    #[serde(default)]
    pub taints: BTreeSet<String>,
    /// Free-form labels, kept for the router (see
    /// [`crate::WorkerSelectionService::worker_status`]); not filtered on.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// LoRA adapters currently loaded.
    #[serde(default)]
    pub lora_adapters: BTreeSet<String>,
    /// Busy thresholds for this worker (`None`: the service's defaults).
    #[serde(default)]
    pub busy_thresholds: Option<BusyThresholds>,
    /// Accelerator or CPU worker.
    #[serde(default)]
    pub device: DeviceKind,
    /// Live, draining or cordoned.
    #[serde(default)]
    pub state: WorkerState,
}

impl WorkerRecord {
    /// A live accelerator worker with one rank (rank 0), weight 1 and nothing else.
    pub fn new(worker_id: WorkerId) -> Self {
        WorkerRecord {
            worker_id,
            data_parallel_start_rank: 0,
            data_parallel_size: 1,
            capacity_weight: 1.0,
            max_active_requests: None,
            max_num_batched_tokens: None,
            taints: BTreeSet::new(),
            labels: BTreeMap::new(),
            lora_adapters: BTreeSet::new(),
            busy_thresholds: None,
            device: DeviceKind::Accelerator,
            state: WorkerState::Live,
        }
    }

    /// Sets the data-parallel ranks `start .. start + size`.
    pub fn with_dp(mut self, start: DpRank, size: u32) -> Self {
        self.data_parallel_start_rank = start;
        self.data_parallel_size = size;
        self
    }

    /// Sets the capacity weight.
    pub fn with_capacity_weight(mut self, weight: f32) -> Self {
        self.capacity_weight = weight;
        self
    }

    /// Sets the per-rank admission limit.
    pub fn with_max_active_requests(mut self, limit: u32) -> Self {
        self.max_active_requests = Some(limit);
        self
    }

    /// Sets the batch budget.
    pub fn with_max_num_batched_tokens(mut self, tokens: u64) -> Self {
        self.max_num_batched_tokens = Some(tokens);
        self
    }

    /// Adds a taint.
    pub fn with_taint(mut self, taint: impl Into<String>) -> Self {
        self.taints.insert(taint.into());
        self
    }

    /// Adds a label.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds a loaded LoRA adapter.
    pub fn with_lora(mut self, adapter: impl Into<String>) -> Self {
        self.lora_adapters.insert(adapter.into());
        self
    }

    /// Sets this worker's busy thresholds.
    pub fn with_busy_thresholds(mut self, thresholds: BusyThresholds) -> Self {
        self.busy_thresholds = Some(thresholds);
        self
    }

    /// Sets the device kind.
    pub fn with_device(mut self, device: DeviceKind) -> Self {
        self.device = device;
        self
    }

    /// Sets the state.
    pub fn with_state(mut self, state: WorkerState) -> Self {
        self.state = state;
        self
    }

    /// The worker's ranks.
    pub fn dp_ranks(&self) -> std::ops::Range<DpRank> {
        self.data_parallel_start_rank..self.data_parallel_start_rank.saturating_add(self.data_parallel_size)
    }

    /// Checks the fields a fleet row depends on, and that the worker's ranks
    /// fit in the fleet's rows at all.
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        let invalid = |reason| {
            Err(DiscoveryError::InvalidWorker {
                worker_id: self.worker_id,
                reason,
            })
        };
        if self.data_parallel_size == 0 {
            return invalid("data_parallel_size must be at least 1");
        }
        if self
            .data_parallel_start_rank
            .checked_add(self.data_parallel_size)
            .is_none()
        {
            return invalid("data-parallel ranks overflow u32");
        }
        if self.data_parallel_size as usize > crate::fleet::HostFleet::CAPACITY {
            return Err(DiscoveryError::TooManyRanks {
                worker_id: self.worker_id,
                data_parallel_size: self.data_parallel_size,
                capacity: crate::fleet::HostFleet::CAPACITY,
            });
        }
        if !selkie_kernel::fleet::capacity_weight_ok(self.capacity_weight) {
            return invalid("capacity_weight must be finite and positive, with a finite reciprocal (>= about 3e-39)");
        }
        if let Some(t) = &self.busy_thresholds {
            if t.prefill_token_fraction.is_some_and(|f| !(f.is_finite() && f >= 0.0)) {
                return invalid("busy_thresholds.prefill_token_fraction must be finite and >= 0");
            }
        }
        Ok(())
    }
}
