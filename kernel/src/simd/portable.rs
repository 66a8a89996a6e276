//! The portable backend: `wide`'s 8-lane types, whose implementation `wide`
//! picks at compile time (SSE2 pairs on baseline x86-64, NEON on aarch64,
//! arrays elsewhere).
//!
//! This module must not contain selection logic.

use super::{reduce_add_array, F32Lanes, Sealed, Simd, U32Lanes};
use crate::lanes::LANES;
use wide::{f32x8, i32x8, u32x8, CmpEq, CmpGt, CmpLt};

/// The portable backend's token (always available).
#[derive(Clone, Copy, Debug, Default)]
pub struct Portable;

impl Portable {
    /// What `wide` compiles to on this target.
    pub(crate) const NAME: &'static str = if cfg!(all(target_arch = "x86_64", target_feature = "avx2")) {
        "avx2-portable"
    } else if cfg!(all(
        any(target_arch = "x86_64", target_arch = "x86"),
        target_feature = "sse2"
    )) {
        "sse2"
    } else if cfg!(all(target_arch = "aarch64", target_feature = "neon")) {
        "neon"
    } else if cfg!(all(target_arch = "wasm32", target_feature = "simd128")) {
        "simd128"
    } else {
        "scalar"
    };
}

impl Sealed for Portable {}

impl Simd for Portable {
    type U32 = u32x8;
    type F32 = f32x8;
    #[inline(always)]
    fn splat_u32(self, v: u32) -> u32x8 {
        u32x8::splat(v)
    }
    #[inline(always)]
    fn splat_f32(self, v: f32) -> f32x8 {
        f32x8::splat(v)
    }
    #[inline(always)]
    fn load_u32(self, a: &[u32; LANES]) -> u32x8 {
        u32x8::from(*a)
    }
    #[inline(always)]
    fn load_f32(self, a: &[f32; LANES]) -> f32x8 {
        f32x8::from(*a)
    }
    #[inline(always)]
    fn load_atomic(self, group: &crate::lanes::AtomicGroup) -> u32x8 {
        u32x8::from(crate::sync::load_lanes(group))
    }
    #[inline(always)]
    fn lane_mask(self, bits: u8) -> u32x8 {
        const BIT: u32x8 = u32x8::new([1, 2, 4, 8, 16, 32, 64, 128]);
        (u32x8::splat(bits as u32) & BIT).cmp_eq(BIT)
    }
    const INLINE_SHAPES: bool = false;
    const FAST_GATHER: bool = false;
    #[inline(always)]
    unsafe fn gather_u32(self, base: *const u8, offsets: u32x8) -> u32x8 {
        let offsets = offsets.to_array();
        // SAFETY: the caller promises that the four bytes at each
        // `base + offsets[i]` lie in one allocation, are initialized and may
        // be read; `read_unaligned` needs no alignment.
        u32x8::from(offsets.map(|o| unsafe { base.add(o as usize).cast::<u32>().read_unaligned() }))
    }
}

impl U32Lanes for u32x8 {
    type F32 = f32x8;
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        u32x8::min(self, o)
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        u32x8::max(self, o)
    }
    #[inline(always)]
    fn cmp_eq(self, o: Self) -> Self {
        CmpEq::cmp_eq(self, o)
    }
    #[inline(always)]
    fn xor(self, o: Self) -> Self {
        self ^ o
    }
    #[inline(always)]
    fn mul_lo(self, o: Self) -> Self {
        self * o
    }
    #[inline(always)]
    fn shr(self, s: u32) -> Self {
        self >> s
    }
    #[inline(always)]
    fn shl(self, s: u32) -> Self {
        self << s
    }
    #[inline(always)]
    fn to_f32(self) -> f32x8 {
        let hi = bytemuck::cast::<u32x8, i32x8>(self >> 16u32).round_float();
        let lo = bytemuck::cast::<u32x8, i32x8>(self & u32x8::splat(0xFFFF)).round_float();
        hi * f32x8::splat(65536.0) + lo
    }
    #[inline(always)]
    fn small_to_f32(self) -> f32x8 {
        bytemuck::cast::<u32x8, i32x8>(self).round_float()
    }
    #[inline(always)]
    fn cast_f32(self) -> f32x8 {
        bytemuck::cast(self)
    }
    #[inline(always)]
    fn bits(self) -> u8 {
        bytemuck::cast::<u32x8, i32x8>(self).move_mask() as u8
    }
    #[inline(always)]
    fn reduce_min(self) -> u32 {
        self.to_array().into_iter().min().unwrap_or(u32::MAX)
    }
    #[inline(always)]
    fn reduce_add(self) -> u32 {
        bytemuck::cast::<u32x8, i32x8>(self).reduce_add() as u32
    }
    #[inline(always)]
    fn to_array(self) -> [u32; LANES] {
        u32x8::to_array(self)
    }
}

impl F32Lanes for f32x8 {
    type U32 = u32x8;
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // `minps` semantics (`self < o ? self : o`: `o` where either is
        // NaN), which the argmin relies on to pass over NaN keys. On x86-64
        // `fast_min` is `minps` itself; elsewhere it is spelled out, as
        // `wide`'s `min` and `fast_min` differ in NaN handling between
        // targets. `-0.0` against `0.0` only ever feeds `==` tests.
        #[cfg(target_arch = "x86_64")]
        {
            self.fast_min(o)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            f32x8::blend(CmpLt::cmp_lt(self, o), self, o)
        }
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // Spelled out: `wide`'s `max`/`fast_max` differ in NaN handling
        // between targets.
        f32x8::blend(CmpGt::cmp_gt(self, o), self, o)
    }
    #[inline(always)]
    fn cmp_lt(self, o: Self) -> Self {
        CmpLt::cmp_lt(self, o)
    }
    #[inline(always)]
    fn cmp_gt(self, o: Self) -> Self {
        CmpGt::cmp_gt(self, o)
    }
    #[inline(always)]
    fn cmp_eq(self, o: Self) -> Self {
        CmpEq::cmp_eq(self, o)
    }
    #[inline(always)]
    fn cmp_le(self, o: Self) -> Self {
        wide::CmpLe::cmp_le(self, o)
    }
    #[inline(always)]
    fn is_finite(self) -> Self {
        f32x8::is_finite(self)
    }
    #[inline(always)]
    fn blend(self, t: Self, f: Self) -> Self {
        f32x8::blend(self, t, f)
    }
    #[inline(always)]
    fn cast_u32(self) -> u32x8 {
        bytemuck::cast(self)
    }
    #[inline(always)]
    fn bits(self) -> u8 {
        self.move_mask() as u8
    }
    #[inline(always)]
    fn reduce_add(self) -> f32 {
        reduce_add_array(f32x8::to_array(self))
    }
    #[inline(always)]
    fn to_array(self) -> [f32; LANES] {
        f32x8::to_array(self)
    }
}
