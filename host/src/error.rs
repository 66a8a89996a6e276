//! The host's error types, one enum per concern.
//!
//! * [`SelectionError`]: why one request got no worker. Every variant is a
//!   distinct, matchable case: no endpoints, every eligible worker
//!   overloaded, every eligible worker removed by the policy's filters, a pin
//!   that is not allowed, overloaded or absent, a data-parallel rank that does
//!   not exist, and a broken plugin.
//! * [`WorkerSelectionPolicyError`]: a policy broke its contract (non-finite
//!   cost, out-of-range pick, panic) or reported its own failure.
//! * [`DiscoveryError`]: a worker table change was refused.
//! * [`WorkerSelectionPolicyProviderError`]: a policy could not be built
//!   (a configuration field out of bounds, parameters that do not fit).
//! * [`RegistryError`] and [`ConfigError`]: start-up problems (policy type
//!   names, config files).
//! * `SyncError` (feature `nats`): replica sync could not start (an option
//!   out of range, a NATS server that cannot be reached).
//! * `CredentialError` (features `nats`, `etcd`): a credential or TLS file
//!   named in the connection options cannot be used.
//!
//! Errors name the worker, row, scorer or limit involved. This module must not
//! contain logic beyond formatting, and it sits at the bottom of the host's
//! layers: it names only the plain types (`crate::types`) and the kernel's
//! errors, never discovery, policies or the service.

use std::path::PathBuf;

use thiserror::Error;

use selkie_kernel::kernels::kv_cost::KvConfigError;

use crate::types::{DpRank, WorkerId};

/// Why a pinned worker (or a session's hard-affinity worker) cannot take the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnavailableReason {
    /// No worker with this id is registered.
    Unknown,
    /// The worker is draining: it finishes its requests and takes no new ones.
    Draining,
    /// The worker is cordoned: it takes no new requests.
    Cordoned,
    /// The worker lacks a taint the request requires.
    MissingRequiredTaint,
}

impl UnavailableReason {
    /// A short lowercase label, as used in metrics.
    pub const fn as_str(&self) -> &'static str {
        match self {
            UnavailableReason::Unknown => "unknown",
            UnavailableReason::Draining => "draining",
            UnavailableReason::Cordoned => "cordoned",
            UnavailableReason::MissingRequiredTaint => "missing_required_taint",
        }
    }
}

