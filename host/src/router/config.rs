//! What `selkie serve` is told at start: [`ServeConfig`] (where to listen,
//! the workers, the policy, the prompt tools) and [`Limits`] (every bound
//! the router holds to, each with its default).
//!
//! Everything is checked by [`ServeConfig::validate`] before the router
//! binds its port: a bound of zero, a timeout of zero, a block size that is
//! not a power of two, a worker URL that is not `http://host:port`, or
//! bounds that need more file descriptors than the process may open is an
//! error that names the option, its value and the bound. Nothing here does
//! I/O except the open-files check.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::error::ServeError;
use crate::WorkerSelectionPolicyParameters;

/// The policy `selkie serve` routes with.
#[derive(Clone, Debug)]
pub enum PolicySpec {
    /// A type of the policy registry (`kv`, `least-loaded`, `prefix-hash`,
    /// ...), with its parameters (empty: the type's defaults).
    Named {
        /// The registry type name.
        name: String,
        /// Its parameters, as in a worker-selection config file.
        parameters: WorkerSelectionPolicyParameters,
    },
    /// A worker-selection config file (what `selkie tune` writes): the
    /// policy its `aggregated` role selects, its lengths in blocks
    /// converted to [`ServeConfig::block_size`] when the file states
    /// another block size.
    ConfigFile(PathBuf),
}

impl Default for PolicySpec {
    /// The `kv` policy with Dynamo's default weights.
    fn default() -> Self {
        PolicySpec::Named {
            name: "kv".to_owned(),
            parameters: WorkerSelectionPolicyParameters::default(),
        }
    }
}

impl PolicySpec {
    /// Parses a `--policy` value: a registry type name (`least-loaded`) or
    /// `TYPE:PARAMETERS` with the parameters as inline YAML, as in a
    /// config file (`kv:{switch_margin_relative: 0.3}`).
    ///
    /// ```
    /// use selkie::router::PolicySpec;
    /// let PolicySpec::Named { name, parameters } = PolicySpec::parse("kv:{router_temperature: 0.5}")? else {
    ///     unreachable!()
    /// };
    /// assert_eq!(name, "kv");
    /// assert!(!parameters.is_empty());
    /// assert!(PolicySpec::parse("kv:{unclosed").is_err());
    /// # Ok::<(), selkie::router::ServeError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Self, ServeError> {
        let (name, parameters) = match text.split_once(':') {
            Some((name, yaml)) => {
                let parameters: WorkerSelectionPolicyParameters =
                    serde_saphyr::from_str(yaml).map_err(|e| ServeError::Invalid {
                        option: "--policy",
                        value: text.to_owned(),
                        bound: format!("TYPE or TYPE:{{inline YAML parameters}} ({e})"),
                    })?;
                (name, parameters)
            }
            None => (text, WorkerSelectionPolicyParameters::default()),
        };
        Ok(PolicySpec::Named {
            name: name.trim().to_owned(),
            parameters,
        })
    }
}

/// Workers from etcd (feature `etcd`): the records under a key prefix, as
/// [`EtcdDiscovery`](crate::EtcdDiscovery) watches them; each record names
/// its worker's URL in the label `url`.
#[cfg(feature = "etcd")]
#[derive(Clone, Debug)]
pub struct EtcdWorkers {
    /// etcd's client endpoints (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// The key prefix the workers register under.
    pub prefix: String,
    /// Timeouts, credentials and TLS.
    pub options: crate::EtcdOptions,
}

