//! The built-in modes, data-parallel aggregation, and the KV
//! policy against values worked out from the KV cost formula.

use std::collections::BTreeMap;
use std::sync::Arc;

use selkie::*;

fn svc(policy: WorkerSelectionPolicy, seed: u64) -> WorkerSelectionService {
    WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(seed),
            ..ServiceConfig::default()
        },
    )
}

fn counts(s: &WorkerSelectionService, req: &SelectionRequest<'_>, n: usize) -> BTreeMap<u64, usize> {
    let mut m = BTreeMap::new();
    for _ in 0..n {
        *m.entry(s.select(req).unwrap().worker().worker_id).or_insert(0) += 1;
    }
    m
}

#[test]
fn random_is_uniform_over_eligible_rows() {
    let s = svc(WorkerSelectionPolicy::random(), 1);
    for id in 0..4 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    s.set_worker_state(3, WorkerState::Cordoned).unwrap();
    let c = counts(&s, &SelectionRequest::new(1), 3000);
    assert_eq!(c.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(c.values().all(|&n| (850..1150).contains(&n)), "{c:?}");
}

#[test]
fn round_robin_cycles_and_peek_does_not_advance() {
    let s = svc(WorkerSelectionPolicy::round_robin(), 1);
    for id in [10, 20, 30] {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let req = SelectionRequest::new(1);
    let first = s.peek(&req).unwrap().worker();
    assert_eq!(s.peek(&req).unwrap().worker(), first, "peek is stable");
    let order: Vec<u64> = (0..6).map(|_| s.select(&req).unwrap().worker().worker_id).collect();
    assert_eq!(order[0], first.worker_id, "select takes what peek showed");
    assert_eq!(&order[..3], &order[3..]);
    let mut round = order[..3].to_vec();
    round.sort();
    assert_eq!(round, vec![10, 20, 30]);
}

#[test]
fn round_robin_is_fair_under_concurrent_callers() {
    let s = Arc::new(svc(WorkerSelectionPolicy::round_robin(), 1));
    for id in 0..4 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut m = BTreeMap::new();
                for _ in 0..250 {
                    *m.entry(s.select(&SelectionRequest::new(1)).unwrap().worker().worker_id)
                        .or_insert(0usize) += 1;
                }
                m
            })
        })
        .collect();
    let mut total = BTreeMap::new();
    for t in threads {
        for (k, v) in t.join().unwrap() {
            *total.entry(k).or_insert(0) += v;
        }
    }
    assert_eq!(total, (0..4).map(|k| (k, 250)).collect(), "each worker once per round");
}

