//! The host's handle on the kernel's fleet, and the row index: the bottom
//! of the host's layers above the plain types.
//!
//! * [`HostFleet`]: the only code that creates the fleet and adds, changes
//!   and removes its rows (which rows, discovery's registry decides). The
//!   fleet is a
//!   `selkie_kernel::fleet::Fleet<FLEET_GROUPS>` (16,384 rows) built
//!   directly on the heap (no 900 KiB stack copy). Everything else in the
//!   host reads it through `Deref`.
//! * `rows`: the row index, which row holds which worker rank, the
//!   per-row masks the hard filters start from, and the rows kept while
//!   bookings hold them ([`rows::RowIndex`]).
//!
//! This module must not select or book, and it names nothing above it
//! (discovery, filters, policies, the service): it speaks in kernel terms
//! (`WorkerSpec`, the kernel's worker state) and worker ids, and what a
//! worker *is* stays with discovery, as the row index's payload type.

pub(crate) mod rows;

use std::ops::Deref;

use selkie_kernel::fleet::{Fleet, Outstanding, SlotId, WorkerSpec, WorkerState};

/// Lane groups of the host's fleet: `FLEET_GROUPS * 8` = 16,384 rows.
pub const FLEET_GROUPS: usize = 2048;

/// The kernel fleet type the host uses.
pub type KernelFleet = Fleet<FLEET_GROUPS>;

/// One kernel row held by a worker rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowHandle {
    pub(crate) row: usize,
    pub(crate) slot: SlotId,
}

/// The heap-allocated fleet.
pub(crate) struct HostFleet {
    inner: Box<KernelFleet>,
}

impl HostFleet {
    /// Rows the fleet holds.
    pub(crate) const CAPACITY: usize = KernelFleet::CAPACITY;

    pub(crate) fn new() -> Self {
        HostFleet { inner: Fleet::boxed() }
    }

    /// Adds one worker rank as a row, in `state`; `None` when the fleet is
    /// full.
    pub(crate) fn add_row(&self, spec: WorkerSpec, state: WorkerState) -> Option<RowHandle> {
        let slot = self.inner.add(spec).ok()?;
        let h = RowHandle {
            row: slot.row as usize,
            slot,
        };
        if state != WorkerState::Live {
            // The slot is ours and its generation current: this cannot fail.
            let _ = self.inner.set_state(slot, state);
        }
        Some(h)
    }

    /// Applies a changed worker to a row: `spec`'s weight and limit (its id
    /// and rank are the row's already), and `state`.
    pub(crate) fn update_row(&self, h: RowHandle, spec: &WorkerSpec, state: WorkerState) {
        // The row index owns `h`, so the slot is current; errors cannot happen.
        let _ = self.inner.set_capacity_weight(h.slot, spec.capacity_weight);
        let _ = self.inner.set_admission_limit(h.slot, spec.admission_limit);
        let _ = self.inner.set_state(h.slot, state);
    }

    /// Removes a row; bookings on it release into nothing.
    pub(crate) fn remove_row(&self, h: RowHandle) {
        let _ = self.inner.remove(h.slot);
    }

    /// Takes a row out of rotation while keeping it (and its counters):
    /// cordoned, so no booking can start on it; bookings already on it keep
    /// releasing into it.
    pub(crate) fn retire_row(&self, h: RowHandle) {
        // The row index owns `h`, so the slot is current; errors cannot happen.
        let _ = self.inner.set_state(h.slot, WorkerState::Cordoned);
        // Other replicas' load on the row goes with the worker: the row
        // drains with this replica's own bookings.
        let _ = self.inner.set_remote_load(h.slot, Outstanding::default());
    }

    /// Whether no booking holds load on the row any more.
    pub(crate) fn is_drained(&self, h: RowHandle) -> bool {
        // A row that no longer holds `h`'s occupant holds nothing of it.
        self.inner.slot_id(h.row) != Some(h.slot) || self.inner.is_drained(h.row)
    }
}

impl Deref for HostFleet {
    type Target = KernelFleet;
    fn deref(&self) -> &KernelFleet {
        &self.inner
    }
}
