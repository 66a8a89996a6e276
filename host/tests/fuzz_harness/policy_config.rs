//! Harness of the `policy_config` fuzz target, shared with the regression
//! replay in `host/tests/fuzz_regressions.rs`.
//!
//! Arbitrary bytes as a worker-selection config file, YAML or TOML, through
//! [`WorkerSelectionConfig`] and a [`WorkerSelectionPolicyRegistry`] with
//! one custom type: every step returns `Ok` or a typed [`ConfigError`] /
//! [`RegistryError`], never panics; registering each instance's type name as
//! a custom type succeeds or fails exactly as the naming rules say; and every
//! policy a valid file builds selects on a small fleet (CPU and accelerator
//! workers, a cache overlap, a pin for `direct`).

use std::sync::Arc;

use arbitrary::Arbitrary;
use selkie::*;

/// The fuzzer's bytes as they are: bit 0 of the first byte picks TOML, the
/// rest is the file (so a seed or regression file is `\x00` or `\x01`
/// followed by the text). `Debug` prints a pasteable reproducer.
pub struct Input {
    pub toml: bool,
    pub bytes: Vec<u8>,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let toml = u8::arbitrary(u)? & 1 == 1;
        let bytes = u.bytes(u.len())?.to_vec();
        Ok(Input { toml, bytes })
    }
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Input {{ toml: {}, bytes: b\"{}\".to_vec() }}",
            self.toml,
            self.bytes.escape_ascii()
        )
    }
}

/// The custom type every registry in this harness carries: its parameters
/// must deserialize as `{ fallback: bool }`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CustomParams {
    #[serde(default)]
    fallback: bool,
}

fn custom_provider() -> WorkerSelectionPolicyProvider {
    Arc::new(|p: &WorkerSelectionPolicyParameters| {
        let params: CustomParams = p.deserialize()?;
        let factory: WorkerSelectionPolicyFactory = Arc::new(move |_, t, _| {
            if params.fallback {
                WorkerSelectionPolicy::random()
            } else {
                WorkerSelectionPolicy::least_loaded()
            }
            .with_worker_type(t)
        });
        Ok(factory)
    })
}

fn registry() -> WorkerSelectionPolicyRegistry {
    let mut r = WorkerSelectionPolicyRegistry::new();
    r.register("fuzz-custom", custom_provider())
        .expect("a fresh name registers");
    r
}

/// Whether `name` may be registered as a custom type in [`registry`].
fn registration_allowed(name: &str) -> Result<(), &'static str> {
    let canonical = BUILTIN_ALIASES
        .iter()
        .find(|(a, _)| *a == name)
        .map_or(name, |(_, c)| c);
    if name.is_empty() {
        Err("empty")
    } else if BUILTIN_POLICIES.contains(&canonical) {
        Err("builtin")
    } else if name == "fuzz-custom" {
        Err("duplicate")
    } else {
        Ok(())
    }
}

fn fleet_service(policy: WorkerSelectionPolicy) -> WorkerSelectionService {
    let s = WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(3),
            ..ServiceConfig::default()
        },
    );
    s.add_worker(WorkerRecord::new(1).with_dp(0, 2)).unwrap();
    s.add_worker(
        WorkerRecord::new(2)
            .with_device(DeviceKind::Cpu)
            .with_capacity_weight(0.5),
    )
    .unwrap();
    s.add_worker(WorkerRecord::new(3).with_max_active_requests(1)).unwrap();
    s
}

