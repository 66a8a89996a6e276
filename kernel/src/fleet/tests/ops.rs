//! Construction, add, remove, set_state, weight and limit updates.

use super::*;
use crate::lanes::{F32Source, U32Source};
use crate::sync::Ordering;
use std::boxed::Box;

#[test]
fn a_new_fleet_is_empty() {
    let fleet = Fleet::<2>::new();
    assert_eq!(Fleet::<2>::CAPACITY, 16);
    assert_eq!(fleet.rows(), 0);
    assert_eq!(fleet.scan_rows(), 0);
    let mut mask = [u64::MAX; 2];
    fleet.selectable(&mut mask);
    assert_eq!(mask, [0, 0]);
    for row in 0..16 {
        assert_eq!(fleet.state(row), SlotState::Empty);
        assert_eq!(fleet.worker(row), None);
        assert_eq!(fleet.slot_id(row), None);
    }
    assert_all_released(&fleet);
}

#[test]
#[cfg_attr(miri, ignore)] // 900 KiB of zeroing and reads: slow under miri, not concurrent
fn init_zeroed_builds_a_big_fleet_on_the_heap() {
    let mut slot = Box::<Fleet<2048>>::new_uninit();
    // Dirty the memory first, so the test shows `init_zeroed` cleans it.
    // SAFETY: `slot` is valid for writes of one `Fleet<2048>`.
    unsafe {
        slot.as_mut_ptr()
            .cast::<u8>()
            .write_bytes(0xA5, core::mem::size_of::<Fleet<2048>>())
    };
    let fleet = Fleet::init_zeroed(&mut slot);
    assert_eq!(fleet.rows(), 0);
    let last = Fleet::<2048>::CAPACITY - 1;
    assert_eq!(fleet.state(last), SlotState::Empty);
    assert_eq!(fleet.outstanding(last), Some(Outstanding::default()));
    let a = fleet.add(worker(1, 3)).unwrap();
    assert_eq!(a, SlotId { row: 0, generation: 1 });
    let mut mask = [0u64; 256];
    fleet.selectable(&mut mask);
    assert_eq!(mask[0], 1);
    assert!(mask[1..].iter().all(|&w| w == 0));
}

#[test]
#[cfg_attr(miri, ignore)] // 900 KiB of zeroing and reads: slow under miri, not concurrent
fn boxed_is_an_empty_fleet_on_the_heap() {
    let fleet = Fleet::<2048>::boxed();
    assert_eq!((fleet.rows(), fleet.scan_rows()), (0, 0));
    for row in [0, 1, 4095, Fleet::<2048>::CAPACITY - 1] {
        assert_eq!(fleet.state(row), SlotState::Empty);
        assert_eq!(fleet.worker(row), None);
        assert_eq!(fleet.outstanding(row), Some(Outstanding::default()));
    }
    let mut mask = [u64::MAX; 256];
    fleet.selectable(&mut mask);
    assert!(mask.iter().all(|&w| w == 0));
    let a = fleet.add(worker(1, 3)).unwrap();
    assert_eq!(a, SlotId { row: 0, generation: 1 });
    assert_eq!(fleet.rows(), 1);
}

#[test]
fn add_fills_the_lowest_free_row_and_publishes_the_worker() {
    let fleet = Fleet::<1>::new();
    let spec = WorkerSpec {
        worker_id: 0xDEAD_BEEF_0000_0007,
        dp_rank: 3,
        capacity_weight: 4.0,
        admission_limit: 9,
    };
    let a = fleet.add(spec).unwrap();
    let b = fleet.add(WorkerSpec::new(8)).unwrap();
    assert_eq!((a.row, b.row), (0, 1));
    assert_eq!(fleet.rows(), 2);
    assert_eq!(fleet.scan_rows(), 8);
    let info = fleet.worker(0).unwrap();
    assert_eq!(
        info,
        WorkerInfo {
            slot: a,
            state: SlotState::Live,
            worker_id: 0xDEAD_BEEF_0000_0007,
            dp_rank: 3,
            capacity_weight: 4.0,
            admission_limit: 9
        }
    );
    assert_eq!(fleet.worker_id(1), Some(8));
    assert_eq!(fleet.dp_rank(0), Some(3));
    assert_eq!(fleet.slot_id(1), Some(b));
    assert!(fleet.is_selectable(0) && fleet.is_selectable(1) && !fleet.is_selectable(2));
    assert_eq!(F32Source::value(&fleet.inv_capacity_weight(), 0), 0.25);
    assert_eq!(F32Source::value(&fleet.capacity_weight(), 1), 1.0);
    assert_eq!(U32Source::value(&fleet.dp_ranks(), 0), 3);

    fleet.remove(a).unwrap();
    let c = fleet.add(WorkerSpec::new(9)).unwrap();
    assert_eq!(
        c,
        SlotId { row: 0, generation: 2 },
        "row 0 reused with the next generation"
    );
    assert_eq!(fleet.rows(), 2, "the high-water mark does not move");
}

