//! Row-indexed overlaps (`RowOverlaps`): read as the KV policy's columns,
//! equal to the worker-keyed form, refused on a stale row layout or a short
//! column, and used for the prefill tokens booked.

use selkie::*;

fn kv() -> WorkerSelectionService {
    WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig {
            seed: Some(3),
            ..ServiceConfig::default()
        },
    )
}

fn w(id: u64, rank: u32) -> WorkerWithDpRank {
    WorkerWithDpRank::new(id, rank)
}

/// Worker-keyed overlaps and the row columns an indexer would produce for
/// them.
fn both(s: &WorkerSelectionService, ids: &[u64]) -> (Vec<WorkerOverlap>, RowLayout, Vec<f32>, Vec<f32>, Vec<f32>) {
    let layout = s.row_layout();
    let (mut device, mut cached, mut host) = (
        vec![0.0; layout.rows()],
        vec![0.0; layout.rows()],
        vec![0.0; layout.rows()],
    );
    let mut keyed = Vec::new();
    for &id in ids {
        for rank in 0..2 {
            // One clear best (the first rank of the first worker), so the
            // choice does not depend on how ties are broken.
            let best = id == ids[0] && rank == 0;
            let blocks = if best { 12 } else { (id as u32 * 3 + rank) % 7 };
            let host_blocks = (id as u32 + rank) % 3;
            keyed.push(WorkerOverlap {
                worker: w(id, rank),
                device_blocks: blocks,
                host_blocks,
                cached_tokens: blocks * 16,
                ..Default::default()
            });
            let row = s.row_of(w(id, rank)).unwrap();
            (device[row], cached[row], host[row]) = (blocks as f32, (blocks * 16) as f32, host_blocks as f32);
        }
    }
    // Unsorted on purpose: the worker-keyed form accepts any order.
    keyed.reverse();
    (keyed, layout, device, cached, host)
}

#[test]
fn row_overlaps_cost_what_worker_overlaps_cost() {
    let s = kv();
    let ids: Vec<u64> = (1..=12).map(|i| i * 1_000_003).collect();
    for &id in &ids {
        s.add_worker(WorkerRecord::new(id).with_dp(0, 2)).unwrap();
    }
    let (keyed, layout, device, cached, host) = both(&s, &ids);
    let rows = RowOverlaps::new(layout, &device)
        .with_cached_tokens(&cached)
        .with_host_blocks(&host);
    let by_worker = s.costs(&SelectionRequest::new(256).with_overlaps(&keyed)).unwrap();
    let by_row = s.costs(&SelectionRequest::new(256).with_row_overlaps(rows)).unwrap();
    assert_eq!(by_worker, by_row);
    let none = s.costs(&SelectionRequest::new(256)).unwrap();
    assert_ne!(by_row, none, "the overlaps change the costs");
    // The same choice, and the same prefill tokens booked.
    let a = s.select(&SelectionRequest::new(256).with_overlaps(&keyed)).unwrap();
    let (wa, pa) = (a.worker(), a.prefill_tokens());
    drop(a);
    let b = s.select(&SelectionRequest::new(256).with_row_overlaps(rows)).unwrap();
    assert_eq!((b.worker(), b.prefill_tokens()), (wa, pa));
    assert!(pa < 256, "cached tokens were credited");
}

#[test]
fn a_row_given_to_another_worker_is_a_stale_layout() {
    let s = kv();
    for id in 1..=3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let layout = s.row_layout();
    let row = s.row_of(w(2, 0)).unwrap();
    let mut device = vec![0.0; layout.rows()];
    device[row] = 1_000.0;
    // Worker 2 leaves; worker 9 takes its row.
    s.remove_worker(2).unwrap();
    s.add_worker(WorkerRecord::new(9)).unwrap();
    assert_eq!(s.row_of(w(9, 0)), Some(row), "the row was reused");
    let req = SelectionRequest::new(4096).with_row_overlaps(RowOverlaps::new(layout, &device));
    let err = s.select(&req).unwrap_err();
    assert_eq!(
        err,
        SelectionError::StaleRowLayout {
            expected: layout.epoch(),
            found: s.row_layout().epoch()
        }
    );
    // Recomputed against the new layout, the row credits worker 9.
    let layout = s.row_layout();
    let req = SelectionRequest::new(4096).with_row_overlaps(RowOverlaps::new(layout, &device));
    assert_eq!(s.select(&req).unwrap().worker(), w(9, 0));
}

