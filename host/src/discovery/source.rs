//! Where worker records come from: the [`Discovery`] trait and the two
//! sources that ship with selkie, [`InMemoryDiscovery`] and [`FileDiscovery`].
//!
//! A source reports whole snapshots; the registry works out what was added,
//! updated and removed ([`crate::WorkerSelectionService::sync`]). Sources never touch
//! the fleet themselves.
//!
//! One bad record refuses only itself (see [`Discovery`]): a source leaves
//! it out of its snapshot and reports it beside it, so that no record,
//! however often rewritten, holds back a change to another worker.

use std::collections::{BTreeMap, HashMap};
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
/// # One bad record refuses only itself
///
/// A source that reads many records from one place (a file, an etcd
/// prefix) refuses a bad record on its own: the snapshot it delivers holds
/// every good record, plus, for the worker of each refused record, the last
/// good record the source delivered for it (or nothing, if it had none),
/// and the refusal is handed out once through
/// [`take_refused`](Discovery::take_refused), naming the record's key or
/// file and worker; [`crate::WorkerSelectionService::refresh`] takes them
/// after every `poll` it applies. A refused record never makes `poll`
/// fail, so a bad record, however often it is rewritten and however many
/// there are, never holds back a change to another worker. A snapshot
/// still applies whole or not at all: what the service refuses is a
/// snapshot that does not fit the fleet, which no single record decides.
///
/// # Refused snapshots
///
/// A snapshot the service refuses (an invalid record from a source that
/// does not check its records, a fleet too small for it) changes nothing. [`crate::WorkerSelectionService::refresh`] keeps it
/// and tries it again whenever a later `poll` reports no change, until it
/// applies (once bookings that held rows have ended, say) or the source
/// delivers a newer snapshot; so a source never has to deliver a snapshot
/// twice. It is also told, through
/// [`snapshot_refused`](Discovery::snapshot_refused) (the built-in sources
/// then re-read their input on the next `poll`).
pub trait Discovery: Send {
    /// The current workers if they may have changed since the last call.
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError>;

    /// The records refused since the last call, each once, each error
    /// naming the record's key or file and, where known, its worker. The
    /// snapshots `poll` delivers leave them out (their workers keep their
    /// last good records). The default refuses nothing.
    fn take_refused(&mut self) -> Vec<DiscoveryError> {
        Vec::new()
    }

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

/// One record of a discovery file, before it is taken: the worker it
/// names, the line it starts on, and the record or why it does not parse.
pub(crate) struct FileRecord {
    worker_id: WorkerId,
    line: usize,
    parsed: Result<WorkerRecord, String>,
}

/// A JSON discovery file as the table form (see [`FileDiscovery`] for the
/// format), its records still raw.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonFile<'a> {
    #[serde(borrow)]
    workers: Option<Vec<&'a serde_json::value::RawValue>>,
}

/// A TOML discovery file, its records still tables (with where they start).
#[cfg(feature = "toml")]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlFile {
    workers: Option<Vec<toml::Spanned<toml::Table>>>,
}

