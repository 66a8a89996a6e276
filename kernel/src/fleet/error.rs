//! Why a fleet operation refused: plain enums that name the row, the worker
//! and the limit involved.
//!
//! This module must not contain logic beyond formatting.

use super::state::SlotState;
use core::fmt;

/// Why a change to the fleet (`add`, `remove`, `set_state`, updates) was
/// refused. Nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FleetError {
    /// Every row is occupied.
    Full {
        /// Rows of the fleet.
        capacity: usize,
    },
    /// A capacity weight that is not finite and positive, or whose
    /// reciprocal is not finite.
    BadCapacityWeight {
        /// The worker it was for.
        worker_id: u64,
        /// The weight given.
        weight: f32,
    },
    /// The row is past the fleet's capacity.
    NoSuchRow {
        /// The row given.
        row: u32,
        /// Rows of the fleet.
        capacity: usize,
    },
    /// The row is empty: its worker was removed.
    Vacant {
        /// The row.
        row: u32,
        /// The generation the caller's `SlotId` had.
        generation: u32,
    },
    /// The row holds a later occupant than the caller's `SlotId`.
    StaleSlot {
        /// The row.
        row: u32,
        /// The generation the caller's `SlotId` had.
        expected: u32,
        /// The generation the row holds.
        found: u32,
    },
}

/// Why a booking was refused. Nothing stays booked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BookError {
    /// The row is past the fleet's capacity.
    NoSuchRow {
        /// The row given.
        row: usize,
        /// Rows of the fleet.
        capacity: usize,
    },
    /// The row's worker does not take new requests.
    NotLive {
        /// The row.
        row: u32,
        /// What the row holds.
        state: SlotState,
    },
    /// The row changed occupant during the booking (or holds another
    /// generation than the `SlotId` asked for).
    Stale {
        /// The row.
        row: u32,
        /// The generation the booking was for.
        expected: u32,
        /// The generation the row holds now.
        found: u32,
    },
    /// The worker already has `limit` requests in flight.
    Overloaded {
        /// The row.
        row: u32,
        /// Its admission limit (capped to `COUNTER_MAX`).
        limit: u32,
    },
}

/// Why `select_and_book` found no worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelectError {
    /// The first scan found no eligible row.
    NoEligible,
    /// Every row the scans chose refused the booking (overloaded, or no
    /// longer live), and the attempts ran out or no eligible row was left.
    AllOverloaded {
        /// Booking attempts made.
        attempts: u32,
        /// Why the last attempt was refused.
        last: BookError,
    },
    /// The scan returned a row that is not in the mask or not in the fleet.
    BadPick {
        /// The row it returned.
        row: usize,
    },
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            FleetError::Full { capacity } => write!(f, "all {capacity} worker slots are occupied"),
            FleetError::BadCapacityWeight { worker_id, weight } => {
                write!(
                    f,
                    "worker {worker_id}: capacity weight {weight} is not finite and > 0 with a finite reciprocal"
                )
            }
            FleetError::NoSuchRow { row, capacity } => write!(f, "row {row} is past the fleet's {capacity} rows"),
            FleetError::Vacant { row, generation } => {
                write!(
                    f,
                    "row {row} is empty: its worker (generation {generation}) was removed"
                )
            }
            FleetError::StaleSlot { row, expected, found } => {
                write!(
                    f,
                    "row {row} holds generation {found}, not {expected}: the worker was replaced"
                )
            }
        }
    }
}

impl fmt::Display for BookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BookError::NoSuchRow { row, capacity } => write!(f, "row {row} is past the fleet's {capacity} rows"),
            BookError::NotLive { row, state } => write!(f, "row {row} is {state:?}, not Live"),
            BookError::Stale { row, expected, found } => {
                write!(
                    f,
                    "row {row} changed from generation {expected} to {found} during the booking"
                )
            }
            BookError::Overloaded { row, limit } => write!(f, "row {row} already has {limit} requests in flight"),
        }
    }
}

impl fmt::Display for SelectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SelectError::NoEligible => f.write_str("no eligible worker"),
            SelectError::AllOverloaded { attempts, last } => {
                write!(
                    f,
                    "every eligible worker refused after {attempts} attempts (last: {last})"
                )
            }
            SelectError::BadPick { row } => write!(f, "the scan picked row {row}, which is not eligible"),
        }
    }
}

impl core::error::Error for FleetError {}
impl core::error::Error for BookError {}
impl core::error::Error for SelectError {}
