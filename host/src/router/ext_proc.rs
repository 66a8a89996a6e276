//! The endpoint picker door: `selkie serve --ext-proc-port P` answers
//! Envoy's external processing calls (`envoy.service.ext_proc.v3.
//! ExternalProcessor/Process`, gRPC, one bidirectional stream per HTTP
//! request) as the Gateway API Inference Extension's endpoint picker
//! protocol asks. It shares the HTTP door's [`RouterCore`]: the same
//! selection service, KV index, event subscribers and bookings.
//!
//! What a stream goes through:
//!
//! 1. **Request headers.** `:path` says which OpenAI shape the body has
//!    (ending in `/chat/completions`: chat; in `/completions`:
//!    completions; any other path: chat when the body has `messages`). The proxy's subset hint, when its
//!    metadata carries one (namespace [`SUBSET_HINT_NAMESPACE`], key
//!    [`SUBSET_HINT_KEY`], a list of `ip:port`), limits the choice to
//!    those endpoints.
//! 2. **Request body**, in one message or in chunks, at most
//!    [`Limits::max_body_bytes`](super::Limits::max_body_bytes) in all.
//!    At its end the picker parses it (as the HTTP door does), chooses and
//!    books, and answers with the endpoint twice, equal values: the
//!    request header [`DESTINATION_HEADER`] and the dynamic metadata
//!    namespace [`DESTINATION_NAMESPACE`], key [`DESTINATION_HEADER`]. The
//!    value is `ip:port` of the chosen worker, then up to
//!    [`ServeConfig::ext_proc_fallbacks`](super::ServeConfig::ext_proc_fallbacks)
//!    fallbacks, comma-separated, in the policy's order (its cost now,
//!    without cache credit).
//!    * With the request body in `FULL_DUPLEX_STREAMED` mode (what the
//!      protocol recommends; the proxy says so in `protocol_config`), the
//!      headers answer waits for the body, carries the header mutation
//!      (and `content-length`) and `clear_route_cache`, and the body is
//!      sent back as streamed body mutations.
//!    * In the other modes (`BUFFERED`, `STREAMED`), the headers are
//!      answered at once and the decision comes in the answer to the
//!      body's last message (in `BUFFERED` mode, its one message). Only
//!      `BUFFERED` lets a proxy route on it: in `STREAMED` mode the proxy
//!      has picked its upstream before the body ends. A body that ends
//!      in request trailers in `STREAMED` mode gets the decision in the
//!      trailers' answer, as metadata only.
//! 3. **Refusals** are immediate responses (the picker then closes the
//!    stream) with the status and JSON body
//!    the HTTP door gives: 400 (bad body), 404 (unknown model), 413 (body
//!    over the limit), 429 with `Retry-After` (every eligible worker at
//!    its admission limit), 503 (no worker, or none in the subset).
//!    Nothing stays booked.
//! 4. **The endpoint served.** When the proxy reports where it sent the
//!    request (the response header [`SERVED_KEY`], or the same key in the
//!    `envoy.lb` namespace of its metadata) and that is another worker,
//!    the booking moves there (`selkie_ext_proc_served_elsewhere_total`;
//!    a worker at its admission limit cannot take it: the booking stays,
//!    counted in `selkie_ext_proc_move_refused_total`).
//! 5. **The response.** Its headers answer adds `x-selkie-worker` and,
//!    when the policy read cache overlaps,
//!    `x-selkie-predicted-cached-tokens`; the booking's prefill completes
//!    at the first body chunk (or at the headers of a response that does
//!    not stream), output blocks are booked as generated tokens pass, and
//!    the booking is released at the response's end of stream, at its
//!    trailers (the picker then closes the stream), or when the gRPC
//!    stream ends or breaks first. Response
//!    bodies in `FULL_DUPLEX_STREAMED` mode are sent back unchanged.
//!
//! FailOpen and FailClose (what the proxy does when the picker does not
//! answer) are the proxy's settings, not the picker's.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap as EnvoyHeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::error::{ApiError, Refusal};
use super::http::{PREDICTED_CACHED_HEADER, WORKER_HEADER};
use super::lifecycle::Ending;
use super::request::{Endpoint, ParsedRequest};
use super::route::{Choice, RouterCore};
use super::workers::WorkerEntry;
use crate::WorkerId;

/// The request header (and dynamic metadata key) that names the chosen
/// endpoint(s): `ip:port[,ip:port...]`.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// The dynamic metadata namespace of the destination.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";

