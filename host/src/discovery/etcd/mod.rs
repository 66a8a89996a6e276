//! Discovery from etcd (feature `etcd`): [`EtcdDiscovery`] watches a key
//! prefix, [`EtcdRegistration`] keeps one worker's record there under a
//! lease.
//!
//! A worker's record sits at `prefix + worker_id` (the id in decimal), as
//! the same JSON a discovery file's records use, attached to a lease that
//! the worker keeps alive: a worker that stops (or loses etcd for longer
//! than its lease's TTL) is removed when the lease expires.
//!
//! The source keeps a map key -> record on a background thread (its own
//! current-thread tokio runtime): an initial `get` of the prefix, then a
//! watch from the revision after it. A watch that breaks (a server
//! restart, a lost connection) is resumed from the last revision seen, so
//! the changes made meanwhile arrive in order, once each; if that revision
//! has been compacted away the prefix is listed again and the map replaced
//! whole. Either way the map holds what etcd holds, and `poll` hands out
//! whole snapshots of it, so a change is never lost or applied twice.
//!
//! What it must not do: touch the fleet (snapshots go through
//! [`crate::WorkerSelectionService::refresh`] like every source's), or
//! block `poll` on the network (`poll` only reads the map).
//!
//! # Connecting to a secured etcd
//!
//! Whoever can write under the prefix decides which workers are in the
//! fleet. Run etcd with authentication, give the routers a user that may
//! read the prefix and each worker one that may write it (etcd's roles
//! grant permissions per key range), and use TLS where the network is not
//! trusted. [`EtcdOptions`] takes what etcd asks for, for
//! [`EtcdDiscovery::connect_with`] and [`EtcdRegistration::register_with`]
//! alike:
//!
//! | option | etcd side | what it does |
//! |---|---|---|
//! | `with_user_and_password(user, password)` | `etcdctl user add`, `auth enable` | gets a token with them on connecting, and a new one when it expires |
//! | `with_tls_ca_file(path)` | `--cert-file`, `--key-file` | trusts the CAs in the PEM file (not the system's) for etcd's certificate |
//! | `with_client_certificate(cert, key)` | `--client-cert-auth`, `--trusted-ca-file` | presents the PEM certificate chain and key |
//!
//! TLS is used for `https://` endpoints (checked against the system's CAs
//! unless a CA file is set); a TLS file with an `http://` endpoint, or a
//! user and password inside an endpoint, is refused. `connect_with` and
//! `register_with` read and check every file first: one that cannot be
//! read, or does not hold PEM certificates or a PEM private key, is a
//! [`DiscoveryError::EtcdCredentials`] naming the option and the file.
//! etcd refusing the client (a wrong user or password, none while auth is
//! on, a user without permission on the prefix or the worker's key) fails
//! them at once with [`DiscoveryError::EtcdAuthenticationFailed`]; a
//! failed TLS handshake (etcd's certificate signed by no trusted CA, a
//! client certificate refused or missing) with [`DiscoveryError::EtcdTls`].
//! etcd ends the TLS connection of a client whose certificate it refuses
//! right after the handshake, and whether the client reads why before its
//! first request meets the closed connection is a race: with TLS, a
//! connection closed under that first request is reported as `EtcdTls`
//! too. After connecting, a refusal is an outage like a lost etcd (`poll`
//! reports it, the watch retries). Certificates and keys are read again on
//! each connection, so replaced files take effect at the next
//! reconnection.
//!
//! The password never appears in `Debug` output, logs or errors (the
//! options print `"***"` for it).
//!
//! ```no_run
//! # // no_run: needs an etcd with TLS and auth.
//! use selkie::*;
//! let options = EtcdOptions::default()
//!     .with_user_and_password("router", "router-password")
//!     .with_tls_ca_file("/etc/selkie/etcd-ca.pem")
//!     .with_client_certificate("/etc/selkie/router.pem", "/etc/selkie/router-key.pem");
//! let source = EtcdDiscovery::connect_with(&["https://etcd.internal:2379"], "/selkie/workers/", options.clone())?;
//! let registration = EtcdRegistration::register_with(
//!     &["https://etcd.internal:2379"],
//!     "/selkie/workers/",
//!     WorkerRecord::new(7),
//!     std::time::Duration::from_secs(10),
//!     options,
//! )?;
//! # Ok::<(), DiscoveryError>(())
//! ```
//!
//! The options and the refusals are in `connect`.

mod connect;
mod registration;
mod watch;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

