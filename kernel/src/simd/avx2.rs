//! The AVX2 backend: hand-written 256-bit lane types over `core::arch`.
//!
//! # Why the safe lane operations are sound
//!
//! The intrinsics are `unsafe` because executing them on a CPU without AVX2
//! is undefined behaviour. Every lane value of this module ([`U32x8`],
//! [`F32x8`]) is created by a method of the [`Avx2`] token or of another lane
//! value, and an `Avx2` token can only be created by
//! [`Avx2::new_unchecked`], whose caller promises that the CPU has every
//! feature an AVX2 entry point enables (avx2, fma, bmi1, bmi2, lzcnt,
//! popcnt; the dispatchers call it only after detection found them, inside
//! a `#[target_feature]` entry point). So holding a token or a lane value proves that the instructions
//! may run, and each method below only needs that proof and in-bounds
//! pointers. The methods are `#[inline(always)]` so that they compile as part
//! of the entry point, with its features enabled.
//!
//! This module must not contain selection logic.

use super::{F32Lanes, FieldAt, Sealed, Simd, U32Lanes};
use crate::lanes::LANES;
use core::arch::x86_64::*;
use core::ops::{Add, BitAnd, BitOr, Div, Mul, Not, Sub};

/// Proof that the CPU runs AVX2, FMA, BMI1, BMI2, LZCNT and POPCNT: the
/// AVX2 backend's token.
#[derive(Clone, Copy, Debug)]
pub struct Avx2(());

impl Avx2 {
    /// The token.
    ///
    /// # Safety
    ///
    /// The CPU must support avx2, fma, bmi1, bmi2, lzcnt and popcnt.
    #[inline(always)]
    pub(crate) unsafe fn new_unchecked() -> Avx2 {
        Avx2(())
    }
}

/// Eight `u32` lanes in one `ymm` register (exists only on an AVX2 CPU).
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub struct U32x8(__m256i);

/// Eight `f32` lanes in one `ymm` register (exists only on an AVX2 CPU).
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub struct F32x8(__m256);

/// Runs an intrinsic expression. SAFETY (of every use): the token or a lane
/// value of this module is in scope, which proves the CPU has AVX2 and the
/// rest of the x86-64-v3 set (module docs); no use dereferences a pointer
/// except the loads and stores, whose pointers come from references to
/// exactly 32 bytes.
macro_rules! avx {
    ($e:expr) => {
        // SAFETY: see the macro's docs: a token or lane value proves AVX2.
        unsafe { $e }
    };
}

impl Sealed for Avx2 {}

impl Simd for Avx2 {
    type U32 = U32x8;
    type F32 = F32x8;
    #[inline(always)]
    fn splat_u32(self, v: u32) -> U32x8 {
        U32x8(avx!(_mm256_set1_epi32(v as i32)))
    }
    #[inline(always)]
    fn splat_f32(self, v: f32) -> F32x8 {
        F32x8(avx!(_mm256_set1_ps(v)))
    }
    #[inline(always)]
    fn load_u32(self, a: &[u32; LANES]) -> U32x8 {
        U32x8(avx!(_mm256_loadu_si256(a.as_ptr().cast())))
    }
    #[inline(always)]
    fn load_f32(self, a: &[f32; LANES]) -> F32x8 {
        F32x8(avx!(_mm256_loadu_ps(a.as_ptr())))
    }
    #[inline(always)]
    fn load_atomic(self, group: &crate::lanes::AtomicGroup) -> U32x8 {
        // SAFETY: the `Avx2` token proves the CPU has AVX.
        U32x8(unsafe { crate::sync::load_lanes_vex(group) })
    }
    #[inline(always)]
    fn load_atomic_in<const I: usize>(self, block: &[crate::lanes::AtomicGroup; 8]) -> U32x8 {
        // SAFETY: the `Avx2` token proves the CPU has AVX.
        U32x8(unsafe { crate::sync::load_lanes_vex_at::<I>(block) })
    }
    #[inline(always)]
    fn load_atomic8(self, block: &[crate::lanes::AtomicGroup; 8]) -> [U32x8; 8] {
        // SAFETY: the `Avx2` token proves the CPU has AVX.
        let [g0, g1, g2, g3, g4, g5, g6, g7] = unsafe { crate::sync::load_lane_block_vex(block) };
        [
            U32x8(g0),
            U32x8(g1),
            U32x8(g2),
            U32x8(g3),
            U32x8(g4),
            U32x8(g5),
            U32x8(g6),
            U32x8(g7),
        ]
    }
    #[inline(always)]
    fn lane_mask(self, bits: u8) -> U32x8 {
        avx!({
            let bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            U32x8(_mm256_cmpeq_epi32(
                _mm256_and_si256(_mm256_set1_epi32(bits as i32), bit),
                bit,
            ))
        })
    }
    const FAST_GATHER: bool = true;
    #[inline(always)]
    unsafe fn gather_u32(self, base: *const u8, offsets: U32x8) -> U32x8 {
        // SAFETY: the token proves AVX2 (module docs); the caller promises
        // that every lane's four bytes at `base + offsets[i]` may be read,
        // and that the offsets are below `i32::MAX` (the instruction reads
        // them as signed).
        U32x8(unsafe { gather_all::<AtBase>(base, offsets.0) })
    }
    #[inline(always)]
    unsafe fn gather_field<F: FieldAt>(self, base: *const u8, offsets: U32x8) -> U32x8 {
        // SAFETY: as for `gather_u32`, at `base + F::AT` (the caller's
        // promise).
        U32x8(unsafe { gather_all::<F>(base, offsets.0) })
    }
}

