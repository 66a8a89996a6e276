//! KV cache events from the engines (`selkie serve --kv-events`): what
//! each engine rank holds, fed to the router's exact KV index, which then
//! answers the `kv` policy's cache overlaps ([`EventOverlaps`]) in place of
//! the router's own decisions ([`LearnedOverlaps`](super::LearnedOverlaps)).
//!
//! # Endpoints
//!
//! `--kv-events WORKER_URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC][,mode=bind|connect]`,
//! once per engine process (one per data-parallel rank when each rank
//! publishes on its own endpoint; the rank is read from each message).
//! `WORKER_URL` is the worker's URL as `--worker` (or the workers file)
//! names it. A ZMQ SUB socket per endpoint, subscribed to `TOPIC` (default:
//! every topic):
//!
//! * the router **binds** when the endpoint's host is `*`
//!   (`tcp://*:5557`): pair it with an engine whose endpoint names this
//!   router's host (`tcp://router-host:5557`); vLLM's publisher *connects*
//!   when its endpoint names a host;
//! * the router **connects** otherwise (`tcp://engine-host:5557`): pair it
//!   with an engine that binds (`tcp://*:5557` in the engine's config);
//! * `mode=bind` or `mode=connect` overrides the rule (`tcp://127.0.0.1:5557,mode=bind`
//!   listens on loopback only).
//!
//! A worker record's label `kv_events` ([`KV_EVENTS_LABEL`]; workers file
//! `labels`, etcd records) names its endpoint as the flag does after
//! `WORKER_URL=`. The labels are followed as the workers change (every
//! [`LABEL_POLL_PERIOD`]): a new one opens its socket, one gone closes it,
//! one that cannot be opened is logged and tried again when it changes.
//! The router reads the engines' events when any `--kv-events` is given or
//! any worker has the label at start.
//!
//! `replay=ENDPOINT` names the engine's replay socket (vLLM's
//! `replay_endpoint`, a ROUTER socket; the router connects to it, or binds
//! under the same `*` rule).
//!
//! # Messages
//!
//! See [`engine_events`](crate::engine_events): three frames `[topic, sequence number, msgpack payload]`,
//! events `BlockStored`, `BlockRemoved` and `AllBlocksCleared`, as maps or
//! positional arrays; `medium` `"GPU"` is the device tier, `"CPU"` host
//! memory, `"DISK"` disk, anything else is refused (`medium`). A message
//! refused by the decoder, and a store whose `block_size` differs from the
//! router's `--block-size` (`block_size`: the overlaps would be wrong; the
//! first one is logged at error level with the worker and both sizes),
//! is counted in `selkie_kv_events_refused_total{worker,reason}` and
//! skipped; the subscriber goes on.
//!
//! # Sequence numbers, gaps, replay, restarts
//!
//! Each endpoint's messages are numbered from 0 by the engine process.
//! For a message's number:
//!
//! * the last plus one: applied;
//! * further ahead: a gap (`selkie_kv_events_gaps_total`). With a replay
//!   endpoint the router asks it for the messages from the first missing
//!   one (the start number as 8 bytes, big-endian; replies are the
//!   messages, then an end marker) and applies the missing ones in order
//!   (`selkie_kv_events_replayed_total`), waiting at most
//!   [`REPLAY_TIMEOUT`]. Without one, or when the replay fails
//!   (`selkie_kv_events_replay_failures_total`) or does not cover the gap,
//!   the rank's blocks are dropped: they stop counting, since the router
//!   can no longer know them. The index is then rebuilt as the engine
//!   reports: new prefixes count from their first block on; a store under
//!   a parent the router dropped is refused until that prefix is stored
//!   again; `AllBlocksCleared` or an engine restart starts the rank clean;
//! * at or below the last, with the bytes already read under that number:
//!   a duplicate (read through two sockets), ignored
//!   (`selkie_kv_events_duplicates_total`);
//! * at or below the last, with other bytes: the engine restarted (a new
//!   process, whose first messages may have gone out before the router's
//!   socket joined): the rank's blocks are dropped and the message applied
//!   to the empty rank (`selkie_kv_events_restarts_total`). The router
//!   keeps the digests of the latest [`RECENT_MESSAGES`] messages per
//!   endpoint to tell the two apart.
//!
//! An engine reports a block once computed; until a prompt's first token,
//! the router credits it to the rank it was sent to (at most the 256
//! latest prompts), so requests sharing a prefix that arrive together meet
//! there.
//!
//! A connecting subscriber does not hold up the router's start: it
//! connects when the engine's endpoint is up, and checks that it still is
//! after [`CONNECT_REFRESH`] without a message (see `Subscriber::run`).
//!
//! A worker that refuses the router's connection (an engine that died
//! loses its cache, and a restarted one says nothing until it stores
//! again) has its blocks dropped at once, on every rank and tier
//! (`selkie_kv_events_unreachable_total`); its next events rebuild them.
//!
//! Stored blocks and removals are counted as the engine makes them (a
//! block stored twice is held until removed twice; see
//! [`KvIndex`]).
//!
//! # Keys and bounds
//!
//! How a block is keyed, `--kv-hash tokens` (default) or
//! `--kv-hash engine-sha256-cbor[:SEED]`: see [`KvHashing`]. The index
//! holds at most `--max-index-blocks` blocks (the map from engine hashes to
//! keys is part of it: one entry per held block); past it, the blocks
//! stored longest ago go first. Messages wait for the index in a queue of
//! [`QUEUE_MESSAGES`]; a subscriber waits while it is full (ZMQ then drops
//! at the engine's high-water mark, and the sequence numbers show the gap).
//!
//! # Metrics
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `selkie_kv_events_messages_total` | `worker` | messages decoded |
//! | `selkie_kv_events_received_total` | `worker`, `event` | events applied to the index (`stored`, `removed`, `cleared`) |
//! | `selkie_kv_events_refused_total` | `worker`, `reason` | messages or events refused: [`FrameError::REASONS`] and `block_size` |
//! | `selkie_kv_events_index_errors_total` | `worker`, `kind` | events the index refused in part or whole (`unknown_parent`, `unknown_blocks`, ...) |
//! | `selkie_kv_events_gaps_total` | `worker` | sequence gaps seen |
//! | `selkie_kv_events_replayed_total` | `worker` | messages recovered from the replay endpoint |
//! | `selkie_kv_events_replay_failures_total` | `worker` | replays that failed or fell short |
//! | `selkie_kv_events_restarts_total` | `worker` | engine restarts seen |
//! | `selkie_kv_events_duplicates_total` | `worker` | messages ignored as duplicates |
//! | `selkie_kv_events_unreachable_total` | `worker` | times the worker refused a connection and its blocks were dropped |