#[test]
fn state_changes_keep_the_layout() {
    let s = kv();
    for id in 1..=3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let layout = s.row_layout();
    s.set_worker_state(1, WorkerState::Draining).unwrap();
    s.set_overloaded(3, true).unwrap();
    assert_eq!(s.row_layout(), layout);
    let device = vec![0.0; layout.rows()];
    let req = SelectionRequest::new(64).with_row_overlaps(RowOverlaps::new(layout, &device));
    assert_eq!(s.select(&req).unwrap().worker(), w(2, 0));
}

#[test]
fn a_short_column_is_named() {
    let s = kv();
    for id in 1..=3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let layout = s.row_layout();
    let device = vec![0.0; layout.rows()];
    let cached = vec![0.0; 2];
    let req =
        SelectionRequest::new(64).with_row_overlaps(RowOverlaps::new(layout, &device).with_cached_tokens(&cached));
    assert_eq!(
        s.select(&req).unwrap_err(),
        SelectionError::OverlapColumnTooShort {
            column: "cached_tokens",
            len: 2,
            rows: layout.rows()
        }
    );
    let req = SelectionRequest::new(64).with_row_overlaps(RowOverlaps::new(layout, &device[..1]));
    assert!(matches!(
        s.select(&req).unwrap_err(),
        SelectionError::OverlapColumnTooShort {
            column: "device_blocks",
            len: 1,
            ..
        }
    ));
}

#[test]
fn device_aware_reads_row_overlaps() {
    let s = WorkerSelectionService::new(
        WorkerSelectionPolicy::device_aware_weighted(DeviceAwareConfig::default()),
        ServiceConfig::default(),
    );
    for id in 1..=4 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let layout = s.row_layout();
    let mut device = vec![0.0; layout.rows()];
    device[s.row_of(w(3, 0)).unwrap()] = 8.0;
    let req = SelectionRequest::new(64)
        .with_required_cache_hits(8)
        .with_row_overlaps(RowOverlaps::new(layout, &device));
    let sel = s.select(&req).unwrap();
    assert_eq!(sel.worker(), w(3, 0));
    assert_eq!(sel.explanation().branch, Branch::DeviceAwareCacheHit);
}

/// The worker-keyed form costs what the row form costs, and leaves nothing
/// in the next request's columns, whether the ids are small (looked up by
/// id) or spread out (hashed), and whether the scatter clears its rows one
/// by one (few entries against the rows) or its columns whole (many), with
/// and without lower tiers.
#[test]
fn keyed_overlaps_cost_as_rows_and_leave_nothing_behind() {
    for spread in [1, 1_000_003] {
        let s = kv();
        let ids: Vec<u64> = (0..200).map(|i| i * spread).collect();
        for &id in &ids {
            s.add_worker(WorkerRecord::new(id).with_dp(0, 2)).unwrap();
        }
        let plain = s.costs(&SelectionRequest::new(256)).unwrap();
        // 400 entries on 400 rows (columns cleared whole), then 4 (rows
        // cleared from a list).
        for some in [&ids[..], &ids[10..12]] {
            let (keyed, layout, device, cached, host) = both(&s, some);
            for tiers in [false, true] {
                let keyed: Vec<_> = keyed
                    .iter()
                    .map(|o| WorkerOverlap {
                        host_blocks: if tiers { o.host_blocks } else { 0 },
                        ..*o
                    })
                    .collect();
                let zeros = vec![0.0; host.len()];
                let rows = RowOverlaps::new(layout, &device)
                    .with_cached_tokens(&cached)
                    .with_host_blocks(if tiers { &host } else { &zeros });
                let by_worker = s.costs(&SelectionRequest::new(256).with_overlaps(&keyed)).unwrap();
                let by_row = s.costs(&SelectionRequest::new(256).with_row_overlaps(rows)).unwrap();
                let what = format!("spread {spread}, {} entries, tiers {tiers}", keyed.len());
                assert_eq!(by_worker, by_row, "{what}");
                assert_ne!(by_worker, plain, "{what}: the overlaps count");
                assert_eq!(
                    s.costs(&SelectionRequest::new(256)).unwrap(),
                    plain,
                    "{what}: left behind"
                );
            }
        }
    }
}

