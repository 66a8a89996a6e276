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
//! # Who may publish, and what a peer can do
//!
//! Replica sync believes the messages on its subject. Whoever can publish
//! there is a peer: without a signing key, anyone who can reach the NATS
//! server and publish on the partition's subject can add load to any
//! worker rank (within the bounds below), and so steer least-loaded
//! routing or make the admission limit refuse requests. Keep that subject
//! to the router replicas: the server's own permissions (per-user publish
//! and subscribe permissions, accounts, TLS; see "Connecting to a secured
//! server" below) decide who connects and publishes, and a signing key
//! decides which messages count.
//!
//! With a signing key ([`ReplicaSyncOptions::with_signing_key`], the same
//! key on every replica of the partition), every message is signed (an
//! HMAC-SHA256 over the subject and the message) and a message without a
//! valid signature is refused and counted ([`RefusedMessages`]): a
//! publisher without the key changes nothing. The key is the partition's,
//! not a replica's: it says who belongs to the partition, and every
//! holder is trusted to speak only for itself. Captured messages replayed
//! by someone without the key:
//!
//! * every signed message carries its send time; one sent more than
//!   `peer_timeout` before or after this replica's clock is refused
//!   (stale), so the replicas' clocks must agree within that;
//! * a message sent before the latest one from the same sender is refused
//!   (replayed); one sent at the same time changes nothing (a batch is
//!   skipped by its sequence number) and does not keep a silent peer
//!   alive;
//! * a new incarnation of a known replica replaces its table only if it
//!   was sent after that replica's latest message: an old incarnation's
//!   message, replayed, cannot reset a live peer's table.
//!
//! Without a key none of this holds (anyone can write anything), but the
//! bounds do. What any one peer can make this replica hold, or do:
//!
//! | what | bound | default | when hit |
//! | --- | --- | --- | --- |
//! | its load on one worker rank | `max_peer_load`, per field | 65,536 requests, 2^30 prefill tokens, 2^24 decode blocks | the excess does not count ([`ReplicaSyncStats::capped`]) |
//! | its bookings and reported worker ranks | `max_peer_rows` | 65,536 | the booking or report is refused ([`ReplicaSyncStats::refused_rows`]) |
//! | one snapshot it sends | `max_peer_rows` rows, parts that each hold rows, finished within `peer_timeout` | | dropped ([`RefusedMessages`]) |
//! | peers known at once | `max_peers` | 32 | the new peer's messages are refused |
//! | snapshots this replica sends | one per `min_snapshot_interval` (one answers every requester) | 100 ms | later requests wait for the next one |
//! | a batch far ahead of the last one applied | 1,024 batches | | not applied; the peer is asked for a snapshot |
//! | a silent peer | `peer_timeout` | 10 s | its load and tables are removed and their memory freed |
//!
//! A peer's load on a worker rank is summed exactly, each peer's capped on
//! its own, so one peer cannot erase or inflate another's. A row held
//! takes about 50 bytes (46 measured for 50,000 bookings; up to about 80
//! just after a table grows), and a snapshot being received as many again
//! at most, so peers hold at most about `max_peers x max_peer_rows x 80`
//! bytes (about 170 MB with the defaults), all freed when they expire. A
//! peer cannot touch this replica's own bookings. A replica that sees a
//! message in its own name
//! and incarnation that it did not send (a sequence number or send time
//! ahead of its own) counts an id conflict and starts a new incarnation,
//! with a snapshot, so that its peers rebuild its table from that.
//!
//! If the background thread stops (the subscription ended, or it
//! panicked), [`ReplicaSync::health`] says so and why, the peers' load is
//! removed (it can no longer be kept current: `remote_loads` is empty) and
//! the `record_*` calls return `false`.
//!
//! * `wire`: the messages and their encoding (JSON, short keys).
//! * `auth`: message signatures.
//! * `tables`: this replica's outstanding bookings and its peers' tables,
//!   with the sequence rules that make applying a message idempotent and a
//!   snapshot exact.
//! * `ring`: the per-thread queues the deltas wait in.
//! * `task`: the background thread: batching, publishing, heartbeats,
//!   expiry, snapshots, reconnection.
//!
//! It sits beside discovery in the host's layers: it names only the plain
//! types and its error, never the fleet, the service or the policies.
//!
//! What it must not do: block or slow the selection path, and touch the
//! fleet. The `record_*` calls only write a small value into the calling
//! thread's own bounded queue (`ring`: no lock, no contention, no
//! allocation once the thread has its queue, no I/O); a full queue drops
//! the delta and counts it. `report_load` takes a lock and is meant for a
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

