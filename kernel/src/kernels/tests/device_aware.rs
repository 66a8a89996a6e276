//! Device-aware weighted against its reference, and Dynamo's decisions by hand.

use super::{load_value, mask, rows, Shifting};
use crate::kernels::device_aware::*;
use crate::kernels::KernelError;
use crate::mask::contains;
use crate::simd::Backend;
use crate::Rng;
use proptest::prelude::*;
use std::vec;

fn choose(
    load: &[u32],
    hits: &[u32],
    is_cpu: &[u64],
    mask: &[u64],
    config: DeviceAwareConfig,
    seed: u64,
) -> Option<DeviceAwareChoice> {
    let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
    let fast = device_aware(load, hits, is_cpu, mask, &config, &mut a).unwrap();
    let slow = device_aware_reference(load, hits, is_cpu, mask, &config, &mut b).unwrap();
    assert_eq!(fast, slow);
    assert_eq!(a.state(), b.state());
    for backend in Backend::available() {
        let mut c = Rng::new(seed);
        assert_eq!(
            device_aware_on(backend, load, hits, is_cpu, mask, &config, &mut c).unwrap(),
            slow,
            "{backend:?}"
        );
        assert_eq!(c.state(), b.state());
    }
    fast
}

proptest! {
    #[test]
    fn device_aware_matches_reference(
        (load, hits, is_cpu, mask, seed) in rows().prop_flat_map(|n| (
            prop::collection::vec(load_value(), n),
            prop::collection::vec(prop_oneof![0u32..4, Just(u32::MAX)], n),
            prop_oneof![Just(vec![0u64; n.div_ceil(64)]), Just(vec![u64::MAX; n.div_ceil(64)]), mask(n)],
            mask(n),
            any::<u64>(),
        )),
        required in prop_oneof![Just(0u32), 1u32..4, Just(u32::MAX)],
        ratio in prop_oneof![Just(0u32), Just(1u32), Just(8u32), any::<u32>()],
    ) {
        let config = DeviceAwareConfig { required_cache_hits: required, non_cpu_to_cpu_ratio: ratio };
        for backend in Backend::available() {
            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
            let fast = device_aware_on(backend, &load[..], &hits[..], &is_cpu, &mask, &config, &mut a);
            prop_assert_eq!(fast, device_aware_reference(&load[..], &hits[..], &is_cpu, &mask, &config, &mut b), "{:?}", backend);
            prop_assert_eq!(a.state(), b.state());
            if let Ok(Some(c)) = fast {
                prop_assert!(contains(&mask, c.row));
            }
        }
    }
}