/// `check_request` finds every overlap longer than the prompt at the
/// service's block size, in either form, and names the worker, the row and
/// the column; overlaps within the prompt pass, and so do the ones above.
#[test]
fn check_request_finds_overlaps_past_the_prompt() {
    let s = kv();
    for id in 1..=3 {
        s.add_worker(WorkerRecord::new(id).with_dp(0, 2)).unwrap();
    }
    // 200 tokens at the default 16 per block: 13 blocks.
    let req = SelectionRequest::new(200);
    let (keyed, layout, device, cached, host) = both(&s, &[1, 2, 3]);
    assert!(s.check_request(&req.with_overlaps(&keyed)).is_ok());
    let rows = RowOverlaps::new(layout, &device)
        .with_cached_tokens(&cached)
        .with_host_blocks(&host);
    assert!(s.check_request(&req.with_row_overlaps(rows)).is_ok());
    let edge = [WorkerOverlap {
        worker: w(2, 1),
        device_blocks: 13,
        host_blocks: 13,
        disk_blocks: 13,
        shared_blocks: 13,
        cached_tokens: 200,
    }];
    assert!(
        s.check_request(&req.with_overlaps(&edge)).is_ok(),
        "the whole prompt is within it"
    );
    let past = |column: &str| {
        let mut o = edge[0];
        match column {
            "device_blocks" => o.device_blocks = 14,
            "host_blocks" => o.host_blocks = 14,
            "disk_blocks" => o.disk_blocks = 14,
            "shared_blocks" => o.shared_blocks = 14,
            _ => o.cached_tokens = 201,
        }
        [o]
    };
    for column in [
        "device_blocks",
        "host_blocks",
        "disk_blocks",
        "shared_blocks",
        "cached_tokens",
    ] {
        let o = past(column);
        let limit = if column == "cached_tokens" { 200 } else { 13 };
        match s.check_request(&req.with_overlaps(&o)) {
            Err(SelectionError::OverlapPastPrompt {
                worker: Some(wk),
                row: None,
                column: c,
                value,
                limit: l,
            }) => assert_eq!((wk, c, value, l), (w(2, 1), column, limit + 1, limit)),
            other => panic!("{column}: {other:?}"),
        }
    }
    // Per-row columns: a value past the prompt, and a NaN.
    let row = s.row_of(w(3, 0)).unwrap();
    for (v, value) in [(13.5f32, 14u64), (f32::NAN, u64::MAX)] {
        let mut host = host.clone();
        host[row] = v;
        let rows = RowOverlaps::new(layout, &device).with_host_blocks(&host);
        match s.check_request(&req.with_row_overlaps(rows)) {
            Err(e @ SelectionError::OverlapPastPrompt { .. }) => {
                let SelectionError::OverlapPastPrompt {
                    worker,
                    row: r,
                    column,
                    value: got,
                    limit,
                    ..
                } = e.clone()
                else {
                    unreachable!()
                };
                assert_eq!(
                    (worker, r, column, got, limit),
                    (Some(w(3, 0)), Some(row), "host_blocks", value, 13)
                );
                assert!(e.to_string().contains("host_blocks"), "{e}");
            }
            other => panic!("{v}: {other:?}"),
        }
    }
    // A selection takes what check_request refuses as it is.
    assert!(s.select(&req.with_overlaps(&past("cached_tokens"))).is_ok());
}
