//! random, round-robin, power-of-two and least-loaded against their references.

use super::{column_case, load_value, mask, rows};
use crate::kernels::index::*;
use crate::kernels::least_loaded::*;
use crate::lanes::U32Source;
use crate::mask::contains;
use crate::simd::Backend;
use crate::Rng;
use core::cell::Cell;
use proptest::prelude::*;
use std::vec::Vec;

/// A load column that counts how it is read.
struct CountingLoad<'a> {
    values: &'a [u32],
    reads: Cell<usize>,
    group_reads: Cell<usize>,
}

impl U32Source for CountingLoad<'_> {
    fn rows(&self) -> usize {
        self.values.len()
    }
    fn value(&self, row: usize) -> u32 {
        self.reads.set(self.reads.get() + 1);
        self.values[row]
    }
    fn group(&self, group: usize) -> [u32; crate::lanes::LANES] {
        self.group_reads.set(self.group_reads.get() + 1);
        U32Source::group(self.values, group)
    }
}

proptest! {
    #[test]
    fn random_matches_reference((n, mask, seed) in rows().prop_flat_map(|n| (Just(n), mask(n), any::<u64>()))) {
        let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
        let fast = random(n, &mask, &mut a);
        prop_assert_eq!(fast, random_reference(n, &mask, &mut b));
        prop_assert_eq!(a.state(), b.state());
        if let Some(r) = fast {
            prop_assert!(r < n && contains(&mask, r));
        }
    }

    #[test]
    fn round_robin_matches_reference(
        (n, mask, ticket) in rows().prop_flat_map(|n| (Just(n), mask(n), prop_oneof![0u64..100, Just(u64::MAX), any::<u64>()]))
    ) {
        prop_assert_eq!(round_robin(n, &mask, ticket), round_robin_reference(n, &mask, ticket));
    }

    #[test]
    fn power_of_two_matches_reference_with_two_reads((load, mask, seed) in column_case(load_value())) {
        let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
        let counted = CountingLoad { values: &load, reads: Cell::new(0), group_reads: Cell::new(0) };
        let fast = power_of_two(&counted, &mask, &mut a);
        prop_assert_eq!(fast, power_of_two_reference(&load[..], &mask, &mut b));
        prop_assert_eq!(a.state(), b.state());
        let eligible = (0..load.len()).filter(|&r| contains(&mask, r)).count();
        prop_assert_eq!(counted.reads.get(), if eligible >= 2 { 2 } else { 0 });
        prop_assert_eq!(counted.group_reads.get(), 0);
        if let Some(r) = fast {
            prop_assert!(contains(&mask, r));
        }
    }

    #[test]
    fn least_loaded_matches_reference((load, mask, seed) in column_case(load_value())) {
        for backend in Backend::available() {
            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
            prop_assert_eq!(
                least_loaded_on(backend, &load[..], &mask, &mut a),
                least_loaded_reference(&load[..], &mask, &mut b),
                "{:?}", backend
            );
            prop_assert_eq!(a.state(), b.state());
        }
    }

    #[test]
    fn least_loaded_weighted_matches_reference(
        (load, weights, mask, seed) in rows().prop_flat_map(|n| (
            proptest::collection::vec(load_value(), n),
            proptest::collection::vec(prop_oneof![Just(1.0f32), Just(0.5f32), super::uniform_f32(1.0e-3, 10.0, false)], n),
            mask(n),
            any::<u64>(),
        ))
    ) {
        for backend in Backend::available() {
            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
            prop_assert_eq!(
                least_loaded_weighted_on(backend, &load[..], &weights[..], &mask, &mut a),
                least_loaded_weighted_reference(&load[..], &weights[..], &mask, &mut b),
                "{:?}", backend
            );
            prop_assert_eq!(a.state(), b.state());
        }
    }
}

#[test]
fn round_robin_visits_each_eligible_row_once_per_round() {
    let n = 150;
    let mask = [0x8000_0000_0000_0001u64, 0, 0x0000_0000_0030_0000];
    let eligible: Vec<usize> = (0..n).filter(|&r| contains(&mask, r)).collect();
    assert_eq!(eligible, [0, 63, 148, 149]);
    for start in [0u64, 7, u64::MAX - 5] {
        let mut seen: Vec<usize> = (0..4)
            .map(|t| round_robin(n, &mask, start.wrapping_add(t)).unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, eligible, "round starting at ticket {start}");
    }
    // Dynamo's own example: [10, 20, 30, 40] selected four times gives each once, in order.
    assert_eq!(
        (0..4)
            .map(|t| round_robin(4, &[0b1111], t).unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!(round_robin(n, &[0, 0, 0], 3), None);
}

#[test]
fn power_of_two_ties_go_to_the_first_draw() {
    let load = [5u32; 12];
    let mask = [0b1111_0101_0110u64];
    let eligible: Vec<usize> = (0..12).filter(|&r| contains(&mask, r)).collect();
    for seed in 0..200 {
        let mut replay = Rng::new(seed);
        let first = eligible[replay.below(eligible.len() as u64) as usize];
        assert_eq!(
            power_of_two(&load[..], &mask, &mut Rng::new(seed)),
            Some(first),
            "seed {seed}"
        );
    }
}

#[test]
fn power_of_two_with_one_eligible_row_makes_no_draw() {
    let load = [3u32, 1, 2];
    let mut rng = Rng::new(8);
    assert_eq!(power_of_two(&load[..], &[0b100], &mut rng), Some(2));
    assert_eq!(rng.state(), 8);
    assert_eq!(power_of_two(&load[..], &[0], &mut rng), None);
}
