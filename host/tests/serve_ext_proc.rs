//! `selkie serve --ext-proc-port`: the endpoint picker door, driven here
//! as Envoy drives it (request headers, body chunks, response headers,
//! body, trailers) with the ext_proc client `envoy-types` generates, in
//! both body modes; the edge cases: a stream that breaks at every phase,
//! bodies split across chunks and over the limit, unknown models, subset
//! hints, a proxy that serves elsewhere, concurrent streams, and the
//! engines' own metrics as load and busy signals.

mod support;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, CommonResponse, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use selkie::router::ext_proc::{
    DESTINATION_HEADER, DESTINATION_NAMESPACE, SERVED_KEY, SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE,
};
use selkie::router::{engine_load::EngineMetricsConfig, PolicySpec, Server};
use support::stub_engine::{StubConfig, StubEngine};
use support::{eventually, router, scrape, url, wait_unbooked};
use tokio::sync::mpsc;
use tonic::Streaming;

const PROMPT: &str =
    r#"{"model":"tiny","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":8,"stream":true}"#;

/// The proxy's side of one stream.
struct Proxy {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

struct Outbound(mpsc::Receiver<ProcessingRequest>);

impl tonic::codegen::tokio_stream::Stream for Outbound {
    type Item = ProcessingRequest;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ProcessingRequest>> {
        self.0.poll_recv(cx)
    }
}

impl Proxy {
    async fn open(server: &Server) -> Proxy {
        let addr = server.ext_proc_addr().expect("the picker door is on");
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(64);
        let rx = client.process(Outbound(rx)).await.unwrap().into_inner();
        Proxy { tx, rx }
    }

    /// Sends `phase`; `duplex` says FULL_DUPLEX_STREAMED in the protocol
    /// configuration, else it carries none.
    async fn send(&self, phase: Phase, metadata: Option<Metadata>, duplex: bool) {
        self.send_in(phase, metadata, duplex.then_some(4)).await;
    }

    /// Sends `phase` with the request body `mode` (Envoy's `BodySendMode`).
    async fn send_in(&self, phase: Phase, metadata: Option<Metadata>, mode: Option<i32>) {
        let msg = ProcessingRequest {
            request: Some(phase),
            metadata_context: metadata,
            protocol_config: mode.map(|m| ProtocolConfiguration {
                request_body_mode: m,
                response_body_mode: m,
                ..ProtocolConfiguration::default()
            }),
            ..ProcessingRequest::default()
        };
        self.tx.send(msg).await.unwrap();
    }

    async fn answer(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer within 10 s")
            .expect("the stream stays open")
            .expect("an answer, not the end")
    }

    async fn silent_for(&mut self, ms: u64) {
        if let Ok(a) = tokio::time::timeout(Duration::from_millis(ms), self.rx.message()).await {
            panic!("expected no answer, got {a:?}");
        }
    }
}

fn headers(path: &str, end_of_stream: bool) -> Phase {
    Phase::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                raw(":path", path),
                raw(":method", "POST"),
                raw("content-type", "application/json"),
            ],
        }),
        end_of_stream,
        ..HttpHeaders::default()
    })
}

fn raw(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        value: String::new(),
        raw_value: value.as_bytes().to_vec(),
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> Phase {
    Phase::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    })
}

fn response_headers(served: Option<&str>) -> Phase {
    let mut h = vec![raw(":status", "200"), raw("content-type", "text/event-stream")];
    if let Some(s) = served {
        h.push(raw(SERVED_KEY, s));
    }
    Phase::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap { headers: h }),
        ..HttpHeaders::default()
    })
}

fn response_body(bytes: &[u8], end_of_stream: bool) -> Phase {
    Phase::ResponseBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    })
}

fn subset(endpoints: &[&str]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: endpoints
                .iter()
                .map(|e| Value {
                    kind: Some(Kind::StringValue((*e).to_owned())),
                })
                .collect(),
        })),
    };
    Metadata {
        filter_metadata: [(
            SUBSET_HINT_NAMESPACE.to_owned(),
            Struct {
                fields: [(SUBSET_HINT_KEY.to_owned(), list)].into(),
            },
        )]
        .into(),
        ..Metadata::default()
    }
}

