//! Where worker records come from: the [`Discovery`] trait and the two
//! sources that ship with selkie, [`InMemoryDiscovery`] and [`FileDiscovery`].
//!
//! A source reports whole snapshots; the registry works out what was added,
//! updated and removed ([`crate::WorkerSelectionService::sync`]). Sources never touch
//! the fleet themselves.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use serde::Deserialize;

use super::record::WorkerRecord;
use crate::error::DiscoveryError;
use crate::types::WorkerId;

/// A source of worker records.
///
/// `poll` returns the complete current set of workers when it may have
/// changed since the previous call, and `None` when it has certainly not. The
/// first call always returns a snapshot. A source that fails keeps its last
/// good state, so a later `poll` can succeed.
pub trait Discovery: Send {
    /// The current workers if they may have changed since the last call.
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError>;
}

#[derive(Default)]
struct Shared {
    version: u64,
    workers: Vec<WorkerRecord>,
}

/// A discovery source held in memory, changed through cloned handles.
///
/// ```
/// use selkie::{Discovery, InMemoryDiscovery, WorkerRecord};
/// let mut source = InMemoryDiscovery::new();
/// let handle = source.clone();
/// handle.upsert(WorkerRecord::new(1));
/// assert_eq!(source.poll().unwrap().unwrap().len(), 1);
/// assert!(source.poll().unwrap().is_none(), "unchanged");
/// handle.remove(1);
/// assert!(source.poll().unwrap().unwrap().is_empty());
/// ```
#[derive(Clone, Default)]
pub struct InMemoryDiscovery {
    shared: Arc<Mutex<Shared>>,
    seen: Option<u64>,
}

impl InMemoryDiscovery {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    /// A source holding `workers`.
    pub fn with_workers(workers: Vec<WorkerRecord>) -> Self {
        let s = Self::new();
        s.set(workers);
        s
    }

    fn edit(&self, f: impl FnOnce(&mut Vec<WorkerRecord>)) {
        let mut g = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut g.workers);
        g.version += 1;
    }

    /// Replaces every worker.
    pub fn set(&self, workers: Vec<WorkerRecord>) {
        self.edit(|w| *w = workers);
    }

    /// Adds a worker, or replaces the one with the same id.
    pub fn upsert(&self, worker: WorkerRecord) {
        self.edit(|w| match w.iter_mut().find(|x| x.worker_id == worker.worker_id) {
            Some(x) => *x = worker,
            None => w.push(worker),
        });
    }

    /// Removes a worker (no-op if absent).
    pub fn remove(&self, worker_id: WorkerId) {
        self.edit(|w| w.retain(|x| x.worker_id != worker_id));
    }
}

impl Discovery for InMemoryDiscovery {
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError> {
        let g = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        if self.seen == Some(g.version) {
            return Ok(None);
        }
        self.seen = Some(g.version);
        Ok(Some(g.workers.clone()))
    }
}

/// The file format: a list of workers under `workers`.
///
/// JSON (`.json`, or any other extension):
/// ```json
/// { "workers": [ { "worker_id": 1, "data_parallel_size": 2, "taints": ["gpu=h200"] } ] }
/// ```
/// A bare JSON array of workers is accepted too. TOML (`.toml`):
/// ```toml
/// [[workers]]
/// worker_id = 1
/// data_parallel_size = 2
/// taints = ["gpu=h200"]
/// ```
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerFile {
    #[serde(default)]
    workers: Vec<WorkerRecord>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum JsonWorkers {
    Table(WorkerFile),
    List(Vec<WorkerRecord>),
}

/// Parses a discovery file's text; `toml` picks the format.
pub(crate) fn parse_workers(text: &str, toml: bool, path: &Path) -> Result<Vec<WorkerRecord>, DiscoveryError> {
    let err = |message: String| DiscoveryError::Parse {
        path: path.to_owned(),
        message,
    };
    if toml {
        toml::from_str::<WorkerFile>(text)
            .map(|f| f.workers)
            .map_err(|e| err(e.to_string()))
    } else {
        match serde_json::from_str::<JsonWorkers>(text) {
            Ok(JsonWorkers::Table(f)) => Ok(f.workers),
            Ok(JsonWorkers::List(l)) => Ok(l),
            // Re-parse as the documented shape for a precise message.
            Err(_) => serde_json::from_str::<WorkerFile>(text)
                .map(|f| f.workers)
                .map_err(|e| err(e.to_string())),
        }
    }
}

/// A discovery source backed by a JSON or TOML file, re-read when its
/// modification time or length changes.
///
/// Polling is the caller's (or [`crate::DiscoveryPoller`]'s) job: `poll`
/// checks the file's metadata and reads it only when it changed. A file that
/// fails to parse is reported as an error and the previous workers stay in
/// force. Write the file atomically (write a temporary file, then rename) so
/// a poll never sees half a file.
pub struct FileDiscovery {
    path: PathBuf,
    toml: bool,
    seen: Option<(SystemTime, u64)>,
}

impl FileDiscovery {
    /// A source for `path`; `.toml` files are TOML, everything else JSON.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        let toml = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        FileDiscovery { path, toml, seen: None }
    }

    /// The file this source reads.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Discovery for FileDiscovery {
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError> {
        let io = |source| DiscoveryError::Io {
            path: self.path.clone(),
            source,
        };
        let meta = std::fs::metadata(&self.path).map_err(io)?;
        let stamp = (meta.modified().map_err(io)?, meta.len());
        if self.seen == Some(stamp) {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&self.path).map_err(io)?;
        let workers = parse_workers(&text, self.toml, &self.path)?;
        self.seen = Some(stamp);
        Ok(Some(workers))
    }
}
