//! The policy registry rules and the per-role config file.

use std::sync::Arc;

use selkie::*;

fn custom_provider() -> WorkerSelectionPolicyProvider {
    #[derive(serde::Deserialize)]
    struct Params {
        #[serde(default)]
        pick: usize,
    }
    struct Fixed(usize);
    impl WorkerPicker for Fixed {
        fn pick(
            &self,
            _: &WorkerSelectionContext<'_>,
            v: WorkerInputView<'_>,
        ) -> Result<usize, WorkerSelectionPolicyError> {
            Ok(self.0.min(v.len() - 1))
        }
    }
    Arc::new(|p: &WorkerSelectionPolicyParameters| {
        let params: Params = p.deserialize()?;
        let pick = params.pick;
        Ok(
            Arc::new(move |cfg: &KvRouterConfig, t: WorkerType, _: RoutingPartitionRef<'_>| {
                WorkerSelectionPolicy::new(*cfg, t, vec![], Box::new(Fixed(pick))).with_name("fixed")
            }) as WorkerSelectionPolicyFactory,
        )
    })
}

#[test]
fn builtins_are_always_present_and_cannot_be_taken() {
    let mut r = WorkerSelectionPolicyRegistry::with_providers([("fixed".to_string(), custom_provider())]).unwrap();
    for name in BUILTIN_POLICIES {
        assert!(r.names().contains(&name.to_string()), "{name}");
        assert!(matches!(
            r.register(name, custom_provider()),
            Err(RegistryError::BuiltinName { name: n }) if n == name
        ));
        let p = r.build(
            name,
            &Default::default(),
            &KvRouterConfig::default(),
            WorkerType::Decode,
            RoutingPartitionRef::model("m"),
        );
        let p = p.unwrap();
        // A composed policy is named after its parts: without parameters,
        // no scorers and the default picker.
        let want = if name == "composed" { "argmin" } else { name };
        assert_eq!(p.name(), want);
        assert_eq!(p.worker_type(), WorkerType::Decode);
    }
    assert!(matches!(
        r.register("default", custom_provider()),
        Err(RegistryError::BuiltinName { .. })
    ));
    assert!(matches!(
        r.register("", custom_provider()),
        Err(RegistryError::EmptyName)
    ));
    assert!(matches!(
        r.register("fixed", custom_provider()),
        Err(RegistryError::Duplicate { .. })
    ));
    assert!(matches!(
        WorkerSelectionPolicyRegistry::with_providers([("kv".to_string(), custom_provider())]),
        Err(RegistryError::BuiltinName { .. })
    ));
    assert!(r.provider("default").is_ok(), "default is kv");
    assert!(matches!(
        r.register("power-of-two-choices", custom_provider()),
        Err(RegistryError::BuiltinName { .. })
    ));
    let p2c = r.build(
        "power-of-two-choices",
        &Default::default(),
        &KvRouterConfig::default(),
        WorkerType::Aggregated,
        RoutingPartitionRef::model("m"),
    );
    assert_eq!(p2c.unwrap().name(), "power-of-two", "Dynamo's router-mode label works");
}

