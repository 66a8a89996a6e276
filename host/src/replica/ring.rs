//! Per-thread delta queues: how `record_*` hands a delta to the sync
//! thread without writing anything another recording thread writes.
//!
//! Each thread that records for a [`ReplicaSync`](super::ReplicaSync) owns
//! one single-producer, single-consumer queue for it (an [`rtrb`] ring
//! buffer of `queue_capacity` deltas), found through a thread-local list;
//! its consuming end is registered with the sync's [`Rings`] on the
//! thread's first record (the only allocation). A record is a plain write
//! of the slot and one `Release` store of the queue's write index (the
//! producer keeps its own copy of the read index, and reloads it only when
//! the queue looks full): no read-modify-write, no lock, no wake-up. The
//! sync thread drains every queue on its batch timer. A full queue drops
//! the delta and counts it.
//!
//! rtrb rather than crossbeam's `ArrayQueue`, or a ring of selkie's own:
//! measured side by side with each one's whole `record_*` path on one
//! thread, a record took 11.9 ns (44 instructions) with the hand-written
//! ring selkie had, 14.3 ns (59) with rtrb and 29.4 ns (96) with
//! `ArrayQueue`, whose compare-and-swap a single producer does not need.
//!
//! Queues are drained one after another, so two deltas of one booking
//! recorded on two threads (a booking moved to another task before it is
//! released) may be drained in the opposite order. But a delta seen in one
//! drain had its earlier deltas pushed before it, so the next drain sees
//! them: the caller holds back a prefill completion or release of a booking
//! it does not know for one drain (see `task`).
//!
//! What it must not do: block the recording thread, or allocate after a
//! thread's first record.

use std::cell::RefCell;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crossbeam_utils::CachePadded;

use super::wire::Delta;

/// Source of [`Rings`] keys (thread-local lists find their ring by it).
static RING_SETS: AtomicU64 = AtomicU64::new(1);
/// The key of closed rings: no ring has it.
const CLOSED: u64 = 0;
/// Syncs a thread keeps a ring for before it forgets the oldest (whose
/// sync has most likely been dropped).
const RINGS_PER_THREAD: usize = 16;

/// The consuming end of one thread's queue.
struct Ring {
    queue: rtrb::Consumer<Delta>,
    /// Deltas the producer dropped (written by the producer only).
    dropped: Arc<AtomicU64>,
}

impl Ring {
    /// Hands the deltas pushed so far to `f`, oldest first (not those
    /// pushed while it drains: a producer never keeps it going).
    fn drain(&mut self, f: &mut impl FnMut(Delta)) -> usize {
        let mut n = 0;
        for _ in 0..self.queue.slots() {
            let Ok(delta) = self.queue.pop() else { break };
            f(delta);
            n += 1;
        }
        n
    }
}

/// The rings of one sync, for its thread to drain.
pub(super) struct Rings {
    /// Read by every push, written once (by `close`): on a line of its
    /// own, away from the lock the sync thread takes.
    key: CachePadded<AtomicU64>,
    capacity: usize,
    rings: Mutex<RingList>,
    /// Deltas recorded by threads whose rings were already gone (at
    /// thread exit), or after the rings were closed.
    late: AtomicU64,
}

#[derive(Default)]
struct RingList {
    live: Vec<Ring>,
    /// Drops counted by rings since forgotten (their threads ended).
    dropped_before: u64,
}

impl Rings {
    /// Rings of `capacity` deltas each (at least 1).
    pub(super) fn new(capacity: usize) -> Rings {
        Rings {
            key: CachePadded::new(AtomicU64::new(RING_SETS.fetch_add(1, Ordering::Relaxed))),
            capacity: capacity.max(1),
            rings: Mutex::new(RingList::default()),
            late: AtomicU64::new(0),
        }
    }

    /// Hands every delta recorded so far to `f`, ring by ring; forgets the
    /// rings of threads that ended. Returns the number of deltas.
    pub(super) fn drain(&self, mut f: impl FnMut(Delta)) -> usize {
        let mut list = self.rings.lock().unwrap_or_else(PoisonError::into_inner);
        let mut n = 0;
        let mut gone = 0;
        list.live.retain_mut(|ring| {
            // Checked first: a producer that ended before the check below
            // pushed everything the drain then sees.
            let ended = ring.queue.is_abandoned();
            if ended {
                // Pairs with the producer's drop (rtrb's guidance).
                fence(Ordering::Acquire);
            }
            n += ring.drain(&mut f);
            if ended {
                gone += ring.dropped.load(Ordering::Relaxed);
            }
            !ended
        });
        list.dropped_before += gone;
        n
    }

