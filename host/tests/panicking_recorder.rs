//! A metrics recorder that panics while a discovery snapshot is being
//! applied: the snapshot is undone whole, no fleet row leaks, and
//! selections see the workers again at once. (Its own test binary: it
//! installs the process-wide recorder.)

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use selkie::*;

/// Worker id whose selection counter's registration panics (0: none).
static PANIC_FOR_WORKER: AtomicU64 = AtomicU64::new(0);

struct Panicking;
impl Recorder for Panicking {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let armed = PANIC_FOR_WORKER.load(Ordering::Relaxed);
        if armed != 0
            && key
                .labels()
                .any(|l| l.key() == "worker" && l.value() == armed.to_string())
        {
            panic!("recorder exploded on worker {armed}");
        }
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[test]
fn a_panic_while_applying_a_snapshot_undoes_it_whole() {
    metrics::set_global_recorder(Panicking).expect("the only recorder of this binary");
    let s = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
    s.sync((1..=3).map(WorkerRecord::new).collect()).unwrap();
    let held = s.select(&SelectionRequest::new(16).pinned_to_worker(2)).unwrap();
    let snapshot: Vec<_> = [1, 3, 4, 5, 6]
        .into_iter()
        .map(|id| WorkerRecord::new(id).with_dp(0, 2))
        .collect();
    PANIC_FOR_WORKER.store(5, Ordering::Relaxed);
    let result = catch_unwind(AssertUnwindSafe(|| s.sync(snapshot.clone())));
    PANIC_FOR_WORKER.store(0, Ordering::Relaxed);
    assert!(result.is_err(), "the recorder's panic reaches the caller");
    let ids: Vec<_> = s.workers().iter().map(|w| w.worker_id).collect();
    assert_eq!(ids, vec![1, 2, 3], "the snapshot was undone whole");
    assert_eq!(
        s.worker_status(2).unwrap().ranks[0].active_requests,
        1,
        "the booking is still counted"
    );
    // Every undone worker is selectable on its (possibly new) rows at once.
    for id in [1, 2, 3] {
        drop(s.select(&SelectionRequest::new(16).pinned_to_worker(id)).unwrap());
    }
    // No row leaked: the rest of the fleet still fits one worker.
    let free = FLEET_GROUPS as u32 * 8 - 3;
    s.add_worker(WorkerRecord::new(9).with_dp(0, free)).unwrap();
    s.remove_worker(9).unwrap();
    drop(held);
    let report = s.sync(snapshot).unwrap();
    assert_eq!((report.added, report.removed), (vec![4, 5, 6], vec![2]));
}
