//! Remote load: folded into the counters, taken back exactly, counted by
//! admission and by the scans, gone with the worker.

use super::*;
use crate::kernels::least_loaded::least_loaded;
use crate::Rng;

#[test]
fn a_remote_load_adds_to_the_counters_and_the_next_setting_replaces_it() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, UNLIMITED)).unwrap();
    let local = fleet.book(0, load(100, 3)).unwrap();
    assert_eq!(fleet.set_remote_load(a, held(2, 50, 7)), Ok(held(2, 50, 7)));
    assert_eq!(out(&fleet, 0), held(3, 150, 10));
    assert_eq!(fleet.remote_load(0), held(2, 50, 7));
    // Down and up again: only the remote part moves.
    assert_eq!(fleet.set_remote_load(a, held(1, 0, 9)), Ok(held(1, 0, 9)));
    assert_eq!(out(&fleet, 0), held(2, 100, 12));
    drop(local);
    assert_eq!(out(&fleet, 0), held(1, 0, 9), "a release takes back its own load only");
    assert_eq!(
        fleet.set_remote_load(a, Outstanding::default()),
        Ok(Outstanding::default())
    );
    assert_all_released(&fleet);
}

#[test]
fn admission_counts_the_remote_requests_and_a_remote_load_is_never_refused() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, 2)).unwrap();
    fleet.set_remote_load(a, held(1, 0, 0)).unwrap();
    let first = fleet.book(0, load(1, 1)).unwrap();
    assert_eq!(
        fleet.book(0, load(1, 1)).unwrap_err(),
        BookError::Overloaded { row: 0, limit: 2 },
        "one local and one remote request fill a limit of 2"
    );
    // The peers booked more than the limit: counted, not refused.
    assert_eq!(fleet.set_remote_load(a, held(5, 0, 0)), Ok(held(5, 0, 0)));
    assert_eq!(out(&fleet, 0).requests, 6);
    drop(first);
    fleet.set_remote_load(a, held(0, 0, 0)).unwrap();
    assert!(fleet.book(0, load(1, 1)).is_ok());
}

#[test]
fn a_saturated_counter_holds_what_was_added_and_gives_back_exactly_that() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, UNLIMITED)).unwrap();
    let local = fleet.book(0, load(COUNTER_MAX - 10, 0)).unwrap();
    assert_eq!(fleet.set_remote_load(a, held(0, 100, 0)), Ok(held(0, 10, 0)));
    assert_eq!(out(&fleet, 0).prefill_tokens, COUNTER_MAX);
    drop(local);
    assert_eq!(out(&fleet, 0).prefill_tokens, 10);
    fleet.set_remote_load(a, Outstanding::default()).unwrap();
    assert_all_released(&fleet);
}

#[test]
fn a_departed_worker_takes_its_remote_load_and_the_next_occupant_starts_clean() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, UNLIMITED)).unwrap();
    fleet.set_remote_load(a, held(4, 40, 4)).unwrap();
    fleet.remove(a).unwrap();
    assert!(matches!(
        fleet.set_remote_load(a, held(1, 1, 1)),
        Err(FleetError::Vacant { row: 0, .. })
    ));
    let b = fleet.add(worker(2, UNLIMITED)).unwrap();
    assert_eq!(b.row, 0);
    assert_eq!(out(&fleet, 0), Outstanding::default());
    assert_eq!(fleet.remote_load(0), Outstanding::default());
    assert!(matches!(
        fleet.set_remote_load(a, held(1, 1, 1)),
        Err(FleetError::StaleSlot { row: 0, .. })
    ));
    assert_eq!(out(&fleet, 0), Outstanding::default(), "a stale slot changes nothing");
    assert_eq!(fleet.remote_load(9), Outstanding::default(), "past the capacity");
}

#[test]
fn the_load_scans_see_local_plus_remote_load() {
    let fleet = Fleet::<2>::new();
    let slots: std::vec::Vec<_> = (0..16).map(|id| fleet.add(worker(id, UNLIMITED)).unwrap()).collect();
    // Row 3 is idle locally but its peers hold 2 requests; every other row
    // holds one local request.
    let _held: std::vec::Vec<_> = (0..16)
        .filter(|&r| r != 3)
        .map(|r| fleet.book(r, load(0, 0)).unwrap())
        .collect();
    fleet.set_remote_load(slots[3], held(2, 0, 0)).unwrap();
    let mask = [u64::MAX >> 48];
    let row = least_loaded(&fleet.active_requests(), &mask, &mut Rng::new(1)).unwrap();
    assert_ne!(row, 3, "the remote requests make row 3 the busiest");
    fleet.set_remote_load(slots[3], Outstanding::default()).unwrap();
    let row = least_loaded(&fleet.active_requests(), &mask, &mut Rng::new(1)).unwrap();
    assert_eq!(row, 3, "without them it is the idlest");
}

#[test]
fn remote_settings_racing_with_bookings_lose_no_update() {
    use std::sync::Arc;
    let fleet: Arc<Fleet<1>> = Fleet::boxed().into();
    let a = fleet.add(worker(1, UNLIMITED)).unwrap();
    let rounds = if cfg!(miri) { 20 } else { 2_000 };
    let booker = {
        let fleet = Arc::clone(&fleet);
        std::thread::spawn(move || {
            for _ in 0..rounds {
                drop(fleet.book(0, load(3, 2)).unwrap());
            }
        })
    };
    for i in 0..rounds {
        fleet.set_remote_load(a, held(i % 5, i % 7, i % 3)).unwrap();
    }
    booker.join().unwrap();
    let last = rounds - 1;
    assert_eq!(out(&fleet, 0), held(last % 5, last % 7, last % 3));
    fleet.set_remote_load(a, Outstanding::default()).unwrap();
    assert_eq!(out(&fleet, 0), Outstanding::default());
}
