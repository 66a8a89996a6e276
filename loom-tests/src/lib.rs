//! Loom models of the fleet's atomic protocols : booking
//! against an admission limit, release, slot reuse with generations,
//! retarget (by row, and onto a slot that is replaced meanwhile), the
//! round-robin cursor, select-and-book racing a removal, retiring a row
//! (cordon, then check for bookings) racing a booking, and the KV index's
//! reader/writer protocol (readers never meet the writer).
//!
//! Each model runs twice in the same test binary: against the real protocol,
//! where every interleaving must pass (`harness::explore`), and against a
//! deliberately broken variant (compiled into the kernel under
//! `cfg(selkie_loom)`, `selkie_kernel::fleet::fault::Fault`, or a caller
//! that uses the kernel the wrong way), where some
//! interleaving must fail with the message of the assertion that catches
//! the fault, or loom's own report of a data race
//! (`harness::expect_violation`). Both print how many interleavings loom
//! explored.
//!
//! Without `--cfg selkie_loom` this crate is empty. This crate must not test
//! anything but atomic protocols: behaviour belongs in the kernel's tests.

#[cfg(selkie_loom)]
mod harness;

#[cfg(selkie_loom)]
pub use harness::*;
