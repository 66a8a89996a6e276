//! An open-loop load generator for OpenAI-compatible routers (the router
//! benchmark's: `benches/router/compare.py`).
//!
//! ```sh
//! loadgen --url http://127.0.0.1:8000 --rate 1000 --duration 10      # latency at a fixed rate
//! loadgen --url http://127.0.0.1:8000 --streams 10000 --hold 5       # open streams, hold them
//! ```
//!
//! Rate mode: request `i` is sent at `start + i / rate` whatever happened to
//! the ones before (open loop: a late answer delays no later request), on
//! a pool of keep-alive connections that grows as needed; its latency is
//! from its send to the last byte of its answer. Each request is a
//! non-streaming `/v1/completions` whose text prompt is one of 64 shared
//! prefixes of about 100 words and a 16-word suffix of its own, with
//! `max_tokens` 8. Several `--url`s are used in turn (direct to engines).
//! A request unanswered after `--timeout` seconds (default 10) is an error.
//! Prints one JSON object: sent, ok, errors, achieved rate, latency p50,
//! p90, p99, p99.9 and max in ms.
//!
//! `--prompt-tokens N`: the prompt is N token ids instead (one of 64 shared
//! prefixes of N - 16 ids, then 16 of its own).
//!
//! `--ext-proc HOST:PORT` (rate mode): asks an endpoint picker instead, as
//! Envoy does in `FULL_DUPLEX_STREAMED` mode: one ext_proc stream per
//! request on one HTTP/2 connection, its request headers then its body in
//! one message; the latency is from sending the headers to the picker's
//! decision (the headers answer naming the endpoint). The stream is then
//! dropped, which releases the booking.
//!
//! Streams mode: opens N streaming requests over HTTP/2 (64 connections)
//! or HTTP/1.1 (`--h1`), waits until every response head arrived (or
//! `--hold` seconds), prints how many opened, holds them `--hold` seconds,
//! then drops them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[path = "../tests/support/mod.rs"]
mod support;

/// A deterministic sequence of `n` words the tests' tokenizer knows (no
/// `[UNK]`), from `seed`.
fn words(seed: u64, n: usize) -> String {
    let known = &support::VOCAB[1..];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(known[(x % known.len() as u64) as usize]);
    }
    out.join(" ")
}

fn body(i: u64, stream: bool, prompt_tokens: usize) -> Bytes {
    let v = if prompt_tokens > 0 {
        let shared = prompt_tokens.saturating_sub(16) as u64;
        let ids: Vec<u64> = (0..shared)
            .map(|t| 1 + (i % 64) * 100_000 + t)
            .chain((0..prompt_tokens as u64 - shared).map(|t| 7_000_000 + i * 16 + t))
            .collect();
        serde_json::json!({"model": "tiny", "prompt": ids, "max_tokens": 8, "stream": stream})
    } else {
        let prompt = format!("{} {}", words(i % 64, 100), words(1_000_003 + i, 16));
        serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": stream})
    };
    Bytes::from(v.to_string())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Args {
    urls: Vec<String>,
    rate: f64,
    duration: f64,
    streams: usize,
    hold: f64,
    h1: bool,
    timeout: f64,
    prompt_tokens: usize,
    ext_proc: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        urls: Vec::new(),
        rate: 100.0,
        duration: 5.0,
        streams: 0,
        hold: 3.0,
        h1: false,
        timeout: 10.0,
        prompt_tokens: 0,
        ext_proc: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--url" => a.urls.push(v()),
            "--rate" => a.rate = v().parse().expect("--rate R"),
            "--duration" => a.duration = v().parse().expect("--duration S"),
            "--streams" => a.streams = v().parse().expect("--streams N"),
            "--hold" => a.hold = v().parse().expect("--hold S"),
            "--h1" => a.h1 = true,
            "--timeout" => a.timeout = v().parse().expect("--timeout S"),
            "--prompt-tokens" => a.prompt_tokens = v().parse().expect("--prompt-tokens N"),
            "--ext-proc" => a.ext_proc = Some(v()),
            _ => panic!("unknown option {k}"),
        }
    }
    assert!(
        !a.urls.is_empty() || a.ext_proc.is_some(),
        "--url URL or --ext-proc HOST:PORT"
    );
    a
}

fn main() {
    let a = args();
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        if a.streams > 0 {
            streams(&a).await
        } else if let Some(addr) = &a.ext_proc {
            picker::rate(&a, addr).await
        } else {
            rate(&a).await
        }
    });
}

async fn rate(a: &Args) {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector);
    open_loop(a, |i| {
        let client = client.clone();
        let url = format!("{}/v1/completions", a.urls[(i % a.urls.len() as u64) as usize]);
        let body = body(i, false, a.prompt_tokens);
        async move {
            let request = hyper::Request::post(url)
                .header("content-type", "application/json")
                .body(Full::new(body))
                .unwrap();
            match client.request(request).await {
                Ok(r) if r.status().is_success() => r.into_body().collect().await.is_ok(),
                Ok(r) => {
                    let _ = r.into_body().collect().await;
                    false
                }
                Err(_) => false,
            }
        }
    })
    .await;
}

