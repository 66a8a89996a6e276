//! Bounded-load rendezvous hashing against its reference, and the
//! properties the prefix-hash policy relies on: the load bound holds, a key
//! stays on its row while the row has room, a departing worker moves only
//! its own keys, and keys spread evenly.

use super::{chi_square, load_value, mask, rows, Shifting, CHI2_999};
use crate::kernels::rendezvous::*;
use crate::kernels::KernelError;
use crate::mask::contains;
use crate::simd::Backend;
use crate::Rng;
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

fn salts(n: usize) -> Vec<u32> {
    (0..n as u64).map(|w| worker_salt(w * 3 + 1, (w % 4) as u32)).collect()
}

/// The unbounded choice: the eligible row with the lowest score.
fn lowest_score(key: u64, salts: &[u32], mask: &[u64]) -> Option<usize> {
    (0..salts.len())
        .filter(|&r| contains(mask, r))
        .min_by_key(|&r| (rendezvous_score(key, salts[r]), r))
}

fn load_factor() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(1.0),
        Just(DEFAULT_LOAD_FACTOR),
        Just(2.0),
        super::uniform_f64(1.0, 4.0),
        Just(MAX_LOAD_FACTOR)
    ]
}

proptest! {
    #[test]
    fn bounded_rendezvous_matches_reference(
        (load, salt, mask, key, factor) in rows().prop_flat_map(|n| (
            proptest::collection::vec(load_value(), n),
            prop_oneof![
                3 => proptest::collection::vec(any::<u32>(), n),
                // Few distinct salts: ties on the 31-bit key.
                1 => proptest::collection::vec(0u32..3, n),
                // A salt column of another length: the shorter one bounds the scan.
                1 => proptest::collection::vec(any::<u32>(), 0..n + 9),
            ],
            prop_oneof![
                3 => mask(n),
                // Fewer mask words than rows need.
                1 => mask(n).prop_map(|m| m[..m.len() / 2].to_vec()),
            ],
            any::<u64>(),
            load_factor(),
        ))
    ) {
        let slow = bounded_rendezvous_reference(key, &load[..], &salt[..], &mask, factor).unwrap();
        for backend in Backend::available() {
            prop_assert_eq!(
                bounded_rendezvous_on(backend, key, &load[..], &salt[..], &mask, factor).unwrap(),
                slow,
                "{:?}", backend
            );
        }
        let rows = load.len().min(salt.len());
        let eligible: Vec<usize> = (0..rows).filter(|&r| contains(&mask, r)).collect();
        match slow {
            None => prop_assert!(eligible.is_empty()),
            Some(p) => {
                prop_assert!(contains(&mask, p.row));
                // The chosen row is under the bound, and no row under the
                // bound scores lower.
                prop_assert!(u64::from(load[p.row]) < p.load_bound, "{:?} load {}", p, load[p.row]);
                let best = eligible.iter().filter(|&&r| u64::from(load[r]) < p.load_bound)
                    .map(|&r| rendezvous_score(key, salt[r]) >> 1).min();
                prop_assert_eq!(Some(rendezvous_score(key, salt[p.row]) >> 1), best);
            }
        }
    }
}

#[test]
fn bad_load_factors_are_refused() {
    let (load, salt, mask) = ([0u32; 4], salts(4), [0b1111u64]);
    for f in [0.0, 0.99, -1.25, f64::NAN, f64::INFINITY, MAX_LOAD_FACTOR * 2.0] {
        for backend in Backend::available() {
            assert_eq!(
                bounded_rendezvous_on(backend, 1, &load[..], &salt[..], &mask, f),
                Err(KernelError::BadLoadFactor),
                "{f}"
            );
        }
        assert_eq!(
            bounded_rendezvous_reference(1, &load[..], &salt[..], &mask, f),
            Err(KernelError::BadLoadFactor)
        );
    }
    assert!(check_load_factor(1.0).is_ok() && check_load_factor(MAX_LOAD_FACTOR).is_ok());
}

#[test]
fn load_bound_is_the_ceiling_of_the_scaled_average() {
    assert_eq!(load_bound(0, 1, 1.0), 1);
    assert_eq!(load_bound(0, 16, 1.25), 1);
    assert_eq!(load_bound(15, 16, 1.25), 2);
    assert_eq!(load_bound(16, 16, 1.0), 2);
    assert_eq!(load_bound(u64::MAX / 2, 1, MAX_LOAD_FACTOR), u64::MAX);
    assert_eq!(load_bound(u64::from(u32::MAX), 1, 1.0), 1 << 32);
}