#[test]
fn add_refuses_bad_weights_and_a_full_fleet() {
    let fleet = Fleet::<1>::new();
    // A subnormal weight is positive and finite, but its reciprocal is +inf.
    for weight in [
        0.0,
        -1.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(1),
        2.0e-39,
    ] {
        let spec = WorkerSpec {
            capacity_weight: weight,
            ..WorkerSpec::new(5)
        };
        match fleet.add(spec) {
            Err(FleetError::BadCapacityWeight {
                worker_id: 5,
                weight: w,
            }) => {
                assert!(w.to_bits() == weight.to_bits())
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(fleet.rows(), 0, "a refused add claims nothing");
    for id in 0..8 {
        fleet.add(WorkerSpec::new(id)).unwrap();
    }
    assert_eq!(fleet.add(WorkerSpec::new(8)), Err(FleetError::Full { capacity: 8 }));
}

#[test]
fn remove_checks_the_slot_id() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    assert_eq!(
        fleet.remove(SlotId { row: 8, generation: 1 }),
        Err(FleetError::NoSuchRow { row: 8, capacity: 8 })
    );
    assert_eq!(
        fleet.remove(SlotId { row: 1, generation: 0 }),
        Err(FleetError::Vacant { row: 1, generation: 0 })
    );
    fleet.remove(a).unwrap();
    assert_eq!(fleet.state(0), SlotState::Empty);
    assert!(!fleet.is_selectable(0));
    assert_eq!(fleet.remove(a), Err(FleetError::Vacant { row: 0, generation: 1 }));
    let b = fleet.add(WorkerSpec::new(2)).unwrap();
    assert_eq!(
        fleet.remove(a),
        Err(FleetError::StaleSlot {
            row: 0,
            expected: 1,
            found: 2
        })
    );
    assert_eq!(
        fleet.worker_id(0),
        Some(2),
        "the stale remove left the new occupant alone"
    );
    fleet.remove(b).unwrap();
}

#[test]
fn set_state_moves_between_live_draining_and_cordoned() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    for (state, selectable) in [
        (WorkerState::Draining, false),
        (WorkerState::Draining, false),
        (WorkerState::Live, true),
        (WorkerState::Cordoned, false),
        (WorkerState::Live, true),
    ] {
        fleet.set_state(a, state).unwrap();
        assert_eq!(fleet.state(0), SlotState::from(state));
        assert_eq!(fleet.is_selectable(0), selectable);
        assert_eq!(fleet.slot_id(0), Some(a), "state changes keep the generation");
    }
    fleet.remove(a).unwrap();
    assert_eq!(
        fleet.set_state(a, WorkerState::Live),
        Err(FleetError::Vacant { row: 0, generation: 1 })
    );
    fleet.add(WorkerSpec::new(2)).unwrap();
    assert_eq!(
        fleet.set_state(a, WorkerState::Cordoned),
        Err(FleetError::StaleSlot {
            row: 0,
            expected: 1,
            found: 2
        })
    );
    assert_eq!(fleet.state(0), SlotState::Live);
    assert_eq!(
        fleet.set_state(SlotId { row: 99, generation: 1 }, WorkerState::Live),
        Err(FleetError::NoSuchRow { row: 99, capacity: 8 })
    );
}

#[test]
fn updates_change_weight_and_limit_of_the_right_occupant() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(worker(77, 1)).unwrap();
    fleet.set_capacity_weight(a, 2.0).unwrap();
    assert_eq!(F32Source::value(&fleet.capacity_weight(), 0), 2.0);
    assert_eq!(F32Source::value(&fleet.inv_capacity_weight(), 0), 0.5);
    assert_eq!(
        fleet
            .set_capacity_weight(a, f32::NAN)
            .map_err(|e| matches!(e, FleetError::BadCapacityWeight { worker_id: 77, .. })),
        Err(true)
    );
    assert_eq!(
        F32Source::value(&fleet.capacity_weight(), 0),
        2.0,
        "a refused update changes nothing"
    );
    assert!(
        !fleet.state_word(0, Ordering::Relaxed).writer_held(),
        "the writer bit is released on error"
    );

    let first = fleet.book(0, load(0, 0)).unwrap();
    assert_eq!(
        fleet.book(0, load(0, 0)).unwrap_err(),
        BookError::Overloaded { row: 0, limit: 1 }
    );
    fleet.set_admission_limit(a, 2).unwrap();
    assert_eq!(fleet.worker(0).unwrap().admission_limit, 2);
    let second = fleet.book(0, load(0, 0)).unwrap();
    fleet.set_admission_limit(a, 0).unwrap();
    assert_eq!(fleet.worker(0).unwrap().admission_limit, 0);
    assert_eq!(
        fleet.book(0, load(0, 0)).unwrap_err(),
        BookError::Overloaded { row: 0, limit: 0 }
    );
    assert_eq!(out(&fleet, 0).requests, 2, "lowering the limit cancels nothing");
    fleet.set_admission_limit(a, UNLIMITED).unwrap();
    assert_eq!(fleet.worker(0).unwrap().admission_limit, UNLIMITED);
    // Above the counter's maximum a limit admits as UNLIMITED does.
    fleet.set_admission_limit(a, COUNTER_MAX + 1).unwrap();
    assert_eq!(fleet.worker(0).unwrap().admission_limit, UNLIMITED);
    fleet.set_admission_limit(a, COUNTER_MAX - 1).unwrap();
    assert_eq!(fleet.worker(0).unwrap().admission_limit, COUNTER_MAX - 1);
    drop((first, second));

    fleet.remove(a).unwrap();
    assert_eq!(
        fleet.set_admission_limit(a, 5),
        Err(FleetError::Vacant { row: 0, generation: 1 })
    );
    let b = fleet.add(worker(78, 3)).unwrap();
    assert_eq!(
        fleet.set_capacity_weight(a, 9.0),
        Err(FleetError::StaleSlot {
            row: 0,
            expected: 1,
            found: 2
        })
    );
    assert_eq!(fleet.worker(0).unwrap().capacity_weight, 1.0);
    assert_eq!(fleet.worker(0).unwrap().slot, b);
}
