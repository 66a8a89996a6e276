//! `selkie serve`'s flags → [`ServeConfig`], and nothing else: the router
//! is `selkie::router`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use selkie::router::{run, Limits, PolicySpec, ServeConfig};

/// Seconds (fractions allowed) as a duration; 0 is passed on for the
/// router to refuse under the option's name.
fn seconds(text: &str) -> Result<Duration, String> {
    let s: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(s).map_err(|_| format!("{text:?}: seconds must be finite and not negative"))
}

/// `selkie serve`: the flags. Bounds default to [`Limits::default`].
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A worker (an OpenAI-compatible engine) at http://host:port (repeatable).
    #[arg(long = "worker", value_name = "URL")]
    workers: Vec<String>,
    /// A workers file (YAML, JSON or TOML), re-read when it changes: a list
    /// under `workers` of URLs or of {url, max_active_requests, models, ...}.
    #[arg(long, value_name = "FILE")]
    workers_file: Option<PathBuf>,
    /// How often the workers file (and etcd's watch) is polled, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds, default_value = "1")]
    discovery_interval: Duration,
    /// etcd client endpoints to take workers from (repeatable): records
    /// under --etcd-prefix, each with its URL in the label `url`.
    #[cfg(feature = "etcd")]
    #[arg(long = "etcd-endpoint", value_name = "URL")]
    etcd_endpoints: Vec<String>,
    /// The key prefix workers register under in etcd.
    #[cfg(feature = "etcd")]
    #[arg(long, default_value = "/selkie/workers/")]
    etcd_prefix: String,
    /// etcd user (the password is read from SELKIE_ETCD_PASSWORD).
    #[cfg(feature = "etcd")]
    #[arg(long)]
    etcd_user: Option<String>,
    /// CA certificates (PEM) that sign etcd's certificate.
    #[cfg(feature = "etcd")]
    #[arg(long, value_name = "FILE")]
    etcd_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for etcd; needs --etcd-key-file.
    #[cfg(feature = "etcd")]
    #[arg(long, value_name = "FILE", requires = "etcd_key_file")]
    etcd_cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[cfg(feature = "etcd")]
    #[arg(long, value_name = "FILE", requires = "etcd_cert_file")]
    etcd_key_file: Option<PathBuf>,
    /// The policy: a registry type name (kv, least-loaded, power-of-two,
    /// round-robin, random, prefix-hash, device-aware-weighted, direct,
    /// composed) or TYPE:{inline YAML parameters}.
    #[arg(long, value_name = "NAME", default_value = "kv", conflicts_with = "config")]
    policy: String,
    /// A worker-selection config file (what `selkie tune` writes): the
    /// policy of its `aggregated` role. A file that states `block_size` has
    /// its lengths in blocks converted to --block-size blocks.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Tokens per KV block: prompts are hashed in blocks of this size.
    #[arg(long, value_name = "TOKENS", default_value_t = 16)]
    block_size: u32,
    /// A Hugging Face tokenizer.json: text prompts are tokenized with it.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Without a tokenizer: text stands for its tokens four bytes at a
    /// time (text prompts, and chat messages rendered with the chat
    /// template or taken as their JSON), so prompts sharing a text prefix
    /// share blocks. Not with --tokenizer or --kv-events.
    #[arg(long)]
    text_as_bytes: bool,
    /// A Jinja chat template: chat messages are rendered with it, then
    /// tokenized.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Requests each worker rank may hold at once (workers whose entry sets
    /// none); every eligible worker at its limit: 429.
    #[arg(long, value_name = "N")]
    max_active: Option<u32>,
    /// How often each worker's /v1/models is read, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds, default_value = "30")]
    models_refresh: Duration,
    /// How long the prefix index remembers a routing decision, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds, default_value = "120")]
    index_ttl: Duration,
    /// An engine's KV event endpoint: WORKER_URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC][,mode=bind|connect]
    /// (repeatable; with any, cache overlaps come from the engines' events).
    #[arg(long = "kv-events", value_name = "SPEC")]
    kv_events: Vec<String>,
    /// How blocks are keyed to meet the engines': tokens (selkie's hash of
    /// each store's token ids) or engine-sha256-cbor[:PYTHONHASHSEED].
    #[arg(long = "kv-hash", value_name = "MODE", default_value = "tokens")]
    kv_hash: String,
    /// Also answer as a Gateway API endpoint picker: Envoy's external
    /// processing protocol (gRPC) on this port of --host.
    #[arg(long, value_name = "PORT")]
    ext_proc_port: Option<u16>,
    /// Fallback endpoints the picker names after its choice.
    #[arg(long, value_name = "N", default_value_t = 2)]
    ext_proc_fallbacks: usize,
    /// Read each engine's /metrics this often (seconds) for load and busy
    /// signals (requests waiting and running, KV cache usage).
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    engine_metrics_interval: Option<Duration>,
    /// Engine figures older than this (seconds) stop counting.
    #[arg(long, value_name = "SECS", value_parser = seconds, default_value = "2", requires = "engine_metrics_interval")]
    engine_metrics_staleness: Duration,
    /// Requests waiting at which an engine counts as busy (skipped).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 128.0,
        requires = "engine_metrics_interval"
    )]
    engine_queue_threshold: f64,
    /// KV cache usage (0 to 1) at which an engine counts as busy.
    #[arg(
        long,
        value_name = "FRACTION",
        default_value_t = 0.98,
        requires = "engine_metrics_interval"
    )]
    engine_kv_usage_threshold: f64,
    /// Retry-After of a 429 or 503, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds, default_value = "1")]
    retry_after: Duration,
    /// Serving threads, each with its own listener on the port (default:
    /// one per core).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Seed of the policy's random choices.
    #[arg(long)]
    seed: Option<u64>,
    /// Largest request body, in bytes (larger: 413).
    #[arg(long, value_name = "BYTES")]
    max_body_bytes: Option<usize>,
    /// Requests proxied at once (more: 503).
    #[arg(long, value_name = "N")]
    max_concurrent_requests: Option<usize>,
    /// Client connections open at once (more wait in the backlog).
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Concurrent streams on one HTTP/2 client connection.
    #[arg(long, value_name = "N")]
    max_streams_per_connection: Option<u32>,
    /// Prompt tokens hashed per request (longer: routed by load).
    #[arg(long, value_name = "TOKENS")]
    max_prompt_tokens: Option<usize>,
    /// Prompt text tokenized per request, in bytes (longer: routed by load).
    #[arg(long, value_name = "BYTES")]
    max_tokenize_bytes: Option<usize>,
    /// Blocks the prefix index holds.
    #[arg(long, value_name = "BLOCKS")]
    max_index_blocks: Option<usize>,
    /// Connecting to a worker, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    connect_timeout: Option<Duration>,
    /// From request to a worker's response head, in seconds (then 504).
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    response_timeout: Option<Duration>,
    /// Between two chunks of a worker's response, in seconds (then the
    /// response is cut).
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    stream_idle_timeout: Option<Duration>,
    /// Reading a client's request body, in seconds (then 408).
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    body_read_timeout: Option<Duration>,
    /// Reading a client's request head, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    header_read_timeout: Option<Duration>,
    /// After SIGTERM, how long open responses may take, in seconds.
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    shutdown_timeout: Option<Duration>,
    /// Idle connections kept open to each worker.
    #[arg(long, value_name = "N")]
    max_idle_per_worker: Option<usize>,
}