#[test]
fn device_aware_follows_dynamos_decisions() {
    let cfg = DeviceAwareConfig::default();
    // Rows 0, 1: CPU; rows 2, 3, 4: accelerators, load 30 each.
    let is_cpu = [0b00011u64];
    let all = [0b11111u64];
    let no_hits = [0u32; 5];
    let pick = |load: [u32; 5], hits: &[u32], cfg: DeviceAwareConfig, mask: &[u64], seed: u64| {
        choose(&load, hits, &is_cpu, mask, cfg, seed).map(|c| (c.row, c.group))
    };
    // allowed = 90 * 2 / (8 * 3) = 7 (floor of 7.5): CPU total 6 < 7 takes the least-loaded CPU row.
    assert_eq!(
        pick([2, 4, 30, 30, 30], &no_hits, cfg, &all, 1),
        Some((0, DeviceGroup::Cpu))
    );
    // CPU total 7 is not < 7 (it would be < 7.5 without Dynamo's floor): an accelerator, ties uniform.
    for seed in 0..16 {
        let (row, group) = pick([3, 4, 30, 30, 30], &no_hits, cfg, &all, seed).unwrap();
        assert_eq!(group, DeviceGroup::Accelerator);
        assert!((2..5).contains(&row));
    }
    // All idle: allowed = 0 and 0 < 0 is false, so an accelerator.
    assert_eq!(
        pick([0; 5], &no_hits, cfg, &all, 3).unwrap().1,
        DeviceGroup::Accelerator
    );
    // A ratio of 0 counts as 1: allowed = 90 * 2 / 3 = 60.
    let ratio0 = DeviceAwareConfig {
        non_cpu_to_cpu_ratio: 0,
        ..cfg
    };
    assert_eq!(
        pick([30, 29, 30, 30, 30], &no_hits, ratio0, &all, 1),
        Some((1, DeviceGroup::Cpu))
    );
    assert_eq!(
        pick([30, 30, 30, 30, 30], &no_hits, ratio0, &all, 1).unwrap().1,
        DeviceGroup::Accelerator
    );
    // Enough cache hits (>=, exactly 2 counts) wins outright, least-loaded among such rows, CPU or not.
    let full = DeviceAwareConfig {
        required_cache_hits: 2,
        ..cfg
    };
    let hits = [0u32, 2, 1, 3, 0];
    assert_eq!(
        pick([0, 9, 0, 5, 0], &hits, full, &all, 1),
        Some((3, DeviceGroup::FullCache))
    );
    assert_eq!(
        pick([0, 5, 0, 9, 0], &hits, full, &all, 1),
        Some((1, DeviceGroup::FullCache))
    );
    assert!(!DeviceGroup::FullCache.books_occupancy() && DeviceGroup::Cpu.books_occupancy());
    // ... but only among eligible rows, and not when the threshold is 0.
    assert_eq!(
        pick([0, 9, 0, 5, 0], &hits, full, &[0b10101], 1).unwrap().1,
        DeviceGroup::Accelerator
    );
    assert_eq!(
        pick([0, 9, 0, 5, 0], &hits, cfg, &all, 1).unwrap().1,
        DeviceGroup::Accelerator
    );
    // Only one kind eligible: its least-loaded row, whatever the ratio.
    assert_eq!(
        pick([0, 1, 9, 8, 7], &no_hits, cfg, &[0b11100], 1),
        Some((4, DeviceGroup::Accelerator))
    );
    assert_eq!(
        pick([5, 1, 0, 0, 0], &no_hits, cfg, &[0b00011], 1),
        Some((1, DeviceGroup::Cpu))
    );
    assert_eq!(pick([5, 1, 0, 0, 0], &no_hits, cfg, &[0], 1), None);
    // A short cache-hit column is refused.
    let err = device_aware(&[1u32, 2, 3][..], &[0u32, 0][..], &is_cpu, &all, &cfg, &mut Rng::new(0));
    assert_eq!(err, Err(KernelError::ColumnTooShort { rows: 3, len: 2 }));
}

#[test]
fn device_aware_load_sums_do_not_wrap() {
    // 2^17 lane groups of accelerators at u32::MAX: the 16-bit lane sums must
    // be flushed. ratio 1, one CPU row: allowed = u32::MAX exactly, so the CPU
    // row is chosen iff its load is below u32::MAX.
    let n = (1usize << 17) * 8 + 1;
    let mut load = vec![u32::MAX; n];
    let hits = vec![0u32; n];
    let is_cpu = [1u64];
    let mask = vec![u64::MAX; n.div_ceil(64)];
    let cfg = DeviceAwareConfig {
        required_cache_hits: 0,
        non_cpu_to_cpu_ratio: 1,
    };
    load[0] = u32::MAX - 1;
    assert_eq!(
        choose(&load, &hits, &is_cpu, &mask, cfg, 5).unwrap().group,
        DeviceGroup::Cpu
    );
    load[0] = u32::MAX;
    assert_eq!(
        choose(&load, &hits, &is_cpu, &mask, cfg, 5).unwrap().group,
        DeviceGroup::Accelerator
    );
}

