//! Booking, the guard, release, generations, retarget, saturation.

use super::*;

#[test]
fn a_booking_counts_its_load_and_releases_it_once_on_drop() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, 2)).unwrap();
    let b1 = fleet.book(0, load(100, 3)).unwrap();
    assert_eq!(b1.slot(), a);
    assert_eq!((b1.row(), b1.prefill_tokens(), b1.decode_blocks()), (0, 100, 3));
    assert_eq!(out(&fleet, 0), held(1, 100, 3));
    let b2 = fleet.book_slot(a, load(0, 1)).unwrap();
    assert_eq!(out(&fleet, 0), held(2, 100, 4));
    assert_eq!(
        fleet.book(0, load(1, 1)).unwrap_err(),
        BookError::Overloaded { row: 0, limit: 2 }
    );
    assert_eq!(
        out(&fleet, 0),
        held(2, 100, 4),
        "a refused booking leaves nothing behind"
    );
    drop(b1);
    assert_eq!(out(&fleet, 0), held(1, 0, 1));
    drop(b2);
    assert_all_released(&fleet);
    assert!(std::format!("{:?}", fleet.book(0, load(1, 2)).unwrap()).contains("prefill_tokens: 1"));
}

/// A booking by slot reports the in-flight requests it was admitted at
/// (its own not counted), whoever booked them, and across a reuse of the
/// row counts only the new occupant's.
#[test]
fn a_slot_booking_reports_the_requests_it_found() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, 4)).unwrap();
    let (first, found) = Booking::new_for_slot_with_active(&fleet, a, load(10, 1)).unwrap();
    assert_eq!(found, 0);
    let second = fleet.book(0, load(0, 1)).unwrap();
    let (third, found) = Booking::new_for_slot_with_active(&fleet, a, load(0, 0)).unwrap();
    assert_eq!(found, 2, "two bookings held before it");
    drop(second);
    let (fourth, found) = Booking::new_for_slot_with_active(&fleet, a, load(0, 0)).unwrap();
    assert_eq!(found, 2, "the first and third");
    let (last, found) = Booking::new_for_slot_with_active(&fleet, a, load(0, 0)).unwrap();
    assert_eq!(found, 3, "the last place");
    assert_eq!(
        Booking::new_for_slot_with_active(&fleet, a, load(0, 0)).map(|(_, found)| found),
        Err(BookError::Overloaded { row: 0, limit: 4 })
    );
    drop((first, third, fourth, last));
    fleet.remove(a).unwrap();
    let b = fleet.add(worker(2, 4)).unwrap();
    let (_held, found) = Booking::new_for_slot_with_active(&fleet, b, load(0, 0)).unwrap();
    assert_eq!(found, 0, "the new occupant's counters start empty");
}

/// `at_admission_limit` answers what the next booking's admission would:
/// at the limit, after it changes, for a row's next occupant, and never for
/// an empty row, a row past the capacity or an unlimited worker.
#[test]
fn at_admission_limit_is_the_admissions_answer() {
    let fleet = Fleet::<1>::new();
    assert!(!fleet.at_admission_limit(0), "an empty row");
    assert!(!fleet.at_admission_limit(8), "past the capacity");
    let a = fleet.add(worker(1, 2)).unwrap();
    let first = fleet.book(0, load(0, 0)).unwrap();
    assert!(!fleet.at_admission_limit(0));
    let second = fleet.book(0, load(0, 0)).unwrap();
    assert!(fleet.at_admission_limit(0));
    assert!(fleet.book(0, load(0, 0)).is_err(), "the admission agrees");
    fleet.set_admission_limit(a, 3).unwrap();
    assert!(!fleet.at_admission_limit(0));
    fleet.set_admission_limit(a, UNLIMITED).unwrap();
    assert!(!fleet.at_admission_limit(0));
    fleet.set_admission_limit(a, COUNTER_MAX + 1).unwrap();
    assert!(!fleet.at_admission_limit(0), "above the counter's maximum");
    drop((first, second));
    fleet.remove(a).unwrap();
    assert!(!fleet.at_admission_limit(0), "a removed worker's row");
    fleet.add(worker(2, 0)).unwrap();
    assert!(fleet.at_admission_limit(0), "a limit of 0 admits nothing");
    assert!(fleet.book(0, load(0, 0)).is_err());
}

#[test]
fn booking_refuses_absent_rows_and_workers_that_are_not_live() {
    let fleet = Fleet::<1>::new();
    assert_eq!(
        fleet.book(8, load(0, 0)).unwrap_err(),
        BookError::NoSuchRow { row: 8, capacity: 8 }
    );
    assert_eq!(
        fleet.book(0, load(0, 0)).unwrap_err(),
        BookError::NotLive {
            row: 0,
            state: SlotState::Empty
        }
    );
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    fleet.set_state(a, WorkerState::Draining).unwrap();
    assert_eq!(
        fleet.book(0, load(0, 0)).unwrap_err(),
        BookError::NotLive {
            row: 0,
            state: SlotState::Draining
        }
    );
    fleet.set_state(a, WorkerState::Cordoned).unwrap();
    assert_eq!(
        fleet.book_slot(a, load(0, 0)).unwrap_err(),
        BookError::NotLive {
            row: 0,
            state: SlotState::Cordoned
        }
    );
    fleet.remove(a).unwrap();
    fleet.add(WorkerSpec::new(2)).unwrap();
    assert_eq!(
        fleet.book_slot(a, load(0, 0)).unwrap_err(),
        BookError::Stale {
            row: 0,
            expected: 1,
            found: 2
        },
        "book_slot pins the occupant"
    );
    assert_all_released(&fleet);
}

