//! The router's workers: where each one is (its URL), which models it
//! serves, and the sources that say so (`--worker` flags, a workers file
//! re-read when it changes, etcd).
//!
//! Workers are the selection service's workers: every source's entries are
//! merged into one snapshot of [`WorkerRecord`]s that the service applies
//! whole ([`WorkerSelectionService::refresh`](crate::WorkerSelectionService::refresh),
//! driven by a [`DiscoveryPoller`](crate::DiscoveryPoller)). Each record
//! carries its URL in the label `url`, so the service's table alone says
//! where a worker is; the [`WorkerTable`] here is a lock-free cache of it
//! for the request path, and a worker it does not know yet is looked up in
//! the service.
//!
//! A worker's id is its entry's `worker_id`, or else a hash of its URL
//! (xxh3 of `http://host:port/prefix`), so a worker keeps its id across
//! restarts of the router and across sources.
//!
//! # The workers file
//!
//! YAML (`.yaml`, `.yml`), JSON (`.json`) or TOML (`.toml`), a list under
//! `workers`; each entry is a URL, or a table with `url` and any of
//! `worker_id`, `max_active_requests`, `capacity_weight`,
//! `data_parallel_size`, `models`, `state` (`live`, `draining`,
//! `cordoned`), `taints`, `labels`:
//!
//! ```yaml
//! workers:
//!   - http://10.0.0.1:8000
//!   - url: http://10.0.0.2:8000
//!     max_active_requests: 64
//!     models: [llama-3-8b]
//!     state: draining
//! ```
//!
//! The file is read at most [`MAX_WORKERS_FILE_BYTES`] long. A file that
//! does not parse, or lists no `workers`, changes nothing (the error is
//! logged and counted); write `workers: []` to remove every worker. A
//! worker with `data_parallel_size` above 1 is routed per rank; the chosen
//! rank is sent in the `x-data-parallel-rank` request header (vLLM's).
//!
//! # Models
//!
//! A worker serves the models its entry lists; without a list, the models
//! its `GET /v1/models` answers, read at start and every
//! [`models_refresh`](super::ServeConfig::models_refresh). A worker whose
//! models are not known yet is taken to serve every model. A request for a
//! model no worker serves is refused with 404.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::{ArcSwap, ArcSwapOption};
use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::HeaderValue;
use serde::Deserialize;

use super::error::ServeError;
use crate::{Discovery, DiscoveryError, WorkerId, WorkerRecord, WorkerSelectionService, WorkerState};

/// The largest workers file read (16 MiB).
pub const MAX_WORKERS_FILE_BYTES: u64 = 16 << 20;

/// The most models kept per worker from its `/v1/models`.
pub const MAX_MODELS_PER_WORKER: usize = 1024;

/// The label of a worker record that holds its URL.
pub const URL_LABEL: &str = "url";

/// The label of a worker record that lists its models (comma-separated),
/// for records from etcd.
pub const MODELS_LABEL: &str = "models";

/// A worker's base URL: `http://host:port` and an optional path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerUrl {
    authority: Authority,
    prefix: String,
    text: String,
}

impl WorkerUrl {
    /// Parses `http://host[:port][/prefix]` (port 80 when absent). Other
    /// schemes, queries and user info are refused.
    ///
    /// ```
    /// use selkie::router::WorkerUrl;
    /// let u = WorkerUrl::parse("http://127.0.0.1:8101/")?;
    /// assert_eq!(u.as_str(), "http://127.0.0.1:8101");
    /// assert_eq!(u.authority(), "127.0.0.1:8101");
    /// assert!(WorkerUrl::parse("https://a:1").is_err());
    /// assert!(WorkerUrl::parse("127.0.0.1:8101").is_err());
    /// # Ok::<(), selkie::router::ServeError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Self, ServeError> {
        let bad = |why: &str| ServeError::Invalid {
            option: "--worker",
            value: text.to_owned(),
            bound: format!("a worker URL is http://host:port[/prefix] ({why})"),
        };
        let uri: Uri = text.trim().parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(bad("the scheme must be http"));
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?.clone();
        if authority.as_str().contains('@') {
            return Err(bad("no user info"));
        }
        if authority.host().is_empty() {
            return Err(bad("no host"));
        }
        if uri.query().is_some() {
            return Err(bad("no query"));
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let authority: Authority = match authority.port_u16() {
            Some(_) => authority,
            None => format!("{}:80", authority.host())
                .parse()
                .map_err(|_| bad("bad host"))?,
        };
        let text = format!("http://{}{}", authority.as_str().to_ascii_lowercase(), prefix);
        Ok(WorkerUrl {
            authority,
            prefix,
            text,
        })
    }