/// Sends request `i` (the future `exchange(i)` makes, true when it
/// succeeded) at `start + i / rate` whatever happened to the ones before,
/// then prints the latencies.
async fn open_loop<F, Fut>(a: &Args, exchange: F)
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let total = (a.rate * a.duration).round() as u64;
    let errors = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<f64>();
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(total as usize);
    let timeout = Duration::from_secs_f64(a.timeout);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / a.rate);
        tokio::time::sleep_until(due.into()).await;
        let (tx, errors) = (tx.clone(), errors.clone());
        let exchange = exchange(i);
        tasks.push(tokio::spawn(async move {
            // Late timers and a busy machine delay the send past its due
            // time; the latency counts from the send (no request waits for
            // another's answer, so none is held back by a slow one).
            let sent = Instant::now();
            let ok = tokio::time::timeout(timeout, exchange).await.unwrap_or(false);
            if ok {
                let _ = tx.send(sent.elapsed().as_secs_f64() * 1e3);
            } else {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    drop(tx);
    for t in tasks {
        let _ = t.await;
    }
    report(a.rate, total, start, &mut rx, errors.load(Ordering::Relaxed));
}

/// Prints the latencies `rx` collected as one JSON object.
fn report(rate: f64, total: u64, start: Instant, rx: &mut tokio::sync::mpsc::UnboundedReceiver<f64>, errors: u64) {
    let elapsed = start.elapsed().as_secs_f64();
    let mut lat = Vec::with_capacity(total as usize);
    while let Ok(l) = rx.try_recv() {
        lat.push(l);
    }
    lat.sort_by(f64::total_cmp);
    let out = serde_json::json!({
        "rate": rate,
        "sent": total,
        "ok": lat.len(),
        "errors": errors,
        "achieved_rps": lat.len() as f64 / elapsed,
        "p50_ms": percentile(&lat, 50.0),
        "p90_ms": percentile(&lat, 90.0),
        "p99_ms": percentile(&lat, 99.0),
        "p999_ms": percentile(&lat, 99.9),
        "max_ms": lat.last().copied().unwrap_or(f64::NAN),
    });
    println!("{out}");
}

/// Rate mode against an endpoint picker (`--ext-proc`).
mod picker {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    };

    fn header(key: &str, value: &str) -> HeaderValue {
        HeaderValue {
            key: key.into(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }
    }

    pub async fn rate(a: &Args, addr: &str) {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("--ext-proc HOST:PORT")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect to the picker");
        let client = ExternalProcessorClient::new(channel);
        open_loop(a, |i| {
            let mut client = client.clone();
            let body = body(i, false, a.prompt_tokens).to_vec();
            async move {
                let messages = vec![
                    ProcessingRequest {
                        request: Some(Phase::RequestHeaders(HttpHeaders {
                            headers: Some(HeaderMap {
                                headers: vec![header(":path", "/v1/completions"), header(":method", "POST")],
                            }),
                            ..HttpHeaders::default()
                        })),
                        protocol_config: Some(ProtocolConfiguration {
                            request_body_mode: 4,
                            response_body_mode: 4,
                            ..ProtocolConfiguration::default()
                        }),
                        ..ProcessingRequest::default()
                    },
                    ProcessingRequest {
                        request: Some(Phase::RequestBody(HttpBody {
                            body,
                            end_of_stream: true,
                            ..HttpBody::default()
                        })),
                        ..ProcessingRequest::default()
                    },
                ];
                // The request side stays open (as Envoy's does until the
                // response): the stream ends when it is dropped.
                let (keep, held) = tokio::sync::oneshot::channel::<()>();
                let outbound = tonic::codegen::tokio_stream::StreamExt::chain(
                    tonic::codegen::tokio_stream::iter(messages),
                    futures_until(held),
                );
                let Ok(answers) = client.process(outbound).await else {
                    return false;
                };
                let decided = matches!(
                    answers.into_inner().message().await,
                    Ok(Some(ProcessingResponse {
                        response: Some(Answer::RequestHeaders(_)),
                        ..
                    }))
                );
                drop(keep);
                decided
            }
        })
        .await;
    }

    /// A stream of no items that ends when `held` resolves.
    fn futures_until(
        held: tokio::sync::oneshot::Receiver<()>,
    ) -> impl tonic::codegen::tokio_stream::Stream<Item = ProcessingRequest> {
        struct Until(tokio::sync::oneshot::Receiver<()>);
        impl tonic::codegen::tokio_stream::Stream for Until {
            type Item = ProcessingRequest;
            fn poll_next(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<ProcessingRequest>> {
                std::future::Future::poll(std::pin::Pin::new(&mut self.0), cx).map(|_| None)
            }
        }
        Until(held)
    }
}

async fn streams(a: &Args) {
    let clients: Vec<Client<_, Full<Bytes>>> = (0..if a.h1 { 1 } else { 64 })
        .map(|_| Client::builder(TokioExecutor::new()).http2_only(!a.h1).build_http())
        .collect();
    let opened = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(a.streams);
    for i in 0..a.streams {
        let client = clients[i % clients.len()].clone();
        let url = format!("{}/v1/completions", a.urls[i % a.urls.len()]);
        let (opened, failed) = (opened.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let request = hyper::Request::post(url)
                .header("content-type", "application/json")
                .body(Full::new(body(i as u64, true, 0)))
                .unwrap();
            match client.request(request).await {
                Ok(r) if r.status().is_success() => {
                    opened.fetch_add(1, Ordering::Relaxed);
                    // Hold the stream open until the task is dropped.
                    let _ = r.into_body().collect().await;
                }
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs_f64(a.hold.max(1.0) * 10.0);
    while opened.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed) < a.streams as u64
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "{}",
        serde_json::json!({"streams": a.streams, "opened": opened.load(Ordering::Relaxed), "failed": failed.load(Ordering::Relaxed)})
    );
    tokio::time::sleep(Duration::from_secs_f64(a.hold)).await;
    for t in tasks {
        t.abort();
    }
}