/// Why a request got no worker.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum SelectionError {
    /// The worker table has no live row at all.
    #[error("no endpoints available to route work")]
    NoEndpoints,
    /// Workers are live, but the request's allowlist, required taints or LoRA
    /// requirement exclude every one of them.
    #[error("no live worker satisfies the request's allowlist, taints or adapter ({rejected} rows rejected)")]
    NoEligibleWorkers {
        /// Rows the hard filters rejected.
        rejected: usize,
    },
    /// Every worker that passed the other hard filters is over a busy
    /// threshold, marked overloaded, or at its admission limit.
    #[error("all eligible workers are overloaded")]
    AllEligibleWorkersOverloaded,
    /// The policy's own filters removed every eligible worker.
    #[error("all eligible workers were rejected by policy filters")]
    AllEligibleWorkersFiltered,
    /// The request pins a worker outside its own allowlist.
    #[error("pinned worker {worker_id} is not in allowed worker set")]
    PinnedWorkerNotAllowed {
        /// The pinned worker.
        worker_id: WorkerId,
    },
    /// The pinned worker is over a busy threshold or at its admission limit.
    #[error("pinned worker {worker_id} is overloaded")]
    PinnedWorkerOverloaded {
        /// The pinned worker.
        worker_id: WorkerId,
    },
    /// The pinned worker is absent, draining, cordoned or lacks a required taint.
    #[error("pinned worker {worker_id} is unavailable ({})", reason.as_str())]
    PinnedWorkerUnavailable {
        /// The pinned worker.
        worker_id: WorkerId,
        /// Why.
        reason: UnavailableReason,
    },
    /// The pinned data-parallel rank is outside the worker's ranks.
    #[error("worker {worker_id} dp_rank {dp_rank} is outside [{start}, {end})")]
    DpRankUnavailable {
        /// The pinned worker.
        worker_id: WorkerId,
        /// The requested rank.
        dp_rank: DpRank,
        /// The worker's first rank.
        start: DpRank,
        /// One past the worker's last rank.
        end: DpRank,
    },
    /// The `direct` policy needs the request to name its worker.
    #[error("the direct policy needs a request that names its worker")]
    DirectWorkerMissing,
    /// A request field is out of range (negative temperature, zero block size, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The request's [`RowOverlaps`](crate::RowOverlaps) were computed
    /// against another row layout than the service's now (a worker got or
    /// lost a row since): recompute them against
    /// [`row_layout`](crate::WorkerSelectionService::row_layout).
    #[error("row overlaps computed for row layout {expected}, but the service's layout is {found}")]
    StaleRowLayout {
        /// The epoch the overlaps carry.
        expected: u64,
        /// The service's epoch.
        found: u64,
    },
    /// A column of the request's [`RowOverlaps`](crate::RowOverlaps) is
    /// shorter than the rows the selection scans.
    #[error("row overlap column {column} has {len} rows, the selection scans {rows}")]
    OverlapColumnTooShort {
        /// The column (`device_blocks`, `cached_tokens`, `host_blocks`,
        /// `disk_blocks` or `shared_blocks`).
        column: &'static str,
        /// Its length.
        len: usize,
        /// Rows it must cover ([`RowLayout::rows`](crate::RowLayout::rows)).
        rows: usize,
    },
    /// A cache overlap is longer than the request's prompt at the
    /// service's block size (only
    /// [`check_request`](crate::WorkerSelectionService::check_request)
    /// reports this; a selection takes overlaps as given).
    #[error("{column} of {} is {value}, past the prompt's {limit}", overlap_owner(*worker, *row))]
    OverlapPastPrompt {
        /// The overlap's worker rank (for a per-row column, the row's, if
        /// it has one).
        worker: Option<crate::types::WorkerWithDpRank>,
        /// The row, for a per-row column.
        row: Option<usize>,
        /// `device_blocks`, `host_blocks`, `disk_blocks`, `shared_blocks`
        /// (limit: the prompt's blocks) or `cached_tokens` (limit: its
        /// tokens).
        column: &'static str,
        /// The overlap's value (rounded up; `u64::MAX` for a NaN or a
        /// negative per-row value).
        value: u64,
        /// The prompt's blocks or tokens.
        limit: u64,
    },
    /// The request carries more block hashes
    /// ([`prompt_blocks`](crate::SelectionRequest::prompt_blocks)) than its
    /// prompt has blocks at the service's block size: they were cut at a
    /// smaller block size (only
    /// [`check_request`](crate::WorkerSelectionService::check_request)
    /// reports this).
    #[error(
        "the request carries {hashes} block hashes, past its prompt's {limit} blocks of {block_size} tokens (hashed at \
         another block size than the service's?)"
    )]
    PromptBlocksPastPrompt {
        /// The block hashes the request carries.
        hashes: u64,
        /// The prompt's blocks at the service's block size.
        limit: u64,
        /// The service's block size.
        block_size: u32,
    },
    /// The policy reads cache overlaps, not block hashes, and the request
    /// carries block hashes only
    /// ([`with_prompt_blocks`](crate::SelectionRequest::with_prompt_blocks),
    /// no overlaps): nothing would look them up, and every worker's cost
    /// would tie.
    #[error(
        "the {policy} policy reads cache overlaps, not block hashes: look the request's prompt_blocks up in a KV \
         index and pass its overlaps (with_row_overlaps or with_overlaps), or leave prompt_blocks off"
    )]
    PromptBlocksUnused {
        /// The policy's name.
        policy: &'static str,
    },
    /// The policy broke its contract or failed.
    #[error(transparent)]
    Policy(#[from] WorkerSelectionPolicyError),
}

/// "worker 2 rank 1", "row 7 (worker 2 rank 1)" or "row 7".
fn overlap_owner(worker: Option<crate::types::WorkerWithDpRank>, row: Option<usize>) -> String {
    match (row, worker) {
        (None, Some(w)) => format!("the overlap on {w}"),
        (Some(r), Some(w)) => format!("row {r} ({w})"),
        (Some(r), None) => format!("row {r}"),
        (None, None) => "an overlap".to_owned(),
    }
}

impl SelectionError {
    /// Whether the request failed because workers are overloaded (a caller may
    /// queue and retry).
    pub fn is_overload(&self) -> bool {
        matches!(
            self,
            Self::AllEligibleWorkersOverloaded | Self::PinnedWorkerOverloaded { .. }
        )
    }

