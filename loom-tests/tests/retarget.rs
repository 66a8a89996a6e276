//! Model: a booking is retargeted from row 0 to row 1 while an observer sums
//! the two rows' requests and a contender books row 1's only place. The
//! request must be counted on at least one row at every instant, and on
//! exactly one afterwards; the contender and the retarget cannot both get
//! row 1.
//!
//! Broken variant: retarget releases the old row before booking the new one
//! (`Fault::RetargetReleasesFirst`); the observer can then count zero.
//!
//! Second model: `retarget_slot` onto a worker that is replaced meanwhile
//! (removed, and its row taken by a newcomer). The request may land on the
//! named worker (and then go with it) or stay where it was, but never on
//! the newcomer. Broken variant: retargeting by row alone, without the
//! generation (`retarget`), books the newcomer.
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, BookError, Booking, Fleet};
use selkie_loom_tests::{expect_violation, explore, load, worker};

fn retarget_under_observation(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    fleet.add(worker(1, 1)).unwrap();
    fleet.add(worker(2, 1)).unwrap();
    let mut moving = Booking::new(Arc::clone(&fleet), 0, load(5, 1)).unwrap();
    let mover = thread::spawn(move || {
        let result = moving.retarget(1);
        (moving, result)
    });
    let observer = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            let r0 = fleet.outstanding(0).unwrap().requests;
            let r1 = fleet.outstanding(1).unwrap().requests;
            assert!(r0 + r1 >= 1, "the moving request was counted nowhere");
        })
    };
    let contender = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || Booking::new(fleet, 1, load(0, 0)))
    };
    let (moving, result) = mover.join().unwrap();
    observer.join().unwrap();
    let contender = contender.join().unwrap();
    match (&result, &contender) {
        (Ok(()), Err(BookError::Overloaded { row: 1, .. })) => assert_eq!(moving.row(), 1),
        (Err(BookError::Overloaded { row: 1, .. }), Ok(_)) => assert_eq!(moving.row(), 0),
        other => panic!("row 1 has one place: {other:?}"),
    }
    let (r0, r1) = (fleet.outstanding(0).unwrap(), fleet.outstanding(1).unwrap());
    let guards = 1 + u32::from(contender.is_ok());
    assert_eq!(
        r0.requests + r1.requests,
        guards,
        "exactly the outstanding guards are counted"
    );
    assert_eq!(
        fleet.outstanding(moving.row()).unwrap().prefill_tokens,
        5,
        "the load moved with the booking"
    );
    drop((moving, contender));
    assert_eq!(
        fleet.outstanding(0).unwrap().requests + fleet.outstanding(1).unwrap().requests,
        0
    );
}

#[test]
fn retarget_moves_exactly_one_booking() {
    explore("retarget", || retarget_under_observation(Fault::None));
}

#[test]
fn retarget_model_catches_release_before_book() {
    expect_violation(
        "retarget / RetargetReleasesFirst",
        "the moving request was counted nowhere",
        || retarget_under_observation(Fault::RetargetReleasesFirst),
    );
}

fn retarget_racing_replacement(by_slot: bool) {
    let fleet = Arc::new(Fleet::<1>::new());
    fleet.add(worker(1, 4)).unwrap();
    let target = fleet.add(worker(2, 4)).unwrap();
    let mut moving = Booking::new(Arc::clone(&fleet), 0, load(5, 1)).unwrap();
    let churn = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            fleet.remove(target).unwrap();
            fleet.add(worker(3, 4)).unwrap()
        })
    };
    let mover = thread::spawn(move || {
        let result = if by_slot {
            moving.retarget_slot(target)
        } else {
            moving.retarget(target.row as usize)
        };
        (moving, result)
    });
    let newcomer = churn.join().unwrap();
    let (moving, result) = mover.join().unwrap();
    assert_eq!(newcomer.row, target.row, "the newcomer takes the freed row");
    assert_eq!(
        fleet.outstanding(newcomer.row as usize).unwrap().requests,
        0,
        "the request was booked on the worker that took the target's row"
    );
    match result {
        Ok(()) => assert_eq!(moving.slot(), target),
        Err(_) => assert_eq!(moving.row(), 0, "a refused retarget stays put"),
    }
    drop(moving);
    assert_eq!(fleet.outstanding(0).unwrap().requests, 0);
    assert_eq!(fleet.outstanding(1).unwrap().requests, 0);
}

#[test]
fn retarget_slot_never_books_a_newcomer() {
    explore("retarget_slot", || retarget_racing_replacement(true));
}

#[test]
fn retarget_slot_model_catches_retarget_by_row() {
    expect_violation(
        "retarget_slot / retarget by row",
        "the request was booked on the worker that took the target's row",
        || retarget_racing_replacement(false),
    );
}
