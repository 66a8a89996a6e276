//! The booking tables replica sync keeps: this replica's own outstanding
//! bookings and reported loads ([`OwnBookings`], what a snapshot it sends
//! holds) and its peers' ([`PeerTables`], one table per peer and their
//! sum per worker rank).
//!
//! The rules for a peer's messages, which make applying them idempotent,
//! keep a snapshot from counting a delta twice, and bound what a peer can
//! make this replica hold ([`Limits`]):
//!
//! ```text
//! signed partition, send time off this clock by more than peer_timeout -> refused (stale)
//! signed partition, send time before the peer's latest                 -> refused (replayed)
//! unknown replica, max_peers known already  -> refused (peers full)
//! unknown replica, or a new incarnation     -> a fresh, empty table (an old one's load is removed);
//!                                              signed: only if sent after the old one's latest message
//! delta batch, seq <= last applied          -> skipped (already applied, or inside a snapshot)
//! delta batch, seq  > last + MAX_SEQ_GAP    -> not applied (refused as a jump once the peer was in
//!                                              sync), the peer is asked for a snapshot
//! delta batch, seq  > last + 1              -> applied, and the peer is asked for a snapshot (a gap)
//! heartbeat,   seq  > last applied          -> the peer is asked for a snapshot (a gap)
//! snapshot parts 0..=last, seq >= last      -> the peer's table is replaced, last applied = seq
//! snapshot part without rows (but a lone
//!   empty part 0), or past max_rows rows    -> the snapshot is dropped (refused)
//! snapshot unfinished after peer_timeout    -> dropped
//! nothing heard for peer_timeout            -> the peer and its load are removed
//! ```
//!
//! A booking that is booked again replaces itself; a prefill completion or
//! a release of a booking the table does not hold changes nothing (it is
//! counted). A reported load replaces the peer's earlier report for that
//! worker rank (zero removes it). A peer holds at most `max_rows` bookings
//! and reported worker ranks: a booking or a report of a new worker rank
//! past that is refused and counted.
//!
//! A peer's load on a worker rank is its bookings there plus its report,
//! summed exactly, and it counts in the sum per worker rank up to
//! `max_load` (field by field; the excess is counted, never added). The
//! sum per worker rank is kept exact: it always equals the sum of every
//! peer's capped load, so one peer's report, however large, can never
//! erase or inflate another's. This module is plain data: no I/O, no clock
//! of its own (the caller passes `now`), and it never touches the fleet.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::wire::{Body, Booked, Delta, Envelope, Loaded};
use super::RemoteLoad;
use crate::types::WorkerWithDpRank;

/// How far ahead of the last batch applied a peer's batch may be and
/// still be applied (the batches between are missing: the peer is asked
/// for a snapshot either way). Further ahead, the batch is not believed:
/// only a snapshot moves the peer's sequence that far.
pub(crate) const MAX_SEQ_GAP: u64 = 1024;

/// What a peer's messages may make this replica hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Peers known at once.
    pub(crate) max_peers: usize,
    /// Bookings plus reported worker ranks one peer holds, and the rows
    /// of one snapshot.
    pub(crate) max_rows: usize,
    /// The most one peer's load counts on one worker rank.
    pub(crate) max_load: RemoteLoad,
    /// How long a silent peer, or an unfinished snapshot, is kept; for
    /// signed messages also how far a send time may be off this clock.
    pub(crate) timeout: Duration,
    /// Messages are signed: their send times are checked.
    pub(crate) check_times: bool,
}

impl Default for Limits {
    fn default() -> Self {
        let options = super::ReplicaSyncOptions::default();
        options.limits()
    }
}

/// Why a peer's message was refused as a whole: the fields of
/// [`RefusedMessages`](super::RefusedMessages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Without a signature, in a signed partition (checked by the caller).
    Unsigned,
    /// With a signature that is not the key's (checked by the caller).
    BadSignature,
    /// Its send time is further from this replica's clock than the peer
    /// timeout.
    Stale,
    /// Sent before the latest message of its sender already seen (or an
    /// old incarnation's).
    Replayed,
    /// A delta batch too far ahead of the last one applied.
    SeqJump,
    /// A new peer when `max_peers` are known.
    PeersFull,
    /// A snapshot of more than `max_rows` rows.
    SnapshotTooLarge,
    /// A snapshot part that holds nothing (only a lone part 0 may).
    SnapshotMalformed,
    /// A snapshot unfinished after the timeout (dropped by `expire`).
    SnapshotExpired,
}

impl Refusal {
    /// How many there are.
    pub(crate) const COUNT: usize = 9;

    /// A short lowercase label, for logs.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Refusal::Unsigned => "unsigned",
            Refusal::BadSignature => "bad_signature",
            Refusal::Stale => "stale",
            Refusal::Replayed => "replayed",
            Refusal::SeqJump => "seq_jump",
            Refusal::PeersFull => "peers_full",
            Refusal::SnapshotTooLarge => "snapshot_too_large",
            Refusal::SnapshotMalformed => "snapshot_malformed",
            Refusal::SnapshotExpired => "snapshot_expired",
        }
    }
}

/// This replica's outstanding bookings and reported loads, as the deltas
/// it recorded left them.
#[derive(Default)]
pub(crate) struct OwnBookings {
    bookings: FxHashMap<u64, Booked>,
    /// Non-zero reported loads only.
    loads: FxHashMap<WorkerWithDpRank, RemoteLoad>,
}

impl OwnBookings {
    /// Applies one recorded delta; returns it if it changed the table (so
    /// it is worth publishing), `None` for a prefill completion or release
    /// of a booking not held (its booking was dropped from a full queue,
    /// or it was released already).
    pub(crate) fn apply(&mut self, delta: Delta) -> Option<Delta> {
        match delta {
            Delta::Book(id, booked) => {
                self.bookings.insert(id, booked);
                Some(delta)
            }
            Delta::PrefillComplete(id) => {
                let b = self.bookings.get_mut(&id)?;
                b.prefill_tokens = 0;
                Some(delta)
            }
            Delta::Release(id) => self.bookings.remove(&id).map(|_| delta),
            Delta::Load(Loaded { worker, load }) => (set_load(&mut self.loads, worker, load) != load).then_some(delta),
        }
    }

