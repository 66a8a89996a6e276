//! The selection service: booking lifecycle, peek, retarget, sessions,
//! explanations, metrics and tracing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use selkie::*;

fn svc(policy: WorkerSelectionPolicy) -> WorkerSelectionService {
    WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(2),
            ..ServiceConfig::default()
        },
    )
}

fn load(s: &WorkerSelectionService, id: u64) -> (u32, u32, u32) {
    let r = s.worker_status(id).unwrap().ranks[0];
    (r.active_requests, r.active_prefill_tokens, r.active_decode_blocks)
}

#[test]
fn booking_lifecycle_prefill_output_finish() {
    let s = svc(WorkerSelectionPolicy::least_loaded());
    s.add_worker(WorkerRecord::new(1)).unwrap();
    // 100 tokens, 32 of them cached: 68 prefill tokens, ceil(100/16) = 7 blocks.
    let ov = [WorkerOverlap {
        worker: WorkerWithDpRank::new(1, 0),
        device_blocks: 2,
        cached_tokens: 32,
        ..Default::default()
    }];
    let mut a = s.select(&SelectionRequest::new(100).with_overlaps(&ov)).unwrap();
    assert_eq!((a.prefill_tokens(), a.decode_blocks()), (68, 7));
    assert_eq!(load(&s, 1), (1, 68, 7));
    a.prefill_complete();
    assert_eq!(load(&s, 1), (1, 0, 7));
    a.prefill_complete(); // idempotent
    a.add_output_block().unwrap();
    a.add_output_block().unwrap();
    assert_eq!(load(&s, 1), (1, 0, 9));
    let b = s
        .select(&SelectionRequest::new(16).with_track_prefill_tokens(false))
        .unwrap();
    assert_eq!(load(&s, 1), (2, 0, 10));
    a.finish();
    assert_eq!(load(&s, 1), (1, 0, 1));
    drop(b);
    assert_eq!(load(&s, 1), (0, 0, 0));
}

#[test]
fn output_blocks_after_removal_count_on_the_retired_row() {
    let s = svc(WorkerSelectionPolicy::random());
    s.add_worker(WorkerRecord::new(1)).unwrap();
    let mut a = s.select(&SelectionRequest::new(16)).unwrap();
    let (requests, tokens, blocks) = load(&s, 1);
    s.remove_worker(1).unwrap();
    // Worker 1's row is retired, not freed, while `a` holds load on it.
    s.add_worker(WorkerRecord::new(2)).unwrap();
    a.add_output_block().unwrap();
    assert_eq!(load(&s, 2), (0, 0, 0), "the new worker is untouched");
    // Worker 1 comes back on its own row, with the booking still counted.
    s.add_worker(WorkerRecord::new(1)).unwrap();
    assert_eq!(load(&s, 1), (requests, tokens, blocks + 1));
    drop(a);
    assert_eq!(load(&s, 1), (0, 0, 0));
    assert_eq!(load(&s, 2), (0, 0, 0));
}

#[test]
fn peek_books_nothing() {
    for policy in [
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        WorkerSelectionPolicy::least_loaded(),
        WorkerSelectionPolicy::round_robin(),
    ] {
        let s = svc(policy);
        s.add_worker(WorkerRecord::new(1)).unwrap();
        s.add_worker(WorkerRecord::new(2)).unwrap();
        let p = s.peek(&SelectionRequest::new(64)).unwrap();
        assert_eq!(load(&s, 1).0 + load(&s, 2).0, 0);
        assert!(p.explanation.runner_up.is_some(), "peek is explained");
        assert_eq!(s.select(&SelectionRequest::new(64)).unwrap().worker(), p.worker);
    }
}

