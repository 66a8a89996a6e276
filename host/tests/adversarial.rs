//! Adversarial inputs: arbitrary plugin outputs, config text and discovery
//! files always give the typed result they should (each test computes it
//! from how its input was built), never a panic or a wrong booking.

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use selkie::*;

#[path = "fuzz_harness/discovery_file.rs"]
#[allow(dead_code)]
mod discovery_file;
#[path = "fuzz_harness/policy_config.rs"]
#[allow(dead_code)]
mod policy_config;

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
        4 => (0u64..1 << 40).prop_map(|k| -1e6 + 2e6 * (k as f64 / (1u64 << 40) as f64)),
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

    /// Text near a valid config (a few characters deleted, replaced or
    /// inserted), YAML or TOML, through the `policy_config` fuzz harness:
    /// each step gives `Ok` or the typed error its rules say, and every
    /// policy a surviving config builds selects on a small fleet.
    #[test]
    fn config_text_near_valid_configs_keeps_the_harness_rules(
        base in 0..VALID_CONFIGS.len(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), prop::option::of(prop::sample::select(EDIT_CHARS.to_vec()))), 0..4),
    ) {
        let (toml, text) = VALID_CONFIGS[base];
        let mut chars: Vec<char> = text.chars().collect();
        for (at, c) in &edits {
            let i = at.index(chars.len() + 1);
            match c {
                Some(c) if i < chars.len() && i % 2 == 0 => chars[i] = *c,
                Some(c) => chars.insert(i.min(chars.len()), *c),
                None if i < chars.len() => {
                    chars.remove(i);
                }
                None => {}
            }
        }
        let text: String = chars.into_iter().collect();
        // TOML is read only with the `toml` feature.
        if edits.is_empty() && (!toml || cfg!(feature = "toml")) {
            let parsed = parse_config(toml, &text);
            prop_assert!(parsed.is_ok(), "{text:?}: {parsed:?}");
        }
        policy_config::check(&policy_config::Input { toml, bytes: text.into_bytes() });
    }

    /// A one-instance config built from parts whose effect is known gets
    /// exactly the result its parts say: the parse error, the refused
    /// instance, the provider's typed error for each role, or the policy.
    #[test]
    fn config_like_text_gets_exactly_the_result_its_parts_say(
        role in prop::sample::select(vec!["aggregated", "prefill", "decode", "encode"]),
        name in prop::sample::select(vec!["a", "cache-heavy", "default", ""]),
        ty in prop::sample::select(vec!["kv", "random", "least-loaded", "direct", "prefix-hash", "power-of-two-choices", "nope", ""]),
        params in prop::sample::select(PARAMS.to_vec()),
    ) {
        let text = format!("{role}: {name}\ninstances:\n  - name: {name}\n    type: {ty}\n    parameters: {params}\n");
        let parsed = WorkerSelectionConfig::from_yaml_str(&text);
        let parse_fails = role == "encode" || name.is_empty() || ty.is_empty() || params == "{ x: .nan }";
        let cfg = match parsed {
            Err(ConfigError::Parse { .. }) if parse_fails => return Ok(()),
            Err(ConfigError::ReservedInstanceName) if !parse_fails && name == "default" => return Ok(()),
            Err(ConfigError::ParametersNotAMapping { instance })
                if !parse_fails && name != "default" && params == "[1]" =>
            {
                prop_assert_eq!(instance, name);
                return Ok(());
            }
            Ok(cfg) if !parse_fails && name != "default" && params != "[1]" => cfg,
            other => return Err(TestCaseError::fail(format!("{text:?}: {other:?}"))),
        };
        let registry = WorkerSelectionPolicyRegistry::new();
        for r in [WorkerType::Aggregated, WorkerType::Prefill, WorkerType::Decode] {
            let resolved = cfg.resolve(&registry, r);
            let selected = r.as_str() == role;
            let ty = if selected { ty } else { "kv" };
            let params = if selected { params } else { "{}" };
            let canonical = if ty == "power-of-two-choices" { "power-of-two" } else { ty };
            let none = params == "{}" || params == "null";
            let expected: Result<(), &str> = match (canonical, params) {
                ("nope", _) => Err("unknown type"),
                (_, _) if none => Ok(()),
                ("kv", "{ overlap_score_credit: -1 }") => Err("kv weight"),
                ("kv", "{ overlap_score_credit: 2 }") | ("prefix-hash", "{ load_factor: 2 }") => Ok(()),
                ("kv" | "prefix-hash", _) => Err("parameters"),
                _ => Err("unexpected parameters"),
            };
            use WorkerSelectionPolicyProviderError as P;
            match (resolved, expected) {
                (Ok(factory), Ok(())) => {
                    let p = factory(&KvRouterConfig::default(), r, RoutingPartitionRef::model("m"));
                    prop_assert_eq!(p.worker_type(), r);
                    prop_assert_eq!(p.name(), canonical);
                    let credit = if selected && params == "{ overlap_score_credit: 2 }" { 2.0 } else { 1.0 };
                    if canonical == "kv" {
                        prop_assert_eq!(p.kv_router_config().overlap_score_credit, credit);
                    }
                }
                (Err(ConfigError::Registry(RegistryError::UnknownType { name, .. })), Err("unknown type")) => {
                    prop_assert_eq!(name, "nope");
                }
                (Err(ConfigError::Registry(RegistryError::Provider { policy_type, source })), Err(want)) => {
                    prop_assert_eq!(policy_type.as_str(), ty);
                    let kind = match source {
                        P::KvWeight { .. } => "kv weight",
                        P::Parameters { .. } => "parameters",
                        P::UnexpectedParameters => "unexpected parameters",
                        other => return Err(TestCaseError::fail(format!("{other:?}"))),
                    };
                    prop_assert_eq!(kind, want, "{:?}", text);
                }
                (got, want) => return Err(TestCaseError::fail(format!("{text:?} {r}: got {:?}, expected {want:?}", got.err()))),
            }
        }
    }

    /// A discovery file built from records whose validity is known, in JSON
    /// or TOML, delivers exactly its good records and refuses exactly its
    /// bad ones, each by worker (a repeated id once), and through the
    /// `discovery_file` fuzz harness keeps its rules.
    #[test]
    fn discovery_files_apply_the_records_their_parts_allow(
        records in prop::collection::vec((0u64..5, 0u32..3, prop::sample::select(vec![1.0f32, 2.5, 0.0]), prop::sample::select(vec!["live", "draining", "cordoned", "paused"])), 0..6),
        toml in any::<bool>(),
    ) {
        // TOML files are read only with the `toml` feature.
        let toml = toml && cfg!(feature = "toml");
        let text = if toml {
            records.iter().map(|(id, dp, w, st)| format!("[[workers]]\nworker_id = {id}\ndata_parallel_size = {dp}\ncapacity_weight = {w:?}\nstate = \"{st}\"\n")).collect::<String>()
                + if records.is_empty() { "workers = []\n" } else { "" }
        } else {
            let list: Vec<String> = records.iter().map(|(id, dp, w, st)| format!("{{\"worker_id\": {id}, \"data_parallel_size\": {dp}, \"capacity_weight\": {w:?}, \"state\": \"{st}\"}}")).collect();
            format!("{{\"workers\": [{}]}}", list.join(", "))
        };
        let path = std::env::temp_dir().join(format!(
            "selkie-adv-{}-{:?}.{}",
            std::process::id(),
            std::thread::current().id(),
            if toml { "toml" } else { "json" }
        ).replace(['(', ')'], ""));
        std::fs::write(&path, &text).unwrap();
        let mut source = FileDiscovery::new(&path);
        let polled = source.poll();
        let _ = std::fs::remove_file(&path);
        let service = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
        // What each record's parts say: a repeated id refuses every record
        // of that id (once, at its first), an unknown state refuses the
        // record as unparsable, a zero rank count or weight as invalid; the
        // rest is the snapshot, in the file's order.
        let times = |id| records.iter().filter(|r| r.0 == id).count();
        let mut want_refused = Vec::new();
        let mut want = Vec::new();
        for (i, &(id, dp, w, st)) in records.iter().enumerate() {
            if times(id) > 1 {
                if records.iter().position(|r| r.0 == id) == Some(i) {
                    want_refused.push(("duplicate", id));
                }
            } else if st == "paused" {
                want_refused.push(("parse", id));
            } else if dp == 0 || w == 0.0 {
                want_refused.push(("invalid", id));
            } else {
                want.push(id);
            }
        }
        let parsed = polled.unwrap().unwrap();
        prop_assert_eq!(parsed.iter().map(|r| r.worker_id).collect::<Vec<_>>(), want, "{}", text);
        let refused: Vec<_> = source
            .take_refused()
            .into_iter()
            .map(|e| match e {
                DiscoveryError::FileRecordParse { worker_id, .. } => ("parse", worker_id),
                DiscoveryError::FileRecordInvalid { source, .. } => match *source {
                    DiscoveryError::InvalidWorker { worker_id, .. } => ("invalid", worker_id),
                    DiscoveryError::DuplicateInSnapshot { worker_id } => ("duplicate", worker_id),
                    other => ("other", other.reason().len() as u64),
                },
                _ => ("other", 0),
            })
            .collect();
        prop_assert_eq!(refused, want_refused, "{}", text);
        service.sync(parsed.clone()).unwrap();
        let mut want = parsed;
        want.sort_by_key(|r| r.worker_id);
        prop_assert_eq!(service.workers(), want);
        discovery_file::check(&discovery_file::Input { toml, bytes: text.into_bytes() });
    }
}