    /// `host:port`, as an endpoint picker names the worker to its proxy.
    pub fn authority(&self) -> &str {
        let end = self.text.len() - self.prefix.len();
        &self.text["http://".len()..end]
    }

    /// The URL as the router writes it (`http://host:port[/prefix]`).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The worker's URI for `path_and_query` (`/v1/completions?x=1`).
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        let pq: PathAndQuery = if self.prefix.is_empty() {
            path_and_query.parse()?
        } else {
            format!("{}{}", self.prefix, path_and_query).parse()?
        };
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
    }

    /// The id of a worker known only by its URL.
    pub fn default_id(&self) -> WorkerId {
        xxhash_rust::xxh3::xxh3_64(self.text.as_bytes())
    }
}

/// The models one worker serves, as read from its `/v1/models` (or its
/// entry).
#[derive(Debug, Default)]
pub struct ModelList {
    /// The ids.
    pub ids: Vec<String>,
    /// The model objects as the worker wrote them (for the router's own
    /// `/v1/models`).
    pub objects: Vec<serde_json::Value>,
}

/// One worker as the request path sees it.
#[derive(Debug)]
pub struct WorkerEntry {
    /// Its id in the selection service.
    pub id: WorkerId,
    /// Where it is.
    pub url: WorkerUrl,
    /// `x-selkie-worker`'s value.
    pub header: HeaderValue,
    /// Its first data-parallel rank and rank count.
    pub dp: (u32, u32),
    /// Whether its models come from its entry (not read from the worker).
    pub listed_models: bool,
    /// Its KV event endpoint: the label `kv_events` of its record
    /// (`ENDPOINT[,replay=ENDPOINT][,topic=TOPIC][,mode=bind|connect]`,
    /// see [`kv_events`](super::kv_events)).
    pub kv_events: Option<String>,
    models: ArcSwapOption<ModelList>,
}

impl WorkerEntry {
    fn new(spec: &WorkerSpec) -> Self {
        let models = spec.models.as_ref().map(|ids| {
            Arc::new(ModelList {
                ids: ids.clone(),
                objects: ids
                    .iter()
                    .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "selkie"}))
                    .collect(),
            })
        });
        WorkerEntry {
            id: spec.record.worker_id,
            header: HeaderValue::from_str(spec.url.as_str()).unwrap_or_else(|_| HeaderValue::from_static("invalid")),
            url: spec.url.clone(),
            dp: (spec.record.data_parallel_start_rank, spec.record.data_parallel_size),
            listed_models: models.is_some(),
            kv_events: spec.record.labels.get(super::kv_events::KV_EVENTS_LABEL).cloned(),
            models: ArcSwapOption::new(models),
        }
    }

    /// The models it serves, if known.
    pub fn models(&self) -> Option<Arc<ModelList>> {
        self.models.load_full()
    }

    /// Sets the models read from the worker.
    pub fn set_models(&self, models: ModelList) {
        self.models.store(Some(Arc::new(models)));
    }
}

/// Which workers may serve a model.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ModelRoute {
    /// Every worker (no allowlist).
    #[default]
    Any,
    /// Only these.
    Only(Arc<[WorkerId]>),
    /// None: no worker serves it.
    Unknown,
}

/// An immutable view of the workers, swapped whole on every change.
#[derive(Debug, Default)]
pub struct FleetView {
    by_id: HashMap<WorkerId, Arc<WorkerEntry>>,
    order: Vec<Arc<WorkerEntry>>,
    routes: HashMap<String, ModelRoute>,
    /// The route of a model no worker lists: the workers whose models are
    /// unknown.
    unlisted: ModelRoute,
    models_json: Bytes,
}

