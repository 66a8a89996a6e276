//! The KV cost inputs Dynamo's scheduler computes per worker rank
//! ([`KvRankInputs`]), decided as dynamo-kv-router 1.6.1 decides them
//! (its `DefaultWorkerScorer`): the blocks a request would add per rank, a
//! rank without a load observation, and shared-cache hits credited to every
//! rank with the per-request multiplier. Each case is the issue's
//! hand-computed example; Dynamo's picks are checked against Dynamo itself
//! in `benches/tests/dynamo_parity.rs`.

use selkie::*;

/// A prefill service with workers 1 and 2, one rank each.
fn service() -> WorkerSelectionService {
    let s = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Prefill),
        ServiceConfig::default(),
    );
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    s
}

/// Books `blocks` decode blocks on `worker` (one request of `blocks`
/// blocks, prefill not tracked), held until the returned selection drops.
fn hold(s: &WorkerSelectionService, worker: u64, blocks: usize) -> Selection<'_> {
    let req = SelectionRequest::new(blocks * 16)
        .pinned_to_rank(WorkerWithDpRank::new(worker, 0))
        .with_track_prefill_tokens(false);
    s.select(&req).unwrap()
}

fn cost(costs: &[(WorkerWithDpRank, f64)], worker: u64) -> f64 {
    costs.iter().find(|(w, _)| w.worker_id == worker).unwrap().1
}

const W1: WorkerWithDpRank = WorkerWithDpRank::new(1, 0);
const W2: WorkerWithDpRank = WorkerWithDpRank::new(2, 0);

#[test]
fn blocks_added_per_rank_decide_as_dynamo() {
    let s = service();
    let _held = (hold(&s, 1, 100), hold(&s, 2, 80));
    // Prompt 1,024 tokens (64 blocks): worker 1's active requests hold
    // every block of it, worker 2 would add all 64.
    let added = [(W1, 0), (W2, 64)];
    let inputs = KvRankInputs {
        added_blocks: AddedBlocks::PerRank {
            blocks: &added,
            others: 64,
        },
        ..KvRankInputs::default()
    };
    let req = SelectionRequest::new(1024).with_rank_inputs(&inputs);
    let costs = s.costs(&req).unwrap();
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (164.0, 208.0));
    let sel = s.select(&req).unwrap();
    assert_eq!(sel.worker(), W1);
    // The booking adds what the cost charged: nothing on worker 1.
    let status = s.worker_status(1).unwrap();
    assert_eq!(status.ranks[0].active_decode_blocks, 100);
    drop(sel);
    // selkie's default adds the prompt's 64 blocks on both: worker 2.
    let plain = s.costs(&SelectionRequest::new(1024)).unwrap();
    assert_eq!((cost(&plain, 1), cost(&plain, 2)), (228.0, 208.0));
    assert_eq!(s.select(&SelectionRequest::new(1024)).unwrap().worker(), W2);
}

#[test]
fn a_decode_pool_without_block_hashes_adds_nothing() {
    let s = service();
    let _held = (hold(&s, 1, 10), hold(&s, 2, 10));
    let inputs = KvRankInputs {
        added_blocks: AddedBlocks::Uniform(0),
        ..KvRankInputs::default()
    };
    let req = SelectionRequest::new(1024)
        .with_track_prefill_tokens(false)
        .with_rank_inputs(&inputs);
    let costs = s.costs(&req).unwrap();
    // A tie at 10 + 0, where selkie's default charges 10 + 64 on both.
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (10.0, 10.0));
    let sel = s.select(&req).unwrap();
    let booked = s.worker_status(sel.worker().worker_id).unwrap().ranks[0].active_decode_blocks;
    assert_eq!(booked, 10, "the booking added no decode blocks");
}

#[test]
fn a_rank_without_a_load_observation_is_charged_the_whole_prompt_and_no_decode() {
    let s = service();
    let _held = hold(&s, 1, 64);
    let overlaps = [WorkerOverlap::device(W1, 40, 16), WorkerOverlap::device(W2, 30, 16)];
    let unobserved = [W1];
    let inputs = KvRankInputs {
        unobserved_load: &unobserved,
        ..KvRankInputs::default()
    };
    let req = SelectionRequest::new(1024)
        .with_overlaps(&overlaps)
        .with_rank_inputs(&inputs);
    let costs = s.costs(&req).unwrap();
    // Worker 1: 64 - 40, no decode, nothing added; worker 2: 64 - 30 + 64.
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (24.0, 98.0));
    assert_eq!(s.peek(&req).unwrap().worker(), W1);
    // With its load observed, worker 1 costs 64 - 40 + 64 + 64.
    let observed = SelectionRequest::new(1024).with_overlaps(&overlaps);
    let costs = s.costs(&observed).unwrap();
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (152.0, 98.0));
    assert_eq!(s.peek(&observed).unwrap().worker(), W2);
}

