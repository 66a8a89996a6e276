//! The lock-free fleet: worker slots stored as atomic columns, and the
//! booking protocol that admits requests against them.
//!
//! A [`Fleet<GROUPS>`] has `GROUPS * LANES` rows (16,384 at `GROUPS =
//! 2048`). Each row is a worker slot; each signal is a 32-byte aligned column
//! of `AtomicU32`: the state word (state + generation, see [`SlotState`]),
//! worker id (two words), data-parallel rank, capacity weight and its
//! inverse (`f32` bits), admission limit, and three tagged load counters
//! (active requests, active prefill tokens, active decode blocks; see
//! [`COUNTER_MAX`]), which also hold the load other router replicas booked
//! on the worker ([`Fleet::set_remote_load`]; the part that is theirs is
//! kept in three more plain columns, which no scan reads). Two bitmaps say which rows are occupied and which are
//! selectable (Live); a high-water mark, [`Fleet::rows`], bounds the scans.
//!
//! # Protocol in one page
//!
//! ```text
//! add:      claim lowest clear `occupied` bit (CAS)         -> the row is ours
//!           counters := 0 << 8 | tag(gen + 1)               -> old bookings go stale
//!           metadata := spec (Release);  rows := max(rows, row + 1)
//!           state := Live(gen + 1) (SeqCst);  sync selectable bit
//! book:     s := state (Acquire); Live?  limit := admission limit
//!           CAS active: tag == tag(gen) && value < limit -> value + 1    (SeqCst)
//!           re-check state == Live(gen) (SeqCst), else undo and refuse
//!           tag-checked CAS add prefill tokens, decode blocks
//! release:  state generation == gen?  (else the slot was reused: no-op)
//!           tag-checked CAS sub tokens, blocks, then the request
//! remove:   CAS state X(gen) -> Empty(gen) (waits while WRITER is set);
//!           sync selectable; clear occupied (Release)
//! update:   CAS state |= WRITER; store weight / limit (Release); clear WRITER
//! ```
//!
//! Bookings are RAII guards ([`Booking`]) that release exactly once. A guard
//! that outlives its worker never touches the row's next occupant: the
//! generation check and the counter tags make its release a no-op (the ABA
//! bound is in [`Booking`]'s docs).
//!
//! # How a SIMD scan reads the columns soundly
//!
//! The kernels read a column through an [`AtomicView`] (from
//! [`Fleet::active_requests`] and friends), whose lane groups are loaded by
//! `sync::load_lanes`: elsewhere than x86-64, and always under miri and
//! loom, eight relaxed atomic loads; on x86-64 aligned vector loads in
//! inline assembly (two 16-byte loads on the SSE2 baseline, one 32-byte load
//! with AVX), which read each lane as one 4-byte access and so are eight
//! `AtomicU32::load(Relaxed)`. The manuals document that per-lane atomicity
//! for aligned accesses of up to 8 bytes and, on processors with AVX, for
//! 16-byte loads; `sync::load_lanes` states what is relied on beyond that,
//! and why a torn lane could only cost a worse pick. No plain (non-atomic)
//! read of a shared counter ever happens, so there is no data race in
//! Rust's memory model.
//!
//! What a scan may observe: each lane is a value its counter really held at
//! some instant during the scan (never torn, never invented), but different
//! rows are read at different instants, so a scan is stale by at most its
//! own duration. The selectable mask is likewise a per-word copy. A scan can
//! therefore pick a row that filled up or was removed while it ran; the
//! booking's compare-and-swap then refuses (`Overloaded`, `NotLive`,
//! `Stale`) and [`Fleet::select_and_book`] rescans. A stale scan can cost a
//! sub-optimal pick or a retry; it can never over-admit, because the
//! admission limit is checked by the read-modify-write on the live value.
//!
//! A kernel that reads a column in several passes (the argmin: minimum,
//! then ties, then the k-th tie) may see a row's value change between its
//! passes. Such a kernel must stay total over a live view: return some
//! eligible row or `None`, never panic or return an ineligible row. A caller
//! that wants one consistent view copies the column first (one lane-group
//! load per 8 rows) and scans the copy.
//!
//! # Neighbouring rows share cache lines
//!
//! Columns are padded to whole lane groups (32 bytes), not to cache lines:
//! one 64-byte line holds the same counter of 16 consecutive rows. Bookings
//! and releases on different workers whose rows are in the same 16-row block
//! therefore contend for one line (false sharing): each compare-and-swap
//! takes the line exclusive, and a scan's load of it then misses. This is
//! the price of the layout that makes scans fast (a scan reads each line
//! once, for 16 rows); padding every counter to its own line would make a
//! column 16 times larger. Only the fleet-wide words every selection may
//! write, the high-water mark and the round-robin ticket, are cache-padded.
//! The state words and the occupied / selectable bitmaps share lines the
//! same way, but change only when workers come, go or change state.
//!
//! This module must not scan (that is `kernels`), allocate (but for
//! [`Fleet::boxed`], which allocates the fleet itself), or block:
//! bookings and selections are lock-free. Updates of a row's weight or limit
//! hold the row's writer bit for a few stores, which only another update or a
//! `remove` of the same row waits for.
//!
//! ```
//! use selkie_kernel::fleet::{BookLoad, Fleet, WorkerSpec};
//! use selkie_kernel::kernels::least_loaded::least_loaded;
//! use selkie_kernel::{Rng, RowMask};
//!
//! static FLEET: Fleet<2> = Fleet::new(); // 16 rows, in a static: no heap
//! let a = FLEET.add(WorkerSpec { admission_limit: 1, ..WorkerSpec::new(7) }).unwrap();
//! let b = FLEET.add(WorkerSpec::new(8)).unwrap();
//!
//! let mut mask = RowMask::<1>::new();
//! FLEET.selectable(mask.words_mut());
//! let scan = |m: &[u64], r: &mut Rng| least_loaded(&FLEET.active_requests(), m, r);
//! let load = BookLoad { prefill_tokens: 100, decode_blocks: 2 };
//! let first = FLEET.select_and_book(mask.words_mut(), load, &mut Rng::new(1), scan, 4).unwrap();
//! let second = FLEET.select_and_book(mask.words_mut(), load, &mut Rng::new(2), scan, 4).unwrap();
//! assert_ne!(first.slot(), second.slot());
//! assert_eq!(FLEET.outstanding(b.row as usize).unwrap().requests, 1);
//! drop((first, second));
//! assert_eq!(FLEET.outstanding(a.row as usize).unwrap().requests, 0);
//! ```