    /// Every outstanding booking, for a snapshot.
    pub(crate) fn rows(&self) -> Vec<(u64, Booked)> {
        self.bookings.iter().map(|(&id, &b)| (id, b)).collect()
    }

    /// Every non-zero reported load, for a snapshot.
    pub(crate) fn loads(&self) -> Vec<Loaded> {
        self.loads
            .iter()
            .map(|(&worker, &load)| Loaded { worker, load })
            .collect()
    }

    /// Bookings and reported loads held.
    pub(crate) fn len(&self) -> usize {
        self.bookings.len() + self.loads.len()
    }
}

/// What applying one message did, for the caller's counters and replies.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Applied {
    /// Deltas applied.
    pub(crate) deltas: u64,
    /// Deltas skipped: their batch was at or below the last applied (or,
    /// for a peer not in sync yet, far ahead of it).
    pub(crate) skipped: u64,
    /// Prefill completions or releases of bookings the table does not hold.
    pub(crate) unknown: u64,
    /// Bookings and reports of new worker ranks refused: the peer holds
    /// `max_rows` already.
    pub(crate) rows_refused: u64,
    /// Changes that left the peer's load on a worker rank above
    /// `max_load` (the excess does not count).
    pub(crate) capped: u64,
    /// The whole message was refused, and why.
    pub(crate) refused: Option<Refusal>,
    /// A snapshot replaced the peer's table.
    pub(crate) snapshot: bool,
    /// The peer was not known (or restarted): a new table.
    pub(crate) new_peer: bool,
    /// Ask the peer for a snapshot: it sent something this replica missed.
    pub(crate) ask_snapshot: bool,
}

impl Applied {
    fn refused(refusal: Refusal) -> Applied {
        Applied {
            refused: Some(refusal),
            ..Applied::default()
        }
    }
}

/// A snapshot being received part by part.
struct Staging {
    seq: u64,
    next_part: u32,
    started: Instant,
    bookings: Vec<(u64, Booked)>,
    loads: Vec<Loaded>,
}

impl Staging {
    fn rows(&self) -> usize {
        self.bookings.len() + self.loads.len()
    }
}

/// One peer as this replica knows it.
struct Peer {
    incarnation: u64,
    /// The last delta batch applied (or reflected by the snapshot applied).
    last_seq: u64,
    /// A snapshot was applied, or every batch since the first: `last_seq`
    /// is the peer's.
    in_sync: bool,
    /// The latest send time seen (signed partitions).
    latest_sent: u64,
    heard: Instant,
    /// When this replica last asked it for a snapshot.
    asked: Option<Instant>,
    held: Held,
    staging: Option<Staging>,
}

/// What one peer holds: its bookings, its reported loads (non-zero, each
/// within `max_load`), and their exact sum per worker rank (non-zero).
#[derive(Default)]
struct Held {
    bookings: FxHashMap<u64, Booked>,
    loads: FxHashMap<WorkerWithDpRank, RemoteLoad>,
    per_worker: FxHashMap<WorkerWithDpRank, RemoteLoad>,
}

impl Held {
    fn len(&self) -> usize {
        self.bookings.len() + self.loads.len()
    }
}

impl Peer {
    fn new(incarnation: u64, now: Instant, sent: u64) -> Peer {
        Peer {
            incarnation,
            last_seq: 0,
            in_sync: false,
            latest_sent: sent,
            heard: now,
            asked: None,
            held: Held::default(),
            staging: None,
        }
    }
}

/// The peers' bookings, one table per peer, and their sum per worker rank.
pub(crate) struct PeerTables {
    limits: Limits,
    peers: FxHashMap<u64, Peer>,
    /// Non-zero loads only: per worker rank, the sum of every peer's load
    /// there, each capped to `limits.max_load`.
    aggregate: BTreeMap<WorkerWithDpRank, RemoteLoad>,
    /// Moves on every change to `aggregate`.
    version: u64,
}

impl Default for PeerTables {
    fn default() -> Self {
        PeerTables::new(Limits::default())
    }
}

/// What expiring silent peers removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Expired {
    /// Each peer removed, with the bookings and reported loads it held.
    pub(crate) peers: Vec<(u64, usize)>,
    /// Unfinished snapshots dropped.
    pub(crate) snapshots: u64,
}

/// The sum per worker rank, and its version counter.
struct Aggregate<'a> {
    loads: &'a mut BTreeMap<WorkerWithDpRank, RemoteLoad>,
    version: &'a mut u64,
    max_load: RemoteLoad,
}

/// Sets `worker`'s reported load in `loads` (zero removes it, so the map
/// holds non-zero loads only); returns the load it replaced.
fn set_load(
    loads: &mut FxHashMap<WorkerWithDpRank, RemoteLoad>,
    worker: WorkerWithDpRank,
    load: RemoteLoad,
) -> RemoteLoad {
    let old = if load == RemoteLoad::default() {
        loads.remove(&worker)
    } else {
        loads.insert(worker, load)
    };
    old.unwrap_or_default()
}

/// One booking's load.
fn load_of(b: Booked) -> RemoteLoad {
    RemoteLoad {
        requests: 1,
        prefill_tokens: u64::from(b.prefill_tokens),
        decode_blocks: u64::from(b.decode_blocks),
    }
}

/// `load`, field by field no more than `max`.
pub(crate) fn capped(load: RemoteLoad, max: RemoteLoad) -> RemoteLoad {
    RemoteLoad {
        requests: load.requests.min(max.requests),
        prefill_tokens: load.prefill_tokens.min(max.prefill_tokens),
        decode_blocks: load.decode_blocks.min(max.decode_blocks),
    }
}

/// `a + b`, field by field. The tables' sums never come near `u64::MAX`:
/// a peer's exact sum is at most `max_rows` bookings of `u32` values plus
/// one report within `max_load`, and the sum over peers at most
/// `max_peers` capped loads (the options' bounds keep both below 2^60).
fn plus(a: RemoteLoad, b: RemoteLoad) -> RemoteLoad {
    RemoteLoad {
        requests: a.requests + b.requests,
        prefill_tokens: a.prefill_tokens + b.prefill_tokens,
        decode_blocks: a.decode_blocks + b.decode_blocks,
    }
}