/// The metadata namespace of the proxy's subset hint.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";

/// The key of the subset hint: a list of `ip:port` the proxy allows.
pub const SUBSET_HINT_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Where the proxy reports the endpoint it sent the request to (a
/// response header, or a key of the `envoy.lb` metadata namespace).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// The most fallbacks `--ext-proc-fallbacks` takes.
pub const MAX_FALLBACKS: usize = 16;

/// A body sent back in `FULL_DUPLEX_STREAMED` mode goes in chunks of at
/// most this many bytes (under Envoy's default gRPC message limit).
pub const STREAMED_CHUNK_BYTES: usize = 62_000;

/// Answers queued per stream before the picker waits for the proxy.
const ANSWER_QUEUE: usize = 16;

/// `BodySendMode::BUFFERED` of Envoy's ext_proc filter.
const BUFFERED: i32 = 2;

/// `BodySendMode::FULL_DUPLEX_STREAMED` of Envoy's ext_proc filter.
const FULL_DUPLEX_STREAMED: i32 = 4;

/// The message whose answer carries the decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trigger {
    /// Request headers that end the request (no body).
    Headers,
    /// The body's last message (or the one message of a buffered body).
    Body,
    /// Request trailers, before which the body did not end.
    Trailers,
}

/// How a stream ended for the picker (the `outcome` label).
#[derive(Clone, Copy)]
enum Outcome {
    Routed,
    Refused,
    BrokenBeforeDecision,
}

impl Outcome {
    const ALL: [Outcome; 3] = [Outcome::Routed, Outcome::Refused, Outcome::BrokenBeforeDecision];

    const fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::Refused => "refused",
            Outcome::BrokenBeforeDecision => "broken_before_decision",
        }
    }
}

/// The picker door's counters.
#[derive(Clone)]
pub struct PickerMetrics {
    streams: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// `streams`' counters, one per [`Outcome`], looked up once.
    outcomes: [Counter; 3],
    served_elsewhere: Counter,
    move_refused: Counter,
}

impl Default for PickerMetrics {
    fn default() -> Self {
        let streams = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        let outcomes = Outcome::ALL.map(|o| streams.get_or_create(&vec![("outcome", o.as_str())]).clone());
        PickerMetrics {
            streams,
            outcomes,
            served_elsewhere: Counter::default(),
            move_refused: Counter::default(),
        }
    }
}

impl PickerMetrics {
    /// Registers them (`selkie_ext_proc_streams_total{outcome}`,
    /// `selkie_ext_proc_served_elsewhere_total`,
    /// `selkie_ext_proc_move_refused_total`).
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "selkie_ext_proc_streams",
            "Endpoint picker streams, by outcome (routed, refused, broken before a decision)",
            self.streams.clone(),
        );
        registry.register(
            "selkie_ext_proc_served_elsewhere",
            "Requests the proxy sent to another endpoint than the picker's first (the booking moved)",
            self.served_elsewhere.clone(),
        );
        registry.register(
            "selkie_ext_proc_move_refused",
            "Requests the proxy served elsewhere whose booking could not move there (that worker at its admission limit, or gone)",
            self.move_refused.clone(),
        );
    }

    fn stream(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].inc();
    }
}

/// The endpoint picker: an `ExternalProcessor` over the router's core.
#[derive(Clone)]
pub struct Picker {
    inner: Arc<PickerInner>,
}

struct PickerInner {
    core: Arc<RouterCore>,
    max_body_bytes: usize,
    retry_after_secs: u64,
    fallbacks: usize,
    metrics: PickerMetrics,
    shutting_down: AtomicBool,
}

impl Picker {
    /// A picker over `core`: bodies up to `max_body_bytes`, `Retry-After`
    /// of `retry_after_secs` on 429 and 503, up to `fallbacks` fallback
    /// endpoints after the chosen one.
    pub fn new(
        core: Arc<RouterCore>,
        max_body_bytes: usize,
        retry_after_secs: u64,
        fallbacks: usize,
        metrics: PickerMetrics,
    ) -> Self {
        Picker {
            inner: Arc::new(PickerInner {
                core,
                max_body_bytes,
                retry_after_secs,
                fallbacks: fallbacks.min(MAX_FALLBACKS),
                metrics,
                shutting_down: AtomicBool::new(false),
            }),
        }
    }

