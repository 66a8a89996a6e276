//! Model: a worker is taken out of rotation (its row cordoned, then its
//! counters read to decide whether the row can be freed) while a booking
//! races for the row. If the retirer finds no load and frees the row, the
//! booking must have been refused: a booking that succeeds is always seen.
//!
//! The retirer reads the counters with `Fleet::is_drained` (read-modify-
//! writes: a plain load could miss a booking whose own state re-check
//! missed the cordon, the store-buffering pattern).
//!
//! Broken variants: the retirer reads the counters before it cordons the
//! row (a booking can then slip in between and be forgotten), or reads them
//! with plain loads (`Fleet::outstanding`) after cordoning.
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{Booking, Fleet, WorkerState};
use selkie_loom_tests::{expect_violation, explore, load, worker};

fn retire_racing_a_booking(cordon_first: bool, rmw_read: bool) {
    let fleet = Arc::new(Fleet::<1>::new());
    let slot = fleet.add(worker(1, 4)).unwrap();
    let booker = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || Booking::new(fleet, 0, load(0, 0)))
    };
    let drained = |fleet: &Fleet<1>| {
        if rmw_read {
            fleet.is_drained(0)
        } else {
            fleet.outstanding(0).unwrap().requests == 0
        }
    };
    let freed = if cordon_first {
        fleet.set_state(slot, WorkerState::Cordoned).unwrap();
        drained(&fleet)
    } else {
        let d = drained(&fleet);
        fleet.set_state(slot, WorkerState::Cordoned).unwrap();
        d
    };
    let booking = booker.join().unwrap();
    if freed {
        assert!(booking.is_err(), "the row was freed while a booking held it");
    }
    drop(booking);
    assert_eq!(fleet.outstanding(0).unwrap().requests, 0);
}

#[test]
fn retiring_a_row_sees_every_booking_on_it() {
    explore("retire", || retire_racing_a_booking(true, true));
}

#[test]
fn retire_model_catches_reading_before_cordoning() {
    expect_violation(
        "retire / read before cordon",
        "the row was freed while a booking held it",
        || retire_racing_a_booking(false, true),
    );
}

#[test]
fn retire_model_catches_a_plain_load_of_the_counters() {
    expect_violation(
        "retire / plain load",
        "the row was freed while a booking held it",
        || retire_racing_a_booking(true, false),
    );
}