/// `a - b`, field by field, for `b` a part of the sum `a`.
fn minus(a: RemoteLoad, b: RemoteLoad) -> RemoteLoad {
    RemoteLoad {
        requests: a.requests - b.requests,
        prefill_tokens: a.prefill_tokens - b.prefill_tokens,
        decode_blocks: a.decode_blocks - b.decode_blocks,
    }
}

impl Aggregate<'_> {
    /// Changes a peer's exact load on `worker` from `old` to `new` (both
    /// uncapped) and the sum by the change of its capped load. Returns
    /// whether `new` is above the cap.
    fn change(&mut self, worker: WorkerWithDpRank, old: RemoteLoad, new: RemoteLoad) -> bool {
        let (was, now) = (capped(old, self.max_load), capped(new, self.max_load));
        if was != now {
            let sum = self.loads.entry(worker).or_default();
            *sum = plus(minus(*sum, was), now);
            if *sum == RemoteLoad::default() {
                self.loads.remove(&worker);
            }
            *self.version += 1;
        }
        now != new
    }

    /// Adds `add` to the peer's exact load on `worker`, or takes `sub`
    /// off it; returns whether the result is above the cap.
    fn shift(&mut self, held: &mut Held, worker: WorkerWithDpRank, add: RemoteLoad, sub: RemoteLoad) -> bool {
        let old = held.per_worker.get(&worker).copied().unwrap_or_default();
        let new = minus(plus(old, add), sub);
        if new == RemoteLoad::default() {
            held.per_worker.remove(&worker);
        } else {
            held.per_worker.insert(worker, new);
        }
        self.change(worker, old, new)
    }

    fn apply(&mut self, held: &mut Held, delta: Delta, max_rows: usize, applied: &mut Applied) {
        let zero = RemoteLoad::default();
        let capped_now = match delta {
            Delta::Book(id, booked) => match held.bookings.get(&id).copied() {
                Some(old) if old == booked => false,
                Some(old) => {
                    held.bookings.insert(id, booked);
                    self.shift(held, old.worker, zero, load_of(old));
                    self.shift(held, booked.worker, load_of(booked), zero)
                }
                None if held.len() >= max_rows => {
                    applied.rows_refused += 1;
                    false
                }
                None => {
                    held.bookings.insert(id, booked);
                    self.shift(held, booked.worker, load_of(booked), zero)
                }
            },
            Delta::PrefillComplete(id) => match held.bookings.get_mut(&id) {
                Some(b) if b.prefill_tokens > 0 => {
                    let done = RemoteLoad {
                        prefill_tokens: u64::from(b.prefill_tokens),
                        ..zero
                    };
                    b.prefill_tokens = 0;
                    let worker = b.worker;
                    self.shift(held, worker, zero, done)
                }
                Some(_) => false,
                None => {
                    applied.unknown += 1;
                    false
                }
            },
            Delta::Release(id) => match held.bookings.remove(&id) {
                Some(old) => self.shift(held, old.worker, zero, load_of(old)),
                None => {
                    applied.unknown += 1;
                    false
                }
            },
            Delta::Load(Loaded { worker, load: reported }) => {
                let load = capped(reported, self.max_load);
                let known = held.loads.contains_key(&worker);
                if !known && load != zero && held.len() >= max_rows {
                    applied.rows_refused += 1;
                    false
                } else {
                    let old = set_load(&mut held.loads, worker, load);
                    let over = old != load && self.shift(held, worker, load, old);
                    over || load != reported
                }
            }
        };
        applied.capped += u64::from(capped_now);
    }

    fn remove_all(&mut self, held: &Held) {
        for (&worker, &load) in &held.per_worker {
            self.change(worker, load, RemoteLoad::default());
        }
    }
}

impl PeerTables {
    pub(crate) fn new(limits: Limits) -> PeerTables {
        PeerTables {
            limits,
            peers: FxHashMap::default(),
            aggregate: BTreeMap::new(),
            version: 0,
        }
    }