    /// The gRPC service to serve.
    pub fn into_service(self) -> ExternalProcessorServer<Picker> {
        ExternalProcessorServer::new(self)
    }

    /// From now on, new requests get 503.
    pub fn begin_shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::Relaxed);
    }
}

/// The answers of one stream, as tonic sends them.
pub struct Answers(mpsc::Receiver<Result<ProcessingResponse, Status>>);

impl tonic::codegen::tokio_stream::Stream for Answers {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(ANSWER_QUEUE);
        let inner = self.inner.clone();
        tokio::spawn(async move { inner.run(request.into_inner(), tx).await });
        Ok(Response::new(Answers(rx)))
    }
}

/// One stream's state.
#[derive(Default)]
struct StreamState {
    request_duplex: bool,
    request_buffered: bool,
    response_duplex: bool,
    path: Option<String>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// An immediate response was sent: the stream is over for the picker.
    refused: bool,
    decided: Option<Decided>,
    response_headers_seen: bool,
    response_body_started: bool,
    ended: bool,
}

/// A decision and its booking.
struct Decided {
    choice: Choice,
    subset: Option<Vec<WorkerId>>,
}

impl PickerInner {
    async fn run(
        &self,
        mut inbound: Streaming<ProcessingRequest>,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) {
        let mut s = StreamState::default();
        let clean = loop {
            let msg = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break true,
                Err(_) => break false,
            };
            let answers = self.step(&mut s, msg).await;
            let mut sent = true;
            for a in answers {
                if tx.send(Ok(a)).await.is_err() {
                    sent = false;
                    break;
                }
            }
            if !sent {
                break false;
            }
            // After an immediate response, or once the response has
            // ended, the picker has nothing more to do: it closes the
            // stream (the proxy goes on without it).
            if s.refused || s.ended {
                break true;
            }
        };
        self.finish(&mut s, clean);
    }

    /// The stream ended (`clean`: the proxy closed it) or broke.
    fn finish(&self, s: &mut StreamState, clean: bool) {
        match s.decided.take() {
            Some(mut d) if !s.ended => {
                // A proxy that does not send response bodies closes the
                // stream after the headers; one that stops in the middle
                // of a body lost its client or its upstream.
                let ending = if clean && s.response_headers_seen && !s.response_body_started {
                    Ending::Complete
                } else {
                    // Counted in selkie_client_disconnects_total by the
                    // lifecycle.
                    Ending::ClientGone
                };
                d.choice.lifecycle.end(ending);
            }
            Some(_) => {}
            None if !s.refused => self.metrics.stream(Outcome::BrokenBeforeDecision),
            None => {}
        }
    }

    async fn step(&self, s: &mut StreamState, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(pc) = &msg.protocol_config {
            s.request_duplex = pc.request_body_mode == FULL_DUPLEX_STREAMED;
            s.request_buffered = pc.request_body_mode == BUFFERED;
            s.response_duplex = pc.response_body_mode == FULL_DUPLEX_STREAMED;
        }
        if let Some(md) = &msg.metadata_context {
            if let Some(hint) = subset_hint(md) {
                s.subset = Some(hint);
            }
            if let Some(served) = string_in(md, DESTINATION_NAMESPACE, SERVED_KEY) {
                self.served(s, &served);
            }
        }
        if s.refused {
            return Vec::new();
        }
        match msg.request {
            Some(Phase::RequestHeaders(h)) => {
                let headers = h.headers.unwrap_or_default();
                s.path = header(&headers, ":path").map(|p| p.split('?').next().unwrap_or_default().to_owned());
                if h.end_of_stream {
                    return self.decide(s, Trigger::Headers).await;
                }
                if s.request_duplex {
                    Vec::new()
                } else {
                    vec![answer(Answer::RequestHeaders(HeadersResponse::default()))]
                }
            }
            Some(Phase::RequestBody(b)) => {
                if s.decided.is_some() {
                    // A body after the decision (trailers came first).
                    return vec![self.body_back(s.request_duplex, b.body, b.end_of_stream, true)];
                }
                if s.body.len() + b.body.len() > self.max_body_bytes {
                    self.core.metrics.bound_hit("max_body_bytes");
                    return vec![self.refuse(
                        s,
                        ApiError::new(
                            Refusal::BodyTooLarge,
                            format!("the body is over max_body_bytes = {}", self.max_body_bytes),
                        ),
                    )];
                }
                s.body.extend_from_slice(&b.body);
                // A buffered body comes in one message, which says
                // end_of_stream only when no trailers follow.
                if b.end_of_stream || s.request_buffered {
                    self.decide(s, Trigger::Body).await
                } else if s.request_duplex {
                    Vec::new()
                } else {
                    vec![answer(Answer::RequestBody(BodyResponse::default()))]
                }
            }
            Some(Phase::RequestTrailers(_)) => {
                if s.decided.is_none() {
                    let mut out = self.decide(s, Trigger::Trailers).await;
                    if s.request_duplex && !s.refused {
                        out.push(answer(Answer::RequestTrailers(TrailersResponse::default())));
                    }
                    out
                } else {
                    vec![answer(Answer::RequestTrailers(TrailersResponse::default()))]
                }
            }
            Some(Phase::ResponseHeaders(h)) => {
                let headers = h.headers.unwrap_or_default();
                if let Some(served) = header(&headers, SERVED_KEY) {
                    self.served(s, &served);
                }
                s.response_headers_seen = true;
                let mut set = Vec::new();
                if let Some(d) = &mut s.decided {
                    d.choice.lifecycle.response_head();
                    set.push(header_option(WORKER_HEADER, d.choice.worker.url.as_str()));
                    if let Some(tokens) = d.choice.predicted_cached_tokens {
                        set.push(header_option(PREDICTED_CACHED_HEADER, &tokens.to_string()));
                    }
                    if h.end_of_stream {
                        d.choice.lifecycle.end(Ending::Complete);
                        s.ended = true;
                    }
                }
                vec![answer(Answer::ResponseHeaders(HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: set,
                            remove_headers: Vec::new(),
                        }),
                        ..CommonResponse::default()
                    }),
                }))]
            }
            Some(Phase::ResponseBody(b)) => {
                s.response_body_started = true;
                if let Some(d) = &mut s.decided {
                    if !s.ended {
                        d.choice.lifecycle.body_chunk(&b.body);
                        if b.end_of_stream {
                            d.choice.lifecycle.end(Ending::Complete);
                            s.ended = true;
                        }
                    }
                }
                vec![self.body_back(s.response_duplex, b.body, b.end_of_stream, false)]
            }
            Some(Phase::ResponseTrailers(_)) => {
                if let Some(d) = &mut s.decided {
                    if !s.ended {
                        d.choice.lifecycle.end(Ending::Complete);
                        s.ended = true;
                    }
                }
                vec![answer(Answer::ResponseTrailers(TrailersResponse::default()))]
            }
            // Flow-control updates and the like: nothing to answer.
            None => Vec::new(),
        }
    }

    /// The answer to a body message that passes unchanged.
    fn body_back(&self, duplex: bool, body: Vec<u8>, end_of_stream: bool, request: bool) -> ProcessingResponse {
        let response = if duplex {
            BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(streamed(body, end_of_stream)),
                    ..CommonResponse::default()
                }),
            }
        } else {
            BodyResponse::default()
        };
        answer(if request {
            Answer::RequestBody(response)
        } else {
            Answer::ResponseBody(response)
        })
    }

    /// The body is complete: parse, choose, book, answer.
    async fn decide(&self, s: &mut StreamState, trigger: Trigger) -> Vec<ProcessingResponse> {
        match self.try_decide(s, trigger).await {
            Ok(answers) => answers,
            Err(e) => vec![self.refuse(s, e)],
        }
    }

    async fn try_decide(&self, s: &mut StreamState, trigger: Trigger) -> Result<Vec<ProcessingResponse>, ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::new(Refusal::ShuttingDown, "the picker is shutting down"));
        }
        let body = std::mem::take(&mut s.body);
        let endpoint = endpoint_of(s.path.as_deref(), &body);
        let parsed = ParsedRequest::parse(endpoint, &body)?;
        let view = self.core.table.view();
        let subset: Option<Vec<WorkerId>> = match &s.subset {
            None => None,
            Some(names) => {
                let ids: Vec<WorkerId> = view
                    .workers()
                    .iter()
                    .filter(|w| names.iter().any(|n| n == w.url.authority()))
                    .map(|w| w.id)
                    .collect();
                if ids.is_empty() {
                    return Err(ApiError::new(
                        Refusal::NoWorkers,
                        format!(
                            "none of the endpoints the proxy allows ({}) is a worker of this picker",
                            names.join(",")
                        ),
                    ));
                }
                Some(ids)
            }
        };
        let choice = match &subset {
            Some(ids) => self.core.choose_among(&parsed, ids).await?,
            None => self.core.choose(&parsed, None).await?,
        };
        drop(parsed);
        let mut destination = choice.worker.url.authority().to_owned();
        for w in self.core.fallbacks(&choice, subset.as_deref(), self.fallbacks) {
            destination.push(',');
            destination.push_str(w.url.authority());
        }
        self.metrics.stream(Outcome::Routed);
        self.core.metrics.answered("ext_proc", 200);
        self.core.metrics.request_bytes(body.len());
        let metadata = Struct {
            fields: [(
                DESTINATION_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(Struct {
                        fields: [(DESTINATION_HEADER.to_owned(), string_value(&destination))].into(),
                    })),
                },
            )]
            .into(),
        };
        let mut set = vec![header_option(DESTINATION_HEADER, &destination)];
        let answers = if s.request_duplex {
            set.push(header_option("content-length", &body.len().to_string()));
            let mut out = vec![ProcessingResponse {
                response: Some(Answer::RequestHeaders(HeadersResponse {
                    response: Some(common(set)),
                })),
                dynamic_metadata: Some(metadata),
                ..ProcessingResponse::default()
            }];
            if trigger != Trigger::Headers {
                // The body goes on; with trailers to come, it does not end.
                let ends = trigger == Trigger::Body;
                let mut chunks = body.chunks(STREAMED_CHUNK_BYTES).peekable();
                if chunks.peek().is_none() {
                    out.push(self.body_back(true, Vec::new(), ends, true));
                }
                while let Some(chunk) = chunks.next() {
                    let last = chunks.peek().is_none();
                    out.push(self.body_back(true, chunk.to_vec(), last && ends, true));
                }
            }
            out
        } else {
            let response = match trigger {
                Trigger::Headers => Answer::RequestHeaders(HeadersResponse {
                    response: Some(common(set)),
                }),
                Trigger::Body => Answer::RequestBody(BodyResponse {
                    response: Some(common(set)),
                }),
                // The headers have gone on: only the metadata can name the
                // endpoint now.
                Trigger::Trailers => Answer::RequestTrailers(TrailersResponse::default()),
            };
            vec![ProcessingResponse {
                response: Some(response),
                dynamic_metadata: Some(metadata),
                ..ProcessingResponse::default()
            }]
        };
        s.decided = Some(Decided { choice, subset });
        Ok(answers)
    }

    /// The proxy reports it sent the request to `served`: the booking
    /// moves there when that is another worker of the picker.
    fn served(&self, s: &mut StreamState, served: &str) {
        let Some(d) = &mut s.decided else { return };
        let first = served.split(',').next().unwrap_or_default().trim();
        if first.is_empty() || first == d.choice.worker.url.authority() {
            return;
        }
        let view = self.core.table.view();
        let Some(worker): Option<Arc<WorkerEntry>> =
            view.workers().iter().find(|w| w.url.authority() == first).cloned()
        else {
            tracing::debug!(
                served = first,
                "the proxy served an endpoint that is not a worker of this picker"
            );
            return;
        };
        if d.subset.as_ref().is_some_and(|ids| !ids.contains(&worker.id)) {
            tracing::debug!(
                served = first,
                "the proxy served an endpoint outside its own subset hint"
            );
        }
        match self.core.moved_to(&mut d.choice, worker) {
            Ok(()) => {
                self.metrics.served_elsewhere.inc();
            }
            Err(e) => {
                self.metrics.move_refused.inc();
                tracing::warn!(served = first, %e, "the proxy served another endpoint, which refused the booking: it stays");
            }
        }
    }

    /// An immediate response for `e` (nothing stays booked).
    fn refuse(&self, s: &mut StreamState, e: ApiError) -> ProcessingResponse {
        s.refused = true;
        s.body = Vec::new();
        if let Some(mut d) = s.decided.take() {
            d.choice.lifecycle.end(Ending::Refused);
        }
        let status = e.reason.status();
        self.core.metrics.refused(e.reason);
        self.core.metrics.answered("ext_proc", status);
        self.metrics.stream(Outcome::Refused);
        let mut set = vec![header_option("content-type", "application/json")];
        if e.reason.retry_after() {
            set.push(header_option("retry-after", &self.retry_after_secs.to_string()));
        }
        answer(Answer::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: set,
                remove_headers: Vec::new(),
            }),
            body: e.body().to_vec(),
            grpc_status: None,
            details: e.reason.as_str().to_owned(),
        }))
    }
}