/// Every bound `selkie serve` holds to. Each is a command-line option of
/// the same name (`max_body_bytes` is `--max-body-bytes`); when one is hit
/// the router answers as documented on the field and counts it in
/// `selkie_bound_hits_total{bound="<field>"}`. The configured values are
/// reported as `selkie_limit{bound="<field>"}`.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// The largest request body read (default 16 MiB). Larger: 413, before
    /// the body is read when `Content-Length` says so.
    pub max_body_bytes: usize,
    /// Requests proxied at once (default 8,192). Past it: 503 with
    /// `Retry-After`, nothing booked.
    pub max_concurrent_requests: usize,
    /// Client connections open at once (default 8,192). At the bound the
    /// router stops accepting until one closes (the kernel's backlog holds
    /// the rest).
    pub max_connections: usize,
    /// Concurrent streams on one HTTP/2 client connection (default 1,024).
    pub max_streams_per_connection: u32,
    /// Prompt tokens hashed per request (default 262,144). A longer prompt
    /// is routed by load (`selkie_unhashed_requests_total{reason="prompt_too_long"}`).
    pub max_prompt_tokens: usize,
    /// Prompt text tokenized per request, in bytes (default 1 MiB), so a
    /// large body cannot keep a tokenizer thread busy. Longer: routed by
    /// load (`reason="prompt_too_long"`).
    pub max_tokenize_bytes: usize,
    /// Blocks the router's own prefix index holds (the `kv` policy without
    /// engine events learns from its decisions; default 4,194,304, about
    /// 0.5 GiB). At the bound new decisions are not recorded until records
    /// expire.
    pub max_index_blocks: usize,
    /// Connecting to a worker (default 5 s). A refused or timed-out
    /// connection is retried once on the next choice; then 502.
    pub connect_timeout: Duration,
    /// From sending a request to the worker's response head (default
    /// 600 s: a worker may queue it). Past it: 504, the booking released.
    pub response_timeout: Duration,
    /// Between two chunks of a worker's response body (default 300 s). Past
    /// it the response is cut (the client sees the connection end without
    /// the final chunk) and the booking released.
    pub stream_idle_timeout: Duration,
    /// Reading a client's request body (default 60 s). Past it: 408.
    pub body_read_timeout: Duration,
    /// Reading a client's request head (default 30 s). Past it the
    /// connection is closed.
    pub header_read_timeout: Duration,
    /// After SIGTERM, how long in-flight responses may take to finish
    /// (default 30 s); then they are cut and the process exits 0.
    pub shutdown_timeout: Duration,
    /// Idle connections kept open to each worker (default 1,024).
    pub max_idle_per_worker: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 16 << 20,
            max_concurrent_requests: 8192,
            max_connections: 8192,
            max_streams_per_connection: 1024,
            max_prompt_tokens: 262_144,
            max_tokenize_bytes: 1 << 20,
            max_index_blocks: 1 << 22,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(300),
            body_read_timeout: Duration::from_secs(60),
            header_read_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            max_idle_per_worker: 1024,
        }
    }
}

/// File descriptors kept free for everything but connections: the
/// listener, the runtime, the tokenizer and template files, discovery.
pub const RESERVED_FDS: u64 = 128;

impl Limits {
    /// The bounds by name, as reported in `selkie_limit{bound}` (durations
    /// in seconds).
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("max_body_bytes", self.max_body_bytes as f64),
            ("max_concurrent_requests", self.max_concurrent_requests as f64),
            ("max_connections", self.max_connections as f64),
            ("max_streams_per_connection", f64::from(self.max_streams_per_connection)),
            ("max_prompt_tokens", self.max_prompt_tokens as f64),
            ("max_tokenize_bytes", self.max_tokenize_bytes as f64),
            ("max_index_blocks", self.max_index_blocks as f64),
            ("connect_timeout", self.connect_timeout.as_secs_f64()),
            ("response_timeout", self.response_timeout.as_secs_f64()),
            ("stream_idle_timeout", self.stream_idle_timeout.as_secs_f64()),
            ("body_read_timeout", self.body_read_timeout.as_secs_f64()),
            ("header_read_timeout", self.header_read_timeout.as_secs_f64()),
            ("shutdown_timeout", self.shutdown_timeout.as_secs_f64()),
            ("max_idle_per_worker", self.max_idle_per_worker as f64),
        ]
    }

    /// Checks every bound (none may be zero) and that the connection
    /// bounds fit in `open_files` descriptors: `max_connections +
    /// max_concurrent_requests + RESERVED_FDS` (each proxied request holds
    /// one connection to its worker).
    pub fn validate(&self, open_files: Option<u64>) -> Result<(), ServeError> {
        let counts = [
            ("--max-body-bytes", self.max_body_bytes as u64),
            ("--max-concurrent-requests", self.max_concurrent_requests as u64),
            ("--max-connections", self.max_connections as u64),
            (
                "--max-streams-per-connection",
                u64::from(self.max_streams_per_connection),
            ),
            ("--max-prompt-tokens", self.max_prompt_tokens as u64),
            ("--max-tokenize-bytes", self.max_tokenize_bytes as u64),
            ("--max-index-blocks", self.max_index_blocks as u64),
            ("--max-idle-per-worker", self.max_idle_per_worker as u64),
        ];
        for (option, value) in counts {
            if value == 0 {
                return Err(ServeError::Invalid {
                    option,
                    value: "0".into(),
                    bound: "must be at least 1".into(),
                });
            }
        }
        let times = [
            ("--connect-timeout", self.connect_timeout),
            ("--response-timeout", self.response_timeout),
            ("--stream-idle-timeout", self.stream_idle_timeout),
            ("--body-read-timeout", self.body_read_timeout),
            ("--header-read-timeout", self.header_read_timeout),
            ("--shutdown-timeout", self.shutdown_timeout),
        ];
        for (option, value) in times {
            if value.is_zero() {
                return Err(ServeError::Invalid {
                    option,
                    value: "0".into(),
                    bound: "must be positive".into(),
                });
            }
        }
        if let Some(limit) = open_files {
            let needed = (self.max_connections as u64)
                .saturating_add(self.max_concurrent_requests as u64)
                .saturating_add(RESERVED_FDS);
            if needed > limit {
                return Err(ServeError::OpenFiles {
                    max_connections: self.max_connections,
                    max_concurrent_requests: self.max_concurrent_requests,
                    needed,
                    limit,
                });
            }
        }
        Ok(())
    }
}