    /// Applies one message from a peer (the caller has dropped its own and
    /// checked its signature). `unix_ms` is this replica's clock, for the
    /// send times of a signed partition; `ask_every` bounds how often one
    /// peer is asked for a snapshot.
    pub(crate) fn apply(&mut self, message: Envelope, now: Instant, unix_ms: u64, ask_every: Duration) -> Applied {
        let limits = self.limits;
        let window = u64::try_from(limits.timeout.as_millis()).unwrap_or(u64::MAX);
        if limits.check_times && unix_ms.abs_diff(message.sent) > window {
            return Applied::refused(Refusal::Stale);
        }
        let mut applied = Applied::default();
        let mut aggregate = Aggregate {
            loads: &mut self.aggregate,
            version: &mut self.version,
            max_load: limits.max_load,
        };
        let known = self.peers.len();
        let peer = match self.peers.entry(message.replica) {
            Entry::Occupied(o) if o.get().incarnation == message.incarnation => {
                let peer = o.into_mut();
                if limits.check_times {
                    if message.sent < peer.latest_sent {
                        return Applied::refused(Refusal::Replayed);
                    }
                    // A message sent at the same time as the latest one (a
                    // replay of it, maybe) does not keep the peer alive.
                    if message.sent > peer.latest_sent {
                        peer.latest_sent = message.sent;
                        peer.heard = now;
                    }
                } else {
                    peer.heard = now;
                }
                peer
            }
            Entry::Occupied(mut o) => {
                if limits.check_times && message.sent <= o.get().latest_sent {
                    // An incarnation that spoke before the one known: an
                    // old one's message, replayed.
                    return Applied::refused(Refusal::Replayed);
                }
                // The same id, restarted: its earlier bookings went with it.
                let old = std::mem::replace(o.get_mut(), Peer::new(message.incarnation, now, message.sent));
                aggregate.remove_all(&old.held);
                applied.new_peer = true;
                o.into_mut()
            }
            Entry::Vacant(_) if known >= limits.max_peers => return Applied::refused(Refusal::PeersFull),
            Entry::Vacant(v) => {
                applied.new_peer = true;
                v.insert(Peer::new(message.incarnation, now, message.sent))
            }
        };
        let mut gap = false;
        match message.body {
            Body::Deltas(deltas) => {
                if message.seq <= peer.last_seq {
                    applied.skipped = deltas.len() as u64;
                    return applied;
                }
                gap = true;
                if message.seq - peer.last_seq > MAX_SEQ_GAP {
                    // Not believed: only a snapshot moves the peer this far.
                    if peer.in_sync {
                        applied.refused = Some(Refusal::SeqJump);
                    } else {
                        applied.skipped = deltas.len() as u64;
                    }
                } else {
                    gap = message.seq != peer.last_seq + 1;
                    // A batch after a snapshot's parts ends the snapshot;
                    // an unfinished one is a gap.
                    gap |= peer.staging.take().is_some();
                    peer.in_sync |= peer.last_seq == 0 && message.seq == 1;
                    applied.deltas = deltas.len() as u64;
                    for delta in deltas {
                        aggregate.apply(&mut peer.held, delta, limits.max_rows, &mut applied);
                    }
                    peer.last_seq = message.seq;
                }
            }
            Body::Heartbeat => gap = message.seq > peer.last_seq,
            Body::SnapshotRequest(_) => {}
            Body::Snapshot {
                part,
                last,
                bookings,
                loads,
            } => {
                if message.seq < peer.last_seq {
                    // Older than what is applied (a reordering): no use.
                    return applied;
                }
                if bookings.is_empty() && loads.is_empty() && !(part == 0 && last) {
                    // A sender splits a snapshot only into parts with rows.
                    peer.staging = None;
                    applied.refused = Some(Refusal::SnapshotMalformed);
                    return applied;
                }
                match (part, peer.staging.as_mut()) {
                    (0, _) => {
                        peer.staging = Some(Staging {
                            seq: message.seq,
                            next_part: 1,
                            started: now,
                            bookings,
                            loads,
                        })
                    }
                    (n, Some(s)) if s.seq == message.seq && s.next_part == n => {
                        s.bookings.extend(bookings);
                        s.loads.extend(loads);
                        s.next_part += 1;
                    }
                    _ => {
                        // A part went missing.
                        peer.staging = None;
                        gap = true;
                    }
                }
                if peer.staging.as_ref().is_some_and(|s| s.rows() > limits.max_rows) {
                    peer.staging = None;
                    applied.refused = Some(Refusal::SnapshotTooLarge);
                    return applied;
                }
                if last {
                    if let Some(staging) = peer.staging.take() {
                        aggregate.remove_all(&peer.held);
                        peer.held = Held::default();
                        let mut ignore = Applied::default();
                        for (id, booked) in staging.bookings {
                            aggregate.apply(&mut peer.held, Delta::Book(id, booked), limits.max_rows, &mut ignore);
                        }
                        for loaded in staging.loads {
                            aggregate.apply(&mut peer.held, Delta::Load(loaded), limits.max_rows, &mut ignore);
                        }
                        applied.capped += ignore.capped;
                        peer.last_seq = staging.seq;
                        peer.in_sync = true;
                        peer.asked = None;
                        applied.snapshot = true;
                    }
                }
            }
        }
        if gap && peer.asked.is_none_or(|t| now.saturating_duration_since(t) >= ask_every) {
            peer.asked = Some(now);
            applied.ask_snapshot = true;
        }
        applied
    }

    /// Removes the peers not heard from within the timeout, with their
    /// load, and drops the snapshots unfinished for that long.
    pub(crate) fn expire(&mut self, now: Instant) -> Expired {
        let timeout = self.limits.timeout;
        let mut expired = Expired::default();
        let mut aggregate = Aggregate {
            loads: &mut self.aggregate,
            version: &mut self.version,
            max_load: self.limits.max_load,
        };
        self.peers.retain(|&id, peer| {
            if now.saturating_duration_since(peer.heard) > timeout {
                aggregate.remove_all(&peer.held);
                expired.peers.push((id, peer.held.len()));
                return false;
            }
            if peer
                .staging
                .as_ref()
                .is_some_and(|s| now.saturating_duration_since(s.started) > timeout)
            {
                peer.staging = None;
                expired.snapshots += 1;
            }
            true
        });
        if !expired.peers.is_empty() && self.peers.is_empty() {
            // Give back the table's room too.
            self.peers = FxHashMap::default();
        }
        expired
    }

    /// Forgets every peer and its load (the sync stopped: their load can
    /// no longer be kept current).
    pub(crate) fn clear(&mut self) {
        self.peers = FxHashMap::default();
        if !self.aggregate.is_empty() {
            self.aggregate.clear();
            self.version += 1;
        }
    }

    pub(crate) fn load(&self, worker: WorkerWithDpRank) -> RemoteLoad {
        self.aggregate.get(&worker).copied().unwrap_or_default()
    }

    pub(crate) fn loads(&self) -> Vec<(WorkerWithDpRank, RemoteLoad)> {
        self.aggregate.iter().map(|(&w, &l)| (w, l)).collect()
    }

