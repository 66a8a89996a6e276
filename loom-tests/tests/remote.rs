//! Model of the remote load (what other router replicas booked) folded
//! into a row's counters while local bookings come and go.
//!
//! * Remote setting under churn: the row holds one booking; one thread sets
//!   its remote load while another books and releases. At the end the
//!   counters must equal the booking still alive plus the remote load, and
//!   once that booking is dropped and the remote load set to zero, every
//!   counter is zero.
//!
//! Broken variant: the setting adds with a load and then a store
//! (`Fault::RemoteLoadThenStore`), so a booking or release that lands in
//! between is lost.
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Booking, Fleet, Outstanding, UNLIMITED};
use selkie_loom_tests::{expect_violation, explore, held, load, worker};

fn remote_setting_under_churn(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    let slot = fleet.add(worker(1, UNLIMITED)).unwrap();
    let kept = Booking::new(Arc::clone(&fleet), 0, load(5, 1)).unwrap();
    let setter = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            fleet.set_remote_load(slot, held(2, 20, 2)).unwrap();
        })
    };
    let churn = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || drop(Booking::new(fleet, 0, load(3, 1)).unwrap()))
    };
    setter.join().unwrap();
    churn.join().unwrap();
    assert_eq!(
        fleet.outstanding(0).unwrap(),
        held(3, 25, 3),
        "counters equal the booking alive plus the remote load"
    );
    drop(kept);
    fleet.set_remote_load(slot, Outstanding::default()).unwrap();
    assert_eq!(fleet.outstanding(0).unwrap(), held(0, 0, 0));
}

#[test]
fn remote_load_settings_lose_no_booking_or_release() {
    explore("remote: setting under churn", || {
        remote_setting_under_churn(Fault::None)
    });
}

#[test]
fn remote_model_catches_a_load_then_store_setting() {
    expect_violation(
        "remote: setting under churn / RemoteLoadThenStore",
        "counters equal the booking alive plus the remote load",
        || remote_setting_under_churn(Fault::RemoteLoadThenStore),
    );
}
