//! Concurrency of the service: selections racing discovery churn never
//! report a worker other than the row they booked, and nothing leaks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use selkie_kernel::lanes::U32Source;

use super::*;

/// Points inside a selection where a test can run code (a worker added,
/// removed or replaced) to force an interleaving a debugger found, without
/// a debugger. Each hook fires on the thread that set it; compiled only
/// into the crate's own tests.
pub(crate) mod hooks {
    use std::cell::RefCell;

    /// A hook; its argument is the selection's row count where it has one.
    pub(crate) type Hook = Box<dyn FnMut(usize)>;

    thread_local! {
        static AFTER_ROWS_READ: RefCell<Option<Hook>> = const { RefCell::new(None) };
        static BEFORE_RETARGET_CLAIM: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    fn fire(cell: &'static std::thread::LocalKey<RefCell<Option<Hook>>>, arg: usize) {
        // Taken out while it runs, so a hook that selects does not recurse.
        // None once the thread's hooks are gone (a selection at thread exit).
        if let Some(mut f) = cell.try_with(|c| c.borrow_mut().take()).ok().flatten() {
            f(arg);
            cell.with(|c| {
                let mut c = c.borrow_mut();
                if c.is_none() {
                    *c = Some(f);
                }
            });
        }
    }

    /// Runs the hook set with [`set_after_rows_read`], if any.
    pub(crate) fn after_rows_read(rows: usize) {
        fire(&AFTER_ROWS_READ, rows);
    }

    /// Runs the hook set with [`set_before_retarget_claim`], if any.
    pub(crate) fn before_retarget_claim() {
        fire(&BEFORE_RETARGET_CLAIM, 0);
    }

    /// Runs `f(rows)` right after a selection (or `costs`) has read its
    /// row count and sized its buffers, before the hard filters run.
    pub(crate) fn set_after_rows_read(f: Option<Hook>) {
        AFTER_ROWS_READ.with(|c| *c.borrow_mut() = f);
    }

    /// Runs `f` inside `Booked::retarget`, after the target was resolved
    /// and before it is booked.
    pub(crate) fn set_before_retarget_claim(f: Option<Hook>) {
        BEFORE_RETARGET_CLAIM.with(|c| *c.borrow_mut() = f);
    }
}

#[test]
fn selections_racing_churn_book_the_worker_they_report() {
    for policy in [
        WorkerSelectionPolicy::random(),
        WorkerSelectionPolicy::kv(crate::KvRouterConfig::default(), crate::WorkerType::Prefill),
    ] {
        let s = Arc::new(WorkerSelectionService::new(policy, ServiceConfig::default()));
        for id in 0..4 {
            s.add_worker(WorkerRecord::new(id)).unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let churn = {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut next = 100;
                while !stop.load(Ordering::Relaxed) {
                    // Replace worker ids in place: rows get reused by new occupants.
                    let victim = s.workers()[0].worker_id;
                    s.remove_worker(victim).unwrap();
                    s.add_worker(WorkerRecord::new(next).with_dp(0, 1 + (next % 2) as u32))
                        .unwrap();
                    next += 1;
                }
            })
        };
        let pickers: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut checked = 0;
                    for _ in 0..3000 {
                        let Ok(sel) = s.select(&SelectionRequest::new(32)) else {
                            continue;
                        };
                        // One consistent read of the row: if it still holds the
                        // booked occupancy, its worker must be the one reported.
                        if let Some(info) = s.fleet.worker(sel.booking.row()) {
                            if info.slot == sel.booking.slot() {
                                assert_eq!(info.worker_id, sel.worker().worker_id);
                                checked += 1;
                            }
                        }
                    }
                    checked
                })
            })
            .collect();
        let checked: usize = pickers.into_iter().map(|t| t.join().unwrap()).sum();
        stop.store(true, Ordering::Relaxed);
        churn.join().unwrap();
        assert!(checked > 100, "only {checked} selections checked");
        for w in s.workers() {
            let st = s.worker_status(w.worker_id).unwrap();
            for r in st.ranks {
                assert_eq!(
                    (r.active_requests, r.active_prefill_tokens, r.active_decode_blocks),
                    (0, 0, 0)
                );
            }
        }
        let f = &s.fleet;
        for row in 0..f.rows() {
            if f.slot_id(row).is_some() {
                assert_eq!(f.active_requests().value(row), 0, "row {row} leaked");
            }
        }
    }
}

