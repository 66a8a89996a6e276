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

use super::argmin::{argmin, argmin_reference, ArgminKey};
use crate::lanes::{u32_to_f32, F32Source, U32Source};
use crate::Rng;
use wide::{f32x8, u32x8};

struct Active<'a, A: ?Sized>(&'a A);

impl<A: U32Source + ?Sized> ArgminKey for Active<'_, A> {
    type Key = u32;
    type Lanes = u32x8;
    #[inline(always)]
    fn rows(&self) -> usize {
        self.0.rows()
    }
    #[inline(always)]
    fn key(&self, row: usize) -> u32 {
        self.0.value(row)
    }
    #[inline(always)]
    fn keys(&self, group: usize) -> u32x8 {
        self.0.group(group)
    }
    #[inline(always)]
    fn keys8(&self, first_group: usize) -> [u32x8; 8] {
        self.0.groups8(first_group)
    }
}

struct Weighted<'a, A: ?Sized, W: ?Sized>(&'a A, &'a W);

impl<A: U32Source + ?Sized, W: F32Source + ?Sized> ArgminKey for Weighted<'_, A, W> {
    type Key = f32;
    type Lanes = f32x8;
    #[inline(always)]
    fn rows(&self) -> usize {
        self.0.rows().min(self.1.rows())
    }
    #[inline(always)]
    fn key(&self, row: usize) -> f32 {
        self.0.value(row) as f32 * self.1.value(row)
    }
    #[inline(always)]
    fn keys(&self, group: usize) -> f32x8 {
        u32_to_f32(self.0.group(group)) * self.1.group(group)
    }
    #[inline(always)]
    fn keys8(&self, first_group: usize) -> [f32x8; 8] {
        let (active, inv_weight) = (self.0.groups8(first_group), self.1.groups8(first_group));
        core::array::from_fn(|i| u32_to_f32(active[i]) * inv_weight[i])
    }
}

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
#[inline]
pub fn least_loaded<A: U32Source + ?Sized>(active: &A, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    argmin(&Active(active), mask, rng)
}

/// Scalar reference of [`least_loaded`].
pub fn least_loaded_reference<A: U32Source + ?Sized>(active: &A, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    argmin_reference(&Active(active), mask, rng)
}

/// Capacity-weighted least-loaded (SIMD): argmin of `active * inv_weight`.
///
/// Rows past the shorter of the two columns are not scanned.
#[inline]
pub fn least_loaded_weighted<A, W>(active: &A, inv_weight: &W, mask: &[u64], rng: &mut Rng) -> Option<usize>
where
    A: U32Source + ?Sized,
    W: F32Source + ?Sized,
{
    argmin(&Weighted(active, inv_weight), mask, rng)
}

/// Scalar reference of [`least_loaded_weighted`].
pub fn least_loaded_weighted_reference<A, W>(active: &A, inv_weight: &W, mask: &[u64], rng: &mut Rng) -> Option<usize>
where
    A: U32Source + ?Sized,
    W: F32Source + ?Sized,
{
    argmin_reference(&Weighted(active, inv_weight), mask, rng)
}
