//! Per-row reads: who occupies a row, in what state, with what load.
//!
//! A row's metadata is written only by `add` (while the row is Empty) and by
//! the weight/limit updates (under the writer bit), always with `Release`
//! stores, and a `remove` changes the state word before the row can be
//! claimed again. So a reader that loads the state word, then the metadata
//! (`Acquire`), then the state word again, and finds the same occupied
//! generation both times, has read that occupant's metadata: had it read a
//! later occupant's store, it would have synchronized with that `add`, which
//! happens after the `remove`, and the second load would see the change.
//!
//! This module must not write.

use super::counter::{limit_of_word, value_of};
use super::state::{Outstanding, SlotId, SlotState, StateWord, WorkerInfo};
use super::Fleet;
use crate::sync::Ordering;

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// The state word of `row` (`row < CAPACITY`).
    #[inline]
    pub(crate) fn state_word(&self, row: usize, order: Ordering) -> StateWord {
        StateWord(self.state.at(row).load(order))
    }

    /// What `row` holds now (`Empty` past the capacity).
    #[inline]
    pub fn state(&self, row: usize) -> SlotState {
        if !Self::in_range(row) {
            return SlotState::Empty;
        }
        self.state_word(row, Ordering::Acquire).state()
    }

    /// Whether `row`'s selectable bit is set (its worker is Live).
    #[inline]
    pub fn is_selectable(&self, row: usize) -> bool {
        Self::in_range(row) && self.selectable.contains(row, Ordering::Acquire)
    }

    /// The occupancy of `row`, or `None` if it is empty or past the capacity.
    #[inline]
    pub fn slot_id(&self, row: usize) -> Option<SlotId> {
        if !Self::in_range(row) {
            return None;
        }
        let s = self.state_word(row, Ordering::Acquire);
        (s.state() != SlotState::Empty).then_some(SlotId {
            row: row as u32,
            generation: s.generation(),
        })
    }

    /// `row`'s worker, or `None` if the row is empty or past the capacity.
    ///
    /// Every field belongs to the same occupant (a seqlock-style read: the
    /// state word before and after the fields carries the same generation); it
    /// retries while the row changes occupant under it (lock-free: each
    /// retry means an `add` or `remove` completed). A weight or limit update
    /// racing the read may show in one field and not yet in another.
    pub fn worker(&self, row: usize) -> Option<WorkerInfo> {
        if !Self::in_range(row) {
            return None;
        }
        loop {
            let before = self.state_word(row, Ordering::Acquire);
            if before.state() == SlotState::Empty {
                return None;
            }
            let lo = self.worker_lo.at(row).load(Ordering::Acquire);
            let hi = self.worker_hi.at(row).load(Ordering::Acquire);
            let dp_rank = self.dp_rank.at(row).load(Ordering::Acquire);
            let weight = self.capacity_weight.at(row).load(Ordering::Acquire);
            let limit = self.admission_limit.at(row).load(Ordering::Acquire);
            let after = self.state_word(row, Ordering::Acquire);
            if after.generation() == before.generation() && after.state() != SlotState::Empty {
                return Some(WorkerInfo {
                    slot: SlotId {
                        row: row as u32,
                        generation: before.generation(),
                    },
                    state: after.state(),
                    worker_id: (hi as u64) << 32 | lo as u64,
                    dp_rank,
                    capacity_weight: f32::from_bits(weight),
                    admission_limit: limit_of_word(limit),
                });
            }
            crate::sync::spin_loop();
        }
    }

    /// The worker id in `row`, or `None` if it is empty.
    #[inline]
    pub fn worker_id(&self, row: usize) -> Option<u64> {
        self.worker(row).map(|w| w.worker_id)
    }

    /// The data-parallel rank of the worker in `row`, or `None` if empty.
    #[inline]
    pub fn dp_rank(&self, row: usize) -> Option<u32> {
        self.worker(row).map(|w| w.dp_rank)
    }

    /// The load `row`'s counters hold now, whatever occupant they belong to
    /// (a removed worker's counters keep counting its outstanding guards
    /// until the row is reused), the remote load set on it included
    /// ([`set_remote_load`](Self::set_remote_load)). `None` past the
    /// capacity.
    ///
    /// After all guards are dropped, every row's counters hold its remote
    /// load (zero without one).
    pub fn outstanding(&self, row: usize) -> Option<Outstanding> {
        if !Self::in_range(row) {
            return None;
        }
        Some(Outstanding {
            requests: value_of(self.active_requests.at(row).load(Ordering::Acquire)),
            prefill_tokens: value_of(self.active_prefill_tokens.at(row).load(Ordering::Acquire)),
            decode_blocks: value_of(self.active_decode_blocks.at(row).load(Ordering::Acquire)),
        })
    }

    /// Whether a booking on `row` would now be refused for its admission
    /// limit: the admission's own comparison of the in-flight requests with
    /// the limit (capped to `COUNTER_MAX`, where a booking stops whatever
    /// the limit), as read now. `false` for an empty row and past the
    /// capacity.
    ///
    /// ```
    /// use selkie_kernel::fleet::{BookLoad, Fleet, WorkerSpec};
    ///
    /// let fleet = Fleet::<1>::new();
    /// fleet.add(WorkerSpec { admission_limit: 1, ..WorkerSpec::new(1) }).unwrap();
    /// assert!(!fleet.at_admission_limit(0));
    /// let held = fleet.book(0, BookLoad::default()).unwrap();
    /// assert!(fleet.at_admission_limit(0));
    /// drop(held);
    /// assert!(!fleet.at_admission_limit(0));
    /// ```
    pub fn at_admission_limit(&self, row: usize) -> bool {
        if !Self::in_range(row) || self.state_word(row, Ordering::Acquire).state() == SlotState::Empty {
            return false;
        }
        let full = self.admission_limit.at(row).load(Ordering::Acquire);
        self.active_requests.at(row).load(Ordering::Acquire) >= full
    }

    /// Whether no booking holds anything on `row` any more, for a row the
    /// caller has just taken out of rotation ([`set_state`](Self::set_state)
    /// to Draining or Cordoned) and wants to free if nothing is left on it.
    ///
    /// A booking racing with the state change either fails its re-check of
    /// the state (and undoes itself) or is seen here: the counters are read
    /// with read-modify-writes (adding zero), which read the latest value
    /// and synchronize with the booking's compare-and-swap, so that a plain
    /// load's store-buffering window (each side missing the other's write)
    /// cannot occur. `true` past the capacity.
    pub fn is_drained(&self, row: usize) -> bool {
        if !Self::in_range(row) {
            return true;
        }
        [
            &self.active_requests,
            &self.active_prefill_tokens,
            &self.active_decode_blocks,
        ]
        .iter()
        .all(|c| value_of(c.at(row).fetch_add(0, Ordering::AcqRel)) == 0)
    }
}
