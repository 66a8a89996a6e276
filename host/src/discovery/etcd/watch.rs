//! The watch thread behind [`EtcdDiscovery`](super::EtcdDiscovery): list
//! the prefix, watch it from the next revision, and when the watch breaks,
//! reconnect and resume from the last revision seen (or list again when
//! that revision is gone).
//!
//! The protocol, in order:
//!
//! ```text
//! connect; get prefix -> map, rev = header.revision     (fails connect())
//! loop:
//!     watch prefix from rev + 1
//!     created, but the server's revision < rev -> history restarted: relist
//!     each event batch: put/delete into the map, rev = event's mod_revision
//!     progress notification: rev = header.revision
//!     canceled with compact_revision > 0 -> rev + 1 was compacted: relist
//!     stream error or end -> outage; wait (backoff), reconnect, loop
//! ```
//!
//! Applying an event is idempotent (a put sets a key, a delete removes it),
//! and every event after `rev` arrives once from the resumed watch, so the
//! map always equals etcd's prefix at `rev`. This module only writes the
//! shared [`WatchState`](super::WatchState); it never touches the fleet.

use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions};

use super::connect::{connect, Failure};
use super::{EtcdOptions, WatchState};

/// The first wait before reconnecting; it doubles up to the options' maximum.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

pub(super) struct Watcher {
    pub(super) endpoints: Vec<String>,
    pub(super) prefix: String,
    pub(super) options: EtcdOptions,
    pub(super) shared: Arc<Mutex<WatchState>>,
}

/// Why one watch ended.
enum WatchEnd {
    /// The revision to resume from is gone: list again.
    Relist,
    /// The connection or the stream failed.
    Broken(Failure),
}

/// The current-thread runtime the background threads run on.
pub(super) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a tokio runtime: {e}"))
}

/// Resolves once the stop sender is dropped.
pub(super) async fn stopped(mut stop: tokio::sync::watch::Receiver<()>) {
    while stop.changed().await.is_ok() {}
}

impl Watcher {
    fn state(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread's body: reports the first listing's outcome on `ready`,
    /// then watches until `stop` is dropped.
    pub(super) fn run(self, stop: tokio::sync::watch::Receiver<()>, ready: mpsc::Sender<Result<(), Failure>>) {
        let rt = match runtime() {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(e.into()));
                return;
            }
        };
        rt.block_on(async {
            tokio::select! {
                () = stopped(stop) => {}
                () = self.watch_forever(ready) => {}
            }
        });
    }

    async fn watch_forever(&self, ready: mpsc::Sender<Result<(), Failure>>) {
        let first = async {
            let mut client = connect(&self.endpoints, &self.options).await?;
            self.list(&mut client).await?;
            Ok::<_, Failure>(client)
        };
        let mut client = match first.await {
            Ok(client) => client,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        // Answered once the first watch is established: until then a
        // failure is the caller's, after it the thread's to recover from.
        let mut ready = Some(ready);
        let mut backoff = FIRST_BACKOFF;
        loop {
            let failure = match self.watch_once(&mut client, &mut backoff, &mut ready).await {
                WatchEnd::Relist => match self.list(&mut client).await {
                    Ok(()) => {
                        self.state().status.relists += 1;
                        continue;
                    }
                    Err(e) => e,
                },
                WatchEnd::Broken(e) => e,
            };
            if let Some(ready) = ready.take() {
                let _ = ready.send(Err(failure));
                return;
            }
            self.outage(failure);
            client = self.reconnect(&mut backoff).await;
        }
    }

    fn outage(&self, failure: Failure) {
        tracing::warn!(error = %failure, "etcd watch broken; reconnecting");
        let mut s = self.state();
        s.status.connected = false;
        s.outage = Some(failure.to_string());
    }

    /// Waits `backoff` (then doubles it) and connects again, until it does.
    async fn reconnect(&self, backoff: &mut Duration) -> Client {
        loop {
            tokio::time::sleep(*backoff).await;
            *backoff = (*backoff * 2).min(self.options.max_backoff.max(FIRST_BACKOFF));
            match connect(&self.endpoints, &self.options).await {
                Ok(client) => return client,
                Err(e) => self.state().outage = Some(e.to_string()),
            }
        }
    }

    /// Lists the prefix and replaces the map with it.
    async fn list(&self, client: &mut Client) -> Result<(), Failure> {
        let get = client.get(self.prefix.as_str(), Some(GetOptions::new().with_prefix()));
        let response = match tokio::time::timeout(self.options.timeout, get).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Err(Failure::etcd(format_args!("cannot list {:?}", self.prefix), &e)),
            Err(_) => return Err(format!("cannot list {:?} within {:?}", self.prefix, self.options.timeout).into()),
        };
        let revision = response.header().map_or(0, |h| h.revision());
        let kvs = response
            .kvs()
            .iter()
            .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.value().to_vec()))
            .collect();
        let mut s = self.state();
        s.replace(kvs);
        s.status.revision = revision;
        Ok(())
    }

    /// One watch from the revision after the map's, until it ends.
    async fn watch_once(
        &self,
        client: &mut Client,
        backoff: &mut Duration,
        ready: &mut Option<mpsc::Sender<Result<(), Failure>>>,
    ) -> WatchEnd {
        let from = self.state().status.revision;
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(from + 1)
            .with_progress_notify();
        let mut stream =
            match tokio::time::timeout(self.options.timeout, client.watch(self.prefix.as_str(), Some(options))).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    return WatchEnd::Broken(Failure::etcd(format_args!("cannot watch {:?}", self.prefix), &e))
                }
                Err(_) => {
                    return WatchEnd::Broken(
                        format!("cannot watch {:?} within {:?}", self.prefix, self.options.timeout).into(),
                    )
                }
            };
        loop {
            let response = match stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) => return WatchEnd::Broken("the watch stream ended".to_owned().into()),
                Err(e) => return WatchEnd::Broken(Failure::etcd("the watch stream failed", &e)),
            };
            if response.canceled() {
                if response.compact_revision() > 0 {
                    tracing::info!(
                        from = from + 1,
                        compacted = response.compact_revision(),
                        "etcd revision to resume from was compacted; listing again"
                    );
                    return WatchEnd::Relist;
                }
                return WatchEnd::Broken(format!("the watch was canceled: {}", response.cancel_reason()).into());
            }
            let header_revision = response.header().map_or(0, |h| h.revision());
            let mut s = self.state();
            if response.created() {
                if header_revision < from {
                    tracing::info!(
                        seen = from,
                        server = header_revision,
                        "etcd's revision is behind the one seen (history restarted); listing again"
                    );
                    return WatchEnd::Relist;
                }
                if s.outage.take().is_some() {
                    s.status.reconnects += 1;
                    tracing::info!(from = from + 1, "etcd watch resumed");
                }
                s.status.connected = true;
                *backoff = FIRST_BACKOFF;
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Ok(()));
                }
                continue;
            }
            if response.events().is_empty() {
                // A progress notification: everything up to the header's
                // revision has been delivered.
                s.status.revision = s.status.revision.max(header_revision);
                continue;
            }
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key());
                match event.event_type() {
                    EventType::Put => s.put(&key, kv.value()),
                    EventType::Delete => s.delete(&key),
                }
                s.status.revision = s.status.revision.max(kv.mod_revision());
            }
        }
    }
}
