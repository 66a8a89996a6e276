//! The OpenAI-compatible HTTP front door: accepts connections (HTTP/1.1
//! and HTTP/2 without TLS), answers `/health`, `/metrics` and
//! `/v1/models` itself, and proxies `/v1/completions` and
//! `/v1/chat/completions` to the worker [`RouterCore`] chooses.
//!
//! A proxied response reaches the client as the worker wrote it: its
//! status, its headers (less the hop-by-hop ones, plus
//! `x-selkie-worker: URL`) and its body chunk by chunk as each arrives (an
//! SSE stream is never buffered). The request body is forwarded unchanged
//! too, with the request's headers less the hop-by-hop ones and
//! `x-selkie-worker`. Refusals are JSON (see [`Refusal`]).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::{ApiError, Refusal};
use super::lifecycle::{Ending, Lifecycle};
use super::metrics::UpstreamErrorKind;
use super::request::{Endpoint, ParsedRequest};
use super::route::{Choice, RouterCore};
use super::upstream::{SendError, Upstream};
use super::Limits;

/// The response header naming the worker that served a request (and the
/// request header that names the worker a request must go to).
pub const WORKER_HEADER: &str = "x-selkie-worker";

/// The response header with the prompt tokens the router predicted the
/// chosen worker rank holds in its cache (whole blocks), when its policy
/// reads cache overlaps. Compare it with the engine's own count
/// (`usage.prompt_tokens_details.cached_tokens` in vLLM).
pub const PREDICTED_CACHED_HEADER: &str = "x-selkie-predicted-cached-tokens";

/// The request header carrying the chosen data-parallel rank, for workers
/// with several (vLLM's name).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1),
/// plus `host` and `content-length`, which the router sets itself.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

/// The state of the HTTP door.
///
/// A router serving on several threads has one door per thread
/// ([`HttpDoor::sibling`]): each with its own connections to the workers,
/// all sharing the routing core, the bounds on requests and connections,
/// and the shutdown.
pub struct HttpDoor {
    core: Arc<RouterCore>,
    upstream: Upstream,
    limits: Limits,
    inflight: Arc<Semaphore>,
    connections: Arc<Semaphore>,
    retry_after: HeaderValue,
    shutting_down: Arc<AtomicBool>,
    /// Which serving thread this door is (0: the one that started it).
    thread: usize,
}

/// A response body: the router's own, or a worker's passed through.
pub enum ResponseBody {
    /// The router's answer.
    Local(Full<Bytes>),
    /// A worker's, followed by its booking.
    Proxied(Box<ProxyBody>),
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ResponseBody::Local(b) => Pin::new(b).poll_frame(cx).map_err(|e| match e {}),
            ResponseBody::Proxied(b) => Pin::new(b.as_mut()).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Local(b) => b.is_end_stream(),
            ResponseBody::Proxied(b) => b.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Local(b) => b.size_hint(),
            ResponseBody::Proxied(b) => b.inner.size_hint(),
        }
    }
}

/// A worker's response body on its way to the client: each chunk is
/// passed on as it arrives and shown to the booking's [`Lifecycle`]; the
/// booking is released when the body ends, breaks, stalls past
/// `stream_idle_timeout`, or is dropped because the client left.
pub struct ProxyBody {
    inner: Incoming,
    lifecycle: Lifecycle,
    idle: Duration,
    stall: Pin<Box<tokio::time::Sleep>>,
    done: bool,
    /// The worker's error, passed on after one flush.
    broken: Option<Box<dyn std::error::Error + Send + Sync>>,
    core: Arc<RouterCore>,
    _permit: OwnedSemaphorePermit,
}

