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
//! This module must not scan by itself: the caller's closure does.

use super::booking::BookLoad;
use super::error::{BookError, SelectError};
use super::guard::Booking;
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
