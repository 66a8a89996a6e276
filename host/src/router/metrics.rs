//! The router's Prometheus metrics: what the front doors and the request
//! lifecycle count, rendered as text for `GET /metrics`.
//!
//! Counters the request path touches are created once at start (one atomic
//! add per event, no lock, no label lookup); only the selections by branch
//! and the per-worker gauges go through a label lookup. The booked load per
//! worker rank is read from the selection service when `/metrics` is
//! scraped, so it is exactly what the service holds at that moment.
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `selkie_http_requests_total` | `endpoint`, `status` | requests answered (proxied: the worker's status) |
//! | `selkie_http_connections_total` | `thread` | connections accepted, by the serving thread that took them |
//! | `selkie_selections_total` | `policy`, `branch` | selections, by the policy's branch |
//! | `selkie_selection_seconds` | | time in `select` (histogram) |
//! | `selkie_inflight_requests` | `worker`, `rank` | requests booked on a rank |
//! | `selkie_booked_prefill_tokens` | `worker`, `rank` | prompt tokens booked, not yet prefilled |
//! | `selkie_booked_decode_blocks` | `worker`, `rank` | KV blocks booked |
//! | `selkie_refusals_total` | `reason` | requests refused or cut short by the router |
//! | `selkie_upstream_errors_total` | `kind` | `connect`, `timeout`, `broken` (before the head), `body` (mid-body), `stall`, `status_5xx` |
//! | `selkie_retries_total` | | requests sent to a second worker after a refused connection |
//! | `selkie_unhashed_requests_total` | `reason` | requests routed by load, their prompt not hashed |
//! | `selkie_request_bytes_total`, `selkie_response_bytes_total` | | body bytes proxied |
//! | `selkie_open_responses` | | responses being streamed now |
//! | `selkie_client_disconnects_total` | | responses the client left before their end |
//! | `selkie_bound_hits_total` | `bound` | a bound of [`Limits`](super::Limits) was hit |
//! | `selkie_limit` | `bound` | the configured bounds |
//! | `selkie_workers` | | workers in the table |
//! | `selkie_kv_index_blocks` | | blocks the prefix index holds (when the policy reads it) |

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

use super::error::Refusal;
use super::prompt::Unhashed;
use super::Limits;
use crate::WorkerSelectionService;

type Labels = Vec<(&'static str, String)>;

/// `selkie_http_requests_total`'s labels (no allocation per request).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    status: u16,
}

/// `selkie_http_connections_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ThreadLabels {
    thread: u32,
}

/// `selkie_selections_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SelectionLabels {
    policy: &'static str,
    branch: &'static str,
}

/// Why a worker's answer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpstreamErrorKind {
    /// The connection was refused or timed out.
    Connect,
    /// No response head within `response_timeout`.
    Timeout,
    /// The connection broke before the response head.
    Broken,
    /// The connection broke in the middle of the body.
    Body,
    /// No body chunk within `stream_idle_timeout`.
    Stall,
    /// The worker answered with a 5xx status (passed through as it is).
    Status5xx,
}

impl UpstreamErrorKind {
    /// The label.
    pub const fn as_str(self) -> &'static str {
        match self {
            UpstreamErrorKind::Connect => "connect",
            UpstreamErrorKind::Timeout => "timeout",
            UpstreamErrorKind::Broken => "broken",
            UpstreamErrorKind::Body => "body",
            UpstreamErrorKind::Stall => "stall",
            UpstreamErrorKind::Status5xx => "status_5xx",
        }
    }

    /// Every kind, for metrics registered up front.
    pub const ALL: [UpstreamErrorKind; 6] = [
        UpstreamErrorKind::Connect,
        UpstreamErrorKind::Timeout,
        UpstreamErrorKind::Broken,
        UpstreamErrorKind::Body,
        UpstreamErrorKind::Stall,
        UpstreamErrorKind::Status5xx,
    ];
}

/// The bounds counted in `selkie_bound_hits_total{bound}`.
pub const BOUNDS: [&str; 9] = [
    "max_body_bytes",
    "max_concurrent_requests",
    "max_connections",
    "max_prompt_tokens",
    "max_tokenize_bytes",
    "max_index_blocks",
    "response_timeout",
    "stream_idle_timeout",
    "body_read_timeout",
];

