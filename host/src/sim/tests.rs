//! Scenarios whose outcome is known in advance, run end to end through the
//! real selection service.

use super::compare::{run_policy, PolicyChoice};
use super::dist::LengthDist;
use super::engine::TimingModel;
use super::metrics::PolicyReport;
use super::run::FleetSpec;
use super::workload::{Arrivals, Workload, WorkloadSpec};
use crate::WorkerSelectionPolicyRegistry;

fn fleet(workers: u32, dp_size: u32) -> FleetSpec {
    FleetSpec {
        workers,
        dp_size,
        kv_blocks: 4_096,
        timing: TimingModel::default(),
        max_active_requests: None,
        classes: Vec::new(),
        routers: 1,
        sync_delay_ms: None,
    }
}

fn shared_prefix_workload(requests: usize, seed: u64) -> Workload {
    shared_prefix_spec(requests).generate(seed)
}

/// 16 shared 1,024-token system prompts of Zipf(0.5) popularity, short
/// user turns, Poisson arrivals at 40 per second, no sessions.
fn shared_prefix_spec(requests: usize) -> WorkloadSpec {
    WorkloadSpec {
        requests,
        block_size: 16,
        arrivals: Arrivals::Poisson { rate_per_s: 40.0 },
        system_prompts: 16,
        system_prompt_tokens: LengthDist::Fixed(1024),
        zipf_s: 0.5,
        session_fraction: 0.0,
        session_turns: LengthDist::Fixed(1),
        think_time_ms: 1_000.0,
        user_tokens: LengthDist::Uniform { lo: 16, hi: 128 },
        output_tokens: LengthDist::Uniform { lo: 8, hi: 32 },
    }
}

fn run(policy: &PolicyChoice, workload: &Workload, fleet: &FleetSpec) -> (PolicyReport, Vec<u32>) {
    let registry = WorkerSelectionPolicyRegistry::new();
    let r = run_policy(&registry, policy, workload, fleet, 7, &mut |_| {}).unwrap();
    let mut per_row = vec![0u32; fleet.rows()];
    for rec in &r.record.requests {
        per_row[rec.row.expect("routed") as usize] += 1;
        // Every routed request runs to completion, in order, using at most
        // its prompt from cache.
        assert!(
            rec.arrival_ms < rec.first_token_ms && rec.first_token_ms <= rec.finish_ms,
            "{rec:?}"
        );
        assert!(
            rec.finish_ms <= r.record.makespan_ms && rec.cached_tokens < rec.input_tokens,
            "{rec:?}"
        );
    }
    (r.report, per_row)
}

#[test]
fn one_worker_gets_every_request() {
    let w = shared_prefix_workload(300, 1);
    for p in PolicyChoice::builtins() {
        let (report, per_row) = run(&p, &w, &fleet(1, 1));
        assert_eq!(per_row, vec![300], "{}", p.label);
        assert_eq!(report.failed, 0);
        assert_eq!(report.missed_reuse, 0.0, "no other worker can hold a longer prefix");
        assert_eq!(report.missed_elsewhere, 0.0, "nothing is cached elsewhere");
        assert!((report.hit_rate + report.missed_elsewhere + report.cached_nowhere - 1.0).abs() < 1e-9);
        assert!(report.ttft_p50_ms > 0.0 && report.ttft_p50_ms <= report.ttft_p99_ms);
    }
}

#[test]
fn round_robin_splits_evenly() {
    let w = shared_prefix_workload(400, 2);
    let (report, per_row) = run(&PolicyChoice::builtin("round-robin"), &w, &fleet(4, 2));
    assert_eq!(per_row, vec![50; 8]);
    assert_eq!(report.routed, 400);
}

