//! Models of the fleet's own changes.
//!
//! * Two `add`s at once must claim different rows, and both workers must end
//!   up Live and selectable. Broken variant: the row is claimed with a load
//!   and a store (`Fault::ClaimLoadThenStore`).
//! * Two `set_state`s at once (Live and Draining) must leave the selectable
//!   bit matching whichever state won. Broken variant: the bit is written
//!   once after the change, without re-reading the state
//!   (`Fault::SelectableNoRecheck`).
//! * A weight update of a worker races with its removal and the addition of
//!   a new worker in the same row: the new worker must keep its own weight.
//!   Broken variant: the update checks the generation and writes without
//!   holding the row's writer bit (`Fault::UpdateWithoutWriterBit`).
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Fleet, SlotState, WorkerSpec, WorkerState};
use selkie_loom_tests::{expect_violation, explore};

fn two_adds(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    let adders: Vec<_> = (1..=2)
        .map(|id| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || fleet.add(WorkerSpec::new(id)).unwrap())
        })
        .collect();
    let slots: Vec<_> = adders.into_iter().map(|t| t.join().unwrap()).collect();
    assert_ne!(slots[0].row, slots[1].row, "two adds claimed the same row");
    let mut mask = [0u64];
    fleet.selectable(&mut mask);
    assert_eq!(mask[0], 0b11);
    let mut ids = [fleet.worker_id(0).unwrap(), fleet.worker_id(1).unwrap()];
    ids.sort_unstable();
    assert_eq!(ids, [1, 2]);
}

fn two_state_changes(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    let slot = fleet.add(WorkerSpec::new(1)).unwrap();
    fleet.set_state(slot, WorkerState::Cordoned).unwrap();
    let changers: Vec<_> = [WorkerState::Live, WorkerState::Draining]
        .into_iter()
        .map(|state| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || fleet.set_state(slot, state).unwrap())
        })
        .collect();
    for t in changers {
        t.join().unwrap();
    }
    let live = fleet.state(0) == SlotState::Live;
    assert_eq!(
        fleet.is_selectable(0),
        live,
        "selectable bit disagrees with state {:?}",
        fleet.state(0)
    );
}

fn update_races_replacement(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    let old = fleet.add(WorkerSpec::new(1)).unwrap();
    let updater = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || fleet.set_capacity_weight(old, 4.0).is_ok())
    };
    let replacer = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            fleet.remove(old).unwrap();
            fleet
                .add(WorkerSpec {
                    capacity_weight: 2.0,
                    ..WorkerSpec::new(2)
                })
                .unwrap()
        })
    };
    updater.join().unwrap();
    let new = replacer.join().unwrap();
    let info = fleet.worker(new.row as usize).unwrap();
    assert_eq!(
        (info.worker_id, info.capacity_weight),
        (2, 2.0),
        "the old worker's update leaked into the new one"
    );
}

#[test]
fn concurrent_adds_claim_distinct_rows() {
    explore("add+add", || two_adds(Fault::None));
}

#[test]
fn add_model_catches_a_load_then_store_claim() {
    expect_violation("add+add / ClaimLoadThenStore", "two adds claimed the same row", || {
        two_adds(Fault::ClaimLoadThenStore)
    });
}

#[test]
fn the_selectable_bit_follows_racing_state_changes() {
    explore("set_state+set_state", || two_state_changes(Fault::None));
}

#[test]
fn state_model_catches_a_selectable_bit_without_recheck() {
    expect_violation(
        "set_state+set_state / SelectableNoRecheck",
        "selectable bit disagrees with state",
        || two_state_changes(Fault::SelectableNoRecheck),
    );
}

#[test]
fn an_update_never_lands_on_the_next_occupant() {
    explore("update+replace", || update_races_replacement(Fault::None));
}

#[test]
fn update_model_catches_an_update_without_writer_bit() {
    expect_violation(
        "update+replace / UpdateWithoutWriterBit",
        "the old worker's update leaked into the new one",
        || update_races_replacement(Fault::UpdateWithoutWriterBit),
    );
}
