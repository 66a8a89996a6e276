//! The background thread behind [`ReplicaSync`](super::ReplicaSync): one
//! current-thread tokio runtime running one loop.
//!
//! ```text
//! connect, subscribe, flush                      (fails connect())
//! publish: snapshot request (every peer), heartbeat
//! loop, whichever comes first:
//!     stop                      -> publish the open batch; end
//!     batch tick                -> drain the recording threads' rings and the
//!                                  reported loads into the own table and the batch
//!                                  (changes only; a full batch is published at
//!                                  once), then publish the batch (seq + 1),
//!                                  and a snapshot owed, once due
//!     a message on the subject  -> signed partition: check the signature
//!                                  (refuse and count a bad one);
//!                                  own: ignore, but one in this replica's name
//!                                  and incarnation that it did not send (a
//!                                  sequence number or send time ahead of its
//!                                  own) makes it take a new incarnation and
//!                                  owe a snapshot;
//!                                  a snapshot request for this replica: publish
//!                                  the open batch, then the snapshot (at most one
//!                                  per min_snapshot_interval: a request inside it
//!                                  is answered by the next one, which answers every
//!                                  requester); else apply to the peer tables,
//!                                  asking a peer with a gap for a snapshot
//!     heartbeat tick            -> drain, publish a heartbeat, expire silent peers
//!                                  and stale snapshots, log refusals since the last
//!     connection back           -> snapshot request (every peer), heartbeat
//!     subscription ended        -> end, saying why (`ReplicaSync::health`)
//! ```
//!
//! Every message carries its send time: this replica's clock when it
//! started plus the time since, in milliseconds, so that it never goes
//! back within an incarnation even if the clock is set back.
//!
//! While the server is unreachable, batches are not published (counted;
//! their sequence numbers are used up, so peers see the gap and ask for a
//! snapshot) and the own table stays current. This module writes only the
//! shared tables and counters; it never touches the fleet, and nothing on
//! the selection path waits for it.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::connection::State;
use async_nats::{Client, ConnectOptions, Event, HeaderMap, Message, Subject, Subscriber};
use futures_util::StreamExt;
use tokio::sync::mpsc as async_mpsc;

use rustc_hash::FxHashMap;

use super::auth::{BadSignature, SIGNATURE_HEADER};
use super::connect;
use super::tables::OwnBookings;
use super::tables::Refusal;
use super::wire::{Body, Delta, Envelope, Loaded, ENVELOPE_BYTES, SNAPSHOT_ROW_BYTES};
use super::{bump, random_u64, RemoteLoad, ReplicaSyncOptions, Shared};
use crate::error::SyncError;
use crate::types::WorkerWithDpRank;

/// The server's payload limit when it has not said (NATS' default).
const DEFAULT_MAX_PAYLOAD: usize = 1 << 20;

pub(super) struct SyncLoop {
    server: String,
    replica: u64,
    incarnation: u64,
    options: ReplicaSyncOptions,
    shared: Arc<Shared>,
    own: OwnBookings,
    batch: Vec<Delta>,
    /// The deltas of one drain (kept for its capacity).
    drained: Vec<Delta>,
    /// The loads reported for one drain (kept for its capacity).
    reported: FxHashMap<WorkerWithDpRank, RemoteLoad>,
    /// Prefill completions and releases of bookings not (yet) in the own
    /// table, held back for one drain.
    held_back: Vec<Delta>,
    /// The last batch's sequence number (published or not).
    seq: u64,
    disconnected: bool,
    /// This replica's clock when it started, in ms since the Unix epoch,
    /// and the instant it read it: send times are `started_ms` plus the
    /// time since `started`.
    started_ms: u64,
    started: Instant,
    /// The latest send time stamped on a message.
    last_sent: u64,
    /// The incarnation before a new one was taken (its messages still on
    /// their way are this replica's own).
    old_incarnation: Option<u64>,
    /// When the last snapshot was sent, and whether one is owed.
    last_snapshot: Option<Instant>,
    snapshot_owed: bool,
    /// Refusals logged so far.
    refusals_logged: u64,
}

