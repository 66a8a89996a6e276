//! Booking sync between router replicas over NATS (feature `nats`):
//! [`ReplicaSync`] publishes this replica's load and keeps its peers',
//! per worker rank.
//!
//! Several router replicas that route to the same workers each see only
//! their own bookings. With replica sync each replica also knows the
//! others'. A replica says what it holds in one of two forms, batched by
//! count and time, and its peers sum both into one table per peer and a
//! sum per worker rank ([`ReplicaSync::remote_load`]):
//!
//! * per worker rank ([`ReplicaSync::report_load`]): "my load on this
//!   worker rank is now ...", sent when it changed. A selection service
//!   reports this way: its sync thread reads its own load from the fleet's
//!   counters every batch interval, so selecting records nothing.
//! * per booking ([`ReplicaSync::record_book`],
//!   [`record_prefill_complete`](ReplicaSync::record_prefill_complete),
//!   [`record_release`](ReplicaSync::record_release)), as Dynamo's
//!   `AddRequest` / `MarkPrefillCompleted` / `Free` are: for a router that
//!   keeps its bookings itself.
//!
//! In the per-booking form output-block growth is not synced (as in
//! Dynamo): a booking counts with the decode blocks it was booked with. A
//! service's reports carry its counters, output blocks included.
//!
//! Replicas of one partition must share the message format: a replica
//! from before the `L` (load) delta cannot decode a batch carrying one, so
//! it would not count the load a service reports.
//!
//! * `wire`: the messages and their encoding (JSON, short keys).
//! * `tables`: this replica's outstanding bookings and its peers' tables,
//!   with the sequence rules that make applying a message idempotent and a
//!   snapshot exact.
//! * `ring`: the per-thread rings the deltas wait in.
//! * `task`: the background thread: batching, publishing, heartbeats,
//!   expiry, snapshots, reconnection.
//!
//! It sits beside discovery in the host's layers: it names only the plain
//! types and its error, never the fleet, the service or the policies.
//!
//! What it must not do: block or slow the selection path, and touch the
//! fleet. The `record_*` calls only write a small value into the calling
//! thread's own bounded ring (`ring`: no lock, no read-modify-write, no
//! allocation once the thread has its ring, no I/O); a full ring drops the
//! delta and counts it. `report_load` takes a lock and is meant for a
//! periodic caller, not the selection path. The local booking stays the
//! truth for the local replica: replica sync never changes it. The service
//! wires it in (its `set_replica_sync`, `publish_local_load` and
//! `apply_remote_load`, in `service::replica`): it reports the load its
//! fleet's counters hold here, and sets [`ReplicaSync::remote_loads`] as
//! its rows' remote load when [`ReplicaSync::version`] moved.
//!
//! # Connecting to a secured server
//!
//! Every replica of a partition, and anything else that can publish on
//! its subject, is a peer: what it publishes there is counted. Run the
//! server with authentication, and let only the routers of a partition
//! publish and subscribe on its subject (nats-server's `permissions`, or
//! an account of their own); use TLS where the network between routers
//! and server is not trusted. [`ReplicaSyncOptions`] takes what the server
//! asks for, one way to authenticate (the last one set wins) plus TLS:
//!
//! | option | server side | what it does |
//! |---|---|---|
//! | `with_user_and_password(user, password)` | `authorization { user, password }` or `users = [...]` | sends them on connecting; credentials in the URL (`nats://user:password@host`) do the same |
//! | `with_token(token)` | `authorization { token }` | sends it on connecting; so does `nats://token@host` |
//! | `with_nkey_seed_file(path)` | `users = [{ nkey: U... }]` | signs the server's nonce with the user NKey seed (`SU...`) in the file |
//! | `with_credentials_file(path)` | operator mode (`operator`, `resolver`) | sends the user JWT of the `.creds` file and signs the nonce with its seed |
//! | `with_tls_ca_file(path)` | `tls { cert_file, key_file }` | trusts the CAs in the PEM file (not the system's) for the server's certificate; requires TLS |
//! | `with_client_certificate(cert, key)` | `tls { verify: true, ca_file }` | presents the PEM certificate chain and key; requires TLS |
//! | `with_tls_required(true)` | `tls { ... }` | refuses a server that offers no TLS (the system's CAs check its certificate unless a CA file is set) |
//!
//! Without them, TLS is used when the server requires it (checked against
//! the system's CAs) or the URL's scheme is `tls://`. [`ReplicaSync::connect`]
//! reads and checks every file first: one that cannot be read, or does not
//! hold what its option needs (PEM certificates, a PEM private key, a user
//! NKey seed, a `.creds` file), is a [`SyncError::Credentials`] naming the
//! option and the file. A server that refuses the credentials (wrong, or
//! none where it wants some) fails `connect` at once with
//! [`SyncError::AuthenticationFailed`]; a failed TLS handshake (a server
//! certificate no trusted CA signed, a client certificate refused or
//! missing) with [`SyncError::Tls`]; neither waits for the connect
//! timeout. After `connect`, a server that refuses a reconnection is
//! retried like a lost one. The user needs permission to publish and
//! subscribe on the subject: a refused subscription or publication is
//! not an error of `connect` (the server reports it later, as a
//! connection event). Certificates and keys are read
//! again on each connection, so replaced files take effect at the next
//! reconnection; the seed and `.creds` files are read once.
//!
//! Passwords, tokens, seeds and keys never appear in `Debug` output, logs
//! or errors: the options print `"***"` for them, and a URL's user
//! information is taken out of it before the URL is stored, logged or put
//! in an error ([`ReplicaSync::server`]).
//!
//! ```no_run
//! # // no_run: needs a nats-server with TLS and users.
//! use selkie::*;
//! let options = ReplicaSyncOptions::default()
//!     .with_subject("selkie.bookings.llama-70b")
//!     .with_credentials_file("/etc/selkie/router.creds")
//!     .with_tls_ca_file("/etc/selkie/nats-ca.pem")
//!     .with_client_certificate("/etc/selkie/router.pem", "/etc/selkie/router-key.pem");
//! match ReplicaSync::connect("tls://nats.internal:4222", options) {
//!     Ok(sync) => println!("connected to {}", sync.server()),
//!     Err(e @ SyncError::AuthenticationFailed { .. }) => eprintln!("check the credentials: {e}"),
//!     Err(e) => eprintln!("{e}"),
//! }
//! ```
//!
//! The options and the refusals are in `connect`.