pub use registration::EtcdRegistration;

use super::record::WorkerRecord;
use super::source::Discovery;
use crate::error::DiscoveryError;
use crate::types::WorkerId;

/// Timeouts, reconnection pacing, credentials and TLS for
/// [`EtcdDiscovery`] and [`EtcdRegistration`].
///
/// ```
/// use std::time::Duration;
/// let options = selkie::EtcdOptions::default()
///     .with_timeout(Duration::from_secs(2))
///     .with_max_backoff(Duration::from_secs(1));
/// assert_eq!(options.timeout(), Duration::from_secs(2));
/// ```
///
/// For a secured etcd: [`with_user_and_password`](Self::with_user_and_password),
/// [`with_tls_ca_file`](Self::with_tls_ca_file) and
/// [`with_client_certificate`](Self::with_client_certificate), with
/// `https://` endpoints for TLS. The password does not show in `Debug`:
///
/// ```
/// let options = selkie::EtcdOptions::default().with_user_and_password("router", "hunter2");
/// assert!(!format!("{options:?}").contains("hunter2"));
/// ```
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    timeout: Duration,
    max_backoff: Duration,
    /// User, password and TLS (`connect`).
    security: connect::EtcdSecurity,
}

impl Default for EtcdOptions {
    /// 5 s per request, reconnection attempts at most 2 s apart.
    fn default() -> Self {
        EtcdOptions {
            timeout: Duration::from_secs(5),
            max_backoff: Duration::from_secs(2),
            security: connect::EtcdSecurity::default(),
        }
    }
}

impl EtcdOptions {
    /// The longest a connection attempt or one request may take.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The longest wait between reconnection attempts (they start at 50 ms
    /// and double up to this).
    pub fn with_max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// See [`with_timeout`](Self::with_timeout).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// See [`with_max_backoff`](Self::with_max_backoff).
    pub fn max_backoff(&self) -> Duration {
        self.max_backoff
    }
}

/// Where an [`EtcdDiscovery`]'s watch stands (see [`EtcdDiscovery::status`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdWatchStatus {
    /// The etcd revision the map reflects.
    pub revision: i64,
    /// Whether the watch is established now.
    pub connected: bool,
    /// Times the watch broke and was established again.
    pub reconnects: u64,
    /// Times the prefix was listed again because the revision to resume
    /// from had been compacted (or the server's history restarted).
    pub relists: u64,
}

/// Parses the record stored at `key` (under `prefix`): JSON in the
/// discovery file's record format, valid, and at its own key.
pub(crate) fn parse_record(prefix: &str, key: &str, value: &[u8]) -> Result<WorkerRecord, DiscoveryError> {
    let record: WorkerRecord = serde_json::from_slice(value).map_err(|e| DiscoveryError::EtcdRecordParse {
        key: key.to_owned(),
        message: e.to_string(),
    })?;
    if key.strip_prefix(prefix) != Some(record.worker_id.to_string().as_str()) {
        return Err(DiscoveryError::EtcdKeyMismatch {
            key: key.to_owned(),
            worker_id: record.worker_id,
        });
    }
    record.validate().map_err(|e| DiscoveryError::EtcdRecordInvalid {
        key: key.to_owned(),
        source: Box::new(e),
    })?;
    Ok(record)
}

/// The key of `worker_id`'s record under `prefix`.
pub(crate) fn record_key(prefix: &str, worker_id: WorkerId) -> String {
    format!("{prefix}{worker_id}")
}

/// What the watch thread shares with [`EtcdDiscovery::poll`].
#[derive(Default)]
pub(crate) struct WatchState {
    prefix: String,
    /// Bumped whenever `workers` changes.
    version: u64,
    /// The good records, by key.
    workers: BTreeMap<String, WorkerRecord>,
    /// Keys whose latest value was refused, with why; each is taken by
    /// one `take_refused` and withdrawn if the key gets a good value or is
    /// deleted first. At most one per key under the prefix.
    refused: BTreeMap<String, DiscoveryError>,
    /// Why the watch is down, while it is.
    outage: Option<String>,
    status: EtcdWatchStatus,
}

impl WatchState {
    /// A value was put at `key`: take it if it is a good record; otherwise
    /// keep the key's last good record (if any) and note the refusal.
    fn put(&mut self, key: &str, value: &[u8]) {
        match parse_record(&self.prefix, key, value) {
            Ok(record) => {
                self.refused.remove(key);
                if self.workers.get(key) != Some(&record) {
                    self.workers.insert(key.to_owned(), record);
                    self.version += 1;
                }
            }
            Err(e) => {
                tracing::debug!(key, error = %e, "etcd worker record refused; the key keeps its last good record");
                self.refused.insert(key.to_owned(), e);
            }
        }
    }

