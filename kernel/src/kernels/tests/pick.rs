//! The pick (argmin and softmax) against its references, and the softmax
//! weights against `f64`.

use super::{any_cost, column_case, finite_cost};
use crate::kernels::pick::*;
use crate::kernels::KernelError;
use crate::lanes::F32Source;
use crate::mask::contains;
use crate::simd::Backend;
use crate::Rng;
use proptest::prelude::*;
use std::vec::Vec;

/// How far apart (in normalised cumulative probability) the SIMD and the
/// reference softmax walks may be; see [`softmax_picks_consistent`].
const CUMULATIVE_EPS: f64 = 2.0e-5;

/// The reference's cumulative probabilities, `(row, C_row)` for each eligible
/// row in row order: Dynamo's procedure in `f64`.
fn reference_cumulative(costs: &[f32], mask: &[u64], t: f32) -> Vec<(usize, f64)> {
    let rows: Vec<usize> = (0..costs.len()).filter(|&r| contains(mask, r)).collect();
    let lo = rows.iter().map(|&r| costs[r]).fold(f32::INFINITY, f32::min);
    let hi = rows.iter().map(|&r| costs[r]).fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = rows
        .iter()
        .map(|&r| softmax_weight_reference(costs[r], lo, hi, t))
        .collect();
    let sum: f64 = w.iter().sum();
    let mut cum = 0.0;
    rows.iter()
        .zip(&w)
        .map(|(&r, &w)| {
            cum += w / sum;
            (r, cum)
        })
        .collect()
}

/// Whether two softmax picks made with the same draw `u` are consistent: the
/// same row, or rows that differ only because `u` lies within `eps` of *every*
/// cumulative boundary between them, so that a perturbation of the
/// cumulative sums by at most `eps` moves the pick from one to the other.
fn softmax_picks_consistent(simd: usize, reference: usize, cum: &[(usize, f64)], u: f64, eps: f64) -> bool {
    if simd == reference {
        return true;
    }
    let pos = |row| cum.iter().position(|&(r, _)| r == row);
    let (Some(a), Some(b)) = (pos(simd), pos(reference)) else {
        return false;
    };
    let (lo, hi) = (a.min(b), a.max(b));
    cum[lo..hi].iter().all(|&(_, c)| (u - c).abs() <= eps)
}

#[test]
fn boundary_helper_accepts_only_draws_on_a_boundary() {
    let cum = [(0, 0.25), (3, 0.5), (4, 0.5 + 1e-9), (7, 1.0)];
    assert!(softmax_picks_consistent(3, 3, &cum, 0.9, 0.0));
    assert!(softmax_picks_consistent(3, 4, &cum, 0.5, 1e-6));
    assert!(softmax_picks_consistent(0, 4, &cum, 0.25, 0.25 + 1e-6));
    assert!(
        !softmax_picks_consistent(0, 4, &cum, 0.25, 1e-6),
        "0.5 is not near 0.25"
    );
    assert!(!softmax_picks_consistent(3, 7, &cum, 0.75, 1e-6));
    assert!(!softmax_picks_consistent(3, 9, &cum, 0.5, 1.0), "row 9 is not eligible");
}

fn temperature() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => super::uniform_f32(0.05, 10.0, false),
        1 => Just(1.0e-3f32),
        1 => Just(1.0e-30f32),
        1 => Just(1.0e-45f32),
        1 => Just(1.0e30f32),
        1 => Just(f32::MAX),
    ]
}