/// The policies a selection path can run, with a request that makes each
/// read its columns (overlaps for kv and the device-aware cache check).
fn every_policy() -> Vec<WorkerSelectionPolicy> {
    vec![
        WorkerSelectionPolicy::random(),
        WorkerSelectionPolicy::round_robin(),
        WorkerSelectionPolicy::least_loaded(),
        WorkerSelectionPolicy::power_of_two(),
        WorkerSelectionPolicy::device_aware_weighted(crate::DeviceAwareConfig::default()),
        WorkerSelectionPolicy::kv(crate::KvRouterConfig::default(), crate::WorkerType::Aggregated),
        WorkerSelectionPolicy::kv(
            crate::KvRouterConfig {
                router_temperature: 0.7,
                ..Default::default()
            },
            crate::WorkerType::Aggregated,
        ),
    ]
}

/// Finding: an add that crossed a multiple of 64 rows between the sizing of
/// a fresh thread's scratch and the hard filters panicked ("range end index
/// 3 out of range for slice of length 1"); device-aware reported every
/// worker overloaded on an idle fleet (its cache-hit column and its load
/// view had different lengths). The hook adds 70 workers at exactly that
/// point, on a fresh thread, for every policy and for select, peek and
/// costs.
#[test]
fn workers_added_mid_selection_neither_panic_nor_refuse() {
    for (p, policy) in every_policy().into_iter().enumerate() {
        for op in ["select", "peek", "costs"] {
            let s = Arc::new(WorkerSelectionService::new(
                every_policy().swap_remove(p),
                ServiceConfig {
                    seed: Some(3),
                    ..ServiceConfig::default()
                },
            ));
            let name = policy.name();
            for id in 0..60 {
                s.add_worker(WorkerRecord::new(id)).unwrap();
            }
            let added = s.clone();
            std::thread::spawn(move || {
                let mut next = 1000;
                hooks::set_after_rows_read(Some(Box::new(move |_| {
                    for _ in 0..70 {
                        added.add_worker(WorkerRecord::new(next)).unwrap();
                        next += 1;
                    }
                })));
                let overlaps = [crate::WorkerOverlap::device(WorkerWithDpRank::new(5, 0), 4, 16)];
                let req = SelectionRequest::new(64)
                    .with_overlaps(&overlaps)
                    .with_required_cache_hits(8);
                let worker = match op {
                    "select" => s.select(&req).map(|b| b.worker().worker_id),
                    "peek" => s.peek(&req).map(|p| p.worker.worker_id),
                    _ => s.costs(&req).map(|c| {
                        assert_eq!(
                            c.len(),
                            60,
                            "{name}: costs cover the workers the selection started with"
                        );
                        c[0].0.worker_id
                    }),
                };
                hooks::set_after_rows_read(None);
                let worker = worker.unwrap_or_else(|e| panic!("{name} {op}: {e}"));
                assert!(
                    worker < 60,
                    "{name} {op}: chose worker {worker}, added during the selection"
                );
            })
            .join()
            .unwrap_or_else(|_| panic!("{name} {op} panicked"));
        }
    }
}

