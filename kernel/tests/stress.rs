//! Stress: two threads select, book and release against one fleet while a
//! third adds, removes, cordons and re-weights workers under them.
//!
//! Checks, with std threads on real hardware (the exhaustive small-scale
//! checks are the loom models in `loom-tests/`):
//!
//! * the admission limit is never passed: every thread keeps a shadow count
//!   of the bookings it holds per (row, generation), raised after a booking
//!   succeeds and lowered before it is released, so it never exceeds the
//!   fleet's own count; its maximum must stay within the limit;
//! * after every guard is dropped, every counter of every row is zero:
//!   nothing leaked, nothing released twice.
//!
//! Release builds run 1,000,000 selections (two threads of 500,000, about as
//! many releases, and millions of fleet changes) in under a second; debug
//! builds a fifth of that, miri a few hundred.

#![cfg(not(selkie_loom))]

use selkie_kernel::fleet::{BookLoad, Booking, Fleet, Outstanding, SlotId, WorkerSpec, WorkerState};
use selkie_kernel::kernels::{index::power_of_two, index::random, least_loaded::least_loaded};
use selkie_kernel::Rng;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::thread;
use std::time::Instant;

/// Selections per booking thread.
const SELECTIONS: u32 = if cfg!(miri) {
    150
} else if cfg!(debug_assertions) {
    100_000
} else {
    500_000
};
/// Admission limit of every worker.
const LIMIT: u32 = 2;
/// Guards a booking thread holds at most.
const HOLD: usize = 12;
type F = Fleet<2>;
const ROWS: usize = F::CAPACITY;

/// Per (row, generation) count of guards the booking threads hold, packed
/// `generation << 32 | count`, and the largest count ever reached.
struct Shadow {
    held: [AtomicU64; ROWS],
    max: AtomicU32,
}

impl Shadow {
    fn booked(&self, slot: SlotId) {
        let cell = &self.held[slot.row as usize];
        let mut word = cell.load(Ordering::Relaxed);
        loop {
            let (generation, count) = ((word >> 32) as u32, word as u32);
            let next = match generation.cmp(&slot.generation) {
                std::cmp::Ordering::Greater => return, // a booking of a replaced occupant
                std::cmp::Ordering::Equal => word + 1,
                std::cmp::Ordering::Less => (slot.generation as u64) << 32 | 1,
            };
            match cell.compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    self.max.fetch_max(next as u32, Ordering::Relaxed);
                    let _ = count;
                    return;
                }
                Err(now) => word = now,
            }
        }
    }

    fn releasing(&self, slot: SlotId) {
        let cell = &self.held[slot.row as usize];
        let mut word = cell.load(Ordering::Relaxed);
        while (word >> 32) as u32 == slot.generation {
            assert!(word as u32 >= 1, "shadow underflow on {slot:?}");
            match cell.compare_exchange_weak(word, word - 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => word = now,
            }
        }
    }
}

#[derive(Default, Debug)]
struct Tally {
    selections: u64,
    booked: u64,
    refused: u64,
    released: u64,
    retargeted: u64,
}

fn booker(fleet: &F, shadow: &Shadow, seed: u64) -> Tally {
    let mut rng = Rng::new(seed);
    let mut held: Vec<Booking<&F, 2>> = Vec::with_capacity(HOLD + 1);
    let mut tally = Tally::default();
    for _ in 0..SELECTIONS {
        let mut mask = [0u64];
        fleet.selectable(&mut mask);
        let policy = rng.below(3);
        let scan = |m: &[u64], r: &mut Rng| match policy {
            0 => least_loaded(&fleet.active_requests(), m, r),
            1 => power_of_two(&fleet.active_requests(), m, r),
            _ => random(fleet.scan_rows(), m, r),
        };
        let load = BookLoad {
            prefill_tokens: rng.below(1000) as u32,
            decode_blocks: rng.below(4) as u32,
        };
        tally.selections += 1;
        match fleet.select_and_book(&mut mask, load, &mut rng, scan, 3) {
            Ok(mut b) => {
                shadow.booked(b.slot());
                let now = fleet.outstanding(b.row()).unwrap().requests;
                assert!(now <= LIMIT, "row {} holds {now} requests", b.row());
                tally.booked += 1;
                match rng.below(8) {
                    0 => b.prefill_complete(),
                    1 => {
                        let _ = b.add_output_block();
                    }
                    2 => {
                        // Retarget releases the old row inside the call, so
                        // the shadow lets go of it first (it must never count
                        // more than the fleet does) and counts the booking
                        // again wherever it is afterwards.
                        let before = b.slot();
                        shadow.releasing(before);
                        if b.retarget(rng.below(ROWS as u64) as usize).is_ok() && b.slot() != before {
                            tally.retargeted += 1;
                        }
                        shadow.booked(b.slot());
                    }
                    _ => {}
                }
                held.push(b);
            }
            Err(_) => tally.refused += 1,
        }
        while held.len() > rng.below(HOLD as u64 + 1) as usize {
            let b = held.swap_remove(rng.below(held.len() as u64) as usize);
            shadow.releasing(b.slot());
            drop(b);
            tally.released += 1;
        }
    }
    for b in held.drain(..) {
        shadow.releasing(b.slot());
        tally.released += 1;
    }
    tally
}

