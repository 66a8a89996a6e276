//! Session affinity: which worker rank each live session is bound to, with
//! an idle timeout and a fixed capacity.
//!
//! The table is a set-associative cache with two choices: a session id is
//! hashed (SipHash with keys drawn per table) to 64 bits, whose halves pick
//! two buckets of [`WAYS`] entries, each bucket behind its own mutex. A
//! lookup or a bind locks one bucket at a time and compares at most
//! [`WAYS`] keys in each: no resize, no allocation after the table's first
//! use, and no lock shared by all session-carrying requests. A new session
//! takes a free or expired entry in either bucket; only when both are full
//! of live sessions does it evict the older of their least recently used
//! sessions (counted in `selkie_session_evictions_total`). With two choices
//! live sessions are rarely evicted below about 90% of the capacity. Memory
//! is bounded by [`ServiceConfig::max_sessions`](super::ServiceConfig)
//! whatever the number of distinct session ids.
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

/// The most sessions a table holds (about 160 MiB of entries).
pub(crate) const MAX_CAPACITY: usize = 1 << 22;

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
        let bucket_count = capacity.clamp(1, MAX_CAPACITY).div_ceil(WAYS).next_power_of_two();
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

    /// The two buckets of `key` (the same one twice only in a one-bucket
    /// table).
    fn choices(&self, key: u64) -> [usize; 2] {
        let mask = self.bucket_count - 1;
        let first = (key >> 32) as usize & mask;
        let mut second = key as usize & mask;
        if second == first {
            second = first ^ (1 & mask);
        }
        [first, second]
    }

    fn lock(b: &Bucket) -> std::sync::MutexGuard<'_, [Entry; WAYS]> {
        b.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The session's worker, if bound and not idle past the timeout.
    pub(crate) fn get(&self, id: &str, now: Instant) -> Option<WorkerWithDpRank> {
        let buckets = self.buckets.get()?;
        let key = self.key(id);
        let now = self.nanos(now);
        for b in self.choices(key) {
            let mut bucket = Self::lock(&buckets[b]);
            if let Some(e) = bucket.iter_mut().find(|e| e.key == key) {
                if !self.expired(e, now) {
                    return e.worker;
                }
                *e = Entry::default();
            }
        }
        None
    }

    /// Binds (or re-binds) a session and refreshes its idle clock.
    ///
    /// Both of the session's buckets are locked (the lower index first) for
    /// the whole find-or-insert, so two first requests of one session
    /// racing here leave one entry, not two.
    pub(crate) fn bind(&self, id: &str, worker: WorkerWithDpRank, now: Instant) {
        let key = self.key(id);
        let buckets = self.buckets.get_or_init(|| {
            (0..self.bucket_count)
                .map(|_| Mutex::new([Entry::default(); WAYS]))
                .collect()
        });
        let now = self.nanos(now);
        let fresh = Entry {
            key,
            worker: Some(worker),
            last_used: now,
        };
        let [first, second] = self.choices(key);
        let (lo, hi) = (first.min(second), first.max(second));
        let mut lo_guard = Self::lock(&buckets[lo]);
        let mut hi_guard = (hi != lo).then(|| Self::lock(&buckets[hi]));
        let mut locked: [Option<&mut [Entry; WAYS]>; 2] = [Some(&mut *lo_guard), hi_guard.as_deref_mut()];
        // Bound already: refresh it where it is.
        for bucket in locked.iter_mut().flatten() {
            if let Some(e) = bucket.iter_mut().find(|e| e.key == key) {
                *e = fresh;
                return;
            }
        }
        // The bucket with more free (or expired) entries takes it; when
        // both are full of live sessions, the least recently used of the
        // two buckets goes.
        let free = |e: &Entry| e.key == 0 || self.expired(e, now);
        let free_in = |b: &Option<&mut [Entry; WAYS]>| b.as_ref().map_or(0, |b| b.iter().filter(|e| free(e)).count());
        let pick = usize::from(free_in(&locked[1]) > free_in(&locked[0]));
        if let Some(e) = locked[pick].as_mut().and_then(|b| b.iter_mut().find(|e| free(e))) {
            *e = fresh;
            return;
        }
        let oldest = locked
            .iter_mut()
            .flatten()
            .flat_map(|b| b.iter_mut())
            .min_by_key(|e| e.last_used);
        if let Some(e) = oldest {
            *e = fresh;
            self.evictions.increment(1);
        }
    }

    /// Forgets a session.
    pub(crate) fn end(&self, id: &str) -> bool {
        let Some(buckets) = self.buckets.get() else {
            return false;
        };
        let key = self.key(id);
        let mut found = false;
        for b in self.choices(key) {
            for e in Self::lock(&buckets[b]).iter_mut().filter(|e| e.key == key) {
                *e = Entry::default();
                found = true;
            }
        }
        found
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two choices keep nearly every live session up to most of the
    /// capacity (one choice lost 14% at full capacity and 1% at half).
    #[test]
    fn live_sessions_survive_up_to_most_of_the_capacity() {
        let w = WorkerWithDpRank::new(1, 0);
        let now = Instant::now();
        for (percent, min_kept_per_mille) in [(50, 1000), (75, 999), (90, 990)] {
            let table = SessionTable::new(Duration::from_secs(3600), 65_536);
            assert_eq!(table.capacity(), 65_536);
            let live = table.capacity() * percent / 100;
            for i in 0..live {
                table.bind(&format!("s{i}"), w, now);
            }
            let kept = (0..live).filter(|i| table.get(&format!("s{i}"), now).is_some()).count();
            assert!(
                kept * 1000 >= live * min_kept_per_mille,
                "{percent}% full: {kept} of {live} live sessions kept"
            );
            assert_eq!(table.expire(now), kept);
        }
        // Far past the capacity the table stays bounded and keeps the newest.
        let table = SessionTable::new(Duration::from_secs(3600), 1024);
        let sessions = 4 * table.capacity();
        for i in 0..sessions {
            table.bind(&format!("s{i}"), w, now + Duration::from_nanos(i as u64));
        }
        assert!(table.expire(now) <= table.capacity());
        assert_eq!(table.get(&format!("s{}", sessions - 1), now), Some(w));
    }

    #[test]
    fn capacity_is_bounded_whatever_is_asked() {
        let table = SessionTable::new(Duration::from_secs(1), usize::MAX);
        assert_eq!(table.capacity(), MAX_CAPACITY);
        assert_eq!(SessionTable::new(Duration::from_secs(1), 0).capacity(), WAYS);
    }

    /// Concurrent first binds of the same sessions leave one entry each.
    #[test]
    fn racing_first_binds_leave_one_entry_per_session() {
        let table = std::sync::Arc::new(SessionTable::new(Duration::from_secs(3600), 4096));
        let now = Instant::now();
        let threads: std::vec::Vec<_> = (0..4u64)
            .map(|t| {
                let table = table.clone();
                std::thread::spawn(move || {
                    for i in 0..3000 {
                        table.bind(&format!("s{i}"), WorkerWithDpRank::new(t, 0), now);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let buckets = table.buckets.get().unwrap();
        let mut duplicated = 0;
        for i in 0..3000 {
            let key = table.key(&format!("s{i}"));
            let [a, b] = table.choices(key);
            let mut copies = count_key(&buckets[a], key);
            if b != a {
                copies += count_key(&buckets[b], key);
            }
            duplicated += usize::from(copies > 1);
        }
        assert_eq!(duplicated, 0, "sessions with more than one entry");
    }

    fn count_key(bucket: &Bucket, key: u64) -> usize {
        SessionTable::lock(bucket).iter().filter(|e| e.key == key).count()
    }
}