/// Loads too large for a lane sum of plain `u32`s, and a lone row at
/// `u32::MAX`: the row is still under its bound (which can exceed
/// `u32::MAX`), on every backend.
#[test]
fn huge_loads_are_summed_exactly() {
    for load in [[20_971_522u32], [u32::MAX]] {
        let salt = salts(1);
        for backend in Backend::available() {
            let p = bounded_rendezvous_on(backend, 9, &load[..], &salt[..], &[1], 1.0)
                .unwrap()
                .unwrap();
            assert_eq!(p.row, 0);
            assert_eq!(p.load_bound, u64::from(load[0]) + 1, "{backend:?}");
        }
    }
    // Eight full groups of u32::MAX loads: the sum needs 38 bits.
    let load = vec![u32::MAX; 64];
    let (salt, mask) = (salts(64), [u64::MAX]);
    for backend in Backend::available() {
        let p = bounded_rendezvous_on(backend, 3, &load[..], &salt[..], &mask, 1.0)
            .unwrap()
            .unwrap();
        assert_eq!(
            p.load_bound,
            load_bound(64 * u64::from(u32::MAX), 64, 1.0),
            "{backend:?}"
        );
        assert_eq!(p.load_bound, u64::from(u32::MAX) + 1);
    }
}

/// With nothing in flight every key goes to its lowest-scoring row, and the
/// same key always to the same row.
#[test]
fn idle_rows_give_every_key_its_lowest_scoring_row() {
    let n = 100;
    let (load, salt, mask) = (vec![0u32; n], salts(n), [u64::MAX, u64::MAX]);
    for key in 0..2_000u64 {
        let k = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let p = bounded_rendezvous(k, &load[..], &salt[..], &mask, DEFAULT_LOAD_FACTOR)
            .unwrap()
            .unwrap();
        assert_eq!(Some(p.row), lowest_score(k, &salt, &mask), "key {k}");
    }
}

/// Requests with one key, booked one after another and never released: the
/// key fills its first row up to the bound, then the next rows in its order;
/// no row ever holds more than the bound of the request that went there.
#[test]
fn one_hot_key_is_spread_within_the_bound() {
    let n = 16;
    let (mut load, salt, mask) = (vec![0u32; n], salts(n), [u64::MAX]);
    let first = lowest_score(77, &salt, &mask).unwrap();
    for i in 0..1_000u64 {
        let p = bounded_rendezvous(77, &load[..], &salt[..], &mask, DEFAULT_LOAD_FACTOR)
            .unwrap()
            .unwrap();
        let expected = load_bound(i, n as u32, DEFAULT_LOAD_FACTOR);
        assert_eq!(p.load_bound, expected);
        assert!(
            u64::from(load[p.row]) < expected,
            "request {i}: row {} holds {}",
            p.row,
            load[p.row]
        );
        load[p.row] += 1;
    }
    let max = *load.iter().max().unwrap();
    assert!(
        u64::from(max) <= load_bound(999, n as u32, DEFAULT_LOAD_FACTOR),
        "{load:?}"
    );
    assert_eq!(load[first], max, "the key's own row is full");
    // Rows fill to the bound before the key takes another: 1,000 requests
    // need ceil(1000 / 79) = 13 rows.
    assert_eq!(load.iter().filter(|&&l| l > 0).count(), 13, "{load:?}");
}

/// Rendezvous hashing moves only the keys of a worker that leaves: every
/// other key keeps its row.
#[test]
fn a_departing_worker_moves_only_its_own_keys() {
    let n = 40;
    let (load, salt) = (vec![0u32; n], salts(n));
    let all = [(1u64 << n) - 1];
    let gone = 17;
    let without = [all[0] & !(1 << gone)];
    let mut moved = 0;
    for key in 0..5_000u64 {
        let k = key.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ 0x5555;
        let before = bounded_rendezvous(k, &load[..], &salt[..], &all, 1.25)
            .unwrap()
            .unwrap();
        let after = bounded_rendezvous(k, &load[..], &salt[..], &without, 1.25)
            .unwrap()
            .unwrap();
        if before.row == gone {
            moved += 1;
            assert_ne!(after.row, gone);
        } else {
            assert_eq!(before.row, after.row, "key {k} moved though its worker stayed");
        }
    }
    // About 1/40 of the keys lived on the departed worker.
    assert!((60..200).contains(&moved), "{moved}");
}