    /// A short lowercase label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoEndpoints => "no_endpoints",
            Self::NoEligibleWorkers { .. } => "no_eligible_workers",
            Self::AllEligibleWorkersOverloaded => "all_overloaded",
            Self::AllEligibleWorkersFiltered => "all_filtered",
            Self::PinnedWorkerNotAllowed { .. } => "pinned_not_allowed",
            Self::PinnedWorkerOverloaded { .. } => "pinned_overloaded",
            Self::PinnedWorkerUnavailable { .. } => "pinned_unavailable",
            Self::DpRankUnavailable { .. } => "dp_rank_unavailable",
            Self::DirectWorkerMissing => "direct_worker_missing",
            Self::InvalidRequest(_) => "invalid_request",
            Self::StaleRowLayout { .. } => "stale_row_layout",
            Self::OverlapColumnTooShort { .. } => "overlap_column_too_short",
            Self::OverlapPastPrompt { .. } => "overlap_past_prompt",
            Self::PromptBlocksPastPrompt { .. } => "prompt_blocks_past_prompt",
            Self::PromptBlocksUnused { .. } => "prompt_blocks_unused",
            Self::Policy(p) => p.reason(),
        }
    }
}

/// Which kind of plugin misbehaved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginKind {
    /// A [`crate::WorkerFilter`].
    Filter,
    /// A [`crate::WorkerScorer`].
    Scorer,
    /// A [`crate::WorkerPicker`].
    Picker,
}

impl PluginKind {
    /// Lowercase name.
    pub const fn as_str(&self) -> &'static str {
        match self {
            PluginKind::Filter => "filter",
            PluginKind::Scorer => "scorer",
            PluginKind::Picker => "picker",
        }
    }
}

/// A policy broke the selection contract, or reported its own failure.
///
/// Each is an error for the one request; the service keeps serving.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum WorkerSelectionPolicyError {
    /// A plugin reported a failure of its own.
    #[error("worker selection policy failed: {0}")]
    Failed(String),
    /// A scorer wrote a NaN or infinite contribution, or the running total
    /// became non-finite.
    #[error("scorer {scorer_index} ({scorer}) produced a non-finite cost for candidate row {row}")]
    NonFiniteCost {
        /// Position of the scorer in the policy.
        scorer_index: usize,
        /// The scorer's [`name`](crate::WorkerScorer::name).
        scorer: &'static str,
        /// The candidate row.
        row: usize,
    },
    /// The picker returned a row past the end of the candidate table.
    #[error("picker returned candidate row {row}, but the candidate table contains {candidate_count} rows")]
    InvalidPickerRow {
        /// The row returned.
        row: usize,
        /// The number of candidates.
        candidate_count: usize,
    },
    /// A plugin panicked; the panic was caught and the service kept serving.
    #[error("{} {name} panicked: {message}", kind.as_str())]
    PluginPanicked {
        /// Filter, scorer or picker.
        kind: PluginKind,
        /// The plugin's name.
        name: &'static str,
        /// The panic payload, if it was a string.
        message: String,
    },
}

impl WorkerSelectionPolicyError {
    /// A plugin-reported failure.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::Failed(message.into())
    }

    /// A short lowercase label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Failed(_) => "policy_failed",
            Self::NonFiniteCost { .. } => "non_finite_cost",
            Self::InvalidPickerRow { .. } => "invalid_picker_row",
            Self::PluginPanicked { .. } => "plugin_panicked",
        }
    }
}

