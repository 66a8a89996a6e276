//! Deliberately broken variants of the fleet's atomic protocols, compiled
//! only under `cfg(selkie_loom)`, so that each loom model in `loom-tests/`
//! can show that it catches the bug it is about. Production builds contain
//! none of this.

use super::Fleet;

/// A protocol step replaced by a broken version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The correct protocol.
    None,
    /// Booking reads the active-requests word and then stores `+1` instead
    /// of a CAS: two bookers can both take the last place.
    BookLoadThenStore,
    /// Booking increments without checking the generation tag: a booking
    /// that raced with a slot reuse lands on the new occupant.
    BookIgnoresTag,
    /// Release reads each counter and then stores the difference instead of
    /// a CAS: concurrent releases lose updates.
    ReleaseLoadThenStore,
    /// Release checks neither the generation nor the tags: a guard that
    /// outlived its worker decrements the row's next occupant.
    ReleaseIgnoresGeneration,
    /// Retarget releases the old row before booking the new one: for a
    /// moment the request is counted nowhere.
    RetargetReleasesFirst,
    /// The ticket counter is advanced with a load and a store: two
    /// selections can get the same ticket.
    TicketLoadThenStore,
    /// `peek_ticket` advances the cursor.
    PeekAdvances,
    /// `add` claims its row with a load and a store instead of a CAS: two
    /// adds can take the same row.
    ClaimLoadThenStore,
    /// After a state change, the selectable bit is written once and not
    /// re-checked: racing state changes can leave it wrong.
    SelectableNoRecheck,
    /// `set_capacity_weight` checks the generation and then writes, without
    /// taking the writer bit: a `remove` and `add` in between get the old
    /// occupant's weight written over the new one's.
    UpdateWithoutWriterBit,
    /// Setting a remote load adds it with a load and a store instead of a
    /// CAS: a booking or release in between is lost.
    RemoteLoadThenStore,
}

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// An empty fleet whose protocols contain `fault`.
    pub fn with_fault(fault: Fault) -> Self {
        use crate::lanes::Column;
        use crossbeam_utils::CachePadded;
        Fleet {
            state: Column::new(0),
            worker_lo: Column::new(0),
            worker_hi: Column::new(0),
            dp_rank: Column::new(0),
            rendezvous_salt: Column::new(0),
            capacity_weight: Column::new(0),
            inv_capacity_weight: Column::new(0),
            admission_limit: Column::new(0),
            active_requests: Column::new(0),
            active_prefill_tokens: Column::new(0),
            active_decode_blocks: Column::new(0),
            remote_requests: Column::new(0),
            remote_prefill_tokens: Column::new(0),
            remote_decode_blocks: Column::new(0),
            occupied: super::bits::RowBits::new(),
            selectable: super::bits::RowBits::new(),
            rows: CachePadded::new(crate::sync::atomic_u32(0)),
            ticket: CachePadded::new(crate::sync::atomic_u32(0)),
            fault,
        }
    }
}
