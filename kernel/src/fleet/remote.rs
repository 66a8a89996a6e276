//! Remote load: what other router replicas booked on a row's worker, as
//! this fleet was last told of it (by the host's replica sync).
//!
//! The remote load is folded into the row's tagged load counters: setting
//! it adds the difference from what was set before to `active_requests`,
//! `active_prefill_tokens` and `active_decode_blocks` (the same
//! compare-and-swaps a booking makes, so it never loses a concurrent
//! booking's or release's update), and keeps what it added in three plain
//! columns, so that the next setting, and only it, takes that back. Every
//! scan, the admission check and `outstanding` then see local plus remote
//! load at no cost at all: there is nothing extra to read on the selection
//! path, whether or not a fleet has remote load.
//!
//! Bookings and their releases never touch the remote columns, and a
//! release takes back exactly what its booking added, so a counter never
//! holds less than its row's remote load. `add` zeroes the remote columns
//! with the counters: a new occupant starts with no remote load.
//!
//! This module must not book or release.

use super::counter::{add_saturating, sub_if_tagged, tag_of_generation};
use super::state::{Outstanding, SlotId};
use super::{Fleet, FleetError};
use crate::lanes::Column;
use crate::sync::Ordering;

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// Sets the load other router replicas hold on `slot`'s worker to
    /// `load`: the row's counters (and so its scans, its admission check and
    /// [`outstanding`](Self::outstanding)) count it from now on on top of
    /// this fleet's own bookings, until the next call replaces it. Returns
    /// the remote load now held, which is `load` unless a counter saturated
    /// at [`COUNTER_MAX`](super::COUNTER_MAX).
    ///
    /// The remote load never refuses: a worker may hold more than its
    /// admission limit once its peers' bookings are counted (new local
    /// bookings are then refused until enough are released). Calls for the
    /// same row are serialized by the row's writer bit (as weight and limit
    /// updates are); bookings and releases run concurrently with them.
    ///
    /// Errors as the other updates: [`FleetError::NoSuchRow`],
    /// [`FleetError::StaleSlot`], [`FleetError::Vacant`] (the worker left:
    /// its remote load left with it).
    ///
    /// ```
    /// use selkie_kernel::fleet::{BookLoad, Booking, Fleet, Outstanding, WorkerSpec};
    /// let fleet: Box<Fleet<1>> = Fleet::boxed();
    /// let slot = fleet.add(WorkerSpec { admission_limit: 3, ..WorkerSpec::new(7) }).unwrap();
    /// let peers = Outstanding { requests: 2, prefill_tokens: 100, decode_blocks: 8 };
    /// fleet.set_remote_load(slot, peers).unwrap();
    /// let local = Booking::new(&*fleet, 0, BookLoad { prefill_tokens: 10, decode_blocks: 1 }).unwrap();
    /// assert_eq!(fleet.outstanding(0).unwrap().requests, 3);
    /// // The limit of 3 counts the peers' 2 requests: a second booking is refused.
    /// assert!(Booking::new(&*fleet, 0, BookLoad::default()).is_err());
    /// drop(local);
    /// fleet.set_remote_load(slot, Outstanding::default()).unwrap();
    /// assert_eq!(fleet.outstanding(0).unwrap(), Outstanding::default());
    /// ```
    pub fn set_remote_load(&self, slot: SlotId, load: Outstanding) -> Result<Outstanding, FleetError> {
        let row = self.lock_writer(slot)?;
        let tag = tag_of_generation(slot.generation);
        let held = Outstanding {
            requests: self.move_remote(&self.active_requests, &self.remote_requests, row, tag, load.requests),
            prefill_tokens: self.move_remote(
                &self.active_prefill_tokens,
                &self.remote_prefill_tokens,
                row,
                tag,
                load.prefill_tokens,
            ),
            decode_blocks: self.move_remote(
                &self.active_decode_blocks,
                &self.remote_decode_blocks,
                row,
                tag,
                load.decode_blocks,
            ),
        };
        self.unlock_writer(row);
        Ok(held)
    }

    /// The remote load last set on `row` ([`set_remote_load`](Self::set_remote_load));
    /// zero for a row no call reached since its worker was added, and past
    /// the capacity.
    pub fn remote_load(&self, row: usize) -> Outstanding {
        if !Self::in_range(row) {
            return Outstanding::default();
        }
        Outstanding {
            requests: self.remote_requests.at(row).load(Ordering::Acquire),
            prefill_tokens: self.remote_prefill_tokens.at(row).load(Ordering::Acquire),
            decode_blocks: self.remote_decode_blocks.at(row).load(Ordering::Acquire),
        }
    }

    /// Zeroes `row`'s remote load columns (`add`, before the row is
    /// published).
    pub(super) fn clear_remote_load(&self, row: usize) {
        for column in [
            &self.remote_requests,
            &self.remote_prefill_tokens,
            &self.remote_decode_blocks,
        ] {
            column.at(row).store(0, Ordering::Release);
        }
    }

    /// Moves one counter's remote part from what `remote` holds to `target`
    /// (under the row's writer bit, so `remote` has no other writer); returns
    /// the remote part now held.
    fn move_remote(&self, counter: &Column<GROUPS>, remote: &Column<GROUPS>, row: usize, tag: u32, target: u32) -> u32 {
        let held = remote.at(row).load(Ordering::Relaxed);
        let counter = counter.at(row);
        let now = if target >= held {
            #[cfg(selkie_loom)]
            if self.fault == super::fault::Fault::RemoteLoadThenStore {
                return self.move_remote_load_then_store(counter, remote, row, held, target);
            }
            // The writer bit holds the generation, so the tag matches;
            // `None` (stale) would add nothing.
            held + add_saturating(counter, tag, target - held).unwrap_or(0)
        } else if sub_if_tagged(counter, tag, held - target) {
            target
        } else {
            held
        };
        remote.at(row).store(now, Ordering::Release);
        now
    }

    /// [`move_remote`](Self::move_remote)'s increase as a load then a store
    /// (`Fault::RemoteLoadThenStore`): a booking or release in between is
    /// lost.
    #[cfg(selkie_loom)]
    fn move_remote_load_then_store(
        &self,
        counter: &crate::sync::AtomicU32,
        remote: &Column<GROUPS>,
        row: usize,
        held: u32,
        target: u32,
    ) -> u32 {
        let word = counter.load(Ordering::Acquire);
        counter.store(word + ((target - held) << super::counter::TAG_BITS), Ordering::Release);
        remote.at(row).store(target, Ordering::Release);
        target
    }
}