    pub(crate) fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Bookings and reported loads held for all peers, snapshots being
    /// received included.
    pub(crate) fn rows(&self) -> usize {
        self.peers
            .values()
            .map(|p| p.held.len() + p.staging.as_ref().map_or(0, Staging::rows))
            .sum()
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// Recomputes everything derived from the peers' bookings and reports
    /// and checks it, and the bounds: `Err` says what is off.
    #[cfg(test)]
    fn check(&self) -> Result<(), String> {
        let l = self.limits;
        if self.peers.len() > l.max_peers {
            return Err(format!("{} peers", self.peers.len()));
        }
        let mut sum: BTreeMap<WorkerWithDpRank, RemoteLoad> = BTreeMap::new();
        for (id, p) in &self.peers {
            if p.held.len() > l.max_rows || p.staging.as_ref().is_some_and(|s| s.rows() > l.max_rows) {
                return Err(format!("peer {id} holds {} rows", p.held.len()));
            }
            let mut exact: FxHashMap<WorkerWithDpRank, RemoteLoad> = FxHashMap::default();
            for b in p.held.bookings.values() {
                let e = exact.entry(b.worker).or_default();
                *e = plus(*e, load_of(*b));
            }
            for (w, r) in &p.held.loads {
                if *r == RemoteLoad::default() || capped(*r, l.max_load) != *r {
                    return Err(format!("peer {id} keeps report {r:?}"));
                }
                let e = exact.entry(*w).or_default();
                *e = plus(*e, *r);
            }
            if exact != p.held.per_worker {
                return Err(format!(
                    "peer {id}: per worker {:?}, recomputed {exact:?}",
                    p.held.per_worker
                ));
            }
            for (w, e) in exact {
                let s = sum.entry(w).or_default();
                *s = plus(*s, capped(e, l.max_load));
            }
        }
        sum.retain(|_, v| *v != RemoteLoad::default());
        if sum != self.aggregate {
            return Err(format!("sum {:?}, recomputed {sum:?}", self.aggregate));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The rules in the module docs, message by message, without a server.

    use super::*;

    const W: WorkerWithDpRank = WorkerWithDpRank::new(5, 1);
    const ASK: Duration = Duration::from_millis(100);

    fn booked(prefill: u32, decode: u32) -> Booked {
        Booked {
            worker: W,
            prefill_tokens: prefill,
            decode_blocks: decode,
        }
    }

    fn msg(replica: u64, seq: u64, body: Body) -> Envelope {
        Envelope {
            replica,
            incarnation: 1,
            seq,
            sent: 0,
            body,
        }
    }

    /// Tables with the default limits but for a one-second timeout.
    fn tables() -> PeerTables {
        PeerTables::new(Limits {
            timeout: Duration::from_secs(1),
            ..Limits::default()
        })
    }

    fn load(requests: u64, prefill_tokens: u64, decode_blocks: u64) -> RemoteLoad {
        RemoteLoad {
            requests,
            prefill_tokens,
            decode_blocks,
        }
    }

    #[test]
    fn deltas_add_and_remove_load_once_each() {
        let (mut t, now) = (tables(), Instant::now());
        let a = t.apply(
            msg(
                1,
                1,
                Body::Deltas(vec![Delta::Book(10, booked(100, 4)), Delta::Book(11, booked(50, 2))]),
            ),
            now,
            0,
            ASK,
        );
        assert!(a.new_peer && !a.ask_snapshot);
        assert_eq!(t.load(W), load(2, 150, 6));
        let v = t.version();
        // The same batch again (a redelivery) is skipped.
        let a = t.apply(
            msg(1, 1, Body::Deltas(vec![Delta::Book(10, booked(100, 4))])),
            now,
            0,
            ASK,
        );
        assert_eq!(a.skipped, 1);
        assert_eq!((t.load(W), t.version()), (load(2, 150, 6), v));
        t.apply(
            msg(
                1,
                2,
                Body::Deltas(vec![
                    Delta::PrefillComplete(10),
                    Delta::PrefillComplete(10),
                    Delta::Release(11),
                    Delta::Release(11),
                ]),
            ),
            now,
            0,
            ASK,
        );
        assert_eq!(t.load(W), load(1, 0, 4), "prefill complete removes prefill tokens only");
        let a = t.apply(msg(1, 3, Body::Deltas(vec![Delta::Release(10)])), now, 0, ASK);
        assert_eq!(a.unknown, 0);
        assert!(t.loads().is_empty(), "zero loads are not listed");
        assert!(t.version() > v);
    }

    #[test]
    fn a_gap_asks_for_a_snapshot_at_most_once_per_interval() {
        let (mut t, now) = (tables(), Instant::now());
        assert!(
            !t.apply(msg(1, 0, Body::Heartbeat), now, 0, ASK).ask_snapshot,
            "a fresh peer"
        );
        assert!(t.apply(msg(1, 3, Body::Heartbeat), now, 0, ASK).ask_snapshot);
        assert!(!t.apply(msg(1, 3, Body::Heartbeat), now, 0, ASK).ask_snapshot);
        assert!(t.apply(msg(1, 3, Body::Heartbeat), now + ASK, 0, ASK).ask_snapshot);
        let a = t.apply(msg(2, 7, Body::Deltas(vec![Delta::Release(1)])), now, 0, ASK);
        assert!(a.new_peer && a.ask_snapshot && a.unknown == 1);
    }

    #[test]
    fn a_snapshot_replaces_the_table_and_deltas_it_covers_are_skipped() {
        let (mut t, now) = (tables(), Instant::now());
        t.apply(msg(1, 1, Body::Deltas(vec![Delta::Book(1, booked(1, 1))])), now, 0, ASK);
        // Batches 2 and 3 were missed; the snapshot reflects batch 3.
        let part = |part, last, bookings| Body::Snapshot {
            part,
            last,
            bookings,
            loads: vec![],
        };
        t.apply(msg(1, 3, part(0, false, vec![(2, booked(10, 0))])), now, 0, ASK);
        assert_eq!(t.load(W), load(1, 1, 1), "nothing changes before the last part");
        let a = t.apply(msg(1, 3, part(1, true, vec![(3, booked(20, 0))])), now, 0, ASK);
        assert!(a.snapshot);
        assert_eq!(t.load(W), load(2, 30, 0));
        // Batch 3 arrives late: the snapshot already holds it.
        let a = t.apply(
            msg(1, 3, Body::Deltas(vec![Delta::Book(3, booked(20, 0))])),
            now,
            0,
            ASK,
        );
        assert_eq!((a.skipped, t.load(W)), (1, load(2, 30, 0)));
        t.apply(msg(1, 4, Body::Deltas(vec![Delta::Release(2)])), now, 0, ASK);
        assert_eq!(t.load(W), load(1, 20, 0));
        // A snapshot whose part 0 was lost is not applied, and asks again.
        let a = t.apply(msg(1, 5, part(1, true, vec![(4, booked(1, 0))])), now + ASK, 0, ASK);
        assert!(!a.snapshot && a.ask_snapshot);
        assert_eq!(t.load(W), load(1, 20, 0));
        // An older snapshot than what is applied is ignored.
        assert!(!t.apply(msg(1, 2, part(0, true, vec![])), now, 0, ASK).snapshot);
        assert_eq!(t.load(W), load(1, 20, 0));
    }

    #[test]
    fn a_restarted_peer_and_a_silent_peer_lose_their_load() {
        let (mut t, now) = (tables(), Instant::now());
        t.apply(msg(1, 1, Body::Deltas(vec![Delta::Book(1, booked(1, 1))])), now, 0, ASK);
        t.apply(msg(2, 1, Body::Deltas(vec![Delta::Book(1, booked(2, 2))])), now, 0, ASK);
        assert_eq!(t.load(W), load(2, 3, 3));
        let restarted = |seq| Envelope {
            incarnation: 2,
            ..msg(1, seq, Body::Heartbeat)
        };
        assert!(t.apply(restarted(0), now, 0, ASK).new_peer);
        assert_eq!(t.load(W), load(1, 2, 2), "replica 1's old bookings are gone");
        // Replica 1 (new incarnation) is heard again later; replica 2 is not.
        let later = now + Duration::from_secs(2);
        assert!(!t.apply(restarted(0), later, 0, ASK).new_peer);
        assert_eq!(t.expire(later).peers, [(2, 1)]);
        assert!(t.loads().is_empty());
        assert_eq!(t.peers(), 1);
    }

    #[test]
    fn signed_send_times_refuse_stale_and_replayed_messages() {
        let mut t = PeerTables::new(Limits {
            check_times: true,
            ..tables().limits
        });
        let now = Instant::now();
        let at = |incarnation, seq, sent, body| Envelope {
            incarnation,
            sent,
            ..msg(1, seq, body)
        };
        let book = |id| Body::Deltas(vec![Delta::Book(id, booked(1, 1))]);
        // One second either side of this clock (10,000 ms) is fresh.
        assert_eq!(
            t.apply(at(1, 1, 8_999, book(1)), now, 10_000, ASK).refused,
            Some(Refusal::Stale)
        );
        assert_eq!(
            t.apply(at(1, 1, 11_001, book(1)), now, 10_000, ASK).refused,
            Some(Refusal::Stale)
        );
        assert!(t.apply(at(1, 1, 10_000, book(1)), now, 10_000, ASK).new_peer);
        assert_eq!(
            t.apply(at(1, 2, 9_999, book(2)), now, 10_000, ASK).refused,
            Some(Refusal::Replayed)
        );
        // The same send time: applied, but it keeps nothing alive.
        let a = t.apply(at(1, 2, 10_000, book(2)), now + ASK * 9, 10_000, ASK);
        assert_eq!((a.refused, a.deltas), (None, 1));
        assert_eq!(
            t.expire(now + Duration::from_millis(1_001)).peers,
            [(1, 2)],
            "heard at 10,000 only"
        );
        // A new incarnation replaces the old only if it spoke later.
        t.apply(at(1, 1, 10_500, book(1)), now, 10_500, ASK);
        assert!(t.apply(at(2, 1, 10_600, book(7)), now, 10_600, ASK).new_peer);
        assert_eq!(t.load(W), load(1, 1, 1));
        let replayed = t.apply(at(1, 2, 10_550, book(3)), now, 10_600, ASK);
        assert_eq!(
            replayed.refused,
            Some(Refusal::Replayed),
            "the old incarnation's message"
        );
        assert_eq!(t.load(W), load(1, 1, 1), "the live incarnation's table stays");
    }

    fn report(worker: WorkerWithDpRank, requests: u64, prefill_tokens: u64, decode_blocks: u64) -> Delta {
        Delta::Load(Loaded {
            worker,
            load: load(requests, prefill_tokens, decode_blocks),
        })
    }

    #[test]
    fn a_reported_load_replaces_the_last_report_and_adds_to_the_peers_bookings() {
        let (mut t, now) = (tables(), Instant::now());
        let other = WorkerWithDpRank::new(6, 0);
        t.apply(
            msg(
                1,
                1,
                Body::Deltas(vec![
                    Delta::Book(10, booked(100, 4)),
                    report(W, 3, 30, 9),
                    report(other, 1, 0, 1),
                ]),
            ),
            now,
            0,
            ASK,
        );
        assert_eq!(
            t.load(W),
            load(4, 130, 13),
            "a booking and a report on one worker rank add up"
        );
        t.apply(msg(2, 1, Body::Deltas(vec![report(W, 1, 1, 1)])), now, 0, ASK);
        assert_eq!(t.load(W), load(5, 131, 14), "two peers add up");
        let v = t.version();
        t.apply(msg(1, 2, Body::Deltas(vec![report(W, 3, 30, 9)])), now, 0, ASK);
        assert_eq!(
            (t.load(W), t.version()),
            (load(5, 131, 14), v),
            "the same report changes nothing"
        );
        t.apply(msg(1, 3, Body::Deltas(vec![report(W, 2, 0, 6)])), now, 0, ASK);
        assert_eq!(t.load(W), load(4, 101, 11), "a report replaces the last one");
        t.apply(
            msg(
                1,
                4,
                Body::Deltas(vec![report(W, 0, 0, 0), Delta::Release(10), report(other, 0, 0, 0)]),
            ),
            now,
            0,
            ASK,
        );
        assert_eq!(t.loads(), [(W, load(1, 1, 1))], "a zero report removes it");
        // A snapshot replaces bookings and reports alike.
        let snapshot = Body::Snapshot {
            part: 0,
            last: true,
            bookings: vec![(11, booked(5, 5))],
            loads: vec![Loaded {
                worker: other,
                load: load(7, 0, 7),
            }],
        };
        t.apply(msg(1, 4, snapshot), now, 0, ASK);
        assert_eq!(t.loads(), [(W, load(2, 6, 6)), (other, load(7, 0, 7))]);
        // The peer restarts: its reports go with it.
        let restarted = Envelope {
            incarnation: 2,
            ..msg(1, 0, Body::Heartbeat)
        };
        t.apply(restarted, now, 0, ASK);
        assert_eq!(t.loads(), [(W, load(1, 1, 1))]);
        assert_eq!(t.expire(now + Duration::from_secs(2)).peers.len(), 2);
        assert!(t.loads().is_empty());
    }

    #[test]
    fn own_reports_forward_only_changes() {
        let mut own = OwnBookings::default();
        assert_eq!(
            own.apply(report(W, 0, 0, 0)),
            None,
            "zero is what an unreported worker holds"
        );
        assert!(own.apply(report(W, 2, 3, 4)).is_some());
        assert_eq!(own.apply(report(W, 2, 3, 4)), None);
        assert_eq!(own.len(), 1);
        assert!(own.apply(report(W, 0, 0, 0)).is_some());
        assert_eq!((own.len(), own.loads()), (0, vec![]));
    }

    #[test]
    fn own_bookings_forward_only_changes() {
        let mut own = OwnBookings::default();
        assert_eq!(own.apply(Delta::Release(1)), None);
        assert_eq!(own.apply(Delta::PrefillComplete(1)), None);
        assert!(own.apply(Delta::Book(1, booked(5, 5))).is_some());
        assert!(own.apply(Delta::PrefillComplete(1)).is_some());
        assert_eq!(own.rows(), [(1, booked(0, 5))]);
        assert!(own.apply(Delta::Release(1)).is_some());
        assert_eq!(own.len(), 0);
    }

    /// A model-based check: two peers book, complete prefills, release and
    /// report loads through `OwnBookings` (as the sync thread does), their
    /// batches reach this replica's tables (some lost), snapshots split
    /// into parts, restarts. Whenever no batch is missing, the tables sum
    /// exactly what each peer's own table holds.
    mod model {
        use super::*;
        use crate::replica::task::part_ranges;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Book {
                id: u8,
                worker: u8,
                prefill: u16,
                decode: u8,
            },
            Prefill {
                id: u8,
            },
            Release {
                id: u8,
            },
            Report {
                worker: u8,
                requests: u64,
                prefill: u64,
            },
            /// The batch open now is lost on its way.
            Lose,
            /// The peer sends a snapshot in parts of this many rows.
            Snapshot {
                per_part: u8,
            },
            /// The peer restarts with nothing (a new incarnation).
            Restart,
        }

        /// A reported value: mostly in `small`, sometimes far past any
        /// cap, `u64::MAX` included.
        fn huge(small: std::ops::Range<u64>) -> impl Strategy<Value = u64> {
            prop_oneof![6 => small, 1 => Just(u64::MAX), 1 => (1u64 << 20)..(1u64 << 62)]
        }

        /// What one peer's load on a worker rank counts for, at most, in
        /// the model: small, so that bookings and reports pass it.
        const CAP: RemoteLoad = RemoteLoad {
            requests: 6,
            prefill_tokens: 900,
            decode_blocks: 20,
        };

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..12u8, 0..4u8, 0..500u16, 0..8u8)
                    .prop_map(|(id, worker, prefill, decode)| Op::Book { id, worker, prefill, decode }),
                2 => (0..12u8).prop_map(|id| Op::Prefill { id }),
                3 => (0..12u8).prop_map(|id| Op::Release { id }),
                4 => (4..8u8, huge(0..4), huge(0..300)).prop_map(|(worker, requests, prefill)| Op::Report {
                    worker,
                    requests,
                    prefill
                }),
                1 => Just(Op::Lose),
                1 => (1..5u8).prop_map(|per_part| Op::Snapshot { per_part }),
                1 => Just(Op::Restart),
            ]
        }