proptest! {
    #[test]
    fn first_non_finite_matches_reference((costs, mask, _) in column_case(any_cost())) {
        for backend in Backend::available() {
            let fast = first_non_finite_on(backend, &costs[..], &mask);
            prop_assert_eq!(fast, first_non_finite_reference(&costs[..], &mask), "{:?}", backend);
        }
    }

    #[test]
    fn pick_min_matches_reference((costs, mask, seed) in column_case(any_cost())) {
        for backend in Backend::available() {
            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
            let fast = pick_min_on(backend, &costs[..], &mask, &mut a);
            prop_assert_eq!(fast, pick_min_reference(&costs[..], &mask, &mut b), "{:?}", backend);
            prop_assert_eq!(a.state(), b.state());
            if let Ok(Some(r)) = fast {
                let min = (0..costs.len()).filter(|&r| contains(&mask, r)).map(|r| costs[r]).fold(f32::INFINITY, f32::min);
                prop_assert_eq!(costs[r], min);
            }
        }
    }

    #[test]
    fn pick_softmax_agrees_with_reference((costs, mask, seed) in column_case(any_cost()), t in temperature()) {
        let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
        let u = Rng::new(seed).unit_f64();
        let fast = pick_softmax(&costs[..], &mask, t, &mut a);
        let slow = pick_softmax_reference(&costs[..], &mask, t, &mut b);
        // Every backend computes the same weights, bit for bit: the same pick.
        for backend in Backend::available() {
            let mut c = Rng::new(seed);
            prop_assert_eq!(pick_softmax_on(backend, &costs[..], &mask, t, &mut c), fast, "{:?}", backend);
            prop_assert_eq!(c.state(), a.state());
        }
        prop_assert_eq!(a.state(), b.state());
        match (fast, slow) {
            (Ok(Some(f)), Ok(Some(s))) => {
                prop_assert!(contains(&mask, f));
                let cum = reference_cumulative(&costs, &mask, t);
                prop_assert!(
                    softmax_picks_consistent(f, s, &cum, u, CUMULATIVE_EPS),
                    "simd {} reference {} u {} cumulative {:?}", f, s, u, cum
                );
            }
            (f, s) => prop_assert_eq!(f, s),
        }
    }

    #[test]
    fn softmax_weights_match_f64(costs in proptest::collection::vec(finite_cost(), 2..=8), t in temperature()) {
        let lo = costs.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = costs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut lanes = [lo; 8];
        lanes[..costs.len()].copy_from_slice(&costs);
        let weights = SoftmaxLanes::new(lo, hi, t);
        for backend in Backend::available() {
            let w = softmax_weights_on(backend, &weights, lanes, 0xFF);
            for (i, &c) in costs.iter().enumerate() {
                let exact = softmax_weight_reference(c, lo, hi, t);
                let err = (w[i] as f64 - exact).abs();
                prop_assert!(err <= 1.0e-5 * exact + 1.0e-12, "{:?} cost {} weight {} exact {} (T = {})", backend, c, w[i], exact, t);
                let scalar = weights.weight_scalar(c);
                prop_assert_eq!(w[i].to_bits(), scalar.to_bits(), "{:?} cost {} lanes {} scalar {}", backend, c, w[i], scalar);
            }
            if weights.unmasked() {
                let all = softmax_weights_all_on(backend, &weights, lanes);
                prop_assert_eq!(all.map(f32::to_bits), w.map(f32::to_bits), "{:?} unmasked lanes", backend);
            }
        }
    }

    #[test]
    fn pick_dispatches_on_temperature((costs, mask, seed) in column_case(finite_cost()), t in prop_oneof![
        Just(0.0f32), Just(-0.0f32), Just(0.7f32), Just(-1.0f32), Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)
    ]) {
        let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
        let fast = pick(&costs[..], &mask, t, &mut a);
        if t == 0.0 {
            prop_assert_eq!(fast, pick_min_reference(&costs[..], &mask, &mut b));
        } else if !(t.is_finite() && t > 0.0) {
            prop_assert_eq!(fast, Err(KernelError::BadTemperature));
            prop_assert_eq!(a.state(), seed);
        } else {
            prop_assert_eq!(fast.is_ok(), pick_reference(&costs[..], &mask, t, &mut b).is_ok());
        }
        prop_assert_eq!(a.state(), b.state());
    }
}

#[test]
fn non_finite_costs_are_refused_by_row() {
    let mut costs = [1.0f32; 20];
    costs[17] = f32::NAN;
    costs[3] = f32::NEG_INFINITY;
    let all = [u64::MAX];
    let mut rng = Rng::new(0);
    assert_eq!(
        pick_min(&costs[..], &all, &mut rng),
        Err(KernelError::NonFiniteCost { row: 3 })
    );
    assert_eq!(
        pick_softmax(&costs[..], &all, 1.0, &mut rng),
        Err(KernelError::NonFiniteCost { row: 3 })
    );
    let without_3 = [!(1u64 << 3)];
    assert_eq!(
        pick(&costs[..], &without_3, 0.0, &mut rng),
        Err(KernelError::NonFiniteCost { row: 17 })
    );
    assert_eq!(rng.state(), 0, "a refused input consumes no randomness");
    let neither = [!(1u64 << 3 | 1 << 17)];
    assert!(pick(&costs[..], &neither, 0.0, &mut rng).unwrap().is_some());
}

