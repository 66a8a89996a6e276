//! The worker's side of etcd discovery: [`EtcdRegistration`] puts one
//! worker's record at `prefix + worker_id` under a lease and keeps the
//! lease alive on a background thread.
//!
//! It writes only its own key, and only through its lease; it never reads
//! the prefix (that is [`EtcdDiscovery`](super::EtcdDiscovery)'s job).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use tokio::sync::mpsc as async_mpsc;

use super::connect::{connect, Failure};
use super::watch::runtime;
use super::{record_key, EtcdOptions};
use crate::discovery::record::WorkerRecord;
use crate::error::DiscoveryError;

/// What the owner asks of the lease thread.
enum Command {
    /// Put a new record (same worker id) under the lease.
    Update(WorkerRecord, mpsc::Sender<Result<(), Failure>>),
    /// Revoke the lease (deleting the key) and stop.
    Revoke(mpsc::Sender<Result<(), Failure>>),
    /// Stop renewing the lease and leave the key to expire.
    Abandon,
}

/// One worker's record in etcd, kept alive by a lease (feature `etcd`).
///
/// [`register`](Self::register) grants a lease with the given TTL, puts the
/// record as JSON (the discovery file's record format) at
/// `prefix + worker_id`, and renews the lease every third of its TTL on a
/// background thread. If the lease is lost anyway (etcd unreachable for
/// longer than the TTL), the thread grants a new one and puts the record
/// again as soon as etcd answers. [`revoke`](Self::revoke), or dropping the
/// registration, revokes the lease, which deletes the key at once (dropping
/// waits up to the request timeout for that); a worker that dies without
/// either is removed when its TTL runs out, as
/// [`abandon`](Self::abandon) shows.
///
/// ```no_run
/// # // no_run: needs a running etcd.
/// use std::time::Duration;
/// use selkie::*;
/// let record = WorkerRecord::new(7).with_dp(0, 2).with_taint("gpu=h200");
/// let registration = EtcdRegistration::register(&["http://127.0.0.1:2379"], "/selkie/workers/", record, Duration::from_secs(10))?;
/// assert_eq!(registration.key(), "/selkie/workers/7");
/// registration.update(WorkerRecord::new(7).with_dp(0, 2).with_state(WorkerState::Draining))?;
/// registration.revoke()?;
/// # Ok::<(), DiscoveryError>(())
/// ```
pub struct EtcdRegistration {
    key: String,
    worker_id: crate::types::WorkerId,
    endpoints: String,
    timeout: Duration,
    commands: async_mpsc::UnboundedSender<Command>,
    thread: Option<JoinHandle<()>>,
}

