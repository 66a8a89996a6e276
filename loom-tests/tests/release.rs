//! Model: two threads each book, grow, complete prefill and release on the
//! same worker at once. When every guard is dropped, every counter must be
//! back to zero.
//!
//! Broken variant: releases read each counter and then store the difference
//! (`Fault::ReleaseLoadThenStore`), losing one of two concurrent releases.
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Booking, Fleet, UNLIMITED};
use selkie_loom_tests::{expect_violation, explore, held, load, worker};

fn two_requests_come_and_go(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    fleet.add(worker(1, UNLIMITED)).unwrap();
    let requests: Vec<_> = (0..2)
        .map(|_| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || {
                let mut b = Booking::new(fleet, 0, load(3, 1)).unwrap();
                b.add_output_block().unwrap();
                b.prefill_complete();
                drop(b);
            })
        })
        .collect();
    for t in requests {
        t.join().unwrap();
    }
    assert_eq!(
        fleet.outstanding(0).unwrap(),
        held(0, 0, 0),
        "counters must return to zero"
    );
}

#[test]
fn counters_return_to_zero_when_all_guards_are_dropped() {
    explore("release", || two_requests_come_and_go(Fault::None));
}

#[test]
fn release_model_catches_a_load_then_store_release() {
    expect_violation("release / ReleaseLoadThenStore", "counters must return to zero", || {
        two_requests_come_and_go(Fault::ReleaseLoadThenStore)
    });
}
