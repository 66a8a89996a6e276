//! Models of booking against an admission limit.
//!
//! * Last place: two threads book the one free place of a worker (limit 1)
//!   at once; exactly one must get it.
//! * Limit under churn: a worker with limit 2 already holds one request; two
//!   threads book it at once while a third releases that request. Every
//!   booker that succeeds must see at most 2 requests in flight, and the
//!   counters must equal the guards alive.
//!
//! Broken variant of both: the booking reads the counter and then stores
//! `+1` (`Fault::BookLoadThenStore`), so two bookers can both take the last
//! place, and a release racing with a booker can be lost.
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Booking, Fleet};
use selkie_loom_tests::{expect_violation, explore, held, load, worker};

const LIMIT: u32 = 2;

fn two_bookers_one_place(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    fleet.add(worker(1, 1)).unwrap();
    let bookers: Vec<_> = (0..2)
        .map(|_| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || Booking::new(fleet, 0, load(2, 1)).ok())
        })
        .collect();
    let alive: Vec<_> = bookers.into_iter().filter_map(|t| t.join().unwrap()).collect();
    assert_eq!(
        alive.len(),
        1,
        "admission limit 1, but {} bookings succeeded",
        alive.len()
    );
    assert_eq!(fleet.outstanding(0).unwrap(), held(1, 2, 1));
}

fn bookers_against_a_limit(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    fleet.add(worker(1, LIMIT)).unwrap();
    let earlier = Booking::new(Arc::clone(&fleet), 0, load(2, 1)).unwrap();
    let releaser = thread::spawn(move || drop(earlier));
    let bookers: Vec<_> = (0..2)
        .map(|_| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || {
                let booking = Booking::new(Arc::clone(&fleet), 0, load(2, 1)).ok();
                if booking.is_some() {
                    let in_flight = fleet.outstanding(0).unwrap().requests;
                    assert!(
                        in_flight <= LIMIT,
                        "admission limit {LIMIT} passed: {in_flight} in flight"
                    );
                }
                booking
            })
        })
        .collect();
    releaser.join().unwrap();
    let alive: Vec<_> = bookers.into_iter().filter_map(|t| t.join().unwrap()).collect();
    let n = alive.len() as u32;
    assert!(n >= 1, "one place was free throughout");
    assert_eq!(
        fleet.outstanding(0).unwrap(),
        held(n, 2 * n, n),
        "counters equal the guards alive"
    );
    drop(alive);
    assert_eq!(fleet.outstanding(0).unwrap(), held(0, 0, 0));
}

#[test]
fn the_last_place_goes_to_exactly_one_booker() {
    explore("admission: last place", || two_bookers_one_place(Fault::None));
}

#[test]
fn last_place_model_catches_a_load_then_store_booking() {
    expect_violation(
        "admission: last place / BookLoadThenStore",
        "admission limit 1, but 2 bookings succeeded",
        || two_bookers_one_place(Fault::BookLoadThenStore),
    );
}

#[test]
fn admission_limit_is_never_passed() {
    explore("admission: limit under churn", || bookers_against_a_limit(Fault::None));
}

#[test]
fn admission_model_catches_a_load_then_store_booking() {
    expect_violation(
        "admission: limit under churn / BookLoadThenStore",
        "counters equal the guards alive",
        || bookers_against_a_limit(Fault::BookLoadThenStore),
    );
}
