//! The only module of the kernel that names atomics.
//!
//! Everything else in the crate imports `AtomicU32`, `Ordering` and
//! `spin_loop` from here, so the lock-free protocols are written once and
//! model-checked as written:
//!
//! * `cfg(selkie_loom)`: loom's instrumented atomics (`loom-tests/`).
//! * targets with native 32-bit atomics (x86-64, `thumbv7em-none-eabihf`,
//!   aarch64, ...): `core::sync::atomic`.
//! * targets without them: `portable-atomic`.
//!
//! The kernel deliberately uses only 32-bit atomics: they are native on every
//! target it supports, including Cortex-M4, so no critical-section fallback
//! is ever needed.
//!
//! This module also owns [`load_lanes`] (and its AVX2 form
//! `load_lanes_vex`), the one place where a SIMD scan reads a column that
//! other threads update: each SIMD backend's `load_atomic` calls one of them.
//! What it may observe, and why it is sound, is written down there.
//!
//! It must not contain protocol logic: only the primitives.

#[cfg(selkie_loom)]
pub(crate) use loom::hint::spin_loop;
#[cfg(selkie_loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, Ordering};

#[cfg(all(not(selkie_loom), target_has_atomic = "32"))]
#[allow(unused_imports)]
pub(crate) use core::hint::spin_loop;
#[cfg(all(not(selkie_loom), target_has_atomic = "32"))]
pub(crate) use core::sync::atomic::{AtomicU32, Ordering};

#[cfg(all(not(selkie_loom), not(target_has_atomic = "32")))]
#[allow(unused_imports)]
pub(crate) use core::hint::spin_loop;
#[cfg(all(not(selkie_loom), not(target_has_atomic = "32")))]
pub(crate) use portable_atomic::{AtomicU32, Ordering};

use crate::lanes::LANES;

/// Creates an atomic with an initial value; `const` where the backend allows.
#[cfg(not(selkie_loom))]
pub(crate) const fn atomic_u32(v: u32) -> AtomicU32 {
    AtomicU32::new(v)
}

/// Creates an atomic with an initial value (loom's constructor is not const).
#[cfg(selkie_loom)]
pub(crate) fn atomic_u32(v: u32) -> AtomicU32 {
    AtomicU32::new(v)
}

/// Reads one lane group (`LANES` consecutive counters) that other threads
/// may be updating.
///
/// # What a scan observes
///
/// Each lane is a value its counter really held at some instant during the
/// call: lanes are never torn, but the group is *not* a consistent snapshot
/// across rows, and a whole scan is a sequence of such groups. A scan is
/// therefore stale by at most its own duration, and every decision it makes
/// is re-validated by the booking's read-modify-write (`fleet::booking`),
/// which checks the admission limit and generation on the live value. A stale
/// read can make a pick sub-optimal; it can never over-admit a worker.
///
/// # Why it is sound
///
/// The portable path (always taken under miri and loom, and on targets
/// without a vector backend) performs `LANES` relaxed atomic loads, which is
/// data-race free in Rust's memory model by definition.
///
/// On x86-64 the fast path reads the same bytes with aligned 16-byte vector
/// loads in inline assembly: `movdqa` here (`vmovdqa` when the build enables
/// AVX), and always the VEX form `vmovdqa` in `load_lanes_vex`, which the AVX2
/// backend uses. Inline assembly may do anything that
/// Rust code could do, so the question is which Rust operations it is
/// equivalent to. Intel SDM vol. 3A §9.1.1 guarantees that an aligned
/// doubleword access is atomic, and that on processors with AVX an aligned
/// 16-byte `MOVDQA` load is performed as a single atomic access (AMD APM vol.
/// 2 §7.3.2 makes the same promise). Each 4-byte lane sits at a 4-byte aligned
/// address inside a 16-byte aligned block (columns are 32-byte aligned, see
/// [`crate::lanes::Column`]), so the instruction observes every lane as a
/// single, untorn, relaxed atomic load of an `AtomicU32`, exactly what the
/// portable path does in Rust. The assembly does not write memory and keeps
/// no pointer past the call.
#[inline(always)]
pub(crate) fn load_lanes(group: &[AtomicU32; LANES]) -> [u32; LANES] {
    #[cfg(all(target_arch = "x86_64", not(miri), not(selkie_loom)))]
    {
        let p = group.as_ptr();
        debug_assert_eq!(p as usize % 16, 0, "lane groups are 16-byte aligned");
        let lo: core::arch::x86_64::__m128i;
        let hi: core::arch::x86_64::__m128i;
        // SAFETY: `group` is a live shared reference to 32 readable bytes,
        // 16-byte aligned (columns are `#[repr(align(32))]` and groups start
        // at multiples of 32 bytes), so both aligned loads are in bounds and
        // cannot fault. Each lane is read as one atomic 4-byte access (see the
        // function docs), which is what `AtomicU32::load(Relaxed)` does; the
        // asm writes no memory and does not touch the stack or flags.
        unsafe {
            // With AVX enabled the rest of the scan uses VEX-encoded
            // instructions; a legacy-SSE `movdqa` among them forces an
            // AVX-SSE state transition that costs ~70x the load itself, so
            // the VEX.128 form is used there (same atomicity guarantee: SDM
            // §9.1.1 names VMOVDQA).
            #[cfg(target_feature = "avx")]
            {
                (lo, hi) = vmovdqa_pair(p);
            }
            #[cfg(not(target_feature = "avx"))]
            core::arch::asm!(
                "movdqa {lo}, xmmword ptr [{p}]",
                "movdqa {hi}, xmmword ptr [{p} + 16]",
                p = in(reg) p,
                lo = out(xmm_reg) lo,
                hi = out(xmm_reg) hi,
                options(readonly, nostack, preserves_flags),
            );
        }
        // SAFETY: two `__m128i` are 32 bytes of plain integers; every bit
        // pattern is a valid `[u32; 8]`.
        unsafe { core::mem::transmute::<[core::arch::x86_64::__m128i; 2], [u32; LANES]>([lo, hi]) }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri), not(selkie_loom))))]
    {
        core::array::from_fn(|i| group[i].load(Ordering::Relaxed))
    }
}

