//! The selection kernels: pure functions over columns and an eligibility
//! mask. Each SIMD kernel has a scalar reference beside it (`*_reference`),
//! written to be obviously correct, with the same signature, the same result
//! and the same random draws; `tests` compares every pair.
//!
//! Kernels never allocate, never lock and never write to the fleet: booking
//! is `fleet`'s job, filtering is the host's.
//!
//! Inlining: a kernel's scan is written as small generic functions that an
//! optimised build must inline into the backend's `#[target_feature]` entry
//! point, so they are `inline(always)` there. Without optimisation
//! (`debug_assertions`, as in `cargo test`'s default profile) they are left
//! as calls: forced inlining at `opt-level = 0` keeps a stack slot for every
//! local of every inlined copy, and the KV kernel's unrolled lane-group
//! loops would need a frame of megabytes, more than a spawned thread's
//! default stack.

mod argmin;
pub mod device_aware;
pub mod index;
pub mod keyed;
pub mod kv_cost;
pub mod least_loaded;
pub mod pick;
pub mod rendezvous;

#[cfg(test)]
mod tests;

/// Why a kernel refused its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelError {
    /// An eligible row's cost is NaN or infinite.
    NonFiniteCost {
        /// The first such row, in row order.
        row: usize,
    },
    /// The temperature is negative or not finite.
    BadTemperature,
    /// The load factor of a bounded-load kernel is not finite or outside
    /// `1 ..= MAX_LOAD_FACTOR` (see `rendezvous::check_load_factor`).
    BadLoadFactor,
    /// A column is shorter than the number of rows scanned.
    ColumnTooShort {
        /// Rows the kernel was asked to scan.
        rows: usize,
        /// Length of the short column.
        len: usize,
    },
}

impl core::fmt::Display for KernelError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            KernelError::NonFiniteCost { row } => write!(f, "row {row} has a non-finite cost"),
            KernelError::BadTemperature => f.write_str("temperature must be finite and >= 0"),
            KernelError::BadLoadFactor => write!(
                f,
                "load factor must be finite and within 1 ..= {}",
                rendezvous::MAX_LOAD_FACTOR
            ),
            KernelError::ColumnTooShort { rows, len } => {
                write!(f, "column has {len} rows, scan needs {rows}")
            }
        }
    }
}