/// A worker table change was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// `add` for a worker id already registered.
    #[error("worker {worker_id} is already registered")]
    DuplicateWorker {
        /// The worker.
        worker_id: WorkerId,
    },
    /// `update`, `remove` or a state change for an unknown worker id.
    #[error("worker {worker_id} is not registered")]
    UnknownWorker {
        /// The worker.
        worker_id: WorkerId,
    },
    /// The fleet has no free row for another data-parallel rank.
    #[error(
        "worker table is full: worker {worker_id} needs {needed} new rows, {free} of {capacity} are free \
         ({retired} held by removed workers until their in-flight requests end)"
    )]
    FleetFull {
        /// The worker being added or changed.
        worker_id: WorkerId,
        /// New rows it needs (one per data-parallel rank it does not hold).
        needed: usize,
        /// Rows free for it.
        free: usize,
        /// Rows of removed workers (or dropped ranks) kept until the
        /// requests booked on them end.
        retired: usize,
        /// Rows the fleet holds.
        capacity: usize,
    },
    /// A record has more data-parallel ranks than the fleet has rows.
    #[error("worker {worker_id}: data_parallel_size {data_parallel_size} exceeds the fleet's {capacity} rows")]
    TooManyRanks {
        /// The worker.
        worker_id: WorkerId,
        /// Its `data_parallel_size`.
        data_parallel_size: u32,
        /// Rows the fleet holds.
        capacity: usize,
    },
    /// A record field is out of range.
    #[error("worker {worker_id}: {reason}")]
    InvalidWorker {
        /// The worker.
        worker_id: WorkerId,
        /// What is wrong.
        reason: &'static str,
    },
    /// The same worker id appears twice in one snapshot.
    #[error("worker {worker_id} appears twice in the discovery snapshot")]
    DuplicateInSnapshot {
        /// The worker.
        worker_id: WorkerId,
    },
    /// The discovery file could not be read.
    #[error("cannot read discovery file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The discovery file's format is one this build of selkie does not
    /// read: its feature (`toml`) is off.
    #[error("cannot read discovery file {path}: {format} discovery files need selkie's `{feature}` feature")]
    FormatNotBuilt {
        /// The file.
        path: PathBuf,
        /// `"TOML"`.
        format: &'static str,
        /// The cargo feature that reads it.
        feature: &'static str,
    },
    /// The discovery file could not be parsed.
    #[error("cannot parse discovery file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The discovery file is empty or has no `workers` list (a truncated
    /// file is not taken to mean "no workers": write `workers = []`,
    /// `{"workers": []}` or `[]` for that).
    #[error("discovery file {path} lists no workers (empty or truncated?); write an explicit empty `workers` list to remove every worker")]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },
    /// The discovery file is larger than a discovery file may be.
    #[error("discovery file {path} is {len} bytes, over the limit of {limit}")]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The most bytes a discovery file may have.
        limit: u64,
    },
    /// A record in a discovery file does not parse as a worker record (an
    /// unknown field, a value of the wrong type). It is refused on its own:
    /// the file's other records apply, and its worker keeps the record it
    /// had (or stays absent).
    #[error("discovery file {path}: cannot parse the record of worker {worker_id} (line {line}): {message}")]
    FileRecordParse {
        /// The file.
        path: PathBuf,
        /// The worker the record names.
        worker_id: WorkerId,
        /// The line the record starts on.
        line: usize,
        /// The parser's message.
        message: String,
    },
    /// A record in a discovery file parsed but cannot be taken: a field is
    /// out of range ([`WorkerRecord::validate`](crate::WorkerRecord::validate)),
    /// or its worker id appears more than once in the file. Refused on its
    /// own, as [`FileRecordParse`](Self::FileRecordParse).
    #[error("discovery file {path}: {source}")]
    FileRecordInvalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it ([`InvalidWorker`](Self::InvalidWorker),
        /// [`TooManyRanks`](Self::TooManyRanks) or
        /// [`DuplicateInSnapshot`](Self::DuplicateInSnapshot)).
        #[source]
        source: Box<DiscoveryError>,
    },
    /// A worker record in etcd is not JSON a [`WorkerRecord`](crate::WorkerRecord)
    /// parses from (or its key or value is not UTF-8). The key is refused;
    /// the other workers are served as before.
    #[cfg(feature = "etcd")]
    #[error("etcd key {key:?}: cannot parse the worker record: {message}")]
    EtcdRecordParse {
        /// The key holding the record.
        key: String,
        /// The parser's message.
        message: String,
    },
    /// A worker record in etcd parsed but a field is out of range
    /// ([`WorkerRecord::validate`](crate::WorkerRecord::validate) refused it).
    #[cfg(feature = "etcd")]
    #[error("etcd key {key:?}: {source}")]
    EtcdRecordInvalid {
        /// The key holding the record.
        key: String,
        /// What is wrong with it.
        #[source]
        source: Box<DiscoveryError>,
    },
    /// A worker record in etcd does not sit at its own key: the key must be
    /// the watched prefix followed by the record's `worker_id` in decimal.
    #[cfg(feature = "etcd")]
    #[error("etcd key {key:?} holds the record of worker {worker_id}; a record's key must be the prefix followed by its worker id")]
    EtcdKeyMismatch {
        /// The key holding the record.
        key: String,
        /// The worker id the record names.
        worker_id: WorkerId,
    },
    /// etcd could not be reached, or a request to it failed.
    #[cfg(feature = "etcd")]
    #[error("etcd at {endpoints}: {message}")]
    EtcdUnavailable {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What failed.
        message: String,
    },
    /// A credential or TLS file in the [`EtcdOptions`](crate::EtcdOptions)
    /// cannot be used, or the options do not fit the endpoints.
    #[cfg(feature = "etcd")]
    #[error("etcd: {0}")]
    EtcdCredentials(#[from] CredentialError),
    /// etcd refused this client: a wrong user or password, none where etcd
    /// requires one, or a user without permission on the prefix.
    #[cfg(feature = "etcd")]
    #[error("etcd at {endpoints} refused the client: authentication/authorization failed: {message}")]
    EtcdAuthenticationFailed {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// etcd's answer.
        message: String,
    },
    /// The TLS handshake with etcd failed: its certificate is not signed by
    /// a trusted CA (or does not name the endpoint's host), or it refused
    /// this client's certificate (or its absence).
    #[cfg(feature = "etcd")]
    #[error("etcd at {endpoints}: TLS failed: {message}")]
    EtcdTls {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What the TLS layer said.
        message: String,
    },
}

