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
//!
//! One exception to the 32-bit rule: [`two_copies`](crate::two_copies)
//! counts readers in a 64-bit word (a 32-bit count could wrap between two
//! publishes of a long-lived index), so it exists only on targets with
//! 64-bit atomics; its `AtomicU64`, `UnsafeCell` and `yield_now` come from
//! here too.

#[cfg(all(not(selkie_loom), feature = "alloc", target_has_atomic = "64"))]
pub(crate) use core::sync::atomic::AtomicU64;
#[cfg(selkie_loom)]
pub(crate) use loom::hint::spin_loop;
#[cfg(all(selkie_loom, feature = "alloc"))]
pub(crate) use loom::{cell::UnsafeCell, sync::atomic::AtomicU64, thread::yield_now};

/// Lets a waiting thread give way: the OS's yield with `std`, else a spin
/// hint.
#[cfg(all(not(selkie_loom), feature = "alloc", target_has_atomic = "64"))]
#[inline]
pub(crate) fn yield_now() {
    #[cfg(feature = "std")]
    std::thread::yield_now();
    #[cfg(not(feature = "std"))]
    core::hint::spin_loop();
}

/// `core`'s `UnsafeCell` with loom's access API (`with`, `with_mut`), so
/// that code using it is model-checked as written.
#[cfg(all(not(selkie_loom), feature = "alloc", target_has_atomic = "64"))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

#[cfg(all(not(selkie_loom), feature = "alloc", target_has_atomic = "64"))]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> Self {
        UnsafeCell(core::cell::UnsafeCell::new(value))
    }

    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
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
/// On x86-64 the fast paths read the same bytes with aligned vector loads in
/// inline assembly: two 16-byte `movdqa` on the SSE2 baseline, one 32-byte
/// `vmovdqa` when AVX is available ([`load_lanes_vex`], and here when the
/// build enables AVX). Inline assembly may do anything that Rust code could
/// do, so the question is which Rust operations these loads are equivalent
/// to. Each 4-byte lane sits at a 4-byte aligned address inside a 32-byte
/// aligned group (see [`crate::lanes::AtomicGroup`]). If the processor reads
/// every lane in one access, the instruction is exactly `LANES` relaxed
/// `AtomicU32` loads, which is what the portable path does.
///
/// What the manuals promise, and what is relied on beyond it: Intel SDM vol.
/// 3A §9.1.1 and AMD APM vol. 2 §7.3.2 make aligned accesses of up to 8
/// bytes atomic, and (Intel, on processors with AVX) the 16-byte `movdqa` /
/// `vmovdqa` forms; they also say that wider SSE/AVX accesses may be
/// performed as several memory accesses, without saying where such an
/// access may be split. No x86-64 implementation splits inside an aligned
/// doubleword (they move whole 8-, 16- or 32-byte chunks), and
/// per-lane atomicity of aligned vector loads is what this code relies on;
/// it is not a documented guarantee for the 32-byte form, nor for `movdqa`
/// on processors without AVX. Were a lane ever torn, the kernel would see a
/// `u32` its counter never held: kernels treat lanes as plain numbers (never
/// as an index without a bounds check), so the effect could only be a worse
/// pick, which the booking then re-validates. The assembly writes no memory
/// and keeps no pointer past the call.
#[inline(always)]
pub(crate) fn load_lanes(group: &crate::lanes::AtomicGroup) -> [u32; LANES] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx", not(miri), not(selkie_loom)))]
    {
        // With AVX enabled the rest of the scan uses VEX-encoded
        // instructions; a legacy-SSE `movdqa` among them would force an
        // AVX-SSE state transition (about 70 times the cost of the load).
        // SAFETY: the build enables AVX, so every CPU this code runs on
        // has it.
        let lanes = unsafe { load_lanes_vex(group) };
        // SAFETY: an `__m256i` is 32 bytes of plain integers; every bit
        // pattern is a valid `[u32; 8]`.
        unsafe { core::mem::transmute::<core::arch::x86_64::__m256i, [u32; LANES]>(lanes) }
    }
    #[cfg(all(target_arch = "x86_64", not(target_feature = "avx"), not(miri), not(selkie_loom)))]
    {
        let p = group.0.as_ptr();
        debug_assert_eq!(p as usize % 32, 0, "lane groups are 32-byte aligned");
        let lo: core::arch::x86_64::__m128i;
        let hi: core::arch::x86_64::__m128i;
        // SAFETY: `group` is a live shared reference to 32 readable bytes,
        // 32-byte aligned (`AtomicGroup` is `#[repr(align(32))]`), so both
        // aligned loads are in bounds and cannot fault. Each lane is read as
        // one relaxed atomic load (see the function docs for what this
        // relies on); the asm writes no memory and does not touch the stack
        // or flags.
        unsafe {
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
        core::array::from_fn(|i| group.0[i].load(Ordering::Relaxed))
    }
}