/// Finding: a preview took the next random stream of a seeded service
/// (and the thread's generator, advanced, on an unseeded one), so the
/// selection after it drew other numbers than the preview had: a random
/// policy chose another worker than the one previewed, and a seeded
/// service's selections changed with previews between them.
#[test]
fn a_preview_draws_what_the_next_selection_draws() {
    for seed in [Some(2), None] {
        let config = || ServiceConfig {
            seed,
            ..ServiceConfig::default()
        };
        let previewed = WorkerSelectionService::new(WorkerSelectionPolicy::random(), config());
        let plain = WorkerSelectionService::new(WorkerSelectionPolicy::random(), config());
        for id in 0..16 {
            previewed.add_worker(WorkerRecord::new(id)).unwrap();
            plain.add_worker(WorkerRecord::new(id)).unwrap();
        }
        let req = SelectionRequest::new(64);
        for i in 0..40 {
            let preview = previewed.peek(&req).unwrap();
            let chosen = previewed.select(&req).unwrap().worker();
            assert_eq!(chosen, preview.worker, "seed {seed:?}, selection {i}");
            if seed.is_some() {
                let alone = plain.select(&req).unwrap().worker();
                assert_eq!(chosen, alone, "selection {i}: previews between selections changed it");
            }
        }
    }
}

#[test]
fn retarget_moves_the_load() {
    let s = svc(WorkerSelectionPolicy::least_loaded());
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2).with_max_active_requests(1)).unwrap();
    s.add_worker(WorkerRecord::new(3).with_state(WorkerState::Cordoned))
        .unwrap();
    let mut a = s.select(&SelectionRequest::new(48).pinned_to_worker(1)).unwrap();
    a.retarget(WorkerWithDpRank::new(2, 0)).unwrap();
    assert_eq!(a.worker(), WorkerWithDpRank::new(2, 0));
    assert_eq!((load(&s, 1), load(&s, 2)), ((0, 0, 0), (1, 48, 3)));
    let _b = s.select(&SelectionRequest::new(16).pinned_to_worker(1)).unwrap();
    let mut c = s.select(&SelectionRequest::new(16).pinned_to_worker(1)).unwrap();
    assert_eq!(
        c.retarget(WorkerWithDpRank::new(2, 0)).unwrap_err(),
        BookingError::Overloaded {
            worker: WorkerWithDpRank::new(2, 0),
            limit: 1
        }
    );
    assert_eq!(
        c.retarget(WorkerWithDpRank::new(3, 0)).unwrap_err(),
        BookingError::NotLive {
            worker: WorkerWithDpRank::new(3, 0)
        }
    );
    assert_eq!(
        c.retarget(WorkerWithDpRank::new(9, 0)).unwrap_err(),
        BookingError::UnknownWorker {
            worker: WorkerWithDpRank::new(9, 0)
        }
    );
    assert_eq!(c.worker().worker_id, 1, "a failed retarget leaves the booking in place");
    assert_eq!(load(&s, 1).0, 2);
    drop((a, c));
    assert_eq!((load(&s, 1).0, load(&s, 2)), (1, (0, 0, 0)));
}