impl DiscoveryError {
    /// A short lowercase label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::DuplicateWorker { .. } => "duplicate_worker",
            Self::UnknownWorker { .. } => "unknown_worker",
            Self::FleetFull { .. } => "fleet_full",
            Self::TooManyRanks { .. } => "too_many_ranks",
            Self::InvalidWorker { .. } => "invalid_worker",
            Self::DuplicateInSnapshot { .. } => "duplicate_in_snapshot",
            Self::Io { .. } => "io",
            Self::Parse { .. } => "parse",
            Self::FormatNotBuilt { .. } => "format_not_built",
            Self::EmptyFile { .. } => "empty_file",
            Self::FileTooLarge { .. } => "file_too_large",
            Self::FileRecordParse { .. } => "file_record_parse",
            Self::FileRecordInvalid { .. } => "file_record_invalid",
            #[cfg(feature = "etcd")]
            Self::EtcdRecordParse { .. } => "etcd_record_parse",
            #[cfg(feature = "etcd")]
            Self::EtcdRecordInvalid { .. } => "etcd_record_invalid",
            #[cfg(feature = "etcd")]
            Self::EtcdKeyMismatch { .. } => "etcd_key_mismatch",
            #[cfg(feature = "etcd")]
            Self::EtcdUnavailable { .. } => "etcd_unavailable",
            #[cfg(feature = "etcd")]
            Self::EtcdCredentials(e) => e.reason(),
            #[cfg(feature = "etcd")]
            Self::EtcdAuthenticationFailed { .. } => "etcd_authentication_failed",
            #[cfg(feature = "etcd")]
            Self::EtcdTls { .. } => "etcd_tls",
        }
    }
}

/// A policy registry operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Policy type names may not be empty.
    #[error("worker-selection policy type must not be empty")]
    EmptyName,
    /// A custom provider tried to take a built-in policy's name.
    #[error("worker-selection policy type {name:?} is built in and cannot be replaced")]
    BuiltinName {
        /// The name.
        name: String,
    },
    /// The name is already registered.
    #[error("worker-selection policy type {name:?} is already registered")]
    Duplicate {
        /// The name.
        name: String,
    },
    /// No policy type of this name.
    #[error("unknown worker-selection policy type {name:?}; available policy types: {available}")]
    UnknownType {
        /// The name asked for.
        name: String,
        /// Every registered name, sorted, comma separated.
        available: String,
    },
    /// A scorer or picker type name may not be empty.
    #[error("{} type must not be empty", kind.as_str())]
    EmptyPluginName {
        /// Scorer or picker.
        kind: PluginKind,
    },
    /// A custom scorer or picker tried to take a built-in one's name.
    #[error("{} type {name:?} is built in and cannot be replaced", kind.as_str())]
    BuiltinPluginName {
        /// Scorer or picker.
        kind: PluginKind,
        /// The name.
        name: String,
    },
    /// The scorer or picker name is already registered.
    #[error("{} type {name:?} is already registered", kind.as_str())]
    DuplicatePlugin {
        /// Scorer or picker.
        kind: PluginKind,
        /// The name.
        name: String,
    },
    /// No scorer or picker type of this name.
    #[error("unknown {} type {name:?}; available {} types: {available}", kind.as_str(), kind.as_str())]
    UnknownPluginType {
        /// Scorer or picker.
        kind: PluginKind,
        /// The name asked for.
        name: String,
        /// Every registered name of that kind, sorted, comma separated.
        available: String,
    },
    /// A scorer or picker provider rejected its parameters.
    #[error("invalid parameters for {} type {plugin_type:?}: {source}", kind.as_str())]
    PluginProvider {
        /// Scorer or picker.
        kind: PluginKind,
        /// The scorer or picker type.
        plugin_type: String,
        /// The provider's error.
        #[source]
        source: Box<WorkerSelectionPolicyProviderError>,
    },
    /// The provider rejected the instance's parameters.
    #[error("invalid parameters for worker-selection policy type {policy_type:?}: {source}")]
    Provider {
        /// The policy type.
        policy_type: String,
        /// The provider's error.
        #[source]
        source: WorkerSelectionPolicyProviderError,
    },
}

