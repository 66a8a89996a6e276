//! The policy registry: build a worker-selection policy by type name.
//!
//! The built-ins (`kv`, `random`, `round-robin`, `least-loaded`,
//! `power-of-two`, `device-aware-weighted`, `prefix-hash`, `direct`, and
//! `composed`, which combines scorers and a picker by type name; see
//! `compose`) are
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
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::compose::{PluginTypes, WorkerPickerProvider, WorkerScorerProvider};
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

/// An instance's parameters: a mapping of field names to values, whatever
/// format they were written in (a config file's YAML or TOML, any other
/// serde format, or built in code). A provider reads them into its own type
/// with [`deserialize`](Self::deserialize).
///
/// ```
/// use selkie::{KvRouterConfig, WorkerSelectionPolicyParameters};
/// #[derive(serde::Serialize)]
/// struct Credit {
///     overlap_score_credit: f64,
/// }
/// let p = WorkerSelectionPolicyParameters::from_serialize(&Credit { overlap_score_credit: 2.0 })?;
/// let kv: KvRouterConfig = p.deserialize()?;
/// assert_eq!(kv.overlap_score_credit, 2.0);
/// assert!(WorkerSelectionPolicyParameters::default().is_empty());
/// // Not a mapping:
/// assert!(WorkerSelectionPolicyParameters::from_serialize(&[1, 2]).is_err());
/// # Ok::<(), selkie::WorkerSelectionPolicyProviderError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerSelectionPolicyParameters(serde_json::Map<String, serde_json::Value>);

/// Why a value is not a parameter mapping.
#[derive(Debug, thiserror::Error)]
#[error("policy parameters must be a mapping of field names to values, not {0}")]
pub(crate) struct NotAMapping(&'static str);

impl WorkerSelectionPolicyParameters {
    /// The parameters `value` serializes to (a struct or a map; a unit or
    /// `None` is no parameters). A NaN or infinite number becomes `null`,
    /// which a policy's number field then refuses.
    pub fn from_serialize<T: Serialize + ?Sized>(value: &T) -> Result<Self, WorkerSelectionPolicyProviderError> {
        let parameters = |source| WorkerSelectionPolicyProviderError::Parameters { source };
        let value = serde_json::to_value(value).map_err(|e| parameters(Box::new(e)))?;
        Self::from_value(value).map_err(|e| parameters(Box::new(e)))
    }

    /// The parameters, if `value` is a mapping or nothing.
    pub(crate) fn from_value(value: serde_json::Value) -> Result<Self, NotAMapping> {
        match value {
            serde_json::Value::Null => Ok(Self::default()),
            serde_json::Value::Object(map) => Ok(Self(map)),
            serde_json::Value::Bool(_) => Err(NotAMapping("a boolean")),
            serde_json::Value::Number(_) => Err(NotAMapping("a number")),
            serde_json::Value::String(_) => Err(NotAMapping("a string")),
            serde_json::Value::Array(_) => Err(NotAMapping("a sequence")),
        }
    }

    /// Whether no parameter is given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Deserializes the parameters into the policy's own type (no
    /// parameters deserialize as an empty mapping).
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, WorkerSelectionPolicyProviderError> {
        T::deserialize(&self.0).map_err(|e| WorkerSelectionPolicyProviderError::Parameters { source: Box::new(e) })
    }
}

/// Parameters read from any self-describing format: a mapping, or nothing
/// (`null`, `~`). Numbers must be finite: NaN and infinities are refused
/// where the text has them.
impl<'de> Deserialize<'de> for WorkerSelectionPolicyParameters {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let FiniteValue(value) = FiniteValue::deserialize(deserializer)?;
        Self::from_value(value).map_err(serde::de::Error::custom)
    }
}

/// Any value of the serde data model whose numbers are finite, read from any
/// self-describing format (a config file's `parameters:` before it is known
/// to be a mapping). NaN and infinities are refused with an error of the
/// format's deserializer, which says where they are.
pub(crate) struct FiniteValue(pub(crate) serde_json::Value);

impl Default for FiniteValue {
    fn default() -> Self {
        FiniteValue(serde_json::Value::Null)
    }
}

impl<'de> Deserialize<'de> for FiniteValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(FiniteVisitor).map(FiniteValue)
    }
}