/// The header a mutation sets.
fn set_header(common: &CommonResponse, key: &str) -> Option<String> {
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == key)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

/// The destination a decision names, checked equal in header and metadata.
fn destination(a: &ProcessingResponse) -> String {
    let common = match a.response.as_ref().unwrap() {
        Answer::RequestHeaders(h) => h.response.as_ref().unwrap(),
        Answer::RequestBody(b) => b.response.as_ref().unwrap(),
        other => panic!("not a decision: {other:?}"),
    };
    assert!(common.clear_route_cache, "the route is recomputed");
    let header = set_header(common, DESTINATION_HEADER).expect("the destination header");
    let md = a.dynamic_metadata.as_ref().expect("dynamic metadata");
    let Some(Kind::StructValue(ns)) = &md.fields[DESTINATION_NAMESPACE].kind else {
        panic!("no {DESTINATION_NAMESPACE} namespace: {md:?}");
    };
    let Some(Kind::StringValue(meta)) = &ns.fields[DESTINATION_HEADER].kind else {
        panic!("no destination key: {ns:?}");
    };
    assert_eq!(&header, meta, "header and metadata name the same endpoints");
    header
}

/// The immediate response's status, JSON code and headers.
fn refusal(a: &ProcessingResponse) -> (i32, String, Vec<(String, String)>) {
    let Some(Answer::ImmediateResponse(i)) = &a.response else {
        panic!("expected an immediate response, got {a:?}");
    };
    let v: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
    let headers = i
        .headers
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .map(|h| (h.key.clone(), String::from_utf8(h.raw_value.clone()).unwrap()))
        .collect();
    (
        i.status.as_ref().unwrap().code,
        v["error"]["code"].as_str().unwrap().to_owned(),
        headers,
    )
}

fn authority(e: &StubEngine) -> String {
    e.addr().to_string()
}

async fn picker(workers: &[&StubEngine], tweak: impl FnOnce(&mut selkie::router::ServeConfig)) -> Server {
    let urls: Vec<String> = workers.iter().map(|w| w.url()).collect();
    let server = router(&urls, |c| {
        c.ext_proc = Some("127.0.0.1:0".parse().unwrap());
        c.policy = PolicySpec::parse("least-loaded").unwrap();
        tweak(c);
    })
    .await;
    // Until a worker's models are read it is taken to serve every model.
    let core = server.core().clone();
    eventually("every worker's models read", async || {
        core.table.view().workers().iter().all(|w| w.models().is_some())
    })
    .await;
    server
}

