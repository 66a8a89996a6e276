//! # selkie-kernel
//!
//! The no_std, allocation-free, lock-free core of selkie (with the `alloc`
//! feature: the optional [`Fleet::boxed`] constructor, and the host's KV
//! index's building blocks, `table` and `two_copies`): the fleet stored as
//! a structure of arrays (one column per signal, one row per worker slot,
//! padded to whole SIMD lane groups), the SIMD selection kernels with their
//! scalar references, and the atomic booking protocol.
//!
//! It knows nothing of discovery, plugins, configuration files or I/O: that is
//! the `selkie` host crate's job.
//!
//! * [`fleet`]: the lock-free worker table (atomic columns), booking with
//!   RAII guards, select-and-book, the round-robin cursor.
//! * [`kernels`]: least-loaded, power-of-two, random, round-robin, the default
//!   KV cost, the pick (argmin or softmax) and device-aware weighted.
//! * [`mask`]: eligibility bitmasks.
//! * [`Rng`]: the seedable generator every random choice goes through
//!   ([`rng`]: it (wyrand), SplitMix64 for streams that must not change
//!   with it, and SplitMix64's mixer for seeds).
//! * [`lanes`]: the lane width and column access.
//! * [`worker`]: a worker rank's identity and a request's cache overlap
//!   keyed by it (the entries of the keyed-overlap scatter).
//! * [`simd`]: the SIMD backends (AVX2, and `wide`'s portable lanes) and the
//!   one place the kernel chooses between them, at run time where `std`
//!   allows; [`simd_backend`] names the choice. The `std` feature (default)
//!   enables the run-time detection; `SELKIE_SIMD=portable` in the
//!   environment forces the portable backend.
//!
//! ```
//! use selkie_kernel::{kernels::least_loaded::least_loaded, Rng};
//! let in_flight = [3u32, 0, 2, 0];
//! let eligible = [0b1101u64]; // row 1 filtered out
//! assert_eq!(least_loaded(&in_flight[..], &eligible, &mut Rng::new(9)), Some(3));
//! ```
#![no_std]
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[cfg(any(test, feature = "std"))]
extern crate std;

#[cfg(feature = "alloc")]
extern crate alloc;

pub mod fleet;
pub mod kernels;
pub mod lanes;
pub mod mask;
pub mod rng;
pub mod simd;
mod sync;
#[cfg(feature = "alloc")]
pub mod table;
#[cfg(all(feature = "alloc", any(selkie_loom, target_has_atomic = "64")))]
pub mod two_copies;
pub mod worker;

pub use fleet::{
    BookError, BookLoad, Booking, Fleet, FleetError, SelectError, SlotId, SlotState, WorkerSpec, WorkerState,
};
pub use kernels::KernelError;
pub use mask::RowMask;
pub use rng::Rng;
pub use simd::simd_backend;
pub use worker::{WorkerOverlap, WorkerWithDpRank};