#[test]
fn cache_aware_policy_beats_random_on_hit_rate() {
    let w = shared_prefix_workload(1_500, 3);
    // Small caches: a worker cannot hold every system prompt, so where a
    // prefix goes decides whether it hits.
    let small = FleetSpec {
        kv_blocks: 600,
        ..fleet(8, 1)
    };
    let (kv, _) = run(&PolicyChoice::kv_at(0.0), &w, &small);
    let (random, _) = run(&PolicyChoice::builtin("random"), &w, &small);
    assert!(
        kv.hit_rate > random.hit_rate + 0.15,
        "kv {} vs random {}",
        kv.hit_rate,
        random.hit_rate
    );
    // Missed reuse separates them where the old "flicker" (any shared
    // block moving) did not.
    assert!(
        kv.missed_reuse + 0.2 < random.missed_reuse,
        "kv {} vs random {}",
        kv.missed_reuse,
        random.missed_reuse
    );
    for r in [&kv, &random] {
        let sum = r.hit_rate + r.missed_elsewhere + r.cached_nowhere;
        assert!((sum - 1.0).abs() < 1e-9, "{}: shares add up to {sum}", r.policy);
        assert!(r.share_of_pooled > 0.0 && r.share_of_pooled.is_finite(), "{r:?}");
    }
    assert!(kv.missed_elsewhere < random.missed_elsewhere);
}

/// The bounds are ordered (no policy's hit rate above the unlimited cache,
/// the pooled cache at most that) and the pooled one grows with capacity.
#[test]
fn hit_bounds_are_ordered_and_bound_every_policy() {
    use super::metrics::HitBounds;
    let w = shared_prefix_workload(1_500, 3);
    let small = FleetSpec {
        kv_blocks: 600,
        ..fleet(8, 1)
    };
    let b = HitBounds::of(&w, &small);
    let tiny = HitBounds::of(
        &w,
        &FleetSpec {
            kv_blocks: 20,
            ..small.clone()
        },
    );
    assert!(b.pooled <= b.unlimited && b.unlimited <= 1.0, "{b:?}");
    assert!(tiny.pooled < b.pooled, "{tiny:?} vs {b:?}");
    assert!((tiny.unlimited - b.unlimited).abs() < 1e-12, "{tiny:?} vs {b:?}");
    for p in [PolicyChoice::kv_at(0.0), PolicyChoice::builtin("random")] {
        let (r, _) = run(&p, &w, &small);
        assert!(
            r.hit_rate <= b.unlimited + 1e-9,
            "{}: {} > {}",
            r.policy,
            r.hit_rate,
            b.unlimited
        );
    }
}

#[test]
fn least_loaded_balances_better_than_random() {
    let w = shared_prefix_workload(1_500, 4);
    let f = fleet(8, 1);
    let (ll, _) = run(&PolicyChoice::builtin("least-loaded"), &w, &f);
    let (random, _) = run(&PolicyChoice::builtin("random"), &w, &f);
    assert!(
        ll.load_cv < random.load_cv,
        "least-loaded {} vs random {}",
        ll.load_cv,
        random.load_cv
    );
}

#[test]
fn runs_replay_from_the_seed() {
    let w = shared_prefix_workload(300, 5);
    let f = fleet(4, 1);
    for p in [PolicyChoice::builtin("random"), PolicyChoice::kv_at(0.5)] {
        let (a, rows_a) = run(&p, &w, &f);
        let (b, rows_b) = run(&p, &w, &f);
        assert_eq!(rows_a, rows_b);
        assert_eq!((a.hit_rate, a.ttft_p99_ms), (b.hit_rate, b.ttft_p99_ms));
    }
}

