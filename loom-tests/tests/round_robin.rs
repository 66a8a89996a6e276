//! Model: two selections take round-robin tickets at once while a preview
//! peeks at the cursor. With two eligible workers, the two selections must
//! get different workers.
//!
//! Broken variants: tickets taken with a load and a store
//! (`Fault::TicketLoadThenStore`: two selections share a ticket), and a peek
//! that advances the cursor (`Fault::PeekAdvances`: the selections get
//! tickets 0 and 2, the same worker).
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::fleet::{fault::Fault, Fleet, WorkerSpec};
use selkie_kernel::kernels::index::round_robin;
use selkie_loom_tests::{expect_violation, explore};

fn two_selections_and_a_preview(fault: Fault) {
    let fleet = Arc::new(Fleet::<1>::with_fault(fault));
    fleet.add(WorkerSpec::new(1)).unwrap();
    fleet.add(WorkerSpec::new(2)).unwrap();
    let mut mask = [0u64];
    fleet.selectable(&mut mask);
    let selections: Vec<_> = (0..2)
        .map(|_| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || round_robin(fleet.scan_rows(), &mask, u64::from(fleet.next_ticket())).unwrap())
        })
        .collect();
    let preview = {
        let fleet = Arc::clone(&fleet);
        thread::spawn(move || round_robin(fleet.scan_rows(), &mask, u64::from(fleet.peek_ticket())).unwrap())
    };
    let rows: Vec<usize> = selections.into_iter().map(|t| t.join().unwrap()).collect();
    let previewed = preview.join().unwrap();
    assert!(previewed < 2);
    assert_ne!(rows[0], rows[1], "two concurrent selections got the same worker");
    assert_eq!(fleet.peek_ticket(), 2, "only the selections advanced the cursor");
}

#[test]
fn round_robin_hands_out_distinct_workers() {
    explore("round-robin", || two_selections_and_a_preview(Fault::None));
}

#[test]
fn round_robin_model_catches_a_load_then_store_ticket() {
    expect_violation(
        "round-robin / TicketLoadThenStore",
        "two concurrent selections got the same worker",
        || two_selections_and_a_preview(Fault::TicketLoadThenStore),
    );
}

#[test]
fn round_robin_model_catches_a_peek_that_advances() {
    expect_violation(
        "round-robin / PeekAdvances",
        "only the selections advanced the cursor",
        || two_selections_and_a_preview(Fault::PeekAdvances),
    );
}
