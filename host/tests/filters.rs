//! Hard filters and the distinct selection errors.

use selkie::*;

fn svc(policy: WorkerSelectionPolicy) -> WorkerSelectionService {
    WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(3),
            ..ServiceConfig::default()
        },
    )
}

/// Workers chosen over `n` selections (each released at once).
fn chosen(s: &WorkerSelectionService, req: &SelectionRequest<'_>, n: usize) -> std::collections::BTreeSet<u64> {
    (0..n).map(|_| s.select(req).unwrap().worker().worker_id).collect()
}

#[test]
fn empty_fleet_is_no_endpoints() {
    let s = svc(WorkerSelectionPolicy::random());
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::NoEndpoints
    );
    s.add_worker(WorkerRecord::new(1).with_state(WorkerState::Draining))
        .unwrap();
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::NoEndpoints
    );
}

#[test]
fn allowlist_keeps_only_listed_workers() {
    let s = svc(WorkerSelectionPolicy::random());
    for id in 1..=5 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let allowed = [2, 4];
    assert_eq!(
        chosen(&s, &SelectionRequest::new(1).with_allowed_workers(&allowed), 100),
        [2, 4].into()
    );
    let none = [99];
    assert!(matches!(
        s.select(&SelectionRequest::new(1).with_allowed_workers(&none)),
        Err(SelectionError::NoEligibleWorkers { .. })
    ));
}

