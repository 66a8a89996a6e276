//! `selkie serve`: an OpenAI-compatible HTTP router whose every decision
//! is the [`WorkerSelectionService`]'s (feature `serve`).
//!
//! ```text
//! client ──► http (front door) ──► request ──► prompt ──► route ──► service.select
//!               │                  (parse)    (tokens,    (SelectionRequest,
//!               │                              blocks)     booking)
//!               ◄── lifecycle ◄── upstream ◄──────────────────┘
//!                   (prefill, output blocks, release)
//! ```
//!
//! * [`request`](ParsedRequest): an OpenAI body → model, prompt, stream
//!   flag (one parser for every front door);
//! * [`prompt`](PromptHasher): prompt → token ids (as given, or with the
//!   `tokenizers` crate and a minijinja chat template) → KV block hashes;
//! * [`route`](RouterCore): the [`SelectionRequest`](crate::SelectionRequest) the policy needs, the
//!   selection and booking, the retry on the next choice;
//! * [`overlaps`](OverlapSource): where cache overlaps come from (the
//!   router's own decisions, [`LearnedOverlaps`], or the engines' KV
//!   events, [`kv_events`]);
//! * [`lifecycle`](Lifecycle): the booking follows the response;
//! * `upstream`: pooled connections to the workers, timeouts;
//! * [`metrics`](Metrics): what `/metrics` shows;
//! * `http`: the HTTP door; [`ext_proc`]: the endpoint picker door
//!   (Envoy's external processing protocol, for Gateway API inference
//!   gateways), on the same core;
//! * [`workers`](WorkerTable): where the workers are and what they serve;
//!   [`engine_load`]: load and busy signals read from the engines' own
//!   metrics.
//!
//! The library's default features compile none of this: a router that
//! embeds selkie builds no tokio, hyper or tokenizer unless it asks for
//! `serve`.
//!
//! Start it from code with [`Server::start`] (inside a tokio runtime), or
//! as the process `selkie serve` does with [`run`]: it raises the
//! open-files limit to the hard limit, checks every option, builds the
//! router, serves until SIGTERM or SIGINT, then stops accepting, lets the
//! open responses finish within
//! [`shutdown_timeout`](Limits::shutdown_timeout) and returns `Ok` (exit
//! status 0).

mod config;
pub mod engine_load;
mod error;
pub mod ext_proc;
mod http;
pub mod kv_events;
mod lifecycle;
mod metrics;
mod overlaps;
mod prompt;
mod request;
mod route;
mod upstream;
mod workers;

use std::net::SocketAddr;
use std::sync::Arc;

#[cfg(feature = "etcd")]
pub use config::EtcdWorkers;
pub use config::{Limits, PolicySpec, ServeConfig, MAX_BLOCK_SIZE, RESERVED_FDS};
pub use error::{ApiError, Refusal, ServeError};
pub use http::{DP_RANK_HEADER, WORKER_HEADER};
pub use lifecycle::{Ending, Lifecycle, TokenScanner, MAX_COUNTED_OUTPUT_TOKENS};
pub use metrics::{Metrics, UpstreamErrorKind};
pub use overlaps::{LearnedOverlaps, OverlapSource, Recorded};
pub use prompt::{text_as_tokens, ChatTemplate, PromptBlocks, PromptHasher, Unhashed, BYTES_PER_TOKEN};
pub use request::{Endpoint, ParsedRequest, PromptInput};
pub use route::{Choice, RouterCore, INLINE_TOKENIZE_BYTES};
pub use workers::{
    parse_workers_file, FleetView, ModelList, ModelRoute, ServeSource, WorkerEntry, WorkerSpec, WorkerTable, WorkerUrl,
    MAX_MODELS_PER_WORKER, MAX_WORKERS_FILE_BYTES, MODELS_LABEL, URL_LABEL,
};

use crate::{
    DiscoveryPoller, KvRouterConfig, RoutingPartitionRef, ServiceConfig, WorkerSelectionConfig, WorkerSelectionPolicy,
    WorkerSelectionPolicyRegistry, WorkerSelectionService, WorkerType,
};

/// The partition name policy factories are called with.
const PARTITION: &str = "selkie-serve";

/// How long a worker's `/v1/models` may take.
const MODELS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Builds the policy `spec` names, through the built-in registry, for a
/// service of `block_size`-token blocks: a config file that states another
/// block size has its lengths in blocks converted to `block_size`
/// ([`WorkerSelectionConfig::resolve_at`]).
pub fn build_policy(spec: &PolicySpec, block_size: u32) -> Result<WorkerSelectionPolicy, ServeError> {
    let registry = WorkerSelectionPolicyRegistry::new();
    let factory = match spec {
        PolicySpec::Named { name, parameters } => registry.factory(name, parameters)?,
        PolicySpec::ConfigFile(path) => {
            WorkerSelectionConfig::from_path(path)?.resolve_at(&registry, WorkerType::Aggregated, block_size)?
        }
    };
    Ok(factory(
        &KvRouterConfig::default(),
        WorkerType::Aggregated,
        RoutingPartitionRef::model(PARTITION),
    ))
}