mod connect;
mod ring;
mod tables;
mod task;
mod wire;

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use rustc_hash::FxHashMap;

use crate::error::SyncError;
use crate::types::WorkerWithDpRank;
use ring::Rings;
use tables::PeerTables;
use wire::{Booked, Delta};

/// How [`ReplicaSync`] batches, heartbeats and expires, and how it
/// authenticates to the server (feature `nats`).
///
/// ```
/// use std::time::Duration;
/// let options = selkie::ReplicaSyncOptions::default()
///     .with_subject("selkie.bookings.llama-70b")
///     .with_heartbeat_interval(Duration::from_millis(500))
///     .with_peer_timeout(Duration::from_secs(5));
/// assert_eq!(options.batch_max_events(), 256);
/// ```
///
/// For a secured server: one of [`with_user_and_password`](Self::with_user_and_password),
/// [`with_token`](Self::with_token), [`with_nkey_seed_file`](Self::with_nkey_seed_file)
/// or [`with_credentials_file`](Self::with_credentials_file), and for TLS
/// [`with_tls_ca_file`](Self::with_tls_ca_file),
/// [`with_client_certificate`](Self::with_client_certificate) or
/// [`with_tls_required`](Self::with_tls_required). No secret shows in
/// `Debug`:
///
/// ```
/// let options = selkie::ReplicaSyncOptions::default()
///     .with_user_and_password("router", "hunter2")
///     .with_tls_ca_file("/etc/selkie/nats-ca.pem");
/// assert!(!format!("{options:?}").contains("hunter2"));
/// ```
#[derive(Clone, Debug)]
pub struct ReplicaSyncOptions {
    subject: String,
    replica_id: Option<u64>,
    batch_max_events: usize,
    batch_interval: Duration,
    heartbeat_interval: Duration,
    peer_timeout: Duration,
    queue_capacity: usize,
    connect_timeout: Duration,
    max_reconnect_delay: Duration,
    /// Credentials and TLS (`connect`).
    security: connect::NatsSecurity,
}

