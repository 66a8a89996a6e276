//! The fast path of a plain selection (no pin, session, constraint or
//! explanation, under a built-in policy) books the row the general path
//! would choose, and a booking it is refused falls back to the other rows.

use selkie::*;

fn service(policy: WorkerSelectionPolicy, attempts: u32) -> WorkerSelectionService {
    WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(7),
            max_booking_attempts: attempts,
            ..ServiceConfig::default()
        },
    )
}

/// Plain requests (the fast path) and explained ones (the general path: an
/// explanation asks for the runner-up) on two services with the same seed
/// and workers choose the same workers with the same explanation, booking
/// the same load, while the load they add changes the next choices.
#[test]
fn plain_selections_choose_as_the_general_path() {
    let policies: [fn() -> WorkerSelectionPolicy; 7] = [
        WorkerSelectionPolicy::random,
        WorkerSelectionPolicy::round_robin,
        WorkerSelectionPolicy::power_of_two,
        WorkerSelectionPolicy::least_loaded,
        || WorkerSelectionPolicy::device_aware_weighted(DeviceAwareConfig::default()),
        || WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        || {
            let config = KvRouterConfig {
                router_temperature: 0.7,
                ..Default::default()
            };
            WorkerSelectionPolicy::kv(config, WorkerType::Aggregated)
        },
    ];
    let overlaps: Vec<_> = (0..50)
        .step_by(7)
        .map(|id| WorkerOverlap::device(WorkerWithDpRank::new(id, 0), id as u32 % 5, 16))
        .collect();
    for policy in policies {
        // One rank per worker, then two (power-of-two and least-loaded
        // then choose by worker).
        for ranks in [1, 2] {
            let (fast, general) = (service(policy(), 4), service(policy(), 4));
            for s in [&fast, &general] {
                for id in 0..50 {
                    let record = WorkerRecord::new(id)
                        .with_dp(0, ranks)
                        .with_capacity_weight(1.0 + (id % 3) as f32);
                    let record = if id % 8 == 7 {
                        record.with_device(DeviceKind::Cpu)
                    } else {
                        record
                    };
                    s.add_worker(record).unwrap();
                }
            }
            let (mut held_fast, mut held_general) = (Vec::new(), Vec::new());
            for i in 0..300 {
                let req = SelectionRequest::new(100 + i).with_overlaps(&overlaps);
                let req = if i % 2 == 0 {
                    req.with_required_cache_hits(3)
                } else {
                    req
                };
                let a = fast.select(&req).unwrap();
                let b = general.select(&req.explained()).unwrap();
                let name = format!("{} with {ranks} ranks", fast.policy().name());
                assert_eq!(a.worker(), b.worker(), "{name}: selection {i}");
                let (ea, eb) = (a.explanation(), b.explanation());
                assert_eq!(
                    (ea.route, ea.branch, ea.cost, ea.candidates, ea.temperature),
                    (eb.route, eb.branch, eb.cost, eb.candidates, eb.temperature),
                    "{name}: selection {i}"
                );
                assert_eq!(ea.runner_up, None, "{name}: a plain request computes no runner-up");
                assert_eq!(
                    (a.prefill_tokens(), a.decode_blocks()),
                    (b.prefill_tokens(), b.decode_blocks())
                );
                // Every third booking is kept, so the loads differ per worker.
                if i % 3 == 0 {
                    held_fast.push(a);
                    held_general.push(b);
                }
            }
        }
    }
}

/// A worker at its admission limit refuses the fast path's booking; the
/// selection then books another row (the refusal counts as one attempt).
#[test]
fn a_refused_fast_booking_falls_back_to_the_other_rows() {
    for policy in [
        WorkerSelectionPolicy::random,
        WorkerSelectionPolicy::round_robin,
        WorkerSelectionPolicy::power_of_two,
        WorkerSelectionPolicy::least_loaded,
    ] {
        let s = service(policy(), 4);
        s.add_worker(WorkerRecord::new(0).with_max_active_requests(1)).unwrap();
        s.add_worker(WorkerRecord::new(1)).unwrap();
        let full = s.select(&SelectionRequest::new(16).pinned_to_worker(0)).unwrap();
        let held: Vec<_> = (0..40).map(|_| s.select(&SelectionRequest::new(16)).unwrap()).collect();
        assert!(
            held.iter().all(|b| b.worker().worker_id == 1),
            "{}: only worker 1 has room",
            s.policy().name()
        );
        drop((held, full));
    }
    // With one attempt, a draw of the full worker is the request's only try.
    let s = service(WorkerSelectionPolicy::round_robin(), 1);
    s.add_worker(WorkerRecord::new(0).with_max_active_requests(1)).unwrap();
    s.add_worker(WorkerRecord::new(1)).unwrap();
    let _full = s.select(&SelectionRequest::new(16).pinned_to_worker(0)).unwrap();
    let results: Vec<_> = (0..4).map(|_| s.select(&SelectionRequest::new(16))).collect();
    assert!(results
        .iter()
        .any(|r| matches!(r, Err(SelectionError::AllEligibleWorkersOverloaded))));
    assert!(results.iter().flatten().all(|b| b.worker().worker_id == 1));
}

/// A plain booking holds `request_blocks` decode blocks at any block size:
/// a power of two (a shift on the fast path), 1, or another size (a
/// division), at prompt lengths on, around and between block boundaries.
#[test]
fn plain_bookings_hold_the_request_blocks_at_any_block_size() {
    for block_size in [1, 2, 10, 16, 64, 100, 1 << 20, 1 << 31, u32::MAX] {
        let s = WorkerSelectionService::new(
            WorkerSelectionPolicy::random(),
            ServiceConfig {
                block_size,
                seed: Some(7),
                ..ServiceConfig::default()
            },
        );
        s.add_worker(WorkerRecord::new(0)).unwrap();
        let b = block_size as usize;
        for tokens in [0, 1, 15, 16, 17, b.saturating_sub(1), b, b + 1, 3 * b + 5, 1 << 40] {
            let req = SelectionRequest::new(tokens);
            let booked = s.select(&req).unwrap();
            let expected = u32::try_from(req.request_blocks(block_size)).unwrap_or(u32::MAX);
            assert_eq!(
                booked.decode_blocks(),
                expected.min(16_777_215),
                "{tokens} tokens at {block_size}"
            );
        }
    }
}

/// A block size of 0 refuses every selection, plain (the fast path) or
/// not, under a policy that draws (random) and one that scans
/// (least-loaded), and books nothing.
#[test]
fn a_block_size_of_0_refuses_every_selection() {
    for policy in [WorkerSelectionPolicy::random(), WorkerSelectionPolicy::least_loaded()] {
        let s = WorkerSelectionService::new(
            policy,
            ServiceConfig {
                block_size: 0,
                ..ServiceConfig::default()
            },
        );
        s.add_worker(WorkerRecord::new(0)).unwrap();
        for req in [SelectionRequest::new(64), SelectionRequest::new(64).explained()] {
            match s.select(&req) {
                Err(SelectionError::InvalidRequest(why)) => assert_eq!(why, "block_size is 0"),
                other => panic!("a block size of 0 selected: {other:?}"),
            }
        }
        assert_eq!(s.worker_status(0).unwrap().ranks[0].active_requests, 0);
    }
}