/// The open-files limit (soft), if the platform says.
pub fn open_files_limit() -> Option<u64> {
    rlimit::getrlimit(rlimit::Resource::NOFILE).ok().map(|(soft, _)| soft)
}

/// A running router (see [`Server::start`]).
pub struct Server {
    addr: SocketAddr,
    core: Arc<RouterCore>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    serving: tokio::task::JoinHandle<()>,
    /// The other serving threads: each says when it has finished.
    doors: Vec<tokio::sync::oneshot::Receiver<()>>,
    models: tokio::task::JoinHandle<()>,
    poller: Option<DiscoveryPoller>,
    kv_events: Option<kv_events::KvEventTasks>,
    picker: Option<PickerDoor>,
    engine_load: Option<tokio::task::JoinHandle<()>>,
    /// Reports the workers' KV event labels a router without KV events
    /// does not follow.
    unused_labels: Option<tokio::task::JoinHandle<()>>,
}

/// The endpoint picker door, while it serves.
struct PickerDoor {
    addr: SocketAddr,
    picker: ext_proc::Picker,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<()>,
    /// How long open streams may take after the stop.
    deadline: std::time::Duration,
}

impl Server {
    /// Checks `config`, builds the router (policy, tokenizer, template,
    /// the first snapshot of the workers), binds its port and starts
    /// serving. Must be called inside a tokio runtime: it serves HTTP on
    /// that runtime and, with [`threads`](ServeConfig::threads) above 1
    /// (the default is one per core), on that many more threads, each
    /// its own single-threaded runtime and listener on the same address
    /// (`SO_REUSEPORT`: the kernel spreads connections over them) with its
    /// own connections to the workers. A request is then served start to
    /// end on one thread, with no hand-over between threads.
    pub async fn start(config: ServeConfig) -> Result<Server, ServeError> {
        config.validate(open_files_limit())?;
        let policy = build_policy(&config.policy, config.block_size)?;
        let tokenizer = config
            .tokenizer
            .as_deref()
            .map(PromptHasher::load_tokenizer)
            .transpose()?;
        let template = config
            .chat_template
            .as_deref()
            .map(ChatTemplate::from_file)
            .transpose()?;
        let mut prompts = PromptHasher::new(
            config.block_size,
            tokenizer,
            template,
            config.limits.max_prompt_tokens,
            config.limits.max_tokenize_bytes,
        );
        if config.text_as_bytes {
            prompts = prompts.with_text_as_bytes();
        }
        if let kv_events::KvHashing::EngineSha256Cbor { seed } = &config.kv_hash {
            prompts = prompts.with_engine_chain(kv_events::Sha256CborChain::new(config.block_size, seed.as_deref()));
        }
        let service = Arc::new(WorkerSelectionService::new(
            policy,
            ServiceConfig {
                block_size: config.block_size,
                seed: config.seed,
                ..ServiceConfig::default()
            },
        ));
        let mut metrics = Metrics::new(service.policy().name(), &config.limits);
        let kv_metrics = kv_events::KvEventMetrics::default();
        kv_metrics.register(metrics.registry_mut());
        let picker_metrics = ext_proc::PickerMetrics::default();
        if config.ext_proc.is_some() {
            picker_metrics.register(metrics.registry_mut());
        }
        let engine_metrics = engine_load::EngineLoadMetrics::default();
        if config.engine_metrics.is_some() {
            engine_metrics.register(metrics.registry_mut());
        }
        let metrics = Arc::new(metrics);
        let table = Arc::new(WorkerTable::new());
        #[allow(unused_mut)]
        let mut source = ServeSource::new(
            &config.workers,
            config.workers_file.clone(),
            config.max_active,
            table.clone(),
        )?;
        #[cfg(feature = "etcd")]
        if let Some(etcd) = &config.etcd {
            let discovery =
                crate::EtcdDiscovery::connect_with(&etcd.endpoints, etcd.prefix.clone(), etcd.options.clone())?;
            source = source.with_etcd(discovery);
        }
        if config.workers.is_empty() && !source.is_dynamic() {
            return Err(ServeError::NoWorkerSource);
        }
        service.refresh(&mut source)?;
        let poller = if source.is_dynamic() {
            Some(
                DiscoveryPoller::spawn(service.clone(), Box::new(source), config.discovery_interval)
                    .map_err(ServeError::Runtime)?,
            )
        } else {
            None
        };
        let mut core = RouterCore::new(
            service.clone(),
            table.clone(),
            prompts,
            metrics.clone(),
            config.index_ttl,
            config.limits.max_index_blocks,
        )?;
        let mut unused_labels = None;
        let kv_events = if config.kv_events.is_empty() && !kv_events::labelled(&table) {
            // Labels that discovery adds later are not followed: say so.
            if poller.is_some() {
                let why = if config.text_as_bytes {
                    "this router hashes text as bytes (--text-as-bytes), which engines' blocks never match"
                } else {
                    "this router started without KV events (no --kv-events, no label at start); restart it to use them"
                };
                unused_labels = Some(tokio::spawn(kv_events::report_unused_labels(
                    table.clone(),
                    metrics.clone(),
                    why,
                )));
            }
            None
        } else if config.text_as_bytes {
            return Err(ServeError::Invalid {
                option: "--text-as-bytes",
                value: "on".into(),
                bound: "not with workers whose entries name KV event endpoints: engines' blocks are of their tokens, \
                        which byte pieces never match"
                    .into(),
            });
        } else {
            let (ingester, overlaps) = kv_events::EventIngester::new(
                config.kv_hash.clone(),
                config.limits.max_index_blocks,
                service,
                table,
                kv_metrics.clone(),
            );
            let ingester = ingester.with_router_metrics(metrics);
            core = core.with_overlaps(Box::new(overlaps))?;
            Some(kv_events::start(&config.kv_events, ingester, kv_metrics).await?)
        };
        let core = Arc::new(core);
        let threads = serving_threads(config.threads);
        let listener = bind_listener(config.listen, threads > 1).map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
        let upstream = upstream::Upstream::new(&config.limits);
        let door = Arc::new(http::HttpDoor::new(
            core.clone(),
            upstream.clone(),
            config.limits.clone(),
            config.retry_after,
        ));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut doors = Vec::with_capacity(threads - 1);
        for thread in 1..threads {
            // A thread that cannot serve stops the start; dropping `stop`
            // on the way out stops those already serving.
            doors.push(spawn_door(&door, addr, thread, stopped.clone()).await?);
        }
        let models = tokio::spawn(refresh_models(core.clone(), upstream.clone(), config.models_refresh));
        let engine_load = config
            .engine_metrics
            .clone()
            .map(|m| tokio::spawn(engine_load::run(core.clone(), upstream.clone(), m, engine_metrics)));
        let picker = match config.ext_proc {
            None => None,
            Some(at) => Some(start_picker(at, &core, &config, picker_metrics).await?),
        };
        let serving = tokio::spawn(http::serve(door, listener, until_stopped(stopped)));
        tracing::info!(%addr, threads, policy = core.service.policy().name(), "selkie serve: listening");
        Ok(Server {
            addr,
            core,
            stop: Some(stop),
            serving,
            doors,
            models,
            poller,
            kv_events,
            picker,
            engine_load,
            unused_labels,
        })
    }

