//! Changing the fleet: add, remove, set state, update weight and limit.
//!
//! # Claiming a row
//!
//! `add` takes the lowest clear bit of the `occupied` bitmap with a CAS, so
//! rows are reused lowest first and [`Fleet::rows`] (the scan length) stays as
//! small as the fleet's peak size. Whoever set the bit owns the row until it
//! publishes the worker: no other `add` can claim it, and every operation
//! that takes a `SlotId` refuses an Empty row, so the metadata stores cannot
//! interleave with anyone's.
//!
//! # Generations
//!
//! `add` bumps the row's generation and stores `0 << 8 | tag` in each load
//! counter *before* publishing `Live`: from that store on, every outstanding
//! booking of the previous occupant is stale (its tag-checked CAS fails), and
//! the new worker starts at zero load.
//!
//! # The selectable bitmap
//!
//! After every state change, [`Fleet::sync_selectable`] sets or clears the
//! row's bit to match the state word, then re-reads the word and repeats if
//! it changed. Whoever changes the state last therefore leaves the bit right,
//! even if two changes race: a thread that wrote a stale bit after another's
//! correct one read-modify-wrote the same bitmap word after it, so (by the
//! word's release sequence) its re-read sees the later state and it repairs
//! the bit.
//!
//! This module must not book or scan.

use super::counter::{limit_word, pack, tag_of_generation};
use super::error::FleetError;
use super::state::{SlotId, SlotState, StateWord, WorkerSpec, WorkerState, GENERATION_MASK, WRITER};
use super::Fleet;
use crate::sync::{spin_loop, Ordering};