impl ServeArgs {
    fn config(self) -> Result<ServeConfig, selkie::router::ServeError> {
        let policy = match self.config {
            Some(path) => PolicySpec::ConfigFile(path),
            None => PolicySpec::parse(&self.policy)?,
        };
        let d = Limits::default();
        let limits = Limits {
            max_body_bytes: self.max_body_bytes.unwrap_or(d.max_body_bytes),
            max_concurrent_requests: self.max_concurrent_requests.unwrap_or(d.max_concurrent_requests),
            max_connections: self.max_connections.unwrap_or(d.max_connections),
            max_streams_per_connection: self.max_streams_per_connection.unwrap_or(d.max_streams_per_connection),
            max_prompt_tokens: self.max_prompt_tokens.unwrap_or(d.max_prompt_tokens),
            max_tokenize_bytes: self.max_tokenize_bytes.unwrap_or(d.max_tokenize_bytes),
            max_index_blocks: self.max_index_blocks.unwrap_or(d.max_index_blocks),
            connect_timeout: self.connect_timeout.unwrap_or(d.connect_timeout),
            response_timeout: self.response_timeout.unwrap_or(d.response_timeout),
            stream_idle_timeout: self.stream_idle_timeout.unwrap_or(d.stream_idle_timeout),
            body_read_timeout: self.body_read_timeout.unwrap_or(d.body_read_timeout),
            header_read_timeout: self.header_read_timeout.unwrap_or(d.header_read_timeout),
            shutdown_timeout: self.shutdown_timeout.unwrap_or(d.shutdown_timeout),
            max_idle_per_worker: self.max_idle_per_worker.unwrap_or(d.max_idle_per_worker),
        };
        #[cfg(feature = "etcd")]
        let etcd = (!self.etcd_endpoints.is_empty()).then(|| {
            let mut options = selkie::EtcdOptions::default();
            if let Some(user) = self.etcd_user {
                options =
                    options.with_user_and_password(user, std::env::var("SELKIE_ETCD_PASSWORD").unwrap_or_default());
            }
            if let Some(ca) = self.etcd_ca_file {
                options = options.with_tls_ca_file(ca);
            }
            if let (Some(cert), Some(key)) = (self.etcd_cert_file, self.etcd_key_file) {
                options = options.with_client_certificate(cert, key);
            }
            selkie::router::EtcdWorkers {
                endpoints: self.etcd_endpoints,
                prefix: self.etcd_prefix,
                options,
            }
        });
        let engine_metrics =
            self.engine_metrics_interval
                .map(|interval| selkie::router::engine_load::EngineMetricsConfig {
                    interval,
                    staleness: self.engine_metrics_staleness,
                    queue_threshold: self.engine_queue_threshold,
                    kv_usage_threshold: self.engine_kv_usage_threshold,
                });
        Ok(ServeConfig {
            ext_proc: self.ext_proc_port.map(|p| SocketAddr::new(self.host, p)),
            ext_proc_fallbacks: self.ext_proc_fallbacks,
            engine_metrics,
            listen: SocketAddr::new(self.host, self.port),
            workers: self.workers,
            workers_file: self.workers_file,
            #[cfg(feature = "etcd")]
            etcd,
            discovery_interval: self.discovery_interval,
            policy,
            block_size: self.block_size,
            tokenizer: self.tokenizer,
            text_as_bytes: self.text_as_bytes,
            chat_template: self.chat_template,
            max_active: self.max_active,
            models_refresh: self.models_refresh,
            index_ttl: self.index_ttl,
            retry_after: self.retry_after,
            threads: self.threads,
            seed: self.seed,
            limits,
            kv_events: self
                .kv_events
                .iter()
                .map(|s| selkie::router::kv_events::KvEventsSpec::parse(s))
                .collect::<Result<_, _>>()?,
            kv_hash: selkie::router::kv_events::KvHashing::parse(&self.kv_hash).ok_or_else(|| {
                selkie::router::ServeError::Invalid {
                    option: "--kv-hash",
                    value: self.kv_hash.clone(),
                    bound: "tokens, engine-sha256-cbor or engine-sha256-cbor:SEED".to_owned(),
                }
            })?,
        })
    }
}

/// Runs the router until SIGTERM; a start-up error is printed and exits 1.
pub fn main(args: ServeArgs) -> ExitCode {
    match args.config().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
