//! Concurrency of the service: selections racing discovery churn never
//! report a worker other than the row they booked, and nothing leaks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use selkie_kernel::lanes::U32Source;

use super::*;

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