impl Default for ReplicaSyncOptions {
    /// Subject `selkie.bookings`, a random replica id, batches of up to 256
    /// deltas or 1 ms (Dynamo's), a heartbeat every second, peers expired
    /// after 10 s of silence, a queue of 8,192 deltas per recording thread, 5 s to connect,
    /// reconnection attempts at most 2 s apart.
    fn default() -> Self {
        ReplicaSyncOptions {
            subject: "selkie.bookings".into(),
            replica_id: None,
            batch_max_events: 256,
            batch_interval: Duration::from_millis(1),
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(10),
            queue_capacity: 1 << 13,
            connect_timeout: Duration::from_secs(5),
            max_reconnect_delay: Duration::from_secs(2),
            security: connect::NatsSecurity::default(),
        }
    }
}

impl ReplicaSyncOptions {
    /// The NATS subject the replicas of one routing partition share (one
    /// subject per partition: replicas routing another model use
    /// another). Dot-separated tokens, no wildcards, no whitespace.
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = subject.into();
        self
    }

    /// This replica's id among its peers (default: random). Two live
    /// replicas must not share one.
    pub fn with_replica_id(mut self, replica_id: u64) -> Self {
        self.replica_id = Some(replica_id);
        self
    }

    /// The most deltas one published batch holds.
    pub fn with_batch_max_events(mut self, events: usize) -> Self {
        self.batch_max_events = events;
        self
    }

    /// The longest a recorded delta waits for its batch to fill.
    pub fn with_batch_interval(mut self, interval: Duration) -> Self {
        self.batch_interval = interval;
        self
    }

    /// How often this replica says it is alive (and checks its peers).
    pub fn with_heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = interval;
        self
    }

    /// A peer not heard from for this long has all its load removed. More
    /// than the heartbeat interval; several times it avoids expiring a
    /// peer over one late heartbeat.
    pub fn with_peer_timeout(mut self, timeout: Duration) -> Self {
        self.peer_timeout = timeout;
        self
    }

    /// The most deltas each recording thread can have waiting for the
    /// background thread (rounded up to a power of two; each thread that
    /// records gets a queue of its own, of about 40 bytes per delta); more
    /// are dropped and counted ([`ReplicaSyncStats::dropped`]). The thread
    /// empties the queues every `batch_interval`.
    pub fn with_queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity;
        self
    }

    /// The longest [`ReplicaSync::connect`] waits for the server.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The longest wait between reconnection attempts (they start at once
    /// and double from 2 ms up to this).
    pub fn with_max_reconnect_delay(mut self, delay: Duration) -> Self {
        self.max_reconnect_delay = delay;
        self
    }

    /// See [`with_subject`](Self::with_subject).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// See [`with_replica_id`](Self::with_replica_id); `None` until
    /// [`ReplicaSync::connect`] picks one.
    pub fn replica_id(&self) -> Option<u64> {
        self.replica_id
    }

    /// See [`with_batch_max_events`](Self::with_batch_max_events).
    pub fn batch_max_events(&self) -> usize {
        self.batch_max_events
    }

    /// See [`with_batch_interval`](Self::with_batch_interval).
    pub fn batch_interval(&self) -> Duration {
        self.batch_interval
    }

    /// See [`with_heartbeat_interval`](Self::with_heartbeat_interval).
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// See [`with_peer_timeout`](Self::with_peer_timeout).
    pub fn peer_timeout(&self) -> Duration {
        self.peer_timeout
    }

    /// See [`with_queue_capacity`](Self::with_queue_capacity).
    pub fn queue_capacity(&self) -> usize {
        self.queue_capacity
    }

    /// See [`with_connect_timeout`](Self::with_connect_timeout).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// See [`with_max_reconnect_delay`](Self::with_max_reconnect_delay).
    pub fn max_reconnect_delay(&self) -> Duration {
        self.max_reconnect_delay
    }

    fn validate(&self) -> Result<(), SyncError> {
        let invalid = |option, value: String, requirement| {
            Err(SyncError::InvalidOption {
                option,
                value,
                requirement,
            })
        };
        let subject_ok = !self.subject.is_empty()
            && self
                .subject
                .split('.')
                .all(|token| !token.is_empty() && !token.contains(|c: char| c.is_whitespace() || c == '*' || c == '>'));
        if !subject_ok {
            return invalid(
                "subject",
                format!("{:?}", self.subject),
                "dot-separated non-empty tokens without wildcards or whitespace",
            );
        }
        if self.batch_max_events == 0 {
            return invalid("batch_max_events", "0".into(), "at least 1");
        }
        if self.queue_capacity == 0 {
            return invalid("queue_capacity", "0".into(), "at least 1");
        }
        if self.heartbeat_interval.is_zero() {
            return invalid("heartbeat_interval", "0s".into(), "more than zero");
        }
        if self.peer_timeout <= self.heartbeat_interval {
            return invalid(
                "peer_timeout",
                format!(
                    "{:?} (heartbeat_interval {:?})",
                    self.peer_timeout, self.heartbeat_interval
                ),
                "more than heartbeat_interval",
            );
        }
        Ok(())
    }
}