/// Which OpenAI shape a body has: chat when the path says so or the body
/// has `messages`, else completions.
fn endpoint_of(path: Option<&str>, body: &[u8]) -> Endpoint {
    match path {
        Some(p) if p.ends_with("/chat/completions") => Endpoint::ChatCompletions,
        Some(p) if p.ends_with("/completions") => Endpoint::Completions,
        _ if memchr::memmem::find(body, b"\"messages\"").is_some() => Endpoint::ChatCompletions,
        _ => Endpoint::Completions,
    }
}

fn answer(response: Answer) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn common(set: Vec<HeaderValueOption>) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: set,
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyMutation {
    BodyMutation {
        mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
            body,
            end_of_stream,
            ..StreamedBodyResponse::default()
        })),
    }
}

fn header_option(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        ..HeaderValueOption::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// A header's value (`raw_value`, or `value` from older proxies).
fn header(headers: &EnvoyHeaderMap, name: &str) -> Option<String> {
    headers
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| {
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            }
        })
}

/// A string (or the first string of a list) under `namespace.key`.
fn string_in(md: &Metadata, namespace: &str, key: &str) -> Option<String> {
    match md.filter_metadata.get(namespace)?.fields.get(key)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        Kind::ListValue(l) => l.values.iter().find_map(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        }),
        _ => None,
    }
}