/// The lease thread's view: the client, the record, and the lease while it
/// holds one.
struct LeaseHolder {
    client: Client,
    key: String,
    record: WorkerRecord,
    ttl: i64,
    timeout: Duration,
    lease: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

impl LeaseHolder {
    async fn timed<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Failure::etcd(what, &e)),
            Err(_) => Err(format!("{what}: no answer within {:?}", self.timeout).into()),
        }
    }

    fn value(&self) -> Vec<u8> {
        serde_json::to_vec(&self.record).expect("a WorkerRecord serialises to JSON")
    }

    /// Grants a lease, puts the record under it and opens its keep-alive.
    async fn acquire(&mut self) -> Result<(), Failure> {
        let mut client = self.client.clone();
        let grant = self
            .timed("cannot grant a lease", client.lease_grant(self.ttl, None))
            .await?;
        let options = PutOptions::new().with_lease(grant.id());
        let value = self.value();
        self.timed(
            "cannot put the record",
            client.put(self.key.as_str(), value, Some(options)),
        )
        .await?;
        let kept = self
            .timed("cannot keep the lease alive", client.lease_keep_alive(grant.id()))
            .await?;
        self.lease = Some(kept);
        Ok(())
    }

    /// Renews the lease once; on failure forgets it (the next renewal
    /// acquires a new one).
    async fn renew(&mut self) {
        let outcome = match self.lease.as_mut() {
            None => return self.acquire_logged().await,
            Some((keeper, stream)) => {
                let timeout = self.timeout;
                let sent = keeper.keep_alive().await;
                match (sent, tokio::time::timeout(timeout, stream.message()).await) {
                    (Ok(()), Ok(Ok(Some(r)))) if r.ttl() > 0 => Ok(()),
                    (Ok(()), Ok(Ok(Some(_)))) => Err("the lease expired".to_owned()),
                    (Err(e), _) | (_, Ok(Err(e))) => Err(e.to_string()),
                    (_, Ok(Ok(None))) => Err("the keep-alive stream ended".to_owned()),
                    (_, Err(_)) => Err(format!("no keep-alive answer within {timeout:?}")),
                }
            }
        };
        if let Err(e) = outcome {
            tracing::warn!(key = %self.key, error = %e, "etcd lease lost; registering again");
            self.lease = None;
            self.acquire_logged().await;
        }
    }

    async fn acquire_logged(&mut self) {
        if let Err(e) = self.acquire().await {
            tracing::warn!(key = %self.key, error = %e, "cannot register the worker in etcd; retrying");
        }
    }

    async fn update(&mut self, record: WorkerRecord) -> Result<(), Failure> {
        self.record = record;
        let Some((keeper, _)) = &self.lease else {
            // Put by the next successful renewal, under a new lease.
            return Err(
                "no lease is held now (etcd unreachable?); the record is put once one is"
                    .to_owned()
                    .into(),
            );
        };
        let options = PutOptions::new().with_lease(keeper.id());
        let (mut client, value) = (self.client.clone(), self.value());
        self.timed(
            "cannot put the record",
            client.put(self.key.as_str(), value, Some(options)),
        )
        .await
        .map(drop)
    }

    async fn revoke(&mut self) -> Result<(), Failure> {
        let Some((keeper, _)) = self.lease.take() else {
            return Ok(());
        };
        let mut client = self.client.clone();
        self.timed("cannot revoke the lease", client.lease_revoke(keeper.id()))
            .await
            .map(drop)
    }

    /// Serves commands and renews the lease until revoked, abandoned or
    /// dropped (dropping revokes).
    async fn serve(mut self, mut commands: async_mpsc::UnboundedReceiver<Command>, renew_every: Duration) {
        let mut tick = tokio::time::interval(renew_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // the first tick is immediate; the lease is fresh
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Update(record, reply)) => {
                        let _ = reply.send(self.update(record).await);
                    }
                    Some(Command::Revoke(reply)) => {
                        let _ = reply.send(self.revoke().await);
                        return;
                    }
                    Some(Command::Abandon) => return,
                    None => {
                        if let Err(e) = self.revoke().await {
                            tracing::warn!(key = %self.key, error = %e, "etcd lease not revoked on drop; it expires after its TTL");
                        }
                        return;
                    }
                },
                _ = tick.tick() => self.renew().await,
            }
        }
    }
}

impl EtcdRegistration {
    /// Registers `record` at `prefix + record.worker_id` under a lease of
    /// `ttl` (whole seconds, at least 1; etcd may grant more), with the
    /// default [`EtcdOptions`]. Fails if the record is invalid
    /// ([`WorkerRecord::validate`]) or etcd cannot be reached.
    pub fn register(
        endpoints: &[impl AsRef<str>],
        prefix: &str,
        record: WorkerRecord,
        ttl: Duration,
    ) -> Result<Self, DiscoveryError> {
        Self::register_with(endpoints, prefix, record, ttl, EtcdOptions::default())
    }

