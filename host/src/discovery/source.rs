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
///
/// A snapshot the service refuses (an invalid record, a fleet too small for
/// it) changes nothing. [`crate::WorkerSelectionService::refresh`] keeps it
/// and tries it again whenever a later `poll` reports no change, until it
/// applies (once bookings that held rows have ended, say) or the source
/// delivers a newer snapshot; so a source never has to deliver a snapshot
/// twice. It is also told, through
/// [`snapshot_refused`](Discovery::snapshot_refused) (the built-in sources
/// then re-read their input on the next `poll`).
pub trait Discovery: Send {
    /// The current workers if they may have changed since the last call.
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError>;

    /// The snapshot returned by the last `poll` was refused with `error`.
    /// The service retries it by itself; a source may use this to log, or
    /// to re-read its input on the next `poll`. The default does nothing.
    fn snapshot_refused(&mut self, error: &DiscoveryError) {
        let _ = error;
    }
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

    fn snapshot_refused(&mut self, _: &DiscoveryError) {
        self.seen = None;
    }
}

/// A discovery file as the table form (see [`FileDiscovery`] for the format).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerFile {
    workers: Option<Vec<WorkerRecord>>,
}

/// Parses a discovery file's text; `toml` picks the format.
///
/// JSON takes the shape the text starts with: a bare list (`[`) or the
/// `workers` table (anything else), so a bad record's error names its field
/// and line in either shape.
pub(crate) fn parse_workers(text: &str, toml: bool, path: &Path) -> Result<Vec<WorkerRecord>, DiscoveryError> {
    let err = |message: String| DiscoveryError::Parse {
        path: path.to_owned(),
        message,
    };
    let empty = || DiscoveryError::EmptyFile { path: path.to_owned() };
    let file = if toml {
        toml::from_str::<WorkerFile>(text).map_err(|e| err(e.to_string()))?
    } else {
        match text.trim_start_matches([' ', '\t', '\n', '\r']).as_bytes().first() {
            None => return Err(empty()),
            Some(b'[') => {
                return serde_json::from_str::<Vec<WorkerRecord>>(text).map_err(|e| err(e.to_string()));
            }
            Some(_) => serde_json::from_str::<WorkerFile>(text).map_err(|e| err(e.to_string()))?,
        }
    };
    file.workers.ok_or_else(empty)
}

/// FNV-1a over `bytes`: a fixed, seedless hash, so a file's content can be
/// compared with what was read before without keeping a copy.
fn content_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What [`FileDiscovery`] last delivered: the file's metadata and a hash of
/// its bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Seen {
    modified: SystemTime,
    len: u64,
    hash: u64,
}

/// A discovery source backed by a JSON or TOML file, re-read when it
/// changes.
///
/// Polling is the caller's (or [`crate::DiscoveryPoller`]'s) job: `poll`
/// checks the file's modification time and length, and when both are as
/// before, its content's hash (a rewrite that keeps both, as `cp -p`,
/// `rsync -t` or a coarse-mtime filesystem can produce, is still seen). A
/// file that fails to parse, lists no workers (see the format below) or is
/// over [`FileDiscovery::MAX_FILE_BYTES`] is reported as an error and the
/// previous workers stay in force; so does a snapshot the service refuses,
/// which the next poll delivers again. Write the file atomically (write a
/// temporary file, then rename) so a poll never sees half a file.
///
/// The file format: a list of workers under `workers`. JSON (`.json`, or
/// any other extension):
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
/// A file without the `workers` list (empty, truncated, `{}`) is refused
/// with [`DiscoveryError::EmptyFile`], so that a truncated file does not
/// remove every worker; a fleet with no workers is written explicitly:
/// `workers = []`, `{"workers": []}` or `[]`.
pub struct FileDiscovery {
    path: PathBuf,
    toml: bool,
    seen: Option<Seen>,
}

impl FileDiscovery {
    /// The largest discovery file read (64 MiB; 16,384 workers of a few
    /// kilobytes each fit).
    pub const MAX_FILE_BYTES: u64 = 64 << 20;

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
        let (modified, len) = (meta.modified().map_err(io)?, meta.len());
        if len > Self::MAX_FILE_BYTES {
            return Err(DiscoveryError::FileTooLarge {
                path: self.path.clone(),
                len,
                limit: Self::MAX_FILE_BYTES,
            });
        }
        // Read at most one byte past the limit: the file may have grown
        // since its metadata was read.
        let mut bytes = Vec::with_capacity(len.min(Self::MAX_FILE_BYTES) as usize);
        std::io::Read::read_to_end(
            &mut std::io::Read::take(std::fs::File::open(&self.path).map_err(io)?, Self::MAX_FILE_BYTES + 1),
            &mut bytes,
        )
        .map_err(io)?;
        if bytes.len() as u64 > Self::MAX_FILE_BYTES {
            return Err(DiscoveryError::FileTooLarge {
                path: self.path.clone(),
                len: bytes.len() as u64,
                limit: Self::MAX_FILE_BYTES,
            });
        }
        let seen = Seen {
            modified,
            len,
            hash: content_hash(&bytes),
        };
        if self.seen == Some(seen) {
            return Ok(None);
        }
        let text = String::from_utf8(bytes).map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        let workers = parse_workers(&text, self.toml, &self.path)?;
        self.seen = Some(seen);
        Ok(Some(workers))
    }

    fn snapshot_refused(&mut self, _: &DiscoveryError) {
        self.seen = None;
    }
}
