//! Replays the minimized inputs committed under `fuzz/regressions/<target>/`
//! through the same checks the fuzz targets run (`fuzz_harness/`, shared
//! with `fuzz/fuzz_targets/` by `#[path]`), so a fixed crash stays fixed
//! without nightly or libFuzzer. Adding a regression is dropping the file
//! `cargo fuzz tmin` wrote into that directory (see FUZZING.md).
//!
//! The `*_reproducer` tests are inputs written as their `Debug` prints
//! them: they keep the reproducer format pasteable and the harnesses
//! exercised in every `cargo test`.

#[path = "fuzz_harness/adversarial_policy.rs"]
#[allow(dead_code)]
mod adversarial_policy;
#[path = "fuzz_harness/discovery_file.rs"]
#[allow(dead_code)]
mod discovery_file;
#[path = "fuzz_harness/kv_index_model.rs"]
#[allow(dead_code)]
mod kv_index_model;
#[path = "fuzz_harness/policy_config.rs"]
#[allow(dead_code)]
mod policy_config;

#[path = "../../kernel/tests/fuzz_harness/replay.rs"]
mod replay;
use arbitrary::{Arbitrary, Unstructured};
use replay::replay;

#[test]
fn adversarial_policy_regressions() {
    replay("adversarial_policy", adversarial_policy::check);
}

#[test]
fn policy_config_regressions() {
    replay("policy_config", policy_config::check);
}

#[test]
fn discovery_file_regressions() {
    replay("discovery_file", discovery_file::check);
}

#[test]
fn kv_index_model_regressions() {
    replay("kv_index_model", kv_index_model::check);
}

/// A hand-written `kv_index_model` input, written as its `Debug` prints:
/// workers join, store runs in every tier, an event id skips (a gap), one
/// worker leaves and another is forgotten, with queries in between.
#[test]
fn kv_index_model_reproducer() {
    use kv_index_model::*;
    let store = |worker, tier, id_step, from, len| Op::Store {
        worker,
        rank: 0,
        tier,
        id_step,
        prompt: 1,
        from,
        len,
        parent: None,
        self_parent: false,
        alias: false,
    };
    let query = Op::Query {
        prompt: 1,
        len: 16,
        change: None,
    };
    let input = Input {
        ops: vec![
            Op::Join { worker: 1 },
            Op::Join { worker: 2 },
            store(1, 0, 2, 0, 3),
            store(1, 0, 2, 4, 3),
            store(1, 1, 2, 8, 3),
            store(2, 0, 2, 0, 1),
            store(2, 2, 2, 1, 3),
            query,
            store(1, 0, 1, 12, 2),
            Op::Remove {
                worker: 2,
                rank: 0,
                tier: 2,
                id_step: 2,
                prompt: 1,
                from: 2,
                len: 0,
                unknown: true,
                alias: false,
                repeat: 0,
            },
            Op::Clear {
                worker: 2,
                rank: 1,
                tier: 0,
                id_step: 2,
            },
            query,
            Op::Leave { worker: 1 },
            Op::Forget { worker: 2 },
            Op::Join { worker: 3 },
            store(3, 0, 2, 0, 3),
            Op::Query {
                prompt: 1,
                len: 5,
                change: Some(1),
            },
            query,
        ],
    };
    check(&input);
}

/// A hand-written `kv_index_model` input of engine behaviours: a block
/// under two engine hashes (one removed, the other still holding it), a
/// block stored twice and removed twice in one event, a device store
/// under a parent held in host memory, an event id too far ahead, a new
/// incarnation (event id 0), and a worker leaving and coming back between
/// two syncs, its new engine's first event before the sync or after it.
#[test]
fn kv_index_model_engine_reproducer() {
    use kv_index_model::*;
    let store = |worker, tier, id_step, from, len, alias| Op::Store {
        worker,
        rank: 0,
        tier,
        id_step,
        prompt: 2,
        from,
        len,
        parent: None,
        self_parent: false,
        alias,
    };
    let remove = |worker, id_step, from, len, alias, repeat| Op::Remove {
        worker,
        rank: 0,
        tier: 0,
        id_step,
        prompt: 2,
        from,
        len,
        unknown: false,
        alias,
        repeat,
    };
    let query = Op::Query {
        prompt: 2,
        len: 16,
        change: None,
    };
    let input = Input {
        ops: vec![
            Op::Join { worker: 1 },
            Op::Join { worker: 2 },
            store(1, 0, 2, 0, 2, false),
            store(1, 0, 2, 0, 0, true),
            query,
            remove(1, 2, 0, 0, false, 0),
            query,
            store(1, 0, 2, 0, 0, true),
            remove(1, 2, 0, 0, true, 1),
            query,
            store(2, 1, 2, 0, 3, false),
            store(2, 0, 2, 4, 2, false),
            query,
            store(1, 0, 142, 5, 1, false),
            store(1, 0, 143, 0, 1, false),
            query,
            Op::Rejoin { worker: 2 },
            store(2, 0, 2, 0, 1, false),
            query,
            Op::Rejoin { worker: 1 },
            query,
            store(1, 0, 143, 0, 3, false),
            query,
            Op::Rejoin { worker: 2 },
            store(2, 0, 143, 0, 2, false),
            query,
        ],
    };
    check(&input);
}

