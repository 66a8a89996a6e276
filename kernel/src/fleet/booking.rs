//! The booking protocol: admitting one request against one row
//! ([`Fleet::book`], documented there) and releasing it (documented, with
//! the ABA bound, on [`Booking`], the guard in `guard`).
//!
//! This module must not scan.

use super::counter::{add_saturating, increment_below, sub_if_tagged, tag_of_generation, value_of, Refusal};
use super::error::BookError;
use super::guard::Booking;
use super::state::{SlotId, StateWord};
use super::Fleet;
use crate::sync::Ordering;

/// The load one request puts on a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BookLoad {
    /// Tokens the worker must prefill (released by
    /// [`Booking::prefill_complete`] or on drop).
    pub prefill_tokens: u32,
    /// KV blocks the request holds when decoding starts (grown by
    /// [`Booking::add_output_block`]).
    pub decode_blocks: u32,
}

/// Why a row whose state word is `s` refuses a booking (`expected`: the
/// generation it must carry): [`BookError::Stale`] if the generation
/// differs, else [`BookError::NotLive`]. Only called once the word has
/// been found not admissible.
#[cold]
#[inline(never)]
fn refusal(row: u32, expected: Option<u32>, s: StateWord) -> BookError {
    match expected {
        Some(expected) if expected != s.generation() => BookError::Stale {
            row,
            expected,
            found: s.generation(),
        },
        _ => BookError::NotLive { row, state: s.state() },
    }
}