mod bits;
mod booking;
mod counter;
mod cursor;
mod error;
#[cfg(selkie_loom)]
#[doc(hidden)]
pub mod fault;
mod guard;
mod read;
mod remote;
mod select;
mod slots;
mod state;

#[cfg(all(test, not(selkie_loom)))]
mod tests;

pub use booking::BookLoad;
pub use counter::COUNTER_MAX;
pub use error::{BookError, FleetError, SelectError};
pub use guard::Booking;
pub use select::SlotPick;
pub use slots::capacity_weight_ok;
pub use state::{Outstanding, SlotId, SlotState, WorkerInfo, WorkerSpec, WorkerState, UNLIMITED};

use crate::lanes::{padded_rows, AtomicView, Column, Decode, LANES};
use crate::sync::{AtomicU32, Ordering};
use bits::RowBits;
use crossbeam_utils::CachePadded;

/// A fixed-capacity fleet of `GROUPS * LANES` worker slots, shared by every
/// selecting thread (`&Fleet`, `Arc<Fleet>`, or a `static`).
///
/// All-zero bytes are a valid empty fleet: build one in a `static` with
/// [`Fleet::new`], on the heap with [`Fleet::boxed`], or in place in memory
/// of your own with [`Fleet::init_zeroed`].
///
/// Each column packs 16 rows to a 64-byte cache line, so bookings on
/// neighbouring rows contend for the same lines (see the module docs).
pub struct Fleet<const GROUPS: usize> {
    /// State word per row (`state::StateWord`).
    state: Column<GROUPS>,
    /// Low 32 bits of the worker id.
    worker_lo: Column<GROUPS>,
    /// High 32 bits of the worker id.
    worker_hi: Column<GROUPS>,
    /// Data-parallel rank.
    dp_rank: Column<GROUPS>,
    /// The row's rendezvous salt, `worker_salt(worker id, rank)` (see
    /// `kernels::rendezvous`).
    rendezvous_salt: Column<GROUPS>,
    /// Capacity weight, `f32` bits.
    capacity_weight: Column<GROUPS>,
    /// `1 / capacity weight`, `f32` bits (least-loaded-weighted multiplies).
    inv_capacity_weight: Column<GROUPS>,
    /// Admission limit as a counter word (`counter::limit_word`): capped
    /// to `COUNTER_MAX`, compared with `active_requests` words as they are.
    admission_limit: Column<GROUPS>,
    /// Tagged counter: requests in flight, including reservations.
    active_requests: Column<GROUPS>,
    /// Tagged counter: prefill tokens booked and not yet prefilled.
    active_prefill_tokens: Column<GROUPS>,
    /// Tagged counter: KV blocks of decoding requests.
    active_decode_blocks: Column<GROUPS>,
    /// The part of `active_requests` other router replicas hold (plain
    /// value; see `remote`).
    remote_requests: Column<GROUPS>,
    /// The part of `active_prefill_tokens` other router replicas hold.
    remote_prefill_tokens: Column<GROUPS>,
    /// The part of `active_decode_blocks` other router replicas hold.
    remote_decode_blocks: Column<GROUPS>,
    /// Rows claimed by an `add` and not yet freed by a `remove`.
    occupied: RowBits<GROUPS>,
    /// Rows whose state is Live (kept in sync by every state change).
    selectable: RowBits<GROUPS>,
    /// High-water mark: one past the highest row ever occupied.
    rows: CachePadded<AtomicU32>,
    /// Round-robin ticket counter (see `cursor`).
    ticket: CachePadded<AtomicU32>,
    /// The deliberately broken variant a loom model asked for.
    #[cfg(selkie_loom)]
    fault: fault::Fault,
}

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// Number of worker slots (rows).
    pub const CAPACITY: usize = GROUPS * LANES;

    /// An empty fleet, usable in a `static`.
    ///
    /// At 16,384 rows a fleet is about 900 KiB: build big ones in a
    /// `static` or with [`Fleet::boxed`], not on the stack.
    #[cfg(not(selkie_loom))]
    pub const fn new() -> Self {
        const { assert!(GROUPS * LANES <= u32::MAX as usize, "rows must fit in u32") };
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
            occupied: RowBits::new(),
            selectable: RowBits::new(),
            rows: CachePadded::new(crate::sync::atomic_u32(0)),
            ticket: CachePadded::new(crate::sync::atomic_u32(0)),
        }
    }

    /// An empty fleet (loom's atomics cannot be built in a `const fn`).
    #[cfg(selkie_loom)]
    pub fn new() -> Self {
        Self::with_fault(fault::Fault::None)
    }

    /// An empty fleet on the heap, built there (a 16,384-row fleet is about
    /// 900 KiB, which `Box::new(Fleet::new())` may copy through the
    /// stack). Needs the `alloc` feature (on with the default `std`).
    ///
    /// ```
    /// use selkie_kernel::fleet::{Fleet, WorkerSpec};
    /// use std::sync::Arc;
    /// let fleet: Arc<Fleet<2048>> = Fleet::boxed().into();
    /// assert_eq!((fleet.rows(), Fleet::<2048>::CAPACITY), (0, 16_384));
    /// fleet.add(WorkerSpec::new(7)).unwrap();
    /// ```
    #[cfg(feature = "alloc")]
    pub fn boxed() -> alloc::boxed::Box<Self> {
        #[cfg(not(selkie_loom))]
        {
            let mut slot = alloc::boxed::Box::<Self>::new_uninit();
            Self::init_zeroed(&mut slot);
            // SAFETY: `init_zeroed` initialized the whole value in place
            // (its contract), so the box holds a valid `Fleet`.
            unsafe { slot.assume_init() }
        }
        #[cfg(selkie_loom)]
        {
            alloc::boxed::Box::new(Self::new())
        }
    }

    /// Initializes `slot` as an empty fleet in place, by zero-filling it, and
    /// returns it: a 16,384-row fleet can be placed in memory the caller
    /// owns (a `static`, an arena) without passing through the stack.
    /// [`Fleet::boxed`] does this on the heap.
    ///
    /// ```
    /// use core::mem::MaybeUninit;
    /// use selkie_kernel::fleet::Fleet;
    /// let mut slot = Box::new(MaybeUninit::<Fleet<2048>>::uninit());
    /// let fleet: &mut Fleet<2048> = Fleet::init_zeroed(&mut slot);
    /// assert_eq!(fleet.rows(), 0);
    /// ```
    #[cfg(not(selkie_loom))]
    pub fn init_zeroed(slot: &mut core::mem::MaybeUninit<Self>) -> &mut Self {
        // SAFETY: `slot` is valid for writes of one `Self`, so zero-filling
        // it is in bounds. All-zero bytes are a valid `Fleet`, and exactly
        // `Fleet::new()`: every field is built only of `AtomicU32`s, in
        // arrays (`Column` = `[AtomicGroup; GROUPS]`, `AtomicGroup` =
        // `[AtomicU32; 8]`, `RowBits` = `[AtomicU32; GROUPS]`) and structs
        // (`CachePadded<AtomicU32>`); a struct or array whose every field is
        // valid when zeroed is valid when zeroed, whatever its layout and
        // padding. `AtomicU32` (core's, and portable-atomic's: both an
        // `UnsafeCell<u32>`) is valid for every bit pattern, and zero is the
        // value `new()` gives each one. No field is a pointer, reference,
        // enum or other type with a niche (the loom build, whose atomics are
        // not plain integers and which has the `fault` field, has no
        // `init_zeroed`).
        unsafe {
            slot.as_mut_ptr().write_bytes(0, 1);
            slot.assume_init_mut()
        }
    }

    /// Rows scans must cover: one past the highest row ever occupied. Never
    /// decreases. Views and masks cover it padded to whole lane groups.
    #[inline]
    pub fn rows(&self) -> usize {
        self.rows.load(Ordering::Acquire) as usize
    }

    /// Rows a scan reads: [`rows`](Self::rows) rounded up to whole lane
    /// groups.
    #[inline]
    pub fn scan_rows(&self) -> usize {
        padded_rows(self.rows())
    }

    /// Copies the selectable (Live) rows into an eligibility mask, bit
    /// `i % 64` of `out[i / 64]` for row `i`; words past the fleet are
    /// zeroed. Intersect it with the host's filters, then scan.
    ///
    /// Each 32-row word is one atomic load: a row that changes state during
    /// the copy may be seen either way, and the booking re-checks.
    #[inline]
    pub fn selectable(&self, out: &mut [u64]) {
        self.selectable.copy_to(out);
    }

    /// Requests in flight per row (tagged counter decoded by the view).
    #[inline]
    pub fn active_requests(&self) -> AtomicView<'_> {
        self.active_requests
            .view(self.scan_rows(), Decode::Shift(counter::TAG_BITS))
    }

    /// Prefill tokens booked and not yet prefilled, per row.
    #[inline]
    pub fn active_prefill_tokens(&self) -> AtomicView<'_> {
        self.active_prefill_tokens
            .view(self.scan_rows(), Decode::Shift(counter::TAG_BITS))
    }

    /// KV blocks held by decoding requests, per row.
    #[inline]
    pub fn active_decode_blocks(&self) -> AtomicView<'_> {
        self.active_decode_blocks
            .view(self.scan_rows(), Decode::Shift(counter::TAG_BITS))
    }

    /// `1 / capacity weight` per row, as an `F32Source` (0.0 in empty rows).
    #[inline]
    pub fn inv_capacity_weight(&self) -> AtomicView<'_> {
        self.inv_capacity_weight.view(self.scan_rows(), Decode::Raw)
    }

    /// Capacity weight per row, as an `F32Source` (0.0 in empty rows).
    #[inline]
    pub fn capacity_weight(&self) -> AtomicView<'_> {
        self.capacity_weight.view(self.scan_rows(), Decode::Raw)
    }

    /// Data-parallel rank per row, as a `U32Source` (0 in empty rows).
    #[inline]
    pub fn dp_ranks(&self) -> AtomicView<'_> {
        self.dp_rank.view(self.scan_rows(), Decode::Raw)
    }

    /// Each row's rendezvous salt, as a `U32Source`: the
    /// [`worker_salt`](crate::kernels::rendezvous::worker_salt) of its worker
    /// id and rank, written when the row is added (0 in rows never used).
    #[inline]
    pub fn rendezvous_salts(&self) -> AtomicView<'_> {
        self.rendezvous_salt.view(self.scan_rows(), Decode::Raw)
    }

    /// Every load column over exactly `rows` rows (rounded up to whole lane
    /// groups, at most [`CAPACITY`](Self::CAPACITY)), whatever the fleet's
    /// high-water mark is now.
    ///
    /// A caller that sizes its masks and per-row buffers once per selection
    /// reads every column through one `FleetView`, so an `add` that raises
    /// [`rows`](Self::rows) in the middle of a selection cannot make one
    /// column longer than another (or than the caller's buffers). Rows past
    /// the fleet's mark are empty: zero loads, not selectable.
    ///
    /// ```
    /// use selkie_kernel::fleet::{Fleet, WorkerSpec};
    /// use selkie_kernel::lanes::U32Source;
    /// let fleet = Fleet::<4>::new();
    /// let view = fleet.view(3); // sized before the add
    /// fleet.add(WorkerSpec::new(1)).unwrap();
    /// assert_eq!(view.active_requests().rows(), 8, "one lane group");
    /// assert_eq!(fleet.view(100).rows(), 32, "capped at the capacity");
    /// ```
    #[inline]
    pub fn view(&self, rows: usize) -> FleetView<'_, GROUPS> {
        FleetView {
            fleet: self,
            rows: padded_rows(rows.min(Self::CAPACITY)),
        }
    }

    /// Whether `row` is in the fleet.
    #[inline]
    fn in_range(row: usize) -> bool {
        row < Self::CAPACITY
    }
}

