//! The built-in scorers and pickers: the KV terms sum to the default KV
//! cost, the pickers' distributions, and composing them by name.

use std::collections::HashMap;

use selkie::*;

const YAML_KV_TERMS: &str = "aggregated: terms
instances:
  - name: terms
    type: composed
    parameters:
      scorers:
        - type: preferred-taints
          parameters:
            scorers: [{ type: prefill }, { type: decode }, { type: cache-credit }]
      picker: { type: argmin, parameters: { seed: 1 } }
";

fn service(policy: WorkerSelectionPolicy) -> WorkerSelectionService {
    let s = WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(5),
            ..ServiceConfig::default()
        },
    );
    for id in 1..=5u64 {
        let mut r = WorkerRecord::new(id).with_dp(0, 2);
        if id % 2 == 0 {
            r = r.with_taint("gpu=h200");
        }
        s.add_worker(r).unwrap();
    }
    s
}

fn composed(yaml: &str, registry: &WorkerSelectionPolicyRegistry) -> WorkerSelectionPolicy {
    let factory = WorkerSelectionConfig::from_yaml_str(yaml)
        .unwrap()
        .resolve(registry, WorkerType::Aggregated)
        .unwrap();
    factory(
        &KvRouterConfig::default(),
        WorkerType::Aggregated,
        RoutingPartitionRef::model("m"),
    )
}

/// Books the same load on both services: `n` pinned requests per rank of
/// varying sizes.
fn load<'s>(s: &'s WorkerSelectionService, held: &mut Vec<Selection<'s>>) {
    for id in 1..=5u64 {
        for rank in 0..2 {
            let isl = (id as usize * 37 + rank * 101) % 300 + 20;
            for _ in 0..(id as usize + rank) % 3 + 1 {
                let req = SelectionRequest::new(isl).pinned_to_rank(WorkerWithDpRank::new(id, rank as u32));
                held.push(s.select(&req).unwrap());
            }
        }
    }
}

#[test]
fn kv_terms_sum_to_the_default_kv_cost() {
    let kv = service(WorkerSelectionPolicy::kv(
        KvRouterConfig::default(),
        WorkerType::Aggregated,
    ));
    let terms = service(composed(YAML_KV_TERMS, &WorkerSelectionPolicyRegistry::new()));
    let (mut a, mut b) = (Vec::new(), Vec::new());
    load(&kv, &mut a);
    load(&terms, &mut b);
    let w = |id, rank| WorkerWithDpRank::new(id, rank);
    // Overlaps within the prompt's 20 blocks (320 tokens), on every tier.
    let overlaps = [
        WorkerOverlap {
            worker: w(1, 0),
            device_blocks: 12,
            host_blocks: 3,
            disk_blocks: 2,
            shared_blocks: 0,
            cached_tokens: 192,
        },
        WorkerOverlap {
            worker: w(2, 1),
            device_blocks: 4,
            host_blocks: 8,
            disk_blocks: 0,
            shared_blocks: 0,
            cached_tokens: 64,
        },
        WorkerOverlap {
            worker: w(3, 0),
            device_blocks: 0,
            host_blocks: 0,
            disk_blocks: 9,
            shared_blocks: 0,
            cached_tokens: 0,
        },
        WorkerOverlap {
            worker: w(4, 1),
            device_blocks: 18,
            host_blocks: 0,
            disk_blocks: 0,
            shared_blocks: 0,
            cached_tokens: 288,
        },
    ];
    let taints = [("gpu=h200", 0.7f32)];
    let requests = [
        SelectionRequest::new(320).with_overlaps(&overlaps),
        SelectionRequest::new(320)
            .with_overlaps(&overlaps)
            .with_preferred_taints(&taints),
        SelectionRequest::new(77).with_overlaps(&overlaps[3..]),
        SelectionRequest::new(320)
            .with_overlaps(&overlaps)
            .with_track_prefill_tokens(false),
    ];
    for (i, req) in requests.iter().enumerate() {
        let expected: HashMap<_, _> = kv.costs(req).unwrap().into_iter().collect();
        let got = terms.costs(req).unwrap();
        assert_eq!(got.len(), expected.len(), "request {i}");
        for (worker, cost) in got {
            let want = expected[&worker];
            assert!(
                (cost - want).abs() <= 1e-5 * want.abs().max(1.0),
                "request {i}, {worker}: terms {cost}, kv {want}"
            );
        }
    }
}

