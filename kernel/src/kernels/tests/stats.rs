//! Statistical tests with fixed seeds: the random choices have the
//! distributions they promise (chi-square against the 99.9% quantile).

use super::{chi_square, CHI2_999};
use crate::kernels::index::{power_of_two, random};
use crate::kernels::least_loaded::least_loaded;
use crate::kernels::pick::{pick_min, pick_min_reference, pick_softmax, pick_softmax_reference};
use crate::Rng;
use std::vec::Vec;

const DRAWS: u64 = 40_000;

/// Counts how often each of `rows` is returned by `f` over `DRAWS` calls
/// sharing one generator.
fn histogram(rows: &[usize], seed: u64, mut f: impl FnMut(&mut Rng) -> Option<usize>) -> Vec<u64> {
    let mut rng = Rng::new(seed);
    let mut counts = std::vec![0u64; rows.len()];
    for _ in 0..DRAWS {
        let row = f(&mut rng).expect("a row");
        let i = rows
            .iter()
            .position(|&r| r == row)
            .unwrap_or_else(|| panic!("unexpected row {row}"));
        counts[i] += 1;
    }
    counts
}

#[test]
fn ties_are_uniform() {
    // 4 rows tie for the minimum among 20, spread across lane groups and the tail.
    let mut costs = [9.0f32; 20];
    let mut active = [9u32; 20];
    let tied = [1usize, 8, 15, 18];
    for &r in &tied {
        costs[r] = 2.0;
        active[r] = 2;
    }
    costs[3] = 1.0; // cheaper, but not eligible
    active[3] = 1;
    let mask = [0xF_FFFF & !(1u64 << 3)];
    let p = [0.25; 4];
    let simd = histogram(&tied, 1, |rng| pick_min(&costs[..], &mask, rng).unwrap());
    let reference = histogram(&tied, 2, |rng| pick_min_reference(&costs[..], &mask, rng).unwrap());
    let ll = histogram(&tied, 3, |rng| least_loaded(&active[..], &mask, rng));
    for (name, counts) in [
        ("pick_min", &simd),
        ("pick_min_reference", &reference),
        ("least_loaded", &ll),
    ] {
        let x2 = chi_square(counts, &p);
        assert!(x2 < CHI2_999[3], "{name}: {counts:?} chi2 {x2}");
    }
}

#[test]
fn random_is_uniform() {
    let mask = [0b1000_0000_0100_0000_0001_0000_0100_0001u64];
    let rows: Vec<usize> = (0..32).filter(|&r| mask[0] >> r & 1 == 1).collect();
    assert_eq!(rows.len(), 5);
    let counts = histogram(&rows, 4, |rng| random(32, &mask, rng));
    let x2 = chi_square(&counts, &[0.2; 5]);
    assert!(x2 < CHI2_999[4], "{counts:?} chi2 {x2}");
}

#[test]
fn power_of_two_prefers_lower_load_as_expected() {
    // Distinct loads: the row of load rank r (0 = lightest) wins iff it is in
    // the pair and the other is heavier: P = 2 (n - 1 - r) / (n (n - 1)).
    let load = [40u32, 10, 30, 20, 0];
    let rows = [4usize, 1, 3, 2]; // by rank; row 0 (heaviest) never wins
    let n = 5.0;
    let p: Vec<f64> = (0..4).map(|r| 2.0 * (n - 1.0 - r as f64) / (n * (n - 1.0))).collect();
    let counts = histogram(&rows, 5, |rng| power_of_two(&load[..], &[0b11111], rng));
    let x2 = chi_square(&counts, &p);
    assert!(x2 < CHI2_999[3], "{counts:?} chi2 {x2}");
}

#[test]
fn softmax_samples_its_exact_probabilities() {
    // Costs 1, 2, 3, 5 at T = 0.5: weights exp(-(c - 1) / (4 * 0.5)).
    let costs = [1.0f32, 7.0, 2.0, 3.0, 5.0, 0.0];
    let mask = [0b011101u64]; // rows 0, 2, 3, 4
    let t = 0.5;
    let w: Vec<f64> = [1.0f64, 2.0, 3.0, 5.0]
        .iter()
        .map(|c| (-(c - 1.0) / (4.0 * t)).exp())
        .collect();
    let sum: f64 = w.iter().sum();
    let p: Vec<f64> = w.iter().map(|w| w / sum).collect();
    let rows = [0usize, 2, 3, 4];
    let simd = histogram(&rows, 6, |rng| pick_softmax(&costs[..], &mask, t as f32, rng).unwrap());
    let reference = histogram(&rows, 7, |rng| {
        pick_softmax_reference(&costs[..], &mask, t as f32, rng).unwrap()
    });
    for (name, counts) in [("simd", &simd), ("reference", &reference)] {
        let x2 = chi_square(counts, &p);
        assert!(x2 < CHI2_999[3], "{name}: {counts:?} expected {p:?} chi2 {x2}");
    }
}
