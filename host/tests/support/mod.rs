//! What the router's tests share: stub engines, a client that records
//! when each chunk arrives, the router's metrics read back, a tokenizer and
//! a chat template built in code.
#![allow(dead_code)]

pub mod ports;
pub mod stub_engine;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use selkie::router::{ServeConfig, Server};

/// A router on a free loopback port in front of `workers`, with small
/// connection bounds (the test process's open-files limit may be low), a
/// fast models refresh, a fixed seed, and `tweak` applied.
pub async fn router(workers: &[String], tweak: impl FnOnce(&mut ServeConfig)) -> Server {
    let mut c = ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        workers: workers.to_vec(),
        models_refresh: Duration::from_millis(200),
        seed: Some(7),
        ..ServeConfig::default()
    };
    c.limits.max_connections = 256;
    c.limits.max_concurrent_requests = 256;
    tweak(&mut c);
    Server::start(c).await.expect("the router starts")
}

/// `http://ADDR` of a router.
pub fn url(s: &Server) -> String {
    format!("http://{}", s.local_addr())
}

/// A plain HTTP/1.1 client.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// What came back for one request.
#[derive(Debug)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: hyper::HeaderMap,
    /// Body chunks with the time each arrived.
    pub chunks: Vec<(Instant, Bytes)>,
    /// The body's error, if it ended in one.
    pub error: Option<String>,
    /// When the request was sent.
    pub sent: Instant,
}

impl Reply {
    /// The whole body.
    pub fn body(&self) -> Vec<u8> {
        self.chunks.iter().flat_map(|(_, c)| c.iter().copied()).collect()
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body())
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body())))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Sends `body` to `url` + `path` with `headers` and reads the whole reply.
pub async fn post(url: &str, path: &str, body: impl Into<Bytes>, headers: &[(&str, &str)]) -> Reply {
    send(&client(), "POST", url, path, body.into(), headers).await
}

/// `GET url + path`.
pub async fn get(url: &str, path: &str) -> Reply {
    send(&client(), "GET", url, path, Bytes::new(), &[]).await
}

/// Sends one request with `client` and reads the whole reply.
pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    path: &str,
    body: Bytes,
    headers: &[(&str, &str)],
) -> Reply {
    let mut req = Request::builder().method(method).uri(format!("{url}{path}"));
    if method == "POST" && !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("content-type")) {
        req = req.header("content-type", "application/json");
    }
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let sent = Instant::now();
    let response = client
        .request(req.body(Full::new(body)).unwrap())
        .await
        .unwrap_or_else(|e| panic!("{method} {url}{path}: {e:?}"));
    let (parts, mut body) = response.into_parts();
    let mut chunks = Vec::new();
    let mut error = None;
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    chunks.push((Instant::now(), data));
                }
            }
            Some(Err(e)) => {
                error = Some(format!("{e:?}"));
                break;
            }
        }
    }
    Reply {
        status: parts.status,
        headers: parts.headers,
        chunks,
        error,
        sent,
    }
}

/// The router's metrics, parsed: `name{labels}` → value.
#[derive(Debug, Default)]
pub struct Scrape {
    /// Every sample.
    pub samples: BTreeMap<String, f64>,
    /// The text.
    pub text: String,
}

impl Scrape {
    /// The sample `name{labels}` (labels as written, e.g.
    /// `reason="malformed_json"`), 0 when absent.
    pub fn value(&self, name: &str, labels: &str) -> f64 {
        let key = if labels.is_empty() {
            name.to_owned()
        } else {
            format!("{name}{{{labels}}}")
        };
        self.samples.get(&key).copied().unwrap_or(0.0)
    }

    /// The sum of every sample of `name` (any labels).
    pub fn sum(&self, name: &str) -> f64 {
        self.samples
            .iter()
            .filter(|(k, _)| k.as_str() == name || k.starts_with(&format!("{name}{{")))
            .map(|(_, v)| v)
            .sum()
    }

    /// Requests, prefill tokens and decode blocks booked, over all
    /// workers.
    pub fn booked(&self) -> (f64, f64, f64) {
        (
            self.sum("selkie_inflight_requests"),
            self.sum("selkie_booked_prefill_tokens"),
            self.sum("selkie_booked_decode_blocks"),
        )
    }
}

/// Reads the router's `/metrics`.
pub async fn scrape(router: &str) -> Scrape {
    let reply = get(router, "/metrics").await;
    assert_eq!(reply.status, 200);
    let text = String::from_utf8(reply.body()).unwrap();
    let mut samples = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        if let Some((key, value)) = line.rsplit_once(' ') {
            if let Ok(v) = value.parse::<f64>() {
                samples.insert(key.to_owned(), v);
            }
        }
    }
    Scrape { samples, text }
}

/// Waits (up to 10 s) until the router books nothing, and returns the
/// scrape that showed it.
pub async fn wait_unbooked(router: &str) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = scrape(router).await;
        if s.booked() == (0.0, 0.0, 0.0) || Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (up to 10 s) for `check` to hold.
pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh directory for one test's files.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("selkie-serve-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The words the test tokenizer knows, in id order (unknown words are id 0).
pub const VOCAB: [&str; 12] = [
    "[UNK]",
    "hello",
    "world",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "<user>",
    "<assistant>",
    "<system>",
    "again",
];

/// Writes a word-level tokenizer (whitespace split, [`VOCAB`]) and a chat
/// template (`<role> content` per message, then `<assistant>`) into `dir`;
/// returns their paths.
pub fn tokenizer_and_template(dir: &std::path::Path) -> (PathBuf, PathBuf) {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    let vocab = VOCAB
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(WhitespaceSplit));
    let tokenizer_path = dir.join("tokenizer.json");
    tokenizer.save(&tokenizer_path, false).unwrap();
    let template_path = dir.join("template.jinja");
    std::fs::write(
        &template_path,
        "{% for m in messages %}<{{ m.role }}> {{ m.content | trim }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    (tokenizer_path, template_path)
}

/// A port on loopback that refuses connections, for as long as the returned
/// socket lives: bound and never listening, so no other server of the test
/// run (a stub engine, a router) can take the port meanwhile, as one could
/// a port closed again.
pub fn dead_url() -> (String, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    (format!("http://{addr}"), socket)
}