/// The worker id alone, read before the rest of a JSON record.
#[derive(Deserialize)]
struct NamesWorker {
    worker_id: WorkerId,
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    1 + text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

/// Parses a discovery file's text into its records; `toml` picks the format.
///
/// The file as a whole must parse (a syntax error, a missing `workers`
/// list or a record that does not name its worker with an integer
/// `worker_id` refuses the file); each record is then parsed on its own, so
/// that one bad record is refused alone. JSON takes the shape the text
/// starts with: a bare list (`[`) or the `workers` table (anything else).
/// Errors name the line.
pub(crate) fn parse_workers(text: &str, toml: bool, path: &Path) -> Result<Vec<FileRecord>, DiscoveryError> {
    let err = |message: String| DiscoveryError::Parse {
        path: path.to_owned(),
        message,
    };
    let empty = || DiscoveryError::EmptyFile { path: path.to_owned() };
    if toml {
        #[cfg(feature = "toml")]
        return parse_toml_workers(text, path);
        #[cfg(not(feature = "toml"))]
        return Err(DiscoveryError::FormatNotBuilt {
            path: path.to_owned(),
            format: "TOML",
            feature: "toml",
        });
    }
    let raw = match text.trim_start_matches([' ', '\t', '\n', '\r']).as_bytes().first() {
        None => return Err(empty()),
        Some(b'[') => {
            serde_json::from_str::<Vec<&serde_json::value::RawValue>>(text).map_err(|e| err(e.to_string()))?
        }
        Some(_) => serde_json::from_str::<JsonFile>(text)
            .map_err(|e| err(e.to_string()))?
            .workers
            .ok_or_else(empty)?,
    };
    raw.into_iter()
        .map(|record| {
            // The record's text is a slice of `text`: its start is where it
            // sits in the file.
            let offset = record.get().as_ptr() as usize - text.as_ptr() as usize;
            let line = line_of(text, offset);
            // serde_json counts lines and columns from the record's start.
            let at = |e: &serde_json::Error| {
                let column = if e.line() == 1 {
                    e.column() + offset - text[..offset].rfind('\n').map_or(0, |n| n + 1)
                } else {
                    e.column()
                };
                let message = e.to_string();
                let bare = message
                    .strip_suffix(&format!(" at line {} column {}", e.line(), e.column()))
                    .unwrap_or(&message);
                format!("{bare} at line {} column {column}", line + e.line() - 1)
            };
            let worker_id = serde_json::from_str::<NamesWorker>(record.get())
                .map_err(|e| {
                    err(format!(
                        "the record at line {line} names no worker (an integer `worker_id`): {}",
                        at(&e)
                    ))
                })?
                .worker_id;
            let parsed = serde_json::from_str::<WorkerRecord>(record.get()).map_err(|e| at(&e));
            Ok(FileRecord {
                worker_id,
                line,
                parsed,
            })
        })
        .collect()
}

/// A TOML discovery file's records (see [`parse_workers`]).
#[cfg(feature = "toml")]
fn parse_toml_workers(text: &str, path: &Path) -> Result<Vec<FileRecord>, DiscoveryError> {
    let err = |message: String| DiscoveryError::Parse {
        path: path.to_owned(),
        message,
    };
    let empty = || DiscoveryError::EmptyFile { path: path.to_owned() };
    let file = toml::from_str::<TomlFile>(text).map_err(|e| err(e.to_string()))?;
    file.workers
        .ok_or_else(empty)?
        .into_iter()
        .map(|spanned| {
            let line = line_of(text, spanned.span().start);
            let table = spanned.into_inner();
            let worker_id = table
                .get("worker_id")
                .and_then(toml::Value::as_integer)
                .and_then(|id| WorkerId::try_from(id).ok())
                .ok_or_else(|| {
                    err(format!(
                        "the record at line {line} names no worker (an integer `worker_id`)"
                    ))
                })?;
            let parsed = toml::Value::Table(table)
                .try_into::<WorkerRecord>()
                .map_err(|e| e.to_string());
            Ok(FileRecord {
                worker_id,
                line,
                parsed,
            })
        })
        .collect()
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
/// A single bad record is refused on its own (see [`Discovery`]): one
/// that does not parse as a worker record
/// ([`DiscoveryError::FileRecordParse`]), has a field
/// [`WorkerRecord::validate`] refuses, or shares its `worker_id` with
/// another record ([`DiscoveryError::FileRecordInvalid`]). The file's other
/// records apply, the refused record's worker keeps the record this source
/// last delivered for it (or stays absent), and
/// [`take_refused`](Discovery::take_refused) reports the refusal once per
/// version of the file. A record must name its worker (an integer
/// `worker_id`) for this: one that does not refuses the whole file, since
/// the source cannot tell which worker it was meant to keep.
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
    /// The records of the last snapshot delivered, by worker: what a
    /// refused record's worker keeps.
    delivered: BTreeMap<WorkerId, WorkerRecord>,
    /// The records refused in the last version of the file read, not yet
    /// taken.
    refused: Vec<DiscoveryError>,
}

impl FileDiscovery {
    /// The largest discovery file read (64 MiB; 16,384 workers of a few
    /// kilobytes each fit).
    pub const MAX_FILE_BYTES: u64 = 64 << 20;

    /// A source for `path`; `.toml` files are TOML, everything else JSON.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        let toml = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        FileDiscovery {
            path,
            toml,
            seen: None,
            delivered: BTreeMap::new(),
            refused: Vec::new(),
        }
    }

    /// The file this source reads.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The snapshot of a file's `records`: the good ones, in the file's
    /// order, then the last delivered record of each worker whose record
    /// was refused. Notes the refusals (replacing those of an earlier
    /// version not yet taken) and what was delivered.
    fn take_good(&mut self, records: Vec<FileRecord>) -> Vec<WorkerRecord> {
        // Records per worker id; an id's count drops to 0 once its
        // repetition is reported.
        let mut times: HashMap<WorkerId, usize> = HashMap::with_capacity(records.len());
        for r in &records {
            *times.entry(r.worker_id).or_default() += 1;
        }
        let invalid = |source| DiscoveryError::FileRecordInvalid {
            path: self.path.clone(),
            source: Box::new(source),
        };
        let mut refused = Vec::new();
        let mut kept = Vec::new();
        let mut workers = Vec::with_capacity(records.len());
        for FileRecord {
            worker_id,
            line,
            parsed,
        } in records
        {
            let count = times.get_mut(&worker_id).expect("counted above");
            let refusal = match parsed {
                _ if *count != 1 => {
                    (std::mem::take(count) > 1).then(|| invalid(DiscoveryError::DuplicateInSnapshot { worker_id }))
                }
                Err(message) => Some(DiscoveryError::FileRecordParse {
                    path: self.path.clone(),
                    worker_id,
                    line,
                    message,
                }),
                Ok(record) => match record.validate() {
                    Ok(()) => {
                        workers.push(record);
                        continue;
                    }
                    Err(e) => Some(invalid(e)),
                },
            };
            if let Some(refusal) = refusal {
                refused.push(refusal);
                kept.extend(self.delivered.get(&worker_id).cloned());
            }
        }
        workers.extend(kept);
        self.refused = refused;
        self.delivered = workers.iter().map(|r| (r.worker_id, r.clone())).collect();
        workers
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
        let records = parse_workers(&text, self.toml, &self.path)?;
        let workers = self.take_good(records);
        self.seen = Some(seen);
        Ok(Some(workers))
    }

    fn take_refused(&mut self) -> Vec<DiscoveryError> {
        std::mem::take(&mut self.refused)
    }

    fn snapshot_refused(&mut self, _: &DiscoveryError) {
        self.seen = None;
    }
}