#[test]
fn session_affinity_keeps_conversations_on_their_cache() {
    let mut spec = super::scenario::Scenario::embedded(super::scenario::ScenarioName::Default);
    spec.workload.requests = 1_500;
    spec.fleet.workers = 8;
    let w = spec.workload.generate(9);
    let plain = PolicyChoice::builtin("least-loaded");
    let sticky = plain.clone().with_session_affinity(crate::AffinityMode::Hard);
    assert_eq!(sticky.label, "least-loaded +hard");
    let (plain, _) = run(&plain, &w, &spec.fleet);
    let (sticky, _) = run(&sticky, &w, &spec.fleet);
    assert!(
        sticky.hit_rate > plain.hit_rate + 0.05,
        "{} vs {}",
        sticky.hit_rate,
        plain.hit_rate
    );
    assert!(
        sticky.missed_elsewhere < plain.missed_elsewhere,
        "{} vs {}",
        sticky.missed_elsewhere,
        plain.missed_elsewhere
    );
}

#[test]
fn the_services_admission_limit_holds_and_refusals_are_counted() {
    let w = shared_prefix_workload(600, 6);
    let limited = FleetSpec {
        max_active_requests: Some(3),
        ..fleet(2, 1)
    };
    let registry = WorkerSelectionPolicyRegistry::new();
    for p in [PolicyChoice::kv_at(0.0), PolicyChoice::builtin("least-loaded")] {
        let r = run_policy(&registry, &p, &w, &limited, 7, &mut |_| {}).unwrap();
        assert!(
            r.report.failed > 0,
            "{}: 600 requests at 40/s cannot fit in 6 slots",
            p.label
        );
        assert_eq!(r.report.routed + r.report.failed, 600);
        let peak = r.record.load_samples.iter().flatten().copied().max().unwrap();
        assert!(peak <= 3, "{}: {peak} in flight on one rank", p.label);
        let msg = r.record.first_failure.as_deref().unwrap();
        assert!(msg.contains("overloaded"), "{msg}");
    }
}

#[test]
fn a_fleet_larger_than_the_service_is_refused_before_allocating() {
    let workload = shared_prefix_workload(10, 1);
    let registry = WorkerSelectionPolicyRegistry::new();
    for (workers, dp_size) in [(16, u32::MAX), (u32::MAX, 2), (2, 8_193)] {
        let e = run_policy(
            &registry,
            &PolicyChoice::builtin("random"),
            &workload,
            &fleet(workers, dp_size),
            1,
            &mut |_| {},
        )
        .map(|_| ())
        .unwrap_err();
        assert!(
            matches!(e, super::SimError::FleetTooLarge { workers: w, dp_size: d, capacity: 16_384 } if (w, d) == (workers, dp_size)),
            "{e}"
        );
    }
}

/// A mixed fleet: a class's speed, cache and capacity weight reach the
/// engines and the service, and the device-aware policy, identical to
/// least-loaded on a uniform fleet, decides differently.
#[test]
fn worker_classes_change_speed_cache_and_what_the_policies_see() {
    use super::run::WorkerClass;
    let w = shared_prefix_workload(400, 8);
    let mut two = fleet(2, 1);
    two.classes = vec![WorkerClass {
        workers: 1,
        speed: 4.0,
        kv_blocks: Some(50),
        capacity_weight: 3.0,
        cpu: false,
        dp_size: None,
    }];
    assert_eq!(two.worker_model(0).kv_blocks, 50);
    assert_eq!(two.worker_model(1).kv_blocks, 4_096);
    assert_eq!(two.total_kv_blocks(), 4_146);
    let r = super::compare::run_policy(
        &crate::WorkerSelectionPolicyRegistry::new(),
        &PolicyChoice::builtin("round-robin"),
        &w,
        &two,
        1,
        &mut |_| {},
    )
    .unwrap();
    let mean_latency = |row: u32| {
        let l: Vec<f64> = r
            .record
            .requests
            .iter()
            .filter(|q| q.row == Some(row))
            .map(|q| q.finish_ms - q.arrival_ms)
            .collect();
        l.iter().sum::<f64>() / l.len() as f64
    };
    assert!(
        mean_latency(0) * 2.0 < mean_latency(1),
        "the 4x worker: {} ms, the other {} ms",
        mean_latency(0),
        mean_latency(1)
    );
    let service =
        super::service_router::fleet_service(crate::WorkerSelectionPolicy::least_loaded(), &two, 16, 1).unwrap();
    assert_eq!(service.worker_status(1).unwrap().record.capacity_weight, 3.0);

    let mixed = super::scenario::Scenario::embedded(super::scenario::ScenarioName::Mixed);
    mixed.validate().unwrap();
    let mut spec = mixed.workload.clone();
    spec.requests = 1_500;
    let w = spec.generate(4);
    let (ll, _) = run(&PolicyChoice::builtin("least-loaded"), &w, &mixed.fleet);
    let (da, _) = run(&PolicyChoice::builtin("device-aware-weighted"), &w, &mixed.fleet);
    assert_ne!((ll.hit_rate, ll.ttft_p99_ms), (da.hit_rate, da.ttft_p99_ms));
}

