//! The per-rank KV cost inputs ([`selkie::KvRankInputs`]) against
//! dynamo-kv-router 1.6.1's `DefaultWorkerSelector` on the same two-worker
//! inputs: the blocks a request adds per rank, a rank without a load
//! observation, and shared-cache hits with the per-request multiplier.
//! Every case checks that selkie picks Dynamo's worker with the inputs, and
//! that selkie's defaults without them pick the other one (so the case
//! fails without the input).
//!
//! ```text
//! cargo test -p selkie-benches --features dynamo --test dynamo_inputs_parity
//! ```
use std::collections::HashMap;
use std::ops::Range;

use dynamo_kv_router::protocols::{SharedCacheHits, WorkerId, WorkerWithDpRank as DWorker};
use dynamo_kv_router::test_utils::SimpleWorkerConfig;
use dynamo_kv_router::{
    DefaultWorkerSelector, KvRouterConfig as DConfig, RouterConfigOverride, WorkerLoadProjection, WorkerSelectionInput,
    WorkerSelector,
};
use selkie::*;
use selkie_benches::vs_dynamo::base_request;

const BLOCK: u32 = 16;

/// One worker of a case: the decode blocks it holds (booked in selkie's
/// fleet; Dynamo's load projection when `observed`), whether Dynamo has a
/// load observation for it, the blocks the request would add there, and
/// its device overlap in blocks.
struct Worker {
    decode: u32,
    observed: bool,
    added: u32,
    device: u32,
}

struct Case {
    isl: u32,
    workers: [Worker; 2],
    shared_hits: Vec<Range<u32>>,
    shared_multiplier: Option<f64>,
}

fn dynamo_pick(c: &Case) -> u64 {
    let mut request = base_request(c.isl as usize);
    request.router_config_override = c.shared_multiplier.map(|m| RouterConfigOverride {
        shared_cache_multiplier: Some(m),
        ..Default::default()
    });
    request.shared_cache_hits =
        (!c.shared_hits.is_empty()).then(|| SharedCacheHits::from_ranges(c.shared_hits.clone()));
    let mut workers = HashMap::new();
    for (i, w) in c.workers.iter().enumerate() {
        let id = WorkerId::from(i as u32 + 1);
        let rank = DWorker::from_worker_id(id);
        workers.insert(
            id,
            SimpleWorkerConfig {
                total_kv_blocks: Some(1 << 20),
                ..Default::default()
            },
        );
        if w.device > 0 {
            request
                .overlap
                .effective_overlap_blocks
                .insert(rank, f64::from(w.device));
            request
                .overlap
                .effective_cached_tokens
                .insert(rank, (w.device * BLOCK) as usize);
        }
        if w.observed {
            request.worker_loads.insert(
                rank,
                WorkerLoadProjection {
                    active_decode_blocks: w.decode as usize,
                    additional_active_blocks: w.added as usize,
                    ..Default::default()
                },
            );
        }
    }
    let selector = DefaultWorkerSelector::new(
        Some(DConfig {
            router_temperature: 0.0,
            overlap_score_credit_decay: 0.0,
            ..Default::default()
        }),
        "prefill",
    );
    let input = WorkerSelectionInput::configured(&workers, &request, request.eligibility(), BLOCK);
    selector.select_worker(input).expect("Dynamo selects").worker.worker_id
}

/// selkie's pick for `c`, with the per-rank inputs or with its defaults.
fn selkie_pick(c: &Case, with_inputs: bool) -> u64 {
    let s = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Prefill),
        ServiceConfig::default(),
    );
    let ranks = [WorkerWithDpRank::new(1, 0), WorkerWithDpRank::new(2, 0)];
    let mut held = Vec::new();
    for (w, rank) in c.workers.iter().zip(ranks) {
        s.add_worker(WorkerRecord::new(rank.worker_id)).unwrap();
        if w.decode > 0 {
            let one = SelectionRequest::new((w.decode * BLOCK) as usize)
                .pinned_to_rank(rank)
                .with_track_prefill_tokens(false);
            held.push(s.select(&one).unwrap());
        }
    }
    let overlaps: Vec<WorkerOverlap> = c
        .workers
        .iter()
        .zip(ranks)
        .filter(|(w, _)| w.device > 0)
        .map(|(w, rank)| WorkerOverlap::device(rank, w.device, BLOCK))
        .collect();
    let added: Vec<(WorkerWithDpRank, u32)> = c.workers.iter().zip(ranks).map(|(w, r)| (r, w.added)).collect();
    let unobserved: Vec<WorkerWithDpRank> = c
        .workers
        .iter()
        .zip(ranks)
        .filter(|(w, _)| !w.observed)
        .map(|(_, r)| r)
        .collect();
    let inputs = KvRankInputs {
        added_blocks: AddedBlocks::PerRank {
            blocks: &added,
            others: 0,
        },
        unobserved_load: &unobserved,
        shared_cache_hits: &c.shared_hits,
    };
    let mut req = SelectionRequest::new(c.isl as usize).with_overlaps(&overlaps);
    if let Some(m) = c.shared_multiplier {
        req = req.with_kv_overrides(KvCostOverrides {
            shared_cache_multiplier: Some(m),
            ..KvCostOverrides::default()
        });
    }
    if with_inputs {
        req = req.with_rank_inputs(&inputs);
    }
    s.peek(&req).unwrap().worker().worker_id
}

fn check(name: &str, c: &Case) {
    let dynamo = dynamo_pick(c);
    assert_eq!(selkie_pick(c, true), dynamo, "{name}: selkie with the per-rank inputs");
    assert_ne!(
        selkie_pick(c, false),
        dynamo,
        "{name}: the case must depend on the inputs"
    );
}

#[test]
fn blocks_added_per_rank() {
    let w = |decode, added| Worker {
        decode,
        observed: true,
        added,
        device: 0,
    };
    check(
        "added blocks",
        &Case {
            isl: 1024,
            workers: [w(100, 0), w(80, 64)],
            shared_hits: Vec::new(),
            shared_multiplier: None,
        },
    );
}

#[test]
fn a_rank_without_a_load_observation() {
    check(
        "no load observation",
        &Case {
            isl: 1024,
            workers: [
                Worker {
                    decode: 64,
                    observed: false,
                    added: 64,
                    device: 40,
                },
                Worker {
                    decode: 0,
                    observed: true,
                    added: 64,
                    device: 30,
                },
            ],
            shared_hits: Vec::new(),
            shared_multiplier: None,
        },
    );
}

#[test]
fn shared_cache_hits_on_every_rank() {
    check(
        "shared-cache hits",
        &Case {
            isl: 1024,
            workers: [
                Worker {
                    decode: 8,
                    observed: true,
                    added: 64,
                    device: 10,
                },
                Worker {
                    decode: 0,
                    observed: true,
                    added: 64,
                    device: 0,
                },
            ],
            shared_hits: vec![Range { start: 0, end: 40 }],
            shared_multiplier: Some(0.5),
        },
    );
}
