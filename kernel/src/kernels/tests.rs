//! Tests of the kernels: every SIMD kernel against its scalar reference
//! (proptest, over every length up to three lane groups and a partial one,
//! some long columns, random and extreme masks, values and seeds, comparing
//! results *and* the generator's state afterwards), statistical tests of the
//! random choices with fixed seeds, and hand-worked KV costs.
//!
//! This file holds the shared strategies and helpers; the tests are in the
//! submodules, one per kernel module.

use crate::mask::words_for;
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

mod argmin;
mod device_aware;
mod index;
mod keyed;
mod kv_cost;
mod pick;
mod rendezvous;
mod stats;

/// Row counts: every length up to `3 * LANES + 7`, some longer ones, 1000.
pub(super) fn rows() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 0usize..=31, 1 => 32usize..=200, 1 => Just(1000usize)]
}

/// One mask word: empty, full, dense or sparse.
fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        any::<u64>(),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(a, b, c)| a & b & c),
    ]
}

/// A bitmask over `rows` rows, with one spare word whose bits (rows past the
/// end) kernels must ignore. All-zero and all-one masks are common.
pub(super) fn mask(rows: usize) -> impl Strategy<Value = Vec<u64>> {
    let words = words_for(rows) + 1;
    prop_oneof![
        1 => Just(vec![0u64; words]),
        1 => Just(vec![u64::MAX; words]),
        4 => prop::collection::vec(word(), words),
    ]
}

/// A load or count: small (many ties), near `2^24` (where `f32` rounds), any,
/// or the extremes.
pub(super) fn load_value() -> impl Strategy<Value = u32> + Clone {
    prop_oneof![
        4 => 0u32..4,
        1 => Just(u32::MAX),
        1 => Just(u32::MAX - 1),
        1 => (1u32 << 24) - 2..(1u32 << 24) + 3,
        2 => any::<u32>(),
    ]
}

/// A uniform `f32` in `lo..hi` (`hi` included when `inclusive`), drawn
/// from 2^24 evenly spaced steps. proptest's own float range sampler can
/// trip its internal assertion (`self.low - result < initial.step`) on
/// some seeds, which failed unrelated runs.
pub(super) fn uniform_f32(lo: f32, hi: f32, inclusive: bool) -> impl Strategy<Value = f32> + Clone {
    const STEPS: u32 = 1 << 24;
    let last = if inclusive { STEPS } else { STEPS - 1 };
    (0..=last).prop_map(move |k| {
        let v = lo + (hi - lo) * (k as f32 / STEPS as f32);
        if inclusive {
            v.min(hi)
        } else if v >= hi {
            lo
        } else {
            v
        }
    })
}

/// A uniform `f64` in `lo..hi`, as [`uniform_f32`].
pub(super) fn uniform_f64(lo: f64, hi: f64) -> impl Strategy<Value = f64> + Clone {
    const STEPS: u64 = 1 << 40;
    (0..STEPS).prop_map(move |k| {
        let v = lo + (hi - lo) * (k as f64 / STEPS as f64);
        if v >= hi {
            lo
        } else {
            v
        }
    })
}

/// A finite cost: small integers (ties), moderate values, the extremes of
/// `f32`, subnormals and both zeros.
pub(super) fn finite_cost() -> impl Strategy<Value = f32> + Clone {
    prop_oneof![
        4 => (0u8..4).prop_map(f32::from),
        3 => uniform_f32(-1.0e6, 1.0e6, false),
        1 => Just(f32::MAX),
        1 => Just(-f32::MAX),
        1 => Just(f32::MIN_POSITIVE),
        1 => Just(1.0e-45f32),
        1 => Just(-0.0f32),
        1 => any::<f32>().prop_filter("finite", |c| c.is_finite()),
    ]
}

/// A cost that is sometimes NaN or infinite.
pub(super) fn any_cost() -> impl Strategy<Value = f32> + Clone {
    prop_oneof![
        12 => finite_cost(),
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
    ]
}

/// `rows`, a column of `rows` values, a mask and a seed.
pub(super) fn column_case<T: core::fmt::Debug + Clone, S: Strategy<Value = T> + Clone>(
    value: S,
) -> impl Strategy<Value = (Vec<T>, Vec<u64>, u64)> {
    rows().prop_flat_map(move |n| (prop::collection::vec(value.clone(), n), mask(n), any::<u64>()))
}

/// Whether two `f32` results are the same value, bit for bit (any NaN equals
/// any NaN: the kernels do not promise NaN payloads).
pub(super) fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Pearson's chi-square statistic of `observed` counts against probabilities.
pub(super) fn chi_square(observed: &[u64], p: &[f64]) -> f64 {
    let n: u64 = observed.iter().sum();
    observed
        .iter()
        .zip(p)
        .map(|(&o, &p)| {
            let e = p * n as f64;
            (o as f64 - e) * (o as f64 - e) / e
        })
        .sum()
}

/// 99.9% quantiles of the chi-square distribution, by degrees of freedom.
pub(super) const CHI2_999: [f64; 6] = [f64::NAN, 10.828, 13.816, 16.266, 18.467, 20.515];

/// The 99.9% quantile of the chi-square distribution with `df >= 1`
/// degrees of freedom: the table up to 5, the Wilson-Hilferty
/// approximation above (within 1% there).
pub(super) fn chi2_999(df: usize) -> f64 {
    match CHI2_999.get(df) {
        Some(&q) if df > 0 => q,
        _ => {
            let (k, z) = (df as f64, 3.090_232);
            k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
        }
    }
}

/// A load column that changes under the scan, as the fleet's live columns
/// may while other threads book and release: every read of a row returns a
/// different value, one of `values`, so many rows tie.
pub(super) struct Shifting {
    rows: usize,
    reads: core::cell::Cell<u32>,
    values: u32,
}

impl Shifting {
    /// `rows` rows; `first_read` seeds the sequence of values.
    pub(super) fn new(rows: usize, first_read: u32, values: u32) -> Self {
        Shifting {
            rows,
            reads: core::cell::Cell::new(first_read),
            values,
        }
    }

    fn next(&self, row: usize) -> u32 {
        let n = self.reads.get();
        self.reads.set(n.wrapping_add(1));
        (n.wrapping_mul(2_654_435_761) ^ row as u32).rotate_left(n % 31) % self.values
    }
}

impl crate::lanes::U32Source for Shifting {
    fn rows(&self) -> usize {
        self.rows
    }
    fn value(&self, row: usize) -> u32 {
        self.next(row)
    }
    fn group(&self, group: usize) -> [u32; crate::lanes::LANES] {
        core::array::from_fn(|i| self.next(group * 8 + i))
    }
}