#[test]
fn adversarial_policy_reproducer() {
    use adversarial_policy::*;
    let bad = Script {
        filters: [FilterAct::DropEvery(0), FilterAct::Keep],
        scorers: [
            ScorerAct::Costs([Cost::Max, Cost::Finite(1), Cost::Max, Cost::NegZero]),
            ScorerAct::Costs([Cost::Max, Cost::Tiny, Cost::Finite(-3), Cost::Nan]),
            ScorerAct::Zero,
        ],
        picker: PickAct::Len,
    };
    let input = Input {
        workers: vec![
            Worker {
                id: 1,
                dp_start: 0,
                dp_size: 3,
                limit: Some(0),
                state: 0,
            },
            Worker {
                id: 2,
                dp_start: 2,
                dp_size: 1,
                limit: None,
                state: 0,
            },
            Worker {
                id: 3,
                dp_start: 0,
                dp_size: 1,
                limit: None,
                state: 1,
            },
        ],
        ops: vec![
            Op::Select {
                isl: 100,
                explained: true,
                script: WELL_BEHAVED,
            },
            Op::Select {
                isl: 17,
                explained: false,
                script: bad,
            },
            Op::Peek {
                isl: 5,
                script: Script {
                    picker: PickAct::UsizeMax,
                    ..WELL_BEHAVED
                },
            },
            Op::Select {
                isl: 5,
                explained: false,
                script: Script {
                    picker: PickAct::PanicAny,
                    ..WELL_BEHAVED
                },
            },
            Op::Select {
                isl: 5,
                explained: false,
                script: Script {
                    filters: [FilterAct::Keep, FilterAct::PanicAt(1)],
                    ..WELL_BEHAVED
                },
            },
            Op::Select {
                isl: 9,
                explained: false,
                script: WELL_BEHAVED,
            },
            Op::OutputBlock { booking: 0 },
            Op::Retarget {
                booking: 1,
                worker: 2,
                rank: 2,
            },
            Op::Remove { id: 1 },
            Op::OutputBlock { booking: 0 },
            Op::Add(Worker {
                id: 1,
                dp_start: 0,
                dp_size: 1,
                limit: None,
                state: 0,
            }),
            Op::PrefillComplete { booking: 1 },
            Op::Select {
                isl: 1,
                explained: false,
                script: Script {
                    picker: PickAct::Row(0),
                    ..WELL_BEHAVED
                },
            },
            Op::Release { booking: 0 },
            Op::SetState { id: 2, state: 2 },
            Op::Select {
                isl: 1,
                explained: false,
                script: Script {
                    filters: [FilterAct::DropAll, FilterAct::Keep],
                    ..WELL_BEHAVED
                },
            },
        ],
    };
    check(&input);
}

#[test]
fn policy_config_reproducer() {
    use policy_config::*;
    let yaml = b"aggregated: a\ndecode: d\ninstances:\n  - { name: a, type: fuzz-custom, parameters: { fallback: true } }\n  - { name: d, type: device-aware-weighted, parameters: { non_cpu_to_cpu_ratio: 4294967295 } }\n";
    check(&Input {
        toml: false,
        bytes: yaml.to_vec(),
    });
    let toml = b"prefill = \"p\"\n[[instances]]\nname = \"p\"\ntype = \"kv\"\nparameters = { router_temperature = 1e300, overlap_score_credit = 1e300 }\n";
    check(&Input {
        toml: true,
        bytes: toml.to_vec(),
    });
}

#[test]
fn discovery_file_reproducer() {
    use discovery_file::*;
    let json = br#"{ "workers": [ { "worker_id": 1, "data_parallel_size": 2, "capacity_weight": 1e-45 }, { "worker_id": 2, "state": "draining" } ] }"#;
    check(&Input {
        toml: false,
        bytes: json.to_vec(),
    });
    check(&Input {
        toml: true,
        bytes: b"[[workers]]\nworker_id = 1\n[[workers]]\nworker_id = 1\n".to_vec(),
    });
    check(&Input {
        toml: false,
        bytes: b"\xff".to_vec(),
    });
}

#[test]
fn parser_inputs_decode_as_flag_byte_then_file() {
    let bytes = b"\x01a = 1\n";
    let input = policy_config::Input::arbitrary_take_rest(Unstructured::new(bytes)).unwrap();
    assert!(input.toml);
    assert_eq!(input.bytes, b"a = 1\n");
    let input = discovery_file::Input::arbitrary_take_rest(Unstructured::new(b"\x00[]")).unwrap();
    assert_eq!((input.toml, &input.bytes[..]), (false, &b"[]"[..]));
}