/// Parses, registers, resolves and builds; panics on any deviation.
pub fn check(input: &Input) {
    let parsed = match std::str::from_utf8(&input.bytes) {
        #[cfg(feature = "toml")]
        Ok(text) if input.toml => WorkerSelectionConfig::from_toml_str(text),
        // TOML is read only with the `toml` feature.
        #[cfg(not(feature = "toml"))]
        Ok(_) if input.toml => return,
        Ok(text) => WorkerSelectionConfig::from_yaml_str(text),
        // Not UTF-8: only the file path can see these bytes.
        Err(_) => return,
    };
    let config = match parsed {
        Ok(c) => c,
        Err(e @ ConfigError::Parse { .. }) => {
            assert!(
                std::error::Error::source(&e).is_some(),
                "the parser's error is kept: {e:?}"
            );
            return;
        }
        Err(
            ConfigError::EmptyInstanceField { .. }
            | ConfigError::ReservedInstanceName
            | ConfigError::ParametersNotAMapping { .. }
            | ConfigError::DuplicateInstance { .. }
            | ConfigError::UnknownInstance { .. },
        ) => return,
        Err(ConfigError::InvalidBlockSize { value, limit }) => {
            assert!(
                (value == 0 || value > limit) && limit == MAX_CONFIG_BLOCK_SIZE,
                "block_size {value} refused within 1 ..= {limit}"
            );
            return;
        }
        // The bounds checked before parsing: only for text past them.
        Err(ConfigError::TooLarge { len, limit }) => {
            assert!(len > limit && limit == MAX_CONFIG_BYTES, "too large: {len} > {limit}");
            return;
        }
        Err(ConfigError::TooManyCollections { count, limit }) => {
            assert!(
                count > limit && limit == MAX_CONFIG_COLLECTIONS,
                "too many: {count} > {limit}"
            );
            return;
        }
        Err(ConfigError::TooDeep { depth, limit }) => {
            assert!(
                depth > limit && limit == MAX_CONFIG_DEPTH,
                "too deep: {depth} > {limit}"
            );
            return;
        }
        Err(e) => panic!("parsing gave an unexpected error kind: {e:?}"),
    };
    let registry = registry();
    for name in config.instance_names() {
        let instance = config.instance(&name).expect("listed instance exists");
        let policy_type = instance.policy_type().to_owned();
        let mut r = registry.clone();
        let got = r.register(policy_type.clone(), custom_provider());
        match (registration_allowed(&policy_type), &got) {
            (Ok(()), Ok(())) => assert!(r.names().contains(&policy_type)),
            (Err("empty"), Err(RegistryError::EmptyName))
            | (Err("builtin"), Err(RegistryError::BuiltinName { .. }))
            | (Err("duplicate"), Err(RegistryError::Duplicate { .. })) => {}
            (want, _) => panic!("register {policy_type:?}: got {got:?}, expected {want:?}"),
        }
    }
    for role in [WorkerType::Aggregated, WorkerType::Prefill, WorkerType::Decode] {
        // A file that states its block size is resolved at the service's
        // (16, the fleet's), never without it.
        let resolved = match config.block_size() {
            Some(b) => {
                let plain = config.resolve(&registry, role);
                assert!(
                    matches!(plain, Err(ConfigError::BlockSizeUnresolved { block_size }) if block_size == b),
                    "resolve without a block size: {:?}",
                    plain.err()
                );
                config.resolve_at(&registry, role, 16)
            }
            None => config.resolve(&registry, role),
        };
        let factory = match resolved {
            Ok(f) => f,
            // Lengths that do not convert to blocks of 16, or a custom
            // type's, whose units are unknown.
            Err(ConfigError::BlockSizeNotWhole { to: 16, .. } | ConfigError::BlockSizeUnknownUnits { to: 16, .. }) => {
                continue
            }
            Err(ConfigError::Registry(RegistryError::UnknownType { name, available })) => {
                assert!(!registry.names().contains(&name), "{name:?} is registered: {available}");
                continue;
            }
            Err(ConfigError::Registry(RegistryError::Provider { .. })) => continue,
            Err(e) => panic!("resolve {role}: unexpected error kind {e:?}"),
        };
        let policy = factory(&KvRouterConfig::default(), role, RoutingPartitionRef::model("fuzz"));
        assert_eq!(policy.worker_type(), role);
        let service = fleet_service(policy);
        let overlaps = [WorkerOverlap::device(WorkerWithDpRank::new(1, 1), 3, 16)];
        let mut req = SelectionRequest::new(64).with_overlaps(&overlaps).explained();
        if service.policy().name() == "direct" {
            req = req.pinned_to_worker(2);
        }
        let mut held = Vec::new();
        // Four rows, one of them limited to one request: four selections fit.
        for i in 0..4 {
            match service.select(&req) {
                Ok(s) => {
                    assert!(!s.explanation().cost.is_nan(), "NaN cost: {:?}", s.explanation());
                    held.push(s);
                }
                Err(e) if i > 0 && e.is_overload() => break,
                Err(e) => panic!(
                    "{} ({role}) cannot select on a healthy fleet: {e:?}",
                    service.policy().name()
                ),
            }
        }
        drop(held);
        for id in 1..=3 {
            for r in service.worker_status(id).expect("registered").ranks {
                assert_eq!(
                    (r.active_requests, r.active_prefill_tokens, r.active_decode_blocks),
                    (0, 0, 0)
                );
            }
        }
    }
}
