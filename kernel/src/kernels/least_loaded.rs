//! Least-loaded: the eligible row with the fewest in-flight requests per unit
//! of capacity weight; ties uniformly at random.
//!
//! Two forms:
//! * [`least_loaded`]: unweighted (every weight 1), integer compare. This is
//!   Dynamo's `least-loaded` router mode and the fast path.
//! * [`least_loaded_weighted`]: load `= active as f32 * inv_weight` where
//!   `inv_weight = 1 / capacity_weight` is precomputed per row. Both the SIMD
//!   kernel and the reference compute the same single IEEE multiply, so they
//!   agree bit for bit.

use super::argmin::{argmin, argmin_reference, least_run_by_word, ArgminKey, Least};
use crate::lanes::{F32Source, U32Source};
use crate::lanes::{GroupWords, Words};
use crate::simd::{dispatch, Simd, U32Lanes};
use crate::Rng;

struct Active<'a, A: ?Sized>(&'a A);

/// The lane-wise least of eight lane groups.
#[cfg_attr(not(debug_assertions), inline(always))]
fn least_of<L: U32Lanes>(groups: [L; 8]) -> L {
    let [a, b, c, d, e, f, g, h] = groups;
    a.min(b).min(c.min(d)).min(e.min(f).min(g.min(h)))
}

impl<A: U32Source + ?Sized> ArgminKey for Active<'_, A> {
    type Key = u32;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn rows(&self) -> usize {
        self.0.rows()
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key(&self, row: usize) -> u32 {
        self.0.value(row)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        self.0.lanes(s, group)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        self.0.lanes8(s, first_group)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ordered<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        self.0.words(s, group)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ordered8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        self.0.words8(s, first_group)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key_of_ordered(&self, k: u32) -> u32 {
        k >> self.0.word_shift()
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn least_run<S: Simd>(&self, s: S, mask: &[u64], mut w: usize, end: usize, least: &mut Least<'_, S, u32>) -> usize {
        // The column's mask words as blocks of eight lane groups, cut once:
        // no bounds check or address arithmetic per word.
        match self.0.group_words(end) {
            Some(GroupWords(Words::Counter(blocks, shift))) => {
                while w < end && mask[w] == u64::MAX {
                    let lanes = least_of(s.load_atomic8(&blocks[w]));
                    least.push_remembered(s, w, lanes, lanes.shr(shift));
                    w += 1;
                }
                w
            }
            Some(GroupWords(Words::Plain(blocks))) => {
                while w < end && mask[w] == u64::MAX {
                    let b = &blocks[w];
                    let lanes = least_of([0, 1, 2, 3, 4, 5, 6, 7].map(|i| s.load_u32(&b[i])));
                    least.push_remembered(s, w, lanes, lanes);
                    w += 1;
                }
                w
            }
            None => least_run_by_word(s, self, mask, w, end, least),
        }
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys_of_ordered<S: Simd>(&self, _s: S, ordered: S::U32) -> S::U32 {
        // A shift by 0 leaves the lanes as they are: no branch.
        ordered.shr(self.0.word_shift())
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn ordered_at_most(&self, key: u32) -> u32 {
        let shift = self.0.word_shift();
        match key.checked_shl(shift) {
            Some(high) if high >> shift == key => high | ((1u32 << shift) - 1),
            // Every word's key is at most `key`.
            _ => u32::MAX,
        }
    }
}

struct Weighted<'a, A: ?Sized, W: ?Sized>(&'a A, &'a W);

impl<A: U32Source + ?Sized, W: F32Source + ?Sized> ArgminKey for Weighted<'_, A, W> {
    type Key = f32;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn rows(&self) -> usize {
        self.0.rows().min(self.1.rows())
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key(&self, row: usize) -> f32 {
        self.0.value(row) as f32 * self.1.value(row)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys<S: Simd>(&self, s: S, group: usize) -> S::F32 {
        self.0.lanes(s, group).to_f32() * self.1.lanes(s, group)
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys8<S: Simd>(&self, s: S, first_group: usize) -> [S::F32; 8] {
        let (active, inv_weight) = (self.0.lanes8(s, first_group), self.1.lanes8(s, first_group));
        let mut keys = [active[0].to_f32(); 8];
        for (i, k) in keys.iter_mut().enumerate() {
            *k = active[i].to_f32() * inv_weight[i];
        }
        keys
    }
}

dispatch! {
    /// Unweighted least-loaded over eligible rows (SIMD).
    ///
    /// One `rng.below` draw iff several rows tie for the minimum.
    ///
    /// ```
    /// use selkie_kernel::{kernels::least_loaded::least_loaded, Rng};
    /// let active = [4u32, 1, 7, 1, 0];
    /// let mask = [0b01111u64]; // row 4 is not eligible
    /// let row = least_loaded(&active[..], &mask, &mut Rng::new(1)).unwrap();
    /// assert!(row == 1 || row == 3);
    /// ```
    pub fn least_loaded / least_loaded_on [A: U32Source + ?Sized] (active: &A, mask: &[u64], rng: &mut Rng)
        -> Option<usize>
        = |s| argmin(s, &Active(active), mask, rng)
}

/// Scalar reference of [`least_loaded`].
pub fn least_loaded_reference<A: U32Source + ?Sized>(active: &A, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    argmin_reference(&Active(active), mask, rng)
}

dispatch! {
    /// Capacity-weighted least-loaded (SIMD): argmin of `active * inv_weight`.
    ///
    /// Rows past the shorter of the two columns are not scanned.
    pub fn least_loaded_weighted / least_loaded_weighted_on [A: U32Source + ?Sized, W: F32Source + ?Sized]
        (active: &A, inv_weight: &W, mask: &[u64], rng: &mut Rng) -> Option<usize>
        = |s| argmin(s, &Weighted(active, inv_weight), mask, rng)
}

/// Scalar reference of [`least_loaded_weighted`].
pub fn least_loaded_weighted_reference<A, W>(active: &A, inv_weight: &W, mask: &[u64], rng: &mut Rng) -> Option<usize>
where
    A: U32Source + ?Sized,
    W: F32Source + ?Sized,
{
    argmin_reference(&Weighted(active, inv_weight), mask, rng)
}
