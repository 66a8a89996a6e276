//! The policy registry: build a worker-selection policy by type name.
//!
//! The built-ins (`kv`, `random`, `round-robin`, `least-loaded`,
//! `power-of-two`, `device-aware-weighted`, `prefix-hash`, `direct`) are
//! present in every
//! registry, including one built with custom providers; a custom provider
//! may not take a built-in's name (nor `default`, which means `kv`); an
//! unknown name is an error listing every available name.
//!
//! The shapes are Dynamo's: a *provider* parses an instance's parameters
//! once and returns a *factory*; the factory is called once per routing
//! partition (model, routing group) to build the policy.
//!
//! It only builds policies: it must not hold workers or run selections, and
//! it names nothing above the policies (no service, no configuration file
//! format; `config` reads files and calls it). A provider's error type lives
//! in `crate::error` with the other errors.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use super::{DeviceAwareConfig, KvRouterConfig, PolicyKind, PrefixHashConfig, WorkerSelectionPolicy};
use crate::error::{RegistryError, WorkerSelectionPolicyProviderError};
use crate::types::{RoutingPartitionRef, WorkerType};

/// Builds one policy per routing partition.
pub type WorkerSelectionPolicyFactory =
    Arc<dyn for<'a> Fn(&KvRouterConfig, WorkerType, RoutingPartitionRef<'a>) -> WorkerSelectionPolicy + Send + Sync>;

/// Parses one instance's parameters and returns its factory.
pub type WorkerSelectionPolicyProvider = Arc<
    dyn Fn(&WorkerSelectionPolicyParameters) -> Result<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
        + Send
        + Sync,
>;

/// An instance's parameters, as written in the config file (a YAML value;
/// TOML files are converted).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerSelectionPolicyParameters(serde_yaml::Value);

impl WorkerSelectionPolicyParameters {
    /// Wraps a value.
    pub fn new(value: serde_yaml::Value) -> Self {
        WorkerSelectionPolicyParameters(value)
    }

    /// Deserialises the parameters into the policy's own type (a missing or
    /// null value deserialises as an empty mapping).
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, WorkerSelectionPolicyProviderError> {
        let v = match &self.0 {
            serde_yaml::Value::Null => serde_yaml::Value::Mapping(Default::default()),
            v => v.clone(),
        };
        serde_yaml::from_value(v).map_err(|e| WorkerSelectionPolicyProviderError::Parameters { source: Box::new(e) })
    }

    /// The raw value.
    pub fn value(&self) -> &serde_yaml::Value {
        &self.0
    }
}

/// Other names of built-in types: `default` (the `kv` policy) and Dynamo's
/// `--router-mode` label `power-of-two-choices`.
pub const BUILTIN_ALIASES: [(&str, &str); 2] = [("default", "kv"), ("power-of-two-choices", "power-of-two")];

fn canonical(name: &str) -> &str {
    BUILTIN_ALIASES
        .iter()
        .find(|(a, _)| *a == name)
        .map_or(name, |(_, c)| c)
}

/// Names of the built-in policy types.
pub const BUILTIN_POLICIES: [&str; 8] = [
    "kv",
    "random",
    "round-robin",
    "least-loaded",
    "power-of-two",
    "device-aware-weighted",
    "prefix-hash",
    "direct",
];

fn no_params(p: &WorkerSelectionPolicyParameters) -> Result<(), WorkerSelectionPolicyProviderError> {
    match p.value() {
        serde_yaml::Value::Null => Ok(()),
        serde_yaml::Value::Mapping(m) if m.is_empty() => Ok(()),
        _ => Err(WorkerSelectionPolicyProviderError::UnexpectedParameters),
    }
}