/// Whether `weight` can be a capacity weight: finite and positive, with a
/// finite reciprocal (the weighted kernels multiply by `1 / weight`; a
/// subnormal weight's reciprocal is `+inf`, and `0 * inf` is NaN).
pub fn capacity_weight_ok(weight: f32) -> bool {
    weight.is_finite() && weight > 0.0 && (1.0 / weight).is_finite()
}

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// Adds a worker in the lowest free row and publishes it Live, with zero
    /// load and a new generation.
    ///
    /// Errors: [`FleetError::BadCapacityWeight`] if the weight is not finite
    /// and positive with a finite reciprocal (see [`capacity_weight_ok`]),
    /// [`FleetError::Full`] if every row is occupied.
    pub fn add(&self, worker: WorkerSpec) -> Result<SlotId, FleetError> {
        let weight = worker.capacity_weight;
        if !capacity_weight_ok(weight) {
            return Err(FleetError::BadCapacityWeight {
                worker_id: worker.worker_id,
                weight,
            });
        }
        let row = self.claim_row().ok_or(FleetError::Full {
            capacity: Self::CAPACITY,
        })?;
        // The claim (Acquire) synchronized with the `remove` that freed the
        // row (Release): its Empty store and its selectable clear are visible.
        let old = self.state_word(row, Ordering::Relaxed);
        debug_assert_eq!(old.state(), SlotState::Empty, "an unoccupied row is Empty");
        debug_assert!(!old.writer_held(), "remove waits for the writer bit");
        let generation = (old.generation() + 1) & GENERATION_MASK;
        let tag = tag_of_generation(generation);
        // Every write to a counter is a read-modify-write, this reset
        // included: it then sits in one total order with the CASes of
        // stale guards still releasing (a plain store would be just as
        // correct in the C++ model, but loom orders a plain store racing an
        // RMW too loosely and reports a false stale tag).
        for counter in [
            &self.active_requests,
            &self.active_prefill_tokens,
            &self.active_decode_blocks,
        ] {
            counter.at(row).swap(pack(0, tag), Ordering::AcqRel);
        }
        self.clear_remote_load(row);
        self.write_metadata(row, worker.worker_id, worker.dp_rank);
        self.write_weight(row, weight);
        self.admission_limit
            .at(row)
            .store(limit_word(worker.admission_limit), Ordering::Release);
        self.rows.fetch_max(row as u32 + 1, Ordering::AcqRel);
        self.state
            .at(row)
            .store(StateWord::new(SlotState::Live, generation).0, Ordering::SeqCst);
        self.sync_selectable(row);
        Ok(SlotId {
            row: row as u32,
            generation,
        })
    }

    /// Removes the worker of `slot`: its row becomes Empty, unselectable, and
    /// free for the next `add`. Outstanding bookings stay valid guards; they
    /// release into the removed worker's counters (or nowhere, once the row
    /// is reused).
    ///
    /// Waits (spins) only while an update of the same row holds its writer
    /// bit, i.e. for a few stores.
    pub fn remove(&self, slot: SlotId) -> Result<(), FleetError> {
        let row = self.check_row(slot)?;
        let mut word = self.state_word(row, Ordering::Relaxed);
        loop {
            self.check_occupant(slot, word)?;
            if word.writer_held() {
                spin_loop();
                word = self.state_word(row, Ordering::Relaxed);
                continue;
            }
            let empty = StateWord::new(SlotState::Empty, slot.generation);
            match self
                .state
                .at(row)
                .compare_exchange_weak(word.0, empty.0, Ordering::SeqCst, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => word = StateWord(now),
            }
        }
        self.sync_selectable(row);
        self.occupied.clear(row, Ordering::Release);
        Ok(())
    }

    /// Puts the worker of `slot` in `state`. Draining and Cordoned workers
    /// take no new bookings (a booking racing with the change either
    /// completes before it or is undone); their existing bookings are kept.
    pub fn set_state(&self, slot: SlotId, state: WorkerState) -> Result<(), FleetError> {
        let row = self.check_row(slot)?;
        let mut word = self.state_word(row, Ordering::Relaxed);
        loop {
            self.check_occupant(slot, word)?;
            let new = word.with_state(state.into());
            if new == word {
                break;
            }
            match self
                .state
                .at(row)
                .compare_exchange_weak(word.0, new.0, Ordering::SeqCst, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => word = StateWord(now),
            }
        }
        self.sync_selectable(row);
        Ok(())
    }

    /// Changes the capacity weight (and its inverse) of `slot`'s worker.
    /// Scans running meanwhile may see the old or the new value per column.
    pub fn set_capacity_weight(&self, slot: SlotId, weight: f32) -> Result<(), FleetError> {
        #[cfg(selkie_loom)]
        if self.fault == super::fault::Fault::UpdateWithoutWriterBit {
            let row = self.check_row(slot)?;
            self.check_occupant(slot, self.state_word(row, Ordering::Acquire))?;
            self.write_weight(row, weight);
            return Ok(());
        }
        let row = self.lock_writer(slot)?;
        let result = if capacity_weight_ok(weight) {
            self.write_weight(row, weight);
            Ok(())
        } else {
            let worker_id = self.read_worker_id(row);
            Err(FleetError::BadCapacityWeight { worker_id, weight })
        };
        self.unlock_writer(row);
        result
    }

    /// Changes the admission limit of `slot`'s worker ([`super::UNLIMITED`]
    /// for none). Lowering it below the requests in flight refuses new
    /// bookings until enough are released; nothing is cancelled.
    pub fn set_admission_limit(&self, slot: SlotId, limit: u32) -> Result<(), FleetError> {
        let row = self.lock_writer(slot)?;
        self.admission_limit.at(row).store(limit_word(limit), Ordering::Release);
        self.unlock_writer(row);
        Ok(())
    }

    /// Claims the lowest free row (or, in a loom model, its broken variant).
    #[inline]
    fn claim_row(&self) -> Option<usize> {
        #[cfg(selkie_loom)]
        if self.fault == super::fault::Fault::ClaimLoadThenStore {
            return self.occupied.claim_lowest_clear_load_store();
        }
        self.occupied.claim_lowest_clear()
    }

    /// Makes `row`'s selectable bit match its state word (see module docs).
    pub(crate) fn sync_selectable(&self, row: usize) {
        let mut word = self.state_word(row, Ordering::SeqCst);
        loop {
            if word.is_live() {
                self.selectable.set(row, Ordering::AcqRel);
            } else {
                self.selectable.clear(row, Ordering::AcqRel);
            }
            #[cfg(selkie_loom)]
            if self.fault == super::fault::Fault::SelectableNoRecheck {
                return;
            }
            let now = self.state_word(row, Ordering::SeqCst);
            if now.is_live() == word.is_live() {
                return;
            }
            word = now;
        }
    }

    /// The row of `slot`, if it is in the fleet.
    #[inline]
    fn check_row(&self, slot: SlotId) -> Result<usize, FleetError> {
        let row = slot.row as usize;
        if Self::in_range(row) {
            Ok(row)
        } else {
            Err(FleetError::NoSuchRow {
                row: slot.row,
                capacity: Self::CAPACITY,
            })
        }
    }

    /// Whether `word` is `slot`'s occupant.
    #[inline]
    fn check_occupant(&self, slot: SlotId, word: StateWord) -> Result<(), FleetError> {
        let found = word.generation();
        if found != slot.generation & GENERATION_MASK {
            return Err(FleetError::StaleSlot {
                row: slot.row,
                expected: slot.generation,
                found,
            });
        }
        if word.state() == SlotState::Empty {
            return Err(FleetError::Vacant {
                row: slot.row,
                generation: slot.generation,
            });
        }
        Ok(())
    }

    /// Takes `slot`'s writer bit (spinning while another update holds it).
    pub(super) fn lock_writer(&self, slot: SlotId) -> Result<usize, FleetError> {
        let row = self.check_row(slot)?;
        let mut word = self.state_word(row, Ordering::Relaxed);
        loop {
            self.check_occupant(slot, word)?;
            if word.writer_held() {
                spin_loop();
                word = self.state_word(row, Ordering::Relaxed);
                continue;
            }
            let locked = word.0 | WRITER;
            match self
                .state
                .at(row)
                .compare_exchange_weak(word.0, locked, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return Ok(row),
                Err(now) => word = StateWord(now),
            }
        }
    }

    /// Releases the writer bit taken by [`lock_writer`](Self::lock_writer).
    /// The generation cannot have changed meanwhile: `remove` waits for it.
    pub(super) fn unlock_writer(&self, row: usize) {
        self.state.at(row).fetch_and(!WRITER, Ordering::Release);
    }

    fn write_metadata(&self, row: usize, worker_id: u64, dp_rank: u32) {
        self.worker_lo.at(row).store(worker_id as u32, Ordering::Release);
        self.worker_hi
            .at(row)
            .store((worker_id >> 32) as u32, Ordering::Release);
        self.dp_rank.at(row).store(dp_rank, Ordering::Release);
        self.rendezvous_salt.at(row).store(
            crate::kernels::rendezvous::worker_salt(worker_id, dp_rank),
            Ordering::Release,
        );
    }

    fn write_weight(&self, row: usize, weight: f32) {
        self.capacity_weight.at(row).store(weight.to_bits(), Ordering::Release);
        self.inv_capacity_weight
            .at(row)
            .store((1.0 / weight).to_bits(), Ordering::Release);
    }

    /// The worker id of an occupied row whose occupant cannot change (the
    /// caller holds the writer bit).
    fn read_worker_id(&self, row: usize) -> u64 {
        let lo = self.worker_lo.at(row).load(Ordering::Acquire);
        let hi = self.worker_hi.at(row).load(Ordering::Acquire);
        (hi as u64) << 32 | lo as u64
    }
}
