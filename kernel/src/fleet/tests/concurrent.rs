//! Small concurrent tests: std threads over one fleet. Miri runs them (with
//! few iterations) to check the protocols are free of data races and UB;
//! natively they run more iterations. The exhaustive interleaving checks are
//! the loom models in `loom-tests/`, the long run is `tests/stress.rs`.

use super::*;
use crate::Rng;
use std::sync::atomic::{AtomicU32 as StdAtomicU32, Ordering as StdOrdering};
use std::thread;
use std::vec::Vec;

/// Iterations per thread.
const N: u32 = if cfg!(miri) { 20 } else { 5_000 };

#[test]
fn concurrent_bookings_never_pass_the_admission_limit() {
    const LIMIT: u32 = 2;
    let fleet = Fleet::<1>::new();
    fleet.add(worker(1, LIMIT)).unwrap();
    fleet.add(worker(2, LIMIT)).unwrap();
    let max_seen = StdAtomicU32::new(0);
    thread::scope(|s| {
        for t in 0..3u64 {
            let (fleet, max_seen) = (&fleet, &max_seen);
            s.spawn(move || {
                let mut rng = Rng::new(t);
                let mut held = Vec::new();
                for _ in 0..N {
                    let row = rng.below(2) as usize;
                    if let Ok(b) = fleet.book(row, load(3, 1)) {
                        max_seen.fetch_max(fleet.outstanding(row).unwrap().requests, StdOrdering::Relaxed);
                        held.push(b);
                    }
                    if held.len() > 1 || rng.below(2) == 0 {
                        held.pop();
                    }
                }
            });
        }
    });
    assert!(max_seen.load(StdOrdering::Relaxed) <= LIMIT);
    assert_all_released(&fleet);
}

#[test]
fn releases_racing_with_slot_reuse_leave_every_counter_at_zero() {
    let fleet = Fleet::<1>::new();
    fleet.add(worker(1, 3)).unwrap();
    thread::scope(|s| {
        for t in 0..2u64 {
            let fleet = &fleet;
            s.spawn(move || {
                let mut rng = Rng::new(t);
                let mut held = Vec::new();
                for _ in 0..N {
                    if let Ok(mut b) = fleet.book(0, load(5, 1)) {
                        let _ = b.add_output_block();
                        if rng.below(2) == 0 {
                            b.prefill_complete();
                        }
                        held.push(b);
                    }
                    if held.len() > 2 || (!held.is_empty() && rng.below(3) == 0) {
                        held.remove(0);
                    }
                }
            });
        }
        let fleet = &fleet;
        s.spawn(move || {
            for i in 0..N / 2 {
                let slot = fleet.slot_id(0).unwrap();
                fleet.remove(slot).unwrap();
                fleet.add(worker(100 + u64::from(i), 3)).unwrap();
            }
        });
    });
    assert_all_released(&fleet);
    assert_eq!(fleet.slot_id(0).unwrap().generation, 1 + N / 2);
}

#[test]
fn racing_state_changes_leave_the_selectable_bit_matching_the_state() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    for round in 0..if cfg!(miri) { 3 } else { 200 } {
        thread::scope(|s| {
            for t in 0..2u64 {
                let fleet = &fleet;
                s.spawn(move || {
                    let mut rng = Rng::new(round * 2 + t);
                    for _ in 0..N / 10 {
                        let state =
                            [WorkerState::Live, WorkerState::Draining, WorkerState::Cordoned][rng.below(3) as usize];
                        fleet.set_state(a, state).unwrap();
                    }
                });
            }
        });
        assert_eq!(
            fleet.is_selectable(0),
            fleet.state(0) == SlotState::Live,
            "round {round}"
        );
    }
}

#[test]
fn concurrent_tickets_are_distinct() {
    let fleet = Fleet::<1>::new();
    let mut all: Vec<u32> = thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let fleet = &fleet;
                s.spawn(move || (0..N).map(|_| fleet.next_ticket()).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    all.sort_unstable();
    assert!(all.iter().copied().eq(0..3 * N), "every ticket handed out once");
    assert_eq!(fleet.peek_ticket(), 3 * N);
}

#[test]
fn racing_weight_updates_keep_weight_and_inverse_paired() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    thread::scope(|s| {
        for weight in [2.0f32, 8.0] {
            let fleet = &fleet;
            s.spawn(move || {
                for _ in 0..N / 4 {
                    fleet.set_capacity_weight(a, weight).unwrap();
                    fleet.set_admission_limit(a, weight as u32).unwrap();
                }
            });
        }
        let fleet = &fleet;
        s.spawn(move || {
            for _ in 0..N / 4 {
                let w = fleet.worker(0).unwrap();
                assert!([1.0, 2.0, 8.0].contains(&w.capacity_weight));
                assert_eq!(w.worker_id, 1);
            }
        });
    });
    let w = fleet.worker(0).unwrap();
    let inv = crate::lanes::F32Source::value(&fleet.inv_capacity_weight(), 0);
    assert_eq!(inv, 1.0 / w.capacity_weight, "the last writer wrote both columns");
    assert!(!fleet.state_word(0, crate::sync::Ordering::Relaxed).writer_held());
}

#[test]
fn select_and_book_races_with_removal_and_reuse() {
    use crate::kernels::index::power_of_two;
    let fleet = Fleet::<1>::new();
    for id in 0..4 {
        fleet.add(worker(id, 2)).unwrap();
    }
    let booked = StdAtomicU32::new(0);
    thread::scope(|s| {
        for t in 0..2u64 {
            let (fleet, booked) = (&fleet, &booked);
            s.spawn(move || {
                let mut rng = Rng::new(t);
                let mut held = Vec::new();
                for _ in 0..N {
                    let mut mask = [0u64];
                    fleet.selectable(&mut mask);
                    let scan = |m: &[u64], r: &mut Rng| power_of_two(&fleet.active_requests(), m, r);
                    if let Ok(b) = fleet.select_and_book(&mut mask, load(1, 1), &mut rng, scan, 4) {
                        booked.fetch_add(1, StdOrdering::Relaxed);
                        held.push(b);
                    }
                    if held.len() > 3 {
                        held.remove(rng.below(4) as usize);
                    }
                }
            });
        }
        let fleet = &fleet;
        s.spawn(move || {
            for i in 0..N / 4 {
                let slot = fleet.slot_id((i % 4) as usize).unwrap();
                fleet.remove(slot).unwrap();
                fleet.add(worker(10 + u64::from(i), 2)).unwrap();
            }
        });
    });
    assert!(booked.load(StdOrdering::Relaxed) > 0);
    assert_all_released(&fleet);
}