#[test]
fn hard_session_affinity_always_returns_to_its_worker() {
    let s = svc(WorkerSelectionPolicy::least_loaded());
    s.add_worker(WorkerRecord::new(1).with_max_active_requests(2)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let req = SelectionRequest::new(16).with_session("chat-1", AffinityMode::Hard);
    let first = s.select(&req).unwrap();
    let w = first.worker();
    assert_eq!(s.session_worker("chat-1"), Some(w));
    let mut held = vec![first];
    // Even though the other worker is idle, the session stays.
    let second = s.select(&req).unwrap();
    assert_eq!((second.worker(), second.explanation().route), (w, Route::SessionHard));
    held.push(second);
    if w.worker_id == 1 {
        assert_eq!(
            s.select(&req).unwrap_err(),
            SelectionError::PinnedWorkerOverloaded { worker_id: 1 }
        );
    }
    // The worker drains: the session moves on instead of failing.
    drop(held);
    s.set_worker_state(w.worker_id, WorkerState::Draining).unwrap();
    let moved = s.select(&req).unwrap();
    assert_ne!(moved.worker(), w);
    drop(moved);
    s.set_worker_state(w.worker_id, WorkerState::Live).unwrap();
    s.select(&req.pinned_to_worker(w.worker_id)).unwrap(); // explicit pins are untouched
    let held: Vec<Selection<'_>> = Vec::new();
    // The worker leaves: the session rebinds.
    drop(held);
    s.remove_worker(w.worker_id).unwrap();
    let third = s.select(&req).unwrap();
    assert_ne!(third.worker(), w);
    assert_eq!(s.session_worker("chat-1"), Some(third.worker()));
    assert!(s.end_session("chat-1"));
    assert_eq!(s.session_worker("chat-1"), None);
}

#[test]
fn soft_session_affinity_prefers_but_does_not_insist() {
    let s = svc(WorkerSelectionPolicy::least_loaded());
    let t = BusyThresholds {
        active_prefill_tokens: Some(20),
        ..BusyThresholds::NONE
    };
    s.add_worker(WorkerRecord::new(1).with_busy_thresholds(t)).unwrap();
    s.add_worker(WorkerRecord::new(2).with_busy_thresholds(t)).unwrap();
    let req = SelectionRequest::new(12).with_session("s", AffinityMode::Soft);
    let a = s.select(&req).unwrap();
    let w = a.worker();
    let b = s.select(&req).unwrap(); // least-loaded alone would pick the other worker
    assert_eq!((b.worker(), b.explanation().route), (w, Route::SessionSoft));
    let c = s.select(&req).unwrap(); // 24 > 20 prefill tokens now: busy
    assert_ne!(c.worker(), w, "busy session worker is not insisted on");
    assert_eq!(c.explanation().route, Route::Policy);
    assert_eq!(s.session_worker("s"), Some(c.worker()), "rebound");
    drop((a, b, c));
}

#[test]
fn sessions_expire_after_the_idle_timeout() {
    let s = WorkerSelectionService::new(
        WorkerSelectionPolicy::round_robin(),
        ServiceConfig {
            session_idle_timeout: Duration::from_millis(30),
            ..ServiceConfig::default()
        },
    );
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let req = SelectionRequest::new(1).with_session("x", AffinityMode::Hard);
    let w = s.select(&req).unwrap().worker();
    assert_eq!(s.select(&req).unwrap().worker(), w);
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(s.session_worker("x"), None);
    assert_eq!(s.expire_sessions(), 0);
    // Peek does not bind a session.
    s.peek(&req).unwrap();
    assert_eq!(s.session_worker("x"), None);
}

#[test]
fn explanation_prints_cost_runner_up_margin_and_branch() {
    let s = svc(WorkerSelectionPolicy::kv(
        KvRouterConfig::default(),
        WorkerType::Prefill,
    ));
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let ov = [WorkerOverlap::device(WorkerWithDpRank::new(2, 0), 4, 16)];
    let sel = s
        .select(&SelectionRequest::new(128).with_overlaps(&ov).explained())
        .unwrap();
    let e = sel.explanation();
    assert_eq!(
        (e.chosen, e.cost, e.branch, e.route),
        (WorkerWithDpRank::new(2, 0), 12.0, Branch::KvMinimum, Route::Policy)
    );
    assert_eq!(e.runner_up, Some((WorkerWithDpRank::new(1, 0), 16.0)));
    assert_eq!(e.margin(), Some(4.0));
    assert_eq!(
        e.to_string(),
        "kv chose 2/dp0 via kv-minimum (Policy) at cost 12.0000 (prefill 8.0000 + cache-credit -4.0000 + decode 8.0000) \
         among 2 candidates; runner-up 1/dp0 at 16.0000 (prefill 8.0000 + cache-credit 0.0000 + decode 8.0000), margin 4.0000"
    );
    // Without `explained`, no runner-up (no extra pass).
    assert_eq!(
        s.select(&SelectionRequest::new(128).with_overlaps(&ov))
            .unwrap()
            .explanation()
            .runner_up,
        None
    );
}

// ---- metrics ------------------------------------------------------------

#[derive(Default)]
struct TestRecorder {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

impl TestRecorder {
    fn get(&self, key: &str) -> u64 {
        self.counters
            .lock()
            .unwrap()
            .get(key)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

impl metrics::Recorder for TestRecorder {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let c = self.counters.lock().unwrap().entry(name).or_default().clone();
        metrics::Counter::from_arc(c)
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

#[test]
fn metrics_count_selections_per_worker_and_rejection_reasons() {
    let rec = TestRecorder::default();
    metrics::with_local_recorder(&rec, || {
        let s = svc(WorkerSelectionPolicy::round_robin());
        s.add_worker(WorkerRecord::new(1)).unwrap();
        s.add_worker(WorkerRecord::new(2).with_state(WorkerState::Draining))
            .unwrap();
        s.add_worker(WorkerRecord::new(3).with_busy_thresholds(BusyThresholds {
            active_prefill_tokens: Some(0),
            ..BusyThresholds::NONE
        }))
        .unwrap();
        let _held = s.select(&SelectionRequest::new(5).pinned_to_worker(3)).unwrap();
        for _ in 0..4 {
            s.select(&SelectionRequest::new(1)).unwrap();
        }
        let _ = s.select(&SelectionRequest::new(1).pinned_to_worker(2));
        let _ = s.select(&SelectionRequest::new(1).pinned_to_worker(3));
    });
    assert_eq!(rec.get("selkie_worker_selections_total{worker=1}"), 4);
    assert_eq!(rec.get("selkie_worker_selections_total{worker=3}"), 1);
    assert_eq!(rec.get("selkie_selections_total{policy=round-robin}"), 5);
    assert_eq!(
        rec.get("selkie_rejections_total{reason=busy}"),
        4,
        "worker 3 skipped as busy four times"
    );
    assert_eq!(rec.get("selkie_rejections_total{reason=draining}"), 1);
    assert_eq!(rec.get("selkie_selection_errors_total{reason=pinned_unavailable}"), 1);
    assert_eq!(rec.get("selkie_selection_errors_total{reason=pinned_overloaded}"), 1);
}

/// A worker marked overloaded is counted as skipped (`reason=busy`) by a
/// plain request as by an explained one: the fast path, which would not
/// count it, does not take a snapshot whose ready rows leave out a live
/// worker.
#[test]
fn a_marked_worker_is_counted_on_plain_requests_too() {
    let counts = [false, true].map(|explained| {
        let rec = TestRecorder::default();
        metrics::with_local_recorder(&rec, || {
            let s = svc(WorkerSelectionPolicy::random());
            for id in 1..=3 {
                s.add_worker(WorkerRecord::new(id)).unwrap();
            }
            s.set_overloaded(2, true).unwrap();
            for _ in 0..5 {
                let req = SelectionRequest::new(1);
                let req = if explained { req.explained() } else { req };
                assert_ne!(s.select(&req).unwrap().worker().worker_id, 2);
            }
        });
        rec.get("selkie_rejections_total{reason=busy}")
    });
    assert_eq!(counts, [5, 5], "plain and explained requests");
}

/// A failed selection is counted once under its reason, whichever way it
/// failed: a request refused before any path (a NaN temperature), a
/// plain request whose policy fails on the fast path (overlap columns of
/// an earlier row layout), and the same request explained (the general
/// path).
#[test]
fn every_failed_selection_is_counted_once() {
    let rec = TestRecorder::default();
    metrics::with_local_recorder(&rec, || {
        let s = svc(WorkerSelectionPolicy::kv(
            KvRouterConfig::default(),
            WorkerType::Aggregated,
        ));
        s.add_worker(WorkerRecord::new(1)).unwrap();
        let layout = s.row_layout();
        let device = vec![0.0; layout.rows()];
        s.add_worker(WorkerRecord::new(2)).unwrap();
        let stale = SelectionRequest::new(64).with_row_overlaps(RowOverlaps::new(layout, &device));
        assert!(matches!(s.select(&stale), Err(SelectionError::StaleRowLayout { .. })));
        assert!(matches!(
            s.select(&stale.explained()),
            Err(SelectionError::StaleRowLayout { .. })
        ));
        let nan = SelectionRequest::new(64).with_temperature(f64::NAN);
        assert!(matches!(s.select(&nan), Err(SelectionError::InvalidRequest(_))));
    });
    assert_eq!(rec.get("selkie_selection_errors_total{reason=stale_row_layout}"), 2);
    assert_eq!(rec.get("selkie_selection_errors_total{reason=invalid_request}"), 1);
}

/// A booking the fleet refuses is counted once, on the fast path of a
/// plain request as on the general path (an explained request): both see
/// the same refusals.
#[test]
fn refused_bookings_are_counted() {
    let refusals = [false, true].map(|explained| {
        let rec = TestRecorder::default();
        metrics::with_local_recorder(&rec, || {
            let s = svc(WorkerSelectionPolicy::round_robin());
            s.add_worker(WorkerRecord::new(1).with_max_active_requests(1)).unwrap();
            s.add_worker(WorkerRecord::new(2)).unwrap();
            let _full = s.select(&SelectionRequest::new(1).pinned_to_worker(1)).unwrap();
            for _ in 0..4 {
                let req = SelectionRequest::new(1);
                let req = if explained { req.explained() } else { req };
                assert_eq!(s.select(&req).unwrap().worker().worker_id, 2);
            }
        });
        assert_eq!(rec.get("selkie_worker_selections_total{worker=2}"), 4);
        rec.get("selkie_rejections_total{reason=booking_refused}")
    });
    assert_eq!(refusals[0], refusals[1], "fast and general paths");
    assert!(refusals[0] > 0, "round robin draws the full worker");
}

/// A booking's prefill tokens are the prompt less the cached tokens of the
/// worker it booked, whichever way the `kv` policy chose (argmin, softmax
/// draw, the switching margin's holder) and however the worker-keyed
/// overlaps were scattered (by the kernel when many, from a list when few):
/// overlaps in shuffled order, so that no search by worker finds them
/// sorted. A count past `f32`'s exact integers is booked exactly too.
#[test]
fn a_keyed_bookings_prefill_is_its_workers_uncached_tokens() {
    let workers = 64u64;
    let configs = [
        KvRouterConfig::default(),
        KvRouterConfig {
            router_temperature: 0.7,
            ..KvRouterConfig::default()
        },
        KvRouterConfig {
            switch_margin: 1e12,
            ..KvRouterConfig::default()
        },
    ];
    let service = |config: &KvRouterConfig| {
        let s = svc(WorkerSelectionPolicy::kv(*config, WorkerType::Aggregated));
        for id in 0..workers {
            s.add_worker(WorkerRecord::new(id)).unwrap();
        }
        s
    };
    let keyed = |ids: &[u64], cached_on: &dyn Fn(u64) -> u32| -> Vec<WorkerOverlap> {
        ids.iter()
            .map(|&id| WorkerOverlap {
                worker: WorkerWithDpRank::new(id, 0),
                device_blocks: cached_on(id) / 16,
                cached_tokens: cached_on(id),
                ..Default::default()
            })
            .collect()
    };
    // Many entries (the kernel's scatter) and few (the list), in a fixed
    // shuffle; the bookings are held, so the load moves the choice about.
    let many: Vec<u64> = (0..workers)
        .filter(|w| w % 5 != 3)
        .map(|w| (w * 37) % workers)
        .collect();
    let few: Vec<u64> = vec![5, 41, 17];
    let isl = 8192;
    let cached_on = |id: u64| (id as u32 * 977) % 4096;
    for config in &configs {
        for ids in [&many, &few] {
            let s = service(config);
            let overlaps = keyed(ids, &cached_on);
            let req = SelectionRequest::new(isl).with_overlaps(&overlaps);
            let mut held = Vec::new();
            let mut chosen = std::collections::BTreeSet::new();
            for _ in 0..200 {
                let b = s.select(&req).unwrap();
                let id = b.worker().worker_id;
                let cached = if ids.contains(&id) { cached_on(id) } else { 0 };
                assert_eq!(
                    b.prefill_tokens(),
                    isl as u32 - cached,
                    "worker {id}, temperature {}, margin {}, {} entries",
                    config.router_temperature,
                    config.switch_margin,
                    ids.len()
                );
                chosen.insert(id);
                held.push(b);
            }
            assert!(chosen.len() > 3, "{chosen:?}");
        }
        // 16,777,217 cached tokens on worker 5: an f32 holds 16,777,216.
        // Each booking dropped before the next (the counters cap a
        // booking's prefill at COUNTER_MAX).
        let all: Vec<u64> = (0..workers).map(|w| (w * 37) % workers).collect();
        for ids in [&all, &few] {
            let s = service(config);
            let overlaps = keyed(ids, &|id| if id == 5 { 16_777_217 } else { 0 });
            let req = SelectionRequest::new(20_000_000).with_overlaps(&overlaps);
            let mut fives = 0;
            for _ in 0..200 {
                let b = s.select(&req).unwrap();
                let (id, prefill) = (b.worker().worker_id, b.prefill_tokens());
                if id == 5 {
                    fives += 1;
                    assert_eq!(prefill, 20_000_000 - 16_777_217);
                } else {
                    assert_eq!(prefill, selkie_kernel::fleet::COUNTER_MAX, "worker {id}");
                }
            }
            assert!(fives > 0, "temperature {}", config.router_temperature);
        }
    }
}