#[test]
fn softmax_draw_at_zero_takes_the_first_eligible_row_even_at_weight_zero() {
    // Dynamo walks `sample <= cumulative`, so u == 0 selects the first
    // eligible row whatever its weight. The generator outputs 0 (so u == 0)
    // from the state that the next increment wraps to 0.
    let zero_draw = 0u64.wrapping_sub(Rng::INCREMENT);
    assert_eq!(Rng::new(zero_draw).unit_f64(), 0.0);
    let costs = [7.0f32, 1.0e30, 0.0, 5.0];
    let mask = [0b1110u64];
    // Row 1's weight exp(-1000) underflows to 0 in both kernels.
    assert_eq!(
        pick_softmax(&costs[..], &mask, 1.0e-3, &mut Rng::new(zero_draw)),
        Ok(Some(1))
    );
    assert_eq!(
        pick_softmax_reference(&costs[..], &mask, 1.0e-3, &mut Rng::new(zero_draw)),
        Ok(Some(1))
    );
    // Any other draw skips it.
    for seed in 0..64 {
        assert_ne!(
            pick_softmax(&costs[..], &mask, 1.0e-3, &mut Rng::new(seed)),
            Ok(Some(1))
        );
    }
}

#[test]
fn softmax_with_equal_costs_is_uniform_by_position() {
    // Every weight is 1: the k-th eligible row is taken for u in ((k)/n, (k+1)/n].
    let costs = [2.5f32; 40];
    let mask = [0x00F0_0F00_F00F_u64];
    let eligible: Vec<usize> = (0..40).filter(|&r| contains(&mask, r)).collect();
    for seed in 0..500 {
        let u = Rng::new(seed).unit_f64();
        let k = ((u * eligible.len() as f64).ceil() as usize).max(1) - 1;
        let row = pick_softmax(&costs[..], &mask, 0.7, &mut Rng::new(seed)).unwrap();
        assert_eq!(row, Some(eligible[k]), "seed {seed}");
    }
}

#[test]
fn softmax_handles_a_range_that_overflows_f32() {
    // c_max - c_min overflows f32; Dynamo's f64 code picks row 0 (the cheap
    // one) at u = 0.6 for costs (-f64::MAX, f64::MAX) and T = 1.
    let costs = [-f32::MAX, f32::MAX];
    let mut seen = [0u32; 2];
    for seed in 0..2000 {
        let row = pick_softmax(&costs[..], &[0b11], 1.0, &mut Rng::new(seed))
            .unwrap()
            .unwrap();
        seen[row] += 1;
    }
    // weights 1 and e^-1: P(row 0) = 1 / (1 + e^-1) = 0.731
    let p0 = seen[0] as f64 / 2000.0;
    assert!((p0 - 0.731).abs() < 0.04, "{seen:?}");
}

/// Full mask words (the unmasked first pass) whose cost range overflows
/// `f32` (costs are halved first) agree with the reference on every backend.
#[test]
fn softmax_on_full_words_with_a_range_that_overflows_f32() {
    let rows: usize = 64 * 5 + 3;
    let costs: Vec<f32> = (0..rows)
        .map(|r| f32::MAX * (((r * 37) % 101) as f32 / 50.0 - 1.0))
        .collect();
    let mask = std::vec![u64::MAX; rows.div_ceil(64)];
    for seed in 0..300 {
        let t = [0.05f32, 0.7, 4.0][seed as usize % 3];
        let u = Rng::new(seed).unit_f64();
        let fast = pick_softmax(&costs[..], &mask, t, &mut Rng::new(seed))
            .unwrap()
            .unwrap();
        let slow = pick_softmax_reference(&costs[..], &mask, t, &mut Rng::new(seed))
            .unwrap()
            .unwrap();
        for backend in Backend::available() {
            assert_eq!(
                pick_softmax_on(backend, &costs[..], &mask, t, &mut Rng::new(seed)),
                Ok(Some(fast))
            );
        }
        let cum = reference_cumulative(&costs, &mask, t);
        assert!(
            softmax_picks_consistent(fast, slow, &cum, u, CUMULATIVE_EPS),
            "seed {seed}: simd {fast} reference {slow} u {u}"
        );
    }
}

#[test]
fn explain_reports_cost_and_runner_up() {
    let costs = [4.0f32, 1.0, 3.0, 3.0, 0.5];
    let mask = [0b01111u64];
    let why = explain(&costs[..], &mask, 1).unwrap();
    assert_eq!(
        why,
        PickOutcome {
            row: 1,
            cost: 1.0,
            runner_up: Some((2, 3.0))
        }
    );
    assert_eq!(why.margin(), Some(2.0));
    let why = explain(&costs[..], &mask, 3).unwrap();
    assert_eq!(why.runner_up, Some((1, 1.0)));
    assert_eq!(why.margin(), Some(-2.0));
    assert_eq!(explain(&costs[..], &mask, 4), None, "row 4 is not eligible");
    assert_eq!(explain(&costs[..], &[0b10], 1).unwrap().runner_up, None);
    assert_eq!(explain(&costs[..], &mask, 9), None);
    assert_eq!(F32Source::rows(&costs[..]), 5);
}

// Cases proptest found (kept here rather than in a regressions file).