struct Fixed(&'static [f64]);
impl WorkerScorer for Fixed {
    fn score(
        &self,
        _: &WorkerSelectionContext<'_>,
        c: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (cost, c) in costs.iter_mut().zip(c.iter()) {
            *cost = self.0[c.worker().worker_id as usize - 1];
        }
        Ok(())
    }
}

/// How often each worker (1-based id) wins `n` selections over workers
/// costing `costs`, with `picker`.
fn frequencies(costs: &'static [f64], picker: Box<dyn WorkerPicker>, n: usize) -> Vec<usize> {
    let policy = WorkerSelectionPolicy::new(
        KvRouterConfig::default(),
        WorkerType::Aggregated,
        vec![Box::new(Fixed(costs))],
        picker,
    );
    let s = WorkerSelectionService::new(policy, ServiceConfig::default());
    for id in 1..=costs.len() as u64 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let mut counts = vec![0; costs.len()];
    for _ in 0..n {
        // Dropped at once: the booking does not change the fixed costs anyway.
        let w = s.select(&SelectionRequest::new(16)).unwrap().worker();
        counts[w.worker_id as usize - 1] += 1;
    }
    counts
}

/// Pearson's chi-square statistic of `counts` against `p`.
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&o, &p)| {
            let e = p * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn argmin_picks_the_minimum_and_splits_ties_evenly() {
    let counts = frequencies(
        &[3.0, 1.0, 2.0, 5.0],
        Box::new(ArgminPicker::new(SeedParameters { seed: Some(1) })),
        200,
    );
    assert_eq!(counts, vec![0, 200, 0, 0]);
    // Ties: uniform over the two cheapest (chi-square, 1 degree of freedom, p = 0.001: 10.83).
    let counts = frequencies(
        &[1.0, 4.0, 1.0, 2.0],
        Box::new(ArgminPicker::new(SeedParameters { seed: Some(2) })),
        4000,
    );
    assert_eq!(counts[1] + counts[3], 0, "{counts:?}");
    let x2 = chi_square(&[counts[0], counts[2]], &[0.5, 0.5]);
    assert!(x2 < 10.83, "{counts:?} chi-square {x2}");
}

#[test]
fn softmax_frequencies_match_its_probabilities() {
    const COSTS: &[f64] = &[10.0, 12.0, 15.0, 20.0];
    let params = SoftmaxParameters {
        temperature: 0.5,
        seed: Some(11),
    };
    let p = SoftmaxPicker::new(params).unwrap().probabilities(COSTS, 0.5);
    // Dynamo's normalisation, written out: exp(-(c - 10) / (10 * 0.5)).
    let w: Vec<f64> = COSTS.iter().map(|c| (-(c - 10.0) / 5.0).exp()).collect();
    let sum: f64 = w.iter().sum();
    for (p, w) in p.iter().zip(&w) {
        assert!((p - w / sum).abs() < 1e-12);
    }
    let counts = frequencies(COSTS, Box::new(SoftmaxPicker::new(params).unwrap()), 20_000);
    // 3 degrees of freedom, p = 0.001: 16.27.
    let x2 = chi_square(&counts, &p);
    assert!(x2 < 16.27, "{counts:?} against {p:?}: chi-square {x2}");
    // T = 0 is argmin.
    let zero = SoftmaxParameters {
        temperature: 0.0,
        seed: Some(3),
    };
    assert_eq!(
        frequencies(COSTS, Box::new(SoftmaxPicker::new(zero).unwrap()), 100),
        vec![100, 0, 0, 0]
    );
}

#[test]
fn power_of_two_never_picks_the_costliest_of_three() {
    // Two distinct candidates: the costliest always loses; the middle one
    // wins only against the costliest, 1 pair in 3.
    let counts = frequencies(
        &[1.0, 2.0, 3.0],
        Box::new(PowerOfTwoPicker::new(SeedParameters { seed: Some(9) })),
        6000,
    );
    assert_eq!(counts[2], 0, "{counts:?}");
    let x2 = chi_square(&counts[..2], &[2.0 / 3.0, 1.0 / 3.0]);
    assert!(x2 < 10.83, "{counts:?} chi-square {x2}");
}

#[test]
fn pickers_with_a_seed_replay() {
    let run = || {
        frequencies(
            &[1.0, 1.5, 2.0, 9.0],
            Box::new(
                SoftmaxPicker::new(SoftmaxParameters {
                    temperature: 1.0,
                    seed: Some(4),
                })
                .unwrap(),
            ),
            50,
        )
    };
    assert_eq!(run(), run());
}

#[test]
fn unknown_and_reserved_names_are_refused() {
    let r = WorkerSelectionPolicyRegistry::new();
    let yaml =
        "aggregated: c\ninstances:\n  - { name: c, type: composed, parameters: { scorers: [{ type: fastest }] } }\n";
    let err = WorkerSelectionConfig::from_yaml_str(yaml)
        .unwrap()
        .resolve(&r, WorkerType::Aggregated)
        .err()
        .unwrap();
    let msg = err.to_string();
    assert!(msg.contains("unknown scorer type \"fastest\""), "{msg}");
    assert!(msg.contains("cache-credit, decode, preferred-taints, prefill"), "{msg}");
    let yaml = "aggregated: c\ninstances:\n  - { name: c, type: composed, parameters: { picker: { type: best } } }\n";
    let msg = WorkerSelectionConfig::from_yaml_str(yaml)
        .unwrap()
        .resolve(&r, WorkerType::Aggregated)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("unknown picker type \"best\"; available picker types: argmin, power-of-two, softmax"),
        "{msg}"
    );
    // A bad bound names the field and the bound.
    let yaml = "aggregated: c\ninstances:\n  - { name: c, type: composed, parameters: { picker: { type: softmax, parameters: { temperature: -2 } } } }\n";
    let msg = WorkerSelectionConfig::from_yaml_str(yaml)
        .unwrap()
        .resolve(&r, WorkerType::Aggregated)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("router_temperature must be at least 0, got -2"), "{msg}");
    let yaml = "aggregated: c\ninstances:\n  - { name: c, type: composed, parameters: { scorers: [{ type: decode, parameters: { weight: 1 } }] } }\n";
    let msg = WorkerSelectionConfig::from_yaml_str(yaml)
        .unwrap()
        .resolve(&r, WorkerType::Aggregated)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("unknown field `weight`"), "{msg}");

    let mut r = WorkerSelectionPolicyRegistry::new();
    let picker: WorkerPickerProvider = std::sync::Arc::new(|_: &WorkerSelectionPolicyParameters| {
        Ok(
            std::sync::Arc::new(|_: &KvRouterConfig, _: WorkerType, _: RoutingPartitionRef<'_>| {
                Box::new(ArgminPicker::new(SeedParameters::default())) as Box<dyn WorkerPicker>
            }) as WorkerPickerFactory,
        )
    });
    for name in BUILTIN_PICKERS {
        assert!(matches!(
            r.register_picker(name, picker.clone()),
            Err(RegistryError::BuiltinPluginName {
                kind: PluginKind::Picker,
                ..
            })
        ));
    }
    assert!(matches!(
        r.register_picker("", picker.clone()),
        Err(RegistryError::EmptyPluginName { .. })
    ));
    r.register_picker("mine", picker.clone()).unwrap();
    assert!(matches!(
        r.register_picker("mine", picker),
        Err(RegistryError::DuplicatePlugin { .. })
    ));
    assert!(r.picker_names().contains(&"mine".to_string()));
}