/// [`load_lanes`] for the AVX2 backend: the two aligned 16-byte loads in
/// their VEX encoding (`vmovdqa`), so that no legacy-SSE instruction sits in
/// the middle of VEX code (an AVX-SSE state transition costs about 70 times
/// the load). Atomicity and soundness are [`load_lanes`]'s: SDM §9.1.1 names
/// `VMOVDQA` among the 16-byte loads that are single atomic accesses on
/// processors with AVX. The token proves the CPU has AVX.
#[cfg(all(target_arch = "x86_64", not(miri), not(selkie_loom)))]
#[inline(always)]
pub(crate) fn load_lanes_vex(
    _avx2: crate::simd::Avx2,
    group: &[AtomicU32; LANES],
) -> (core::arch::x86_64::__m128i, core::arch::x86_64::__m128i) {
    let p = group.as_ptr();
    debug_assert_eq!(p as usize % 16, 0, "lane groups are 16-byte aligned");
    // SAFETY: `group` is a live shared reference to 32 readable, 16-byte
    // aligned bytes (see `load_lanes`), and the `Avx2` token proves the CPU
    // has AVX.
    unsafe { vmovdqa_pair(p) }
}

/// The two aligned 16-byte `vmovdqa` loads of one lane group, each lane one
/// atomic 4-byte access (see [`load_lanes`]); the asm writes no memory,
/// stack or flags.
///
/// # Safety
/// `p` points to 32 readable bytes, 16-byte aligned, that stay live for the
/// call, and the CPU has AVX.
#[cfg(all(target_arch = "x86_64", not(miri), not(selkie_loom)))]
#[inline(always)]
unsafe fn vmovdqa_pair(p: *const AtomicU32) -> (core::arch::x86_64::__m128i, core::arch::x86_64::__m128i) {
    let lo: core::arch::x86_64::__m128i;
    let hi: core::arch::x86_64::__m128i;
    // SAFETY: the caller's contract: 32 readable, 16-byte aligned bytes, so
    // both aligned loads are in bounds and cannot fault, and AVX for the VEX
    // encoding.
    unsafe {
        core::arch::asm!(
            "vmovdqa {lo}, xmmword ptr [{p}]",
            "vmovdqa {hi}, xmmword ptr [{p} + 16]",
            p = in(reg) p,
            lo = out(xmm_reg) lo,
            hi = out(xmm_reg) hi,
            options(readonly, nostack, preserves_flags),
        );
    }
    (lo, hi)
}
