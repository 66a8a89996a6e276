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

const TAINTS: [(&str, f32); 1] = [("gpu=h200", 0.7)];

/// Overlaps within the prompt's 20 blocks (320 tokens), on every tier.
fn overlaps() -> [WorkerOverlap; 4] {
    let w = |id, rank| WorkerWithDpRank::new(id, rank);
    [
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
    ]
}

/// Requests over `overlaps`: plain, with preferred taints, a short prompt
/// its overlaps exceed, and without prefill tracking.
fn requests(overlaps: &[WorkerOverlap]) -> [SelectionRequest<'_>; 4] {
    [
        SelectionRequest::new(320).with_overlaps(overlaps),
        SelectionRequest::new(320)
            .with_overlaps(overlaps)
            .with_preferred_taints(&TAINTS),
        SelectionRequest::new(77).with_overlaps(&overlaps[3..]),
        SelectionRequest::new(320)
            .with_overlaps(overlaps)
            .with_track_prefill_tokens(false),
    ]
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
    let overlaps = overlaps();
    let requests = requests(&overlaps);
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

const YAML_KV_PARTS: &str = "aggregated: parts
instances:
  - name: parts
    type: composed
    parameters:
      scorers: [{ type: prefill }, { type: cache-credit }, { type: decode }]
      picker: { type: argmin, parameters: { seed: 1 } }
";

/// Within the `f32` cost's rounding of the `f64` terms' sum: relative to the
/// terms' magnitude.
#[track_caller]
fn assert_sums_to(terms: CostTerms, cost: f64, what: &str) {
    let magnitude: f64 = terms.iter().map(|(_, v)| v.abs()).sum();
    assert!(
        (terms.sum() - cost).abs() <= 1e-5 * magnitude.max(1.0),
        "{what}: terms {terms} sum to {}, cost {cost}",
        terms.sum()
    );
}

/// An explained KV choice splits the chosen row's and the runner-up's cost
/// into the formula's terms, by the built-in scorers' names; they sum to
/// the cost, and where the formula's clamp does not bite they are the
/// scorers' own values. A composed policy's terms are its scorers'.
#[test]
fn explanations_split_the_kv_cost_into_terms_that_sum_to_it() {
    let kv = service(WorkerSelectionPolicy::kv(
        KvRouterConfig::default(),
        WorkerType::Aggregated,
    ));
    let registry = WorkerSelectionPolicyRegistry::new();
    let parts = service(composed(YAML_KV_PARTS, &registry));
    let nested = service(composed(YAML_KV_TERMS, &registry));
    assert_eq!(parts.policy().name(), "prefill+cache-credit+decode/argmin");
    assert_eq!(
        nested.policy().name(),
        "preferred-taints(prefill+decode+cache-credit)/argmin"
    );
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    load(&kv, &mut a);
    load(&parts, &mut b);
    load(&nested, &mut c);
    let overlaps = overlaps();
    for (i, req) in requests(&overlaps).iter().enumerate() {
        let peeked = kv.peek(req).unwrap().explanation;
        let selected = kv.select(&req.explained()).unwrap().explanation();
        for e in [peeked, selected] {
            let what = format!("request {i}: {e}");
            let terms = e.terms.unwrap_or_else(|| panic!("{what}: no terms"));
            let names: Vec<&str> = terms.iter().map(|(n, _)| n).collect();
            if i == 1 {
                assert_eq!(
                    names,
                    ["prefill", "cache-credit", "decode", "preferred-taints"],
                    "{what}"
                );
            } else {
                assert_eq!(names, ["prefill", "cache-credit", "decode"], "{what}");
            }
            assert_sums_to(terms, e.cost, &what);
            let (_, runner_up) = e.runner_up.unwrap_or_else(|| panic!("{what}: no runner-up"));
            assert_sums_to(e.runner_up_terms.expect("runner-up terms"), runner_up, &what);
            assert!(e.to_string().contains(" (prefill "), "{what}");
        }
        // The plain prompt's overlaps lie within it: the formula's terms
        // are the scorers', rank by rank.
        if i == 0 {
            let pinned = req.pinned_to_rank(peeked.chosen);
            let scored = parts.peek(&pinned).unwrap().explanation.terms.expect("composed terms");
            for (name, value) in terms_of(peeked) {
                let want = scored.get(name).expect(name);
                assert!(
                    (value - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{name}: kv {value}, scorer {want}"
                );
            }
        }
        let e = nested.peek(req).unwrap().explanation;
        let terms = e.terms.expect("composed terms");
        assert_eq!(terms.iter().map(|(n, _)| n).collect::<Vec<_>>(), ["preferred-taints"]);
        assert_sums_to(terms, e.cost, &format!("request {i}: {e}"));
        // Every row's terms, as `costs` gives their sums.
        for s in [&kv, &parts] {
            let costs = s.costs(req).unwrap();
            let terms = s.cost_terms(req).unwrap();
            assert_eq!(terms.len(), costs.len(), "request {i}");
            for ((w, t), (v, cost)) in terms.iter().zip(&costs) {
                assert_eq!(w, v, "request {i}");
                assert_sums_to(*t, *cost, &format!("request {i}, {w}"));
            }
        }
    }
    // The load modes' cost is one number: no terms.
    let least = service(WorkerSelectionPolicy::least_loaded());
    assert!(least.cost_terms(&SelectionRequest::new(64)).unwrap().is_empty());
}

fn terms_of(e: Explanation) -> Vec<(&'static str, f64)> {
    e.terms.map_or_else(Vec::new, |t| t.iter().collect())
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