/// Finding: rows claimed by an add the fleet refused raised the scan length
/// for good (16 workers, then a refused 16,370-rank worker: every selection
/// scanned 16,384 rows). The scan length is the snapshot's highest row: a
/// refused add leaves it alone (it is now refused before it claims a row,
/// too), and removing the top workers shortens it (which tells the two
/// apart: the fleet's own high-water mark never shrinks).
#[test]
fn scans_cover_the_registered_rows_only() {
    let s = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
    for id in 0..16 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let scanned = |s: &WorkerSelectionService| {
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let out = seen.clone();
        hooks::set_after_rows_read(Some(Box::new(move |rows| out.store(rows, Ordering::Relaxed))));
        s.select(&SelectionRequest::new(16)).unwrap();
        hooks::set_after_rows_read(None);
        seen.load(Ordering::Relaxed)
    };
    assert_eq!(scanned(&s), 16);
    let err = s.add_worker(WorkerRecord::new(99).with_dp(0, 16_370)).unwrap_err();
    assert!(
        matches!(err, crate::DiscoveryError::FleetFull { worker_id: 99, .. }),
        "{err}"
    );
    assert_eq!(scanned(&s), 16, "a refused add must not lengthen every scan");
    for id in 8..16 {
        s.remove_worker(id).unwrap();
    }
    assert_eq!(scanned(&s), 8, "removing the top workers shortens the scan");
}

/// Finding: `retarget(worker 2)` resolved worker 2's row, then booked the
/// row without its generation: when worker 2 left and worker 9 took its row
/// in between, it returned `Ok`, the booking said worker 2 and worker 9
/// carried the load.
#[test]
fn retarget_never_books_a_worker_other_than_the_one_named() {
    let s = Arc::new(WorkerSelectionService::new(
        WorkerSelectionPolicy::least_loaded(),
        ServiceConfig::default(),
    ));
    for id in 1..=3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let mut booking = s.select(&SelectionRequest::new(32).pinned_to_worker(1)).unwrap();
    let churn = s.clone();
    hooks::set_before_retarget_claim(Some(Box::new(move |_| {
        churn.remove_worker(2).unwrap();
        churn.add_worker(WorkerRecord::new(9)).unwrap(); // takes worker 2's row
    })));
    let result = booking.retarget(WorkerWithDpRank::new(2, 0));
    hooks::set_before_retarget_claim(None);
    assert_eq!(
        result,
        Err(crate::BookingError::UnknownWorker {
            worker: WorkerWithDpRank::new(2, 0)
        })
    );
    assert_eq!(booking.worker().worker_id, 1);
    let active = |id| s.worker_status(id).unwrap().ranks[0].active_requests;
    assert_eq!(
        (active(1), active(9)),
        (1, 0),
        "worker 9 must not carry worker 1's request"
    );
    drop(booking);
    assert_eq!(active(1), 0);
}

