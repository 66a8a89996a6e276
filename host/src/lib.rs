#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod config;
mod contain;
mod discovery;
mod error;
mod explain;
mod filter;
mod fleet;
pub mod kv_index;

#[cfg(feature = "engine-events")]
pub mod engine_events;
mod plugin;
mod policy;
#[cfg(feature = "nats")]
mod replica;
mod request;
#[cfg(any(feature = "nats", feature = "etcd"))]
mod secure;
mod service;
mod types;

pub use config::{
    WorkerSelectionConfig, WorkerSelectionInstance, MAX_CONFIG_BLOCK_SIZE, MAX_CONFIG_BYTES, MAX_CONFIG_COLLECTIONS,
    MAX_CONFIG_DEPTH,
};
pub use discovery::{
    BusyThresholds, DeviceKind, Discovery, FileDiscovery, InMemoryDiscovery, RefreshReport, SyncReport, WorkerRecord,
    WorkerState,
};
#[cfg(feature = "etcd")]
pub use discovery::{EtcdDiscovery, EtcdOptions, EtcdRegistration, EtcdWatchStatus};
#[cfg(any(feature = "nats", feature = "etcd"))]
pub use error::CredentialError;
#[cfg(feature = "nats")]
pub use error::SyncError;
pub use error::{
    BookingError, ConfigError, DiscoveryError, PluginKind, RegistryError, SelectionError, UnavailableReason,
    WorkerSelectionPolicyError, WorkerSelectionPolicyProviderError,
};
pub use explain::{Branch, CostTerms, Explanation, Route};
pub use fleet::{KernelFleet, FLEET_GROUPS};
pub use kv_index::{KvBlockHasher, KvEvent, KvEventData, KvEventError, KvIndex, KvOverlaps, StorageTier, StoredBlock};
pub use plugin::{
    ScoredWorkerCandidate, WorkerCacheInput, WorkerCandidate, WorkerCandidates, WorkerFilter, WorkerInputView,
    WorkerInputs, WorkerLoadInput, WorkerOccupancy, WorkerPicker, WorkerScorer, WorkerSelectionContext,
};
pub use policy::plugins::{
    ArgminPicker, CacheCreditParameters, CacheCreditScorer, DecodeParameters, DecodeScorer, PowerOfTwoPicker,
    PreferredTaintScorer, PrefillParameters, PrefillScorer, SeedParameters, SoftmaxParameters, SoftmaxPicker,
};
pub use policy::{
    prefix_key, DeviceAwareConfig, KvRouterConfig, PrefixHashConfig, WorkerPickerFactory, WorkerPickerProvider,
    WorkerScorerFactory, WorkerScorerProvider, WorkerSelectionPolicy, WorkerSelectionPolicyFactory,
    WorkerSelectionPolicyParameters, WorkerSelectionPolicyProvider, WorkerSelectionPolicyRegistry, BUILTIN_ALIASES,
    BUILTIN_PICKERS, BUILTIN_POLICIES, BUILTIN_SCORERS,
};
#[cfg(feature = "nats")]
pub use replica::{RefusedMessages, RemoteLoad, ReplicaSync, ReplicaSyncOptions, ReplicaSyncStats, SyncHealth};
pub use request::{
    AddedBlocks, AffinityMode, KvCostOverrides, KvRankInputs, Pin, RowLayout, RowOverlaps, SelectionRequest,
    SessionAffinity, WorkerOverlap,
};
/// The KV cost model's field check, whose error
/// [`WorkerSelectionPolicyProviderError::KvWeight`] carries.
pub use selkie_kernel::kernels::kv_cost::{KvConfigError, KvConfigField, KvConfigProblem};
pub use service::{
    Booked, DiscoveryHealth, DiscoveryPoller, FleetHandle, OwnedSelection, Preview, RankStatus, Selection,
    ServiceConfig, WorkerSelectionService, WorkerStatus,
};
#[cfg(feature = "nats")]
pub use service::{OverAdmission, ReplicaSyncThread};
pub use types::{DpRank, RankRow, RoutingPartitionRef, WorkerId, WorkerType, WorkerWithDpRank};

#[cfg(feature = "sim")]
pub mod sim;

#[cfg(feature = "serve")]
pub mod router;

/// The repository README's Rust examples, compiled and run with the
/// crate's doctests (`cargo test -p selkie --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct RepositoryReadme;
