//! The keyed-overlap scatter against its reference: on every backend, and
//! the gathered path itself on the portable backend too (its lane-by-lane
//! gather), over entries inside and outside the dense table, duplicate
//! rows, rows past the columns, values at and above `2^31`, and lower tiers.

use crate::kernels::keyed::*;
use crate::simd::{Backend, Portable};
use crate::worker::{WorkerOverlap, WorkerWithDpRank};
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

/// The entries are the kernel's own [`WorkerOverlap`] (the host's
/// worker-keyed overlap: the id and rank first, with padding after the
/// rank, then the tiers), so these tests, and Miri's run of them, cover its
/// `KeyedOverlap` implementation.
type Entry = WorkerOverlap;

/// An entry of worker `id`'s rank `rank`.
fn entry(id: u64, rank: u32, device: u32, host: u32, disk: u32, shared: u32, tokens: u32) -> Entry {
    WorkerOverlap {
        worker: WorkerWithDpRank::new(id, rank),
        device_blocks: device,
        host_blocks: host,
        disk_blocks: disk,
        shared_blocks: shared,
        cached_tokens: tokens,
    }
}

/// A case: the dense table (`ranks` per worker), the rows the probe knows,
/// the columns' length, and the entries.
#[derive(Clone, Debug)]
struct Case {
    table: Vec<u32>,
    ranks: u32,
    probed: Vec<((u64, u32), u32)>,
    columns: usize,
    entries: Vec<Entry>,
}

/// A block or token count: small, or (with weight `big`) at or above `2^31`.
fn value(big: u32) -> impl Strategy<Value = u32> {
    prop_oneof![40 => 0u32..200, 4 => Just(0), big => (1u32 << 31)..=u32::MAX, big => Just(u32::MAX), big => any::<u32>()]
}

/// Cases of two kinds: mostly clean ones (almost every entry inside the
/// table, on a row inside the columns, with small values: the groups the
/// gathers take whole, with now and then one that must go one by one),
/// and rough ones (entries far outside the table, rows past the columns,
/// huge values).
fn case() -> impl Strategy<Value = Case> {
    (any::<bool>(), 1u32..=4, 1usize..=20, 1usize..=40, 0usize..=60).prop_flat_map(|(rough, ranks, workers, columns, n)| {
        let (odd, big) = if rough { (10, 10) } else { (1, 1) };
        // Rows past the columns, and EMPTY, are both "no row".
        let row = prop_oneof![60 => 0..columns as u32, odd => columns as u32..columns as u32 + 3, odd => Just(DenseRows::EMPTY)];
        let table = prop::collection::vec(row.clone(), workers * ranks as usize);
        let key = prop_oneof![
            // Mostly inside the table (rank 0 most of all) ...
            60 => (0..workers as u64, prop_oneof![3 => Just(0u32), 1 => 0..ranks]),
            // ... sometimes just past it ...
            odd => (0..workers as u64 + 2, 0..ranks + 2),
            // ... or far outside it.
            odd => (prop_oneof![Just(u64::MAX), Just(1u64 << 32), any::<u64>()], any::<u32>()),
        ];
        let tier = prop_oneof![40 => Just(0u32), 10 => value(big)];
        let entry = (key, value(big), tier.clone(), tier.clone(), tier, value(big)).prop_map(
            |((id, rank), device, host, disk, shared, tokens)| entry(id, rank, device, host, disk, shared, tokens),
        );
        let probed = prop::collection::vec(((0..workers as u64 + 2, 0..ranks + 2), row), 0..8);
        (table, probed, prop::collection::vec(entry, n)).prop_map(move |(table, probed, entries)| Case {
            table,
            ranks,
            probed,
            columns,
            entries,
        })
    })
}

/// A probe the tests pass to the kernel.
type Probe<'a> = dyn FnMut(u64, u32) -> u32 + 'a;
/// The device and cached columns (as bits), the result, and the probe's
/// calls.
type Ran = (Vec<u32>, Vec<u32>, Scattered, Vec<(u64, u32)>);