/// Loads that change between the passes must never make the kernel return
/// `None` while a row is eligible (the host reported "all eligible workers
/// are overloaded" on an idle fleet under churn), nor a row outside the
/// mask.
#[test]
fn a_load_column_changing_under_the_scan_still_yields_an_eligible_row() {
    for rows in [8usize, 64, 100, 130, 1000] {
        for seed in 0..300u64 {
            let mut r = Rng::new(seed);
            let mask: std::vec::Vec<u64> = (0..rows.div_ceil(64))
                .map(|_| if seed % 3 == 0 { u64::MAX } else { r.next_u64() })
                .collect();
            let is_cpu: std::vec::Vec<u64> = (0..rows.div_ceil(64)).map(|_| r.next_u64()).collect();
            let hits: std::vec::Vec<u32> = (0..rows as u32).map(|i| (i * 7 + seed as u32) % 4).collect();
            let load = Shifting::new(rows, seed as u32, 5);
            let config = DeviceAwareConfig {
                required_cache_hits: (seed % 4) as u32,
                ..DeviceAwareConfig::default()
            };
            let any = (0..rows).any(|row| contains(&mask, row));
            match device_aware(&load, &hits[..], &is_cpu, &mask, &config, &mut r).unwrap() {
                Some(c) => assert!(c.row < rows && contains(&mask, c.row), "rows {rows} seed {seed}: {c:?}"),
                None => assert!(!any, "rows {rows} seed {seed}: None with eligible rows"),
            }
        }
    }
}

/// Over a fleet's counter column (an `AtomicView`, read a mask word of lane
/// groups at a time), with masks and CPU bitmasks shorter or longer than the
/// rows: every backend returns the reference's row and draws.
#[test]
fn device_aware_over_a_fleet_column_matches_reference() {
    use crate::fleet::{BookLoad, Fleet, WorkerSpec};
    let fleet = Fleet::<48>::new();
    let rows = 300usize;
    let mut r = Rng::new(11);
    let mut bookings = vec![];
    for id in 0..rows {
        let row = fleet.add(WorkerSpec::new(id as u64)).unwrap().row as usize;
        for _ in 0..r.below(4) {
            bookings.push(fleet.book(row, BookLoad::default()).unwrap());
        }
    }
    let active = fleet.active_requests();
    let scan_rows = crate::lanes::U32Source::rows(&active);
    let hits: std::vec::Vec<u32> = (0..scan_rows as u32).map(|i| (i * 5) % 3).collect();
    let words = scan_rows.div_ceil(64);
    // Under miri (CI runs the kernel's fleet tests there) a few seeds.
    let seeds = if cfg!(miri) { 3 } else { 200u64 };
    for seed in 0..seeds {
        let mut r = Rng::new(seed);
        let word = |r: &mut Rng| match r.below(4) {
            0 => 0,
            1 => u64::MAX,
            _ => r.next_u64(),
        };
        let mask_len = r.below(words as u64 + 2) as usize;
        let mask: std::vec::Vec<u64> = (0..mask_len).map(|_| word(&mut r)).collect();
        let cpu_len = r.below(words as u64 + 2) as usize;
        let is_cpu: std::vec::Vec<u64> = (0..cpu_len).map(|_| word(&mut r)).collect();
        for required in [0u32, 1, 2] {
            let config = DeviceAwareConfig {
                required_cache_hits: required,
                non_cpu_to_cpu_ratio: (seed % 10) as u32,
            };
            let mut b = Rng::new(seed);
            let slow = device_aware_reference(&active, &hits[..], &is_cpu, &mask, &config, &mut b).unwrap();
            for backend in Backend::available() {
                let mut a = Rng::new(seed);
                let fast = device_aware_on(backend, &active, &hits[..], &is_cpu, &mask, &config, &mut a).unwrap();
                assert_eq!(fast, slow, "{backend:?} seed {seed} required {required}");
                assert_eq!(a.state(), b.state(), "{backend:?} seed {seed} required {required}");
            }
        }
    }
    drop(bookings);
}
