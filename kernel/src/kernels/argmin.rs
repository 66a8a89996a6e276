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
    /// Keys of eight consecutive lane groups (one mask word of rows).
    #[inline(always)]
    fn key_block(&self, first_group: usize) -> [Self::Lanes; 8] {
        core::array::from_fn(|i| self.keys(first_group + i))
    }
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
        if bits == 0xFF {
            self.min(keys)
        } else {
            self.min(keys | !lane_mask(bits))
        }
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
        if bits == 0xFF {
            self.fast_min(keys)
        } else {
            let m: f32x8 = bytemuck::cast(lane_mask(bits));
            self.fast_min(m.blend(keys, f32x8::splat(f32::INFINITY)))
        }
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

/// Visits the lane groups `0..groups` that have at least one eligible row,
/// calling `f(group, bits)`. Whole mask words are handled at once: an all-ones
/// word (the common case: every live worker eligible) runs eight groups with
/// no per-group mask work, an all-zeros word is skipped.
#[inline(always)]
fn for_each_eligible_group<C: ArgminKey + ?Sized>(
    col: &C,
    mask: &[u64],
    groups: usize,
    first: usize,
    mut f: impl FnMut(usize, u8, C::Lanes) -> bool,
) {
    let mut g = first;
    while g < groups {
        let word = mask.get(g / 8).copied().unwrap_or(0) >> ((g % 8) * 8);
        let block_end = ((g / 8) + 1) * 8;
        if block_end <= groups && g % 8 == 0 && word == u64::MAX {
            for gg in g..block_end {
                if !f(gg, 0xFF, col.keys(gg)) {
                    return;
                }
            }
        } else if word != 0 {
            for gg in g..block_end.min(groups) {
                let bits = (word >> ((gg - g) * 8)) as u8;
                if bits != 0 && !f(gg, bits, col.keys(gg)) {
                    return;
                }
            }
        }
        g = block_end;
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
    for_each_eligible_group(col, mask, groups, 0, |_, bits, keys| {
        acc = acc.min_eligible(keys, bits);
        true
    });
    let mut min = acc.reduce_min();
    for row in groups * LANES..rows {
        if contains(mask, row) {
            let k = col.key(row);
            if k < min {
                min = k;
            }
        }
    }
    // Pass 2: ties (and whether anything is eligible at all).
    let mut ties = 0usize;
    let mut first_group = groups;
    for_each_eligible_group(col, mask, groups, 0, |g, bits, keys| {
        let t = keys.eq_bits(min) & bits;
        if t != 0 && ties == 0 {
            first_group = g;
        }
        ties += t.count_ones() as usize;
        true
    });
    for row in groups * LANES..rows {
        if contains(mask, row) && col.key(row) == min {
            ties += 1;
        }
    }
    if ties == 0 {
        return None;
    }
    let mut k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    // Pass 3: the k-th tie in row order, from the group of the first tie.
    let mut found = None;
    for_each_eligible_group(col, mask, groups, first_group, |g, bits, keys| {
        let mut t = keys.eq_bits(min) & bits;
        let c = t.count_ones() as usize;
        if k < c {
            for _ in 0..k {
                t &= t - 1;
            }
            found = Some(g * LANES + t.trailing_zeros() as usize);
            return false;
        }
        k -= c;
        true
    });
    if found.is_some() {
        return found;
    }
    (groups * LANES..rows).filter(|&row| contains(mask, row) && col.key(row) == min).nth(k)
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
    let ties = (0..col.rows())
        .filter(|&r| contains(mask, r) && col.key(r) == min)
        .count();
    let k = if ties > 1 { rng.below(ties as u64) as usize } else { 0 };
    (0..col.rows())
        .filter(|&r| contains(mask, r) && col.key(r) == min)
        .nth(k)
}