/// Why a worker-selection policy could not be built: a configuration field
/// out of its bounds, parameters that do not fit the policy, or a custom
/// provider's own reason. The one error of policy construction: providers
/// return it (as in Dynamo), and so do [`KvRouterConfig::validate`],
/// [`PrefixHashConfig::validate`] and
/// [`WorkerSelectionPolicy::prefix_hash`].
///
/// [`KvRouterConfig::validate`]: crate::KvRouterConfig::validate
/// [`PrefixHashConfig::validate`]: crate::PrefixHashConfig::validate
/// [`WorkerSelectionPolicy::prefix_hash`]: crate::WorkerSelectionPolicy::prefix_hash
///
/// ```
/// use selkie::{KvRouterConfig, WorkerSelectionPolicyProviderError as E};
/// let c = KvRouterConfig { host_cache_hit_weight: 1.5, ..Default::default() };
/// let err = c.validate().unwrap_err();
/// assert_eq!(err.to_string(), "host_cache_hit_weight must be at most 1, got 1.5");
/// assert!(matches!(err, E::KvWeight { value: 1.5, .. }));
/// // A custom provider's own reason.
/// assert_eq!(E::new("threshold must be above 0").to_string(), "threshold must be above 0");
/// ```
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WorkerSelectionPolicyProviderError {
    /// A KV cost weight outside the bounds the cost model accepts; the
    /// source names the field and the bound.
    #[error("{source}, got {value}")]
    KvWeight {
        /// The value given.
        value: f64,
        /// The cost model's check
        /// ([`KvConfigField::check`](selkie_kernel::kernels::kv_cost::KvConfigField::check)).
        #[source]
        source: KvConfigError,
    },
    /// A field outside its range.
    #[error("{field} must be within {} ..= {}, got {value}", bound(*min), bound(*max))]
    OutOfRange {
        /// The field, as named in a config file.
        field: &'static str,
        /// The value given.
        value: f64,
        /// The least value allowed.
        min: f64,
        /// The largest value allowed.
        max: f64,
    },
    /// The parameters do not fit the policy's parameter type (an unknown
    /// field, a value of the wrong type, ...).
    #[error("{source}")]
    Parameters {
        /// What the deserializer said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The policy takes no parameters, and some were given.
    #[error("this policy takes no parameters")]
    UnexpectedParameters,
    /// A custom provider's own reason, for start-up diagnostics.
    #[error("{0}")]
    Custom(String),
    /// A scorer or picker of a `composed` policy could not be built (an
    /// unknown type, or parameters its provider refused).
    #[error("{0}")]
    Plugin(Box<RegistryError>),
}

/// A range bound for display: `f32::MAX` by name.
fn bound(v: f64) -> String {
    if v == f64::from(f32::MAX) {
        "f32::MAX".to_owned()
    } else {
        v.to_string()
    }
}

impl WorkerSelectionPolicyProviderError {
    /// A custom provider's own reason (Dynamo's
    /// `WorkerSelectionPolicyProviderError::new`).
    pub fn new(message: impl Into<String>) -> Self {
        Self::Custom(message.into())
    }
}

/// A worker-selection configuration file was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid YAML / TOML for the schema.
    #[error("cannot parse worker-selection config ({format}): {source}")]
    Parse {
        /// `"YAML"` or `"TOML"`.
        format: &'static str,
        /// The parser's error (its message names the line and column).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The file's format is one this build of selkie does not read: its
    /// feature (`yaml`, on by default, or `toml`) is off.
    #[error("cannot read config file {path}: {format} config files need selkie's `{feature}` feature")]
    FormatNotBuilt {
        /// The file.
        path: PathBuf,
        /// `"YAML"` or `"TOML"`.
        format: &'static str,
        /// The cargo feature that reads it.
        feature: &'static str,
    },
    /// The text is longer than a config may be (checked before parsing).
    #[error("worker-selection config is {len} bytes, over the limit of {limit}")]
    TooLarge {
        /// The text's length in bytes.
        len: usize,
        /// The most bytes a config may have.
        limit: usize,
    },
    /// The text nests deeper than a config may (checked before parsing:
    /// brackets, braces, indentation and `- ` entries).
    #[error("worker-selection config nests {depth} levels deep, over the limit of {limit}")]
    TooDeep {
        /// The depth reached when the limit was passed.
        depth: usize,
        /// The most levels a config may nest.
        limit: usize,
    },
    /// The config has more flow collections (`[` and `{`, counted anywhere
    /// in the text) than any real config needs.
    #[error("worker-selection config has {count} '[' or '{{', over the limit of {limit}")]
    TooManyCollections {
        /// Brackets and braces counted when the limit was passed.
        count: usize,
        /// The most a config may have.
        limit: usize,
    },
    /// An instance has an empty name or type.
    #[error("instance {index} of the worker-selection config has an empty name or type")]
    EmptyInstanceField {
        /// The instance's position in `instances` (from 0).
        index: usize,
    },
    /// An instance is named `default`, which means the kv policy.
    #[error("instance name \"default\" is reserved for the kv policy")]
    ReservedInstanceName,
    /// An instance's parameters are not a mapping.
    #[error("parameters of instance {instance:?} must be a mapping")]
    ParametersNotAMapping {
        /// The instance.
        instance: String,
    },
    /// Two instances have the same name.
    #[error("instance {instance:?} is defined twice")]
    DuplicateInstance {
        /// The name.
        instance: String,
    },
    /// A role names an instance that is not defined.
    #[error("{role} selects instance {name:?}, which is not defined; instances: {available}")]
    UnknownInstance {
        /// The role.
        role: &'static str,
        /// The name.
        name: String,
        /// Defined instance names.
        available: String,
    },
    /// The config's `block_size` is 0 or past
    /// [`MAX_CONFIG_BLOCK_SIZE`](crate::MAX_CONFIG_BLOCK_SIZE) (or a block
    /// size to resolve it at is).
    #[error("block_size must be within 1 ..= {limit}, got {value}")]
    InvalidBlockSize {
        /// The block size given.
        value: u32,
        /// The largest accepted.
        limit: u32,
    },
    /// The config states the block size its lengths are in, and was
    /// resolved without the service's
    /// ([`resolve`](crate::WorkerSelectionConfig::resolve)): resolve it with
    /// [`resolve_at`](crate::WorkerSelectionConfig::resolve_at).
    #[error(
        "the config's lengths are in blocks of {block_size} tokens: resolve it at the service's block size \
         (resolve_at), which converts them"
    )]
    BlockSizeUnresolved {
        /// The config's block size.
        block_size: u32,
    },
    /// A whole number of blocks of the config's block size is not a whole
    /// number of the service's.
    #[error(
        "instance {instance:?}: {field} = {value} blocks of {from} tokens is not a whole number of blocks of {to} \
         tokens"
    )]
    BlockSizeNotWhole {
        /// The instance.
        instance: String,
        /// The parameter (`prefix_blocks` or `required_cache_hits`).
        field: String,
        /// Its value, in blocks of `from` tokens.
        value: u64,
        /// The config's block size.
        from: u32,
        /// The service's.
        to: u32,
    },
    /// An instance of another block size than the service's uses a policy,
    /// scorer or picker type that is not built in: which of its parameters
    /// are lengths in blocks is unknown, so they cannot be converted.
    #[error(
        "instance {instance:?}: {plugin} is not built in, so its parameters cannot be converted from blocks of \
         {from} tokens to blocks of {to}: write the config at block_size {to}"
    )]
    BlockSizeUnknownUnits {
        /// The instance.
        instance: String,
        /// `policy type "x"`, `scorer type "x"` or `picker type "x"`.
        plugin: String,
        /// The config's block size.
        from: u32,
        /// The service's.
        to: u32,
    },
    /// Building the instance's policy failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// A change to a live booking was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BookingError {
    /// The booked worker was removed (or its ranks replaced) and its fleet
    /// row reused since the booking.
    #[error("worker {worker} was removed; the booking no longer holds load")]
    WorkerGone {
        /// The booked worker rank.
        worker: crate::types::WorkerWithDpRank,
    },
    /// The retarget destination is not registered.
    #[error("worker {worker} is not registered")]
    UnknownWorker {
        /// The destination.
        worker: crate::types::WorkerWithDpRank,
    },
    /// The retarget destination does not take new requests (draining, cordoned).
    #[error("worker {worker} does not take new requests")]
    NotLive {
        /// The destination.
        worker: crate::types::WorkerWithDpRank,
    },
    /// The retarget destination is at its admission limit.
    #[error("worker {worker} is at its admission limit of {limit}")]
    Overloaded {
        /// The destination.
        worker: crate::types::WorkerWithDpRank,
        /// Its limit.
        limit: u32,
    },
}