struct FiniteVisitor;

impl<'de> serde::de::Visitor<'de> for FiniteVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a value with finite numbers")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        serde_json::Number::from_f64(v)
            .map(serde_json::Value::Number)
            .ok_or_else(|| E::custom(format_args!("policy parameters must be finite numbers, got {v}")))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut v = Vec::new();
        while let Some(FiniteValue(x)) = seq.next_element()? {
            v.push(x);
        }
        Ok(serde_json::Value::Array(v))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut m = serde_json::Map::new();
        while let Some((k, FiniteValue(v))) = map.next_entry::<String, FiniteValue>()? {
            m.insert(k, v);
        }
        Ok(serde_json::Value::Object(m))
    }
}

impl Serialize for WorkerSelectionPolicyParameters {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
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
pub const BUILTIN_POLICIES: [&str; 9] = [
    "kv",
    "composed",
    "random",
    "round-robin",
    "least-loaded",
    "power-of-two",
    "device-aware-weighted",
    "prefix-hash",
    "direct",
];

fn no_params(p: &WorkerSelectionPolicyParameters) -> Result<(), WorkerSelectionPolicyProviderError> {
    if p.is_empty() {
        Ok(())
    } else {
        Err(WorkerSelectionPolicyProviderError::UnexpectedParameters)
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
            let explicit = !p.is_empty();
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
    plugins: PluginTypes,
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

    /// Registers a custom policy type: `provider` reads an instance's
    /// parameters once (refusing bad ones with a
    /// [`WorkerSelectionPolicyProviderError`]) and returns the factory
    /// that builds the policy for each routing partition. A built-in's
    /// name (or alias), an empty name or a name already registered is
    /// refused.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use selkie::*;
    ///
    /// /// The candidate with the most device-cached blocks, if it has at least
    /// /// `min_blocks`; else the first.
    /// struct MostCached {
    ///     min_blocks: f64,
    /// }
    /// impl WorkerPicker for MostCached {
    ///     fn required_worker_inputs(&self) -> WorkerInputs {
    ///         WorkerInputs::CACHE
    ///     }
    ///     fn pick(&self, _: &WorkerSelectionContext<'_>, view: WorkerInputView<'_>) -> Result<usize, WorkerSelectionPolicyError> {
    ///         let cached = |i| view.candidate(i).and_then(|c| c.cache()).map_or(0.0, |c| c.device_overlap_blocks());
    ///         let best = (0..view.len()).max_by(|&a, &b| cached(a).total_cmp(&cached(b))).unwrap_or(0);
    ///         Ok(if cached(best) >= self.min_blocks { best } else { 0 })
    ///     }
    /// }
    ///
    /// /// The parameters an instance may give (all optional).
    /// #[derive(serde::Deserialize, Default)]
    /// #[serde(default, deny_unknown_fields)]
    /// struct Params {
    ///     min_blocks: f64,
    /// }
    ///
    /// let provider: WorkerSelectionPolicyProvider = Arc::new(|p: &WorkerSelectionPolicyParameters| {
    ///     let Params { min_blocks } = p.deserialize()?; // unknown fields are refused here
    ///     if !(min_blocks >= 0.0) {
    ///         return Err(WorkerSelectionPolicyProviderError::new("min_blocks must be at least 0"));
    ///     }
    ///     let factory: WorkerSelectionPolicyFactory = Arc::new(move |config, worker_type, _partition| {
    ///         WorkerSelectionPolicy::new(*config, worker_type, Vec::new(), Box::new(MostCached { min_blocks }))
    ///             .with_name("most-cached")
    ///     });
    ///     Ok(factory)
    /// });
    /// let mut registry = WorkerSelectionPolicyRegistry::new();
    /// registry.register("most-cached", provider.clone())?;
    /// assert!(matches!(registry.register("kv", provider), Err(RegistryError::BuiltinName { .. })));
    ///
    /// // A config file can name it now, with its parameters.
    /// let yaml = "aggregated: mc\ninstances:\n  - { name: mc, type: most-cached, parameters: { min_blocks: 4 } }\n";
    /// let factory = WorkerSelectionConfig::from_yaml_str(yaml)?.resolve(&registry, WorkerType::Aggregated)?;
    /// let policy = factory(&KvRouterConfig::default(), WorkerType::Aggregated, RoutingPartitionRef::model("llama"));
    /// assert_eq!(policy.name(), "most-cached");
    /// let bad = WorkerSelectionConfig::from_yaml_str("aggregated: mc\ninstances:\n  - { name: mc, type: most-cached, parameters: { min_block: 4 } }\n")?;
    /// assert!(matches!(bad.resolve(&registry, WorkerType::Aggregated), Err(ConfigError::Registry(RegistryError::Provider { .. }))));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
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

    /// Registers a custom scorer type for `composed` policies: `provider`
    /// reads an instance's parameters once and returns the factory that
    /// builds the scorer for each routing partition. A built-in scorer's
    /// name ([`BUILTIN_SCORERS`](crate::BUILTIN_SCORERS)), an empty name or
    /// a name already registered is refused.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use selkie::*;
    ///
    /// /// `weight` per active request.
    /// #[derive(Clone)]
    /// struct Busy(f64);
    /// impl WorkerScorer for Busy {
    ///     fn required_worker_inputs(&self) -> WorkerInputs {
    ///         WorkerInputs::LOAD
    ///     }
    ///     fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> Result<(), WorkerSelectionPolicyError> {
    ///         for (cost, c) in costs.iter_mut().zip(c.iter()) {
    ///             *cost = self.0 * c.load().map_or(0, |l| l.active_requests()) as f64;
    ///         }
    ///         Ok(())
    ///     }
    /// }
    /// #[derive(serde::Deserialize)]
    /// #[serde(deny_unknown_fields)]
    /// struct Params {
    ///     weight: f64,
    /// }
    /// let provider: WorkerScorerProvider = Arc::new(|p: &WorkerSelectionPolicyParameters| {
    ///     let Params { weight } = p.deserialize()?;
    ///     let factory: WorkerScorerFactory = Arc::new(move |_, _, _| Box::new(Busy(weight)));
    ///     Ok(factory)
    /// });
    /// let mut registry = WorkerSelectionPolicyRegistry::new();
    /// registry.register_scorer("busy", provider.clone())?;
    /// assert!(matches!(registry.register_scorer("busy", provider.clone()), Err(RegistryError::DuplicatePlugin { .. })));
    /// assert!(matches!(registry.register_scorer("decode", provider), Err(RegistryError::BuiltinPluginName { .. })));
    ///
    /// let yaml = "aggregated: mine\ninstances:\n  - name: mine\n    type: composed\n    parameters:\n      scorers: [{ type: busy, parameters: { weight: 2 } }, { type: decode }]\n      picker: { type: softmax, parameters: { temperature: 0.5 } }\n";
    /// let factory = WorkerSelectionConfig::from_yaml_str(yaml)?.resolve(&registry, WorkerType::Aggregated)?;
    /// let policy = factory(&KvRouterConfig::default(), WorkerType::Aggregated, RoutingPartitionRef::model("m"));
    /// assert_eq!(policy.name(), "busy+decode/softmax");
    /// assert_eq!(policy.required_worker_inputs(), WorkerInputs::LOAD);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn register_scorer(
        &mut self,
        name: impl Into<String>,
        provider: WorkerScorerProvider,
    ) -> Result<(), RegistryError> {
        self.plugins.register_scorer(name.into(), provider)
    }

    /// Registers a custom picker type for `composed` policies, as
    /// [`register_scorer`](Self::register_scorer) does a scorer (built-in
    /// names: [`BUILTIN_PICKERS`](crate::BUILTIN_PICKERS)).
    pub fn register_picker(
        &mut self,
        name: impl Into<String>,
        provider: WorkerPickerProvider,
    ) -> Result<(), RegistryError> {
        self.plugins.register_picker(name.into(), provider)
    }

    /// Every available scorer type name, sorted.
    pub fn scorer_names(&self) -> Vec<String> {
        self.plugins.scorer_names()
    }

    /// Every available picker type name, sorted.
    pub fn picker_names(&self) -> Vec<String> {
        self.plugins.picker_names()
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
        if name == "composed" {
            return Ok(self.plugins.composed_provider());
        }
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
