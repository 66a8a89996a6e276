//! The host's handle on the kernel's fleet: the one module that creates the
//! fleet and turns discovery records into kernel rows.
//!
//! The fleet is a `selkie_kernel::fleet::Fleet<FLEET_GROUPS>` (16,384 rows)
//! built directly on the heap (no 700 KiB stack copy). Everything else in
//! the host reads it through `Deref`. This module must not select.

use std::ops::Deref;

use selkie_kernel::fleet::{Fleet, SlotId, WorkerSpec, WorkerState as KernelState, UNLIMITED};

use crate::discovery::{WorkerRecord, WorkerState};
use crate::types::DpRank;

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

fn kernel_state(s: WorkerState) -> KernelState {
    match s {
        WorkerState::Live => KernelState::Live,
        WorkerState::Draining => KernelState::Draining,
        WorkerState::Cordoned => KernelState::Cordoned,
    }
}

impl HostFleet {
    /// Rows the fleet holds.
    pub(crate) const CAPACITY: usize = KernelFleet::CAPACITY;

    #[cfg(not(selkie_loom))]
    pub(crate) fn new() -> Self {
        let mut slot = Box::<KernelFleet>::new_uninit();
        Fleet::init_zeroed(&mut slot);
        // SAFETY: `init_zeroed` initialised the whole value in place.
        let inner = unsafe { slot.assume_init() };
        HostFleet { inner }
    }

    /// Under loom the kernel's atomics are not plain integers, so the fleet
    /// cannot be zero-initialised in place.
    #[cfg(selkie_loom)]
    pub(crate) fn new() -> Self {
        HostFleet {
            inner: Box::new(Fleet::new()),
        }
    }

    /// Adds one rank of `record` as a row; `None` when the fleet is full.
    pub(crate) fn add_row(&self, record: &WorkerRecord, rank: DpRank) -> Option<RowHandle> {
        let spec = WorkerSpec {
            worker_id: record.worker_id,
            dp_rank: rank,
            capacity_weight: record.capacity_weight,
            admission_limit: record.max_active_requests.unwrap_or(UNLIMITED),
        };
        let slot = self.inner.add(spec).ok()?;
        let h = RowHandle {
            row: slot.row as usize,
            slot,
        };
        if record.state != WorkerState::Live {
            // The slot is ours and its generation current: this cannot fail.
            let _ = self.inner.set_state(slot, kernel_state(record.state));
        }
        Some(h)
    }

    /// Applies a changed record to a row (weight, limit, state).
    pub(crate) fn update_row(&self, h: RowHandle, record: &WorkerRecord) {
        // The registry owns `h`, so the slot is current; errors cannot happen.
        let _ = self.inner.set_capacity_weight(h.slot, record.capacity_weight);
        let _ = self
            .inner
            .set_admission_limit(h.slot, record.max_active_requests.unwrap_or(UNLIMITED));
        let _ = self.inner.set_state(h.slot, kernel_state(record.state));
    }

    /// Removes a row; bookings on it release into nothing.
    pub(crate) fn remove_row(&self, h: RowHandle) {
        let _ = self.inner.remove(h.slot);
    }

    /// Takes a row out of rotation while keeping it (and its counters):
    /// cordoned, so no booking can start on it; bookings already on it keep
    /// releasing into it.
    pub(crate) fn retire_row(&self, h: RowHandle) {
        // The registry owns `h`, so the slot is current; errors cannot happen.
        let _ = self.inner.set_state(h.slot, KernelState::Cordoned);
    }

    /// Whether no booking holds load on the row any more.
    pub(crate) fn is_drained(&self, h: RowHandle) -> bool {
        self.inner.is_drained(h.row)
    }
}

impl Deref for HostFleet {
    type Target = KernelFleet;
    fn deref(&self) -> &KernelFleet {
        &self.inner
    }
}