/// The connection, once made.
struct Link {
    client: Client,
    subject: Subject,
}

impl SyncLoop {
    pub(super) fn new(
        server: String,
        replica: u64,
        incarnation: u64,
        options: ReplicaSyncOptions,
        shared: Arc<Shared>,
    ) -> SyncLoop {
        let batch = Vec::with_capacity(options.batch_max_events);
        SyncLoop {
            server,
            replica,
            incarnation,
            options,
            shared,
            own: OwnBookings::default(),
            batch,
            drained: Vec::new(),
            reported: FxHashMap::default(),
            held_back: Vec::new(),
            seq: 0,
            disconnected: false,
            started_ms: unix_ms(),
            started: Instant::now(),
            last_sent: 0,
            old_incarnation: None,
            last_snapshot: None,
            snapshot_owed: false,
            refusals_logged: 0,
        }
    }

    /// Connects and subscribes (reporting the outcome on `ready`), then
    /// serves until `stop`'s sender is dropped. Returns why it stopped
    /// otherwise.
    pub(super) fn run(
        self,
        stop: tokio::sync::watch::Receiver<()>,
        ready: std::sync::mpsc::Sender<Result<(), SyncError>>,
    ) -> Option<String> {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(self.unavailable(format!("cannot start a tokio runtime: {e}"))));
                return None;
            }
        };
        rt.block_on(async move {
            let (events_tx, events) = async_mpsc::unbounded_channel();
            let (link, subscriber) = match self.connect(events_tx).await {
                Ok(connected) => connected,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return None;
                }
            };
            let _ = ready.send(Ok(()));
            tracing::info!(server = %self.server, subject = %link.subject, replica = self.replica, "replica sync connected");
            self.serve(&link, subscriber, events, stop).await
        })
    }

    async fn connect(&self, events: async_mpsc::UnboundedSender<Event>) -> Result<(Link, Subscriber), SyncError> {
        let max_delay = self.options.max_reconnect_delay;
        let timeout = self.options.connect_timeout;
        let connecting = (self.options.security.apply(ConnectOptions::new())?)
            .name(format!("selkie-replica-{}", self.replica))
            .connection_timeout(timeout)
            .max_reconnects(None)
            .reconnect_delay_callback(move |attempts| {
                if attempts <= 1 {
                    Duration::ZERO
                } else {
                    let exp = u32::try_from(attempts - 1).unwrap_or(u32::MAX).min(32);
                    Duration::from_millis(2u64.saturating_pow(exp)).min(max_delay)
                }
            })
            .event_callback(move |event| {
                let events = events.clone();
                async move {
                    let _ = events.send(event);
                }
            })
            .connect(self.server.as_str());
        let client = match tokio::time::timeout(timeout, connecting).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(connect::connect_failed(&self.server, &e)),
            Err(_) => return Err(self.unavailable(format!("cannot connect within {timeout:?}"))),
        };
        let subject = Subject::from(self.options.subject.as_str());
        let subscriber = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| self.unavailable(format!("cannot subscribe to {subject}: {e}")))?;
        // The subscription is written before anyone is asked for a
        // snapshot: the server handles one connection's operations in
        // order, so the answers find it.
        match tokio::time::timeout(timeout, client.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.unavailable(format!("cannot subscribe to {subject}: {e}"))),
            Err(_) => return Err(self.unavailable(format!("no answer to subscribing to {subject} within {timeout:?}"))),
        }
        Ok((Link { client, subject }, subscriber))
    }

    fn unavailable(&self, message: String) -> SyncError {
        SyncError::Unavailable {
            server: self.server.clone(),
            message,
        }
    }

    async fn serve(
        mut self,
        link: &Link,
        mut subscriber: Subscriber,
        mut events: async_mpsc::UnboundedReceiver<Event>,
        stop: tokio::sync::watch::Receiver<()>,
    ) -> Option<String> {
        let stopped = stopped(stop);
        tokio::pin!(stopped);
        self.request_snapshot(link, None).await;
        self.heartbeat(link).await;
        let mut heartbeat = tokio::time::interval(self.options.heartbeat_interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await; // the first tick is immediate
        let mut batch_tick = tokio::time::interval(self.options.batch_interval);
        batch_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ended = loop {
            tokio::select! {
                _ = &mut stopped => break None,
                Some(event) = events.recv() => self.on_event(link, event).await,
                message = subscriber.next() => match message {
                    Some(message) => self.on_message(link, &message).await,
                    None => break Some(format!("the subscription to {} ended", link.subject)),
                },
                _ = batch_tick.tick() => {
                    self.drain(link).await;
                    self.publish_batch(link).await;
                    if self.snapshot_owed && self.snapshot_due() {
                        self.send_snapshot(link).await;
                    }
                }
                _ = heartbeat.tick() => {
                    self.drain(link).await;
                    self.heartbeat(link).await;
                    self.expire();
                    self.log_refusals();
                }
            }
        };
        // Best effort: what was recorded before the drop goes out.
        self.drain(link).await;
        self.publish_batch(link).await;
        if link.client.connection_state() == State::Connected {
            let _ = tokio::time::timeout(Duration::from_millis(500), link.client.flush()).await;
        }
        ended
    }

    /// Moves the deltas recorded and the loads reported so far into the
    /// own table and the open batch (a reported load only if it changed).
    /// A prefill completion or release of a booking the own table
    /// does not hold waits for the next drain (its booking may sit in
    /// another thread's ring, drained earlier: see `ring`), and is then
    /// dropped if still unknown (its booking was dropped from a full ring).
    async fn drain(&mut self, link: &Link) {
        let mut reported = std::mem::take(&mut self.reported);
        std::mem::swap(&mut reported, &mut *self.shared.reported());
        for (worker, load) in reported.drain() {
            if let Some(delta) = self.own.apply(Delta::Load(Loaded { worker, load })) {
                self.push_delta(link, delta).await;
            }
        }
        self.reported = reported;
        let mut drained = std::mem::take(&mut self.drained);
        self.shared.rings.drain(|delta| drained.push(delta));
        let held_back = std::mem::take(&mut self.held_back);
        for delta in drained.drain(..) {
            match self.own.apply(delta) {
                Some(delta) => self.push_delta(link, delta).await,
                None => self.held_back.push(delta),
            }
        }
        for delta in held_back {
            if let Some(delta) = self.own.apply(delta) {
                self.push_delta(link, delta).await;
            }
        }
        self.drained = drained;
    }

    /// Adds a delta to the open batch, publishing it once full.
    async fn push_delta(&mut self, link: &Link, delta: Delta) {
        self.batch.push(delta);
        if self.batch.len() >= self.options.batch_max_events {
            self.publish_batch(link).await;
        }
    }

    async fn publish_batch(&mut self, link: &Link) {
        if self.batch.is_empty() {
            return;
        }
        self.seq += 1;
        let events = self.batch.len() as u64;
        let batch = std::mem::take(&mut self.batch);
        let mut message = self.envelope(Body::Deltas(batch));
        let c = &self.shared.counters;
        if self.publish(link, &message).await {
            bump(&c.published_batches, 1);
            bump(&c.published_events, events);
        } else {
            bump(&c.unpublished_batches, 1);
        }
        if let Body::Deltas(batch) = &mut message.body {
            batch.clear();
            self.batch = std::mem::take(batch);
        }
    }

    async fn heartbeat(&mut self, link: &Link) {
        let message = self.envelope(Body::Heartbeat);
        self.publish(link, &message).await;
    }

    async fn request_snapshot(&mut self, link: &Link, peer: Option<u64>) {
        let message = self.envelope(Body::SnapshotRequest(peer));
        if self.publish(link, &message).await {
            bump(&self.shared.counters.snapshot_requests, 1);
        }
    }

    /// Publishes the open batch, then the own table (bookings, then
    /// reported loads) as of it, in parts that fit the server's payload
    /// limit.
    async fn send_snapshot(&mut self, link: &Link) {
        self.last_snapshot = Some(Instant::now());
        self.snapshot_owed = false;
        self.publish_batch(link).await;
        let max_payload = match link.client.server_info().max_payload {
            0 => DEFAULT_MAX_PAYLOAD,
            n => n,
        };
        let per_part = (max_payload.saturating_sub(ENVELOPE_BYTES) / SNAPSHOT_ROW_BYTES).max(1);
        let rows = self.own.rows();
        let loads = self.own.loads();
        let total = rows.len() + loads.len();
        let parts = total.div_ceil(per_part).max(1);
        for part in 0..parts {
            let (of_bookings, of_loads) = part_ranges(rows.len(), total, per_part, part);
            let bookings = rows.get(of_bookings).unwrap_or(&[]);
            let loads = loads.get(of_loads).unwrap_or(&[]);
            let message = self.envelope(Body::Snapshot {
                part: part as u32,
                last: part + 1 == parts,
                bookings: bookings.to_vec(),
                loads: loads.to_vec(),
            });
            if !self.publish(link, &message).await {
                return;
            }
        }
        tracing::debug!(
            replica = self.replica,
            held = self.own.len(),
            parts,
            seq = self.seq,
            "replica sync snapshot sent"
        );
        bump(&self.shared.counters.snapshots_sent, 1);
    }

    /// Whether a snapshot may be sent now (`min_snapshot_interval` after
    /// the last).
    fn snapshot_due(&self) -> bool {
        self.last_snapshot
            .is_none_or(|t| t.elapsed() >= self.options.min_snapshot_interval)
    }

    /// Answers a snapshot request: now if one is due, else with the next
    /// (which answers every requester).
    async fn answer_snapshot_request(&mut self, link: &Link) {
        if self.snapshot_due() {
            self.send_snapshot(link).await;
        } else {
            self.snapshot_owed = true;
            bump(&self.shared.counters.snapshots_deferred, 1);
        }
    }

    fn envelope(&mut self, body: Body) -> Envelope {
        let elapsed = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_sent = self.started_ms.saturating_add(elapsed).max(self.last_sent);
        Envelope {
            replica: self.replica,
            incarnation: self.incarnation,
            seq: self.seq,
            sent: self.last_sent,
            body,
        }
    }

    /// Publishes `message` (signed, in a signed partition) if the server
    /// is reachable; never waits longer than a heartbeat interval for room
    /// in the client's buffer.
    async fn publish(&self, link: &Link, message: &Envelope) -> bool {
        if link.client.connection_state() != State::Connected {
            return false;
        }
        let wait = self.options.heartbeat_interval;
        let payload = message.encode();
        let publishing = async {
            match self.options.key() {
                Some(key) => {
                    let mut headers = HeaderMap::new();
                    headers.insert(SIGNATURE_HEADER, key.sign(link.subject.as_str(), &payload));
                    link.client
                        .publish_with_headers(link.subject.clone(), headers, payload.into())
                        .await
                }
                None => link.client.publish(link.subject.clone(), payload.into()).await,
            }
        };
        let failure = match tokio::time::timeout(wait, publishing).await {
            Ok(Ok(())) => return true,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no room in the client's buffer within {wait:?}"),
        };
        bump(&self.shared.counters.publish_errors, 1);
        tracing::warn!(server = %self.server, subject = %link.subject, error = %failure, "replica sync cannot publish");
        false
    }

    async fn on_message(&mut self, link: &Link, received: &Message) {
        let c = &self.shared.counters;
        let payload = &received.payload[..];
        if let Some(key) = self.options.key() {
            let signature = received
                .headers
                .as_ref()
                .and_then(|h| h.get(SIGNATURE_HEADER))
                .map(|v| v.as_str());
            if let Err(bad) = key.verify(link.subject.as_str(), payload, signature) {
                let why = match bad {
                    BadSignature::Missing => Refusal::Unsigned,
                    BadSignature::Wrong => Refusal::BadSignature,
                };
                c.refuse(why, 1);
                tracing::debug!(subject = %link.subject, reason = why.as_str(), "replica sync message refused");
                return;
            }
        }
        let message = match Envelope::decode(payload) {
            Ok(m) => m,
            Err(e) => {
                bump(&c.decode_errors, 1);
                tracing::warn!(server = %self.server, subject = %link.subject, error = %e, "replica sync message ignored: cannot decode it");
                return;
            }
        };
        if message.replica == self.replica {
            return self.on_own_name(link, &message).await;
        }
        let peer = message.replica;
        let asks_me = matches!(message.body, Body::SnapshotRequest(to) if to.is_none_or(|to| to == self.replica));
        let applied = {
            // Counted under the lock, so that stats agree with the loads
            // read after them.
            let mut tables = self.shared.tables();
            let applied = tables.apply(message, Instant::now(), unix_ms(), self.options.heartbeat_interval);
            self.shared.version.store(tables.version(), Ordering::Release);
            c.peers.store(tables.peers() as u64, Ordering::Relaxed);
            c.peer_rows.store(tables.rows() as u64, Ordering::Relaxed);
            bump(&c.applied, applied.deltas);
            bump(&c.skipped, applied.skipped);
            bump(&c.unknown, applied.unknown);
            bump(&c.refused_rows, applied.rows_refused);
            bump(&c.capped, applied.capped);
            bump(&c.snapshots_received, u64::from(applied.snapshot));
            if let Some(refusal) = applied.refused {
                c.refuse(refusal, 1);
            }
            applied
        };
        if let Some(refusal) = applied.refused {
            tracing::debug!(
                replica = self.replica,
                peer,
                reason = refusal.as_str(),
                "replica sync message refused"
            );
            if !applied.ask_snapshot {
                return;
            }
        }
        if applied.new_peer {
            tracing::info!(replica = self.replica, peer, "replica sync peer joined");
        }
        if applied.ask_snapshot {
            self.request_snapshot(link, Some(peer)).await;
        }
        if asks_me && applied.refused.is_none() {
            self.answer_snapshot_request(link).await;
        }
    }

    /// A message in this replica's name: its own (ignored), a signed one
    /// sent before this replica started (a predecessor's, replayed:
    /// refused), another replica given the same id (counted), or one it
    /// never sent in its
    /// own incarnation (a forgery, or a copy of this replica): counted, and
    /// this replica takes a new incarnation, so that its peers drop
    /// whatever the message made them believe and rebuild its table from
    /// the snapshot it then owes.
    async fn on_own_name(&mut self, link: &Link, message: &Envelope) {
        let c = &self.shared.counters;
        if message.incarnation == self.incarnation {
            if message.seq <= self.seq && message.sent <= self.last_sent {
                return; // its own
            }
            bump(&c.id_conflicts, 1);
            bump(&c.reincarnations, 1);
            self.old_incarnation = Some(self.incarnation);
            self.incarnation = random_u64();
            tracing::warn!(
                replica = self.replica,
                subject = %link.subject,
                seq = message.seq,
                own_seq = self.seq,
                "a message in this replica's name that it did not send; it takes a new incarnation"
            );
            self.heartbeat(link).await;
            self.answer_snapshot_request(link).await;
        } else if self.options.is_signed() && message.sent < self.started_ms {
            // Signed before this replica started: a predecessor's message
            // (this replica restarted with its id), replayed.
            c.refuse(Refusal::Replayed, 1);
        } else if Some(message.incarnation) != self.old_incarnation {
            bump(&c.id_conflicts, 1);
            tracing::warn!(replica = self.replica, subject = %link.subject, "another replica uses this replica's id; its messages are ignored");
        }
    }

    /// Logs the refusals counted since the last call, if any (a flood of
    /// forged messages logs once per heartbeat, not once per message).
    fn log_refusals(&mut self) {
        let refused = self.shared.counters.refused();
        let total = refused.total();
        if total > self.refusals_logged {
            tracing::warn!(
                replica = self.replica,
                new = total - self.refusals_logged,
                ?refused,
                "replica sync refused peers' messages"
            );
            self.refusals_logged = total;
        }
    }

    fn expire(&self) {
        let timeout = self.options.peer_timeout;
        let mut tables = self.shared.tables();
        let expired = tables.expire(Instant::now());
        let c = &self.shared.counters;
        c.refuse(Refusal::SnapshotExpired, expired.snapshots);
        c.peer_rows.store(tables.rows() as u64, Ordering::Relaxed);
        if expired.peers.is_empty() {
            return;
        }
        self.shared.version.store(tables.version(), Ordering::Release);
        c.peers.store(tables.peers() as u64, Ordering::Relaxed);
        bump(&c.peers_expired, expired.peers.len() as u64);
        drop(tables);
        for (peer, held) in expired.peers {
            tracing::warn!(
                replica = self.replica,
                peer,
                held,
                ?timeout,
                "replica sync peer silent; its load is removed"
            );
        }
    }

    async fn on_event(&mut self, link: &Link, event: Event) {
        match event {
            Event::Disconnected => {
                self.disconnected = true;
                tracing::warn!(server = %self.server, "replica sync lost the NATS server; reconnecting");
            }
            Event::Connected if self.disconnected => {
                self.disconnected = false;
                bump(&self.shared.counters.reconnects, 1);
                tracing::info!(server = %self.server, "replica sync reconnected; asking peers for snapshots");
                self.request_snapshot(link, None).await;
                self.heartbeat(link).await;
            }
            // Messages were dropped for this replica: the gaps they leave
            // are noticed from the next message of each peer concerned.
            Event::SlowConsumer(_) => {
                tracing::warn!(server = %self.server, "replica sync fell behind; the server dropped messages for it")
            }
            other => tracing::debug!(server = %self.server, event = %other, "replica sync connection event"),
        }
    }
}