mod auth;
mod connect;
mod ring;
mod tables;
mod task;
mod wire;

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use rustc_hash::FxHashMap;

use crate::error::SyncError;
use crate::types::WorkerWithDpRank;
use auth::SigningKey;
use ring::Rings;
use tables::{Limits, PeerTables, Refusal};
use wire::{Booked, Delta};

/// How [`ReplicaSync`] batches, heartbeats, expires, signs and bounds what
/// peers send, and how it authenticates to the server (feature `nats`).
///
/// Every option has a range; [`ReplicaSync::connect`] refuses a value
/// outside it with [`SyncError::InvalidOption`] naming the option and its
/// bound.
///
/// ```
/// use std::time::Duration;
/// let options = selkie::ReplicaSyncOptions::default()
///     .with_subject("selkie.bookings.llama-70b")
///     .with_heartbeat_interval(Duration::from_millis(500))
///     .with_peer_timeout(Duration::from_secs(5))
///     .with_signing_key(*b"the partition's 32-byte secret!!");
/// assert_eq!(options.batch_max_events(), 256);
/// assert!(options.is_signed());
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
    /// `Err(length)`: a key too short to use.
    signing_key: Option<Result<SigningKey, usize>>,
    max_peers: usize,
    max_peer_rows: usize,
    max_peer_load: RemoteLoad,
    min_snapshot_interval: Duration,
    /// Credentials and TLS (`connect`).
    security: connect::NatsSecurity,
}

impl Default for ReplicaSyncOptions {
    /// Subject `selkie.bookings`, a random replica id, batches of up to 256
    /// deltas or 1 ms (Dynamo's), a heartbeat every second, peers expired
    /// after 10 s of silence, a queue of 8,192 deltas per recording thread,
    /// 5 s to connect, reconnection attempts at most 2 s apart; no signing
    /// key; at most 32 peers of 65,536 rows each, a peer's load on a worker
    /// rank counted up to 65,536 requests, 2^30 prefill tokens and 2^24
    /// decode blocks; a snapshot sent at most every 100 ms.
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
            signing_key: None,
            max_peers: 32,
            max_peer_rows: 1 << 16,
            max_peer_load: RemoteLoad {
                requests: 1 << 16,
                prefill_tokens: 1 << 30,
                decode_blocks: 1 << 24,
            },
            min_snapshot_interval: Duration::from_millis(100),
            security: connect::NatsSecurity::default(),
        }
    }
}

impl ReplicaSyncOptions {
    /// The shortest `batch_interval`.
    pub const MIN_BATCH_INTERVAL: Duration = Duration::from_micros(100);
    /// The longest `batch_interval`.
    pub const MAX_BATCH_INTERVAL: Duration = Duration::from_secs(10);
    /// The most deltas in one batch (a batch of 8,192 deltas at their
    /// longest is about 850 KB: within NATS' default 1 MiB payload).
    pub const MAX_BATCH_EVENTS: usize = 1 << 13;
    /// The largest `queue_capacity` (each recording thread's queue holds
    /// that many deltas of about 40 bytes: 40 MB).
    pub const MAX_QUEUE_CAPACITY: usize = 1 << 20;
    /// The longest `heartbeat_interval`, `peer_timeout`,
    /// `connect_timeout`, `max_reconnect_delay` and
    /// `min_snapshot_interval`.
    pub const MAX_DURATION: Duration = Duration::from_secs(3600);
    /// The most `max_peers`.
    pub const MAX_PEERS: usize = 1 << 12;
    /// The most `max_peer_rows`.
    pub const MAX_PEER_ROWS: usize = 1 << 24;
    /// The most any field of `max_peer_load` may be (with `MAX_PEERS`,
    /// the sum over peers stays exact in 64 bits).
    pub const MAX_PEER_LOAD_FIELD: u64 = 1 << 40;
    /// The fewest bytes a signing key has.
    pub const MIN_SIGNING_KEY_BYTES: usize = auth::MIN_KEY_BYTES;

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