fn builtin(name: &str) -> Option<WorkerSelectionPolicyProvider> {
    fn simple(make: fn() -> WorkerSelectionPolicy) -> WorkerSelectionPolicyProvider {
        Arc::new(move |p| {
            no_params(p)?;
            Ok(
                Arc::new(move |_: &KvRouterConfig, t: WorkerType, _: RoutingPartitionRef<'_>| {
                    make().with_worker_type(t)
                }) as WorkerSelectionPolicyFactory,
            )
        })
    }
    Some(match name {
        "kv" => Arc::new(|p: &WorkerSelectionPolicyParameters| {
            // Without parameters the instance uses the router's KV
            // configuration; with them, the parameters (missing fields take
            // the defaults).
            let explicit = !matches!(p.value(), serde_yaml::Value::Null)
                && !matches!(p.value(), serde_yaml::Value::Mapping(m) if m.is_empty());
            let parsed: KvRouterConfig = p.deserialize()?;
            parsed.validate()?;
            Ok(Arc::new(
                move |base: &KvRouterConfig, t: WorkerType, _: RoutingPartitionRef<'_>| {
                    WorkerSelectionPolicy::kv(if explicit { parsed } else { *base }, t)
                },
            ) as WorkerSelectionPolicyFactory)
        }),
        "random" => simple(WorkerSelectionPolicy::random),
        "round-robin" => simple(WorkerSelectionPolicy::round_robin),
        "least-loaded" => simple(WorkerSelectionPolicy::least_loaded),
        "power-of-two" => simple(WorkerSelectionPolicy::power_of_two),
        "direct" => simple(WorkerSelectionPolicy::direct),
        "device-aware-weighted" => Arc::new(|p: &WorkerSelectionPolicyParameters| {
            let c: DeviceAwareConfig = p.deserialize()?;
            Ok(
                Arc::new(move |_: &KvRouterConfig, t: WorkerType, _: RoutingPartitionRef<'_>| {
                    WorkerSelectionPolicy::device_aware_weighted(c).with_worker_type(t)
                }) as WorkerSelectionPolicyFactory,
            )
        }),
        "prefix-hash" => Arc::new(|p: &WorkerSelectionPolicyParameters| {
            let c: PrefixHashConfig = p.deserialize()?;
            c.validate()?;
            Ok(
                Arc::new(move |_: &KvRouterConfig, t: WorkerType, _: RoutingPartitionRef<'_>| {
                    WorkerSelectionPolicy::builtin(PolicyKind::PrefixHash(c), "prefix-hash", t)
                }) as WorkerSelectionPolicyFactory,
            )
        }),
        _ => return None,
    })
}

/// Builds policies by type name. See the module docs for the rules.
///
/// ```
/// use selkie::{WorkerSelectionPolicyParameters, WorkerSelectionPolicyRegistry};
/// let registry = WorkerSelectionPolicyRegistry::new();
/// assert!(registry.names().contains(&"kv".to_string()));
/// let err = registry.provider("fastest").err().unwrap().to_string();
/// assert!(err.contains("least-loaded"), "{err}");
/// ```
#[derive(Clone, Default)]
pub struct WorkerSelectionPolicyRegistry {
    custom: BTreeMap<String, WorkerSelectionPolicyProvider>,
}

impl WorkerSelectionPolicyRegistry {
    /// A registry with the built-ins only.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry with the built-ins and `providers`.
    pub fn with_providers(
        providers: impl IntoIterator<Item = (String, WorkerSelectionPolicyProvider)>,
    ) -> Result<Self, RegistryError> {
        let mut r = Self::new();
        for (name, p) in providers {
            r.register(name, p)?;
        }
        Ok(r)
    }

    /// Registers a custom policy type.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        provider: WorkerSelectionPolicyProvider,
    ) -> Result<(), RegistryError> {
        let name = name.into();
        if name.is_empty() {
            return Err(RegistryError::EmptyName);
        }
        if BUILTIN_POLICIES.contains(&canonical(&name)) {
            return Err(RegistryError::BuiltinName { name });
        }
        if self.custom.contains_key(&name) {
            return Err(RegistryError::Duplicate { name });
        }
        self.custom.insert(name, provider);
        Ok(())
    }

    /// Every available type name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = BUILTIN_POLICIES.iter().map(|s| s.to_string()).collect();
        v.extend(self.custom.keys().cloned());
        v.sort();
        v
    }

    /// The provider of `name` (see [`BUILTIN_ALIASES`] for other names of
    /// the built-ins).
    pub fn provider(&self, name: &str) -> Result<WorkerSelectionPolicyProvider, RegistryError> {
        let name = canonical(name);
        if let Some(p) = builtin(name) {
            return Ok(p);
        }
        self.custom
            .get(name)
            .cloned()
            .ok_or_else(|| RegistryError::UnknownType {
                name: name.to_owned(),
                available: self.names().join(", "),
            })
    }

    /// The factory of type `name` with `parameters`.
    pub fn factory(
        &self,
        name: &str,
        parameters: &WorkerSelectionPolicyParameters,
    ) -> Result<WorkerSelectionPolicyFactory, RegistryError> {
        let provider = self.provider(name)?;
        provider(parameters).map_err(|source| RegistryError::Provider {
            policy_type: name.to_owned(),
            source,
        })
    }

    /// Builds a policy of type `name` for one partition.
    pub fn build(
        &self,
        name: &str,
        parameters: &WorkerSelectionPolicyParameters,
        config: &KvRouterConfig,
        worker_type: WorkerType,
        partition: RoutingPartitionRef<'_>,
    ) -> Result<WorkerSelectionPolicy, RegistryError> {
        Ok(self.factory(name, parameters)?(config, worker_type, partition))
    }
}