/// What one booking holds on one row: the part of a [`Booking`] that does
/// not depend on the fleet handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) row: u32,
    pub(crate) generation: u32,
    pub(crate) prefill_tokens: u32,
    pub(crate) decode_blocks: u32,
}

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// Books one request against the worker in `row`, returning the guard
    /// that releases it.
    ///
    /// Errors: [`BookError::NoSuchRow`], [`BookError::NotLive`] (Empty,
    /// Draining or Cordoned), [`BookError::Overloaded`] (at the admission
    /// limit), [`BookError::Stale`] (the row changed occupant meanwhile).
    /// A refused booking leaves nothing booked.
    ///
    /// # Protocol
    ///
    /// 1. Load the row's state word (`Acquire`): it must be Live; its generation
    ///    `g` gives the counters' tag `g & 0xFF`. Load the admission limit.
    /// 2. CAS the active-requests word from `v << 8 | tag` to `(v + 1) << 8 |
    ///    tag`, refusing if the tag differs (`Stale`: the row was reused) or
    ///    `v >= limit` (`Overloaded`). The CAS is the admission decision, on the
    ///    live value: concurrent bookers are serialized by it, so the limit is
    ///    never passed however stale their scans were.
    /// 3. Re-load the state word (`SeqCst`). If it is no longer `Live(g)`, undo
    ///    the increment (tag-checked) and refuse. `set_state` and `remove` write
    ///    the state with `SeqCst` too, and the CAS of step 2 is `SeqCst`, so all
    ///    of them sit in one total order: a booking that succeeds made its
    ///    increment and its re-check before the state change in that order. A
    ///    thread that changed the state (or synchronized with the one that did)
    ///    and then reads the counter therefore sees every booking that
    ///    succeeded against the old state; bookings that raced with the change
    ///    show up at most transiently, until they undo themselves. (Without
    ///    step 3 a booking could read `Live` in step 1, sleep across a whole
    ///    `set_state(Draining)`, and succeed afterwards.)
    /// 4. Add the prefill tokens and decode blocks with tag-checked CAS
    ///    (saturating at `COUNTER_MAX`; the guard records what it really added).
    ///
    pub fn book(&self, row: usize, load: BookLoad) -> Result<Booking<&Self, GROUPS>, BookError> {
        Booking::new(self, row, load)
    }

    /// As [`book`](Self::book), but only if `row` still holds `slot`'s
    /// occupant (`BookError::Stale` otherwise).
    pub fn book_slot(&self, slot: SlotId, load: BookLoad) -> Result<Booking<&Self, GROUPS>, BookError> {
        Booking::new_for_slot(self, slot, load)
    }

    /// The booking protocol; `expected` pins the generation.
    #[inline]
    pub(crate) fn claim(&self, row: usize, expected: Option<u32>, load: BookLoad) -> Result<Claim, BookError> {
        self.claim_inline(row, expected, load).map(|(claim, _)| claim)
    }

    /// [`claim`](Self::claim), always inlined, with the row's in-flight
    /// requests its CAS found (its own not counted): for
    /// [`Booking::new_for_slot_with_active`], the host's fast path, where
    /// the call and its result through memory cost more than the
    /// protocol's own loads.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(crate) fn claim_inline(
        &self,
        row: usize,
        expected: Option<u32>,
        load: BookLoad,
    ) -> Result<(Claim, u32), BookError> {
        if !Self::in_range(row) {
            return Err(BookError::NoSuchRow {
                row,
                capacity: Self::CAPACITY,
            });
        }
        let row32 = row as u32;
        let s = self.state_word(row, Ordering::Acquire);
        let generation = s.generation();
        // One comparison of the whole word on the way in; the refusal's
        // reason is worked out off the hot path.
        let admissible = match expected {
            Some(expected) => s.is_live_of(expected),
            None => s.is_live(),
        };
        if !admissible {
            return Err(refusal(row32, expected, s));
        }
        // The limit as a counter word (`counter::limit_word`), compared
        // with the active-requests word as it is.
        let full = self.admission_limit.at(row).load(Ordering::Acquire);
        let tag = tag_of_generation(generation);
        let active = self.active_requests.at(row);
        let found = match self.increment_active(row, tag, full) {
            Ok(found) => found,
            Err(Refusal::AtLimit) => {
                return Err(BookError::Overloaded {
                    row: row32,
                    limit: value_of(full),
                })
            }
            Err(Refusal::Stale) => return Err(self.stale(row, generation)),
        };
        let now = self.state_word(row, Ordering::SeqCst);
        // `s` was found Live (of `expected`, when given): unchanged means
        // Live of `generation` still.
        if !s.unchanged_in(now) {
            sub_if_tagged(active, tag, 1);
            return Err(refusal(row32, Some(generation), now));
        }
        let Some(prefill_tokens) = add_saturating(self.active_prefill_tokens.at(row), tag, load.prefill_tokens) else {
            sub_if_tagged(active, tag, 1);
            return Err(self.stale(row, generation));
        };
        let Some(decode_blocks) = add_saturating(self.active_decode_blocks.at(row), tag, load.decode_blocks) else {
            sub_if_tagged(self.active_prefill_tokens.at(row), tag, prefill_tokens);
            sub_if_tagged(active, tag, 1);
            return Err(self.stale(row, generation));
        };
        let claim = Claim {
            row: row32,
            generation,
            prefill_tokens,
            decode_blocks,
        };
        Ok((claim, found))
    }

    /// Step 2 of the protocol (or, in a loom model, its broken variants);
    /// `full`: the row's [`limit_word`](super::counter::limit_word). Returns
    /// the in-flight requests found.
    #[inline(always)]
    fn increment_active(&self, row: usize, tag: u32, full: u32) -> Result<u32, Refusal> {
        let active = self.active_requests.at(row);
        #[cfg(selkie_loom)]
        match self.fault {
            super::fault::Fault::BookLoadThenStore => {
                return super::counter::broken::increment_below_load_store(active, tag, value_of(full))
            }
            super::fault::Fault::BookIgnoresTag => {
                return super::counter::broken::increment_below_untagged(active, value_of(full))
            }
            _ => {}
        }
        increment_below(active, tag, full)
    }

    pub(super) fn stale(&self, row: usize, expected: u32) -> BookError {
        let found = self.state_word(row, Ordering::Acquire).generation();
        BookError::Stale {
            row: row as u32,
            expected,
            found,
        }
    }

    /// Releases everything `claim` holds (see [`Booking`]).
    pub(crate) fn release(&self, claim: &Claim) {
        let row = claim.row as usize;
        #[cfg(selkie_loom)]
        if self.fault == super::fault::Fault::ReleaseIgnoresGeneration {
            super::counter::broken::sub_untagged(self.active_prefill_tokens.at(row), claim.prefill_tokens);
            super::counter::broken::sub_untagged(self.active_decode_blocks.at(row), claim.decode_blocks);
            super::counter::broken::sub_untagged(self.active_requests.at(row), 1);
            return;
        }
        if self.state_word(row, Ordering::Acquire).generation() != claim.generation {
            return;
        }
        let tag = tag_of_generation(claim.generation);
        self.sub(self.active_prefill_tokens.at(row), tag, claim.prefill_tokens);
        self.sub(self.active_decode_blocks.at(row), tag, claim.decode_blocks);
        self.sub(self.active_requests.at(row), tag, 1);
    }

    /// A tag-checked subtraction (or, in a loom model, its broken variant).
    #[inline(always)]
    pub(super) fn sub(&self, counter: &crate::sync::AtomicU32, tag: u32, amount: u32) -> bool {
        #[cfg(selkie_loom)]
        if self.fault == super::fault::Fault::ReleaseLoadThenStore {
            return super::counter::broken::sub_load_store(counter, tag, amount);
        }
        sub_if_tagged(counter, tag, amount)
    }
}