    /// Where the endpoint picker door listens, when it is on.
    pub fn ext_proc_addr(&self) -> Option<SocketAddr> {
        self.picker.as_ref().map(|p| p.addr)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The routing core (its service, workers and metrics).
    pub fn core(&self) -> &Arc<RouterCore> {
        &self.core
    }

    /// Stops accepting, lets open responses finish within the shutdown
    /// timeout, and returns.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        let picker = self.picker.take().map(|p| {
            p.picker.begin_shutdown();
            let _ = p.stop.send(());
            (p.serving, p.deadline)
        });
        let _ = (&mut self.serving).await;
        for door in self.doors.drain(..) {
            let _ = door.await;
        }
        if let Some((mut serving, deadline)) = picker {
            if tokio::time::timeout(deadline, &mut serving).await.is_err() {
                serving.abort();
            }
        }
        if let Some(task) = self.engine_load.take() {
            task.abort();
        }
        if let Some(task) = self.unused_labels.take() {
            task.abort();
        }
        self.models.abort();
        if let Some(k) = self.kv_events.take() {
            k.stop();
        }
        if let Some(p) = self.poller.take() {
            p.stop();
        }
    }
}

/// The connections one listening socket may hold unaccepted.
const LISTEN_BACKLOG: u32 = 1024;

/// How many threads serve HTTP: `threads`, or one per core (always one
/// where sockets cannot share a port).
fn serving_threads(threads: Option<usize>) -> usize {
    if cfg!(unix) {
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    } else {
        1
    }
}

/// A listening socket on `addr`; `shared` lets other sockets of this
/// process listen on the same address (`SO_REUSEPORT`).
fn bind_listener(addr: SocketAddr, shared: bool) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    {
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(shared)?;
    }
    #[cfg(not(unix))]
    let _ = shared;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Resolves when the router is told to stop, or dropped.