#[test]
fn unknown_names_list_the_available_ones() {
    let r = WorkerSelectionPolicyRegistry::with_providers([("fixed".to_string(), custom_provider())]).unwrap();
    let e = r.provider("fastest").err().unwrap();
    match &e {
        RegistryError::UnknownType { name, available } => {
            assert_eq!(name, "fastest");
            assert_eq!(
                available,
                "composed, device-aware-weighted, direct, fixed, kv, least-loaded, power-of-two, prefix-hash, random, round-robin"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("least-loaded"));
}

#[test]
fn bad_parameters_are_provider_errors() {
    let r = WorkerSelectionPolicyRegistry::new();
    let bad = serde_saphyr::from_str::<WorkerSelectionPolicyParameters>("{ overlap_score_credit: -1 }").unwrap();
    // The cost model's own typed error, with the value, under the policy type.
    match r.factory("kv", &bad) {
        Err(RegistryError::Provider {
            policy_type,
            source:
                WorkerSelectionPolicyProviderError::KvWeight {
                    value: -1.0,
                    source:
                        KvConfigError {
                            field: KvConfigField::OverlapScoreCredit,
                            problem: KvConfigProblem::Negative,
                        },
                },
        }) => assert_eq!(policy_type, "kv"),
        other => panic!("{:?}", other.err()),
    }
    let unknown = serde_saphyr::from_str::<WorkerSelectionPolicyParameters>("{ credit: 1 }").unwrap();
    match r.factory("kv", &unknown) {
        Err(RegistryError::Provider {
            source: e @ WorkerSelectionPolicyProviderError::Parameters { .. },
            ..
        }) => assert!(e.to_string().contains("credit"), "{e}"),
        other => panic!("{:?}", other.err()),
    }
    let extra = serde_saphyr::from_str::<WorkerSelectionPolicyParameters>("{ x: 1 }").unwrap();
    assert!(matches!(
        r.factory("random", &extra),
        Err(RegistryError::Provider {
            source: WorkerSelectionPolicyProviderError::UnexpectedParameters,
            ..
        })
    ));
}

const YAML: &str = r#"
aggregated: cache-heavy
prefill: default
decode: pinned
instances:
  - name: cache-heavy
    type: kv
    parameters: { overlap_score_credit: 2.0, router_temperature: 0.25 }
  - name: pinned
    type: fixed
    parameters: { pick: 1 }
"#;

const TOML: &str = r#"
aggregated = "cache-heavy"
prefill = "default"
decode = "pinned"
[[instances]]
name = "cache-heavy"
type = "kv"
parameters = { overlap_score_credit = 2.0, router_temperature = 0.25 }
[[instances]]
name = "pinned"
type = "fixed"
parameters = { pick = 1 }
"#;

#[test]
fn config_file_chooses_a_policy_per_role_in_yaml_and_toml() {
    let registry = WorkerSelectionPolicyRegistry::with_providers([("fixed".to_string(), custom_provider())]).unwrap();
    let base = KvRouterConfig {
        overlap_score_credit: 0.5,
        ..KvRouterConfig::default()
    };
    #[allow(unused_mut)]
    let mut configs = vec![WorkerSelectionConfig::from_yaml_str(YAML).unwrap()];
    #[cfg(feature = "toml")]
    configs.push(WorkerSelectionConfig::from_toml_str(TOML).unwrap());
    for cfg in configs {
        assert_eq!(cfg.instance_names(), vec!["cache-heavy", "pinned"]);
        let part = RoutingPartitionRef {
            model: "llama",
            routing_group: Some("a"),
        };
        let agg = cfg.resolve(&registry, WorkerType::Aggregated).unwrap()(&base, WorkerType::Aggregated, part);
        assert_eq!(agg.name(), "kv");
        assert_eq!(agg.kv_router_config().overlap_score_credit, 2.0);
        assert_eq!(agg.kv_router_config().router_temperature, 0.25);
        let pre = cfg.resolve(&registry, WorkerType::Prefill).unwrap()(&base, WorkerType::Prefill, part);
        assert_eq!(
            (pre.name(), pre.kv_router_config().overlap_score_credit),
            ("kv", 0.5),
            "default: the router's config"
        );
        let dec = cfg.resolve(&registry, WorkerType::Decode).unwrap()(&base, WorkerType::Decode, part);
        assert_eq!(dec.name(), "fixed");
        // The factory's policy really runs.
        let s = WorkerSelectionService::new(dec, ServiceConfig::default());
        s.add_worker(WorkerRecord::new(1)).unwrap();
        s.add_worker(WorkerRecord::new(2)).unwrap();
        assert!(s.select(&SelectionRequest::new(1)).is_ok());
    }
}

#[test]
fn config_files_on_disk() {
    let dir = std::env::temp_dir().join(format!("selkie-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("p.yaml"), YAML).unwrap();
    std::fs::write(dir.join("p.toml"), TOML).unwrap();
    #[cfg(feature = "toml")]
    assert_eq!(
        WorkerSelectionConfig::from_path(dir.join("p.yaml")).unwrap(),
        WorkerSelectionConfig::from_path(dir.join("p.toml")).unwrap()
    );
    // A build without the `toml` feature refuses TOML files, naming it.
    #[cfg(not(feature = "toml"))]
    {
        let e = WorkerSelectionConfig::from_path(dir.join("p.toml")).unwrap_err();
        assert!(
            matches!(e, ConfigError::FormatNotBuilt { format: "TOML", feature: "toml", ref path } if path == &dir.join("p.toml")),
            "{e:?}"
        );
        assert!(e.to_string().contains("need selkie's `toml` feature"), "{e}");
        assert!(WorkerSelectionConfig::from_path(dir.join("p.yaml")).is_ok());
    }
    assert!(matches!(
        WorkerSelectionConfig::from_path(dir.join("none.yaml")),
        Err(ConfigError::Io { .. })
    ));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn malformed_configs_are_refused() {
    let cases = [
        ("aggregated: [1, 2]", "parse"),
        ("aggregated: x\nfoo: 1", "parse"),
        ("aggregated: nowhere", "unknown"),
        (
            "instances:\n  - { name: a, type: kv }\n  - { name: a, type: random }",
            "duplicate",
        ),
        ("instances:\n  - { name: default, type: kv }", "reserved"),
        ("instances:\n  - { name: a, type: kv, parameters: [1] }", "mapping"),
        (
            "instances:\n  - { name: a, type: kv }\n  - { name: b, type: '' }",
            "empty",
        ),
        ("instances:\n  - { name: a }", "parse"),
    ];
    for (text, kind) in cases {
        let e = WorkerSelectionConfig::from_yaml_str(text).unwrap_err();
        let ok = match kind {
            // The parser's own error is kept as the source.
            "parse" => {
                matches!(e, ConfigError::Parse { format: "YAML", .. }) && std::error::Error::source(&e).is_some()
            }
            "unknown" => matches!(e, ConfigError::UnknownInstance { role: "aggregated", .. }),
            "duplicate" => matches!(&e, ConfigError::DuplicateInstance { instance } if instance == "a"),
            "reserved" => matches!(e, ConfigError::ReservedInstanceName),
            "mapping" => matches!(&e, ConfigError::ParametersNotAMapping { instance } if instance == "a"),
            "empty" => matches!(e, ConfigError::EmptyInstanceField { index: 1 }),
            _ => unreachable!(),
        };
        assert!(ok, "{text:?}: {e:?}");
    }
    #[cfg(feature = "toml")]
    {
        let e = WorkerSelectionConfig::from_toml_str("aggregated = ").unwrap_err();
        assert!(matches!(e, ConfigError::Parse { format: "TOML", .. }), "{e:?}");
        assert!(std::error::Error::source(&e).is_some());
    }
    let cfg =
        WorkerSelectionConfig::from_yaml_str("aggregated: a\ninstances:\n  - { name: a, type: fastest }").unwrap();
    assert!(matches!(
        cfg.resolve(&WorkerSelectionPolicyRegistry::new(), WorkerType::Aggregated),
        Err(ConfigError::Registry(RegistryError::UnknownType { .. }))
    ));
}

/// The host checks every weight of the KV cost model with the cost model's
/// own bounds, and reports the field it was given under its own name.
#[test]
fn kv_router_config_checks_every_cost_weight_by_its_bound() {
    fn set(c: &mut KvRouterConfig, field: KvConfigField, v: f64) {
        *match field {
            KvConfigField::OverlapScoreCredit => &mut c.overlap_score_credit,
            KvConfigField::OverlapScoreCreditDecay => &mut c.overlap_score_credit_decay,
            KvConfigField::PrefillLoadScale => &mut c.prefill_load_scale,
            KvConfigField::DecodeActiveRequestWeight => &mut c.decode_active_request_weight,
            KvConfigField::HostCacheHitWeight => &mut c.host_cache_hit_weight,
            KvConfigField::DiskCacheHitWeight => &mut c.disk_cache_hit_weight,
            KvConfigField::SharedCacheMultiplier => &mut c.shared_cache_multiplier,
            KvConfigField::RouterTemperature => &mut c.router_temperature,
        } = v;
    }
    for field in KvConfigField::ALL {
        let mut cases = vec![
            (f64::NAN, Some(KvConfigProblem::NotFinite)),
            (1e39, Some(KvConfigProblem::NotFinite)),
            (-0.5, Some(KvConfigProblem::Negative)),
            (0.5, None),
        ];
        cases.push((1.5, field.at_most_one().then_some(KvConfigProblem::AboveOne)));
        for (value, problem) in cases {
            let mut c = KvRouterConfig::default();
            set(&mut c, field, value);
            match (c.validate(), problem) {
                (Ok(()), None) => {}
                (Err(WorkerSelectionPolicyProviderError::KvWeight { value: v, source }), Some(problem)) => {
                    assert_eq!(source, KvConfigError { field, problem }, "{} = {value}", field.name());
                    assert!(v == value || (v.is_nan() && value.is_nan()));
                }
                (got, _) => panic!("{} = {value}: {got:?}, expected {problem:?}", field.name()),
            }
        }
    }
}