    /// [`register`](Self::register) with the given timeouts, credentials
    /// and TLS files; fails as [`EtcdDiscovery::connect_with`](super::EtcdDiscovery::connect_with)
    /// does for a file it cannot use or a refusal.
    pub fn register_with(
        endpoints: &[impl AsRef<str>],
        prefix: &str,
        record: WorkerRecord,
        ttl: Duration,
        options: EtcdOptions,
    ) -> Result<Self, DiscoveryError> {
        record.validate()?;
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.as_ref().to_owned()).collect();
        options.security.check(&endpoints)?;
        let tls = options.security.uses_tls(&endpoints);
        let joined = endpoints.join(",");
        let unavailable = |message: String| DiscoveryError::EtcdUnavailable {
            endpoints: joined.clone(),
            message,
        };
        let key = record_key(prefix, record.worker_id);
        let worker_id = record.worker_id;
        let ttl_secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let timeout = options.timeout;
        let (commands, receiver) = async_mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Failure>>();
        let thread_key = key.clone();
        let thread = std::thread::Builder::new()
            .name("selkie-etcd-lease".into())
            .spawn(move || {
                let rt = match runtime() {
                    Ok(rt) => rt,
                    Err(e) => return drop(ready_tx.send(Err(e.into()))),
                };
                rt.block_on(async move {
                    let client = match connect(&endpoints, &options).await {
                        Ok(c) => c,
                        Err(e) => return drop(ready_tx.send(Err(e))),
                    };
                    let mut holder = LeaseHolder {
                        client,
                        key: thread_key,
                        record,
                        ttl: ttl_secs,
                        timeout,
                        lease: None,
                    };
                    if let Err(e) = holder.acquire().await {
                        return drop(ready_tx.send(Err(e)));
                    }
                    let _ = ready_tx.send(Ok(()));
                    let renew_every = Duration::from_millis((ttl_secs as u64).saturating_mul(1000) / 3)
                        .max(Duration::from_millis(200));
                    holder.serve(receiver, renew_every).await;
                });
            })
            .map_err(|e| unavailable(format!("cannot start the lease thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(EtcdRegistration {
                key,
                worker_id,
                endpoints: joined,
                timeout,
                commands,
                thread: Some(thread),
            }),
            Ok(Err(failure)) => {
                let _ = thread.join();
                Err(failure.into_start_error(&joined, tls))
            }
            Err(_) => {
                let _ = thread.join();
                Err(unavailable("the lease thread stopped before registering".into()))
            }
        }
    }

    /// The key the record is stored at.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Replaces the stored record (same worker id, under the same lease).
    pub fn update(&self, record: WorkerRecord) -> Result<(), DiscoveryError> {
        if record.worker_id != self.worker_id {
            return Err(DiscoveryError::EtcdKeyMismatch {
                key: self.key.clone(),
                worker_id: record.worker_id,
            });
        }
        record.validate()?;
        let (reply, answer) = mpsc::channel();
        self.ask(Command::Update(record, reply))?;
        self.answer(answer)
    }

    /// Revokes the lease, which deletes the record at once, and stops.
    pub fn revoke(mut self) -> Result<(), DiscoveryError> {
        let (reply, answer) = mpsc::channel();
        self.ask(Command::Revoke(reply))?;
        let outcome = self.answer(answer);
        self.join();
        outcome
    }

    /// Stops renewing the lease without revoking it: the record stays until
    /// the lease's TTL runs out, as a worker's does when its process dies.
    pub fn abandon(mut self) {
        let _ = self.commands.send(Command::Abandon);
        self.join();
    }

    fn ask(&self, command: Command) -> Result<(), DiscoveryError> {
        self.commands.send(command).map_err(|_| self.stopped())
    }

    fn answer(&self, answer: mpsc::Receiver<Result<(), Failure>>) -> Result<(), DiscoveryError> {
        // The thread bounds each request by the timeout; the extra second
        // covers its own scheduling.
        match answer.recv_timeout(self.timeout + Duration::from_secs(1)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(failure)) => Err(failure.into_error(&self.endpoints)),
            Err(_) => Err(self.stopped()),
        }
    }

    fn stopped(&self) -> DiscoveryError {
        DiscoveryError::EtcdUnavailable {
            endpoints: self.endpoints.clone(),
            message: format!("the lease thread for {:?} stopped", self.key),
        }
    }

    fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EtcdRegistration {
    /// Revokes the lease (the thread does, when the command channel
    /// closes) and waits for the thread.
    fn drop(&mut self) {
        let (closed, _) = async_mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.commands, closed));
        self.join();
    }
}
