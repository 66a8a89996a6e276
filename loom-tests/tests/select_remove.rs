//! Model: a select-and-book (least-loaded scan over the live columns) races
//! with the removal of one of the two workers and the addition of a new one
//! in its row. Worker 2 already carries one request, so the scan prefers row
//! 0, the one being replaced. The selection must succeed (worker 2 keeps a
//! free place), and the new occupant's counters must count exactly the
//! bookings made on it.
//!
//! Broken variant: the booking increments without checking the generation
//! tag (`Fault::BookIgnoresTag`): a booking that read the old occupant lands
//! on the new one, and its undo (tag-checked) cannot take it back.
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Booking, Fleet};
use selkie_kernel::kernels::least_loaded::least_loaded;
use selkie_kernel::Rng;
use selkie_loom_tests::{expect_violation, explore, held, load, worker};

fn select_races_remove(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    let first = fleet.add(worker(1, 1)).unwrap();
    fleet.add(worker(2, 2)).unwrap();
    let earlier = Booking::new(Arc::clone(&fleet), 1, load(0, 0)).unwrap();
    let selector = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            let mut mask = [0u64];
            fleet.selectable(&mut mask);
            let view = Arc::clone(&fleet);
            let scan = move |m: &[u64], r: &mut Rng| least_loaded(&view.active_requests(), m, r);
            Booking::select(fleet, &mut mask, load(1, 0), &mut Rng::new(0), scan, 2)
        })
    };
    let replacer = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            fleet.remove(first).unwrap();
            fleet.add(worker(3, 1)).unwrap()
        })
    };
    let booking = selector.join().unwrap().expect("worker 2 stays live and free");
    let third = replacer.join().unwrap();
    let on_third = u32::from(booking.slot() == third);
    let on_second = u32::from(booking.row() == 1);
    assert_eq!(
        fleet.outstanding(0).unwrap(),
        held(on_third, on_third, 0),
        "row 0 counts only bookings of worker 3"
    );
    assert_eq!(fleet.outstanding(1).unwrap(), held(1 + on_second, on_second, 0));
    drop((booking, earlier));
    assert_eq!(fleet.outstanding(0).unwrap(), held(0, 0, 0));
    assert_eq!(fleet.outstanding(1).unwrap(), held(0, 0, 0));
}

#[test]
fn select_and_book_survives_a_concurrent_remove() {
    explore("select+remove", || select_races_remove(Fault::None));
}

#[test]
fn select_remove_model_catches_a_booking_without_tag_check() {
    expect_violation(
        "select+remove / BookIgnoresTag",
        "row 0 counts only bookings of worker 3",
        || select_races_remove(Fault::BookIgnoresTag),
    );
}
