//! Connections to the workers: one pooled HTTP/1.1 client for all of
//! them (idle connections kept per worker up to
//! [`Limits::max_idle_per_worker`](super::Limits::max_idle_per_worker)),
//! with the connect and response-head timeouts of [`Limits`]. It sends and
//! sorts failures ([`SendError`]); choosing and retrying are the caller's.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::workers::{ModelList, WorkerEntry, MAX_MODELS_PER_WORKER};
use super::Limits;

/// How long an idle connection to a worker is kept.
pub const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(90);

/// The largest `/v1/models` answer read from a worker (1 MiB).
pub const MAX_MODELS_BYTES: usize = 1 << 20;

/// Why a request did not get its response head.
#[derive(Debug)]
pub enum SendError {
    /// The connection was refused or timed out: nothing was sent, so the
    /// request may go to another worker.
    Connect(String),
    /// No response head within the response timeout.
    Timeout,
    /// The connection broke after the request was (perhaps) sent.
    Broken(String),
}

/// The client all requests to workers go through.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    response_timeout: Duration,
}

impl Upstream {
    /// A client with `limits`' timeouts and pool size. Must be called
    /// inside a tokio runtime.
    pub fn new(limits: &Limits) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(limits.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(IDLE_CONNECTION_TIMEOUT)
            .pool_max_idle_per_host(limits.max_idle_per_worker)
            .build(connector);
        Upstream {
            client,
            response_timeout: limits.response_timeout,
        }
    }

    /// Sends `request` and waits for the response head.
    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Response<Incoming>, SendError> {
        match tokio::time::timeout(self.response_timeout, self.client.request(request)).await {
            Err(_) => Err(SendError::Timeout),
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) if e.is_connect() => Err(SendError::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(SendError::Broken(error_chain(&e))),
        }
    }

    /// Reads `worker`'s `GET path` answer (a success status, at most
    /// `max_bytes`, within `timeout`).
    pub async fn get(
        &self,
        worker: &WorkerEntry,
        path: &str,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<Bytes, String> {
        let uri: Uri = worker.url.uri(path).map_err(|e| e.to_string())?;
        let request = Request::get(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let read = async {
            let response = self.client.request(request).await.map_err(|e| error_chain(&e))?;
            if !response.status().is_success() {
                return Err(format!("status {}", response.status()));
            }
            let body = Limited::new(response.into_body(), max_bytes)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>(body)
        };
        tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| "timed out".to_owned())?
    }

    /// Reads `worker`'s `GET /v1/models` (at most [`MAX_MODELS_BYTES`],
    /// [`MAX_MODELS_PER_WORKER`] models, within `timeout`).
    pub async fn models(&self, worker: &WorkerEntry, timeout: Duration) -> Result<ModelList, String> {
        let body = self.get(worker, "/v1/models", timeout, MAX_MODELS_BYTES).await?;
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        let data = v
            .get("data")
            .and_then(|d| d.as_array())
            .ok_or_else(|| "no \"data\" list".to_owned())?;
        let mut list = ModelList::default();
        for o in data.iter().take(MAX_MODELS_PER_WORKER) {
            if let Some(id) = o.get("id").and_then(|i| i.as_str()) {
                list.ids.push(id.to_owned());
                list.objects.push(o.clone());
            }
        }
        Ok(list)
    }
}

/// An error and its sources, on one line.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}