/// Identical TTFT distributions share one labelled curve; a load plot
/// draws the busiest, mean and least busy worker, labelled, on a y axis to
/// its own run's peak.
#[test]
fn plots_show_identical_curves_once_and_load_to_the_runs_own_peak() {
    use super::plot::{plot_load, plot_ttft, LoadBands};
    let w = shared_prefix_workload(300, 11);
    let f = fleet(4, 1);
    let (ll, _) = run(&PolicyChoice::builtin("least-loaded"), &w, &f);
    let (da, _) = run(&PolicyChoice::builtin("device-aware-weighted"), &w, &f);
    let (rr, _) = run(&PolicyChoice::builtin("round-robin"), &w, &f);
    assert_eq!(
        ll.ttft_sorted_ms, da.ttft_sorted_ms,
        "a uniform fleet: the same decisions"
    );
    let dir = std::env::temp_dir().join(format!("selkie-plots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ttft = dir.join("ttft.svg");
    plot_ttft(&ttft, "t", &[ll, da, rr]).unwrap();
    let svg = std::fs::read_to_string(&ttft).unwrap();
    assert!(svg.contains("least-loaded = device-aware-weighted"), "merged legend");
    assert_eq!(svg.matches("device-aware-weighted").count(), 1, "one curve, one label");
    assert!(svg.contains("round-robin"));

    let runs: Vec<_> = ["random", "least-loaded"]
        .iter()
        .map(|p| {
            super::compare::run_policy(
                &crate::WorkerSelectionPolicyRegistry::new(),
                &PolicyChoice::builtin(p),
                &w,
                &f,
                1,
                &mut |_| {},
            )
            .unwrap()
            .record
        })
        .collect();
    let bands: Vec<LoadBands> = runs.iter().map(|r| LoadBands::of(&f, r)).collect();
    assert_ne!(
        bands[0].peak, bands[1].peak,
        "the two runs peak differently (the case this checks)"
    );
    // A plot's legend and its y axis's tick labels (right-aligned text).
    let plot = |r: &super::run::RunRecord| {
        let path = dir.join("load.svg");
        plot_load(&path, "load", &f, r).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = svg.lines().collect();
        let ticks: Vec<f64> = lines
            .windows(2)
            .filter(|l| l[0].contains("text-anchor=\"end\""))
            .filter_map(|l| l[1].trim().parse().ok())
            .collect();
        (svg, ticks)
    };
    for (r, b) in runs.iter().zip(&bands) {
        let (svg, ticks) = plot(r);
        for label in [
            "busiest worker",
            "mean of the 4 workers",
            "least busy worker",
            &format!("axis to the peak of this run, {}", b.peak),
        ] {
            assert!(svg.contains(label), "no {label:?} in the plot");
        }
        // The axis runs to the peak and 5% above, no further.
        let top = ticks.iter().copied().fold(0.0, f64::max);
        let peak = f64::from(b.peak);
        assert!(
            top <= peak * 1.05 && top >= peak * 0.75,
            "peak {peak}, highest tick {top}: {ticks:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The bands of a load plot: per sample, the busiest worker (its ranks
/// summed), the mean and the least busy, and the run's peak.
#[test]
fn load_bands_summarise_the_workers_at_each_sample() {
    use super::plot::LoadBands;
    let f = fleet(2, 2);
    let record = super::run::RunRecord {
        requests: Vec::new(),
        makespan_ms: 20.0,
        load_area: vec![0.0; 4],
        sample_times_ms: vec![0.0, 1000.0, 2000.0],
        load_samples: vec![vec![0, 0, 0, 0], vec![1, 2, 0, 1], vec![0, 1, 4, 1]],
        failures: 0,
        first_failure: None,
        herd_window_ms: 10.0,
    };
    let b = LoadBands::of(&f, &record);
    assert_eq!(b.times_s, vec![0.0, 1.0, 2.0]);
    assert_eq!(b.busiest, vec![0.0, 3.0, 5.0]);
    assert_eq!(b.mean, vec![0.0, 2.0, 3.0]);
    assert_eq!(b.least, vec![0.0, 1.0, 1.0]);
    assert_eq!(b.peak, 5);
}

/// A class with its own DP ranks: rows follow the workers' ranks, the
/// service registers each worker with its own, and every rank serves.
#[test]
fn worker_classes_with_their_own_dp_ranks_map_rows_both_ways() {
    use super::run::WorkerClass;
    let mut f = fleet(3, 1);
    f.classes = vec![WorkerClass {
        workers: 1,
        speed: 1.0,
        kv_blocks: None,
        capacity_weight: 1.0,
        cpu: false,
        dp_size: Some(4),
    }];
    assert_eq!(f.rows(), 6);
    let mapped: Vec<(u32, u32)> = (0..6).map(|r| f.worker_and_rank(r)).collect();
    assert_eq!(mapped, vec![(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0)]);
    assert_eq!((0..3).map(|w| f.first_row(w)).collect::<Vec<_>>(), vec![0, 4, 5]);
    assert_eq!(f.total_kv_blocks(), 6 * 4_096);
    let service =
        super::service_router::fleet_service(crate::WorkerSelectionPolicy::least_loaded(), &f, 16, 1).unwrap();
    assert_eq!(service.worker_status(1).unwrap().ranks.len(), 4);
    assert_eq!(service.worker_status(2).unwrap().ranks.len(), 1);
    let w = shared_prefix_workload(600, 12);
    let (report, per_row) = run(&PolicyChoice::builtin("round-robin"), &w, &f);
    assert_eq!(report.failed, 0);
    assert_eq!(per_row, vec![100; 6], "round-robin over the six ranks");
}

/// Router replicas: a replica's booking reaches its peers after the sync
/// delay and not before, and a peer releases it when the owner does.
#[test]
fn replica_bookings_reach_peers_after_the_sync_delay() {
    use super::router::{RouteRequest, Router};
    use super::service_router::{fleet_service, ReplicatedRouter, ServiceRouter};
    use crate::WorkerSelectionPolicy;
    let f = fleet(2, 1);
    let services: Vec<_> = (0..2)
        .map(|i| fleet_service(WorkerSelectionPolicy::least_loaded(), &f, 16, i).unwrap())
        .collect();
    let held = |s: &crate::WorkerSelectionService| -> Vec<u32> {
        (1..=2)
            .map(|w| s.worker_status(w).unwrap().ranks[0].active_requests)
            .collect()
    };
    let mut router = ReplicatedRouter::new(services.iter().map(|s| ServiceRouter::new(s, &f)).collect(), Some(5.0));
    let request = |id| RouteRequest {
        id,
        input_tokens: 64,
        output_tokens: 8,
        overlaps: &[],
        prompt_blocks: &[],
        session: None,
    };
    router.advance_to(0.0);
    let first = router.select(&request(0)).unwrap().row; // replica 0
    assert_eq!(held(&services[1]), [0, 0], "not yet at the peer");
    router.advance_to(4.9);
    assert_eq!(held(&services[1]), [0, 0]);
    router.advance_to(5.0);
    let mut expected = [0, 0];
    expected[first] = 1;
    assert_eq!(held(&services[1]), expected, "the peer holds the booking");
    // Replica 1 now sees the load and goes to the other worker.
    let second = router.select(&request(1)).unwrap().row;
    assert_ne!(first, second);
    router.release(0);
    router.advance_to(9.0);
    assert_eq!(held(&services[1])[first], 1, "the release is still in flight");
    router.advance_to(10.0);
    assert_eq!(held(&services[1])[first], 0);
    router.release(1);
    router.flush();
    assert_eq!(router.outstanding(), 0);
    for s in &services {
        assert_eq!(held(s), [0, 0]);
    }
}

/// Replicas routing on stale views herd: with a long sync delay
/// least-loaded sends more requests to one rank within one delay than with
/// a short one, and power-of-two herds less than least-loaded.
#[test]
fn stale_replicas_herd_and_power_of_two_herds_less() {
    let replicated = |delay: f64| FleetSpec {
        routers: 4,
        sync_delay_ms: Some(delay),
        ..fleet(8, 1)
    };
    // Requests fast enough that a stale replica sends several to one worker
    // before it hears of the others' bookings, summed over a few workloads.
    let workloads: Vec<Workload> = (1..=4)
        .map(|seed| {
            WorkloadSpec {
                arrivals: Arrivals::Poisson { rate_per_s: 200.0 },
                ..shared_prefix_spec(600)
            }
            .generate(seed)
        })
        .collect();
    let herd = |policy: &str, delay: f64| -> usize {
        workloads
            .iter()
            .map(|w| run(&PolicyChoice::builtin(policy), w, &replicated(delay)).0.herd as usize)
            .sum()
    };
    let (slow, fast) = (herd("least-loaded", 500.0), herd("least-loaded", 1.0));
    assert!(slow > fast, "least-loaded: {slow} within 500 ms vs {fast} within 1 ms");
    let p2 = herd("power-of-two", 500.0);
    assert!(p2 < slow, "power-of-two {p2} vs least-loaded {slow}");
    let workload = &workloads[2];
    // One router and one replica without sync give the same decisions.
    let one = run(&PolicyChoice::builtin("least-loaded"), workload, &fleet(8, 1)).1;
    let alone = FleetSpec {
        routers: 1,
        sync_delay_ms: Some(500.0),
        ..fleet(8, 1)
    };
    assert_eq!(run(&PolicyChoice::builtin("least-loaded"), workload, &alone).1, one);
}

/// A service that counts blocks of another size than the workload's is
/// refused before any request is routed (its overlaps would be read in the
/// wrong blocks).
#[test]
fn a_router_of_another_block_size_than_the_workload_is_refused() {
    use super::run::simulate;
    use super::service_router::{fleet_service, ServiceRouter};
    let workload = shared_prefix_workload(20, 1);
    let fleet = fleet(2, 1);
    let kv = || crate::WorkerSelectionPolicy::kv(crate::KvRouterConfig::default(), crate::WorkerType::Aggregated);
    let service = fleet_service(kv(), &fleet, 32, 7).unwrap();
    let mut router = ServiceRouter::new(&service, &fleet);
    let err = simulate(&workload, &fleet, &mut router, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            err,
            super::SimError::BlockSizeMismatch {
                workload: 16,
                router: 32
            }
        ),
        "{err}"
    );
    let service = fleet_service(kv(), &fleet, 16, 7).unwrap();
    let mut router = ServiceRouter::new(&service, &fleet);
    let record = simulate(&workload, &fleet, &mut router, &mut |_| {}).unwrap();
    assert_eq!(
        record.failures, 0,
        "the kv policy routes every request, cached prefix or not"
    );
}
