//! Model: a guard is dropped while another thread removes its worker, adds a
//! new one (which reuses the row with the next generation) and books it. The
//! old guard's release must leave the new occupant's counters untouched.
//!
//! Broken variant: release checks neither the generation nor the counter
//! tags (`Fault::ReleaseIgnoresGeneration`).
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Booking, Fleet, SlotId, UNLIMITED};
use selkie_loom_tests::{expect_violation, explore, held, load, worker};

fn release_races_reuse(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    let first = fleet.add(worker(1, UNLIMITED)).unwrap();
    let old = Booking::new(Arc::clone(&fleet), 0, load(4, 1)).unwrap();
    let releaser = thread::spawn(move || drop(old));
    let reuser = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || {
            fleet.remove(first).unwrap();
            let second = fleet.add(worker(2, UNLIMITED)).unwrap();
            assert_eq!(second, SlotId { row: 0, generation: 2 });
            Booking::new(fleet, 0, load(2, 0)).unwrap()
        })
    };
    releaser.join().unwrap();
    let new = reuser.join().unwrap();
    assert_eq!(
        fleet.outstanding(0).unwrap(),
        held(1, 2, 0),
        "the new occupant holds exactly its own booking"
    );
    drop(new);
    assert_eq!(fleet.outstanding(0).unwrap(), held(0, 0, 0));
}

#[test]
fn release_after_slot_reuse_leaves_the_new_occupant_untouched() {
    explore("reuse", || release_races_reuse(Fault::None));
}

#[test]
fn reuse_model_catches_a_release_without_generation_check() {
    expect_violation(
        "reuse / ReleaseIgnoresGeneration",
        "the new occupant holds exactly its own booking",
        || release_races_reuse(Fault::ReleaseIgnoresGeneration),
    );
}