        /// One peer as its own sync thread sees itself.
        struct Sender {
            replica: u64,
            incarnation: u64,
            seq: u64,
            own: OwnBookings,
            /// A batch since the last snapshot was lost.
            behind: bool,
        }

        impl Sender {
            fn send(&mut self, body: Body) -> Envelope {
                Envelope {
                    replica: self.replica,
                    incarnation: self.incarnation,
                    seq: self.seq,
                    sent: 0,
                    body,
                }
            }

            /// What this peer holds, per worker rank, as it counts in a
            /// peer's sum: its report capped, then its whole load there.
            fn holds(&self, sum: &mut BTreeMap<WorkerWithDpRank, RemoteLoad>) {
                let mut mine: BTreeMap<WorkerWithDpRank, RemoteLoad> = BTreeMap::new();
                let mut add = |w: WorkerWithDpRank, l: RemoteLoad| {
                    let e = mine.entry(w).or_default();
                    e.requests += l.requests;
                    e.prefill_tokens += l.prefill_tokens;
                    e.decode_blocks += l.decode_blocks;
                };
                for (_, b) in self.own.rows() {
                    add(b.worker, load_of(b));
                }
                for l in self.own.loads() {
                    add(l.worker, capped(l.load, CAP));
                }
                for (w, l) in mine {
                    let l = capped(l, CAP);
                    let e = sum.entry(w).or_default();
                    e.requests += l.requests;
                    e.prefill_tokens += l.prefill_tokens;
                    e.decode_blocks += l.decode_blocks;
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn the_tables_sum_what_each_peer_holds(ops in proptest::collection::vec((0..2usize, op()), 1..120)) {
                let now = Instant::now();
                let mut t = PeerTables::new(Limits { max_load: CAP, ..Limits::default() });
                let mut peers: Vec<Sender> = (0..2)
                    .map(|i| Sender { replica: i as u64 + 1, incarnation: 1, seq: 0, own: OwnBookings::default(), behind: false })
                    .collect();
                for (who, op) in ops {
                    let p = &mut peers[who];
                    let w = |x: u8| WorkerWithDpRank::new(u64::from(x), 0);
                    let delta = match op {
                        Op::Book { id, worker, prefill, decode } => Some(Delta::Book(
                            u64::from(id),
                            Booked { worker: w(worker), prefill_tokens: u32::from(prefill), decode_blocks: u32::from(decode) },
                        )),
                        Op::Prefill { id } => Some(Delta::PrefillComplete(u64::from(id))),
                        Op::Release { id } => Some(Delta::Release(u64::from(id))),
                        Op::Report { worker, requests, prefill } => Some(Delta::Load(Loaded {
                            worker: w(worker),
                            load: RemoteLoad { requests, prefill_tokens: prefill, decode_blocks: requests.saturating_mul(2) },
                        })),
                        Op::Lose => {
                            // A batch is published (its number used up) but never arrives.
                            p.seq += 1;
                            p.behind = true;
                            None
                        }
                        Op::Snapshot { per_part } => {
                            let (rows, loads) = (p.own.rows(), p.own.loads());
                            let per_part = usize::from(per_part);
                            let total = rows.len() + loads.len();
                            let parts = total.div_ceil(per_part).max(1);
                            for part in 0..parts {
                                let (of_b, of_l) = part_ranges(rows.len(), total, per_part, part);
                                let b = rows.get(of_b).unwrap_or(&[]).to_vec();
                                let l = loads.get(of_l).unwrap_or(&[]).to_vec();
                                let m = p.send(Body::Snapshot { part: part as u32, last: part + 1 == parts, bookings: b, loads: l });
                                t.apply(m, now, 0, ASK);
                            }
                            p.behind = false;
                            None
                        }
                        Op::Restart => {
                            p.incarnation += 1;
                            p.seq = 0;
                            p.own = OwnBookings::default();
                            p.behind = false;
                            let m = p.send(Body::Heartbeat);
                            t.apply(m, now, 0, ASK);
                            None
                        }
                    };
                    if let Some(delta) = delta {
                        // The sync thread publishes what changed its own table.
                        if let Some(delta) = p.own.apply(delta) {
                            p.seq += 1;
                            let m = p.send(Body::Deltas(vec![delta]));
                            t.apply(m, now, 0, ASK);
                        }
                    }
                    if peers.iter().all(|p| !p.behind) {
                        let mut want = BTreeMap::new();
                        for p in &peers {
                            p.holds(&mut want);
                        }
                        want.retain(|_, l| *l != RemoteLoad::default());
                        let got: BTreeMap<_, _> = t.loads().into_iter().collect();
                        prop_assert_eq!(got, want);
                    }
                }
            }
        }
    }