/// [`ReplicaSync`](crate::ReplicaSync) could not start (feature `nats`).
///
/// Once started, replica sync reports nothing through errors: a lost
/// server, a message that cannot be decoded or a full queue is logged and
/// counted in [`ReplicaSyncStats`](crate::ReplicaSyncStats), and the local
/// replica keeps selecting.
#[cfg(feature = "nats")]
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SyncError {
    /// An option is out of range.
    #[error("replica sync option `{option}` is {value}: {requirement}")]
    InvalidOption {
        /// The option's name in [`ReplicaSyncOptions`](crate::ReplicaSyncOptions).
        option: &'static str,
        /// The value given.
        value: String,
        /// What the option must be.
        requirement: &'static str,
    },
    /// The NATS server could not be reached, or refused the subscription.
    #[error("NATS server {server}: {message}")]
    Unavailable {
        /// The server's URL, as given (without credentials).
        server: String,
        /// What failed.
        message: String,
    },
    /// A credential or TLS file in the options cannot be used, or the
    /// options' credentials conflict with the URL's.
    #[error("replica sync: {0}")]
    Credentials(#[from] CredentialError),
    /// The server refused this client: a wrong or missing user and
    /// password, token, NKey or `.creds` file.
    #[error("NATS server {server} refused the client: authentication/authorization failed: {message}")]
    AuthenticationFailed {
        /// The server's URL, as given (without credentials).
        server: String,
        /// The client's account of the refusal.
        message: String,
    },
    /// The TLS handshake with the server failed: its certificate is not
    /// signed by a trusted CA (or does not name the URL's host), or it
    /// refused this client's certificate (or its absence).
    #[error("NATS server {server}: TLS failed: {message}")]
    Tls {
        /// The server's URL, as given (without credentials).
        server: String,
        /// What the TLS layer said.
        message: String,
    },
}

#[cfg(feature = "nats")]
impl SyncError {
    /// A short lowercase label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidOption { .. } => "invalid_option",
            Self::Unavailable { .. } => "unavailable",
            Self::Credentials(e) => e.reason(),
            Self::AuthenticationFailed { .. } => "authentication_failed",
            Self::Tls { .. } => "tls",
        }
    }
}