#[test]
fn softmax_never_picks_a_row_past_the_end() {
    // The mask has bits past the last row; the partial lane group must ignore them.
    let costs = [0.0f32, 4.994_926e-39];
    let mask = [u64::MAX, u64::MAX];
    for seed in [33_060_717_573u64, 0, 1, 2, 3] {
        let fast = pick_softmax(&costs[..], &mask, 0.05, &mut Rng::new(seed));
        assert_eq!(
            fast,
            pick_softmax_reference(&costs[..], &mask, 0.05, &mut Rng::new(seed)),
            "seed {seed}"
        );
        assert!(fast.unwrap().unwrap() < 2);
    }
}

#[test]
fn softmax_weights_survive_a_subnormal_denominator() {
    // (c_max - c_min) * T underflows f32: the exponent is computed in f64.
    let costs = [1.175_494_4e-38f32, 516_510.84, 0.0];
    let t = 1.0e-45f32;
    let mut lanes = [0.0f32; 8];
    lanes[..3].copy_from_slice(&costs);
    let weights = SoftmaxLanes::new(0.0, 516_510.84, t);
    for backend in Backend::available() {
        let w = softmax_weights_on(backend, &weights, lanes, 0b111);
        for (i, &c) in costs.iter().enumerate() {
            assert_eq!(
                w[i].to_bits(),
                weights.weight_scalar(c).to_bits(),
                "{backend:?} cost {c}"
            );
            let exact = softmax_weight_reference(c, 0.0, 516_510.84, t);
            assert!(
                (w[i] as f64 - exact).abs() <= 1.0e-5 * exact + 1.0e-12,
                "{backend:?} cost {c}: {} vs {exact}",
                w[i]
            );
        }
    }
}

proptest! {
    /// With the eligible range supplied (as `kv_cost` supplies it), the pick
    /// skips passes but must choose exactly what the checked pick chooses,
    /// with the same draws, at temperature 0 and above.
    #[test]
    fn pick_in_range_equals_pick((costs, mask, seed) in column_case(finite_cost()), t in prop_oneof![
        2 => Just(0.0f32), 2 => Just(0.7f32), 2 => temperature(),
        1 => Just(-0.0f32), 1 => Just(-1.0f32), 1 => Just(f32::NAN), 1 => Just(f32::INFINITY)
    ], no_row in any::<bool>()) {
        // `no_row`: the empty mask, where a bad temperature must still be
        // refused (fuzz/regressions/kernels_diff/pick-in-range-nan-temperature-no-row).
        let mask = if no_row { std::vec![0; mask.len()] } else { mask };
        let eligible: Vec<f32> = (0..costs.len()).filter(|&r| contains(&mask, r)).map(|r| costs[r]).collect();
        let range = crate::kernels::kv_cost::CostRange {
            min: eligible.iter().copied().fold(f32::INFINITY, f32::min),
            max: eligible.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        };
        let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
        let fast = pick_in_range(&costs[..], &mask, range, t, &mut a);
        let checked = pick(&costs[..], &mask, t, &mut b);
        prop_assert_eq!(fast, checked);
        prop_assert_eq!(a, b);
    }
}

/// Columns longer than the word sums the softmax's first pass keeps (1,024
/// mask words): walks that stop before, at and past that boundary, with
/// empty words, partly eligible words and a partial last word, agree with
/// the reference on every backend.
#[test]
fn softmax_walks_past_the_remembered_word_sums() {
    let rows: usize = 1024 * 64 * 2 + 13;
    let costs: Vec<f32> = (0..rows).map(|r| ((r * 7919) % 97) as f32).collect();
    let mut mask: Vec<u64> = std::vec![u64::MAX; rows.div_ceil(64)];
    mask[3] = 0; // an empty word
    mask[130] = 0x00FF_0000_F0F0_0001;
    mask[1500] = 0x8000_0000_0000_0001;
    for seed in 0..60 {
        // Low temperatures favour early rows, high ones spread the walk.
        let t = [0.05f32, 0.7, 4.0][seed as usize % 3];
        let u = Rng::new(seed).unit_f64();
        let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
        let fast = pick_softmax(&costs[..], &mask, t, &mut a).unwrap().unwrap();
        let slow = pick_softmax_reference(&costs[..], &mask, t, &mut b).unwrap().unwrap();
        for backend in Backend::available() {
            let mut c = Rng::new(seed);
            assert_eq!(pick_softmax_on(backend, &costs[..], &mask, t, &mut c), Ok(Some(fast)));
        }
        let cum = reference_cumulative(&costs, &mask, t);
        assert!(
            softmax_picks_consistent(fast, slow, &cum, u, CUMULATIVE_EPS),
            "seed {seed}: simd {fast} reference {slow} u {u}"
        );
    }
}