/// A load on one worker rank: the peers' outstanding bookings there,
/// summed ([`ReplicaSync::remote_load`]), or this replica's own, as it
/// reports it ([`ReplicaSync::report_load`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemoteLoad {
    /// Bookings not yet released.
    pub requests: u64,
    /// Their prefill tokens, for bookings whose prefill has not completed.
    pub prefill_tokens: u64,
    /// Their decode blocks, as booked.
    pub decode_blocks: u64,
}

/// What replica sync has done so far ([`ReplicaSync::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicaSyncStats {
    /// Delta batches published.
    pub published_batches: u64,
    /// Deltas in them.
    pub published_events: u64,
    /// Batches not published because the server was unreachable (peers
    /// notice the gap and ask for a snapshot).
    pub unpublished_batches: u64,
    /// Publications the client refused or could not buffer in time.
    pub publish_errors: u64,
    /// Deltas dropped at `record_*` because the thread's queue was full (or the
    /// background thread had stopped).
    pub dropped: u64,
    /// Peers' deltas applied.
    pub applied: u64,
    /// Peers' deltas skipped: their batch was applied already, or a
    /// snapshot covered it.
    pub skipped: u64,
    /// Peers' prefill completions and releases of bookings not held
    /// (ignored).
    pub unknown: u64,
    /// Peers known now.
    pub peers: u64,
    /// Peers whose load was removed because they fell silent.
    pub peers_expired: u64,
    /// Snapshots of this replica's bookings sent.
    pub snapshots_sent: u64,
    /// Peers' snapshots applied.
    pub snapshots_received: u64,
    /// Snapshot requests sent (at start, on reconnection, on a gap).
    pub snapshot_requests: u64,
    /// Times the connection to the server came back.
    pub reconnects: u64,
    /// Messages on the subject that could not be decoded (ignored).
    pub decode_errors: u64,
    /// Messages from another replica using this replica's id (ignored).
    pub id_conflicts: u64,
}