    /// Whatever the messages (any replica, incarnation, sequence number,
    /// snapshot part, load, however many), the tables stay within their
    /// bounds and their sums stay exact: each peer's per-worker load is
    /// its bookings plus its report, and the sum per worker rank is every
    /// peer's, capped.
    mod any_stream {
        use super::*;
        use proptest::prelude::*;

        fn value() -> impl Strategy<Value = u64> {
            prop_oneof![4 => 0..5u64, 1 => Just(u64::MAX), 1 => any::<u64>()]
        }

        fn delta() -> impl Strategy<Value = Delta> {
            let worker = (0..3u64).prop_map(|w| WorkerWithDpRank::new(w, 0));
            prop_oneof![
                (0..8u64, worker.clone(), any::<u32>(), any::<u32>()).prop_map(|(id, worker, p, d)| Delta::Book(
                    id,
                    Booked {
                        worker,
                        prefill_tokens: p,
                        decode_blocks: d
                    }
                )),
                (0..8u64).prop_map(Delta::PrefillComplete),
                (0..8u64).prop_map(Delta::Release),
                (worker, value(), value(), value()).prop_map(|(worker, r, p, d)| Delta::Load(Loaded {
                    worker,
                    load: load(r, p, d)
                })),
            ]
        }

        fn body() -> impl Strategy<Value = Body> {
            prop_oneof![
                3 => proptest::collection::vec(delta(), 0..6).prop_map(Body::Deltas),
                1 => Just(Body::Heartbeat),
                1 => Just(Body::SnapshotRequest(None)),
                2 => (0..3u32, any::<bool>(), proptest::collection::vec(delta(), 0..5)).prop_map(|(part, last, rows)| {
                    let mut bookings = Vec::new();
                    let mut loads = Vec::new();
                    for d in rows {
                        match d {
                            Delta::Book(id, b) => bookings.push((id, b)),
                            Delta::Load(l) => loads.push(l),
                            _ => {}
                        }
                    }
                    Body::Snapshot { part, last, bookings, loads }
                }),
            ]
        }