/// The subset hint: the endpoints listed (as strings, or one
/// comma-separated string).
fn subset_hint(md: &Metadata) -> Option<Vec<String>> {
    let v = md
        .filter_metadata
        .get(SUBSET_HINT_NAMESPACE)?
        .fields
        .get(SUBSET_HINT_KEY)?;
    let mut out = Vec::new();
    match v.kind.as_ref()? {
        Kind::ListValue(l) => {
            for item in &l.values {
                if let Some(Kind::StringValue(s)) = &item.kind {
                    out.extend(s.split(',').map(|x| x.trim().to_owned()).filter(|x| !x.is_empty()));
                }
            }
        }
        Kind::StringValue(s) => out.extend(s.split(',').map(|x| x.trim().to_owned()).filter(|x| !x.is_empty())),
        _ => return None,
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(namespace: &str, key: &str, value: Value) -> Metadata {
        Metadata {
            filter_metadata: [(
                namespace.to_owned(),
                Struct {
                    fields: [(key.to_owned(), value)].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
        let list = Value {
            kind: Some(Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
                values: vec![string_value("10.0.0.1:8000"), string_value("10.0.0.2:8000")],
            })),
        };
        assert_eq!(
            subset_hint(&md(SUBSET_HINT_NAMESPACE, SUBSET_HINT_KEY, list)).unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
        let one = string_value("10.0.0.1:8000, 10.0.0.3:8000");
        assert_eq!(
            subset_hint(&md(SUBSET_HINT_NAMESPACE, SUBSET_HINT_KEY, one)).unwrap(),
            ["10.0.0.1:8000", "10.0.0.3:8000"]
        );
        assert!(subset_hint(&md("other", SUBSET_HINT_KEY, string_value("x"))).is_none());
    }

    #[test]
    fn the_shape_comes_from_the_path_then_the_body() {
        assert_eq!(
            endpoint_of(Some("/v1/chat/completions"), b"{}"),
            Endpoint::ChatCompletions
        );
        assert_eq!(
            endpoint_of(Some("/v1/completions"), b"{\"messages\":[]}"),
            Endpoint::Completions
        );
        assert_eq!(endpoint_of(None, b"{\"messages\":[]}"), Endpoint::ChatCompletions);
        assert_eq!(
            endpoint_of(Some("/generate"), b"{\"prompt\":\"x\"}"),
            Endpoint::Completions
        );
    }

    #[test]
    fn headers_are_read_from_raw_value_or_value() {
        let map = EnvoyHeaderMap {
            headers: vec![
                HeaderValue {
                    key: ":path".into(),
                    value: String::new(),
                    raw_value: b"/v1/completions".to_vec(),
                },
                HeaderValue {
                    key: "X-Old".into(),
                    value: "v".into(),
                    raw_value: Vec::new(),
                },
            ],
        };
        assert_eq!(header(&map, ":path").as_deref(), Some("/v1/completions"));
        assert_eq!(header(&map, "x-old").as_deref(), Some("v"));
        assert_eq!(header(&map, "absent"), None);
    }
}