#[test]
fn prefill_complete_and_output_blocks_move_the_token_and_block_counters() {
    let fleet = Fleet::<1>::new();
    fleet.add(WorkerSpec::new(1)).unwrap();
    let mut b = fleet.book(0, load(40, 1)).unwrap();
    b.prefill_complete();
    assert_eq!(out(&fleet, 0), held(1, 0, 1));
    b.prefill_complete();
    assert_eq!(out(&fleet, 0), held(1, 0, 1), "prefill_complete is idempotent");
    b.add_output_block().unwrap();
    b.add_output_block().unwrap();
    assert_eq!(b.decode_blocks(), 3);
    assert_eq!(out(&fleet, 0), held(1, 0, 3));
    drop(b);
    assert_all_released(&fleet);
}

#[test]
fn a_guard_that_outlives_its_worker_never_touches_the_next_occupant() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(1, 5)).unwrap();
    let mut old = fleet.book(0, load(10, 2)).unwrap();
    fleet.remove(a).unwrap();
    let b = fleet.add(worker(2, 5)).unwrap();
    assert_eq!(b.row, a.row);
    assert_eq!(out(&fleet, 0), held(0, 0, 0), "the new occupant starts at zero load");
    let new = fleet.book(0, load(7, 1)).unwrap();
    old.prefill_complete();
    assert_eq!(
        old.add_output_block(),
        Err(BookError::Stale {
            row: 0,
            expected: 1,
            found: 2
        })
    );
    drop(old);
    assert_eq!(out(&fleet, 0), held(1, 7, 1), "the stale guard changed nothing");
    drop(new);
    assert_all_released(&fleet);
}

#[test]
fn a_guard_of_a_removed_worker_still_releases_its_counters() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    let b = fleet.book(0, load(3, 3)).unwrap();
    fleet.remove(a).unwrap();
    assert_eq!(
        out(&fleet, 0),
        held(1, 3, 3),
        "counters keep counting the outstanding guard"
    );
    drop(b);
    assert_all_released(&fleet);
}

#[test]
fn retarget_moves_exactly_one_booking() {
    let fleet = Fleet::<1>::new();
    fleet.add(worker(1, 1)).unwrap();
    let c = fleet.add(worker(2, 1)).unwrap();
    fleet.add(worker(3, 1)).unwrap();
    let mut b = fleet.book(0, load(9, 2)).unwrap();
    b.add_output_block().unwrap();
    b.retarget(1).unwrap();
    assert_eq!(b.slot(), c);
    assert_eq!((out(&fleet, 0), out(&fleet, 1)), (held(0, 0, 0), held(1, 9, 3)));
    b.retarget(1).unwrap();
    assert_eq!(out(&fleet, 1), held(1, 9, 3), "retarget to its own row is a no-op");

    let _blocker = fleet.book(2, load(0, 0)).unwrap();
    assert_eq!(b.retarget(2).unwrap_err(), BookError::Overloaded { row: 2, limit: 1 });
    assert_eq!(b.slot(), c, "a refused retarget keeps the booking where it was");
    assert_eq!(
        b.retarget(7).unwrap_err(),
        BookError::NotLive {
            row: 7,
            state: SlotState::Empty
        }
    );
    assert_eq!(out(&fleet, 1), held(1, 9, 3));
    drop(b);
    assert_eq!(out(&fleet, 1), held(0, 0, 0));
}

#[test]
fn retarget_away_from_a_reused_row_leaves_the_new_occupant_alone() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    fleet.add(WorkerSpec::new(2)).unwrap();
    let mut b = fleet.book(0, load(4, 0)).unwrap();
    fleet.remove(a).unwrap();
    fleet.add(WorkerSpec::new(3)).unwrap();
    let other = fleet.book(0, load(1, 0)).unwrap();
    b.retarget(1).unwrap();
    assert_eq!((out(&fleet, 0), out(&fleet, 1)), (held(1, 1, 0), held(1, 4, 0)));
    drop((b, other));
    assert_all_released(&fleet);
}

#[test]
fn counters_saturate_and_guards_release_what_they_added() {
    let fleet = Fleet::<1>::new();
    fleet.add(WorkerSpec::new(1)).unwrap();
    let big = fleet.book(0, load(COUNTER_MAX - 10, COUNTER_MAX)).unwrap();
    let more = fleet.book(0, load(100, 5)).unwrap();
    assert_eq!((more.prefill_tokens(), more.decode_blocks()), (10, 0));
    assert_eq!(out(&fleet, 0), held(2, COUNTER_MAX, COUNTER_MAX));
    drop(big);
    assert_eq!(out(&fleet, 0), held(1, 10, 0));
    drop(more);
    assert_all_released(&fleet);
}