    /// Deltas dropped so far: a ring was full, or there was none.
    pub(super) fn dropped(&self) -> u64 {
        let list = self.rings.lock().unwrap_or_else(PoisonError::into_inner);
        let live: u64 = list.live.iter().map(|r| r.dropped.load(Ordering::Relaxed)).sum();
        list.dropped_before + live + self.late.load(Ordering::Relaxed)
    }

    /// Refuses every push from now on (dropped and counted): the sync
    /// thread stopped, nothing will drain them.
    pub(super) fn close(&self) {
        self.key.store(CLOSED, Ordering::Relaxed);
    }

    /// Pushes `delta` into this thread's ring (registering one first if the
    /// thread has none); `false` if the ring was full, the rings are
    /// closed, or the thread is ending and its ring is gone (dropped,
    /// counted).
    #[inline]
    pub(super) fn push(&self, delta: Delta) -> bool {
        self.with_producer(|p| p.push(delta)).unwrap_or(false)
    }

    /// Runs `f` on this thread's producer for these rings; `None` (counted
    /// as a drop) once the rings are closed, or the thread's rings are
    /// gone: a booking released by another thread-local's destructor at
    /// thread exit.
    #[inline]
    fn with_producer<R>(&self, f: impl FnOnce(&mut Producer) -> R) -> Option<R> {
        // Closing changes the key: a closed sync's producer no longer
        // matches, with no check of its own on the way.
        let key = self.key.load(Ordering::Relaxed);
        let done = PRODUCERS.try_with(|cell| {
            let mut list = cell.borrow_mut();
            // The sync a thread records for is nearly always the first one
            // (`front` moves it there).
            match list.first_mut() {
                Some(p) if p.key == key => Some(f(p)),
                _ if key == CLOSED => None,
                _ => Some(f(self.front(&mut list, key))),
            }
        });
        let done = done.ok().flatten();
        if done.is_none() {
            self.late.fetch_add(1, Ordering::Relaxed);
        }
        done
    }

    /// Moves this sync's producer to the front of the thread's list
    /// (registering a ring first if the thread has none) and returns it.
    #[cold]
    #[inline(never)]
    fn front<'a>(&self, list: &'a mut Vec<Producer>, key: u64) -> &'a mut Producer {
        match list.iter().position(|p| p.key == key) {
            Some(i) => list.swap(0, i),
            None => {
                if list.len() >= RINGS_PER_THREAD {
                    // Forget the least recently moved to the front.
                    list.pop();
                }
                list.push(self.register(key));
                let last = list.len() - 1;
                list.swap(0, last);
            }
        }
        &mut list[0]
    }

    /// A new ring for the calling thread, registered for draining.
    #[cold]
    fn register(&self, key: u64) -> Producer {
        let (producer, consumer) = rtrb::RingBuffer::new(self.capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let mut list = self.rings.lock().unwrap_or_else(PoisonError::into_inner);
        list.live.push(Ring {
            queue: consumer,
            dropped: Arc::clone(&dropped),
        });
        Producer {
            key,
            queue: producer,
            dropped,
        }
    }
}

thread_local! {
    static PRODUCERS: RefCell<Vec<Producer>> = const { RefCell::new(Vec::new()) };
}

/// A thread's writing end of one ring, kept in the thread-local list.
struct Producer {
    key: u64,
    queue: rtrb::Producer<Delta>,
    dropped: Arc<AtomicU64>,
}