impl FleetView {
    fn build(order: Vec<Arc<WorkerEntry>>) -> Self {
        let by_id: HashMap<_, _> = order.iter().map(|e| (e.id, e.clone())).collect();
        let mut serving: HashMap<String, Vec<WorkerId>> = HashMap::new();
        let mut unknown = Vec::new();
        let mut objects = Vec::new();
        let mut seen = HashSet::new();
        for e in &order {
            match e.models() {
                Some(list) => {
                    for id in list.ids.iter() {
                        let ids = serving.entry(id.clone()).or_default();
                        if !ids.contains(&e.id) {
                            ids.push(e.id);
                        }
                    }
                    for o in &list.objects {
                        let id = o.get("id").and_then(|v| v.as_str()).unwrap_or_default();
                        if seen.insert(id.to_owned()) {
                            objects.push(o.clone());
                        }
                    }
                }
                None => unknown.push(e.id),
            }
        }
        let n = by_id.len();
        let route = |mut ids: Vec<WorkerId>| {
            ids.extend(&unknown);
            ids.sort_unstable();
            ids.dedup();
            if ids.len() == n {
                ModelRoute::Any
            } else if ids.is_empty() {
                ModelRoute::Unknown
            } else {
                ModelRoute::Only(ids.into())
            }
        };
        let routes = serving.into_iter().map(|(m, ids)| (m, route(ids))).collect();
        let unlisted = if n == 0 { ModelRoute::Any } else { route(Vec::new()) };
        let models_json = Bytes::from(serde_json::json!({"object": "list", "data": objects}).to_string());
        FleetView {
            by_id,
            order,
            routes,
            unlisted,
            models_json,
        }
    }

    /// The worker with this id, if the view has it.
    pub fn get(&self, id: WorkerId) -> Option<&Arc<WorkerEntry>> {
        self.by_id.get(&id)
    }

    /// Every worker, in source order.
    pub fn workers(&self) -> &[Arc<WorkerEntry>] {
        &self.order
    }

    /// Which workers may serve `model`.
    pub fn route(&self, model: &str) -> &ModelRoute {
        self.routes.get(model).unwrap_or(&self.unlisted)
    }

    /// The body of `GET /v1/models`: every model the workers list, once.
    pub fn models_json(&self) -> Bytes {
        self.models_json.clone()
    }
}

/// The workers the request path reads without a lock.
#[derive(Debug, Default)]
pub struct WorkerTable {
    view: ArcSwap<FleetView>,
    /// Serialises writers (discovery and the models refresh).
    write: Mutex<()>,
    /// Woken when discovery changes the workers (the models refresh
    /// waits on it).
    changed: tokio::sync::Notify,
}

impl WorkerTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current view.
    pub fn view(&self) -> Arc<FleetView> {
        self.view.load_full()
    }

    /// The worker with this id: from the view, or else from the service's
    /// record (a worker the service applied before this table saw it).
    pub fn get(&self, id: WorkerId, service: &WorkerSelectionService) -> Option<Arc<WorkerEntry>> {
        if let Some(e) = self.view.load().get(id) {
            return Some(e.clone());
        }
        let record = service.worker_status(id)?.record;
        let spec = WorkerSpec::from_record(record).ok()?;
        Some(Arc::new(WorkerEntry::new(&spec)))
    }

    /// Makes the table hold `specs`, keeping the models already read for
    /// workers whose id and URL are unchanged.
    fn set(&self, specs: &[WorkerSpec]) {
        let _w = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.view.load_full();
        let order = specs
            .iter()
            .map(|s| match old.get(s.record.worker_id) {
                Some(e)
                    if e.url == s.url
                        && e.dp == (s.record.data_parallel_start_rank, s.record.data_parallel_size)
                        && !e.listed_models
                        && s.models.is_none()
                        && e.kv_events.as_ref() == s.record.labels.get(super::kv_events::KV_EVENTS_LABEL) =>
                {
                    e.clone()
                }
                _ => Arc::new(WorkerEntry::new(s)),
            })
            .collect();
        self.view.store(Arc::new(FleetView::build(order)));
        self.changed.notify_one();
    }

    /// Waits until discovery changes the workers (a change made since the
    /// last wait counts).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Rebuilds the model routes after a worker's models changed.
    pub fn models_changed(&self) {
        let _w = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let order = self.view.load().order.clone();
        self.view.store(Arc::new(FleetView::build(order)));
    }
}

/// One worker as a source lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSpec {
    /// Where it is.
    pub url: WorkerUrl,
    /// Its record for the service (its `url` label set).
    pub record: WorkerRecord,
    /// The models its entry lists.
    pub models: Option<Vec<String>>,
}