/// A selection takes its thread's snapshot out of the hot entry while it
/// reads it. Selections nested in it (a plugin, here a hook) that move the
/// registry on and fill the thread's cache past its size must not disturb
/// the snapshot it is reading: it still books and reports a worker of its
/// own snapshot, though every one of them was removed meanwhile; and the
/// next selections read the new snapshots (the crate's tests check on every
/// hot read that the entry held the service's current snapshot).
#[test]
fn a_snapshot_in_use_outlives_selections_nested_in_it() {
    let s = Arc::new(WorkerSelectionService::new(
        WorkerSelectionPolicy::random(),
        ServiceConfig::default(),
    ));
    for id in 0..8 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    s.select(&SelectionRequest::new(16)).unwrap(); // the hot entry holds it
    let others: Arc<Vec<_>> = Arc::new(
        (0..super::snapshot::CACHED_SNAPSHOTS + 2)
            .map(|i| {
                let o = WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default());
                o.add_worker(WorkerRecord::new(500 + i as u64)).unwrap();
                o
            })
            .collect(),
    );
    let (nested, in_hook) = (s.clone(), others.clone());
    let mut next = 1000;
    hooks::set_after_rows_read(Some(Box::new(move |_| {
        for round in 0..3 {
            for id in nested.workers().iter().map(|w| w.worker_id).collect::<Vec<_>>() {
                nested.remove_worker(id).unwrap();
            }
            for _ in 0..8 {
                nested.add_worker(WorkerRecord::new(next)).unwrap();
                next += 1;
            }
            let inner = nested.select(&SelectionRequest::new(16)).unwrap();
            assert!(inner.worker().worker_id >= 1000, "round {round}: {}", inner.worker());
            for (i, o) in in_hook.iter().enumerate() {
                assert_eq!(
                    o.select(&SelectionRequest::new(16)).unwrap().worker().worker_id,
                    500 + i as u64
                );
            }
        }
    })));
    let outer = s.select(&SelectionRequest::new(16));
    hooks::set_after_rows_read(None);
    // The outer selection's row now belongs to a worker added in the hook
    // (or to none): its booking is refused as stale, and the general path
    // retries on the same (old) snapshot, whose rows all refuse.
    match outer {
        Ok(b) => panic!("booked {} though every worker of its snapshot left", b.worker()),
        Err(e) => assert_eq!(e, SelectionError::AllEligibleWorkersOverloaded),
    }
    // The next selections read the new snapshots, each service its own, with
    // more services than the thread's cache holds taking turns.
    for _ in 0..2 {
        assert!(s.select(&SelectionRequest::new(16)).unwrap().worker().worker_id >= 1000);
        for (i, o) in others.iter().enumerate() {
            assert_eq!(
                o.select(&SelectionRequest::new(16)).unwrap().worker().worker_id,
                500 + i as u64
            );
        }
    }
}

/// Services taking turns on one thread, fewer than its cache holds: each
/// turn finds the service's snapshot in the cache and puts it in the hot
/// entry, and the next selection reads it from there; every selection
/// reads its own service's snapshot (the hot read checks it too).
#[test]
fn services_taking_turns_read_their_own_snapshots() {
    let services: Vec<_> = (0..3u64)
        .map(|i| {
            let s = WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default());
            s.add_worker(WorkerRecord::new(100 + i)).unwrap();
            s
        })
        .collect();
    for round in 0..4 {
        for (i, s) in services.iter().enumerate() {
            for _ in 0..2 {
                let got = s.select(&SelectionRequest::new(16)).unwrap().worker().worker_id;
                assert_eq!(got, 100 + i as u64, "round {round}");
            }
        }
    }
}

/// A selection in a thread-local's destructor that runs after the thread's
/// snapshot cache is gone (destructors run in the reverse order of their
/// registration) reads the current snapshot and caches nothing.
#[test]
fn a_selection_after_the_threads_cache_is_gone_still_selects() {
    struct SelectsOnExit(Option<(Arc<WorkerSelectionService>, std::sync::mpsc::Sender<u64>)>);
    impl Drop for SelectsOnExit {
        fn drop(&mut self) {
            if let Some((s, tx)) = self.0.take() {
                let got = s.select(&SelectionRequest::new(16)).map(|b| b.worker().worker_id);
                let _ = tx.send(got.unwrap_or(0));
            }
        }
    }
    thread_local! {
        static ON_EXIT: std::cell::RefCell<SelectsOnExit> = const { std::cell::RefCell::new(SelectsOnExit(None)) };
    }
    let s = Arc::new(WorkerSelectionService::new(
        WorkerSelectionPolicy::random(),
        ServiceConfig::default(),
    ));
    s.add_worker(WorkerRecord::new(7)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let in_thread = s.clone();
    std::thread::spawn(move || {
        // Registered before the cache's destructor, so it runs after it.
        ON_EXIT.with(|c| c.borrow_mut().0 = Some((in_thread.clone(), tx)));
        assert_eq!(
            in_thread.select(&SelectionRequest::new(16)).unwrap().worker().worker_id,
            7
        );
    })
    .join()
    .unwrap();
    assert_eq!(rx.recv().unwrap(), 7);
    assert_eq!(s.worker_status(7).unwrap().ranks[0].active_requests, 0);
}
