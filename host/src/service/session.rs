//! Session affinity: which worker rank each live session is bound to, with
//! an idle timeout and a fixed capacity.
//!
//! The table is a set-associative cache: a session id is hashed (SipHash
//! with keys drawn per table) to 64 bits; the hash picks one bucket of
//! [`WAYS`] entries, each bucket behind its own mutex. A lookup or a bind
//! locks one bucket and compares at most [`WAYS`] keys: no resize, no
//! allocation after the table's first use, and no lock shared by all
//! session-carrying requests. When a bucket is full, a bind reuses an
//! expired entry, else evicts the bucket's least recently used session
//! (counted in `selkie_session_evictions_total`). Memory is therefore
//! bounded by [`ServiceConfig::max_sessions`](super::ServiceConfig) whatever
//! the number of distinct session ids.
//!
//! Entries are keyed by the hash alone: two session ids whose 64-bit hashes
//! collide share an entry (about one pair in 2^64 / sessions²; the effect is
//! that one of them is routed as the other's session). Requests without a
//! session never touch the table.

use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use metrics::Counter;

use crate::types::WorkerWithDpRank;

/// Entries per bucket.
pub(crate) const WAYS: usize = 8;

#[derive(Clone, Copy, Default)]
struct Entry {
    /// Hash of the session id; 0 marks a free entry.
    key: u64,
    worker: Option<WorkerWithDpRank>,
    /// Nanoseconds since the table's epoch.
    last_used: u64,
}

type Bucket = Mutex<[Entry; WAYS]>;

pub(crate) struct SessionTable {
    /// Allocated on the first bind (a service without sessions pays nothing).
    buckets: OnceLock<Box<[Bucket]>>,
    /// Buckets; a power of two.
    bucket_count: usize,
    idle_timeout: Duration,
    epoch: Instant,
    hasher: RandomState,
    evictions: Counter,
}

impl SessionTable {
    /// A table for at least `capacity` sessions (rounded up to whole
    /// buckets, a power of two of them).
    pub(crate) fn new(idle_timeout: Duration, capacity: usize) -> Self {
        let bucket_count = capacity.div_ceil(WAYS).max(1).next_power_of_two();
        SessionTable {
            buckets: OnceLock::new(),
            bucket_count,
            idle_timeout,
            epoch: Instant::now(),
            hasher: RandomState::new(),
            evictions: metrics::counter!("selkie_session_evictions_total"),
        }
    }

    /// Sessions the table holds at most.
    pub(crate) fn capacity(&self) -> usize {
        self.bucket_count * WAYS
    }

    fn key(&self, id: &str) -> u64 {
        self.hasher.hash_one(id).max(1)
    }

    fn nanos(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    fn expired(&self, e: &Entry, now: u64) -> bool {
        let timeout = u64::try_from(self.idle_timeout.as_nanos()).unwrap_or(u64::MAX);
        now.saturating_sub(e.last_used) > timeout
    }

    fn bucket(&self, key: u64) -> Option<&Bucket> {
        let b = self.buckets.get()?;
        // The high bits pick the bucket (SipHash's bits are all good).
        Some(&b[(key >> 32) as usize & (self.bucket_count - 1)])
    }

    fn lock(b: &Bucket) -> std::sync::MutexGuard<'_, [Entry; WAYS]> {
        b.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The session's worker, if bound and not idle past the timeout.
    pub(crate) fn get(&self, id: &str, now: Instant) -> Option<WorkerWithDpRank> {
        let key = self.key(id);
        let mut bucket = Self::lock(self.bucket(key)?);
        let now = self.nanos(now);
        let e = bucket.iter_mut().find(|e| e.key == key)?;
        if self.expired(e, now) {
            *e = Entry::default();
            return None;
        }
        e.worker
    }

    /// Binds (or re-binds) a session and refreshes its idle clock.
    pub(crate) fn bind(&self, id: &str, worker: WorkerWithDpRank, now: Instant) {
        let key = self.key(id);
        let buckets = self.buckets.get_or_init(|| {
            (0..self.bucket_count)
                .map(|_| Mutex::new([Entry::default(); WAYS]))
                .collect()
        });
        let now = self.nanos(now);
        let mut bucket = Self::lock(&buckets[(key >> 32) as usize & (self.bucket_count - 1)]);
        let fresh = Entry {
            key,
            worker: Some(worker),
            last_used: now,
        };
        if let Some(e) = bucket.iter_mut().find(|e| e.key == key) {
            *e = fresh;
            return;
        }
        if let Some(e) = bucket.iter_mut().find(|e| e.key == 0 || self.expired(e, now)) {
            *e = fresh;
            return;
        }
        // Full of live sessions: the least recently used one goes.
        if let Some(e) = bucket.iter_mut().min_by_key(|e| e.last_used) {
            *e = fresh;
            self.evictions.increment(1);
        }
    }

    /// Forgets a session.
    pub(crate) fn end(&self, id: &str) -> bool {
        let key = self.key(id);
        let Some(b) = self.bucket(key) else { return false };
        let mut bucket = Self::lock(b);
        match bucket.iter_mut().find(|e| e.key == key) {
            Some(e) => {
                *e = Entry::default();
                true
            }
            None => false,
        }
    }

    /// Drops every session idle past the timeout; returns how many remain.
    /// Locks one bucket at a time, so selections never wait for the sweep.
    pub(crate) fn expire(&self, now: Instant) -> usize {
        let Some(buckets) = self.buckets.get() else { return 0 };
        let now = self.nanos(now);
        let mut live = 0;
        for b in buckets.iter() {
            for e in Self::lock(b).iter_mut() {
                if e.key != 0 && self.expired(e, now) {
                    *e = Entry::default();
                }
                live += usize::from(e.key != 0);
            }
        }
        live
    }
}
