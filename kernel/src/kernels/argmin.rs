//! Argmin over eligible rows with ties broken uniformly at random: the core
//! shared by least-loaded, device-aware and the temperature-0 pick.
//!
//! ```text
//! pass 1: m     = min over eligible rows of key(row)          (SIMD min)
//! pass 2: ties  = #{eligible rows with key == m}              (SIMD compare + popcount)
//!         k     = 0 if ties == 1 else rng.below(ties)         (exactly one draw iff ties > 1)
//! pass 3: return the k-th tie in row order, starting at the group of the first tie
//! ```
//!
//! Keys are compared with `<` / `==`; callers guarantee keys are not NaN.

use crate::lanes::{lane_bits, lane_bits_f32, lane_mask, LANES};
use crate::mask::{contains, group_bits};
use crate::Rng;
use wide::{f32x8, u32x8, CmpEq};

/// A column of keys that the argmin can read one lane group at a time.
pub trait ArgminKey {
    /// Scalar key (`u32` or `f32`).
    type Key: Copy + PartialOrd;
    /// Lanes of keys.
    type Lanes: Copy;
    /// Number of rows.
    fn rows(&self) -> usize;
    /// Key of one row.
    fn key(&self, row: usize) -> Self::Key;
    /// Keys of one lane group.
    fn keys(&self, group: usize) -> Self::Lanes;
}

/// Lane operations the argmin needs, for `u32` and `f32` keys.
pub trait KeyLanes: Copy {
    /// Scalar key.
    type Key: Copy + PartialOrd;
    /// Larger than every key.
    const WORST: Self::Key;
    /// All lanes `WORST`.
    fn worst() -> Self;
    /// Lane-wise min with ineligible lanes (bit clear in `bits`) ignored.
    fn min_eligible(self, keys: Self, bits: u8) -> Self;
    /// Bits of lanes equal to `k`.
    fn eq_bits(self, k: Self::Key) -> u8;
    /// Horizontal min.
    fn reduce_min(self) -> Self::Key;
}

impl KeyLanes for u32x8 {
    type Key = u32;
    const WORST: u32 = u32::MAX;
    #[inline(always)]
    fn worst() -> Self {
        u32x8::splat(u32::MAX)
    }
    #[inline(always)]
    fn min_eligible(self, keys: Self, bits: u8) -> Self {
        self.min(keys | !lane_mask(bits))
    }
    #[inline(always)]
    fn eq_bits(self, k: u32) -> u8 {
        lane_bits(self.cmp_eq(u32x8::splat(k)))
    }
    #[inline(always)]
    fn reduce_min(self) -> u32 {
        self.to_array().into_iter().min().unwrap_or(u32::MAX)
    }
}

impl KeyLanes for f32x8 {
    type Key = f32;
    const WORST: f32 = f32::INFINITY;
    #[inline(always)]
    fn worst() -> Self {
        f32x8::splat(f32::INFINITY)
    }
    #[inline(always)]
    fn min_eligible(self, keys: Self, bits: u8) -> Self {
        let m: f32x8 = bytemuck::cast(lane_mask(bits));
        self.fast_min(m.blend(keys, f32x8::splat(f32::INFINITY)))
    }
    #[inline(always)]
    fn eq_bits(self, k: f32) -> u8 {
        lane_bits_f32(self.cmp_eq(f32x8::splat(k)))
    }
    #[inline(always)]
    fn reduce_min(self) -> f32 {
        self.to_array().into_iter().fold(f32::INFINITY, f32::min)
    }
}

/// SIMD argmin with uniform random ties. See the module docs.
///
/// Returns `None` when no row is eligible. Makes exactly one `rng.below`
/// draw when more than one eligible row holds the minimum, none otherwise.
#[inline]
pub fn argmin<C>(col: &C, mask: &[u64], rng: &mut Rng) -> Option<usize>
where
    C: ArgminKey + ?Sized,
    C::Lanes: KeyLanes<Key = C::Key>,
{
    let rows = col.rows();
    let groups = rows / LANES;
    // Pass 1: minimum.
    let mut acc = <C::Lanes as KeyLanes>::worst();
    for g in 0..groups {
        let bits = group_bits(mask, g);
        if bits != 0 {
            acc = acc.min_eligible(col.keys(g), bits);
        }
    }
    let mut min = acc.reduce_min();
    let mut any = false;
    for row in groups * LANES..rows {
        if contains(mask, row) {
            let k = col.key(row);
            if k < min {
                min = k;
            }
            any = true;
        }
    }
    // Pass 2: ties (and whether anything is eligible at all).
    let mut ties = 0usize;
    let mut first_group = groups;
    for g in 0..groups {
        let bits = group_bits(mask, g);
        if bits != 0 {
            let t = col.keys(g).eq_bits(min) & bits;
            if t != 0 && ties == 0 {
                first_group = g;
            }
            ties += t.count_ones() as usize;
        }
    }
    for row in groups * LANES..rows {
        if contains(mask, row) && col.key(row) == min {
            ties += 1;
        }
    }
    if ties == 0 {
        debug_assert!(!any || min == <C::Lanes as KeyLanes>::WORST);
        return None;
    }
    let mut k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    // Pass 3: the k-th tie in row order.
    for g in first_group..groups {
        let bits = group_bits(mask, g);
        if bits != 0 {
            let t = col.keys(g).eq_bits(min) & bits;
            let c = t.count_ones() as usize;
            if k < c {
                let mut t = t;
                for _ in 0..k {
                    t &= t - 1;
                }
                return Some(g * LANES + t.trailing_zeros() as usize);
            }
            k -= c;
        }
    }
    for row in groups * LANES..rows {
        if contains(mask, row) && col.key(row) == min {
            if k == 0 {
                return Some(row);
            }
            k -= 1;
        }
    }
    None
}

/// Scalar reference of [`argmin`]: same result, same draws.
pub fn argmin_reference<C: ArgminKey + ?Sized>(col: &C, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let mut min: Option<C::Key> = None;
    for row in 0..col.rows() {
        if contains(mask, row) {
            let k = col.key(row);
            if min.is_none_or(|m| k < m) {
                min = Some(k);
            }
        }
    }
    let min = min?;
    let ties = (0..col.rows()).filter(|&r| contains(mask, r) && col.key(r) == min).count();
    let k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    (0..col.rows()).filter(|&r| contains(mask, r) && col.key(r) == min).nth(k)
}