#[test]
fn least_loaded_takes_the_fewest_in_flight_with_uniform_ties() {
    let s = svc(WorkerSelectionPolicy::least_loaded(), 5);
    for id in 0..3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    // Book 2 on worker 0 and 1 on worker 1: worker 2 must win.
    let _held: Vec<_> = [0, 0, 1]
        .iter()
        .map(|&w| s.select(&SelectionRequest::new(1).pinned_to_worker(w)).unwrap())
        .collect();
    for _ in 0..20 {
        assert_eq!(s.select(&SelectionRequest::new(1)).unwrap().worker().worker_id, 2);
    }
    // Booked requests count: holding one on worker 2 ties it with worker 1.
    let _h = s.select(&SelectionRequest::new(1)).unwrap();
    let c = counts(&s, &SelectionRequest::new(1), 2000);
    assert_eq!(c.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
    assert!(c.values().all(|&n| (850..1150).contains(&n)), "ties are uniform: {c:?}");
}

#[test]
fn least_loaded_divides_by_capacity_weight() {
    let s = svc(WorkerSelectionPolicy::least_loaded(), 5);
    s.add_worker(WorkerRecord::new(1).with_capacity_weight(3.0)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let held: Vec<_> = (0..8).map(|_| s.select(&SelectionRequest::new(1)).unwrap()).collect();
    let on1 = held.iter().filter(|h| h.worker().worker_id == 1).count();
    assert_eq!(on1, 6, "weight 3 takes three times the load");
}

#[test]
fn power_of_two_prefers_the_lower_of_two_distinct_draws() {
    let s = svc(WorkerSelectionPolicy::power_of_two(), 9);
    for id in 0..3 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let _held: Vec<_> = [1, 2]
        .iter()
        .map(|&w| s.select(&SelectionRequest::new(1).pinned_to_worker(w)).unwrap())
        .collect();
    // Worker 0 (load 0) wins whenever drawn: in 2 of the 3 distinct pairs.
    let mut zero = 0;
    for _ in 0..3000 {
        let w = s.select(&SelectionRequest::new(1)).unwrap().worker().worker_id;
        zero += usize::from(w == 0);
    }
    assert!((1850..2150).contains(&zero), "{zero}");
    // Two rows: both are always drawn, so the lighter always wins.
    let t = svc(WorkerSelectionPolicy::power_of_two(), 9);
    t.add_worker(WorkerRecord::new(1)).unwrap();
    t.add_worker(WorkerRecord::new(2)).unwrap();
    let _h = t.select(&SelectionRequest::new(1).pinned_to_worker(1)).unwrap();
    for _ in 0..50 {
        assert_eq!(t.select(&SelectionRequest::new(1)).unwrap().worker().worker_id, 2);
    }
}

#[test]
fn data_parallel_workers_are_chosen_by_summed_rank_load() {
    // Worker 1 has 4 ranks with one request each (sum 4); worker 2 has one
    // rank with 2. Per row, a rank of worker 1 (load 1) would win; per
    // worker, worker 2 (2 < 4) does.
    for policy in [
        WorkerSelectionPolicy::least_loaded(),
        WorkerSelectionPolicy::power_of_two(),
    ] {
        let s = svc(policy, 11);
        s.add_worker(WorkerRecord::new(1).with_dp(0, 4)).unwrap();
        s.add_worker(WorkerRecord::new(2)).unwrap();
        let mut held = Vec::new();
        for r in 0..4 {
            held.push(
                s.select(&SelectionRequest::new(1).pinned_to_rank(WorkerWithDpRank::new(1, r)))
                    .unwrap(),
            );
        }
        for _ in 0..2 {
            held.push(s.select(&SelectionRequest::new(1).pinned_to_worker(2)).unwrap());
        }
        for _ in 0..20 {
            let p = s.peek(&SelectionRequest::new(1)).unwrap();
            assert_eq!(p.worker.worker_id, 2, "{}", p.explanation);
            assert!(matches!(
                p.explanation.branch,
                Branch::LeastLoadedWorkerThenRank | Branch::PowerOfTwoWorkerThenRank
            ));
        }
        // Then the least-loaded rank within the worker.
        held.push(
            s.select(&SelectionRequest::new(1).pinned_to_rank(WorkerWithDpRank::new(1, 0)))
                .unwrap(),
        );
        held.truncate(0);
        let _a = s
            .select(&SelectionRequest::new(1).pinned_to_rank(WorkerWithDpRank::new(1, 0)))
            .unwrap();
        let _b = s.select(&SelectionRequest::new(1).pinned_to_worker(2)).unwrap();
        let _c = s.select(&SelectionRequest::new(1).pinned_to_worker(2)).unwrap();
        let p = s.peek(&SelectionRequest::new(1)).unwrap();
        assert_eq!(p.worker.worker_id, 1);
        assert_ne!(p.worker.dp_rank, 0, "the idle ranks, not the busy one");
    }
}

#[test]
fn device_aware_weighted_follows_the_cpu_share_rule() {
    let s = svc(
        WorkerSelectionPolicy::device_aware_weighted(DeviceAwareConfig {
            non_cpu_to_cpu_ratio: 2,
            ..DeviceAwareConfig::default()
        }),
        2,
    );
    s.add_worker(WorkerRecord::new(1).with_device(DeviceKind::Cpu)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    s.add_worker(WorkerRecord::new(3)).unwrap();
    // All idle: allowed = 0, 0 < 0 is false: an accelerator.
    let p = s.peek(&SelectionRequest::new(1)).unwrap();
    assert_eq!(p.explanation.branch, Branch::DeviceAwareAccelerator);
    assert_ne!(p.worker.worker_id, 1);
    // Accelerators at 4 + 4: allowed = 8 * 1 / (2 * 2) = 2; CPU load 0 < 2: CPU.
    let mut held = Vec::new();
    for w in [2, 2, 2, 2, 3, 3, 3, 3] {
        held.push(s.select(&SelectionRequest::new(1).pinned_to_worker(w)).unwrap());
    }
    let p = s.peek(&SelectionRequest::new(1)).unwrap();
    assert_eq!((p.worker.worker_id, p.explanation.branch), (1, Branch::DeviceAwareCpu));
    // CPU at 2: 2 < 2 is false: back to the accelerators.
    held.push(s.select(&SelectionRequest::new(1)).unwrap());
    held.push(s.select(&SelectionRequest::new(1)).unwrap());
    assert_eq!(s.worker_status(1).unwrap().ranks[0].active_requests, 2);
    assert_eq!(
        s.peek(&SelectionRequest::new(1)).unwrap().explanation.branch,
        Branch::DeviceAwareAccelerator
    );
    // A row with the required cache hits wins outright.
    let hits = [WorkerOverlap::device(WorkerWithDpRank::new(3, 0), 2, 16)];
    let p = s
        .peek(
            &SelectionRequest::new(1)
                .with_overlaps(&hits)
                .with_required_cache_hits(2),
        )
        .unwrap();
    assert_eq!(
        (p.worker.worker_id, p.explanation.branch),
        (3, Branch::DeviceAwareCacheHit)
    );
    let p = s
        .peek(
            &SelectionRequest::new(1)
                .with_overlaps(&hits)
                .with_required_cache_hits(3),
        )
        .unwrap();
    assert_ne!(p.explanation.branch, Branch::DeviceAwareCacheHit);
}

#[test]
fn direct_routes_only_to_the_named_worker() {
    let s = svc(WorkerSelectionPolicy::direct(), 1);
    s.add_worker(WorkerRecord::new(1).with_max_active_requests(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::DirectWorkerMissing
    );
    let a = s.select(&SelectionRequest::new(1).pinned_to_worker(1)).unwrap();
    assert_eq!((a.worker().worker_id, a.explanation().branch), (1, Branch::Direct));
    // No fallback to worker 2 when worker 1 is full.
    assert_eq!(
        s.select(&SelectionRequest::new(1).pinned_to_worker(1)).unwrap_err(),
        SelectionError::PinnedWorkerOverloaded { worker_id: 1 }
    );
}

// ---- KV parity with the formula -------------------------------------------

struct Row {
    active_prefill: f64,
    active_decode: f64,
    active_requests: f64,
    device: f64,
    host: f64,
    disk: f64,
    cached: f64,
    taint_sum: f64,
}

/// The KV cost formula, written out in f64.
#[allow(clippy::too_many_arguments)]
fn spec_cost(
    c: &KvRouterConfig,
    decode_role: bool,
    track: bool,
    isl: f64,
    block: f64,
    min_prefill: f64,
    preferred: bool,
    r: &Row,
) -> f64 {
    let request_blocks = (isl / block).ceil();
    let k = c.overlap_score_credit_decay;
    let decay = if track && k > 0.0 {
        1.0 / (1.0 + k * ((r.active_prefill - min_prefill) / block) / request_blocks.max(1.0))
    } else {
        1.0
    };
    let credit =
        c.overlap_score_credit * decay * r.device + c.host_cache_hit_weight * r.host + c.disk_cache_hit_weight * r.disk;
    let req = c.decode_active_request_weight * r.active_requests;
    let decode_cost_blocks = r.active_decode + request_blocks;
    let cost = if decode_role && !track && c.overlap_score_credit > 0.0 {
        (decode_cost_blocks - credit).max(0.0) + req
    } else {
        let raw = if !track {
            0.0
        } else {
            r.active_prefill + (isl - r.cached).max(0.0) + r.cached
        };
        c.prefill_load_scale * (raw / block - credit).max(0.0) + decode_cost_blocks + req
    };
    if preferred {
        cost * (-r.taint_sum.tanh()).exp()
    } else {
        cost
    }
}

#[test]
fn kv_policy_matches_spec_section_4_on_a_dp_fleet_with_taints_and_tiers() {
    let config = KvRouterConfig {
        overlap_score_credit_decay: 0.5,
        decode_active_request_weight: 2.0,
        prefill_load_scale: 1.5,
        ..KvRouterConfig::default()
    };
    let block = 16.0;
    for (role, track) in [
        (WorkerType::Prefill, true),
        (WorkerType::Decode, false),
        (WorkerType::Aggregated, true),
    ] {
        let s = svc(WorkerSelectionPolicy::kv(config, role), 21);
        s.add_worker(WorkerRecord::new(1).with_dp(0, 2).with_taint("rack-a"))
            .unwrap();
        s.add_worker(WorkerRecord::new(2).with_taint("rack-a").with_taint("zone-b"))
            .unwrap();
        s.add_worker(WorkerRecord::new(3).with_dp(4, 2)).unwrap();
        // Load: (1,0) 64 prefill tokens, 4 blocks, 1 request; (3,5) 0 tokens, 10 blocks, 1 request;
        // (2,0) 2 requests of 32 tokens (2 blocks each).
        let mut held = vec![
            s.select(&SelectionRequest::new(64).pinned_to_rank(WorkerWithDpRank::new(1, 0)))
                .unwrap(),
            s.select(
                &SelectionRequest::new(160)
                    .pinned_to_rank(WorkerWithDpRank::new(3, 5))
                    .with_track_prefill_tokens(false),
            )
            .unwrap(),
        ];
        for _ in 0..2 {
            held.push(s.select(&SelectionRequest::new(32).pinned_to_worker(2)).unwrap());
        }
        let w = WorkerWithDpRank::new;
        let overlaps = [
            WorkerOverlap {
                worker: w(1, 0),
                device_blocks: 4,
                host_blocks: 2,
                disk_blocks: 1,
                shared_blocks: 0,
                cached_tokens: 112,
            },
            WorkerOverlap {
                worker: w(1, 1),
                device_blocks: 8,
                cached_tokens: 128,
                ..Default::default()
            },
            WorkerOverlap {
                worker: w(2, 0),
                host_blocks: 6,
                disk_blocks: 4,
                cached_tokens: 160,
                ..Default::default()
            },
            WorkerOverlap {
                worker: w(3, 4),
                device_blocks: 12,
                cached_tokens: 192,
                ..Default::default()
            },
        ];
        let prefs = [("rack-a", 0.5f32), ("zone-b", -0.3f32)];
        let isl = 256.0;
        let req = SelectionRequest::new(256)
            .with_overlaps(&overlaps)
            .with_preferred_taints(&prefs)
            .with_track_prefill_tokens(track);
        let row = |ap: f64, ad: f64, ar: f64, o: Option<&WorkerOverlap>, taint_sum: f64| Row {
            active_prefill: ap,
            active_decode: ad,
            active_requests: ar,
            device: o.map_or(0.0, |o| o.device_blocks as f64),
            host: o.map_or(0.0, |o| o.host_blocks as f64),
            disk: o.map_or(0.0, |o| o.disk_blocks as f64),
            cached: o.map_or(0.0, |o| o.cached_tokens as f64),
            taint_sum,
        };
        let rows = [
            (w(1, 0), row(64.0, 4.0, 1.0, Some(&overlaps[0]), 0.5)),
            (w(1, 1), row(0.0, 0.0, 0.0, Some(&overlaps[1]), 0.5)),
            (w(2, 0), row(64.0, 4.0, 2.0, Some(&overlaps[2]), 0.5 - 0.3)),
            (w(3, 4), row(0.0, 0.0, 0.0, Some(&overlaps[3]), 0.0)),
            (w(3, 5), row(0.0, 10.0, 1.0, None, 0.0)),
        ];
        let min_prefill = rows.iter().map(|r| r.1.active_prefill).fold(f64::INFINITY, f64::min);
        let decode_role = role != WorkerType::Prefill; // Dynamo labels aggregated pools "decode"
        let expected: Vec<(WorkerWithDpRank, f64)> = rows
            .iter()
            .map(|(w, r)| {
                (
                    *w,
                    spec_cost(&config, decode_role, track, isl, block, min_prefill, true, r),
                )
            })
            .collect();
        let got = s.costs(&req).unwrap();
        assert_eq!(got.len(), expected.len());
        for ((gw, g), (ew, e)) in got.iter().zip(&expected) {
            assert_eq!(gw, ew);
            assert!(
                (g - e).abs() <= 1e-6 * e.abs().max(1.0),
                "{role:?} {gw}: got {g}, the formula says {e}"
            );
        }
        let best = expected.iter().map(|e| e.1).fold(f64::INFINITY, f64::min);
        let p = s.peek(&req).unwrap();
        let e = expected.iter().find(|e| e.0 == p.worker).unwrap().1;
        assert!(
            (e - best).abs() <= 1e-6 * best.abs().max(1.0),
            "{role:?}: picked {} at {e}, minimum {best}",
            p.worker
        );
        assert_eq!(p.explanation.branch, Branch::KvMinimum);
        // Pinned requests get no taint multiplier.
        let pinned = s.costs(&req.pinned_to_rank(w(1, 1))).unwrap();
        let plain = spec_cost(&config, decode_role, track, isl, block, 0.0, false, &rows[1].1);
        assert_eq!(pinned.len(), 1);
        assert!(
            (pinned[0].1 - plain).abs() <= 1e-6 * plain.abs().max(1.0),
            "pinned: {} vs {plain}",
            pinned[0].1
        );
        drop(held);
    }
}

#[test]
fn kv_temperature_and_overrides() {
    let s = svc(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Prefill),
        4,
    );
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let ov = [WorkerOverlap::device(WorkerWithDpRank::new(2, 0), 4, 16)];
    let req = SelectionRequest::new(128).with_overlaps(&ov);
    // Costs: 8 prefill blocks + 8 decode blocks, minus 4 blocks of credit on
    // worker 2: 12 vs 16. T = 0: always worker 2.
    assert_eq!(counts(&s, &req, 50), [(2, 50)].into());
    // Softmax at T = 1: weights 1 and exp(-1): worker 1 about 27%.
    let c = counts(&s, &req.with_temperature(1.0), 4000);
    let p1 = c.get(&1).copied().unwrap_or(0) as f64 / 4000.0;
    let want = (-1f64).exp() / (1.0 + (-1f64).exp());
    assert!((p1 - want).abs() < 0.03, "{p1} vs {want}");
    assert_eq!(
        s.peek(&req.with_temperature(1.0)).unwrap().explanation.branch,
        Branch::KvSoftmax
    );
    // Override: no overlap credit: both cost 16, ties uniform.
    let no_credit = KvCostOverrides {
        overlap_score_credit: Some(0.0),
        ..Default::default()
    };
    let c = counts(&s, &req.with_kv_overrides(no_credit), 2000);
    assert!(c.values().all(|&n| (850..1150).contains(&n)), "{c:?}");
    let costs = s.costs(&req.with_kv_overrides(no_credit)).unwrap();
    assert_eq!(costs.iter().map(|c| c.1).collect::<Vec<_>>(), vec![16.0, 16.0]);
}

#[test]
fn overlap_order_does_not_change_costs() {
    let s = svc(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Prefill),
        8,
    );
    let mut records: Vec<WorkerRecord> = (0..200).map(|id| WorkerRecord::new(id * 7 % 1000)).collect();
    records.push(WorkerRecord::new(5000).with_dp(3, 4));
    s.sync(records).unwrap();
    let mut ov: Vec<WorkerOverlap> = (0..200)
        .filter(|i| i % 3 != 0)
        .map(|i| WorkerOverlap {
            worker: WorkerWithDpRank::new(i * 7 % 1000, 0),
            device_blocks: (i % 11) as u32,
            host_blocks: (i % 5) as u32,
            cached_tokens: (i % 11) as u32 * 16,
            ..Default::default()
        })
        .collect();
    ov.push(WorkerOverlap::device(WorkerWithDpRank::new(5000, 5), 9, 16));
    ov.push(WorkerOverlap::device(WorkerWithDpRank::new(4242, 0), 30, 16)); // unknown worker: ignored
    ov.sort_by_key(|o| o.worker);
    let sorted = s.costs(&SelectionRequest::new(512).with_overlaps(&ov)).unwrap();
    let mut rev = ov.clone();
    rev.reverse();
    assert_eq!(
        s.costs(&SelectionRequest::new(512).with_overlaps(&rev)).unwrap(),
        sorted
    );
    let mut shuffled = ov.clone();
    shuffled.rotate_left(37);
    assert_eq!(
        s.costs(&SelectionRequest::new(512).with_overlaps(&shuffled)).unwrap(),
        sorted
    );
    // And the overlaps really count: rank 5 of worker 5000 is cheaper than rank 4.
    let c = |w: WorkerWithDpRank| sorted.iter().find(|e| e.0 == w).unwrap().1;
    assert!(c(WorkerWithDpRank::new(5000, 5)) < c(WorkerWithDpRank::new(5000, 4)));
    // Booked prefill tokens use the chosen worker's cached tokens, in any order.
    let sel = s
        .select(
            &SelectionRequest::new(512)
                .with_overlaps(&shuffled)
                .pinned_to_rank(WorkerWithDpRank::new(5000, 5)),
        )
        .unwrap();
    assert_eq!(sel.prefill_tokens(), 512 - 9 * 16);
}

/// Prompt blocks of a conversation: `shared` leading blocks common to all,
/// then blocks of its own.
fn prompt(conversation: u64, shared: u64, len: u64) -> Vec<u64> {
    (0..len)
        .map(|i| if i < shared { 1_000 + i } else { conversation << 32 | i })
        .collect()
}

#[test]
fn prefix_hash_keeps_a_prefix_on_one_rank_until_the_bound() {
    let s = svc(
        WorkerSelectionPolicy::prefix_hash(PrefixHashConfig::default()).unwrap(),
        1,
    );
    for id in 0..8 {
        s.add_worker(WorkerRecord::new(id).with_dp(0, 2)).unwrap();
    }
    // Idle fleet: each conversation's requests all go to one rank.
    let blocks: Vec<Vec<u64>> = (0..50).map(|c| prompt(c, 1, 10)).collect();
    let mut homes = Vec::new();
    for b in &blocks {
        let req = SelectionRequest::new(160).with_prompt_blocks(b);
        let first = s.peek(&req).unwrap();
        assert_eq!(first.explanation().branch, Branch::PrefixHash);
        for _ in 0..3 {
            assert_eq!(s.peek(&req).unwrap().worker(), first.worker());
        }
        homes.push(first.worker);
    }
    homes.sort();
    homes.dedup();
    assert!(homes.len() >= 10, "50 prefixes spread over the 16 ranks: {homes:?}");
    // One hot prefix, booked and held: no rank ever exceeds the bound of
    // the request that went there (ceil(1.25 * (n + 1) / 16)).
    let hot = prompt(7, 1, 10);
    let req = SelectionRequest::new(160).with_prompt_blocks(&hot);
    let mut held = Vec::new();
    let mut load: BTreeMap<WorkerWithDpRank, u64> = BTreeMap::new();
    for n in 0..400u64 {
        let sel = s.select(&req).unwrap();
        let l = load.entry(sel.worker()).or_insert(0);
        *l += 1;
        let bound = (1.25 * (n + 1) as f64 / 16.0).ceil() as u64;
        assert!(*l <= bound, "request {n}: {:?} holds {l} > {bound}", sel.worker());
        held.push(sel);
    }
    // The last bound is ceil(1.25 * 400 / 16) = 32: 400 requests need at
    // least 13 ranks.
    let max = *load.values().max().unwrap();
    assert!(max <= 32 && load.len() >= 13, "{load:?}");
    drop(held);
}

#[test]
fn prefix_hash_keys_by_the_leading_blocks_or_an_explicit_key() {
    let config = PrefixHashConfig {
        prefix_blocks: 2,
        ..Default::default()
    };
    let s = svc(WorkerSelectionPolicy::prefix_hash(config).unwrap(), 1);
    for id in 0..32 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let peek = |blocks: &[u64]| {
        s.peek(&SelectionRequest::new(64).with_prompt_blocks(blocks))
            .unwrap()
            .worker
    };
    // Only the first two blocks count.
    for tail in 0..20u64 {
        assert_eq!(peek(&[5, 6, tail]), peek(&[5, 6]));
    }
    let spread: std::collections::BTreeSet<_> = (0..40u64).map(|b| peek(&[b, 6])).collect();
    assert!(spread.len() > 10, "the first block changes the key: {spread:?}");
    // An explicit key wins over the blocks, and is what the blocks hash to.
    let keyed = SelectionRequest::new(64)
        .with_prompt_blocks(&[9, 9])
        .with_prefix_key(prefix_key(&[5, 6]));
    assert_eq!(s.peek(&keyed).unwrap().worker, peek(&[5, 6]));
    // A request with no blocks and no key is routed least-loaded.
    let busy: Vec<_> = (0..31)
        .map(|_| s.select(&SelectionRequest::new(1).with_prompt_blocks(&[1])).unwrap())
        .collect();
    let p = s.peek(&SelectionRequest::new(64)).unwrap();
    assert_eq!(p.explanation.branch, Branch::PrefixHashUnkeyed);
    let idle: Vec<u64> = (0..32)
        .filter(|id| busy.iter().all(|b| b.worker().worker_id != *id))
        .collect();
    assert!(
        idle.contains(&p.worker.worker_id),
        "{:?} not among the idle {idle:?}",
        p.worker
    );
}

#[test]
fn prefix_hash_moves_only_the_keys_of_a_departed_worker() {
    let s = svc(
        WorkerSelectionPolicy::prefix_hash(PrefixHashConfig::default()).unwrap(),
        1,
    );
    for id in 0..20 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let blocks: Vec<Vec<u64>> = (0..400).map(|c| prompt(c, 0, 4)).collect();
    let home = |b: &[u64]| {
        s.peek(&SelectionRequest::new(64).with_prompt_blocks(b))
            .unwrap()
            .worker
            .worker_id
    };
    let before: Vec<u64> = blocks.iter().map(|b| home(b)).collect();
    s.remove_worker(13).unwrap();
    let mut moved = 0;
    for (b, &was) in blocks.iter().zip(&before) {
        let now = home(b);
        if was == 13 {
            moved += 1;
            assert_ne!(now, 13);
        } else {
            assert_eq!(now, was, "a key moved though its worker stayed");
        }
    }
    assert!(moved > 5, "{moved}");
    // And it returns to the same worker when the worker comes back.
    s.add_worker(WorkerRecord::new(13)).unwrap();
    let again: Vec<u64> = blocks.iter().map(|b| home(b)).collect();
    assert_eq!(again, before);
}

#[test]
fn prefix_hash_parameters_come_from_the_registry() {
    let r = WorkerSelectionPolicyRegistry::new();
    let params = |yaml: &str| serde_saphyr::from_str::<WorkerSelectionPolicyParameters>(yaml).unwrap();
    let p = r
        .build(
            "prefix-hash",
            &params("{load_factor: 2.0, prefix_blocks: 8}"),
            &KvRouterConfig::default(),
            WorkerType::Aggregated,
            RoutingPartitionRef::model("m"),
        )
        .unwrap();
    assert_eq!(p.name(), "prefix-hash");
    for (yaml, field) in [
        ("{load_factor: 0.5}", "load_factor"),
        ("{prefix_blocks: 0}", "prefix_blocks"),
        ("{prefix_block: 3}", "prefix_block"),
    ] {
        let err = r.factory("prefix-hash", &params(yaml)).err().unwrap().to_string();
        assert!(err.contains(field), "{yaml}: {err}");
    }
    // A NaN is refused where it is written, in YAML and in TOML, and from code.
    assert!(serde_saphyr::from_str::<WorkerSelectionPolicyParameters>("{load_factor: .nan}").is_err());
    #[cfg(feature = "toml")]
    {
        let toml = "[[instances]]\nname = \"p\"\ntype = \"prefix-hash\"\nparameters = { load_factor = nan }\n";
        let err = WorkerSelectionConfig::from_toml_str(toml).unwrap_err().to_string();
        assert!(err.contains("finite"), "{err}");
    }
    let nan = PrefixHashConfig {
        load_factor: f64::NAN,
        ..PrefixHashConfig::default()
    };
    assert!(matches!(
        WorkerSelectionPolicy::prefix_hash(nan),
        Err(WorkerSelectionPolicyProviderError::OutOfRange {
            field: "load_factor",
            ..
        })
    ));
}

/// Two workers: worker 1 holds 4 cached blocks of the request and `busy`
/// requests of 160 prompt tokens in flight (its cost rises with them),
/// worker 2 holds nothing. Returns the service and the bookings.
fn held_fleet(config: KvRouterConfig, busy: usize) -> (Arc<WorkerSelectionService>, Vec<OwnedSelection>) {
    let s = Arc::new(svc(WorkerSelectionPolicy::kv(config, WorkerType::Aggregated), 1));
    s.add_worker(WorkerRecord::new(1)).unwrap();
    s.add_worker(WorkerRecord::new(2)).unwrap();
    let held = (0..busy)
        .map(|_| s.select_owned(&SelectionRequest::new(160).pinned_to_worker(1)).unwrap())
        .collect();
    (s, held)
}

const HOLDER: [WorkerOverlap; 1] = [WorkerOverlap {
    worker: WorkerWithDpRank::new(1, 0),
    device_blocks: 4,
    host_blocks: 0,
    disk_blocks: 0,
    shared_blocks: 0,
    cached_tokens: 64,
}];

fn cost_gap(s: &WorkerSelectionService, req: &SelectionRequest<'_>) -> f64 {
    let costs: BTreeMap<u64, f64> = s
        .costs(req)
        .unwrap()
        .into_iter()
        .map(|(w, c)| (w.worker_id, c))
        .collect();
    costs[&1] - costs[&2]
}

#[test]
fn a_switching_margin_keeps_the_prefix_holder_within_the_margin() {
    let req = SelectionRequest::new(160).with_overlaps(&HOLDER);
    // Without a margin the cheaper worker 2 wins: Dynamo's decision.
    let (s, _held) = held_fleet(KvRouterConfig::default(), 1);
    let gap = cost_gap(&s, &req);
    assert!(gap > 0.0, "the holder is dearer by {gap}");
    assert_eq!(s.peek(&req).unwrap().worker.worker_id, 2);
    // An absolute margin at the gap keeps the request on the holder...
    let at_gap = KvRouterConfig {
        switch_margin: gap,
        ..KvRouterConfig::default()
    };
    let (s, _held) = held_fleet(at_gap, 1);
    let p = s.peek(&req.explained()).unwrap();
    assert_eq!((p.worker.worker_id, p.explanation.branch), (1, Branch::KvHeld));
    assert_eq!(p.explanation.runner_up.map(|(w, _)| w.worker_id), Some(2));
    // ...one just below it does not.
    let below = KvRouterConfig {
        switch_margin: gap * 0.99,
        ..KvRouterConfig::default()
    };
    let (s, _held) = held_fleet(below, 1);
    assert_eq!(s.peek(&req).unwrap().worker.worker_id, 2);
    // The relative margin is a share of the holder's cost.
    let holder_cost = s
        .costs(&req)
        .unwrap()
        .into_iter()
        .find(|(w, _)| w.worker_id == 1)
        .unwrap()
        .1;
    for (share, expected) in [(gap / holder_cost * 1.01, 1), (gap / holder_cost * 0.99, 2)] {
        let relative = KvRouterConfig {
            switch_margin_relative: share,
            ..KvRouterConfig::default()
        };
        let (s, _held) = held_fleet(relative, 1);
        assert_eq!(
            s.peek(&req).unwrap().worker.worker_id,
            expected,
            "relative margin {share}"
        );
    }
    // The margin comes before the temperature: a request kept by it is not
    // sampled.
    let hot = KvRouterConfig {
        router_temperature: 1.0,
        ..at_gap
    };
    let (s, _held) = held_fleet(hot, 1);
    for _ in 0..20 {
        let p = s.peek(&req).unwrap();
        assert_eq!((p.worker.worker_id, p.explanation.branch), (1, Branch::KvHeld));
    }
    // A request with no cached prefix anywhere is not held.
    let (s, _held) = held_fleet(at_gap, 1);
    assert_eq!(s.peek(&SelectionRequest::new(160)).unwrap().worker.worker_id, 2);
}

#[test]
fn the_dwell_bounds_how_many_requests_in_a_row_the_margin_keeps() {
    let req = SelectionRequest::new(160).with_overlaps(&HOLDER);
    let config = KvRouterConfig {
        switch_margin: 1.0e6,
        max_dwell: 3,
        ..KvRouterConfig::default()
    };
    let (s, _held) = held_fleet(config, 1);
    // A preview changes nothing.
    for _ in 0..10 {
        assert_eq!(s.peek(&req).unwrap().worker.worker_id, 1);
    }
    // Three requests are kept on the holder by the margin, the fourth goes
    // to the cheapest worker, and the count starts again.
    let mut got = Vec::new();
    let mut bookings = Vec::new();
    for _ in 0..8 {
        let sel = s.select_owned(&req).unwrap();
        got.push((sel.worker().worker_id, sel.explanation().branch));
        bookings.push(sel);
    }
    let ids: Vec<u64> = got.iter().map(|g| g.0).collect();
    assert_eq!(ids, [1, 1, 1, 2, 1, 1, 1, 2], "{got:?}");
    assert!(
        got.iter().filter(|g| g.0 == 1).all(|g| g.1 == Branch::KvHeld),
        "{got:?}"
    );
    let bad = KvRouterConfig {
        max_dwell: KvRouterConfig::MAX_DWELL + 1,
        ..KvRouterConfig::default()
    };
    assert!(
        matches!(
            bad.validate(),
            Err(WorkerSelectionPolicyProviderError::OutOfRange { field: "max_dwell", value, max, .. })
                if value == f64::from(KvRouterConfig::MAX_DWELL + 1) && max == f64::from(KvRouterConfig::MAX_DWELL)
        ),
        "{:?}",
        bad.validate()
    );
    let bad = KvRouterConfig {
        switch_margin: -1.0,
        ..KvRouterConfig::default()
    };
    assert!(
        matches!(
            bad.validate(),
            Err(WorkerSelectionPolicyProviderError::OutOfRange {
                field: "switch_margin",
                value: -1.0,
                min: 0.0,
                ..
            })
        ),
        "{:?}",
        bad.validate()
    );
}

#[test]
fn device_aware_takes_the_policys_required_cache_hits_unless_the_request_sets_its_own() {
    let yaml = "aggregated: d\ninstances:\n  - { name: d, type: device-aware-weighted, parameters: { required_cache_hits: 4 } }\n";
    let factory = WorkerSelectionConfig::from_yaml_str(yaml)
        .unwrap()
        .resolve(&WorkerSelectionPolicyRegistry::new(), WorkerType::Aggregated)
        .unwrap();
    let policy = factory(
        &KvRouterConfig::default(),
        WorkerType::Aggregated,
        RoutingPartitionRef::model("m"),
    );
    let s = WorkerSelectionService::new(policy, ServiceConfig::default());
    for id in 1..=4 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    // Worker 3 holds 5 of the prompt's blocks: at least the policy's 4.
    let overlaps = [WorkerOverlap::device(WorkerWithDpRank::new(3, 0), 5, 16)];
    let req = SelectionRequest::new(1024).with_overlaps(&overlaps);
    for _ in 0..20 {
        let p = s.peek(&req).unwrap();
        assert_eq!(p.worker().worker_id, 3);
        assert_eq!(p.explanation().branch, Branch::DeviceAwareCacheHit);
    }
    // A request that needs 6 hits finds no full-cache row.
    let strict = req.with_required_cache_hits(6);
    assert_ne!(
        s.peek(&strict).unwrap().explanation().branch,
        Branch::DeviceAwareCacheHit
    );
    let bad =
        "aggregated: d\ninstances:\n  - { name: d, type: device-aware-weighted, parameters: { required_hits: 4 } }\n";
    assert!(WorkerSelectionConfig::from_yaml_str(bad)
        .unwrap()
        .resolve(&WorkerSelectionPolicyRegistry::new(), WorkerType::Aggregated)
        .is_err());
}