#[test]
fn worker_pin_and_rank_pin() {
    let s = svc(WorkerSelectionPolicy::least_loaded());
    s.add_worker(WorkerRecord::new(1).with_dp(2, 2)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let req = SelectionRequest::new(1).pinned_to_worker(1);
    let a = s.select(&req).unwrap();
    let b = s.select(&req).unwrap();
    assert_eq!((a.worker().worker_id, b.worker().worker_id), (1, 1));
    assert_ne!(
        a.worker().dp_rank,
        b.worker().dp_rank,
        "a worker pin spreads over the worker's ranks"
    );
    assert_eq!(a.explanation().route, Route::Pinned);
    for _ in 0..5 {
        let w = s
            .select(&SelectionRequest::new(1).pinned_to_rank(WorkerWithDpRank::new(1, 3)))
            .unwrap()
            .worker();
        assert_eq!(w, WorkerWithDpRank::new(1, 3));
    }
    assert_eq!(
        s.select(&SelectionRequest::new(1).pinned_to_rank(WorkerWithDpRank::new(1, 4)))
            .unwrap_err(),
        SelectionError::DpRankUnavailable {
            worker_id: 1,
            dp_rank: 4,
            start: 2,
            end: 4
        }
    );
    assert_eq!(
        s.select(&SelectionRequest::new(1).pinned_to_worker(42)).unwrap_err(),
        SelectionError::PinnedWorkerUnavailable {
            worker_id: 42,
            reason: UnavailableReason::Unknown
        }
    );
    let allowed = [2];
    assert_eq!(
        s.select(
            &SelectionRequest::new(1)
                .pinned_to_worker(1)
                .with_allowed_workers(&allowed)
        )
        .unwrap_err(),
        SelectionError::PinnedWorkerNotAllowed { worker_id: 1 }
    );
}

#[test]
fn required_taints_must_all_be_present() {
    let s = svc(WorkerSelectionPolicy::random());
    s.add_worker(WorkerRecord::new(1).with_taint("gpu=h200")).unwrap();
    s.add_worker(WorkerRecord::new(2).with_taint("gpu=h200").with_taint("zone=a"))
        .unwrap();
    s.add_worker(WorkerRecord::new(3).with_taint("zone=a")).unwrap();
    let both = ["gpu=h200", "zone=a"];
    assert_eq!(
        chosen(&s, &SelectionRequest::new(1).with_required_taints(&both), 50),
        [2].into()
    );
    let one = ["gpu=h200"];
    assert_eq!(
        chosen(&s, &SelectionRequest::new(1).with_required_taints(&one), 100),
        [1, 2].into()
    );
    let missing = ["gpu=b200"];
    assert!(matches!(
        s.select(&SelectionRequest::new(1).with_required_taints(&missing)),
        Err(SelectionError::NoEligibleWorkers { rejected: 3 })
    ));
    assert_eq!(
        s.select(&SelectionRequest::new(1).with_required_taints(&both).pinned_to_worker(3))
            .unwrap_err(),
        SelectionError::PinnedWorkerUnavailable {
            worker_id: 3,
            reason: UnavailableReason::MissingRequiredTaint
        }
    );
}

#[test]
fn draining_and_cordoned_workers_take_nothing_new() {
    let s = svc(WorkerSelectionPolicy::random());
    for id in 1..=3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    s.set_worker_state(1, WorkerState::Draining).unwrap();
    s.set_worker_state(2, WorkerState::Cordoned).unwrap();
    assert_eq!(chosen(&s, &SelectionRequest::new(1), 50), [3].into());
    assert_eq!(
        s.select(&SelectionRequest::new(1).pinned_to_worker(1)).unwrap_err(),
        SelectionError::PinnedWorkerUnavailable {
            worker_id: 1,
            reason: UnavailableReason::Draining
        }
    );
    assert_eq!(
        s.select(&SelectionRequest::new(1).pinned_to_worker(2)).unwrap_err(),
        SelectionError::PinnedWorkerUnavailable {
            worker_id: 2,
            reason: UnavailableReason::Cordoned
        }
    );
    s.set_worker_state(1, WorkerState::Live).unwrap();
    assert_eq!(chosen(&s, &SelectionRequest::new(1), 100), [1, 3].into());
    assert!(matches!(
        s.set_worker_state(9, WorkerState::Live),
        Err(DiscoveryError::UnknownWorker { worker_id: 9 })
    ));
}

#[test]
fn busy_thresholds_make_workers_overloaded() {
    let s = svc(WorkerSelectionPolicy::random());
    // Worker 1: busy above 40 active prefill tokens. Worker 2: above 4 decode blocks.
    let t1 = BusyThresholds {
        active_prefill_tokens: Some(40),
        ..BusyThresholds::NONE
    };
    let t2 = BusyThresholds {
        active_decode_blocks: Some(4),
        ..BusyThresholds::NONE
    };
    s.add_worker(WorkerRecord::new(1).with_busy_thresholds(t1)).unwrap();
    s.add_worker(WorkerRecord::new(2).with_busy_thresholds(t2)).unwrap();
    let pin1 = SelectionRequest::new(48).pinned_to_worker(1); // 48 prefill tokens, 3 blocks
    let a = s.select(&pin1).unwrap();
    assert!(s.worker_status(1).unwrap().overloaded);
    assert_eq!(
        s.select(&pin1).unwrap_err(),
        SelectionError::PinnedWorkerOverloaded { worker_id: 1 }
    );
    assert_eq!(
        chosen(&s, &SelectionRequest::new(1), 30),
        [2].into(),
        "busy worker 1 is skipped"
    );
    let b = s.select(&SelectionRequest::new(80).pinned_to_worker(2)).unwrap(); // 5 decode blocks
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::AllEligibleWorkersOverloaded
    );
    assert!(s.select(&SelectionRequest::new(1)).unwrap_err().is_overload());
    drop(a);
    assert!(!s.worker_status(1).unwrap().overloaded);
    assert_eq!(chosen(&s, &SelectionRequest::new(1), 30), [1].into());
    drop(b);
}

#[test]
fn prefill_fraction_threshold_uses_the_batch_budget() {
    let s = svc(WorkerSelectionPolicy::random());
    let t = BusyThresholds {
        prefill_token_fraction: Some(0.5),
        ..BusyThresholds::NONE
    };
    s.add_worker(
        WorkerRecord::new(1)
            .with_max_num_batched_tokens(100)
            .with_busy_thresholds(t),
    )
    .unwrap();
    let _a = s.select(&SelectionRequest::new(50)).unwrap(); // 50 is not > 0.5 * 100
    assert!(!s.worker_status(1).unwrap().overloaded);
    let _b = s.select(&SelectionRequest::new(1)).unwrap(); // 51 > 50
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::AllEligibleWorkersOverloaded
    );
}

