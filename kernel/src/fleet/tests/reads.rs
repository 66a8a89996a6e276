//! Views, the selectable mask, tickets, state-word encoding, error text.

use super::*;
use crate::lanes::{F32Source, U32Source};
use crate::sync::Ordering;

#[test]
fn views_decode_tagged_counters() {
    let fleet = Fleet::<2>::new();
    for id in 0..9 {
        fleet.add(WorkerSpec::new(id)).unwrap();
    }
    let _b = fleet.book(8, load(5, 2)).unwrap();
    let _c = fleet.book(8, load(1, 0)).unwrap();
    let active = fleet.active_requests();
    assert_eq!(U32Source::rows(&active), 16, "9 rows padded to 2 groups");
    assert_eq!(U32Source::value(&active, 8), 2);
    assert_eq!(U32Source::group(&active, 1), [2, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(U32Source::value(&fleet.active_prefill_tokens(), 8), 6);
    assert_eq!(U32Source::value(&fleet.active_decode_blocks(), 8), 2);
    assert_eq!(F32Source::group(&fleet.inv_capacity_weight(), 1)[..2], [1.0, 0.0]);
    // The raw word carries the generation tag (1) in its low byte.
    assert_eq!(fleet.active_requests.at(8).load(Ordering::Relaxed), 2 << 8 | 1);
}

#[test]
fn selectable_copies_32_row_words_into_u64_masks() {
    let fleet = Fleet::<16>::new(); // 128 rows: 4 used words
    let mut ids = std::vec::Vec::new();
    for id in 0..128 {
        ids.push(fleet.add(WorkerSpec::new(id)).unwrap());
    }
    for &row in &[0usize, 31, 32, 63, 64, 100, 127] {
        fleet.remove(ids[row]).unwrap();
    }
    fleet.set_state(ids[5], WorkerState::Draining).unwrap();
    let mut mask = [u64::MAX; 3];
    fleet.selectable(&mut mask);
    for row in 0..128 {
        let expected = ![0usize, 5, 31, 32, 63, 64, 100, 127].contains(&row);
        assert_eq!(crate::mask::contains(&mask, row), expected, "row {row}");
    }
    assert_eq!(mask[2], 0, "words past the fleet are zeroed");
    assert_eq!(fleet.add(WorkerSpec::new(500)).unwrap().row, 0, "lowest free row first");
    assert_eq!(fleet.add(WorkerSpec::new(501)).unwrap().row, 31);
}

#[test]
fn tickets_are_consecutive_and_peek_does_not_advance() {
    let fleet = Fleet::<1>::new();
    assert_eq!(fleet.peek_ticket(), 0);
    assert_eq!(fleet.peek_ticket(), 0);
    assert_eq!(fleet.next_ticket(), 0);
    assert_eq!(fleet.next_ticket(), 1);
    assert_eq!(fleet.peek_ticket(), 2);
    fleet.ticket.store(u32::MAX, Ordering::Relaxed);
    assert_eq!(fleet.next_ticket(), u32::MAX);
    assert_eq!(fleet.next_ticket(), 0, "the ticket wraps");
}

#[test]
fn state_words_encode_state_writer_and_a_wrapping_generation() {
    use super::super::state::{StateWord, GENERATION_MASK};
    for state in [
        SlotState::Empty,
        SlotState::Live,
        SlotState::Draining,
        SlotState::Cordoned,
    ] {
        let w = StateWord::new(state, 12345);
        assert_eq!((w.state(), w.generation(), w.writer_held()), (state, 12345, false));
        let locked = StateWord(w.0 | super::super::state::WRITER);
        assert_eq!(locked.with_state(SlotState::Live).generation(), 12345);
        assert!(locked.with_state(SlotState::Live).writer_held());
    }
    assert_eq!(StateWord::new(SlotState::Live, GENERATION_MASK + 1).generation(), 0);
    assert_eq!(
        StateWord(0).state(),
        SlotState::Empty,
        "all-zero is Empty, generation 0"
    );
}

#[test]
fn errors_name_the_row_worker_and_limit() {
    use std::string::ToString;
    assert_eq!(
        FleetError::Full { capacity: 8 }.to_string(),
        "all 8 worker slots are occupied"
    );
    assert!(FleetError::BadCapacityWeight {
        worker_id: 3,
        weight: -1.0
    }
    .to_string()
    .contains("worker 3"));
    assert!(FleetError::StaleSlot {
        row: 2,
        expected: 1,
        found: 4
    }
    .to_string()
    .contains("row 2 holds generation 4"));
    assert!(FleetError::Vacant { row: 2, generation: 1 }
        .to_string()
        .contains("row 2 is empty"));
    assert!(FleetError::NoSuchRow { row: 9, capacity: 8 }
        .to_string()
        .contains("row 9"));
    assert_eq!(
        BookError::Overloaded { row: 4, limit: 2 }.to_string(),
        "row 4 already has 2 requests in flight"
    );
    assert!(BookError::NotLive {
        row: 1,
        state: SlotState::Draining
    }
    .to_string()
    .contains("Draining"));
    assert!(BookError::Stale {
        row: 1,
        expected: 1,
        found: 2
    }
    .to_string()
    .contains("generation 1 to 2"));
    assert!(BookError::NoSuchRow { row: 9, capacity: 8 }
        .to_string()
        .contains("row 9"));
    let all = SelectError::AllOverloaded {
        attempts: 3,
        last: BookError::Overloaded { row: 4, limit: 2 },
    };
    assert!(all.to_string().contains("after 3 attempts"));
    assert_eq!(SelectError::NoEligible.to_string(), "no eligible worker");
    assert!(SelectError::BadPick { row: 7 }.to_string().contains("row 7"));
}