#[test]
fn shared_cache_hits_credit_every_rank_with_the_requests_multiplier() {
    let s = service();
    let _held = hold(&s, 1, 8);
    // Worker 1 holds the prompt's first 10 blocks on device; the shared
    // cache holds blocks 0..40.
    let overlaps = [WorkerOverlap::device(W1, 10, 16)];
    let hits = [std::ops::Range { start: 0, end: 40 }];
    let inputs = KvRankInputs {
        shared_cache_hits: &hits,
        ..KvRankInputs::default()
    };
    let half = KvCostOverrides {
        shared_cache_multiplier: Some(0.5),
        ..KvCostOverrides::default()
    };
    let req = SelectionRequest::new(1024)
        .with_overlaps(&overlaps)
        .with_kv_overrides(half)
        .with_rank_inputs(&inputs);
    let costs = s.costs(&req).unwrap();
    // Worker 1: 64 - 10 - 0.5 * 30 + 8 + 64; worker 2: 64 - 0.5 * 40 + 64.
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (111.0, 108.0));
    assert_eq!(s.peek(&req).unwrap().worker(), W2);
    // Per-entry shared blocks credit only the ranks with an entry.
    let entry = [WorkerOverlap {
        shared_blocks: 30,
        ..WorkerOverlap::device(W1, 10, 16)
    }];
    let by_entry = SelectionRequest::new(1024)
        .with_overlaps(&entry)
        .with_kv_overrides(half);
    let costs = s.costs(&by_entry).unwrap();
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (111.0, 128.0));
    assert_eq!(s.peek(&by_entry).unwrap().worker(), W1);
}

#[test]
fn malformed_shared_cache_hits_are_refused() {
    let s = service();
    let range = |start, end| std::ops::Range { start, end };
    // Reversed, overlapping, empty.
    for hits in [vec![range(4, 2)], vec![range(0, 4), range(2, 6)], vec![range(5, 5)]] {
        let inputs = KvRankInputs {
            shared_cache_hits: &hits,
            ..KvRankInputs::default()
        };
        let err = s
            .select(&SelectionRequest::new(1024).with_rank_inputs(&inputs))
            .unwrap_err();
        assert!(
            matches!(err, SelectionError::InvalidRequest(m) if m.contains("shared_cache_hits")),
            "{hits:?}: {err}"
        );
    }
}

#[test]
fn custom_policies_see_the_same_per_rank_inputs() {
    struct Decode;
    impl WorkerScorer for Decode {
        fn required_worker_inputs(&self) -> WorkerInputs {
            WorkerInputs::LOAD
        }
        fn score(
            &self,
            _: &WorkerSelectionContext<'_>,
            candidates: WorkerCandidates<'_>,
            costs: &mut [f64],
        ) -> Result<(), WorkerSelectionPolicyError> {
            for (i, c) in costs.iter_mut().enumerate() {
                let load = candidates.get(i).unwrap().load().unwrap();
                *c = if load.is_available() {
                    load.decode_cost_blocks()
                } else {
                    -1.0
                };
            }
            Ok(())
        }
    }
    struct First;
    impl WorkerPicker for First {
        fn pick(
            &self,
            _: &WorkerSelectionContext<'_>,
            _: WorkerInputView<'_>,
        ) -> Result<usize, WorkerSelectionPolicyError> {
            Ok(0)
        }
    }
    let policy = WorkerSelectionPolicy::new(
        KvRouterConfig::default(),
        WorkerType::Prefill,
        vec![Box::new(Decode)],
        Box::new(First),
    );
    let s = WorkerSelectionService::new(policy, ServiceConfig::default());
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let _held = hold(&s, 2, 5);
    let added = [(W2, 7)];
    let unobserved = [W1];
    let inputs = KvRankInputs {
        added_blocks: AddedBlocks::PerRank {
            blocks: &added,
            others: 3,
        },
        unobserved_load: &unobserved,
        ..KvRankInputs::default()
    };
    let costs = s.costs(&SelectionRequest::new(1024).with_rank_inputs(&inputs)).unwrap();
    assert_eq!((cost(&costs, 1), cost(&costs, 2)), (-1.0, 12.0));
}