/// A streamed answer of `n` SSE events.
fn sse(n: usize) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = (0..n)
        .map(|i| format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n").into_bytes())
        .collect();
    out.push(b"data: [DONE]\n\n".to_vec());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_streamed_in_chunks_is_routed_booked_and_released_with_its_response() {
    let (a, b) = (
        StubEngine::start(StubConfig::new("a")).await,
        StubEngine::start(StubConfig::new("b")).await,
    );
    let server = picker(&[&a, &b], |_| {}).await;
    let r = url(&server);
    let mut p = Proxy::open(&server).await;
    p.send(headers("/v1/completions", false), None, false).await;
    let Some(Answer::RequestHeaders(_)) = p.answer().await.response else {
        panic!("headers are answered at once in the non-duplex modes")
    };
    // The body in three chunks: the first two pass, the last decides.
    let bytes = PROMPT.as_bytes();
    let (x, rest) = bytes.split_at(10);
    let (y, z) = rest.split_at(20);
    for chunk in [x, y] {
        p.send(body(chunk, false), None, false).await;
        let Some(Answer::RequestBody(_)) = p.answer().await.response else {
            panic!("a body chunk is answered")
        };
    }
    p.send(body(z, true), None, false).await;
    let decision = p.answer().await;
    assert!(matches!(decision.response, Some(Answer::RequestBody(_))));
    let dest = destination(&decision);
    let named: Vec<&str> = dest.split(',').collect();
    assert_eq!(named.len(), 2, "the choice, then one fallback: {dest}");
    let mut both = [authority(&a), authority(&b)];
    both.sort();
    let mut got = [named[0].to_owned(), named[1].to_owned()];
    got.sort();
    assert_eq!(got, both);
    let s = scrape(&r).await;
    assert_eq!(s.booked().0, 1.0, "booked at the decision: {}", s.text);
    // The response: headers get the router's headers, prefill completes at
    // the first chunk, the end of stream releases.
    p.send(response_headers(None), None, false).await;
    let Some(Answer::ResponseHeaders(h)) = p.answer().await.response else {
        panic!("response headers answered")
    };
    let worker = set_header(h.response.as_ref().unwrap(), "x-selkie-worker").unwrap();
    assert_eq!(worker, format!("http://{}", named[0]));
    // The body ends without end_of_stream: trailers follow, as with an
    // upstream that sends them.
    for (i, c) in sse(8).iter().enumerate() {
        p.send(response_body(c, false), None, false).await;
        let Some(Answer::ResponseBody(_)) = p.answer().await.response else {
            panic!("each response chunk is answered")
        };
        if i == 0 {
            let s = scrape(&r).await;
            assert_eq!(s.booked().1, 0.0, "prefill complete at the first chunk: {}", s.text);
            assert_eq!(s.booked().0, 1.0);
        }
    }
    assert_eq!(scrape(&r).await.booked().0, 1.0, "booked until the response ends");
    p.send(Phase::ResponseTrailers(HttpTrailers::default()), None, false)
        .await;
    let Some(Answer::ResponseTrailers(_)) = p.answer().await.response else {
        panic!("trailers answered")
    };
    let closed = tokio::time::timeout(Duration::from_secs(5), p.rx.message()).await;
    assert!(
        matches!(closed, Ok(Ok(None))),
        "the picker closes the stream once the response has ended: {closed:?}"
    );
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0), "{}", s.text);
    assert_eq!(s.value("selkie_ext_proc_streams_total", r#"outcome="routed""#), 1.0);
    drop(p);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_holds_the_headers_then_sends_the_body_back_in_chunks() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let server = picker(&[&a], |c| c.limits.max_body_bytes = 1 << 20).await;
    let r = url(&server);
    let mut p = Proxy::open(&server).await;
    p.send(headers("/v1/chat/completions", false), None, true).await;
    // A chat body of ~150 kB, sent in 7 pieces.
    let text = "word ".repeat(30_000);
    let whole = serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": text}], "stream": true})
        .to_string()
        .into_bytes();
    let pieces: Vec<&[u8]> = whole.chunks(whole.len() / 6).collect();
    for (i, piece) in pieces.iter().enumerate() {
        p.send(body(piece, i == pieces.len() - 1), None, true).await;
        if i < pieces.len() - 1 {
            p.silent_for(30).await;
        }
    }
    let decision = p.answer().await;
    let Some(Answer::RequestHeaders(h)) = &decision.response else {
        panic!("in full duplex the decision is the headers answer: {decision:?}")
    };
    assert_eq!(destination(&decision), authority(&a), "one worker: no fallback");
    assert_eq!(
        set_header(h.response.as_ref().unwrap(), "content-length"),
        Some(whole.len().to_string())
    );
    let mut back = Vec::new();
    let mut messages = 0;
    loop {
        let Some(Answer::RequestBody(b)) = p.answer().await.response else {
            panic!("the body comes back as body answers")
        };
        messages += 1;
        let Some(body_mutation::Mutation::StreamedResponse(s)) = b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("a streamed body mutation")
        };
        assert!(s.body.len() <= selkie::router::ext_proc::STREAMED_CHUNK_BYTES);
        back.extend_from_slice(&s.body);
        if s.end_of_stream {
            break;
        }
    }
    assert_eq!(back, whole, "the body goes back unchanged");
    assert!(messages >= 3, "{messages} chunks for {} bytes", whole.len());
    // Response body in duplex mode: echoed unchanged.
    p.send(response_headers(None), None, true).await;
    p.answer().await;
    p.send(response_body(b"data: {\"choices\":[]}\n\n", true), None, true)
        .await;
    let Some(Answer::ResponseBody(b)) = p.answer().await.response else {
        panic!("response body answered")
    };
    let Some(body_mutation::Mutation::StreamedResponse(s)) = b.response.unwrap().body_mutation.unwrap().mutation else {
        panic!("echoed as a streamed mutation")
    };
    assert_eq!(s.body, b"data: {\"choices\":[]}\n\n");
    assert!(s.end_of_stream);
    assert_eq!(wait_unbooked(&r).await.booked(), (0.0, 0.0, 0.0));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_an_immediate_response_and_books_nothing() {
    let (a, b) = (
        StubEngine::start(StubConfig::new("a")).await,
        StubEngine::start(StubConfig::new("b")).await,
    );
    let server = picker(&[&a, &b], |c| {
        c.limits.max_body_bytes = 4096;
        c.max_active = Some(1);
    })
    .await;
    let r = url(&server);
    let cases: [(&[u8], i32, &str); 4] = [
        (b"{not json", 400, "malformed_json"),
        (br#"{"prompt":"x"}"#, 400, "missing_model"),
        (br#"{"model":"other","prompt":[1,2]}"#, 404, "model_not_found"),
        (&[b' '; 5000], 413, "body_too_large"),
    ];
    for (bytes, status, code) in cases {
        let mut p = Proxy::open(&server).await;
        p.send(headers("/v1/completions", false), None, true).await;
        p.send(body(bytes, true), None, true).await;
        let (got, got_code, _) = refusal(&p.answer().await);
        assert_eq!((got, got_code.as_str()), (status, code));
    }
    // A request without a body is refused (no model).
    let mut p = Proxy::open(&server).await;
    p.send(headers("/v1/completions", true), None, false).await;
    assert_eq!(refusal(&p.answer().await).0, 400);
    // A subset hint that names no worker: 503.
    let mut p = Proxy::open(&server).await;
    p.send(headers("/v1/completions", false), Some(subset(&["10.9.9.9:1"])), true)
        .await;
    p.send(body(PROMPT.as_bytes(), true), None, true).await;
    let (status, code, _) = refusal(&p.answer().await);
    assert_eq!((status, code.as_str()), (503, "no_workers"));
    assert_eq!(scrape(&r).await.booked().0, 0.0, "nothing booked by a refusal");
    // Both workers at their admission limit: 429 with Retry-After.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut p = Proxy::open(&server).await;
        p.send(headers("/v1/completions", false), None, true).await;
        p.send(body(PROMPT.as_bytes(), true), None, true).await;
        destination(&p.answer().await);
        held.push(p);
    }
    let mut p = Proxy::open(&server).await;
    p.send(headers("/v1/completions", false), None, true).await;
    p.send(body(PROMPT.as_bytes(), true), None, true).await;
    let (status, code, hs) = refusal(&p.answer().await);
    assert_eq!((status, code.as_str()), (429, "workers_at_capacity"));
    assert!(hs.iter().any(|(k, v)| k == "retry-after" && v == "1"), "{hs:?}");
    assert_eq!(scrape(&r).await.booked().0, 2.0, "only the two held");
    drop(held);
    assert_eq!(
        wait_unbooked(&r).await.booked(),
        (0.0, 0.0, 0.0),
        "released when their streams break"
    );
    let s = scrape(&r).await;
    assert_eq!(s.value("selkie_refusals_total", r#"reason="workers_at_capacity""#), 1.0);
    assert_eq!(s.value("selkie_ext_proc_streams_total", r#"outcome="refused""#), 7.0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_limits_the_choice_and_the_served_endpoint_moves_the_booking() {
    let (a, b) = (
        StubEngine::start(StubConfig::new("a")).await,
        StubEngine::start(StubConfig::new("b")).await,
    );
    let server = picker(&[&a, &b], |_| {}).await;
    let r = url(&server);
    for _ in 0..4 {
        let mut p = Proxy::open(&server).await;
        p.send(headers("/v1/completions", false), Some(subset(&[&authority(&b)])), true)
            .await;
        p.send(body(PROMPT.as_bytes(), true), None, true).await;
        assert_eq!(destination(&p.answer().await), authority(&b), "only b is allowed");
    }
    // The proxy sends the request to a (not the picker's first): the
    // booking moves to a.
    let mut p = Proxy::open(&server).await;
    p.send_in(
        headers("/v1/completions", false),
        Some(subset(&[&authority(&b)])),
        Some(2),
    )
    .await;
    p.answer().await;
    // This body is followed by trailers; in BUFFERED mode the one body
    // message carries the decision.
    p.send(body(PROMPT.as_bytes(), false), None, false).await;
    let decision = p.answer().await;
    assert!(
        matches!(decision.response, Some(Answer::RequestBody(_))),
        "{decision:?}"
    );
    assert_eq!(destination(&decision), authority(&b));
    p.send(Phase::RequestTrailers(HttpTrailers::default()), None, false)
        .await;
    let Some(Answer::RequestTrailers(_)) = p.answer().await.response else {
        panic!("the trailers answered after the decision")
    };
    let on = |s: &support::Scrape, e: &StubEngine| {
        s.samples
            .iter()
            .filter(|(k, _)| k.starts_with("selkie_inflight_requests{") && k.contains(&e.url()))
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    let s = scrape(&r).await;
    assert_eq!((on(&s, &a), on(&s, &b)), (0.0, 1.0), "{}", s.text);
    p.send(response_headers(Some(&authority(&a))), None, false).await;
    let Some(Answer::ResponseHeaders(h)) = p.answer().await.response else {
        panic!()
    };
    assert_eq!(
        set_header(h.response.as_ref().unwrap(), "x-selkie-worker"),
        Some(a.url()),
        "the response names where it was served"
    );
    let s = scrape(&r).await;
    assert_eq!((on(&s, &a), on(&s, &b)), (1.0, 0.0), "the booking moved: {}", s.text);
    assert_eq!(s.value("selkie_ext_proc_served_elsewhere_total", ""), 1.0);
    p.send(response_body(b"data: [DONE]\n\n", true), None, false).await;
    p.answer().await;
    assert_eq!(wait_unbooked(&r).await.booked(), (0.0, 0.0, 0.0));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_at_any_phase_leaves_nothing_booked() {
    let a = StubEngine::start(StubConfig::new("a")).await;
    let server = picker(&[&a], |_| {}).await;
    let r = url(&server);
    // How far each stream gets before the proxy goes away.
    for phase in 0..5 {
        let mut p = Proxy::open(&server).await;
        p.send(headers("/v1/completions", false), None, true).await;
        if phase >= 1 {
            p.send(body(&PROMPT.as_bytes()[..20], false), None, true).await;
        }
        if phase >= 2 {
            p.send(body(&PROMPT.as_bytes()[20..], true), None, true).await;
            destination(&p.answer().await);
            p.answer().await; // the body back
        }
        if phase >= 3 {
            p.send(response_headers(None), None, true).await;
            p.answer().await;
        }
        if phase >= 4 {
            p.send(response_body(&sse(4)[0], false), None, true).await;
            p.answer().await;
        }
        drop(p);
        let s = wait_unbooked(&r).await;
        assert_eq!(s.booked(), (0.0, 0.0, 0.0), "phase {phase}: {}", s.text);
    }
    let s = scrape(&r).await;
    assert_eq!(
        s.value("selkie_ext_proc_streams_total", r#"outcome="broken_before_decision""#),
        2.0
    );
    // Phases 2 (no response yet) and 4 (mid-body) lost their client; phase
    // 3 may read as a proxy that sends no response bodies.
    let gone = s.value("selkie_client_disconnects_total", "");
    assert!((2.0..=3.0).contains(&gone), "{gone} disconnects: {}", s.text);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_are_each_routed_and_released() {
    let (a, b) = (
        StubEngine::start(StubConfig::new("a")).await,
        StubEngine::start(StubConfig::new("b")).await,
    );
    let server = std::sync::Arc::new(picker(&[&a, &b], |_| {}).await);
    let r = url(&server);
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            let mut p = Proxy::open(&server).await;
            p.send(headers("/v1/completions", false), None, true).await;
            p.send(body(PROMPT.as_bytes(), true), None, true).await;
            let first = destination(&p.answer().await).split(',').next().unwrap().to_owned();
            p.answer().await;
            p.send(response_headers(None), None, true).await;
            p.answer().await;
            let chunks = sse(3);
            for (i, c) in chunks.iter().enumerate() {
                p.send(response_body(c, i == chunks.len() - 1), None, true).await;
                p.answer().await;
            }
            first
        }));
    }
    let mut seen = std::collections::BTreeMap::new();
    for t in tasks {
        *seen.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(seen.values().sum::<i32>(), 200);
    assert_eq!(seen.len(), 2, "both workers used: {seen:?}");
    let s = wait_unbooked(&r).await;
    assert_eq!(s.booked(), (0.0, 0.0, 0.0), "{}", s.text);
    assert_eq!(s.value("selkie_ext_proc_streams_total", r#"outcome="routed""#), 200.0);
    std::sync::Arc::into_inner(server).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_metrics_mark_a_busy_engine_and_count_outside_load_until_they_go_stale() {
    let (a, b) = (
        StubEngine::start(StubConfig::new("a")).await,
        StubEngine::start(StubConfig::new("b")).await,
    );
    a.set_metrics("vllm:num_requests_waiting{model_name=\"tiny\"} 0\nvllm:num_requests_running{model_name=\"tiny\"} 0\nvllm:kv_cache_usage_perc{model_name=\"tiny\"} 0.1\n");
    b.set_metrics(
        "vllm:num_requests_waiting{model_name=\"tiny\"} 0\nvllm:num_requests_running{model_name=\"tiny\"} 0\n",
    );
    let server = picker(&[&a, &b], |c| {
        let mut m = EngineMetricsConfig::every(Duration::from_millis(50));
        m.staleness = Duration::from_millis(300);
        m.queue_threshold = 10.0;
        c.engine_metrics = Some(m);
    })
    .await;
    let r = url(&server);
    // A decision, its stream kept open (the booking held) by the caller.
    let choose_held = || async {
        let mut p = Proxy::open(&server).await;
        p.send(headers("/v1/completions", false), None, true).await;
        p.send(body(PROMPT.as_bytes(), true), None, true).await;
        let d = destination(&p.answer().await);
        (d.split(',').next().unwrap().to_owned(), p)
    };
    let choose = || async { choose_held().await.0 };
    // a's engine queues 12 requests: busy, skipped.
    a.set_metrics(
        "vllm:num_requests_waiting{model_name=\"tiny\"} 12\nvllm:num_requests_running{model_name=\"tiny\"} 4\n",
    );
    eventually("a marked busy", async || {
        scrape(&r)
            .await
            .value("selkie_engine_busy", &format!("worker=\"{}\"", a.url()))
            == 1.0
    })
    .await;
    for _ in 0..6 {
        assert_eq!(choose().await, authority(&b), "a is busy");
    }
    // The six streams above were dropped: nothing booked.
    wait_unbooked(&r).await;
    // a's queue drains but it runs 3 requests the router never booked:
    // least-loaded counts them against it.
    a.set_metrics(
        "vllm:num_requests_waiting{model_name=\"tiny\"} 0\nvllm:num_requests_running{model_name=\"tiny\"} 3\n",
    );
    eventually("a's outside load counted", async || {
        let s = scrape(&r).await;
        s.value("selkie_engine_busy", &format!("worker=\"{}\"", a.url())) == 0.0
            && s.value("selkie_engine_external_requests", &format!("worker=\"{}\"", a.url())) == 3.0
    })
    .await;
    // Three requests held in turn: b holds 0, 1, 2 of them when each is
    // chosen, a its 3 outside ones, so each goes to b.
    let mut held = Vec::new();
    for i in 0..3 {
        let (to, p) = choose_held().await;
        assert_eq!(to, authority(&b), "request {i}: a holds 3 outside requests, b {i}");
        held.push(p);
    }
    drop(held);
    // a's metrics go away: after the staleness bound they stop counting.
    a.set_metrics("");
    eventually("a's figures stale", async || {
        scrape(&r)
            .await
            .value("selkie_engine_external_requests", &format!("worker=\"{}\"", a.url()))
            == 0.0
    })
    .await;
    let s = scrape(&r).await;
    assert!(
        s.value(
            "selkie_engine_scrapes_total",
            &format!("worker=\"{}\",outcome=\"failed\"", a.url())
        ) >= 1.0,
        "{}",
        s.text
    );
    server.shutdown().await;
}