pub mod chain;
mod sequence;
pub use sequence::RECENT_MESSAGES;
use sequence::{Place, Sequence};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

pub use crate::engine_events::{decode_frames, decode_payload, EngineEvent, EventBatch, FrameError, StoredBlocks};
pub use chain::{KvHashing, Sha256CborChain};

use super::overlaps::{InFlight, InFlightTicket, OverlapSource, Recorded};
use super::prompt::PromptBlocks;
use super::workers::{WorkerTable, WorkerUrl};
use super::ServeError;
use crate::kv_index::{
    shared_with, KvBlockHasher, KvEvent, KvEventData, KvEventError, KvIndex, KvIndexReader, KvIndexWriter, KvOverlaps,
    StoredBlock,
};
use crate::{RowOverlaps, WorkerSelectionService, WorkerWithDpRank};

/// How long a replay may take before the gap is taken as lost.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Decoded messages queued for the index, all endpoints together.
pub const QUEUE_MESSAGES: usize = 1024;
/// How often the index follows the fleet's rows when no event arrives.
pub const ROW_SYNC_PERIOD: Duration = Duration::from_millis(100);

/// The worker record label (workers file `labels`, etcd records) that
/// names a worker's KV event endpoint, as `--kv-events` does after
/// `WORKER_URL=`.
pub const KV_EVENTS_LABEL: &str = "kv_events";

/// How often the workers' `kv_events` labels are checked for endpoints to
/// open or close.
pub const LABEL_POLL_PERIOD: Duration = Duration::from_millis(500);

/// How long a connecting subscriber waits before trying a refused
/// connection again.
pub const CONNECT_RETRY: Duration = Duration::from_millis(500);

/// How long a connecting subscriber goes without a message before it
/// checks, with a fresh connection, that its engine is still the one it
/// hears (see the module docs).
pub const CONNECT_REFRESH: Duration = Duration::from_secs(5);

/// The replay end marker's sequence number.
const END_SEQ: u64 = u64::MAX;

/// One `--kv-events` endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsSpec {
    /// The worker's URL.
    pub worker: String,
    /// The publisher's endpoint.
    pub endpoint: String,
    /// The replay endpoint, if any.
    pub replay: Option<String>,
    /// The topic subscribed to ("" for every topic).
    pub topic: String,
    /// Whether the router binds (else connects).
    pub bind: bool,
}

/// Whether the router binds `endpoint` (its host is `*`).
pub fn binds(endpoint: &str) -> bool {
    endpoint
        .split_once("://")
        .is_some_and(|(_, rest)| rest.starts_with("*:") || rest == "*")
}

impl KvEventsSpec {
    /// Parses `WORKER_URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC][,mode=bind|connect]`.
    pub fn parse(text: &str) -> Result<Self, ServeError> {
        let bad = |why: &str| ServeError::Invalid {
            option: "--kv-events",
            value: text.to_owned(),
            bound: format!("WORKER_URL=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC][,mode=bind|connect] ({why})"),
        };
        let (worker, rest) = text.split_once('=').ok_or_else(|| bad("no '='"))?;
        WorkerUrl::parse(worker).map_err(|_| bad("not a worker URL"))?;
        let mut parts = rest.split(',');
        let endpoint = parts.next().unwrap_or_default().trim();
        let zmq_endpoint = |e: &str| {
            ["tcp://", "ipc://"]
                .iter()
                .any(|s| e.starts_with(s) && e.len() > s.len())
        };
        if !zmq_endpoint(endpoint) {
            return Err(bad("the endpoint must be tcp://HOST:PORT or ipc://PATH"));
        }
        let mut spec = KvEventsSpec {
            worker: worker.trim().to_owned(),
            endpoint: endpoint.to_owned(),
            replay: None,
            topic: String::new(),
            bind: binds(endpoint),
        };
        for part in parts {
            match part.split_once('=') {
                Some(("replay", e)) if zmq_endpoint(e) => spec.replay = Some(e.to_owned()),
                Some(("topic", t)) => spec.topic = t.to_owned(),
                Some(("mode", "bind")) => spec.bind = true,
                Some(("mode", "connect")) => spec.bind = false,
                _ => return Err(bad("unknown option")),
            }
        }
        Ok(spec)
    }
}

