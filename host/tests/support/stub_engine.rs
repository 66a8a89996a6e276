//! A stub OpenAI-compatible engine for the router's tests and benches:
//! `/v1/models`, `/v1/completions` and `/v1/chat/completions`, streaming
//! or not, with deterministic answers and faults the test controls.
//!
//! Every answer is a function of the engine's name and the request body
//! alone ([`answer`]), so a test knows the exact bytes a response must
//! have. Streams are sent one SSE event per token, `chunk_delay` apart.
//! Faults: answer 500, die after N events (the connection is cut without
//! the final chunk), stall after N events (the connection stays open,
//! silent, until the client leaves), delay the response head, hold after N
//! events until [`StubEngine::release`].
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// What the engine does to the next requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// Answers normally.
    None,
    /// 500 with a JSON error body.
    Status500,
    /// Streams N events, then cuts the connection.
    DieAfter(usize),
    /// Streams N events, then sends nothing until the client leaves.
    StallAfter(usize),
    /// Waits this long before the response head.
    HeadDelay(Duration),
    /// Streams N events, then waits for [`StubEngine::release`].
    HoldAfter(usize),
}

/// The engine's settings.
#[derive(Clone, Debug)]
pub struct StubConfig {
    /// Its name: part of every answer (tells the engines apart).
    pub name: String,
    /// The model it serves.
    pub model: String,
    /// Tokens answered when the request has no `max_tokens`.
    pub default_tokens: usize,
    /// Time between two streamed events.
    pub chunk_delay: Duration,
}

impl StubConfig {
    /// An engine called `name` serving `tiny`, 8 tokens by default, no
    /// delay.
    pub fn new(name: &str) -> Self {
        StubConfig {
            name: name.to_owned(),
            model: "tiny".to_owned(),
            default_tokens: 8,
            chunk_delay: Duration::ZERO,
        }
    }
}

struct State {
    config: StubConfig,
    fault: Mutex<Fault>,
    requests: AtomicU64,
    generations: AtomicU64,
    open: AtomicU64,
    completed: AtomicU64,
    release: watch::Sender<bool>,
    /// What `GET /metrics` answers (404 while empty).
    metrics: Mutex<String>,
}

/// A running stub engine.
pub struct StubEngine {
    addr: SocketAddr,
    state: Arc<State>,
    stop: watch::Sender<bool>,
}

/// The answer's parts: the status, the content type and the body's chunks
/// (one per SSE event when streaming).
pub struct Answer {
    /// The status.
    pub status: u16,
    /// The content type.
    pub content_type: &'static str,
    /// The body, in the chunks the engine sends.
    pub chunks: Vec<Bytes>,
}

impl Answer {
    /// The whole body.
    pub fn body(&self) -> Vec<u8> {
        self.chunks.iter().flat_map(|c| c.iter().copied()).collect()
    }
}

fn words(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::String(s) => s.split_whitespace().count(),
        serde_json::Value::Array(a) => a.iter().map(words).sum::<usize>().max(a.len().min(1)),
        serde_json::Value::Object(o) => o.get("content").map_or(0, words),
        _ => 0,
    }
}