/// The field at offset 0: a plain gather.
struct AtBase;

impl FieldAt for AtBase {
    const AT: usize = 0;
}

/// `vpgatherdd` of every lane: each lane's four bytes at `base +
/// offsets[i] + F::AT` (the offsets signed, `F::AT` the instruction's
/// displacement). Written out because the intrinsic zeroes the result
/// register before each gather (to break its dependency on the register's
/// old value), a third instruction for the two here: every lane's mask bit
/// is set, so every lane of the result is written and none keeps an old
/// value.
///
/// # Safety
///
/// The CPU must have AVX2 (a caller holds the [`Avx2`] token); every lane's
/// four bytes at `base + offsets[i] + F::AT` must be readable; `F::AT`
/// must be at most `i32::MAX`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn gather_all<F: FieldAt>(base: *const u8, offsets: __m256i) -> __m256i {
    let out: __m256i;
    // SAFETY: the caller promises AVX2 and that the eight addresses are
    // readable; the asm reads only those bytes, writes only its two
    // registers (`out`, and `mask`, which the gather clears), and touches
    // no stack or flags. `out` and `mask` are outputs not written late, so
    // they are distinct from each other and from the index register, as
    // the instruction requires.
    unsafe {
        core::arch::asm!(
            "vpcmpeqd {mask}, {mask}, {mask}",
            "vpgatherdd {out}, dword ptr [{base} + {offsets} + {at}], {mask}",
            base = in(reg) base,
            offsets = in(ymm_reg) offsets,
            at = const F::AT,
            mask = out(ymm_reg) _,
            out = out(ymm_reg) out,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    out
}

impl BitAnd for U32x8 {
    type Output = Self;
    #[inline(always)]
    fn bitand(self, o: Self) -> Self {
        U32x8(avx!(_mm256_and_si256(self.0, o.0)))
    }
}

impl BitOr for U32x8 {
    type Output = Self;
    #[inline(always)]
    fn bitor(self, o: Self) -> Self {
        U32x8(avx!(_mm256_or_si256(self.0, o.0)))
    }
}

impl Not for U32x8 {
    type Output = Self;
    #[inline(always)]
    fn not(self) -> Self {
        U32x8(avx!(_mm256_xor_si256(self.0, _mm256_set1_epi32(-1))))
    }
}

impl Add for U32x8 {
    type Output = Self;
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        U32x8(avx!(_mm256_add_epi32(self.0, o.0)))
    }
}

impl Sub for U32x8 {
    type Output = Self;
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        U32x8(avx!(_mm256_sub_epi32(self.0, o.0)))
    }
}