/// The fleet's columns over a fixed number of rows: see [`Fleet::view`].
#[derive(Clone, Copy)]
pub struct FleetView<'a, const GROUPS: usize> {
    fleet: &'a Fleet<GROUPS>,
    rows: usize,
}

impl<'a, const GROUPS: usize> FleetView<'a, GROUPS> {
    /// Rows every column of this view covers (whole lane groups).
    #[inline]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Requests in flight per row.
    #[inline]
    pub fn active_requests(&self) -> AtomicView<'a> {
        (self.fleet.active_requests).view(self.rows, Decode::Shift(counter::TAG_BITS))
    }

    /// Prefill tokens booked and not yet prefilled, per row.
    #[inline]
    pub fn active_prefill_tokens(&self) -> AtomicView<'a> {
        (self.fleet.active_prefill_tokens).view(self.rows, Decode::Shift(counter::TAG_BITS))
    }

    /// KV blocks held by decoding requests, per row.
    #[inline]
    pub fn active_decode_blocks(&self) -> AtomicView<'a> {
        (self.fleet.active_decode_blocks).view(self.rows, Decode::Shift(counter::TAG_BITS))
    }

    /// `1 / capacity weight` per row (0.0 in empty rows).
    #[inline]
    pub fn inv_capacity_weight(&self) -> AtomicView<'a> {
        (self.fleet.inv_capacity_weight).view(self.rows, Decode::Raw)
    }

    /// Capacity weight per row (0.0 in empty rows).
    #[inline]
    pub fn capacity_weight(&self) -> AtomicView<'a> {
        (self.fleet.capacity_weight).view(self.rows, Decode::Raw)
    }

    /// Data-parallel rank per row (0 in empty rows).
    #[inline]
    pub fn dp_ranks(&self) -> AtomicView<'a> {
        (self.fleet.dp_rank).view(self.rows, Decode::Raw)
    }

    /// Each row's rendezvous salt (see [`Fleet::rendezvous_salts`]).
    #[inline]
    pub fn rendezvous_salts(&self) -> AtomicView<'a> {
        (self.fleet.rendezvous_salt).view(self.rows, Decode::Raw)
    }
}

impl<const GROUPS: usize> core::fmt::Debug for FleetView<'_, GROUPS> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FleetView")
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

impl<const GROUPS: usize> Default for Fleet<GROUPS> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const GROUPS: usize> core::fmt::Debug for Fleet<GROUPS> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Fleet")
            .field("capacity", &Self::CAPACITY)
            .field("rows", &self.rows())
            .field("ticket", &self.peek_ticket())
            .finish_non_exhaustive()
    }
}