/// The router's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    connections: Family<ThreadLabels, Counter>,
    selections: Family<SelectionLabels, Counter>,
    policy: &'static str,
    select_seconds: Histogram,
    inflight: Family<Labels, Gauge>,
    booked_prefill: Family<Labels, Gauge>,
    booked_decode: Family<Labels, Gauge>,
    refusals: HashMap<Refusal, Counter>,
    unhashed: HashMap<Unhashed, Counter>,
    upstream: HashMap<UpstreamErrorKind, Counter>,
    bounds: HashMap<&'static str, Counter>,
    retries: Counter,
    request_bytes: Counter,
    response_bytes: Counter,
    open_responses: Gauge,
    disconnects: Counter,
    workers: Gauge,
    index_blocks: Gauge,
    unused_event_labels: Gauge,
    /// One scrape at a time (a scrape rebuilds the per-rank gauges).
    scraping: std::sync::Mutex<()>,
}

impl Metrics {
    /// The registry, to register more metrics before serving.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The metrics of a router running `policy` under `limits`.
    pub fn new(policy: &'static str, limits: &Limits) -> Self {
        let mut r = Registry::default();
        let limit_family = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        for (name, value) in limits.named() {
            limit_family.get_or_create(&vec![("bound", name.to_owned())]).set(value);
        }
        r.register(
            "selkie_limit",
            "The configured bounds (durations in seconds)",
            limit_family,
        );
        Metrics {
            requests: registered(
                &mut r,
                "selkie_http_requests",
                "Requests answered, by endpoint and status",
            ),
            connections: registered(
                &mut r,
                "selkie_http_connections",
                "Connections accepted, by serving thread",
            ),
            selections: registered(&mut r, "selkie_selections", "Selections, by policy and branch"),
            policy,
            select_seconds: {
                let h = Histogram::new(exponential_buckets(1e-7, 2.0, 16));
                r.register(
                    "selkie_selection_seconds",
                    "Time in the selection service's select",
                    h.clone(),
                );
                h
            },
            inflight: registered(&mut r, "selkie_inflight_requests", "Requests booked on a worker rank"),
            booked_prefill: registered(
                &mut r,
                "selkie_booked_prefill_tokens",
                "Prompt tokens booked on a worker rank, not yet prefilled",
            ),
            booked_decode: registered(
                &mut r,
                "selkie_booked_decode_blocks",
                "KV blocks booked on a worker rank",
            ),
            refusals: counters(
                &mut r,
                (
                    "selkie_refusals",
                    "Requests refused or cut short by the router, by reason",
                ),
                "reason",
                Refusal::ALL.map(|x| (x, x.as_str())),
            ),
            unhashed: counters(
                &mut r,
                (
                    "selkie_unhashed_requests",
                    "Requests routed by load because their prompt could not be hashed, by reason",
                ),
                "reason",
                Unhashed::ALL.map(|x| (x, x.as_str())),
            ),
            upstream: counters(
                &mut r,
                ("selkie_upstream_errors", "Worker failures, by kind"),
                "kind",
                UpstreamErrorKind::ALL.map(|x| (x, x.as_str())),
            ),
            bounds: counters(
                &mut r,
                ("selkie_bound_hits", "Times a configured bound was hit"),
                "bound",
                BOUNDS.map(|b| (b, b)),
            ),
            retries: registered(
                &mut r,
                "selkie_retries",
                "Requests sent to a second worker after a refused connection",
            ),
            request_bytes: registered(&mut r, "selkie_request_bytes", "Request body bytes sent to workers"),
            response_bytes: registered(&mut r, "selkie_response_bytes", "Response body bytes passed to clients"),
            open_responses: registered(&mut r, "selkie_open_responses", "Responses being passed to clients now"),
            disconnects: registered(
                &mut r,
                "selkie_client_disconnects",
                "Responses whose client went away before their end",
            ),
            workers: registered(&mut r, "selkie_workers", "Workers in the table"),
            index_blocks: registered(&mut r, "selkie_kv_index_blocks", "Blocks the prefix index holds"),
            unused_event_labels: registered(
                &mut r,
                "selkie_kv_events_labels_unused",
                "Workers whose kv_events label this router does not follow (it does not use KV events)",
            ),
            scraping: std::sync::Mutex::new(()),
            registry: r,
        }
    }

    /// A request answered with `status`.
    pub fn answered(&self, endpoint: &'static str, status: u16) {
        self.requests.get_or_create(&RequestLabels { endpoint, status }).inc();
    }