        fn message() -> impl Strategy<Value = (Envelope, u64)> {
            let seq = prop_oneof![3 => 0..6u64, 1 => Just(u64::MAX), 1 => any::<u64>()];
            let sent = prop_oneof![4 => 0..3000u64, 1 => Just(u64::MAX)];
            let who = (0..6u64, 1..3u64);
            (who, seq, sent, body(), 0..3000u64).prop_map(|((replica, incarnation), seq, sent, body, later)| {
                (
                    Envelope {
                        replica,
                        incarnation,
                        seq,
                        sent,
                        body,
                    },
                    later,
                )
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            #[test]
            fn the_bounds_and_exact_sums_hold_for_any_stream(
                messages in proptest::collection::vec(message(), 1..150),
                check_times in any::<bool>(),
            ) {
                let limits = Limits {
                    max_peers: 3,
                    max_rows: 4,
                    max_load: load(3, 100, 7),
                    timeout: Duration::from_millis(1000),
                    check_times,
                };
                let mut t = PeerTables::new(limits);
                let start = Instant::now();
                for (m, at) in messages {
                    let now = start + Duration::from_millis(at);
                    // Send times are milliseconds of this clock, 0 to 3 s.
                    t.apply(m, now, at, ASK);
                    if let Err(e) = t.check() {
                        prop_assert!(false, "after a message: {}", e);
                    }
                    if at % 7 == 0 {
                        t.expire(now);
                        if let Err(e) = t.check() {
                            prop_assert!(false, "after expiry: {}", e);
                        }
                    }
                }
                t.expire(start + Duration::from_secs(10));
                prop_assert!(t.loads().is_empty() && t.peers() == 0 && t.rows() == 0);
            }
        }
    }
}