#[test]
fn default_thresholds_and_the_manual_overload_mark() {
    let cfg = ServiceConfig {
        default_busy_thresholds: BusyThresholds {
            active_decode_blocks: Some(0),
            ..BusyThresholds::NONE
        },
        seed: Some(1),
        ..ServiceConfig::default()
    };
    let s = WorkerSelectionService::new(WorkerSelectionPolicy::random(), cfg);
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2).with_busy_thresholds(BusyThresholds::NONE))
        .unwrap();
    let _a = s.select(&SelectionRequest::new(16).pinned_to_worker(1)).unwrap();
    assert_eq!(chosen(&s, &SelectionRequest::new(1), 20), [2].into());
    s.set_overloaded(2, true).unwrap();
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::AllEligibleWorkersOverloaded
    );
    s.set_overloaded(2, false).unwrap();
    assert!(s.select(&SelectionRequest::new(1)).is_ok());
}

#[test]
fn admission_limit_is_enforced_by_the_booking() {
    let s = svc(WorkerSelectionPolicy::round_robin());
    s.add_worker(WorkerRecord::new(1).with_max_active_requests(1)).unwrap();
    s.add_worker(WorkerRecord::new(2).with_max_active_requests(1)).unwrap();
    let a = s.select(&SelectionRequest::new(1)).unwrap();
    let b = s.select(&SelectionRequest::new(1)).unwrap();
    assert_ne!(a.worker(), b.worker());
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::AllEligibleWorkersOverloaded
    );
    assert_eq!(
        s.select(&SelectionRequest::new(1).pinned_to_worker(1)).unwrap_err(),
        SelectionError::PinnedWorkerOverloaded { worker_id: 1 }
    );
    drop(a);
    assert!(s.select(&SelectionRequest::new(1)).is_ok());
}

#[test]
fn lora_prefers_loaded_workers_and_can_be_required() {
    let s = svc(WorkerSelectionPolicy::random());
    s.add_worker(WorkerRecord::new(1).with_lora("sql")).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    assert_eq!(chosen(&s, &SelectionRequest::new(1).with_lora("sql"), 40), [1].into());
    // Nobody has it: any worker (it loads lazily) ...
    assert_eq!(
        chosen(&s, &SelectionRequest::new(1).with_lora("chat"), 100),
        [1, 2].into()
    );
    // ... a pin is kept even without the adapter.
    assert_eq!(
        s.select(&SelectionRequest::new(1).with_lora("sql").pinned_to_worker(2))
            .unwrap()
            .worker()
            .worker_id,
        2
    );

    let strict = WorkerSelectionService::new(
        WorkerSelectionPolicy::random(),
        ServiceConfig {
            lora_required: true,
            ..ServiceConfig::default()
        },
    );
    strict.add_worker(WorkerRecord::new(1).with_lora("sql")).unwrap();
    assert!(matches!(
        strict.select(&SelectionRequest::new(1).with_lora("chat")),
        Err(SelectionError::NoEligibleWorkers { .. })
    ));
}

#[test]
fn invalid_requests_are_typed_errors() {
    let s = svc(WorkerSelectionPolicy::kv(
        KvRouterConfig::default(),
        WorkerType::Aggregated,
    ));
    s.add_worker(WorkerRecord::new(1)).unwrap();
    for t in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            s.select(&SelectionRequest::new(1).with_temperature(t)),
            Err(SelectionError::InvalidRequest(_))
        ));
    }
    let bad = KvCostOverrides {
        prefill_load_scale: Some(f64::NAN),
        ..Default::default()
    };
    assert!(matches!(
        s.select(&SelectionRequest::new(1).with_kv_overrides(bad)),
        Err(SelectionError::InvalidRequest(_))
    ));
}
