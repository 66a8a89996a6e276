//! The booking guard: what a caller holds while its request is in flight,
//! and the only way to release it (on drop, exactly once).
//!
//! This module must not contain the booking protocol itself (`booking`).

use super::booking::{BookLoad, Claim};
use super::counter::{add_saturating, tag_of_generation};
use super::error::BookError;
use super::state::SlotId;
use super::Fleet;
use crate::sync::Ordering;
use core::ops::Deref;

/// A request booked against a worker: an RAII guard that releases the
/// request, its prefill tokens and its decode blocks exactly once, on drop.
///
/// `F` is any handle to the fleet: `&Fleet<GROUPS>` (no_std, scoped),
/// `&'static Fleet<GROUPS>`, or `Arc<Fleet<GROUPS>>` (note that cloning an
/// `Arc` per request touches its shared reference count).
///
/// # Release
///
/// A [`Booking`] releases on drop, exactly once: it checks that the row's
/// state word still carries its full 29-bit generation, then subtracts its
/// tokens and blocks, then its request, each with a CAS that is a no-op if
/// the counter's tag is not its own (the row was reused: those counters
/// belong to the next occupant).
///
/// # ABA
///
/// The counter tag is only 8 bits, so a tag-checked CAS alone would
/// misattribute a release if the row were reused a multiple of 256 times
/// between the guard's booking and its release. The release therefore first
/// compares the full (29-bit) generation in the state word. A release then
/// touches another occupant's counters only if
///
/// * the row was reused a nonzero multiple of 256 times *between that check
///   and the CAS*, a window of a few instructions: 256 complete
///   `remove` + `add` pairs by other threads while this one is preempted
///   exactly there; or
/// * the row was reused a nonzero multiple of 2^29 (536,870,912) times over
///   the guard's lifetime.
///
/// Even then the CAS never goes below zero, never carries into the tag, and
/// moves one counter by the amount the guard booked.
///
/// # Leaks
///
/// The guard has no `into_raw`/`forget`-style escape hatch, and the crate
/// never calls `mem::forget` on one. A guard leaked by the caller
/// (`mem::forget`, an `Rc` cycle) keeps its load on the row until the
/// worker is removed and its row reused: `add` resets the counters, so a
/// leak never outlives the occupant it was booked on.
///
/// ```
/// use selkie_kernel::fleet::{BookLoad, Fleet, Outstanding, WorkerSpec};
///
/// let fleet = Fleet::<1>::new();
/// fleet.add(WorkerSpec::new(1)).unwrap();
/// fleet.add(WorkerSpec::new(2)).unwrap();
/// let mut booking = fleet.book(0, BookLoad { prefill_tokens: 512, decode_blocks: 1 }).unwrap();
/// booking.prefill_complete(); // the worker prefilled: tokens released
/// booking.add_output_block().unwrap(); // decoding grew the KV cache
/// booking.retarget(1).unwrap(); // transport failed: move to worker 2
/// let held = Outstanding { requests: 1, prefill_tokens: 0, decode_blocks: 2 };
/// assert_eq!(fleet.outstanding(1), Some(held));
/// drop(booking);
/// assert_eq!(fleet.outstanding(1), Some(Outstanding::default()));
/// ```
pub struct Booking<F: Deref<Target = Fleet<GROUPS>>, const GROUPS: usize> {
    fleet: F,
    claim: Claim,
}

impl<F: Deref<Target = Fleet<GROUPS>>, const GROUPS: usize> Booking<F, GROUPS> {
    /// Books one request against the worker in `row`, holding the fleet
    /// through `fleet` (see [`Fleet::book`] for the protocol).
    pub fn new(fleet: F, row: usize, load: BookLoad) -> Result<Self, BookError> {
        let claim = fleet.claim(row, None, load)?;
        Ok(Booking { fleet, claim })
    }