/// Configs the edits start from: every built-in, parameters, aliases and
/// roles, in both formats (`true`: TOML).
/// A config's text as TOML (`toml`, with the feature) or YAML.
fn parse_config(toml: bool, text: &str) -> Result<WorkerSelectionConfig, ConfigError> {
    #[cfg(feature = "toml")]
    if toml {
        return WorkerSelectionConfig::from_toml_str(text);
    }
    assert!(!toml, "TOML configs need the `toml` feature");
    WorkerSelectionConfig::from_yaml_str(text)
}

const VALID_CONFIGS: [(bool, &str); 3] = [
    (
        false,
        "aggregated: cache-heavy\ndecode: balanced\nprefill: default\ninstances:\n  - name: cache-heavy\n    type: kv\n    parameters: { overlap_score_credit: 2.0, router_temperature: 0.3 }\n  - name: balanced\n    type: power-of-two-choices\n  - name: hashed\n    type: prefix-hash\n    parameters:\n      load_factor: 1.5\n",
    ),
    (
        false,
        "decode: d\ninstances:\n  - { name: d, type: device-aware-weighted, parameters: { non_cpu_to_cpu_ratio: 4 } }\n  - { name: r, type: round-robin }\n",
    ),
    (
        true,
        "aggregated = \"cache-heavy\"\ndecode = \"balanced\"\n[[instances]]\nname = \"cache-heavy\"\ntype = \"kv\"\nparameters = { overlap_score_credit = 2.0, router_temperature = 0.3 }\n[[instances]]\nname = \"balanced\"\ntype = \"least-loaded\"\n",
    ),
];

/// Characters an edit inserts or replaces with: the ones that change a
/// config's structure.
const EDIT_CHARS: [char; 12] = [':', ' ', '\n', '-', '{', '}', '[', ']', '"', '=', 'x', '1'];

/// Parameters of the config-like text, each with a known effect.
const PARAMS: [&str; 7] = [
    "{}",
    "null",
    "{ overlap_score_credit: -1 }",
    "{ overlap_score_credit: 2 }",
    "[1]",
    "{ load_factor: 2 }",
    "{ x: .nan }",
];