/// A credential or TLS file named in `ReplicaSyncOptions` (feature `nats`)
/// or `EtcdOptions` (feature `etcd`) cannot be used. Found before
/// connecting: the error names the option and the file, never the secret
/// in it.
#[cfg(any(feature = "nats", feature = "etcd"))]
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CredentialError {
    /// The file cannot be read.
    #[error("`{option}` file {path}: cannot read it: {source}")]
    Unreadable {
        /// The option naming the file (its builder method without `with_`).
        option: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not hold what the option needs (PEM certificates, a
    /// PEM private key, an NKey seed, a `.creds` file's JWT and seed).
    #[error("`{option}` file {path}: {problem}")]
    Invalid {
        /// The option naming the file (its builder method without `with_`).
        option: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A setting that cannot work where it is: credentials both in a URL
    /// and in the options, a TLS file with a plain `http://` endpoint.
    #[error("`{option}`: {problem}")]
    Misplaced {
        /// The option or argument involved.
        option: &'static str,
        /// What is wrong, and what to do instead.
        problem: String,
    },
}

#[cfg(any(feature = "nats", feature = "etcd"))]
impl CredentialError {
    /// A short lowercase label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Unreadable { .. } => "credential_unreadable",
            Self::Invalid { .. } => "credential_invalid",
            Self::Misplaced { .. } => "credential_misplaced",
        }
    }
}