/// The counters behind [`ReplicaSyncStats`], written by the background
/// thread only (the drops are counted per ring).
#[derive(Default)]
struct Counters {
    published_batches: AtomicU64,
    published_events: AtomicU64,
    unpublished_batches: AtomicU64,
    publish_errors: AtomicU64,
    applied: AtomicU64,
    skipped: AtomicU64,
    unknown: AtomicU64,
    peers: AtomicU64,
    peers_expired: AtomicU64,
    snapshots_sent: AtomicU64,
    snapshots_received: AtomicU64,
    snapshot_requests: AtomicU64,
    reconnects: AtomicU64,
    decode_errors: AtomicU64,
    id_conflicts: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// What the background thread shares with [`ReplicaSync`].
struct Shared {
    tables: Mutex<PeerTables>,
    /// A copy of the tables' version, readable without the lock.
    version: AtomicU64,
    /// The recording threads' queues.
    rings: Rings,
    /// Loads reported since the last drain, the latest per worker rank.
    reported: Mutex<FxHashMap<WorkerWithDpRank, RemoteLoad>>,
    counters: Counters,
}

impl Shared {
    fn tables(&self) -> MutexGuard<'_, PeerTables> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reported(&self) -> MutexGuard<'_, FxHashMap<WorkerWithDpRank, RemoteLoad>> {
        self.reported.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Booking sync with the other replicas of this router over NATS (feature
/// `nats`).
///
/// [`connect`](Self::connect) connects to the server, subscribes to the
/// partition's subject, asks the peers already there for their bookings,
/// and returns; from then on a background thread (its own current-thread
/// tokio runtime) does all the work:
///
/// * This replica's load goes out in one of two forms (a peer sums
///   both). [`report_load`](Self::report_load) sets this replica's whole
///   load on a worker rank, for a caller that reads it periodically from
///   its own counters (what a
///   [`WorkerSelectionService`](crate::WorkerSelectionService) does: its
///   selections record nothing). Or the selection path calls
///   [`record_book`](Self::record_book),
///   [`record_prefill_complete`](Self::record_prefill_complete) and
///   [`record_release`](Self::record_release), which queue the delta and
///   return at once (never blocking, never allocating); a full queue drops
///   the delta and counts it. The thread publishes the changes in batches
///   (up to `batch_max_events`, or after `batch_interval`) and keeps this
///   replica's outstanding bookings and reported loads, to answer snapshot
///   requests.
/// * It applies the peers' batches into one table per peer and their sum
///   per worker rank: [`remote_load`](Self::remote_load),
///   [`remote_loads`](Self::remote_loads), and [`version`](Self::version),
///   which moves on every change. Its own messages are ignored; a batch
///   that arrives twice, or that a snapshot already covers, is skipped; a
///   release of a booking it does not hold is ignored and counted.
/// * It publishes a heartbeat every `heartbeat_interval`; a peer not heard
///   from within `peer_timeout` has all its load removed (and is logged).
/// * When it starts, and whenever its connection comes back, it asks its
///   peers for snapshots of their outstanding bookings, and each peer's
///   snapshot replaces its table. Every message carries its sender's batch
///   sequence number, so a snapshot says which batch it reflects (deltas
///   at or below it are skipped) and a receiver that missed a batch asks
///   that peer for a snapshot instead of drifting.
///
/// Nothing here changes the local fleet: the local bookings remain the
/// truth for this replica. Dropping it stops the thread.
///
/// ```no_run
/// # // no_run: needs a running nats-server.
/// use selkie::*;
/// let sync = ReplicaSync::connect(
///     "nats://127.0.0.1:4222",
///     ReplicaSyncOptions::default().with_subject("selkie.bookings.llama-70b"),
/// )?;
/// let worker = WorkerWithDpRank::new(7, 0);
/// // This replica's load on worker 7, rank 0, as its counters hold it:
/// sync.report_load(worker, RemoteLoad { requests: 3, prefill_tokens: 4096, decode_blocks: 48 });
/// // Or, for a router that tracks its bookings itself, one by one:
/// let other = WorkerWithDpRank::new(8, 0);
/// sync.record_book(1, other, 2048, 16); // on selection
/// sync.record_prefill_complete(1); //      first token out
/// sync.record_release(1); //               request done
/// // What the other replicas have booked on worker 7, rank 0:
/// let theirs = sync.remote_load(worker);
/// println!("{} requests, {} prefill tokens", theirs.requests, theirs.prefill_tokens);
/// # Ok::<(), SyncError>(())
/// ```
pub struct ReplicaSync {
    replica_id: u64,
    server: String,
    subject: String,
    shared: Arc<Shared>,
    /// Dropping it stops the thread.
    stop: Option<tokio::sync::watch::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ReplicaSync {
    /// Connects to the NATS server at `url`, subscribes to the options'
    /// subject and asks the peers for snapshots; returns once subscribed.
    /// Fails if an option is out of range, a credential or TLS file cannot
    /// be used ([`SyncError::Credentials`]), the server refuses the
    /// credentials ([`SyncError::AuthenticationFailed`]), the TLS handshake
    /// fails ([`SyncError::Tls`]), or the server cannot be reached within
    /// the connect timeout. After that, a lost server is retried for as
    /// long as this lives. Credentials in `url` (`nats://user:password@host`
    /// or `nats://token@host`) are taken out of it and used as if given
    /// with [`ReplicaSyncOptions::with_user_and_password`] or
    /// [`with_token`](ReplicaSyncOptions::with_token).
    pub fn connect(url: &str, mut options: ReplicaSyncOptions) -> Result<ReplicaSync, SyncError> {
        options.validate()?;
        let server = options.security.take_url_credentials(url)?;
        options.security.check()?;
        let replica_id = options.replica_id.unwrap_or_else(random_u64);
        let shared = Arc::new(Shared {
            tables: Mutex::default(),
            version: AtomicU64::new(0),
            rings: Rings::new(options.queue_capacity),
            reported: Mutex::default(),
            counters: Counters::default(),
        });
        let (stop, stopped) = tokio::sync::watch::channel(());
        let (ready_tx, ready_rx) = mpsc::channel();
        let subject = options.subject.clone();
        let sync_loop = task::SyncLoop::new(server.clone(), replica_id, random_u64(), options, shared.clone());
        let unavailable = |message: String| SyncError::Unavailable {
            server: server.clone(),
            message,
        };
        let thread = std::thread::Builder::new()
            .name("selkie-replica-sync".into())
            .spawn(move || sync_loop.run(stopped, ready_tx))
            .map_err(|e| unavailable(format!("cannot start the replica sync thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(ReplicaSync {
                replica_id,
                server,
                subject,
                shared,
                stop: Some(stop),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(unavailable("the replica sync thread stopped before subscribing".into()))
            }
        }
    }

    /// Records that this replica booked `booking_id` on `worker` with
    /// `prefill_tokens` to prefill and `decode_blocks` of decode. Returns
    /// whether the delta was queued (`false`: the queue was full, the delta
    /// is dropped and counted).
    pub fn record_book(
        &self,
        booking_id: u64,
        worker: WorkerWithDpRank,
        prefill_tokens: u32,
        decode_blocks: u32,
    ) -> bool {
        self.record(Delta::Book(
            booking_id,
            Booked {
                worker,
                prefill_tokens,
                decode_blocks,
            },
        ))
    }

    /// Records that `booking_id`'s prefill completed: its prefill tokens no
    /// longer count. Returns whether the delta was queued.
    pub fn record_prefill_complete(&self, booking_id: u64) -> bool {
        self.record(Delta::PrefillComplete(booking_id))
    }

    /// Records that `booking_id` was released. Returns whether the delta
    /// was queued.
    pub fn record_release(&self, booking_id: u64) -> bool {
        self.record(Delta::Release(booking_id))
    }

    #[inline]
    fn record(&self, delta: Delta) -> bool {
        self.shared.rings.push(delta)
    }

    /// Reports this replica's whole load on `worker` now (not a change:
    /// zero withdraws it). The sync thread sends it with its next batch if
    /// it differs from the last one sent; a worker rank reported again
    /// before that sends only the latest. Peers add it to whatever
    /// bookings this replica recorded there with `record_book`, so report a
    /// worker rank's load or record its bookings, not both.
    ///
    /// Takes a lock the sync thread also takes: meant for a periodic
    /// caller reading its own counters, not for the selection path.
    pub fn report_load(&self, worker: WorkerWithDpRank, load: RemoteLoad) {
        self.shared.reported().insert(worker, load);
    }

    /// [`report_load`](Self::report_load) for many worker ranks under one
    /// lock, in order (a worker rank named twice keeps the later load).
    pub fn report_loads(&self, loads: impl IntoIterator<Item = (WorkerWithDpRank, RemoteLoad)>) {
        self.shared.reported().extend(loads);
    }

    /// The peers' outstanding load on `worker` (zero if none).
    pub fn remote_load(&self, worker: WorkerWithDpRank) -> RemoteLoad {
        self.shared.tables().load(worker)
    }

    /// Every worker rank with a non-zero remote load, in order.
    pub fn remote_loads(&self) -> Vec<(WorkerWithDpRank, RemoteLoad)> {
        self.shared.tables().loads()
    }

    /// Moves whenever the remote load changes (a copy of it needs
    /// refreshing only when this differs from the last one seen). Read it
    /// before [`remote_loads`](Self::remote_loads): the loads read after
    /// are at least as new as the version.
    pub fn version(&self) -> u64 {
        self.shared.version.load(Ordering::Acquire)
    }

    /// This replica's id among its peers.
    pub fn replica_id(&self) -> u64 {
        self.replica_id
    }

    /// The server's URL, as given to [`connect`](Self::connect) less any
    /// credentials in it.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The subject the replicas share.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The counters so far.
    pub fn stats(&self) -> ReplicaSyncStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ReplicaSyncStats {
            published_batches: get(&c.published_batches),
            published_events: get(&c.published_events),
            unpublished_batches: get(&c.unpublished_batches),
            publish_errors: get(&c.publish_errors),
            dropped: self.shared.rings.dropped(),
            applied: get(&c.applied),
            skipped: get(&c.skipped),
            unknown: get(&c.unknown),
            peers: get(&c.peers),
            peers_expired: get(&c.peers_expired),
            snapshots_sent: get(&c.snapshots_sent),
            snapshots_received: get(&c.snapshots_received),
            snapshot_requests: get(&c.snapshot_requests),
            reconnects: get(&c.reconnects),
            decode_errors: get(&c.decode_errors),
            id_conflicts: get(&c.id_conflicts),
        }
    }
}

impl Drop for ReplicaSync {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for ReplicaSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSync")
            .field("replica_id", &self.replica_id)
            .field("server", &self.server)
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

/// A random u64 from std's per-process hash keys and the clock (replica
/// ids and incarnations need to differ, not to be secret).
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
}