impl WorkerSpec {
    /// A worker known by its URL alone.
    pub fn from_url(url: &str) -> Result<Self, ServeError> {
        let url = WorkerUrl::parse(url)?;
        let record = WorkerRecord::new(url.default_id()).with_label(URL_LABEL, url.as_str());
        Ok(WorkerSpec {
            url,
            record,
            models: None,
        })
    }

    /// A worker from a record whose label `url` says where it is (etcd's
    /// records), its models from the label `models`.
    pub fn from_record(mut record: WorkerRecord) -> Result<Self, String> {
        let url = record
            .labels
            .get(URL_LABEL)
            .ok_or_else(|| format!("worker {} has no label {URL_LABEL:?}", record.worker_id))?;
        let url = WorkerUrl::parse(url).map_err(|e| format!("worker {}: {e}", record.worker_id))?;
        record.labels.insert(URL_LABEL.to_owned(), url.as_str().to_owned());
        let models = record.labels.get(MODELS_LABEL).map(|m| {
            m.split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect()
        });
        Ok(WorkerSpec { url, record, models })
    }
}

/// One entry of a workers file.
#[derive(Deserialize)]
#[serde(untagged)]
enum FileEntry {
    Url(String),
    Entry(Box<EntryFields>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryFields {
    url: String,
    #[serde(default)]
    worker_id: Option<WorkerId>,
    #[serde(default)]
    max_active_requests: Option<u32>,
    #[serde(default)]
    capacity_weight: Option<f32>,
    #[serde(default)]
    data_parallel_size: Option<u32>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    state: Option<WorkerState>,
    #[serde(default)]
    taints: Vec<String>,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileShape {
    workers: Option<Vec<FileEntry>>,
}

/// Parses a workers file's text (the format by `path`'s extension).
pub fn parse_workers_file(text: &str, path: &Path) -> Result<Vec<WorkerSpec>, DiscoveryError> {
    let err = |message: String| DiscoveryError::Parse {
        path: path.to_owned(),
        message,
    };
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let shape: FileShape = match ext.as_str() {
        "json" => serde_json::from_str(text).map_err(|e| err(e.to_string()))?,
        "toml" => toml::from_str(text).map_err(|e| err(e.to_string()))?,
        _ => serde_saphyr::from_str(text).map_err(|e| err(e.to_string()))?,
    };
    let entries = shape
        .workers
        .ok_or_else(|| DiscoveryError::EmptyFile { path: path.to_owned() })?;
    let mut specs = Vec::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        let spec = match entry {
            FileEntry::Url(url) => WorkerSpec::from_url(&url),
            FileEntry::Entry(f) => WorkerSpec::from_url(&f.url).map(|mut spec| {
                let r = &mut spec.record;
                if let Some(id) = f.worker_id {
                    r.worker_id = id;
                }
                r.max_active_requests = f.max_active_requests;
                if let Some(w) = f.capacity_weight {
                    r.capacity_weight = w;
                }
                if let Some(n) = f.data_parallel_size {
                    r.data_parallel_size = n;
                }
                if let Some(s) = f.state {
                    r.state = s;
                }
                r.taints.extend(f.taints);
                for (k, v) in f.labels {
                    if k != URL_LABEL {
                        r.labels.insert(k, v);
                    }
                }
                spec.models = f.models;
                spec
            }),
        }
        .map_err(|e| err(format!("workers[{i}]: {e}")))?;
        spec.record
            .validate()
            .map_err(|e| err(format!("workers[{i}] ({}): {e}", spec.url.as_str())))?;
        specs.push(spec);
    }
    Ok(specs)
}

/// A workers file, re-read when its content changes.
struct WorkersFile {
    path: PathBuf,
    last: Option<u64>,
}

impl WorkersFile {
    fn poll(&mut self) -> Result<Option<Vec<WorkerSpec>>, DiscoveryError> {
        let io = |source| DiscoveryError::Io {
            path: self.path.clone(),
            source,
        };
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(std::fs::File::open(&self.path).map_err(io)?, MAX_WORKERS_FILE_BYTES + 1),
            &mut bytes,
        )
        .map_err(io)?;
        if bytes.len() as u64 > MAX_WORKERS_FILE_BYTES {
            return Err(DiscoveryError::FileTooLarge {
                path: self.path.clone(),
                len: bytes.len() as u64,
                limit: MAX_WORKERS_FILE_BYTES,
            });
        }
        let hash = xxhash_rust::xxh3::xxh3_64(&bytes);
        if self.last == Some(hash) {
            return Ok(None);
        }
        let text = String::from_utf8(bytes).map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        let specs = parse_workers_file(&text, &self.path)?;
        self.last = Some(hash);
        Ok(Some(specs))
    }
}

/// The router's discovery source: the `--worker` flags, the workers file
/// and etcd, merged into one snapshot (the first entry of an id wins), with
/// `--max-active` applied to entries that set no limit. Every snapshot it
/// delivers also updates the [`WorkerTable`].
pub struct ServeSource {
    statics: Vec<WorkerSpec>,
    file: Option<WorkersFile>,
    #[cfg(feature = "etcd")]
    etcd: Option<crate::EtcdDiscovery>,
    from_file: Vec<WorkerSpec>,
    #[cfg(feature = "etcd")]
    from_etcd: Vec<WorkerSpec>,
    max_active: Option<u32>,
    table: Arc<WorkerTable>,
    delivered: bool,
}

impl ServeSource {
    /// A source of the `--worker` URLs and the workers file.
    pub fn new(
        urls: &[String],
        file: Option<PathBuf>,
        max_active: Option<u32>,
        table: Arc<WorkerTable>,
    ) -> Result<Self, ServeError> {
        let statics = urls.iter().map(|u| WorkerSpec::from_url(u)).collect::<Result<_, _>>()?;
        Ok(ServeSource {
            statics,
            file: file.map(|path| WorkersFile { path, last: None }),
            #[cfg(feature = "etcd")]
            etcd: None,
            from_file: Vec::new(),
            #[cfg(feature = "etcd")]
            from_etcd: Vec::new(),
            max_active,
            table,
            delivered: false,
        })
    }

