//! Adversarial inputs (SPEC §7): arbitrary plugin outputs and arbitrary
//! config / discovery bytes always give a typed result, never a panic or a
//! wrong booking.

use proptest::prelude::*;
use selkie::*;

type R<T> = Result<T, WorkerSelectionPolicyError>;

struct Scripted(Vec<f64>);
impl WorkerScorer for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        for (i, cost) in costs.iter_mut().enumerate().take(c.len()) {
            *cost = self.0[i % self.0.len()];
        }
        Ok(())
    }
}

struct ScriptedPick(usize);
impl WorkerPicker for ScriptedPick {
    fn pick(&self, _: &WorkerSelectionContext<'_>, _: WorkerInputView<'_>) -> R<usize> {
        Ok(self.0)
    }
}

fn cost() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -1e6f64..1e6,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(f64::MAX),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_plugin_output_is_a_typed_result(
        workers in 1usize..8,
        costs in prop::collection::vec(cost(), 1..8),
        scorers in 1usize..3,
        pick in 0usize..10,
    ) {
        let scorer_list: Vec<Box<dyn WorkerScorer>> =
            (0..scorers).map(|_| Box::new(Scripted(costs.clone())) as Box<dyn WorkerScorer>).collect();
        let policy = WorkerSelectionPolicy::new(
            KvRouterConfig::default(),
            WorkerType::Aggregated,
            scorer_list,
            Box::new(ScriptedPick(pick)),
        );
        let s = WorkerSelectionService::new(policy, ServiceConfig::default());
        for id in 0..workers as u64 {
            s.add_worker(WorkerRecord::new(id)).unwrap();
        }
        // What the contract says must happen.
        let per_row: Vec<f64> = (0..workers).map(|i| costs[i % costs.len()]).collect();
        let totals_finite = per_row.iter().all(|&c| {
            let mut t = 0.0f64;
            (0..scorers).all(|_| { t += c; c.is_finite() && t.is_finite() })
        });
        match s.select(&SelectionRequest::new(16)) {
            Ok(sel) => {
                prop_assert!(totals_finite && pick < workers);
                prop_assert!(sel.worker().worker_id < workers as u64);
                prop_assert_eq!(s.worker_status(sel.worker().worker_id).unwrap().ranks[0].active_requests, 1);
            }
            Err(SelectionError::Policy(WorkerSelectionPolicyError::NonFiniteCost { scorer, row, .. })) => {
                prop_assert!(!totals_finite);
                prop_assert_eq!(scorer, "scripted");
                prop_assert!(row < workers);
            }
            Err(SelectionError::Policy(WorkerSelectionPolicyError::InvalidPickerRow { row, candidate_count })) => {
                prop_assert!(totals_finite);
                prop_assert_eq!((row, candidate_count), (pick, workers));
            }
            Err(e) => prop_assert!(false, "unexpected {e:?}"),
        }
        for id in 0..workers as u64 {
            prop_assert_eq!(s.worker_status(id).unwrap().ranks[0].active_requests, 0, "leaked on {}", id);
        }
    }

    #[test]
    fn arbitrary_config_text_never_panics(text in ".{0,200}") {
        let _ = WorkerSelectionConfig::from_yaml_str(&text);
        let _ = WorkerSelectionConfig::from_toml_str(&text);
    }

    #[test]
    fn config_like_text_never_panics(
        role in prop::sample::select(vec!["aggregated", "prefill", "decode", "encode", "x"]),
        name in "[a-z-]{0,6}",
        ty in prop::sample::select(vec!["kv", "random", "least-loaded", "direct", "nope", ""]),
        params in prop::sample::select(vec!["{}", "{ overlap_score_credit: -1 }", "[1]", "null", "{ non_cpu_to_cpu_ratio: 0 }", "{ x: .nan }"]),
    ) {
        let text = format!("{role}: {name}\ninstances:\n  - name: {name}\n    type: {ty}\n    parameters: {params}\n");
        if let Ok(cfg) = WorkerSelectionConfig::from_yaml_str(&text) {
            for role in [WorkerType::Aggregated, WorkerType::Prefill, WorkerType::Decode] {
                if let Ok(f) = cfg.resolve(&WorkerSelectionPolicyRegistry::new(), role) {
                    let p = f(&KvRouterConfig::default(), role, RoutingPartitionRef::model("m"));
                    prop_assert_eq!(p.worker_type(), role);
                }
            }
        }
    }
}

#[test]
fn arbitrary_discovery_files_never_panic() {
    let dir = std::env::temp_dir().join(format!("selkie-adv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    let s = WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default());
    let fragments = prop::collection::vec(
        prop::sample::select(vec![
            "{",
            "}",
            "[",
            "]",
            ",",
            "\"workers\":",
            "\"worker_id\": 1",
            "\"worker_id\": -1",
            "\"data_parallel_size\": 0",
            "\"capacity_weight\": 0",
            "\"state\": \"draining\"",
            "\"device\": \"tpu\"",
            "{\"worker_id\": 2}",
            "null",
        ]),
        0..12,
    );
    runner
        .run(&(fragments, any::<bool>()), |(parts, toml)| {
            let path = dir.join(if toml { "w.toml" } else { "w.json" });
            std::fs::write(&path, parts.concat()).unwrap();
            let mut src = FileDiscovery::new(&path);
            if let Ok(Some(snapshot)) = src.poll() {
                // Whatever parsed is applied or refused with a typed error.
                let _ = s.sync(snapshot);
            }
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