async fn until_stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopping| *stopping).await;
}

/// Starts serving thread `thread`: a single-threaded runtime with its own
/// listener on `addr` and its own connections to the workers, serving
/// `door`'s router until `stop`. Returns once it listens; its receiver
/// says when it has finished.
async fn spawn_door(
    door: &Arc<http::HttpDoor>,
    addr: SocketAddr,
    thread: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::sync::oneshot::Receiver<()>, ServeError> {
    let (listening, ready) = tokio::sync::oneshot::channel::<std::io::Result<()>>();
    let (finished, done) = tokio::sync::oneshot::channel();
    let door = door.clone();
    std::thread::Builder::new()
        .name(format!("selkie-serve-{thread}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    let _ = listening.send(Err(e));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match bind_listener(addr, true) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = listening.send(Err(e));
                        return;
                    }
                };
                let _ = listening.send(Ok(()));
                let door = Arc::new(door.sibling(thread));
                http::serve(door, listener, until_stopped(stop)).await;
            });
            drop(runtime);
            let _ = finished.send(());
        })
        .map_err(ServeError::Runtime)?;
    match ready.await {
        Ok(Ok(())) => Ok(done),
        Ok(Err(source)) => Err(ServeError::Bind { addr, source }),
        Err(_) => Err(ServeError::Runtime(std::io::Error::other(format!(
            "serving thread {thread} ended before it listened"
        )))),
    }
}

/// Binds the endpoint picker door and serves it until stopped.
async fn start_picker(
    at: SocketAddr,
    core: &Arc<RouterCore>,
    config: &ServeConfig,
    metrics: ext_proc::PickerMetrics,
) -> Result<PickerDoor, ServeError> {
    let listener = tokio::net::TcpListener::bind(at)
        .await
        .map_err(|source| ServeError::Bind { addr: at, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ServeError::Bind { addr: at, source })?;
    let picker = ext_proc::Picker::new(
        core.clone(),
        config.limits.max_body_bytes,
        config.retry_after.as_secs_f64().ceil().max(1.0) as u64,
        config.ext_proc_fallbacks,
        metrics,
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = picker.clone().into_service();
    let serving = tokio::spawn(async move {
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let result = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!(%e, "the endpoint picker door stopped");
        }
    });
    tracing::info!(%addr, "selkie serve: endpoint picker (ext_proc) listening");
    Ok(PickerDoor {
        addr,
        picker,
        stop,
        serving,
        deadline: config.limits.shutdown_timeout,
    })
}

/// Reads the models of the workers whose entries list none, at start, on
/// every change of the workers, and every `period`.
async fn refresh_models(core: Arc<RouterCore>, upstream: upstream::Upstream, period: std::time::Duration) {
    loop {
        let view = core.table.view();
        let mut reads = Vec::new();
        for worker in view.workers().iter().filter(|w| !w.listed_models) {
            let (worker, upstream) = (worker.clone(), upstream.clone());
            reads.push(tokio::spawn(async move {
                match upstream.models(&worker, MODELS_TIMEOUT).await {
                    Ok(list) => {
                        let changed = worker.models().is_none_or(|old| old.ids != list.ids);
                        worker.set_models(list);
                        changed
                    }
                    Err(why) => {
                        tracing::debug!(worker = worker.url.as_str(), %why, "cannot read the worker's models");
                        false
                    }
                }
            }));
        }
        let mut changed = false;
        for r in reads {
            changed |= r.await.unwrap_or(false);
        }
        if changed {
            core.table.models_changed();
        }
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            () = core.table.changed() => {}
        }
    }
}

/// Runs `selkie serve` as a process: raises the open-files limit, starts a
/// runtime and the router, serves until SIGTERM or SIGINT, shuts down
/// gracefully and returns `Ok`.
pub fn run(config: ServeConfig) -> Result<(), ServeError> {
    // The hard limit is as far as an unprivileged process may go.
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    config.validate(open_files_limit())?;
    // This thread serves too, beside the router's background work (the
    // workers' models, KV events, discovery, the picker door); the other
    // serving threads are the server's own.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("selkie-serve")
        .build()
        .map_err(ServeError::Runtime)?;
    let result = runtime.block_on(async {
        let server = Server::start(config).await?;
        eprintln!(
            "selkie serve: listening on http://{} (policy {})",
            server.local_addr(),
            server.core().service.policy().name()
        );
        if let Some(addr) = server.ext_proc_addr() {
            eprintln!("selkie serve: endpoint picker (ext_proc, gRPC) on {addr}");
        }
        wait_for_signal().await;
        eprintln!("selkie serve: stopping (finishing open responses)");
        server.shutdown().await;
        Ok(())
    });
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
