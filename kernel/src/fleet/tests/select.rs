//! select_and_book: rescans, mask clearing, errors.

use super::*;
use crate::kernels::least_loaded::least_loaded;
use crate::Rng;

/// The lowest set row of the mask: a deterministic scan.
fn first(mask: &[u64], _: &mut Rng) -> Option<usize> {
    crate::mask::nth(mask, 64 * mask.len(), 0)
}

#[test]
fn select_books_the_scan_pick() {
    let fleet = Fleet::<1>::new();
    for id in 0..3 {
        fleet.add(worker(id, 2)).unwrap();
    }
    let _pre = fleet.book(0, load(0, 0)).unwrap();
    let mut mask = [0u64];
    fleet.selectable(&mut mask);
    let mut rng = Rng::new(5);
    let scan = |m: &[u64], r: &mut Rng| least_loaded(&fleet.active_requests(), m, r);
    let b = fleet.select_and_book(&mut mask, load(2, 1), &mut rng, scan, 3).unwrap();
    assert_ne!(b.row(), 0, "least-loaded avoids the busy row");
    assert_eq!(mask[0], 0b111, "a successful first attempt leaves the mask alone");
    assert_eq!(out(&fleet, b.row() as u32), held(1, 2, 1));
}

#[test]
fn overloaded_picks_are_cleared_and_rescanned() {
    let fleet = Fleet::<1>::new();
    for id in 0..3 {
        fleet.add(worker(id, 1)).unwrap();
    }
    let _a = fleet.book(0, load(0, 0)).unwrap();
    let _b = fleet.book(1, load(0, 0)).unwrap();
    let mut mask = [0b111u64];
    let mut scans = 0;
    let scan = |m: &[u64], r: &mut Rng| {
        scans += 1;
        first(m, r)
    };
    let c = fleet
        .select_and_book(&mut mask, load(0, 0), &mut Rng::new(1), scan, 5)
        .unwrap();
    assert_eq!((c.row(), scans), (2, 3));
    assert_eq!(mask[0], 0b100, "rows 0 and 1 were cleared from the caller's mask");
}

#[test]
fn select_reports_no_eligible_all_overloaded_and_bad_picks() {
    let fleet = Fleet::<1>::new();
    for id in 0..3 {
        fleet.add(worker(id, 1)).unwrap();
    }
    let mut rng = Rng::new(1);
    let mut empty = [0u64];
    assert_eq!(
        fleet
            .select_and_book(&mut empty, load(0, 0), &mut rng, first, 3)
            .unwrap_err(),
        SelectError::NoEligible
    );

    let _held: std::vec::Vec<_> = (0..3).map(|r| fleet.book(r, load(0, 0)).unwrap()).collect();
    let mut mask = [0b111u64];
    assert_eq!(
        fleet
            .select_and_book(&mut mask, load(0, 0), &mut rng, first, 2)
            .unwrap_err(),
        SelectError::AllOverloaded {
            attempts: 2,
            last: BookError::Overloaded { row: 1, limit: 1 }
        }
    );
    let mut mask = [0b111u64];
    assert_eq!(
        fleet
            .select_and_book(&mut mask, load(0, 0), &mut rng, first, 10)
            .unwrap_err(),
        SelectError::AllOverloaded {
            attempts: 3,
            last: BookError::Overloaded { row: 2, limit: 1 }
        },
        "the scan ran out of rows before the attempts ran out"
    );
    let mut mask = [0b111u64];
    assert_eq!(
        fleet
            .select_and_book(&mut mask, load(0, 0), &mut rng, first, 0)
            .unwrap_err(),
        SelectError::AllOverloaded {
            attempts: 1,
            last: BookError::Overloaded { row: 0, limit: 1 }
        },
        "at least one attempt is made"
    );
    let mut mask = [0b110u64];
    assert_eq!(
        fleet
            .select_and_book(&mut mask, load(0, 0), &mut rng, |_, _| Some(0), 3)
            .unwrap_err(),
        SelectError::BadPick { row: 0 }
    );
    let mut mask = [u64::MAX];
    assert_eq!(
        fleet
            .select_and_book(&mut mask, load(0, 0), &mut rng, |_, _| Some(9), 3)
            .unwrap_err(),
        SelectError::BadPick { row: 9 }
    );
    assert_all_released_but(&fleet, 3);
}

/// Every row but the first `busy` (each holding one request) is released.
fn assert_all_released_but(fleet: &Fleet<1>, busy: u32) {
    for row in 0..8 {
        let expected = if row < busy { held(1, 0, 0) } else { held(0, 0, 0) };
        assert_eq!(out(fleet, row), expected, "row {row}");
    }
}

#[test]
fn rows_that_left_or_were_reused_are_cleared_too() {
    let fleet = Fleet::<1>::new();
    let a = fleet.add(WorkerSpec::new(1)).unwrap();
    let b = fleet.add(WorkerSpec::new(2)).unwrap();
    fleet.add(WorkerSpec::new(3)).unwrap();
    let mut mask = [0u64];
    fleet.selectable(&mut mask);
    fleet.set_state(a, WorkerState::Draining).unwrap();
    fleet.remove(b).unwrap();
    let c = fleet
        .select_and_book(&mut mask, load(0, 0), &mut Rng::new(1), first, 5)
        .unwrap();
    assert_eq!(c.row(), 2);
    assert_eq!(mask[0], 0b100);
}