    /// The most deltas one published batch holds: 1 to
    /// [`MAX_BATCH_EVENTS`](Self::MAX_BATCH_EVENTS).
    pub fn with_batch_max_events(mut self, events: usize) -> Self {
        self.batch_max_events = events;
        self
    }

    /// The longest a recorded delta waits for its batch to fill:
    /// [`MIN_BATCH_INTERVAL`](Self::MIN_BATCH_INTERVAL) to
    /// [`MAX_BATCH_INTERVAL`](Self::MAX_BATCH_INTERVAL).
    pub fn with_batch_interval(mut self, interval: Duration) -> Self {
        self.batch_interval = interval;
        self
    }

    /// How often this replica says it is alive (and checks its peers):
    /// more than zero, at most [`MAX_DURATION`](Self::MAX_DURATION).
    pub fn with_heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = interval;
        self
    }

    /// A peer not heard from for this long has all its load removed. More
    /// than the heartbeat interval (several times it avoids expiring a
    /// peer over one late heartbeat), at most
    /// [`MAX_DURATION`](Self::MAX_DURATION). It also bounds how long an
    /// unfinished snapshot is kept and, with a signing key, how far a
    /// message's send time may be from this replica's clock.
    pub fn with_peer_timeout(mut self, timeout: Duration) -> Self {
        self.peer_timeout = timeout;
        self
    }

    /// The most deltas each recording thread can have waiting for the
    /// background thread (each thread that records gets a queue of its
    /// own, of about 40 bytes per delta): 1 to
    /// [`MAX_QUEUE_CAPACITY`](Self::MAX_QUEUE_CAPACITY). More are dropped
    /// and counted ([`ReplicaSyncStats::dropped`]). The thread empties
    /// the queues every `batch_interval`.
    pub fn with_queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity;
        self
    }

    /// The longest [`ReplicaSync::connect`] waits for the server: more than
    /// zero, at most [`MAX_DURATION`](Self::MAX_DURATION).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The longest wait between reconnection attempts (they start at once
    /// and double from 2 ms up to this), at most
    /// [`MAX_DURATION`](Self::MAX_DURATION).
    pub fn with_max_reconnect_delay(mut self, delay: Duration) -> Self {
        self.max_reconnect_delay = delay;
        self
    }

    /// Signs every message with `key` (HMAC-SHA256) and refuses every
    /// message not signed with it: the same key on every replica of the
    /// partition, at least
    /// [`MIN_SIGNING_KEY_BYTES`](Self::MIN_SIGNING_KEY_BYTES) bytes (32
    /// random bytes are best). See the module docs for what it protects
    /// against and what it does not. The key is not shown by `Debug`.
    pub fn with_signing_key(mut self, key: impl AsRef<[u8]>) -> Self {
        let key = key.as_ref();
        self.signing_key = Some(SigningKey::new(key).ok_or(key.len()));
        self
    }

    /// The most peers known at once (1 to
    /// [`MAX_PEERS`](Self::MAX_PEERS)); a new peer's messages past that
    /// are refused until one expires.
    pub fn with_max_peers(mut self, peers: usize) -> Self {
        self.max_peers = peers;
        self
    }

    /// The most bookings plus reported worker ranks one peer can hold here,
    /// and the most rows of one snapshot (1 to
    /// [`MAX_PEER_ROWS`](Self::MAX_PEER_ROWS)); a booking or report past
    /// it is refused and counted, a larger snapshot dropped. Give every
    /// replica of a partition room for the most bookings (or worker ranks
    /// reported) any one of them holds: a replica holding more is not
    /// fully counted by its peers.
    pub fn with_max_peer_rows(mut self, rows: usize) -> Self {
        self.max_peer_rows = rows;
        self
    }

    /// The most one peer's load on one worker rank counts here, field by
    /// field: a plausible maximum for one replica (each field 1 to
    /// [`MAX_PEER_LOAD_FIELD`](Self::MAX_PEER_LOAD_FIELD)). The excess is
    /// counted ([`ReplicaSyncStats::capped`]), never added.
    pub fn with_max_peer_load(mut self, load: RemoteLoad) -> Self {
        self.max_peer_load = load;
        self
    }

    /// The shortest time between two snapshots this replica sends (1 ms to
    /// [`MAX_DURATION`](Self::MAX_DURATION)). A snapshot goes to every
    /// replica on the subject, so one answers every request made before
    /// it; requests within the interval are answered by the next one.
    pub fn with_min_snapshot_interval(mut self, interval: Duration) -> Self {
        self.min_snapshot_interval = interval;
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

    /// Whether a signing key was given ([`with_signing_key`](Self::with_signing_key)).
    pub fn is_signed(&self) -> bool {
        self.signing_key.is_some()
    }

    /// See [`with_max_peers`](Self::with_max_peers).
    pub fn max_peers(&self) -> usize {
        self.max_peers
    }

    /// See [`with_max_peer_rows`](Self::with_max_peer_rows).
    pub fn max_peer_rows(&self) -> usize {
        self.max_peer_rows
    }

    /// See [`with_max_peer_load`](Self::with_max_peer_load).
    pub fn max_peer_load(&self) -> RemoteLoad {
        self.max_peer_load
    }

    /// See [`with_min_snapshot_interval`](Self::with_min_snapshot_interval).
    pub fn min_snapshot_interval(&self) -> Duration {
        self.min_snapshot_interval
    }

    /// The key, once validated.
    fn key(&self) -> Option<&SigningKey> {
        self.signing_key.as_ref().and_then(|k| k.as_ref().ok())
    }

    /// The bounds the peer tables keep.
    fn limits(&self) -> Limits {
        Limits {
            max_peers: self.max_peers,
            max_rows: self.max_peer_rows,
            max_load: self.max_peer_load,
            timeout: self.peer_timeout,
            check_times: self.is_signed(),
        }
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
        if !(1..=Self::MAX_BATCH_EVENTS).contains(&self.batch_max_events) {
            return invalid(
                "batch_max_events",
                self.batch_max_events.to_string(),
                "at least 1 and at most 8192",
            );
        }
        if !(Self::MIN_BATCH_INTERVAL..=Self::MAX_BATCH_INTERVAL).contains(&self.batch_interval) {
            return invalid(
                "batch_interval",
                format!("{:?}", self.batch_interval),
                "at least 100µs and at most 10s",
            );
        }
        if !(1..=Self::MAX_QUEUE_CAPACITY).contains(&self.queue_capacity) {
            return invalid(
                "queue_capacity",
                self.queue_capacity.to_string(),
                "at least 1 and at most 1048576",
            );
        }
        let durations = [
            ("heartbeat_interval", self.heartbeat_interval),
            ("connect_timeout", self.connect_timeout),
        ];
        for (option, value) in durations {
            if value.is_zero() || value > Self::MAX_DURATION {
                return invalid(option, format!("{value:?}"), "more than zero and at most 3600s");
            }
        }
        if self.peer_timeout <= self.heartbeat_interval || self.peer_timeout > Self::MAX_DURATION {
            return invalid(
                "peer_timeout",
                format!(
                    "{:?} (heartbeat_interval {:?})",
                    self.peer_timeout, self.heartbeat_interval
                ),
                "more than heartbeat_interval and at most 3600s",
            );
        }
        if self.max_reconnect_delay > Self::MAX_DURATION {
            return invalid(
                "max_reconnect_delay",
                format!("{:?}", self.max_reconnect_delay),
                "at most 3600s",
            );
        }
        if self.min_snapshot_interval < Duration::from_millis(1) || self.min_snapshot_interval > Self::MAX_DURATION {
            return invalid(
                "min_snapshot_interval",
                format!("{:?}", self.min_snapshot_interval),
                "at least 1ms and at most 3600s",
            );
        }
        if let Some(Err(len)) = self.signing_key {
            return invalid("signing_key", format!("{len} bytes"), "at least 16 bytes");
        }
        if !(1..=Self::MAX_PEERS).contains(&self.max_peers) {
            return invalid("max_peers", self.max_peers.to_string(), "at least 1 and at most 4096");
        }
        if !(1..=Self::MAX_PEER_ROWS).contains(&self.max_peer_rows) {
            return invalid(
                "max_peer_rows",
                self.max_peer_rows.to_string(),
                "at least 1 and at most 16777216",
            );
        }
        let l = self.max_peer_load;
        if [l.requests, l.prefill_tokens, l.decode_blocks]
            .iter()
            .any(|&v| !(1..=Self::MAX_PEER_LOAD_FIELD).contains(&v))
        {
            return invalid(
                "max_peer_load",
                format!("{l:?}"),
                "every field at least 1 and at most 1099511627776",
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
    /// snapshot covered it (or, for a peer not in sync yet, it was too far
    /// ahead to apply before the peer's snapshot).
    pub skipped: u64,
    /// Peers' prefill completions and releases of bookings not held
    /// (ignored).
    pub unknown: u64,
    /// Peers' bookings and reports of new worker ranks refused because
    /// the peer held `max_peer_rows` already.
    pub refused_rows: u64,
    /// Peers' changes that left their load on a worker rank above
    /// `max_peer_load` (the excess does not count).
    pub capped: u64,
    /// Peers' messages refused whole, by reason.
    pub refused: RefusedMessages,
    /// Peers known now.
    pub peers: u64,
    /// Bookings and reported loads held for the peers now (snapshots being
    /// received included).
    pub peer_rows: u64,
    /// Peers whose load was removed because they fell silent.
    pub peers_expired: u64,
    /// Snapshots of this replica's bookings sent.
    pub snapshots_sent: u64,
    /// Snapshot requests that found a snapshot sent less than
    /// `min_snapshot_interval` before: the next one answers them.
    pub snapshots_deferred: u64,
    /// Peers' snapshots applied.
    pub snapshots_received: u64,
    /// Snapshot requests sent (at start, on reconnection, on a gap).
    pub snapshot_requests: u64,
    /// Times the connection to the server came back.
    pub reconnects: u64,
    /// Messages on the subject that could not be decoded (ignored).
    pub decode_errors: u64,
    /// Messages in this replica's name that it did not send (ignored):
    /// another replica with its id, or a forger.
    pub id_conflicts: u64,
    /// Times this replica started a new incarnation because a message in
    /// its name and incarnation was not its own.
    pub reincarnations: u64,
}

/// Peers' messages refused whole, by reason ([`ReplicaSyncStats::refused`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RefusedMessages {
    /// Without a signature, where a signing key is set.
    pub unsigned: u64,
    /// With a signature that is not the key's over the message.
    pub bad_signature: u64,
    /// Signed, but sent more than `peer_timeout` before or after this
    /// replica's clock.
    pub stale: u64,
    /// Signed, but sent before the sender's latest message seen (or by an
    /// incarnation older than the one known): replayed.
    pub replayed: u64,
    /// Delta batches too far ahead of the sender's last one applied.
    pub seq_jump: u64,
    /// From a new peer while `max_peers` are known.
    pub peers_full: u64,
    /// Snapshots of more than `max_peer_rows` rows.
    pub snapshot_too_large: u64,
    /// Snapshot parts that hold nothing (dropping their snapshot).
    pub snapshot_malformed: u64,
    /// Snapshots not finished within `peer_timeout` (dropped).
    pub snapshot_expired: u64,
}

impl RefusedMessages {
    /// Every refusal.
    pub fn total(&self) -> u64 {
        self.unsigned
            + self.bad_signature
            + self.stale
            + self.replayed
            + self.seq_jump
            + self.peers_full
            + self.snapshot_too_large
            + self.snapshot_malformed
            + self.snapshot_expired
    }
}

/// Whether replica sync's background thread still runs
/// ([`ReplicaSync::health`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SyncHealth {
    /// It runs: the peers' load is kept current.
    Running,
    /// It stopped: the peers' load was removed, `record_*` returns
    /// `false`. Make a new [`ReplicaSync`] to sync again.
    Stopped {
        /// Why (the subscription ended, or the thread panicked).
        reason: String,
    },
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
    refused_rows: AtomicU64,
    capped: AtomicU64,
    refused: [AtomicU64; Refusal::COUNT],
    peers: AtomicU64,
    peer_rows: AtomicU64,
    peers_expired: AtomicU64,
    snapshots_sent: AtomicU64,
    snapshots_deferred: AtomicU64,
    snapshots_received: AtomicU64,
    snapshot_requests: AtomicU64,
    reconnects: AtomicU64,
    decode_errors: AtomicU64,
    id_conflicts: AtomicU64,
    reincarnations: AtomicU64,
}

impl Counters {
    fn refuse(&self, why: Refusal, by: u64) {
        bump(&self.refused[why as usize], by);
    }

    fn refused(&self) -> RefusedMessages {
        let get = |why: Refusal| self.refused[why as usize].load(Ordering::Relaxed);
        RefusedMessages {
            unsigned: get(Refusal::Unsigned),
            bad_signature: get(Refusal::BadSignature),
            stale: get(Refusal::Stale),
            replayed: get(Refusal::Replayed),
            seq_jump: get(Refusal::SeqJump),
            peers_full: get(Refusal::PeersFull),
            snapshot_too_large: get(Refusal::SnapshotTooLarge),
            snapshot_malformed: get(Refusal::SnapshotMalformed),
            snapshot_expired: get(Refusal::SnapshotExpired),
        }
    }
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
    /// The background thread runs (cleared when it ends, however).
    running: AtomicBool,
    /// Why it stopped.
    stopped: Mutex<Option<String>>,
}

impl Shared {
    fn new(options: &ReplicaSyncOptions) -> Shared {
        Shared {
            tables: Mutex::new(PeerTables::new(options.limits())),
            version: AtomicU64::new(0),
            rings: Rings::new(options.queue_capacity),
            reported: Mutex::default(),
            counters: Counters::default(),
            running: AtomicBool::new(true),
            stopped: Mutex::default(),
        }
    }

    fn tables(&self) -> MutexGuard<'_, PeerTables> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reported(&self) -> MutexGuard<'_, FxHashMap<WorkerWithDpRank, RemoteLoad>> {
        self.reported.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread ended: says why, and removes the peers' load (it can no
    /// longer be kept current).
    fn stop(&self, reason: String) {
        self.stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(reason);
        self.running.store(false, Ordering::Release);
        self.rings.close();
        let mut tables = self.tables();
        tables.clear();
        self.version.store(tables.version(), Ordering::Release);
        self.counters.peers.store(0, Ordering::Relaxed);
        self.counters.peer_rows.store(0, Ordering::Relaxed);
    }
}

/// Marks the sync stopped when the background thread ends, by return or
/// by panic.
struct StopOnExit(Arc<Shared>);

impl Drop for StopOnExit {
    fn drop(&mut self) {
        self.0.stop("the replica sync thread ended".into());
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
/// truth for this replica. Dropping it stops the thread; if it stops by
/// itself, [`health`](Self::health) says why, the peers' load is removed
/// and `record_*` returns `false`.
///
/// # Who may publish
///
/// Every message on the subject counts: whoever can publish there is a
/// peer and can add load to any worker rank. Keep the subject to the
/// replicas (the NATS server's permissions), and set a signing key
/// ([`ReplicaSyncOptions::with_signing_key`]): every message is then
/// signed (HMAC-SHA256 over subject and message, with its send time), and
/// messages without the key's signature, sent more than `peer_timeout`
/// from this replica's clock, or replayed (sent before the sender's
/// latest, or by an incarnation older than the one known) are refused and
/// counted ([`ReplicaSyncStats::refused`]). The key is the partition's:
/// its holders are trusted to speak for themselves only. Key or not, what
/// one peer can make this replica hold is bounded, and each bound is an
/// option: `max_peers` (32), `max_peer_rows` bookings and reported worker
/// ranks (65,536), `max_peer_load` per worker rank (65,536 requests, 2^30
/// prefill tokens, 2^24 decode blocks), one snapshot sent per
/// `min_snapshot_interval` (100 ms) whoever asks, a batch more than 1,024
/// ahead of the last applied is not believed, and a silent peer's tables
/// go after `peer_timeout`. Each peer's load counts exactly and capped on
/// its own: no peer can erase another's. A replica that sees a message in
/// its own name that it did not send takes a new incarnation, so that its
/// peers rebuild its table.
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
    /// subject and asks the peers for snapshots; returns once the
    /// subscription is written to the server. The server registers it in
    /// its own time: a publication by another connection in the meantime
    /// may miss this replica, which is why it asks the peers for snapshots
    /// (on its own connection, after the subscription).
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
        let shared = Arc::new(Shared::new(&options));
        let subject = options.subject.clone();
        let sync_loop = task::SyncLoop::new(server.clone(), replica_id, random_u64(), options, shared.clone());
        ReplicaSync::start(&server, subject, replica_id, shared, move |stop, ready| {
            sync_loop.run(stop, ready)
        })
    }

    /// Starts the background thread running `work` (which reports on
    /// `ready` once subscribed, or why it cannot start, and returns why it
    /// stopped if not asked to) and waits for it to be ready.
    fn start(
        url: &str,
        subject: String,
        replica_id: u64,
        shared: Arc<Shared>,
        work: impl FnOnce(tokio::sync::watch::Receiver<()>, mpsc::Sender<Result<(), SyncError>>) -> Option<String>
            + Send
            + 'static,
    ) -> Result<ReplicaSync, SyncError> {
        let server = url.to_owned();
        let (stop, stopped) = tokio::sync::watch::channel(());
        let (ready_tx, ready_rx) = mpsc::channel();
        let unavailable = |message: String| SyncError::Unavailable {
            server: server.clone(),
            message,
        };
        let on_exit = StopOnExit(Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("selkie-replica-sync".into())
            .spawn(move || {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(stopped, ready_tx)));
                let reason = match outcome {
                    Ok(reason) => reason,
                    Err(panic) => {
                        let message = panic
                            .downcast_ref::<&str>()
                            .map(|s| (*s).to_owned())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "(no message)".into());
                        Some(format!("the replica sync thread panicked: {message}"))
                    }
                };
                if let Some(reason) = reason {
                    tracing::error!(%reason, "replica sync stopped; the peers' load is removed");
                    on_exit.0.stop(reason);
                }
                drop(on_exit);
            })
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
    /// whether the delta was queued (`false`: the queue was full, or the
    /// background thread stopped; the delta is dropped and counted).
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
        // Closed (and so `false`) once the thread stopped.
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
            refused_rows: get(&c.refused_rows),
            capped: get(&c.capped),
            refused: c.refused(),
            peers: get(&c.peers),
            peer_rows: get(&c.peer_rows),
            peers_expired: get(&c.peers_expired),
            snapshots_sent: get(&c.snapshots_sent),
            snapshots_deferred: get(&c.snapshots_deferred),
            snapshots_received: get(&c.snapshots_received),
            snapshot_requests: get(&c.snapshot_requests),
            reconnects: get(&c.reconnects),
            decode_errors: get(&c.decode_errors),
            id_conflicts: get(&c.id_conflicts),
            reincarnations: get(&c.reincarnations),
        }
    }

    /// Whether the background thread still runs, and if not, why.
    pub fn health(&self) -> SyncHealth {
        if self.shared.running.load(Ordering::Acquire) {
            return SyncHealth::Running;
        }
        let reason = self
            .shared
            .stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        SyncHealth::Stopped {
            reason: reason.unwrap_or_default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A sync whose thread does `work` (a stand-in for the NATS loop).
    fn started(
        work: impl FnOnce(tokio::sync::watch::Receiver<()>, mpsc::Sender<Result<(), SyncError>>) -> Option<String>
            + Send
            + 'static,
    ) -> ReplicaSync {
        let options = ReplicaSyncOptions::default();
        let shared = Arc::new(Shared::new(&options));
        ReplicaSync::start("nats://test", options.subject.clone(), 1, shared, work).unwrap()
    }

    fn wait_stopped(sync: &ReplicaSync) -> String {
        let start = std::time::Instant::now();
        loop {
            if let SyncHealth::Stopped { reason } = sync.health() {
                return reason;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_thread_that_panics_is_reported_and_recording_stops_claiming_success() {
        let (go, wait) = mpsc::channel::<()>();
        let sync = started(move |_stop, ready| {
            ready.send(Ok(())).unwrap();
            wait.recv().unwrap();
            panic!("period must be non-zero");
        });
        let w = WorkerWithDpRank::new(1, 0);
        // A peer's load the thread applied before it died.
        {
            let mut tables = sync.shared.tables();
            let batch = wire::Envelope {
                replica: 2,
                incarnation: 1,
                seq: 1,
                sent: 0,
                body: wire::Body::Deltas(vec![Delta::Book(
                    1,
                    Booked {
                        worker: w,
                        prefill_tokens: 1,
                        decode_blocks: 1,
                    },
                )]),
            };
            tables.apply(batch, std::time::Instant::now(), 0, Duration::from_secs(1));
        }
        assert_eq!(sync.remote_load(w).requests, 1);
        assert_eq!(sync.health(), SyncHealth::Running);
        assert!(sync.record_book(1, w, 1, 1));
        let version = sync.version();
        go.send(()).unwrap();
        let reason = wait_stopped(&sync);
        assert!(reason.contains("panicked: period must be non-zero"), "{reason}");
        assert!(!sync.record_book(2, w, 1, 1), "nothing would publish it");
        assert!(!sync.record_release(2));
        assert_eq!(sync.stats().dropped, 2);
        assert!(sync.remote_loads().is_empty(), "the peers' load is not kept frozen");
        assert!(sync.version() > version, "a reader sees the change");
    }

    #[test]
    fn a_thread_that_ends_says_why() {
        let sync = started(|_stop, ready| {
            ready.send(Ok(())).unwrap();
            Some("the subscription to selkie.bookings ended".into())
        });
        assert_eq!(wait_stopped(&sync), "the subscription to selkie.bookings ended");
        assert!(!sync.record_prefill_complete(1));
    }

    #[test]
    fn each_bound_named_in_an_invalid_option_is_the_constant() {
        let o = ReplicaSyncOptions::default;
        let requirement = |options: ReplicaSyncOptions| match options.validate() {
            Err(SyncError::InvalidOption { requirement, .. }) => requirement,
            other => panic!("{other:?}"),
        };
        type O = ReplicaSyncOptions;
        let max = format!("{:?}", O::MAX_DURATION);
        for (options, bound) in [
            (
                o().with_batch_interval(Duration::ZERO),
                format!("{:?}", O::MIN_BATCH_INTERVAL),
            ),
            (
                o().with_batch_interval(Duration::MAX),
                format!("{:?}", O::MAX_BATCH_INTERVAL),
            ),
            (o().with_batch_max_events(usize::MAX), O::MAX_BATCH_EVENTS.to_string()),
            (o().with_queue_capacity(usize::MAX), O::MAX_QUEUE_CAPACITY.to_string()),
            (o().with_heartbeat_interval(Duration::MAX), max.clone()),
            (o().with_connect_timeout(Duration::MAX), max.clone()),
            (o().with_peer_timeout(Duration::MAX), max.clone()),
            (o().with_max_reconnect_delay(Duration::MAX), max.clone()),
            (o().with_min_snapshot_interval(Duration::MAX), max),
            (
                o().with_signing_key([1; 3]),
                format!("{} bytes", O::MIN_SIGNING_KEY_BYTES),
            ),
            (o().with_max_peers(usize::MAX), O::MAX_PEERS.to_string()),
            (o().with_max_peer_rows(usize::MAX), O::MAX_PEER_ROWS.to_string()),
            (
                o().with_max_peer_load(RemoteLoad {
                    requests: u64::MAX,
                    ..o().max_peer_load()
                }),
                O::MAX_PEER_LOAD_FIELD.to_string(),
            ),
        ] {
            let said = requirement(options);
            assert!(said.contains(&bound), "{said:?} does not name {bound}");
        }
        assert!(o().validate().is_ok());
        // The sums stay exact: every peer at the cap on one worker rank.
        assert!((O::MAX_PEERS as u64).checked_mul(O::MAX_PEER_LOAD_FIELD).unwrap() < 1 << 60);
        assert!((O::MAX_PEER_ROWS as u64).checked_mul(u64::from(u32::MAX)).unwrap() < 1 << 60);
    }

    #[test]
    fn the_signing_key_is_not_shown() {
        let options = ReplicaSyncOptions::default().with_signing_key("a secret of twenty bytes");
        assert!(options.is_signed());
        assert!(!format!("{options:?}").contains("secret"), "{options:?}");
    }
}