    /// Adds etcd's workers (feature `etcd`).
    #[cfg(feature = "etcd")]
    pub fn with_etcd(mut self, etcd: crate::EtcdDiscovery) -> Self {
        self.etcd = Some(etcd);
        self
    }

    /// Whether anything but the flags feeds it (it must be polled).
    pub fn is_dynamic(&self) -> bool {
        #[cfg(feature = "etcd")]
        if self.etcd.is_some() {
            return true;
        }
        self.file.is_some()
    }

    fn merged(&self) -> (Vec<WorkerSpec>, Vec<WorkerRecord>) {
        let mut seen = HashSet::new();
        let mut specs = Vec::new();
        let lists: [&[WorkerSpec]; 3] = [
            &self.statics,
            &self.from_file,
            #[cfg(feature = "etcd")]
            &self.from_etcd,
            #[cfg(not(feature = "etcd"))]
            &[],
        ];
        for s in lists.into_iter().flatten() {
            if seen.insert(s.record.worker_id) {
                let mut s = s.clone();
                if s.record.max_active_requests.is_none() {
                    s.record.max_active_requests = self.max_active;
                }
                specs.push(s);
            }
        }
        let records = specs.iter().map(|s| s.record.clone()).collect();
        (specs, records)
    }
}

impl Discovery for ServeSource {
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError> {
        let mut changed = !self.delivered;
        let mut failure = None;
        if let Some(file) = &mut self.file {
            match file.poll() {
                Ok(Some(specs)) => {
                    self.from_file = specs;
                    changed = true;
                }
                Ok(None) => {}
                Err(e) => failure = Some(e),
            }
        }
        #[cfg(feature = "etcd")]
        if let Some(etcd) = &mut self.etcd {
            match etcd.poll() {
                Ok(Some(records)) => {
                    self.from_etcd = records
                        .into_iter()
                        .filter_map(|r| match WorkerSpec::from_record(r) {
                            Ok(s) => Some(s),
                            Err(message) => {
                                tracing::warn!(%message, "etcd worker record skipped");
                                None
                            }
                        })
                        .collect();
                    changed = true;
                }
                Ok(None) => {}
                Err(e) => failure = Some(e),
            }
        }
        match (changed, failure) {
            // Nothing changed, or the first snapshot is incomplete (the
            // router must not start without a source's workers).
            (false, Some(e)) => Err(e),
            (true, Some(e)) if !self.delivered => Err(e),
            (false, None) => Ok(None),
            (true, failure) => {
                if let Some(e) = failure {
                    tracing::warn!(error = %e, "a worker source failed; the others' changes apply");
                }
                let (specs, records) = self.merged();
                self.table.set(&specs);
                self.delivered = true;
                Ok(Some(records))
            }
        }
    }