/// Two ranks whose salts collide tie on every key: each key still goes to
/// one of them, the same one every time.
#[test]
fn colliding_salts_do_not_make_a_key_bounce() {
    let (load, mask) = ([0u32; 3], [0b111u64]);
    let salt = [7u32, 7, 9];
    let mut rows = [0usize; 3];
    for key in 0..400u64 {
        let first = bounded_rendezvous(key, &load[..], &salt[..], &mask, 1.25)
            .unwrap()
            .unwrap()
            .row;
        for _ in 0..5 {
            assert_eq!(
                bounded_rendezvous(key, &load[..], &salt[..], &mask, 1.25)
                    .unwrap()
                    .unwrap()
                    .row,
                first
            );
        }
        rows[first] += 1;
    }
    assert!(
        rows[0] > 50 && rows[1] > 50,
        "the tie is broken both ways across keys: {rows:?}"
    );
}

/// Keys spread evenly over the rows (chi-square over 5 rows, 99.9%).
#[test]
fn keys_spread_evenly() {
    let n = 5;
    let (load, salt, mask) = (vec![0u32; n], salts(n), [0b11111u64]);
    let mut counts = vec![0u64; n];
    for key in 0..40_000u64 {
        let k = key.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        let p = bounded_rendezvous(k, &load[..], &salt[..], &mask, 1.25)
            .unwrap()
            .unwrap();
        counts[p.row] += 1;
    }
    let stat = chi_square(&counts, &[0.2; 5]);
    assert!(stat < CHI2_999[4], "{counts:?}: {stat}");
}

/// Over a load column that changes under the scan, every backend still
/// returns an eligible row, and `None` only with nothing eligible.
#[test]
fn a_load_column_changing_under_the_scan_still_yields_an_eligible_row() {
    for rows in [8usize, 64, 100, 130, 1000] {
        let salt = salts(rows);
        for seed in 0..200u64 {
            let mut r = Rng::new(seed);
            let mask: Vec<u64> = (0..rows.div_ceil(64))
                .map(|_| if seed % 3 == 0 { u64::MAX } else { r.next_u64() })
                .collect();
            let any = (0..rows).any(|row| contains(&mask, row));
            for backend in Backend::available() {
                let load = Shifting::new(rows, seed as u32, 4);
                match bounded_rendezvous_on(backend, seed, &load, &salt[..], &mask, 1.0).unwrap() {
                    Some(p) => assert!(p.row < rows && contains(&mask, p.row), "rows {rows} seed {seed}: {p:?}"),
                    None => assert!(!any, "rows {rows} seed {seed}: None with eligible rows"),
                }
            }
        }
    }
}

/// A fleet row stores its worker's salt when added, and the kernel over
/// the fleet's columns matches the reference.
#[test]
fn fleet_rows_carry_their_workers_salts() {
    use crate::fleet::{BookLoad, Fleet, WorkerSpec};
    use crate::lanes::U32Source;
    let fleet = Fleet::<16>::new();
    let mut bookings = vec![];
    let mut r = Rng::new(5);
    for id in 0..70u64 {
        let mut spec = WorkerSpec::new(1_000 + id);
        spec.dp_rank = (id % 3) as u32;
        let row = fleet.add(spec).unwrap().row as usize;
        for _ in 0..r.below(3) {
            bookings.push(fleet.book(row, BookLoad::default()).unwrap());
        }
    }
    let salts = fleet.rendezvous_salts();
    for row in 0..70 {
        assert_eq!(
            salts.value(row),
            worker_salt(1_000 + row as u64, (row % 3) as u32),
            "row {row}"
        );
    }
    let active = fleet.active_requests();
    let mask = [u64::MAX, 0x3F];
    let seeds = if cfg!(miri) { 2 } else { 50u64 };
    for key in 0..seeds {
        let slow = bounded_rendezvous_reference(key, &active, &salts, &mask, 1.25).unwrap();
        for backend in Backend::available() {
            assert_eq!(
                bounded_rendezvous_on(backend, key, &active, &salts, &mask, 1.25).unwrap(),
                slow,
                "{backend:?} key {key}"
            );
        }
    }
    drop(bookings);
}