/// Runs `scatter` on fresh columns (filled with a marker, so untouched rows
/// show); returns the columns, the result and the probe's calls.
fn run(
    case: &Case,
    scatter: impl FnOnce(&[Entry], DenseRows<'_>, &mut Probe<'_>, &mut [f32], &mut [f32]) -> Scattered,
) -> Ran {
    let dense = DenseRows::new(&case.table, case.ranks).expect("a small table");
    let (mut device, mut cached) = (vec![-1.0f32; case.columns], vec![-2.0f32; case.columns]);
    let mut calls = Vec::new();
    let mut probe = |id: u64, rank: u32| {
        calls.push((id, rank));
        case.probed
            .iter()
            .find(|(k, _)| *k == (id, rank))
            .map_or(DenseRows::EMPTY, |&(_, row)| row)
    };
    let out = scatter(&case.entries, dense, &mut probe, &mut device, &mut cached);
    let bits = |c: Vec<f32>| c.into_iter().map(f32::to_bits).collect();
    (bits(device), bits(cached), out, calls)
}

proptest! {
    #[test]
    fn scatter_keyed_matches_reference(case in case()) {
        let expected = run(&case, |e, d, p, a, b| scatter_keyed_reference(e, d, p, a, b));
        for backend in Backend::available() {
            let got = run(&case, |e, d, p, a, b| scatter_keyed_on(backend, e, d, p, a, b));
            prop_assert_eq!(&got, &expected, "{:?}", backend);
        }
        // The gathered path on the portable backend's lane-by-lane gather
        // (the dispatcher runs the reference there).
        let got = run(&case, |e, d, p, a, b| super::super::keyed::scatter_gathered(Portable, e, d, p, a, b));
        prop_assert_eq!(&got, &expected);
    }
}

proptest! {
    #[test]
    fn clear_column_matches_reference(values in proptest::collection::vec(any::<f32>(), 0..300)) {
        let mut expected = values.clone();
        clear_column_reference(&mut expected);
        let bits = |c: &[f32]| c.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        for backend in Backend::available() {
            let mut got = values.clone();
            clear_column_on(backend, &mut got);
            prop_assert_eq!(bits(&got), bits(&expected), "{:?}", backend);
        }
    }
}

/// A hand-worked case: two full groups of eight entries gathered whole (one
/// with a duplicate row, last wins), one group done one by one (an entry
/// outside the table), and a tail.
#[test]
fn scatter_keyed_by_hand() {
    // Worker w (rank 0) on row 23 - w; rank 1 not kept.
    let table: Vec<u32> = (0..24u32).flat_map(|w| [23 - w, DenseRows::EMPTY]).collect();
    let entry = |id: u64, rank: u32, device: u32| entry(id, rank, device, 0, u32::from(id == 3), 0, device * 16);
    let mut entries: Vec<Entry> = (0..16).map(|w| entry(w, 0, w as u32 + 100)).collect();
    entries[9] = entry(0, 0, 7); // row 23 again: the later entry wins
    entries.extend((16..24).map(|w| entry(w, 0, 1)));
    entries[20] = entry(500, 2, 9); // outside the table: probed
    entries.push(entry(19, 1, 3)); // tail: covered, EMPTY
    let case = Case {
        table,
        ranks: 2,
        probed: vec![((500, 2), 25)],
        columns: 26,
        entries,
    };
    let backends = Backend::available().map(Some).chain([None]);
    for backend in backends {
        let (device, cached, out, calls) = match backend {
            Some(backend) => run(&case, |e, d, p, a, b| scatter_keyed_on(backend, e, d, p, a, b)),
            // The gathered path on the portable backend (also under Miri).
            None => run(&case, |e, d, p, a, b| {
                super::super::keyed::scatter_gathered(Portable, e, d, p, a, b)
            }),
        };
        let device: Vec<f32> = device.into_iter().map(f32::from_bits).collect();
        let cached: Vec<f32> = cached.into_iter().map(f32::from_bits).collect();
        assert_eq!(device[23], 7.0, "{backend:?}");
        assert_eq!(cached[23], 112.0, "{backend:?}");
        assert_eq!(device[23 - 3], 103.0, "{backend:?}");
        assert_eq!(device[23 - 16], 1.0, "{backend:?}");
        assert_eq!(device[25], 9.0, "{backend:?}: the probed row");
        assert_eq!(calls, vec![(500, 2)], "{backend:?}");
        assert_eq!(out.written, 24, "{backend:?}");
        assert_eq!(out.lower_tiers, 1, "{backend:?}");
    }
}

#[test]
fn dense_rows_refuse_zero_ranks_and_huge_tables() {
    assert!(DenseRows::new(&[1, 2], 0).is_none());
    assert_eq!(DenseRows::new(&[1, 2, 3], 2).and_then(|d| d.row_of(1, 0)), None);
    assert_eq!(DenseRows::new(&[1, 2, 3], 2).and_then(|d| d.row_of(0, 1)), Some(2));
    assert_eq!(DenseRows::none().row_of(0, 0), None);
}