/// Everything `selkie serve` is told at start.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where to listen (default `127.0.0.1:8000`).
    pub listen: SocketAddr,
    /// Workers given on the command line (`http://host:port`, one
    /// `--worker` each).
    pub workers: Vec<String>,
    /// A workers file (YAML, JSON or TOML by extension), re-read when it
    /// changes.
    pub workers_file: Option<PathBuf>,
    /// Workers from etcd (feature `etcd`).
    #[cfg(feature = "etcd")]
    pub etcd: Option<EtcdWorkers>,
    /// How often the workers file and etcd's watch are polled (default 1 s).
    pub discovery_interval: Duration,
    /// The policy.
    pub policy: PolicySpec,
    /// Tokens per KV block: prompts are hashed in blocks of this size
    /// (default 16; a power of two).
    pub block_size: u32,
    /// A Hugging Face `tokenizer.json`: text prompts are tokenized with it.
    pub tokenizer: Option<PathBuf>,
    /// Without a tokenizer, text stands for its tokens four bytes at a time
    /// (`--text-as-bytes`): text prompts, and chat messages (rendered with
    /// the chat template when there is one, else their JSON as sent), are
    /// cut into 4-byte pieces, each one token, and hashed in blocks of
    /// those. Equal text prefixes get equal blocks, so `prefix-hash` and
    /// the `kv` policy's own learned overlaps keep prompts that share a
    /// prefix together with no tokenizer to run; token counts are
    /// estimates. Not with engines' KV events (their blocks are of real
    /// tokens) nor with a tokenizer.
    pub text_as_bytes: bool,
    /// A Jinja chat template: chat messages are rendered with it, then
    /// tokenized.
    pub chat_template: Option<PathBuf>,
    /// Requests each worker rank may hold at once, for workers whose entry
    /// sets none (default: unlimited). At the limit everywhere: 429.
    pub max_active: Option<u32>,
    /// How often each worker's `/v1/models` is read, for workers whose
    /// entry does not list their models (default 30 s).
    pub models_refresh: Duration,
    /// How long the router's own prefix index remembers a routing decision
    /// (default 120 s, as Dynamo's approximate mode).
    pub index_ttl: Duration,
    /// The `Retry-After` of a 429 or 503 (default 1 s).
    pub retry_after: Duration,
    /// Serving threads (default: one per core): each a single-threaded
    /// runtime with its own listener on the same address and its own
    /// connections to the workers, sharing the router and its bounds.
    pub threads: Option<usize>,
    /// Seed of the policy's random choices (default: from the clock).
    pub seed: Option<u64>,
    /// The bounds.
    pub limits: Limits,
    /// Engines' KV event endpoints (`--kv-events`): with any, cache
    /// overlaps come from the engines' events (see
    /// [`kv_events`](super::kv_events)).
    pub kv_events: Vec<super::kv_events::KvEventsSpec>,
    /// How blocks are keyed to meet the engines' (`--kv-hash`, default
    /// `tokens`).
    pub kv_hash: super::kv_events::KvHashing,
    /// Where the endpoint picker door listens (`--ext-proc-port`, on
    /// `--host`): Envoy's external processing protocol over gRPC (see
    /// [`ext_proc`](super::ext_proc)). Default: no picker door.
    pub ext_proc: Option<SocketAddr>,
    /// Fallback endpoints the picker names after its choice
    /// (`--ext-proc-fallbacks`, default 2, at most
    /// [`MAX_FALLBACKS`](super::ext_proc::MAX_FALLBACKS)).
    pub ext_proc_fallbacks: usize,
    /// Load and busy signals from the engines' own `/metrics`
    /// (`--engine-metrics-interval`; see
    /// [`engine_load`](super::engine_load)). Default: not read.
    pub engine_metrics: Option<super::engine_load::EngineMetricsConfig>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            workers: Vec::new(),
            workers_file: None,
            #[cfg(feature = "etcd")]
            etcd: None,
            discovery_interval: Duration::from_secs(1),
            policy: PolicySpec::default(),
            block_size: 16,
            tokenizer: None,
            text_as_bytes: false,
            chat_template: None,
            max_active: None,
            models_refresh: Duration::from_secs(30),
            index_ttl: crate::kv_index::DEFAULT_APPROX_TTL,
            retry_after: Duration::from_secs(1),
            threads: None,
            seed: None,
            limits: Limits::default(),
            kv_events: Vec::new(),
            kv_hash: super::kv_events::KvHashing::default(),
            ext_proc: None,
            ext_proc_fallbacks: 2,
            engine_metrics: None,
        }
    }
}