/// The worker sent nothing for `stream_idle_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the worker sent nothing for {0:?}; the response is cut")]
struct Stalled(Duration);

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(e) = this.broken.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.lifecycle.body_chunk(data);
                }
                let deadline = tokio::time::Instant::now() + this.idle;
                this.stall.as_mut().reset(deadline);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish(Ending::Upstream(UpstreamErrorKind::Body));
                // Pending once, so the connection flushes the bytes passed
                // on before the error cuts it; the error comes next poll.
                this.broken = Some(Box::new(e));
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Ready(None) => {
                this.finish(Ending::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => match this.stall.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.core.metrics.bound_hit("stream_idle_timeout");
                    this.finish(Ending::Upstream(UpstreamErrorKind::Stall));
                    Poll::Ready(Some(Err(Box::new(Stalled(this.idle)))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

impl ProxyBody {
    fn finish(&mut self, ending: Ending) {
        if !self.done {
            self.done = true;
            self.lifecycle.end(ending);
        }
    }
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        // Ended or not (a client gone: the lifecycle releases on drop).
        self.core.metrics.open_response(-1);
    }
}

fn local(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::Local(Full::new(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

impl HttpDoor {
    /// The door over `core`.
    pub fn new(core: Arc<RouterCore>, upstream: Upstream, limits: Limits, retry_after: Duration) -> Self {
        let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
        HttpDoor {
            core,
            upstream,
            inflight: Arc::new(Semaphore::new(limits.max_concurrent_requests)),
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            retry_after: HeaderValue::from(secs),
            shutting_down: Arc::new(AtomicBool::new(false)),
            thread: 0,
        }
    }

    /// The door of serving thread `thread`: this one's core, bounds and
    /// shutdown, with connections to the workers of its own. Must be
    /// called on that thread's runtime.
    pub fn sibling(&self, thread: usize) -> Self {
        HttpDoor {
            core: self.core.clone(),
            upstream: Upstream::new(&self.limits),
            limits: self.limits.clone(),
            inflight: self.inflight.clone(),
            connections: self.connections.clone(),
            retry_after: self.retry_after.clone(),
            shutting_down: self.shutting_down.clone(),
            thread,
        }
    }

    fn refuse(&self, endpoint: &'static str, e: ApiError) -> Response<ResponseBody> {
        self.core.metrics.refused(e.reason);
        let status = e.reason.status();
        self.core.metrics.answered(endpoint, status);
        let mut r = local(
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            "application/json",
            e.body(),
        );
        if e.reason.retry_after() {
            r.headers_mut().insert(header::RETRY_AFTER, self.retry_after.clone());
        }
        r
    }

    /// Answers one request.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<ResponseBody>, Infallible> {
        let path = req.uri().path();
        let endpoint = match path {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            _ => None,
        };
        let response = match (req.method(), path, endpoint) {
            (&Method::POST, _, Some(endpoint)) => self.proxy(endpoint, req).await,
            (&Method::GET, "/health", _) => {
                let (status, state) = if self.shutting_down.load(Ordering::Relaxed) {
                    (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
                } else {
                    (StatusCode::OK, "ok")
                };
                let workers = self.core.table.view().workers().len();
                let body = serde_json::json!({"status": state, "workers": workers}).to_string();
                self.core.metrics.answered("health", status.as_u16());
                local(status, "application/json", Bytes::from(body))
            }
            (&Method::GET, "/metrics", _) => {
                let core = &self.core;
                if let Some(source) = &core.overlaps {
                    core.metrics.index_blocks(source.blocks());
                }
                let text = core.metrics.render(&core.service, |id| {
                    core.table
                        .view()
                        .get(id)
                        .map(|w| w.url.as_str().to_owned())
                        .unwrap_or_default()
                });
                local(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    Bytes::from(text),
                )
            }
            (&Method::GET, "/v1/models", _) => {
                self.core.metrics.answered("models", 200);
                local(StatusCode::OK, "application/json", self.core.table.view().models_json())
            }
            (_, "/health" | "/metrics" | "/v1/models", _) | (_, _, Some(_)) => self.refuse(
                "other",
                ApiError::new(
                    Refusal::MethodNotAllowed,
                    format!("{} does not take {}", path, req.method()),
                ),
            ),
            _ => self.refuse(
                "other",
                ApiError::new(Refusal::NotFound, format!("no route for {path}")),
            ),
        };
        Ok(response)
    }

    async fn proxy(&self, endpoint: Endpoint, req: Request<Incoming>) -> Response<ResponseBody> {
        let label = endpoint.as_str();
        if self.shutting_down.load(Ordering::Relaxed) {
            return self.refuse(
                label,
                ApiError::new(Refusal::ShuttingDown, "the router is shutting down"),
            );
        }
        let Ok(permit) = self.inflight.clone().try_acquire_owned() else {
            self.core.metrics.bound_hit("max_concurrent_requests");
            return self.refuse(
                label,
                ApiError::new(
                    Refusal::RouterAtCapacity,
                    format!(
                        "the router holds its most requests at once (max_concurrent_requests = {}); retry later",
                        self.limits.max_concurrent_requests
                    ),
                ),
            );
        };
        let (parts, body) = req.into_parts();
        let body = match self.read_body(&parts.headers, body).await {
            Ok(b) => b,
            Err(e) => return self.refuse(label, e),
        };
        let parsed = match ParsedRequest::parse(endpoint, &body) {
            Ok(p) => p,
            Err(e) => return self.refuse(label, e),
        };
        let named = match parts.headers.get(WORKER_HEADER).map(|v| v.to_str()) {
            None => None,
            Some(Ok(url)) => match self.core.named_worker(url) {
                Ok(id) => Some(id),
                Err(e) => return self.refuse(label, e),
            },
            Some(Err(_)) => {
                return self.refuse(
                    label,
                    ApiError::new(Refusal::WorkerNotNamed, "x-selkie-worker is not a URL"),
                )
            }
        };
        let mut choice = match self.core.choose(&parsed, named).await {
            Ok(c) => c,
            Err(e) => return self.refuse(label, e),
        };
        drop(parsed);
        let path_and_query = parts.uri.path_and_query().map_or(endpoint.path(), |pq| pq.as_str());
        let mut retried = false;
        let response = loop {
            let request = match self.forward(&parts.headers, path_and_query, &choice, body.clone()) {
                Ok(r) => r,
                Err(e) => {
                    choice.lifecycle.end(Ending::Refused);
                    return self.refuse(label, e);
                }
            };
            match self.upstream.send(request).await {
                Ok(r) => break r,
                Err(SendError::Connect(why)) => {
                    tracing::debug!(worker = choice.worker.url.as_str(), %why, "connection refused");
                    if retried {
                        choice.lifecycle.end(Ending::Upstream(UpstreamErrorKind::Connect));
                        return self.refuse(
                            label,
                            ApiError::new(
                                Refusal::UpstreamUnreachable,
                                format!(
                                    "worker {} and the next choice refused the connection ({why})",
                                    choice.worker.url.as_str()
                                ),
                            ),
                        );
                    }
                    retried = true;
                    self.core.metrics.upstream_error(UpstreamErrorKind::Connect);
                    if let Err(e) = self.core.next_choice(&mut choice) {
                        choice.lifecycle.end(Ending::Refused);
                        return self.refuse(label, e);
                    }
                }
                Err(SendError::Timeout) => {
                    self.core.metrics.bound_hit("response_timeout");
                    choice.lifecycle.end(Ending::Upstream(UpstreamErrorKind::Timeout));
                    return self.refuse(
                        label,
                        ApiError::new(
                            Refusal::UpstreamTimeout,
                            format!(
                                "worker {} did not answer within {:?} (response_timeout)",
                                choice.worker.url.as_str(),
                                self.limits.response_timeout
                            ),
                        ),
                    );
                }
                Err(SendError::Broken(why)) => {
                    choice.lifecycle.end(Ending::Upstream(UpstreamErrorKind::Broken));
                    return self.refuse(
                        label,
                        ApiError::new(
                            Refusal::UpstreamFailed,
                            format!("worker {} broke the connection ({why})", choice.worker.url.as_str()),
                        ),
                    );
                }
            }
        };
        self.core.metrics.request_bytes(body.len());
        let (mut head, incoming) = response.into_parts();
        if head.status.is_server_error() {
            self.core.metrics.upstream_error(UpstreamErrorKind::Status5xx);
        }
        self.core.metrics.answered(label, head.status.as_u16());
        strip_hop_by_hop(&mut head.headers);
        head.headers.insert(WORKER_HEADER, choice.worker.header.clone());
        if let Some(tokens) = choice.predicted_cached_tokens {
            head.headers.insert(PREDICTED_CACHED_HEADER, HeaderValue::from(tokens));
        }
        let Choice { mut lifecycle, .. } = choice;
        lifecycle.response_head();
        self.core.metrics.open_response(1);
        let stall = Box::pin(tokio::time::sleep(self.limits.stream_idle_timeout));
        let body = ProxyBody {
            inner: incoming,
            lifecycle,
            idle: self.limits.stream_idle_timeout,
            stall,
            done: false,
            broken: None,
            core: self.core.clone(),
            _permit: permit,
        };
        Response::from_parts(head, ResponseBody::Proxied(Box::new(body)))
    }

    /// Reads the client's body, within `max_body_bytes` and
    /// `body_read_timeout`.
    async fn read_body(&self, headers: &HeaderMap, body: Incoming) -> Result<Bytes, ApiError> {
        let limit = self.limits.max_body_bytes;
        let too_large = || {
            self.core.metrics.bound_hit("max_body_bytes");
            ApiError::new(
                Refusal::BodyTooLarge,
                format!("the request body is over {limit} bytes (max_body_bytes)"),
            )
        };
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        match tokio::time::timeout(self.limits.body_read_timeout, Limited::new(body, limit).collect()).await {
            Err(_) => {
                self.core.metrics.bound_hit("body_read_timeout");
                Err(ApiError::new(
                    Refusal::BodyTimeout,
                    format!(
                        "the request body did not arrive within {:?} (body_read_timeout)",
                        self.limits.body_read_timeout
                    ),
                ))
            }
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
            Ok(Err(e)) => Err(ApiError::new(
                Refusal::MalformedJson,
                format!("the request body could not be read: {e}"),
            )),
        }
    }

    /// The request to the chosen worker: the client's headers less the
    /// hop-by-hop ones, the body unchanged.
    fn forward(
        &self,
        headers: &HeaderMap,
        path_and_query: &str,
        choice: &Choice,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>, ApiError> {
        let uri = choice.worker.url.uri(path_and_query).map_err(|e| {
            ApiError::new(
                Refusal::UpstreamFailed,
                format!("cannot address worker {}: {e}", choice.worker.url.as_str()),
            )
        })?;
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri;
        let out = request.headers_mut();
        for (name, value) in headers {
            if !is_hop_by_hop(name) && name != header::CONTENT_LENGTH && name.as_str() != WORKER_HEADER {
                out.append(name.clone(), value.clone());
            }
        }
        if choice.worker.dp.1 > 1 {
            out.insert(DP_RANK_HEADER, HeaderValue::from(choice.rank.dp_rank));
        }
        Ok(request)
    }

    /// Stops taking new proxied requests (`/health` answers 503).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the `connection` header names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in HOP_BY_HOP {
        if n != "host" {
            headers.remove(n);
        }
    }
}

/// Accepts connections on `listener` and serves them until `stop`
/// resolves; then stops accepting, lets the open requests finish within
/// `shutdown_timeout`, and returns.
pub async fn serve(door: Arc<HttpDoor>, listener: TcpListener, stop: impl std::future::Future<Output = ()>) {
    let limits = door.limits.clone();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams_per_connection);
    let graceful = GracefulShutdown::new();
    let connections = door.connections.clone();
    tokio::pin!(stop);
    loop {
        let permit = match connections.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                door.core.metrics.bound_hit("max_connections");
                tokio::select! {
                    p = connections.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    () = &mut stop => break,
                }
            }
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or memory: wait for connections to end.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        door.core.metrics.accepted(door.thread);
        let door = door.clone();
        let service = service_fn(move |req| door.clone().handle(req));
        let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    door.begin_shutdown();
    if tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "shutdown: responses still open after {:?}; cutting them",
            limits.shutdown_timeout
        );
    }
}