impl Producer {
    #[inline]
    fn push(&mut self, delta: Delta) -> bool {
        if self.queue.push(delta).is_ok() {
            return true;
        }
        // Only this producer writes `dropped`: no read-modify-write.
        let dropped = self.dropped.load(Ordering::Relaxed);
        self.dropped.store(dropped + 1, Ordering::Relaxed);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::wire::Booked;
    use crate::types::WorkerWithDpRank;

    fn book(id: u64) -> Delta {
        Delta::Book(
            id,
            Booked {
                worker: WorkerWithDpRank::new(id, 0),
                prefill_tokens: 1,
                decode_blocks: 1,
            },
        )
    }

    #[test]
    fn a_ring_hands_over_every_delta_in_order_and_drops_when_full() {
        let rings = Rings::new(4);
        for id in 1..=6 {
            assert_eq!(rings.push(book(id)), id <= 4, "delta {id}");
        }
        assert_eq!(rings.dropped(), 2);
        let mut got = Vec::new();
        assert_eq!(rings.drain(|d| got.push(d)), 4);
        assert_eq!(got, (1..=4).map(book).collect::<Vec<_>>());
        // Room again, and the ring wraps.
        for id in 7..=10 {
            assert!(rings.push(book(id)));
        }
        got.clear();
        rings.drain(|d| got.push(d));
        assert_eq!(got, (7..=10).map(book).collect::<Vec<_>>());
    }

    #[test]
    fn every_threads_deltas_are_drained_once_and_an_ended_threads_ring_is_forgotten() {
        let rings = Arc::new(Rings::new(1024));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let rings = Arc::clone(&rings);
                std::thread::spawn(move || (0..100).all(|i| rings.push(book(t * 1000 + i))))
            })
            .collect();
        assert!(threads.into_iter().all(|t| t.join().unwrap()), "no ring was full");
        let mut drained = Vec::new();
        assert_eq!(rings.drain(|d| drained.push(d)), 400);
        assert_eq!(rings.rings.lock().unwrap().live.len(), 0, "the threads ended");
        drained.sort_unstable_by_key(|d| match d {
            Delta::Book(id, _) => *id,
            _ => unreachable!("only bookings were pushed"),
        });
        let expected: Vec<_> = (0..4u64)
            .flat_map(|t| (0..100).map(move |i| book(t * 1000 + i)))
            .collect();
        assert_eq!(drained, expected, "each delta once");
    }

    #[test]
    fn a_thread_recording_for_several_syncs_fills_each_ones_ring() {
        let syncs: Vec<Rings> = (0..RINGS_PER_THREAD + 2).map(|_| Rings::new(64)).collect();
        // Round robin over more syncs than a thread keeps rings for: the
        // forgotten ones get a new ring, nothing is lost.
        for round in 0..3u64 {
            for (i, r) in syncs.iter().enumerate() {
                assert!(r.push(book(round * 100 + i as u64)));
            }
        }
        for (i, r) in syncs.iter().enumerate() {
            let mut got = Vec::new();
            r.drain(|d| got.push(d));
            let want: Vec<Delta> = (0..3u64).map(|round| book(round * 100 + i as u64)).collect();
            assert_eq!(got, want, "sync {i}");
        }
    }

    #[test]
    fn a_delta_recorded_as_a_thread_ends_is_counted_not_a_panic() {
        // A value in another thread-local whose destructor records after
        // the thread's rings are gone (destructors run in no fixed order).
        struct RecordsOnDrop(Arc<Rings>);
        impl Drop for RecordsOnDrop {
            fn drop(&mut self) {
                self.0.push(book(7));
            }
        }
        thread_local! {
            static LATE: RefCell<Option<RecordsOnDrop>> = const { RefCell::new(None) };
        }
        let rings = Arc::new(Rings::new(8));
        let r = Arc::clone(&rings);
        std::thread::spawn(move || {
            // The late recorder's thread-local first, the ring's second:
            // destructors run in reverse order, so the recorder's runs
            // after the ring's is gone.
            LATE.with(|l| *l.borrow_mut() = Some(RecordsOnDrop(Arc::clone(&r))));
            assert!(r.push(book(1)));
        })
        .join()
        .expect("no panic at thread exit");
        let mut got = Vec::new();
        rings.drain(|d| got.push(d));
        // The late delta either made it into the ring or was counted.
        assert_eq!(got.len() as u64 + rings.dropped(), 2, "{got:?}");
    }

    #[test]
    fn a_consumer_racing_a_producer_loses_and_doubles_nothing() {
        let rings = Arc::new(Rings::new(64));
        let n = if cfg!(miri) { 200 } else { 100_000 };
        let producer = {
            let rings = Arc::clone(&rings);
            std::thread::spawn(move || {
                let mut sent = 0u64;
                for id in 0..n {
                    if rings.push(book(id)) {
                        sent += 1;
                    }
                }
                sent
            })
        };
        let mut seen = Vec::new();
        while !producer.is_finished() {
            rings.drain(|d| seen.push(d));
        }
        let sent = producer.join().unwrap();
        rings.drain(|d| seen.push(d));
        assert_eq!(seen.len() as u64, sent);
        assert_eq!(sent + rings.dropped(), n);
        let ids: Vec<u64> = seen
            .iter()
            .map(|d| match d {
                Delta::Book(id, _) => *id,
                _ => unreachable!(),
            })
            .collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "in order, none twice");
    }
}