    /// As [`new`](Self::new), but only if the row still holds `slot`'s
    /// occupant.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub fn new_for_slot(fleet: F, slot: SlotId, load: BookLoad) -> Result<Self, BookError> {
        Self::new_for_slot_with_active(fleet, slot, load).map(|(booking, _)| booking)
    }

    /// As [`new_for_slot`](Self::new_for_slot), also returning the row's
    /// in-flight requests the admission found, this booking not counted:
    /// the load the request was admitted at, without a read of its own.
    ///
    /// ```
    /// use selkie_kernel::fleet::{BookLoad, Booking, Fleet, WorkerSpec};
    ///
    /// let fleet = Fleet::<1>::new();
    /// let slot = fleet.add(WorkerSpec::new(7)).unwrap();
    /// let (first, found) = Booking::new_for_slot_with_active(&fleet, slot, BookLoad::default()).unwrap();
    /// assert_eq!(found, 0);
    /// let (second, found) = Booking::new_for_slot_with_active(&fleet, slot, BookLoad::default()).unwrap();
    /// assert_eq!(found, 1);
    /// # drop((first, second));
    /// ```
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub fn new_for_slot_with_active(fleet: F, slot: SlotId, load: BookLoad) -> Result<(Self, u32), BookError> {
        let (claim, found) = fleet.claim_inline(slot.row as usize, Some(slot.generation), load)?;
        Ok((Booking { fleet, claim }, found))
    }

    /// Wraps a claim made by the caller on `fleet`.
    pub(crate) fn from_claim(fleet: F, claim: Claim) -> Self {
        Booking { fleet, claim }
    }

    /// The occupancy this booking is held against.
    #[inline]
    pub fn slot(&self) -> SlotId {
        SlotId {
            row: self.claim.row,
            generation: self.claim.generation,
        }
    }

    /// The row this booking is held against.
    #[inline]
    pub fn row(&self) -> usize {
        self.claim.row as usize
    }

    /// Prefill tokens this booking still holds.
    #[inline]
    pub fn prefill_tokens(&self) -> u32 {
        self.claim.prefill_tokens
    }

    /// Decode blocks this booking holds.
    #[inline]
    pub fn decode_blocks(&self) -> u32 {
        self.claim.decode_blocks
    }

    /// The fleet handle.
    #[inline]
    pub fn fleet(&self) -> &F {
        &self.fleet
    }

    /// Prefill is done: release this booking's prefill tokens now (the
    /// request stays booked). Idempotent.
    pub fn prefill_complete(&mut self) {
        let tokens = core::mem::take(&mut self.claim.prefill_tokens);
        if tokens != 0 && self.is_current() {
            self.fleet
                .sub(self.fleet.active_prefill_tokens.at(self.row()), self.tag(), tokens);
        }
    }

    /// The request produced one more KV block: book it on the worker's
    /// decode-block counter (released with the booking).
    ///
    /// Refused with [`BookError::Stale`] if the worker was removed and its
    /// row reused (the block is then counted nowhere). At
    /// [`COUNTER_MAX`](super::COUNTER_MAX) the counter saturates and the
    /// block is not recorded.
    pub fn add_output_block(&mut self) -> Result<(), BookError> {
        if self.is_current() {
            if let Some(added) = add_saturating(self.fleet.active_decode_blocks.at(self.row()), self.tag(), 1) {
                self.claim.decode_blocks += added;
                return Ok(());
            }
        }
        Err(self.fleet.stale(self.row(), self.claim.generation))
    }

    /// Moves this booking to the worker in `new_row` (transport fallback):
    /// books `new_row` first with the load still held, then releases the old
    /// row, so the request is counted on at least one worker at every
    /// instant and on exactly one afterwards. On error nothing moves and the
    /// booking stays where it was. Retargeting to the row it is on is a
    /// no-op.
    pub fn retarget(&mut self, new_row: usize) -> Result<(), BookError> {
        let load = BookLoad {
            prefill_tokens: self.claim.prefill_tokens,
            decode_blocks: self.claim.decode_blocks,
        };
        if new_row == self.row() && self.fleet.slot_id(new_row) == Some(self.slot()) {
            return Ok(());
        }
        #[cfg(selkie_loom)]
        if self.fleet.fault == super::fault::Fault::RetargetReleasesFirst {
            self.fleet.release(&self.claim);
            self.claim = self.fleet.claim(new_row, None, load)?;
            return Ok(());
        }
        let new = self.fleet.claim(new_row, None, load)?;
        let old = core::mem::replace(&mut self.claim, new);
        self.fleet.release(&old);
        Ok(())
    }

    /// As [`retarget`](Self::retarget), but only onto `slot`'s occupant: if
    /// the row was emptied or reused by another worker since the caller
    /// looked `slot` up, the move is refused with [`BookError::Stale`] (or
    /// `NotLive`) and the booking stays where it was. Use this when the
    /// target was resolved from a worker id, so the request is never booked
    /// on a worker other than the one named.
    pub fn retarget_slot(&mut self, slot: SlotId) -> Result<(), BookError> {
        if slot == self.slot() && self.fleet.slot_id(slot.row as usize) == Some(slot) {
            return Ok(());
        }
        let load = BookLoad {
            prefill_tokens: self.claim.prefill_tokens,
            decode_blocks: self.claim.decode_blocks,
        };
        let new = self.fleet.claim(slot.row as usize, Some(slot.generation), load)?;
        let old = core::mem::replace(&mut self.claim, new);
        self.fleet.release(&old);
        Ok(())
    }

    /// Whether the row still holds the occupant this booking was made on.
    #[inline]
    fn is_current(&self) -> bool {
        self.fleet.state_word(self.row(), Ordering::Acquire).generation() == self.claim.generation
    }

    #[inline]
    fn tag(&self) -> u32 {
        tag_of_generation(self.claim.generation)
    }
}

impl<F: Deref<Target = Fleet<GROUPS>>, const GROUPS: usize> Drop for Booking<F, GROUPS> {
    fn drop(&mut self) {
        self.fleet.release(&self.claim);
    }
}

impl<F: Deref<Target = Fleet<GROUPS>>, const GROUPS: usize> core::fmt::Debug for Booking<F, GROUPS> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Booking")
            .field("slot", &self.slot())
            .field("prefill_tokens", &self.claim.prefill_tokens)
            .field("decode_blocks", &self.claim.decode_blocks)
            .finish()
    }
}