/// The exact answer engine `name` gives to `body` on `path`
/// (`/v1/completions` or `/v1/chat/completions`).
pub fn answer(config: &StubConfig, path: &str, body: &[u8]) -> Answer {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Answer {
            status: 400,
            content_type: "application/json",
            chunks: vec![Bytes::from_static(br#"{"error":{"message":"bad json"}}"#)],
        };
    };
    let chat = path.ends_with("/chat/completions");
    let stream = v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
    let usage_in_stream = v
        .pointer("/stream_options/include_usage")
        .and_then(|s| s.as_bool())
        .unwrap_or(false);
    let n = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .and_then(|m| m.as_u64())
        .map_or(config.default_tokens, |m| m as usize)
        .min(100_000);
    let prompt_tokens = if chat {
        v.get("messages").map_or(0, words)
    } else {
        match v.get("prompt") {
            Some(serde_json::Value::Array(a)) if a.iter().all(|x| x.is_u64()) => a.len(),
            Some(p) => words(p),
            None => 0,
        }
    };
    // The id hashes the request's canonical JSON (keys sorted), so the same
    // request written by another client gets the same answer.
    let canonical = serde_json::to_vec(&v).unwrap_or_default();
    let id = format!("{}-{:016x}", config.name, xxhash_rust::xxh3::xxh3_64(&canonical));
    let model = &config.model;
    let token = |i: usize| format!(" {}{}", config.name, i);
    let usage =
        serde_json::json!({"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n});
    let sse = |v: serde_json::Value| Bytes::from(format!("data: {v}\n\n"));
    if !stream {
        let text: String = (0..n).map(token).collect();
        let v = if chat {
            serde_json::json!({"id": id, "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage})
        } else {
            serde_json::json!({"id": id, "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
                "usage": usage})
        };
        return Answer {
            status: 200,
            content_type: "application/json",
            chunks: vec![Bytes::from(v.to_string())],
        };
    }
    let mut chunks = Vec::with_capacity(n + 3);
    for i in 0..n {
        let finish = if i + 1 == n {
            serde_json::json!("length")
        } else {
            serde_json::Value::Null
        };
        let v = if chat {
            let delta = if i == 0 {
                serde_json::json!({"role": "assistant", "content": token(i)})
            } else {
                serde_json::json!({"content": token(i)})
            };
            serde_json::json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
        } else {
            serde_json::json!({"id": id, "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": token(i), "logprobs": null, "finish_reason": finish}]})
        };
        chunks.push(sse(v));
    }
    if usage_in_stream {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        chunks.push(sse(
            serde_json::json!({"id": id, "object": object, "created": 0, "model": model, "choices": [], "usage": usage}),
        ));
    }
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    Answer {
        status: 200,
        content_type: "text/event-stream",
        chunks,
    }
}

/// A body fed by the engine's task; an `Err` item cuts the connection.
struct ChannelBody {
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
    _open: OpenGuard,
}

struct OpenGuard(Arc<State>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<ChannelBody>, Infallible> {
    state.requests.fetch_add(1, Ordering::SeqCst);
    state.open.fetch_add(1, Ordering::SeqCst);
    let guard = OpenGuard(state.clone());
    let path = req.uri().path().to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let (tx, rx) = mpsc::channel(16);
    let respond = |status: u16, content_type: &str, rx| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .header("x-stub-engine", state.config.name.as_str())
            .body(ChannelBody { rx, _open: guard })
            .unwrap()
    };
    if path == "/v1/models" {
        let v = serde_json::json!({"object": "list", "data": [{"id": state.config.model, "object": "model", "created": 0, "owned_by": state.config.name}]});
        let _ = tx.try_send(Ok(Bytes::from(v.to_string())));
        drop(tx);
        return Ok(respond(200, "application/json", rx));
    }
    if path == "/metrics" {
        let text = state.metrics.lock().unwrap().clone();
        if text.is_empty() {
            drop(tx);
            return Ok(respond(404, "text/plain", rx));
        }
        let _ = tx.try_send(Ok(Bytes::from(text)));
        drop(tx);
        return Ok(respond(200, "text/plain; version=0.0.4", rx));
    }
    if path == "/health" {
        drop(tx);
        return Ok(respond(200, "text/plain", rx));
    }
    if path != "/v1/completions" && path != "/v1/chat/completions" {
        drop(tx);
        return Ok(respond(404, "text/plain", rx));
    }
    state.generations.fetch_add(1, Ordering::SeqCst);
    let fault = *state.fault.lock().unwrap();
    if fault == Fault::Status500 {
        let _ = tx.try_send(Ok(Bytes::from_static(
            br#"{"error":{"message":"stub engine failure","type":"server_error"}}"#,
        )));
        drop(tx);
        return Ok(respond(500, "application/json", rx));
    }
    if let Fault::HeadDelay(d) = fault {
        tokio::time::sleep(d).await;
    }
    let a = answer(&state.config, &path, &body);
    let response = respond(a.status, a.content_type, rx);
    let delay = state.config.chunk_delay;
    let streaming = a.content_type == "text/event-stream";
    let mut release = state.release.subscribe();
    let done = state.clone();
    tokio::spawn(async move {
        for (i, chunk) in a.chunks.into_iter().enumerate() {
            match fault {
                Fault::DieAfter(k) if i == k => {
                    // The events before have left the engine.
                    tokio::time::sleep(delay.max(Duration::from_millis(10))).await;
                    let _ = tx.send(Err(std::io::Error::other("stub engine died"))).await;
                    return;
                }
                Fault::StallAfter(k) if i == k => {
                    tx.closed().await;
                    return;
                }
                Fault::HoldAfter(k) if i == k => {
                    tokio::select! {
                        _ = release.wait_for(|r| *r) => {}
                        () = tx.closed() => return,
                    }
                }
                _ => {}
            }
            if streaming && i > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
        done.completed.fetch_add(1, Ordering::SeqCst);
    });
    Ok(response)
}

impl StubEngine {
    /// Starts an engine on a free loopback port.
    pub async fn start(config: StubConfig) -> StubEngine {
        Self::start_on("127.0.0.1:0".parse().unwrap(), config).await
    }

    /// Starts an engine on `addr`.
    pub async fn start_on(addr: SocketAddr, config: StubConfig) -> StubEngine {
        let listener = TcpListener::bind(addr).await.expect("bind the stub engine");
        let addr = listener.local_addr().unwrap();
        let (release, _) = watch::channel(false);
        let state = Arc::new(State {
            config,
            fault: Mutex::new(Fault::None),
            requests: AtomicU64::new(0),
            generations: AtomicU64::new(0),
            open: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            release,
            metrics: Mutex::new(String::new()),
        });
        let (stop, mut stopped) = watch::channel(false);
        let s = state.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = stopped.wait_for(|s| *s) => return,
                };
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let s = s.clone();
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(s.clone(), req));
                    let builder = auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = conn => {}
                        // Stopping cuts every connection.
                        _ = stopped.wait_for(|s| *s) => {}
                    }
                });
            }
        });
        StubEngine { addr, state, stop }
    }

    /// Makes `GET /metrics` answer `text` (Prometheus text; empty: 404).
    pub fn set_metrics(&self, text: &str) {
        *self.state.metrics.lock().unwrap() = text.to_owned();
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The settings.
    pub fn config(&self) -> &StubConfig {
        &self.state.config
    }

    /// Sets the fault of the next requests.
    pub fn set_fault(&self, fault: Fault) {
        *self.state.fault.lock().unwrap() = fault;
    }

    /// Lets held streams go on.
    pub fn release(&self) {
        // `send_replace`, not `send`: with no stream held yet (no receiver),
        // `send` would drop the value, and a request arriving after the
        // release would then hold until the router's idle timeout.
        self.state.release.send_replace(true);
    }

    /// Requests received (`/v1/models` included).
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Completions and chat requests received.
    pub fn generations(&self) -> u64 {
        self.state.generations.load(Ordering::SeqCst)
    }

    /// Responses whose body is still open.
    pub fn open(&self) -> u64 {
        self.state.open.load(Ordering::SeqCst)
    }

    /// Responses sent whole.
    pub fn completed(&self) -> u64 {
        self.state.completed.load(Ordering::SeqCst)
    }

    /// Stops listening and cuts every connection (connections are then
    /// refused).
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }
}

impl Drop for StubEngine {
    fn drop(&mut self) {
        self.stop();
    }
}