    /// How many workers name a KV event endpoint this router does not
    /// follow.
    pub fn set_unused_event_labels(&self, workers: usize) {
        self.unused_event_labels.set(i64::try_from(workers).unwrap_or(i64::MAX));
    }

    /// A connection accepted by serving thread `thread`.
    pub fn accepted(&self, thread: usize) {
        let thread = u32::try_from(thread).unwrap_or(u32::MAX);
        self.connections.get_or_create(&ThreadLabels { thread }).inc();
    }

    /// A selection took `seconds` and went `via` a branch or a composed
    /// policy's picker ([`Explanation::via`](crate::Explanation::via)).
    pub fn selected(&self, via: &'static str, seconds: f64) {
        self.select_seconds.observe(seconds);
        self.selections
            .get_or_create(&SelectionLabels {
                policy: self.policy,
                branch: via,
            })
            .inc();
    }

    /// A refusal.
    pub fn refused(&self, reason: Refusal) {
        if let Some(c) = self.refusals.get(&reason) {
            c.inc();
        }
    }

    /// A prompt routed by load.
    pub fn unhashed(&self, reason: Unhashed) {
        if let Some(c) = self.unhashed.get(&reason) {
            c.inc();
        }
        if reason == Unhashed::PromptTooLong {
            self.bound_hit("max_prompt_tokens");
        }
    }

    /// A worker failure.
    pub fn upstream_error(&self, kind: UpstreamErrorKind) {
        if let Some(c) = self.upstream.get(&kind) {
            c.inc();
        }
    }

    /// A bound was hit (one of `BOUNDS`).
    pub fn bound_hit(&self, bound: &'static str) {
        if let Some(c) = self.bounds.get(bound) {
            c.inc();
        }
    }

    /// A retry on the next choice.
    pub fn retried(&self) {
        self.retries.inc();
    }

    /// Request body bytes sent.
    pub fn request_bytes(&self, n: usize) {
        self.request_bytes.inc_by(n as u64);
    }

    /// Response body bytes passed on.
    pub fn response_bytes(&self, n: usize) {
        self.response_bytes.inc_by(n as u64);
    }

    /// A response started (`+1`) or ended (`-1`).
    pub fn open_response(&self, delta: i64) {
        self.open_responses.inc_by(delta);
    }

    /// A client went away before its response ended.
    pub fn client_disconnected(&self) {
        self.disconnects.inc();
    }

    /// The prefix index holds `blocks`.
    pub fn index_blocks(&self, blocks: usize) {
        self.index_blocks.set(blocks as i64);
    }

    /// The Prometheus text, with the booked load per worker rank read from
    /// `service` now (`url_of` names each worker).
    pub fn render(&self, service: &WorkerSelectionService, url_of: impl Fn(u64) -> String) -> String {
        let _one = self.scraping.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.inflight.clear();
        self.booked_prefill.clear();
        self.booked_decode.clear();
        let workers = service.workers();
        self.workers.set(workers.len() as i64);
        for record in workers {
            let Some(status) = service.worker_status(record.worker_id) else {
                continue;
            };
            let url = record
                .labels
                .get(super::workers::URL_LABEL)
                .cloned()
                .unwrap_or_else(|| url_of(record.worker_id));
            for rank in status.ranks {
                let labels = vec![("worker", url.clone()), ("rank", rank.dp_rank.to_string())];
                self.inflight
                    .get_or_create(&labels)
                    .set(i64::from(rank.active_requests));
                self.booked_prefill
                    .get_or_create(&labels)
                    .set(i64::from(rank.active_prefill_tokens));
                self.booked_decode
                    .get_or_create(&labels)
                    .set(i64::from(rank.active_decode_blocks));
            }
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A metric of its type's default, registered under `name`.
fn registered<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    let m = M::default();
    registry.register(name, help, m.clone());
    m
}

/// A counter family registered as `(name, help)`, with the counter of
/// each item (labelled `label="<its name>"`) created up front, so counting
/// takes no lookup.
fn counters<K: Eq + Hash, const N: usize>(
    registry: &mut Registry,
    (name, help): (&str, &str),
    label: &'static str,
    items: [(K, &'static str); N],
) -> HashMap<K, Counter> {
    let family = registered::<Family<Labels, Counter>>(registry, name, help);
    items
        .into_iter()
        .map(|(k, v)| (k, family.get_or_create_owned(&vec![(label, v.to_owned())])))
        .collect()
}