    fn snapshot_refused(&mut self, error: &DiscoveryError) {
        tracing::warn!(%error, "the workers were refused; the previous workers stay");
        if let Some(f) = &mut self.file {
            f.last = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalised_and_checked() {
        let u = WorkerUrl::parse("http://LocalHost:9000/engine/").unwrap();
        assert_eq!(u.as_str(), "http://localhost:9000/engine");
        assert_eq!(
            u.uri("/v1/models").unwrap().to_string(),
            "http://LocalHost:9000/engine/v1/models"
        );
        assert_eq!(WorkerUrl::parse("http://h").unwrap().as_str(), "http://h:80");
        for bad in ["ftp://h:1", "http://u:p@h:1", "http://h:1/?q=1", "h:1", ""] {
            assert!(WorkerUrl::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            WorkerUrl::parse("http://a:1").unwrap().default_id(),
            WorkerUrl::parse("http://a:1/").unwrap().default_id()
        );
    }

    #[test]
    fn workers_file_in_every_format() {
        let yaml = "workers:\n  - http://a:1\n  - url: http://b:2\n    max_active_requests: 3\n    models: [m]\n    state: draining\n";
        let specs = parse_workers_file(yaml, Path::new("w.yaml")).unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[1].record.max_active_requests, Some(3));
        assert_eq!(specs[1].record.state, WorkerState::Draining);
        assert_eq!(specs[1].models.as_deref(), Some(&["m".to_owned()][..]));
        assert_eq!(specs[1].record.labels[URL_LABEL], "http://b:2");
        let json = r#"{"workers": ["http://a:1", {"url": "http://b:2", "max_active_requests": 3, "models": ["m"], "state": "draining"}]}"#;
        assert_eq!(parse_workers_file(json, Path::new("w.json")).unwrap(), specs);
        let toml = "workers = [\"http://a:1\", { url = \"http://b:2\", max_active_requests = 3, models = [\"m\"], state = \"draining\" }]";
        assert_eq!(parse_workers_file(toml, Path::new("w.toml")).unwrap(), specs);
        let e = parse_workers_file("workers:\n  - url: http://a:1\n    colour: red\n", Path::new("w.yaml"));
        assert!(e.is_err());
        let e = parse_workers_file("workers:\n  - https://a:1\n", Path::new("w.yaml")).unwrap_err();
        assert!(e.to_string().contains("workers[0]"), "{e}");
        assert!(matches!(
            parse_workers_file("{}", Path::new("w.json")),
            Err(DiscoveryError::EmptyFile { .. })
        ));
    }

    #[test]
    fn model_routes() {
        let table = WorkerTable::new();
        let mut a = WorkerSpec::from_url("http://a:1").unwrap();
        a.models = Some(vec!["m1".into()]);
        let b = WorkerSpec::from_url("http://b:1").unwrap();
        table.set(&[a.clone(), b.clone()]);
        let view = table.view();
        assert_eq!(
            view.route("m1"),
            &ModelRoute::Any,
            "b's models are unknown: it may serve m1"
        );
        assert_eq!(view.route("m2"), &ModelRoute::Only(vec![b.record.worker_id].into()));
        view.get(b.record.worker_id).unwrap().set_models(ModelList {
            ids: vec!["m2".into()],
            objects: vec![serde_json::json!({"id": "m2"})],
        });
        table.models_changed();
        let view = table.view();
        assert_eq!(view.route("m1"), &ModelRoute::Only(vec![a.record.worker_id].into()));
        assert_eq!(view.route("m3"), &ModelRoute::Unknown);
        let models: serde_json::Value = serde_json::from_slice(&view.models_json()).unwrap();
        assert_eq!(models["data"].as_array().unwrap().len(), 2);
        // Unchanged workers keep the models read from them.
        table.set(&[a, b.clone()]);
        assert!(table.view().get(b.record.worker_id).unwrap().models().is_some());
    }
}