#[test]
fn an_admission_limit_above_the_counter_is_capped_to_it() {
    let fleet = Fleet::<1>::new();
    fleet.add(worker(1, UNLIMITED)).unwrap();
    // Pretend COUNTER_MAX - 1 requests are in flight (generation tag 1).
    fleet.active_requests.at(0).store(
        super::super::counter::pack(COUNTER_MAX - 1, 1),
        crate::sync::Ordering::Relaxed,
    );
    let last = fleet.book(0, load(0, 0)).unwrap();
    assert_eq!(
        fleet.book(0, load(0, 0)).unwrap_err(),
        BookError::Overloaded {
            row: 0,
            limit: COUNTER_MAX
        }
    );
    drop(last);
    assert_eq!(out(&fleet, 0).requests, COUNTER_MAX - 1);
}

#[test]
fn bookings_work_through_any_handle() {
    use std::sync::Arc;
    let fleet = Arc::new(Fleet::<1>::new());
    fleet.add(WorkerSpec::new(1)).unwrap();
    let b: Booking<Arc<Fleet<1>>, 1> = Booking::new(Arc::clone(&fleet), 0, load(1, 1)).unwrap();
    let handle = std::thread::spawn(move || {
        assert_eq!(b.fleet().outstanding(0).unwrap(), held(1, 1, 1));
        drop(b);
    });
    handle.join().unwrap();
    assert_all_released(&fleet);
    let e = Booking::new(Arc::clone(&fleet), 3, load(0, 0)).unwrap_err();
    assert_eq!(
        e,
        BookError::NotLive {
            row: 3,
            state: SlotState::Empty
        }
    );
    let slot = fleet.slot_id(0).unwrap();
    let b = Booking::new_for_slot(Arc::clone(&fleet), slot, load(0, 0)).unwrap();
    assert_eq!(b.slot(), slot);
}

#[test]
fn retarget_slot_refuses_a_row_taken_by_another_worker() {
    let fleet = Fleet::<1>::new();
    fleet.add(worker(1, 1)).unwrap();
    let target = fleet.add(worker(2, 1)).unwrap();
    let mut b = fleet.book(0, load(5, 1)).unwrap();
    let home = b.slot();
    // Worker 2 leaves; worker 3 takes its row before the retarget claims it.
    fleet.remove(target).unwrap();
    let newcomer = fleet.add(worker(3, 1)).unwrap();
    assert_eq!(newcomer.row, target.row);
    assert_eq!(
        b.retarget_slot(target).unwrap_err(),
        BookError::Stale {
            row: target.row,
            expected: target.generation,
            found: newcomer.generation
        }
    );
    assert_eq!(b.slot(), home, "a refused retarget keeps the booking where it was");
    assert_eq!((out(&fleet, 0), out(&fleet, 1)), (held(1, 5, 1), held(0, 0, 0)));
    b.retarget_slot(newcomer).unwrap();
    assert_eq!((out(&fleet, 0), out(&fleet, 1)), (held(0, 0, 0), held(1, 5, 1)));
    b.retarget_slot(newcomer).unwrap();
    assert_eq!(out(&fleet, 1), held(1, 5, 1), "retarget to its own slot is a no-op");
    // Its own slot, emptied meanwhile: refused like any other.
    fleet.remove(newcomer).unwrap();
    assert_eq!(
        b.retarget_slot(newcomer).unwrap_err(),
        BookError::NotLive {
            row: newcomer.row,
            state: SlotState::Empty
        }
    );
    drop(b);
    assert_eq!(out(&fleet, 1), held(0, 0, 0));
}

#[test]
fn a_view_keeps_its_length_while_the_fleet_grows() {
    let fleet = Fleet::<4>::new();
    fleet.add(worker(1, UNLIMITED)).unwrap();
    let view = fleet.view(fleet.scan_rows());
    for id in 2..=20 {
        fleet.add(worker(id, UNLIMITED)).unwrap();
    }
    assert_eq!(fleet.scan_rows(), 24);
    for col in [
        view.active_requests(),
        view.active_prefill_tokens(),
        view.active_decode_blocks(),
        view.capacity_weight(),
        view.inv_capacity_weight(),
        view.dp_ranks(),
    ] {
        assert_eq!(crate::lanes::U32Source::rows(&col), 8);
    }
    assert_eq!(fleet.view(0).rows(), 0);
    assert_eq!(fleet.view(9).rows(), 16);
    assert_eq!(fleet.view(1 << 20).rows(), Fleet::<4>::CAPACITY);
    let _b = fleet.book(3, load(0, 0)).unwrap();
    assert_eq!(crate::lanes::U32Source::value(&fleet.view(24).active_requests(), 3), 1);
}