/// Which bookings and which loads snapshot part `part` holds, of
/// `bookings` bookings followed by loads, `total` rows in all, `per_part`
/// rows a part.
pub(super) fn part_ranges(bookings: usize, total: usize, per_part: usize, part: usize) -> (Range<usize>, Range<usize>) {
    let start = (part * per_part).min(total);
    let end = total.min(start + per_part);
    (
        start.min(bookings)..end.min(bookings),
        start.saturating_sub(bookings)..end.saturating_sub(bookings),
    )
}

/// This machine's clock, in milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Resolves once the stop sender is dropped.
async fn stopped(mut stop: tokio::sync::watch::Receiver<()>) {
    while stop.changed().await.is_ok() {}
}

#[cfg(test)]
mod tests {
    use super::part_ranges;

    #[test]
    fn snapshot_parts_hold_every_booking_then_every_load_once() {
        for bookings in 0..7usize {
            for loads in 0..7usize {
                for per_part in 1..5usize {
                    let total = bookings + loads;
                    let parts = total.div_ceil(per_part).max(1);
                    let (mut seen_b, mut seen_l) = (Vec::new(), Vec::new());
                    for part in 0..parts {
                        let (b, l) = part_ranges(bookings, total, per_part, part);
                        assert!(b.len() + l.len() <= per_part, "part {part} too big");
                        assert!(part + 1 == parts || b.len() + l.len() == per_part, "part {part} short");
                        seen_b.extend(b);
                        seen_l.extend(l);
                    }
                    assert_eq!(
                        seen_b,
                        (0..bookings).collect::<Vec<_>>(),
                        "{bookings} {loads} {per_part}"
                    );
                    assert_eq!(seen_l, (0..loads).collect::<Vec<_>>(), "{bookings} {loads} {per_part}");
                }
            }
        }
    }
}
