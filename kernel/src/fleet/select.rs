//! Select and book: scan, book the pick, and on refusal rescan a bounded
//! number of times.
//!
//! ```text
//! for attempt in 1..=max_attempts:
//!     row := scan(mask, rng)            -- None: NoEligible (first scan) / AllOverloaded
//!     book(row):  Ok        -> return the booking
//!                 refused   -> clear row in mask; rescan
//! AllOverloaded
//! ```
//!
//! The mask is the caller's, per request: clearing a refused row makes the
//! next scan skip it, so each attempt tries another worker. `Overloaded`,
//! `NotLive` and `Stale` refusals are all cleared (a row that was removed or
//! reused during this request is not one the request's filters approved).
//! Nothing is allocated; the scan decides how rows are ranked.
//!
//! [`Booking::select_slot`] is the same loop for a caller that keeps its own
//! row index (a host whose snapshot of the rows may be stale): its chooser
//! names a [`SlotId`] (row and generation) and the load to book there, and
//! the booking is refused as `Stale` if the row changed occupant since,
//! never credited to the newcomer.
//!
//! This module must not scan by itself: the caller's closure does.

use super::booking::BookLoad;
use super::error::{BookError, SelectError};
use super::guard::Booking;
use super::state::SlotId;
use super::Fleet;
use crate::mask::contains;
use crate::Rng;
use core::ops::Deref;

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// Scans with `scan`, books its pick, and on refusal clears the row in
    /// `mask` and rescans, up to `max_attempts` bookings (at least one).
    ///
    /// Errors: [`SelectError::NoEligible`] if the first scan finds nothing,
    /// [`SelectError::AllOverloaded`] if every attempt was refused,
    /// [`SelectError::BadPick`] if the scan returns a row outside `mask` or
    /// the fleet.
    pub fn select_and_book<S>(
        &self,
        mask: &mut [u64],
        load: BookLoad,
        rng: &mut Rng,
        scan: S,
        max_attempts: u32,
    ) -> Result<Booking<&Self, GROUPS>, SelectError>
    where
        S: FnMut(&[u64], &mut Rng) -> Option<usize>,
    {
        Booking::select(self, mask, load, rng, scan, max_attempts)
    }
}

impl<F: Deref<Target = Fleet<GROUPS>>, const GROUPS: usize> Booking<F, GROUPS> {
    /// [`Fleet::select_and_book`] holding the fleet through any handle `F`
    /// (e.g. an `Arc`).
    pub fn select<S>(
        fleet: F,
        mask: &mut [u64],
        load: BookLoad,
        rng: &mut Rng,
        mut scan: S,
        max_attempts: u32,
    ) -> Result<Self, SelectError>
    where
        S: FnMut(&[u64], &mut Rng) -> Option<usize>,
    {
        let mut last: Option<BookError> = None;
        let mut attempts = 0;
        while attempts < max_attempts.max(1) {
            let Some(row) = scan(mask, rng) else { break };
            if row >= Fleet::<GROUPS>::CAPACITY || !contains(mask, row) {
                return Err(SelectError::BadPick { row });
            }
            attempts += 1;
            match fleet.claim(row, None, load) {
                Ok(claim) => return Ok(Booking::from_claim(fleet, claim)),
                Err(e) => {
                    mask[row / 64] &= !(1u64 << (row % 64));
                    last = Some(e);
                }
            }
        }
        match last {
            None => Err(SelectError::NoEligible),
            Some(last) => Err(SelectError::AllOverloaded { attempts, last }),
        }
    }
}

/// What a [`Booking::select_slot`] chooser picked: the occupancy to book and
/// the load to book on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotPick {
    /// The row and the generation of its occupant the chooser saw.
    pub slot: SlotId,
    /// The load to book there.
    pub load: BookLoad,
}

impl<F: Deref<Target = Fleet<GROUPS>>, const GROUPS: usize> Booking<F, GROUPS> {
    /// Select and book with a chooser that names slots: asks `choose` for a
    /// pick among the set rows of `mask`, books it with the generation
    /// check, and on refusal clears the row in `mask` and asks again, up to
    /// `max_attempts` bookings (at least one). `choose` gets the mask and
    /// the last refusal (`None` on the first call), and may narrow or
    /// replace the mask; it returns `Ok(None)` when it has nothing left, or
    /// its own error, which ends the selection as `Err(e)`.
    ///
    /// The outer `Result` is the chooser's; the inner one the fleet's:
    /// [`SelectError::NoEligible`] if the first call picked nothing,
    /// [`SelectError::AllOverloaded`] once every pick was refused,
    /// [`SelectError::BadPick`] for a pick outside `mask` or the fleet.
    ///
    /// ```
    /// use selkie_kernel::fleet::{BookError, BookLoad, Booking, Fleet, SelectError, SlotPick, WorkerSpec};
    /// let fleet = Fleet::<1>::new();
    /// let a = fleet.add(WorkerSpec::new(1)).unwrap();
    /// let b = fleet.add(WorkerSpec::new(2)).unwrap();
    /// // `a` changes occupant after the caller indexed it.
    /// fleet.remove(a).unwrap();
    /// fleet.add(WorkerSpec::new(3)).unwrap();
    /// let mut mask = [0b11u64];
    /// let mut refusals = Vec::new();
    /// let booked = Booking::select_slot(&fleet, &mut mask, 4, |m, last: Option<BookError>| {
    ///     refusals.extend(last);
    ///     let pick = if m[0] & 1 != 0 { a } else { b };
    ///     Ok::<_, ()>(Some(SlotPick { slot: pick, load: BookLoad::default() }))
    /// });
    /// let booking = booked.unwrap().unwrap();
    /// assert_eq!(booking.slot(), b);
    /// assert!(matches!(refusals[..], [BookError::Stale { row: 0, .. }]));
    /// assert_eq!(mask, [0b10]);
    /// ```
    pub fn select_slot<C, E>(
        fleet: F,
        mask: &mut [u64],
        max_attempts: u32,
        mut choose: C,
    ) -> Result<Result<Self, SelectError>, E>
    where
        C: FnMut(&mut [u64], Option<BookError>) -> Result<Option<SlotPick>, E>,
    {
        let mut last: Option<BookError> = None;
        let mut attempts = 0;
        while attempts < max_attempts.max(1) {
            let Some(pick) = choose(mask, last)? else { break };
            let row = pick.slot.row as usize;
            if row >= Fleet::<GROUPS>::CAPACITY || !contains(mask, row) {
                return Ok(Err(SelectError::BadPick { row }));
            }
            attempts += 1;
            match fleet.claim(row, Some(pick.slot.generation), pick.load) {
                Ok(claim) => return Ok(Ok(Booking::from_claim(fleet, claim))),
                Err(e) => {
                    mask[row / 64] &= !(1u64 << (row % 64));
                    last = Some(e);
                }
            }
        }
        Ok(match last {
            None => Err(SelectError::NoEligible),
            Some(last) => Err(SelectError::AllOverloaded { attempts, last }),
        })
    }
}