    /// `key` was deleted (or its lease expired).
    fn delete(&mut self, key: &str) {
        self.refused.remove(key);
        if self.workers.remove(key).is_some() {
            self.version += 1;
        }
    }

    /// Replaces everything with a fresh listing (`kvs` are key, value).
    fn replace(&mut self, kvs: Vec<(String, Vec<u8>)>) {
        let listed: std::collections::BTreeSet<&str> = kvs.iter().map(|(k, _)| k.as_str()).collect();
        let gone: Vec<String> = self
            .workers
            .keys()
            .chain(self.refused.keys())
            .filter(|k| !listed.contains(k.as_str()))
            .cloned()
            .collect();
        for key in gone {
            self.delete(&key);
        }
        for (key, value) in &kvs {
            self.put(key, value);
        }
    }
}

/// A [`Discovery`] source that watches a key prefix in etcd (feature
/// `etcd`).
///
/// Each key `prefix + worker_id` holds one worker's record as JSON (the
/// same fields and format as a [`FileDiscovery`](crate::FileDiscovery)
/// record), normally under the worker's lease
/// ([`EtcdRegistration`]): the worker is in the fleet while its key
/// exists, and leaves it when the key is deleted or its lease expires.
///
/// [`connect`](Self::connect) lists the prefix and starts the watch before
/// it returns, so the first `poll` delivers the fleet as etcd holds it; later polls deliver a
/// new snapshot whenever a record was added, changed or removed, and never
/// wait on the network. The watch runs on a thread of its own; when it
/// breaks it reconnects with backoff and resumes from the last revision it
/// saw (listing the prefix again if that revision was compacted), so no
/// change is lost or applied twice. While it is down, `poll` returns
/// [`DiscoveryError::EtcdUnavailable`] (after any change it still has to
/// deliver) and the fleet stays as it was.
///
/// A bad record (not JSON a [`WorkerRecord`] parses from, a field
/// [`WorkerRecord::validate`] refuses, or a key that is not the prefix
/// followed by the record's `worker_id`) is refused on its own: its key
/// keeps its last good record (or stays absent if it had none), every
/// other change is delivered by the same `poll` as if the key were not
/// there, and [`take_refused`](Discovery::take_refused) reports it once as
/// [`DiscoveryError::EtcdRecordParse`], [`DiscoveryError::EtcdRecordInvalid`]
/// or [`DiscoveryError::EtcdKeyMismatch`], naming the key (all refused keys
/// at once, however many). A good value at that key (or its deletion)
/// takes effect as usual, and withdraws the report if it was not taken
/// yet. A key rewritten with bad values, however often, so never holds
/// back a change to another key.
///
/// ```no_run
/// # // no_run: needs a running etcd.
/// use std::{sync::Arc, time::Duration};
/// use selkie::*;
/// let service = Arc::new(WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default()));
/// let source = EtcdDiscovery::connect(&["http://127.0.0.1:2379"], "/selkie/workers/")?;
/// let poller = DiscoveryPoller::spawn(service.clone(), Box::new(source), Duration::from_millis(200))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct EtcdDiscovery {
    shared: Arc<Mutex<WatchState>>,
    seen: Option<u64>,
    endpoints: String,
    /// Dropping it stops the watch thread.
    stop: Option<tokio::sync::watch::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl EtcdDiscovery {
    /// Connects to `endpoints`, lists `prefix` and starts watching it, with
    /// the default [`EtcdOptions`]; returns once the watch is established.
    /// Fails if etcd cannot be reached or the listing or the watch fails; a
    /// listing with bad records succeeds (`poll` reports them).
    pub fn connect(endpoints: &[impl AsRef<str>], prefix: impl Into<String>) -> Result<Self, DiscoveryError> {
        Self::connect_with(endpoints, prefix, EtcdOptions::default())
    }

    /// [`connect`](Self::connect) with the given timeouts, backoff,
    /// credentials and TLS files. Fails, before it connects, with
    /// [`DiscoveryError::EtcdCredentials`] for a file it cannot use, and
    /// with [`DiscoveryError::EtcdAuthenticationFailed`] or
    /// [`DiscoveryError::EtcdTls`] when etcd refuses the client.
    pub fn connect_with(
        endpoints: &[impl AsRef<str>],
        prefix: impl Into<String>,
        options: EtcdOptions,
    ) -> Result<Self, DiscoveryError> {
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.as_ref().to_owned()).collect();
        options.security.check(&endpoints)?;
        let tls = options.security.uses_tls(&endpoints);
        let joined = endpoints.join(",");
        let prefix = prefix.into();
        let shared = Arc::new(Mutex::new(WatchState {
            prefix: prefix.clone(),
            ..WatchState::default()
        }));
        let (stop, stopped) = tokio::sync::watch::channel(());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let watcher = watch::Watcher {
            endpoints,
            prefix,
            options,
            shared: shared.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("selkie-etcd-watch".into())
            .spawn(move || watcher.run(stopped, ready_tx))
            .map_err(|e| unavailable(&joined, format!("cannot start the watch thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(EtcdDiscovery {
                shared,
                seen: None,
                endpoints: joined,
                stop: Some(stop),
                thread: Some(thread),
            }),
            Ok(Err(failure)) => {
                let _ = thread.join();
                Err(failure.into_start_error(&joined, tls))
            }
            Err(_) => {
                let _ = thread.join();
                Err(unavailable(&joined, "the watch thread stopped before listing".into()))
            }
        }
    }

    /// Where the watch stands: the revision, whether it is connected, how
    /// often it reconnected or listed again.
    pub fn status(&self) -> EtcdWatchStatus {
        self.lock().status.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn unavailable(endpoints: &str, message: String) -> DiscoveryError {
    DiscoveryError::EtcdUnavailable {
        endpoints: endpoints.to_owned(),
        message,
    }
}

impl Discovery for EtcdDiscovery {
    /// In order: the good records if they changed since the last snapshot
    /// delivered, the outage if the watch is down, else `None`. Refused
    /// records never fail a poll: [`take_refused`](Discovery::take_refused)
    /// hands them out.
    fn poll(&mut self) -> Result<Option<Vec<WorkerRecord>>, DiscoveryError> {
        let thread_ended = self.thread.as_ref().is_none_or(JoinHandle::is_finished);
        let s = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        if self.seen != Some(s.version) {
            self.seen = Some(s.version);
            return Ok(Some(s.workers.values().cloned().collect()));
        }
        if thread_ended {
            return Err(unavailable(&self.endpoints, "the watch thread stopped".into()));
        }
        match &s.outage {
            Some(message) => Err(unavailable(&self.endpoints, message.clone())),
            None => Ok(None),
        }
    }

    /// Every key whose latest value is refused and not yet reported, in
    /// key order, each once (a key rewritten with bad values is reported
    /// once per call that finds a new bad value there).
    fn take_refused(&mut self) -> Vec<DiscoveryError> {
        std::mem::take(&mut self.lock().refused).into_values().collect()
    }

    fn snapshot_refused(&mut self, _: &DiscoveryError) {
        self.seen = None;
    }
}

impl Drop for EtcdDiscovery {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    //! The map's rules without a server: what a put, a delete and a fresh
    //! listing do to the records and to the refusals `poll` reports.

    use super::*;

    fn state() -> WatchState {
        WatchState {
            prefix: "/w/".into(),
            ..WatchState::default()
        }
    }

    fn json(record: &WorkerRecord) -> Vec<u8> {
        serde_json::to_vec(record).unwrap()
    }

    #[test]
    fn a_record_must_parse_validate_and_sit_at_its_own_key() {
        let one = WorkerRecord::new(1).with_taint("t");
        assert_eq!(parse_record("/w/", "/w/1", &json(&one)).unwrap(), one);
        assert!(matches!(
            parse_record("/w/", "/w/1", b"{"),
            Err(DiscoveryError::EtcdRecordParse { key, .. }) if key == "/w/1"
        ));
        assert!(matches!(
            parse_record("/w/", "/w/01", &json(&one)),
            Err(DiscoveryError::EtcdKeyMismatch { worker_id: 1, .. })
        ));
        assert!(matches!(
            parse_record("/w/", "/x/1", &json(&one)),
            Err(DiscoveryError::EtcdKeyMismatch { worker_id: 1, .. })
        ));
        let invalid = parse_record("/w/", "/w/1", &json(&WorkerRecord::new(1).with_capacity_weight(0.0))).unwrap_err();
        assert!(matches!(&invalid, DiscoveryError::EtcdRecordInvalid { key, source }
            if key == "/w/1" && matches!(**source, DiscoveryError::InvalidWorker { worker_id: 1, .. })));
        assert_eq!(invalid.reason(), "etcd_record_invalid");
        assert!(
            invalid
                .to_string()
                .starts_with("etcd key \"/w/1\": worker 1: capacity_weight"),
            "{invalid}"
        );
    }

    #[test]
    fn a_refused_value_keeps_the_last_good_record_and_is_withdrawn_by_a_good_one() {
        let mut s = state();
        s.put("/w/1", &json(&WorkerRecord::new(1)));
        let v = s.version;
        s.put("/w/1", b"nonsense");
        s.put("/w/2", b"nonsense");
        assert_eq!(s.version, v, "a refusal changes no record");
        assert_eq!(s.workers.values().cloned().collect::<Vec<_>>(), [WorkerRecord::new(1)]);
        assert_eq!(s.refused.keys().collect::<Vec<_>>(), ["/w/1", "/w/2"]);
        s.put("/w/2", &json(&WorkerRecord::new(2)));
        s.delete("/w/1");
        assert!(s.refused.is_empty(), "a good value or a delete withdraws the refusal");
        assert_eq!(s.workers.values().cloned().collect::<Vec<_>>(), [WorkerRecord::new(2)]);
        let v = s.version;
        s.put("/w/2", &json(&WorkerRecord::new(2)));
        s.delete("/w/1");
        assert_eq!(
            s.version, v,
            "the same value again, or deleting an absent key, is no change"
        );
    }

    /// A source over `state` with no watch thread (`poll` reports it
    /// stopped once nothing is left to deliver).
    fn source(state: WatchState) -> EtcdDiscovery {
        EtcdDiscovery {
            shared: Arc::new(Mutex::new(state)),
            seen: None,
            endpoints: "test".into(),
            stop: None,
            thread: None,
        }
    }

    #[test]
    fn a_poll_delivers_the_good_records_whatever_is_refused() {
        let mut s = state();
        s.put("/w/1", &json(&WorkerRecord::new(1)));
        for k in 0..1_000 {
            s.put(&format!("/w/{}", 1_000 + k), b"{");
        }
        let mut source = source(s);
        assert_eq!(source.poll().unwrap(), Some(vec![WorkerRecord::new(1)]));
        let refused = source.take_refused();
        assert_eq!(refused.len(), 1_000);
        assert!(refused
            .iter()
            .zip(1_000..)
            .all(|(e, k)| matches!(e, DiscoveryError::EtcdRecordParse { key, .. } if *key == format!("/w/{k}"))));
        assert!(source.take_refused().is_empty(), "each refusal is taken once");

        // A key rewritten with bad values between every two polls, next to
        // good changes: every poll delivers the change, every take reports
        // the key once.
        for round in 2..50 {
            {
                let mut s = source.lock();
                s.put("/w/999", format!("{{\"worker_id\": 999, \"n\": {round}").as_bytes());
                s.put(&format!("/w/{round}"), &json(&WorkerRecord::new(round)));
                s.delete(&format!("/w/{}", round - 1));
            }
            let got = source.poll().unwrap().expect("a change to deliver");
            assert_eq!(got.iter().map(|r| r.worker_id).collect::<Vec<_>>(), [round]);
            let refused = source.take_refused();
            assert!(
                matches!(&refused[..], [DiscoveryError::EtcdRecordParse { key, .. }] if key == "/w/999"),
                "{refused:?}"
            );
        }
        // Nothing left: the stopped thread is reported.
        assert!(matches!(source.poll(), Err(DiscoveryError::EtcdUnavailable { .. })));
    }

    #[test]
    fn a_listing_replaces_the_map_but_keeps_a_refused_keys_last_good_record() {
        let mut s = state();
        for id in 1..=3 {
            s.put(&format!("/w/{id}"), &json(&WorkerRecord::new(id)));
        }
        s.put("/w/4", b"{");
        let two = WorkerRecord::new(2).with_taint("new");
        s.replace(vec![
            ("/w/2".into(), json(&two)),
            ("/w/3".into(), b"{".to_vec()),
            ("/w/5".into(), json(&WorkerRecord::new(5))),
        ]);
        assert_eq!(
            s.workers.values().cloned().collect::<Vec<_>>(),
            [two, WorkerRecord::new(3), WorkerRecord::new(5)]
        );
        assert_eq!(
            s.refused.keys().collect::<Vec<_>>(),
            ["/w/3"],
            "/w/4 is gone, /w/3 is refused"
        );
    }
}