/// [`load_lanes`] in one 32-byte `vmovdqa` (VEX encoded, so that no
/// legacy-SSE instruction sits in the middle of VEX code): the AVX2
/// backend's load. What it may observe, and what its soundness relies on,
/// is written at [`load_lanes`]. Callers prove the CPU has AVX (the
/// `Avx2` token) before calling it.
#[cfg(all(target_arch = "x86_64", not(miri), not(selkie_loom)))]
#[target_feature(enable = "avx")]
#[inline]
pub(crate) fn load_lanes_vex(group: &crate::lanes::AtomicGroup) -> core::arch::x86_64::__m256i {
    let p = group.0.as_ptr();
    debug_assert_eq!(p as usize % 32, 0, "lane groups are 32-byte aligned");
    let lanes: core::arch::x86_64::__m256i;
    // SAFETY: `group` is a live shared reference to 32 readable, 32-byte
    // aligned bytes (`AtomicGroup` is `#[repr(align(32))]`), so the
    // aligned load is in bounds and cannot fault; the function's target
    // feature makes the VEX encoding available. Each lane is read as one
    // relaxed atomic load (see `load_lanes`); the asm writes no memory and
    // does not touch the stack or flags.
    unsafe {
        core::arch::asm!(
            "vmovdqa {lanes}, ymmword ptr [{p}]",
            p = in(reg) p,
            lanes = out(ymm_reg) lanes,
            options(readonly, nostack, preserves_flags),
        );
    }
    lanes
}

/// [`load_lanes_vex`] for the eight lane groups of one mask word: eight
/// 32-byte `vmovdqa` at constant offsets from one pointer (no address
/// arithmetic between them). Callers prove the CPU has AVX.
#[cfg(all(target_arch = "x86_64", not(miri), not(selkie_loom)))]
#[target_feature(enable = "avx")]
#[inline]
pub(crate) fn load_lane_block_vex(block: &[crate::lanes::AtomicGroup; 8]) -> [core::arch::x86_64::__m256i; 8] {
    use core::arch::x86_64::__m256i;
    let p = block.as_ptr();
    let (g0, g1, g2, g3, g4, g5, g6, g7): (__m256i, __m256i, __m256i, __m256i, __m256i, __m256i, __m256i, __m256i);
    // SAFETY: `block` is a live shared reference to eight 32-byte aligned
    // groups, 256 contiguous bytes, so every load is aligned and in bounds;
    // the function's target feature makes the VEX encoding available. Each
    // lane is read as one relaxed atomic load (see `load_lanes`); the asm
    // writes no memory and does not touch the stack or flags.
    unsafe {
        core::arch::asm!(
            "vmovdqa {g0}, ymmword ptr [{p}]",
            "vmovdqa {g1}, ymmword ptr [{p} + 32]",
            "vmovdqa {g2}, ymmword ptr [{p} + 64]",
            "vmovdqa {g3}, ymmword ptr [{p} + 96]",
            "vmovdqa {g4}, ymmword ptr [{p} + 128]",
            "vmovdqa {g5}, ymmword ptr [{p} + 160]",
            "vmovdqa {g6}, ymmword ptr [{p} + 192]",
            "vmovdqa {g7}, ymmword ptr [{p} + 224]",
            p = in(reg) p,
            g0 = out(ymm_reg) g0,
            g1 = out(ymm_reg) g1,
            g2 = out(ymm_reg) g2,
            g3 = out(ymm_reg) g3,
            g4 = out(ymm_reg) g4,
            g5 = out(ymm_reg) g5,
            g6 = out(ymm_reg) g6,
            g7 = out(ymm_reg) g7,
            options(readonly, nostack, preserves_flags),
        );
    }
    [g0, g1, g2, g3, g4, g5, g6, g7]
}

/// [`load_lanes_vex`] for lane group `I` of a block of eight: one 32-byte
/// `vmovdqa` at the constant offset `32 * I` from the block's pointer, so a
/// loop over the block's groups needs no address arithmetic per load.
/// Callers prove the CPU has AVX.
#[cfg(all(target_arch = "x86_64", not(miri), not(selkie_loom)))]
#[target_feature(enable = "avx")]
#[inline]
pub(crate) fn load_lanes_vex_at<const I: usize>(block: &[crate::lanes::AtomicGroup; 8]) -> core::arch::x86_64::__m256i {
    const { assert!(I < 8, "a block holds eight lane groups") };
    let p = block.as_ptr();
    let lanes: core::arch::x86_64::__m256i;
    // SAFETY: `block` is a live shared reference to eight 32-byte aligned
    // groups, 256 contiguous bytes, and `I < 8`, so the load at `32 * I` is
    // aligned and in bounds; the function's target feature makes the VEX
    // encoding available. Each lane is read as one relaxed atomic load (see
    // `load_lanes`); the asm writes no memory and does not touch the stack
    // or flags.
    unsafe {
        core::arch::asm!(
            "vmovdqa {lanes}, ymmword ptr [{p} + {off}]",
            p = in(reg) p,
            off = const I * 32,
            lanes = out(ymm_reg) lanes,
            options(readonly, nostack, preserves_flags),
        );
    }
    lanes
}