/// The most block size allowed (as the simulator's).
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

impl ServeConfig {
    /// Checks every field that needs no file or network (see the module
    /// docs); `open_files` is the process's open-files limit, if known.
    pub fn validate(&self, open_files: Option<u64>) -> Result<(), ServeError> {
        if !self.block_size.is_power_of_two() || self.block_size > MAX_BLOCK_SIZE {
            return Err(ServeError::Invalid {
                option: "--block-size",
                value: self.block_size.to_string(),
                bound: format!("a power of two, at most {MAX_BLOCK_SIZE}"),
            });
        }
        if self.max_active == Some(0) {
            return Err(ServeError::Invalid {
                option: "--max-active",
                value: "0".into(),
                bound: "must be at least 1".into(),
            });
        }
        if self.text_as_bytes {
            let other = if self.tokenizer.is_some() {
                Some("--tokenizer: text is tokenized with it; give one or the other")
            } else if !self.kv_events.is_empty() {
                Some("--kv-events: engines' blocks are of their tokens, which byte pieces never match")
            } else {
                None
            };
            if let Some(why) = other {
                return Err(ServeError::Invalid {
                    option: "--text-as-bytes",
                    value: "on".into(),
                    bound: format!("not with {why}"),
                });
            }
        }
        if self.threads == Some(0) {
            return Err(ServeError::Invalid {
                option: "--threads",
                value: "0".into(),
                bound: "must be at least 1".into(),
            });
        }
        for (option, value) in [
            ("--discovery-interval", self.discovery_interval),
            ("--models-refresh", self.models_refresh),
            ("--index-ttl", self.index_ttl),
        ] {
            if value.is_zero() {
                return Err(ServeError::Invalid {
                    option,
                    value: "0".into(),
                    bound: "must be positive".into(),
                });
            }
        }
        for url in &self.workers {
            super::workers::WorkerUrl::parse(url)?;
        }
        if self.ext_proc_fallbacks > super::ext_proc::MAX_FALLBACKS {
            return Err(ServeError::Invalid {
                option: "--ext-proc-fallbacks",
                value: self.ext_proc_fallbacks.to_string(),
                bound: format!("at most {}", super::ext_proc::MAX_FALLBACKS),
            });
        }
        if let Some(addr) = self.ext_proc {
            if addr == self.listen && addr.port() != 0 {
                return Err(ServeError::Invalid {
                    option: "--ext-proc-port",
                    value: addr.port().to_string(),
                    bound: "must differ from --port".into(),
                });
            }
        }
        if let Some(m) = &self.engine_metrics {
            for (option, value) in [
                ("--engine-metrics-interval", m.interval),
                ("--engine-metrics-staleness", m.staleness),
            ] {
                if value.is_zero() {
                    return Err(ServeError::Invalid {
                        option,
                        value: "0".into(),
                        bound: "must be positive".into(),
                    });
                }
            }
            if !(m.queue_threshold.is_finite() && m.queue_threshold >= 1.0) {
                return Err(ServeError::Invalid {
                    option: "--engine-queue-threshold",
                    value: m.queue_threshold.to_string(),
                    bound: "at least 1".into(),
                });
            }
            if !(m.kv_usage_threshold > 0.0 && m.kv_usage_threshold <= 1.0) {
                return Err(ServeError::Invalid {
                    option: "--engine-kv-usage-threshold",
                    value: m.kv_usage_threshold.to_string(),
                    bound: "above 0, at most 1".into(),
                });
            }
        }
        self.limits.validate(open_files)
    }
}