impl U32Lanes for U32x8 {
    type F32 = F32x8;
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        U32x8(avx!(_mm256_min_epu32(self.0, o.0)))
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        U32x8(avx!(_mm256_max_epu32(self.0, o.0)))
    }
    #[inline(always)]
    fn cmp_eq(self, o: Self) -> Self {
        U32x8(avx!(_mm256_cmpeq_epi32(self.0, o.0)))
    }
    #[inline(always)]
    fn xor(self, o: Self) -> Self {
        U32x8(avx!(_mm256_xor_si256(self.0, o.0)))
    }
    #[inline(always)]
    fn mul_lo(self, o: Self) -> Self {
        U32x8(avx!(_mm256_mullo_epi32(self.0, o.0)))
    }
    #[inline(always)]
    fn shr(self, s: u32) -> Self {
        U32x8(avx!(_mm256_srl_epi32(self.0, _mm_cvtsi32_si128(s as i32))))
    }
    #[inline(always)]
    fn shl(self, s: u32) -> Self {
        U32x8(avx!(_mm256_sll_epi32(self.0, _mm_cvtsi32_si128(s as i32))))
    }
    #[inline(always)]
    fn to_f32(self) -> F32x8 {
        avx!({
            let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<16>(self.0));
            let lo = _mm256_cvtepi32_ps(_mm256_and_si256(self.0, _mm256_set1_epi32(0xFFFF)));
            F32x8(_mm256_add_ps(_mm256_mul_ps(hi, _mm256_set1_ps(65536.0)), lo))
        })
    }
    #[inline(always)]
    fn small_to_f32(self) -> F32x8 {
        F32x8(avx!(_mm256_cvtepi32_ps(self.0)))
    }
    #[inline(always)]
    fn cast_f32(self) -> F32x8 {
        F32x8(avx!(_mm256_castsi256_ps(self.0)))
    }
    #[inline(always)]
    fn bits(self) -> u8 {
        avx!(_mm256_movemask_ps(_mm256_castsi256_ps(self.0))) as u8
    }
    #[inline(always)]
    fn reduce_min(self) -> u32 {
        avx!({
            let m = _mm_min_epu32(_mm256_castsi256_si128(self.0), _mm256_extracti128_si256::<1>(self.0));
            let m = _mm_min_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
            let m = _mm_min_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
            _mm_cvtsi128_si32(m) as u32
        })
    }
    #[inline(always)]
    fn reduce_add(self) -> u32 {
        avx!({
            let m = _mm_add_epi32(_mm256_castsi256_si128(self.0), _mm256_extracti128_si256::<1>(self.0));
            let m = _mm_add_epi32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
            let m = _mm_add_epi32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
            _mm_cvtsi128_si32(m) as u32
        })
    }
    #[inline(always)]
    fn to_array(self) -> [u32; LANES] {
        let mut a = [0u32; LANES];
        avx!(_mm256_storeu_si256(a.as_mut_ptr().cast(), self.0));
        a
    }
}

impl Add for F32x8 {
    type Output = Self;
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        F32x8(avx!(_mm256_add_ps(self.0, o.0)))
    }
}

impl Sub for F32x8 {
    type Output = Self;
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        F32x8(avx!(_mm256_sub_ps(self.0, o.0)))
    }
}

impl Mul for F32x8 {
    type Output = Self;
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        F32x8(avx!(_mm256_mul_ps(self.0, o.0)))
    }
}

impl Div for F32x8 {
    type Output = Self;
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        F32x8(avx!(_mm256_div_ps(self.0, o.0)))
    }
}

impl BitAnd for F32x8 {
    type Output = Self;
    #[inline(always)]
    fn bitand(self, o: Self) -> Self {
        F32x8(avx!(_mm256_and_ps(self.0, o.0)))
    }
}

impl F32Lanes for F32x8 {
    type U32 = U32x8;
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        F32x8(avx!(_mm256_min_ps(self.0, o.0)))
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // `vmaxps` returns its second operand when either is NaN.
        F32x8(avx!(_mm256_max_ps(self.0, o.0)))
    }
    #[inline(always)]
    fn cmp_lt(self, o: Self) -> Self {
        F32x8(avx!(_mm256_cmp_ps::<_CMP_LT_OQ>(self.0, o.0)))
    }
    #[inline(always)]
    fn cmp_gt(self, o: Self) -> Self {
        F32x8(avx!(_mm256_cmp_ps::<_CMP_GT_OQ>(self.0, o.0)))
    }
    #[inline(always)]
    fn cmp_eq(self, o: Self) -> Self {
        F32x8(avx!(_mm256_cmp_ps::<_CMP_EQ_OQ>(self.0, o.0)))
    }
    #[inline(always)]
    fn cmp_le(self, o: Self) -> Self {
        F32x8(avx!(_mm256_cmp_ps::<_CMP_LE_OQ>(self.0, o.0)))
    }
    #[inline(always)]
    fn is_finite(self) -> Self {
        avx!({
            let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), self.0);
            F32x8(_mm256_cmp_ps::<_CMP_LT_OQ>(abs, _mm256_set1_ps(f32::INFINITY)))
        })
    }
    #[inline(always)]
    fn blend(self, t: Self, f: Self) -> Self {
        F32x8(avx!(_mm256_blendv_ps(f.0, t.0, self.0)))
    }
    #[inline(always)]
    fn cast_u32(self) -> U32x8 {
        U32x8(avx!(_mm256_castps_si256(self.0)))
    }
    #[inline(always)]
    fn bits(self) -> u8 {
        avx!(_mm256_movemask_ps(self.0)) as u8
    }
    #[inline(always)]
    fn reduce_add(self) -> f32 {
        avx!({
            // [l0+l4, l1+l5, l2+l6, l3+l7], then lanes 0,1 + lanes 2,3, then
            // lane 0 + lane 1: the order of `reduce_add_array`.
            let q = _mm_add_ps(_mm256_castps256_ps128(self.0), _mm256_extractf128_ps::<1>(self.0));
            let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
            _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps::<0b01>(d, d)))
        })
    }
    #[inline(always)]
    fn to_array(self) -> [f32; LANES] {
        let mut a = [0f32; LANES];
        avx!(_mm256_storeu_ps(a.as_mut_ptr(), self.0));
        a
    }
}