/// The kv events' counters (see the module docs).
#[derive(Clone, Default)]
pub struct KvEventMetrics {
    messages: Family<Vec<(&'static str, String)>, Counter>,
    received: Family<Vec<(&'static str, String)>, Counter>,
    refused: Family<Vec<(&'static str, String)>, Counter>,
    index_errors: Family<Vec<(&'static str, String)>, Counter>,
    gaps: Family<Vec<(&'static str, String)>, Counter>,
    replayed: Family<Vec<(&'static str, String)>, Counter>,
    replay_failures: Family<Vec<(&'static str, String)>, Counter>,
    restarts: Family<Vec<(&'static str, String)>, Counter>,
    duplicates: Family<Vec<(&'static str, String)>, Counter>,
    unreachable: Family<Vec<(&'static str, String)>, Counter>,
}

fn worker_label(worker: &str) -> Vec<(&'static str, String)> {
    vec![("worker", worker.to_owned())]
}

impl KvEventMetrics {
    /// Registers the counters in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        let all = [
            ("selkie_kv_events_messages", "KV event messages decoded", &self.messages),
            (
                "selkie_kv_events_received",
                "KV events applied to the index",
                &self.received,
            ),
            (
                "selkie_kv_events_refused",
                "KV event messages or events refused, by reason",
                &self.refused,
            ),
            (
                "selkie_kv_events_index_errors",
                "KV events the index refused in part or whole, by kind",
                &self.index_errors,
            ),
            ("selkie_kv_events_gaps", "KV event sequence gaps", &self.gaps),
            (
                "selkie_kv_events_replayed",
                "KV event messages recovered by replay",
                &self.replayed,
            ),
            (
                "selkie_kv_events_replay_failures",
                "KV event replays that failed or fell short",
                &self.replay_failures,
            ),
            (
                "selkie_kv_events_restarts",
                "Engine restarts seen in KV events",
                &self.restarts,
            ),
            (
                "selkie_kv_events_duplicates",
                "KV event messages ignored as duplicates",
                &self.duplicates,
            ),
            (
                "selkie_kv_events_unreachable",
                "Times a worker refused a connection and its indexed blocks were dropped",
                &self.unreachable,
            ),
        ];
        for (name, help, family) in all {
            registry.register(name, help, family.clone());
        }
    }

    /// Counts a refusal of `worker`'s message or event.
    pub fn refused(&self, worker: &str, reason: &'static str) {
        self.refused
            .get_or_create(&vec![("worker", worker.to_owned()), ("reason", reason.to_owned())])
            .inc();
    }

    /// Counts an event of `worker` applied to the index (`kind`:
    /// `stored`, `removed`, `cleared`).
    fn received(&self, worker: &str, kind: &'static str) {
        self.received
            .get_or_create(&vec![("worker", worker.to_owned()), ("event", kind.to_owned())])
            .inc();
    }

    /// The count of a refusal reason (tests and diagnostics).
    pub fn refused_count(&self, worker: &str, reason: &'static str) -> u64 {
        self.refused
            .get_or_create(&vec![("worker", worker.to_owned()), ("reason", reason.to_owned())])
            .get()
    }
}

/// What the subscriber knows of a message's place in its endpoint's
/// sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Continuity {
    /// The next one.
    Next,
    /// Messages before it were lost for good.
    Lost,
    /// The engine restarted.
    Restart,
}

struct Ingested {
    worker: Arc<str>,
    batch: EventBatch,
    continuity: Continuity,
}

/// Overlaps from the engines' events: the reading side of the index the
/// event ingester writes.
pub struct EventOverlaps {
    reader: KvIndexReader,
    blocks: Arc<AtomicUsize>,
    down: Arc<WorkersDown>,
    in_flight: Arc<InFlight>,
    block_size: u32,
}

/// Workers that refused a connection, for the ingester to drop.
#[derive(Default)]
struct WorkersDown {
    workers: std::sync::Mutex<Vec<crate::WorkerId>>,
    wake: tokio::sync::Notify,
}

impl OverlapSource for EventOverlaps {
    fn overlaps<'o>(
        &self,
        service: &WorkerSelectionService,
        sequence: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Option<RowOverlaps<'o>> {
        let layout = self.reader.overlaps(sequence, out).ok()?.layout;
        let credits = self.in_flight.credits(sequence);
        if credits.is_empty() || layout != service.row_layout() {
            return out.row_overlaps();
        }
        let credits: Vec<(usize, u32)> = credits
            .into_iter()
            .filter_map(|(rank, blocks)| service.row_of(rank).map(|row| (row, blocks)))
            .collect();
        out.raise_device_blocks(credits, self.block_size)
    }

    fn chosen(&self, _rank: WorkerWithDpRank, _blocks: &PromptBlocks, _held: usize) -> Recorded {
        Recorded::Unneeded
    }

    fn in_flight(&self, rank: WorkerWithDpRank, blocks: &PromptBlocks) -> Option<InFlightTicket> {
        self.in_flight.begin(rank, &blocks.sequence)
    }

    fn blocks(&self) -> usize {
        self.blocks.load(Ordering::Relaxed)
    }

    fn block_size(&self) -> Option<u32> {
        Some(self.block_size)
    }

    fn unreachable(&self, worker: crate::WorkerId) {
        if let Ok(mut w) = self.down.workers.lock() {
            w.push(worker);
        }
        self.down.wake.notify_one();
    }
}

/// The writing side: applies decoded messages to the index.
pub struct EventIngester {
    writer: KvIndexWriter,
    block_size: u32,
    hashing: KvHashing,
    hasher: KvBlockHasher,
    service: Arc<WorkerSelectionService>,
    table: Arc<WorkerTable>,
    metrics: KvEventMetrics,
    /// Per rank: the next event id to give the index.
    next_id: std::collections::HashMap<WorkerWithDpRank, u64>,
    /// Workers whose block size mismatch was logged.
    mismatch_logged: std::collections::HashSet<Arc<str>>,
    blocks: Arc<AtomicUsize>,
    scratch: Vec<StoredBlock>,
    local: Vec<u64>,
    router_metrics: Option<Arc<super::Metrics>>,
    down: Arc<WorkersDown>,
}

impl EventIngester {
    /// An ingester for blocks of the service's block size
    /// ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size), the
    /// one source: the index, its hasher and the check of every engine
    /// store take it from there) keyed as `hashing` says, holding at most
    /// `max_blocks`, and the overlap source reading what it writes.
    pub fn new(
        hashing: KvHashing,
        max_blocks: usize,
        service: Arc<WorkerSelectionService>,
        table: Arc<WorkerTable>,
        metrics: KvEventMetrics,
    ) -> (Self, EventOverlaps) {
        let block_size = service.config().block_size;
        let (writer, reader) = shared_with(|| KvIndex::new(block_size).with_max_blocks(max_blocks));
        let blocks = Arc::new(AtomicUsize::new(0));
        let down = Arc::new(WorkersDown::default());
        let mut ingester = EventIngester {
            writer,
            block_size,
            hashing,
            hasher: KvBlockHasher::new(block_size),
            service,
            table,
            metrics,
            next_id: Default::default(),
            mismatch_logged: Default::default(),
            blocks: blocks.clone(),
            scratch: Vec::new(),
            local: Vec::new(),
            router_metrics: None,
            down: down.clone(),
        };
        ingester.publish();
        let overlaps = EventOverlaps {
            reader,
            blocks,
            down,
            in_flight: Arc::new(InFlight::default()),
            block_size,
        };
        (ingester, overlaps)
    }

    /// Keeps the router's `selkie_kv_index_blocks` gauge at the blocks the
    /// index holds.
    pub fn with_router_metrics(mut self, metrics: Arc<super::Metrics>) -> Self {
        self.router_metrics = Some(metrics);
        self
    }

    fn worker_id(&self, url: &str) -> Option<crate::WorkerId> {
        let parsed = WorkerUrl::parse(url).ok()?;
        let view = self.table.view();
        Some(
            view.workers()
                .iter()
                .find(|w| w.url == parsed)
                .map_or_else(|| parsed.default_id(), |w| w.id),
        )
    }

    /// Applies one message of `worker` (its events in order), then makes
    /// the result visible to queries.
    fn ingest(&mut self, msg: &Ingested) {
        let Some(worker_id) = self.worker_id(&msg.worker) else {
            return;
        };
        let rank = WorkerWithDpRank::new(worker_id, msg.batch.dp_rank);
        let label = worker_label(&msg.worker);
        self.metrics.messages.get_or_create(&label).inc();
        match msg.continuity {
            Continuity::Restart => {
                self.next_id.insert(rank, 0);
            }
            // The index drops a rank's blocks on an event-id gap.
            Continuity::Lost => {
                if let Some(id) = self.next_id.get_mut(&rank) {
                    *id += 1;
                }
            }
            Continuity::Next => {}
        }
        for event in &msg.batch.events {
            let id = *self.next_id.entry(rank).or_insert(1);
            let result = match event {
                EngineEvent::Stored(stored) => {
                    if stored.block_size != self.block_size {
                        self.metrics.refused(&msg.worker, "block_size");
                        if self.mismatch_logged.insert(msg.worker.clone()) {
                            tracing::error!(
                                worker = &*msg.worker,
                                engine_block_size = stored.block_size,
                                router_block_size = self.block_size,
                                "KV events: the engine's block size differs from --block-size; its stores are refused"
                            );
                        }
                        continue;
                    }
                    self.keys(stored);
                    let data = KvEventData::Stored {
                        parent: stored.parent,
                        blocks: &self.scratch,
                    };
                    self.writer.apply(&KvEvent::new(rank, id, data).in_tier(stored.tier))
                }
                EngineEvent::Removed { hashes, tier } => {
                    let data = KvEventData::Removed { blocks: hashes };
                    self.writer.apply(&KvEvent::new(rank, id, data).in_tier(*tier))
                }
                EngineEvent::Cleared => {
                    let result = self.clear_rank(rank);
                    self.metrics.received(&msg.worker, "cleared");
                    if let Err(e) = result {
                        self.index_error(&msg.worker, &e);
                    }
                    continue;
                }
            };
            self.next_id.insert(rank, id + 1);
            let kind = match event {
                EngineEvent::Stored(_) => "stored",
                EngineEvent::Removed { .. } => "removed",
                EngineEvent::Cleared => "cleared",
            };
            self.metrics.received(&msg.worker, kind);
            if let Err(e) = result {
                self.index_error(&msg.worker, &e);
            }
        }
        self.publish();
    }

    /// Drops every block of `rank`, in every tier (one index event each).
    fn clear_rank(&mut self, rank: WorkerWithDpRank) -> Result<(), KvEventError> {
        let mut result = Ok(());
        for tier in [
            crate::kv_index::StorageTier::Device,
            crate::kv_index::StorageTier::Host,
            crate::kv_index::StorageTier::Disk,
        ] {
            let id = *self.next_id.entry(rank).or_insert(1);
            result = result.and(
                self.writer
                    .apply(&KvEvent::new(rank, id, KvEventData::Cleared).in_tier(tier)),
            );
            self.next_id.insert(rank, id + 1);
        }
        result
    }

    /// Drops every block of the workers that refused a connection, in
    /// every tier of each of their ranks; their next events rebuild it.
    fn drop_unreachable(&mut self) {
        let down = match self.down.workers.lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(_) => return,
        };
        if down.is_empty() {
            return;
        }
        for worker in down {
            let ranks: Vec<WorkerWithDpRank> = self.next_id.keys().filter(|r| r.worker_id == worker).copied().collect();
            for rank in ranks {
                // Clearing a rank cannot be refused.
                let _ = self.clear_rank(rank);
            }
            let url = self.table.get(worker, &self.service).map(|w| w.url.as_str().to_owned());
            let url = url.unwrap_or_else(|| format!("{worker:?}"));
            tracing::info!(
                worker = url,
                "KV events: the worker refused a connection; its blocks no longer count"
            );
            self.metrics.unreachable.get_or_create(&worker_label(&url)).inc();
        }
        self.publish();
    }

    fn index_error(&self, worker: &str, e: &KvEventError) {
        let kind = match e {
            KvEventError::UnknownParent { .. } => "unknown_parent",
            KvEventError::TooManyBlocks { .. } => "too_many_blocks",
            KvEventError::SelfParent { .. } => "self_parent",
            KvEventError::UnknownBlocks { .. } => "unknown_blocks",
            KvEventError::EventGap { .. } => "gap",
            _ => "other",
        };
        tracing::debug!(worker, error = %e, "KV events: the index refused an event");
        self.metrics
            .index_errors
            .get_or_create(&vec![("worker", worker.to_owned()), ("kind", kind.to_owned())])
            .inc();
    }

    /// Fills `scratch` with the stored blocks' keys.
    fn keys(&mut self, stored: &StoredBlocks) {
        self.scratch.clear();
        match self.hashing {
            KvHashing::EngineSha256Cbor { .. } => {
                self.scratch.extend(stored.hashes.iter().map(|&h| StoredBlock {
                    block_hash: h,
                    tokens_hash: h,
                }));
            }
            KvHashing::Tokens => {
                self.local.clear();
                let lora = stored
                    .lora_name
                    .clone()
                    .or_else(|| stored.lora_id.map(|id| format!("lora-id:{id}")));
                match lora {
                    Some(name) => KvBlockHasher::new(self.block_size)
                        .with_lora(&name)
                        .local_hashes(&stored.token_ids, &mut self.local),
                    None => self.hasher.local_hashes(&stored.token_ids, &mut self.local),
                }
                for (i, (&block_hash, &local)) in stored.hashes.iter().zip(&self.local).enumerate() {
                    let tokens_hash = match stored.extra_keys.get(i) {
                        Some(Some(extra)) => xxhash_rust::xxh3::xxh3_64_with_seed(extra, local),
                        _ => local,
                    };
                    self.scratch.push(StoredBlock {
                        block_hash,
                        tokens_hash,
                    });
                }
            }
        }
    }

    /// Follows the fleet's rows and publishes what was applied.
    fn publish(&mut self) {
        let layout = self.service.row_layout();
        if self.writer.unpublished() > 0 || self.writer_layout() != Some(layout) {
            let service = &self.service;
            // The index was built with the service's block size (`new`),
            // the one sync_rows checks: it cannot refuse.
            let _ = self.writer.sync_rows(layout, |rank| service.rank_row(rank));
            self.writer.publish();
            let held = self.writer.held_blocks();
            self.blocks.store(held, Ordering::Relaxed);
            if let Some(m) = &self.router_metrics {
                m.index_blocks(held);
            }
        }
    }

    fn writer_layout(&self) -> Option<crate::RowLayout> {
        self.writer.reader().row_layout()
    }

    /// Applies messages from `rx` until every sender is gone, following the
    /// fleet's rows meanwhile.
    async fn run(mut self, mut rx: mpsc::Receiver<Ingested>) {
        let mut tick = tokio::time::interval(ROW_SYNC_PERIOD);
        let down = self.down.clone();
        loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(msg) => {
                        self.drop_unreachable();
                        self.ingest(&msg);
                    }
                    None => return,
                },
                _ = down.wake.notified() => self.drop_unreachable(),
                _ = tick.tick() => self.publish(),
            }
        }
    }
}

/// The running subscribers and ingester.
pub struct KvEventTasks {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Dropped first: each flag subscriber closes its socket and ends.
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl KvEventTasks {
    /// Stops every subscriber and the ingester.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for KvEventTasks {
    fn drop(&mut self) {
        self.stops.clear();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Opens every endpoint's socket (an endpoint that cannot be bound is an
/// error now; a connect is retried by ZMQ) and starts the subscribers and
/// the ingester. Must be called inside a tokio runtime.
pub async fn start(
    specs: &[KvEventsSpec],
    ingester: EventIngester,
    metrics: KvEventMetrics,
) -> Result<KvEventTasks, ServeError> {
    let (tx, rx) = mpsc::channel(QUEUE_MESSAGES);
    let mut tasks = Vec::new();
    let mut stops = Vec::new();
    for spec in specs {
        let (sub, socket) = open(spec, &metrics, &tx).await?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        stops.push(stop);
        tasks.push(tokio::spawn(sub.run(socket, stopped)));
    }
    tasks.push(tokio::spawn(watch_labels(
        ingester.table.clone(),
        specs.to_vec(),
        metrics,
        tx,
    )));
    tasks.push(tokio::spawn(ingester.run(rx)));
    Ok(KvEventTasks { tasks, stops })
}

/// Whether any worker's record names a KV event endpoint (label
/// [`KV_EVENTS_LABEL`]).
pub fn labelled(table: &WorkerTable) -> bool {
    table.view().workers().iter().any(|w| w.kv_events.is_some())
}

/// The workers' `kv_events` labels now, each as `WORKER_URL=ENDPOINT` (the
/// form `--kv-events` takes).
fn label_specs(table: &WorkerTable) -> std::collections::HashSet<String> {
    table
        .view()
        .workers()
        .iter()
        .filter_map(|w| w.kv_events.as_ref().map(|e| format!("{}={e}", w.url.as_str())))
        .collect()
}

/// Follows the workers' `kv_events` labels of a router that does not use
/// KV events (none were named at start, or it hashes text as bytes): such
/// a label is not followed, so each labelled worker is logged once at warn
/// level, saying why, and `metrics` counts them
/// (`selkie_kv_events_labels_unused`). Checked every
/// [`LABEL_POLL_PERIOD`], as the labels of a router that follows them.
pub async fn report_unused_labels(table: Arc<WorkerTable>, metrics: Arc<super::metrics::Metrics>, why: &'static str) {
    let mut warned = std::collections::HashSet::new();
    let mut tick = tokio::time::interval(LABEL_POLL_PERIOD);
    loop {
        tick.tick().await;
        let labelled = label_specs(&table);
        metrics.set_unused_event_labels(labelled.len());
        for label in &labelled {
            if warned.insert(label.clone()) {
                tracing::warn!(label, "KV events: a worker's kv_events label is not followed: {why}");
            }
        }
        warned.retain(|label| labelled.contains(label));
    }
}

/// Opens `spec`'s socket: its subscriber, to run.
async fn open(
    spec: &KvEventsSpec,
    metrics: &KvEventMetrics,
    tx: &mpsc::Sender<Ingested>,
) -> Result<(Subscriber, zeromq::SubSocket), ServeError> {
    let mut socket = zeromq::SubSocket::new();
    let invalid = |e: String| ServeError::Invalid {
        option: "--kv-events",
        value: spec.endpoint.clone(),
        bound: format!(
            "a ZMQ endpoint the router can {} ({e})",
            if spec.bind { "bind" } else { "connect to" }
        ),
    };
    // A connecting subscriber connects in its task, again whenever the
    // engine goes away: an engine that is not up yet never holds up the
    // router.
    let connect = if spec.bind {
        socket.bind(&spec.endpoint).await.map_err(|e| invalid(e.to_string()))?;
        None
    } else {
        spec.endpoint
            .parse::<zeromq::Endpoint>()
            .map_err(|e| invalid(e.to_string()))?;
        Some(spec.endpoint.clone())
    };
    socket.subscribe(&spec.topic).await.map_err(|e| ServeError::Invalid {
        option: "--kv-events",
        value: spec.topic.clone(),
        bound: format!("a topic ({e})"),
    })?;
    let sub = Subscriber {
        worker: spec.worker.as_str().into(),
        connect,
        topic: spec.topic.clone(),
        replay: spec.replay.clone(),
        sequence: Sequence::new(),
        metrics: metrics.clone(),
        tx: tx.clone(),
    };
    Ok((sub, socket))
}

/// Follows the workers' `kv_events` labels (workers file, etcd): opens a
/// subscriber for each new endpoint, closes the ones whose worker or label
/// went away. An endpoint that cannot be opened is logged and tried again
/// when its label changes. Endpoints also given with `--kv-events` are
/// left to the flag.
async fn watch_labels(
    table: Arc<WorkerTable>,
    flags: Vec<KvEventsSpec>,
    metrics: KvEventMetrics,
    tx: mpsc::Sender<Ingested>,
) {
    // Dropped with this task (the router stops): every subscriber it
    // started is aborted.
    let mut subscribers = tokio::task::JoinSet::new();
    // Per endpoint, the sender whose drop stops its subscriber (none: not
    // opened).
    let mut running: std::collections::HashMap<String, Option<tokio::sync::oneshot::Sender<()>>> = Default::default();
    let mut tick = tokio::time::interval(LABEL_POLL_PERIOD);
    loop {
        tick.tick().await;
        while subscribers.try_join_next().is_some() {}
        let wanted = label_specs(&table);
        running.retain(|key, _| wanted.contains(key));
        for key in wanted {
            if running.contains_key(&key) {
                continue;
            }
            let task = match KvEventsSpec::parse(&key) {
                Ok(spec)
                    if flags
                        .iter()
                        .any(|f| f.worker == spec.worker && f.endpoint == spec.endpoint) =>
                {
                    None
                }
                Ok(spec) => match open(&spec, &metrics, &tx).await {
                    Ok((sub, socket)) => {
                        let (stop, stopped) = tokio::sync::oneshot::channel();
                        subscribers.spawn(sub.run(socket, stopped));
                        Some(stop)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "KV events: a worker's kv_events label could not be opened");
                        None
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "KV events: a worker's kv_events label is not an endpoint");
                    None
                }
            };
            running.insert(key, task);
        }
    }
}

struct Subscriber {
    worker: Arc<str>,
    /// The engine's endpoint, when the router connects.
    connect: Option<String>,
    topic: String,
    replay: Option<String>,
    sequence: Sequence,
    metrics: KvEventMetrics,
    tx: mpsc::Sender<Ingested>,
}

impl Subscriber {
    /// Receives until `stop`'s sender is dropped, then closes the socket.
    ///
    /// A connecting subscriber cannot see its engine go away (the ZMQ
    /// library drops a closed connection silently), so after
    /// [`CONNECT_REFRESH`] without a message it opens a fresh socket beside
    /// the old one: when the engine answers, both are read for
    /// [`CONNECT_REFRESH`] (a message seen twice is a duplicate) and the old
    /// one is dropped; when it does not (it is down), the router waits for
    /// it, connecting again.
    async fn run(mut self, socket: zeromq::SubSocket, mut stop: tokio::sync::oneshot::Receiver<()>) {
        // A connecting subscriber's first socket connects in the loop.
        let mut socket = self.connect.is_none().then_some(socket);
        // The socket being replaced, read until the instant given.
        let mut old: Option<(zeromq::SubSocket, tokio::time::Instant)> = None;
        let mut quiet_since = tokio::time::Instant::now();
        loop {
            let Some(current) = socket.as_mut() else {
                let Some(endpoint) = self.connect.clone() else { return };
                tokio::select! {
                    fresh = self.fresh_socket(&endpoint, None) => {
                        socket = fresh;
                        quiet_since = tokio::time::Instant::now();
                    }
                    _ = &mut stop => return,
                }
                continue;
            };
            let refresh_at = quiet_since + CONNECT_REFRESH;
            let old_until = old.as_ref().map(|(_, until)| *until);
            let received = tokio::select! {
                r = current.recv() => r,
                r = async { old.as_mut().expect("guarded").0.recv().await }, if old.is_some() => r,
                _ = tokio::time::sleep_until(old_until.unwrap_or(refresh_at)), if old_until.is_some() => {
                    old = None;
                    continue;
                }
                _ = tokio::time::sleep_until(refresh_at), if self.connect.is_some() && old.is_none() => {
                    let endpoint = self.connect.clone().unwrap_or_default();
                    let fresh = tokio::select! {
                        f = self.fresh_socket(&endpoint, Some(CONNECT_REFRESH)) => f,
                        _ = &mut stop => return,
                    };
                    let replaced = std::mem::replace(&mut socket, fresh);
                    if socket.is_some() {
                        old = replaced.map(|s| (s, tokio::time::Instant::now() + CONNECT_REFRESH));
                    }
                    quiet_since = tokio::time::Instant::now();
                    continue;
                }
                _ = &mut stop => {
                    let _ = current.unbind_all().await;
                    return;
                }
            };
            quiet_since = tokio::time::Instant::now();
            let msg = match received {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(worker = &*self.worker, error = %e, "KV events: receive failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let frames: Vec<_> = msg.into_vec();
            let digest = payload_digest(&frames);
            let batch = match decode_frames(&frames) {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(worker = &*self.worker, error = %e, "KV events: message refused");
                    self.metrics.refused(&self.worker, e.reason());
                    continue;
                }
            };
            if self.accept(batch, digest).await.is_err() {
                return;
            }
        }
    }

    /// A socket subscribed to the topic and connected to `endpoint`, or
    /// none when `within` passes first.
    async fn fresh_socket(&self, endpoint: &str, within: Option<Duration>) -> Option<zeromq::SubSocket> {
        loop {
            let mut socket = zeromq::SubSocket::new();
            if let Err(e) = socket.subscribe(&self.topic).await {
                tracing::warn!(worker = &*self.worker, error = %e, "KV events: subscribe failed");
            }
            let connected = match within {
                Some(limit) => match tokio::time::timeout(limit, socket.connect(endpoint)).await {
                    Ok(r) => r,
                    Err(_) => return None,
                },
                None => socket.connect(endpoint).await,
            };
            match connected {
                Ok(()) => return Some(socket),
                Err(e) => {
                    tracing::debug!(worker = &*self.worker, error = %e, "KV events: connect failed; retrying");
                    if within.is_some() {
                        return None;
                    }
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
            }
        }
    }

    /// Places `batch` (whose payload's digest is `digest`) in the sequence,
    /// replaying a gap when possible, and queues it. Errs when the ingester
    /// is gone.
    async fn accept(&mut self, batch: EventBatch, digest: u64) -> Result<(), ()> {
        let label = worker_label(&self.worker);
        let continuity = match self.sequence.place(batch.seq, digest) {
            Place::Next => Continuity::Next,
            Place::Restart => {
                self.metrics.restarts.get_or_create(&label).inc();
                Continuity::Restart
            }
            Place::Duplicate => {
                self.metrics.duplicates.get_or_create(&label).inc();
                return Ok(());
            }
            Place::Gap { from } => {
                self.metrics.gaps.get_or_create(&label).inc();
                if self.replay_gap(from, batch.seq).await? {
                    Continuity::Next
                } else {
                    self.metrics.replay_failures.get_or_create(&label).inc();
                    Continuity::Lost
                }
            }
        };
        self.send(batch, digest, continuity).await
    }

    async fn send(&mut self, batch: EventBatch, digest: u64, continuity: Continuity) -> Result<(), ()> {
        self.sequence
            .record(batch.seq, digest, continuity == Continuity::Restart);
        let msg = Ingested {
            worker: self.worker.clone(),
            batch,
            continuity,
        };
        self.tx.send(msg).await.map_err(|_| ())
    }

    /// Replays messages `from..until`; whether they all came (none:
    /// no replay endpoint).
    async fn replay_gap(&mut self, from: u64, until: u64) -> Result<bool, ()> {
        let Some(endpoint) = self.replay.clone() else {
            return Ok(false);
        };
        let fetched = tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(&endpoint, from, until)).await;
        let batches = match fetched {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                tracing::warn!(worker = &*self.worker, endpoint, error = %e, "KV events: replay failed");
                return Ok(false);
            }
            Err(_) => {
                tracing::warn!(worker = &*self.worker, endpoint, "KV events: replay timed out");
                return Ok(false);
            }
        };
        let mut expected = from;
        let mut complete = true;
        for batch in batches {
            match batch {
                Ok((b, digest)) if b.seq == expected => {
                    expected += 1;
                    self.metrics.replayed.get_or_create(&worker_label(&self.worker)).inc();
                    self.send(b, digest, Continuity::Next).await?;
                }
                Ok((b, _)) if b.seq < expected => {}
                Ok(_) => {
                    complete = false;
                    break;
                }
                Err(e) => {
                    self.metrics.refused(&self.worker, e.reason());
                    complete = false;
                    break;
                }
            }
        }
        Ok(complete && expected == until)
    }
}

/// The digest of a message's payload (its last frame), which tells a
/// duplicate from a restarted engine's message of the same number.
fn payload_digest(frames: &[bytes::Bytes]) -> u64 {
    frames.last().map_or(0, |payload| xxh3_64(payload))
}

/// Asks a replay endpoint for the messages `from..until` and reads its
/// answers up to the end marker (or `until`), each with its payload's
/// digest.
async fn fetch_replay(
    endpoint: &str,
    from: u64,
    until: u64,
) -> Result<Vec<Result<(EventBatch, u64), FrameError>>, zeromq::ZmqError> {
    let mut socket = zeromq::DealerSocket::new();
    if binds(endpoint) {
        socket.bind(endpoint).await?;
    } else {
        socket.connect(endpoint).await?;
    }
    let mut request = ZmqMessage::from(Vec::<u8>::new());
    request.push_back(from.to_be_bytes().to_vec().into());
    socket.send(request).await?;
    let mut out = Vec::new();
    loop {
        let reply = socket.recv().await?;
        let mut frames: Vec<_> = reply.into_vec();
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        // vLLM answers [topic, seq, payload], SGLang [seq, payload].
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => {
                out.push(Err(FrameError::FrameCount { frames: frames.len() }));
                break;
            }
        };
        let Ok(seq_bytes) = <[u8; 8]>::try_from(seq.as_ref()) else {
            out.push(Err(FrameError::SeqFrame { bytes: seq.len() }));
            break;
        };
        let seq = u64::from_be_bytes(seq_bytes);
        if seq == END_SEQ {
            break;
        }
        let digest = xxh3_64(payload);
        out.push(decode_payload(payload).map(|(dp_rank, events)| (EventBatch { seq, dp_rank, events }, digest)));
        if seq + 1 >= until {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