/// Adds, removes, cordons and re-weights workers until told to stop.
fn churn(fleet: &F, stop: &AtomicBool) -> u64 {
    let mut rng = Rng::new(99);
    let mut next_id = 1000u64;
    let mut changes = 0;
    while !stop.load(Ordering::Relaxed) || changes < 10 {
        let row = rng.below(ROWS as u64) as usize;
        let slot = fleet.slot_id(row);
        match (rng.below(4), slot) {
            (0, Some(slot)) => fleet.remove(slot).unwrap_or(()),
            (1, Some(slot)) => {
                let state = [WorkerState::Live, WorkerState::Draining, WorkerState::Cordoned][rng.below(3) as usize];
                fleet.set_state(slot, state).unwrap_or(())
            }
            (2, Some(slot)) => fleet.set_capacity_weight(slot, 1.0 + rng.below(4) as f32).unwrap_or(()),
            _ => {
                next_id += 1;
                let _ = fleet.add(WorkerSpec {
                    admission_limit: LIMIT,
                    ..WorkerSpec::new(next_id)
                });
            }
        }
        changes += 1;
        if cfg!(miri) {
            thread::yield_now();
        }
    }
    changes
}

#[test]
fn a_million_selections_against_a_churning_fleet_leak_nothing_and_never_over_admit() {
    let fleet = F::new();
    for id in 0..6 {
        fleet
            .add(WorkerSpec {
                admission_limit: LIMIT,
                ..WorkerSpec::new(id)
            })
            .unwrap();
    }
    let shadow = Shadow {
        held: std::array::from_fn(|_| AtomicU64::new(0)),
        max: AtomicU32::new(0),
    };
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let (a, b, changes) = thread::scope(|s| {
        let a = s.spawn(|| booker(&fleet, &shadow, 1));
        let b = s.spawn(|| booker(&fleet, &shadow, 2));
        let c = s.spawn(|| churn(&fleet, &stop));
        let (a, b) = (a.join(), b.join());
        stop.store(true, Ordering::Relaxed); // even if a booker panicked
        (a.unwrap(), b.unwrap(), c.join().unwrap())
    });
    let elapsed = start.elapsed();
    eprintln!(
        "stress: {a:?}\nstress: {b:?}\nstress: {changes} fleet changes, max shadow in-flight {}, {elapsed:?}",
        shadow.max.load(Ordering::Relaxed)
    );

    assert_eq!(a.selections + b.selections, 2 * u64::from(SELECTIONS));
    assert_eq!(a.booked + b.booked, a.released + b.released, "every guard was dropped");
    assert!(shadow.max.load(Ordering::Relaxed) <= LIMIT, "admission limit passed");
    if !cfg!(miri) {
        assert!(
            a.refused + b.refused > 0 && a.retargeted + b.retargeted > 0,
            "the run exercised refusals and retargets"
        );
        assert_eq!(shadow.max.load(Ordering::Relaxed), LIMIT, "the run reached the limit");
    }
    for row in 0..ROWS {
        assert_eq!(fleet.outstanding(row), Some(Outstanding::default()), "row {row} leaked");
        assert_eq!(
            fleet.is_selectable(row),
            fleet.state(row) == selkie_kernel::SlotState::Live,
            "row {row}"
        );
    }
}
