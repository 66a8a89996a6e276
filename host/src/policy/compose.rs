//! Scorers and pickers by type name, and the `composed` policy type that
//! combines them from a config file:
//!
//! ```yaml
//! instances:
//!   - name: mine
//!     type: composed
//!     parameters:
//!       scorers: [{ type: prefill }, { type: my-scorer, parameters: { weight: 2 } }]
//!       picker: { type: softmax, parameters: { temperature: 0.5 } }
//! ```
//!
//! The built-in scorers (`prefill`, `decode`, `cache-credit`,
//! `preferred-taints`, whose `scorers` parameter lists the scorers it
//! multiplies) and pickers (`argmin`, `softmax`, `power-of-two`) are in
//! every registry; custom ones are registered by name next to them. Without
//! scorers every cost is 0; without a picker the picker is `argmin`.
//!
//! The policy is named after its parts' type names, as a policy built in
//! code is after its parts' own names: the one above is
//! `prefill+my-scorer/softmax`, and `preferred-taints` shows the scorers it
//! multiplies, `preferred-taints(prefill+decode)/argmin`.
//!
//! Like the policy providers, a scorer or picker provider reads its
//! parameters once, when the config is resolved, and returns a factory
//! called once per routing partition. This module only builds: it must not
//! run selections.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;

use super::plugins::{
    ArgminPicker, CacheCreditScorer, DecodeScorer, PowerOfTwoPicker, PreferredTaintScorer, PrefillScorer,
    SeedParameters, SoftmaxPicker,
};
use super::{KvRouterConfig, WorkerSelectionPolicy, WorkerSelectionPolicyParameters};
use crate::error::{PluginKind, RegistryError, WorkerSelectionPolicyProviderError};
use crate::plugin::{WorkerPicker, WorkerScorer};
use crate::types::{RoutingPartitionRef, WorkerType};

/// Builds one scorer per routing partition.
pub type WorkerScorerFactory =
    Arc<dyn for<'a> Fn(&KvRouterConfig, WorkerType, RoutingPartitionRef<'a>) -> Box<dyn WorkerScorer> + Send + Sync>;

/// Parses one scorer's parameters and returns its factory.
pub type WorkerScorerProvider = Arc<
    dyn Fn(&WorkerSelectionPolicyParameters) -> Result<WorkerScorerFactory, WorkerSelectionPolicyProviderError>
        + Send
        + Sync,
>;

/// Builds one picker per routing partition.
pub type WorkerPickerFactory =
    Arc<dyn for<'a> Fn(&KvRouterConfig, WorkerType, RoutingPartitionRef<'a>) -> Box<dyn WorkerPicker> + Send + Sync>;

/// Parses one picker's parameters and returns its factory.
pub type WorkerPickerProvider = Arc<
    dyn Fn(&WorkerSelectionPolicyParameters) -> Result<WorkerPickerFactory, WorkerSelectionPolicyProviderError>
        + Send
        + Sync,
>;

/// Names of the built-in scorer types.
pub const BUILTIN_SCORERS: [&str; 4] = ["cache-credit", "decode", "preferred-taints", "prefill"];

/// Names of the built-in picker types.
pub const BUILTIN_PICKERS: [&str; 3] = ["argmin", "power-of-two", "softmax"];

/// One scorer or picker of a `composed` policy: its type and parameters.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PluginSpec {
    #[serde(rename = "type")]
    plugin_type: String,
    #[serde(default)]
    parameters: WorkerSelectionPolicyParameters,
}

/// The parameters of a `composed` policy.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct ComposedParameters {
    scorers: Vec<PluginSpec>,
    picker: Option<PluginSpec>,
}

/// The parameters of `preferred-taints`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct PreferredTaintParameters {
    scorers: Vec<PluginSpec>,
}

/// The custom scorer and picker types of a registry.
#[derive(Clone, Default)]
pub(crate) struct PluginTypes {
    pub(crate) scorers: BTreeMap<String, WorkerScorerProvider>,
    pub(crate) pickers: BTreeMap<String, WorkerPickerProvider>,
}

fn scorer_factory<S: WorkerScorer + Clone + 'static>(s: S) -> WorkerScorerFactory {
    Arc::new(move |_: &KvRouterConfig, _: WorkerType, _: RoutingPartitionRef<'_>| {
        Box::new(s.clone()) as Box<dyn WorkerScorer>
    })
}

fn provider_error(kind: PluginKind, plugin_type: &str, source: WorkerSelectionPolicyProviderError) -> RegistryError {
    RegistryError::PluginProvider {
        kind,
        plugin_type: plugin_type.to_owned(),
        source: Box::new(source),
    }
}

/// A scorer of a resolved `composed` policy.
enum ScorerNode {
    /// A scorer type's factory, and the type's name.
    Factory(WorkerScorerFactory, String),
    PreferredTaints(Vec<ScorerNode>),
}

impl ScorerNode {
    fn build(&self, c: &KvRouterConfig, t: WorkerType, p: RoutingPartitionRef<'_>) -> Box<dyn WorkerScorer> {
        match self {
            ScorerNode::Factory(f, _) => f(c, t, p),
            ScorerNode::PreferredTaints(inner) => Box::new(PreferredTaintScorer::new(
                inner.iter().map(|n| n.build(c, t, p)).collect(),
            )),
        }
    }

    /// Its part of the policy's derived name: the type's name, with
    /// `preferred-taints`' inner scorers in brackets.
    fn label(&self) -> String {
        match self {
            ScorerNode::Factory(_, name) => name.clone(),
            ScorerNode::PreferredTaints(inner) => {
                let inner: Vec<String> = inner.iter().map(ScorerNode::label).collect();
                format!("preferred-taints({})", inner.join("+"))
            }
        }
    }
}

impl PluginTypes {
    fn check_name(&self, kind: PluginKind, name: &str) -> Result<(), RegistryError> {
        let (builtin, taken): (&[&str], bool) = match kind {
            PluginKind::Picker => (&BUILTIN_PICKERS, self.pickers.contains_key(name)),
            _ => (&BUILTIN_SCORERS, self.scorers.contains_key(name)),
        };
        if name.is_empty() {
            Err(RegistryError::EmptyPluginName { kind })
        } else if builtin.contains(&name) {
            Err(RegistryError::BuiltinPluginName {
                kind,
                name: name.to_owned(),
            })
        } else if taken {
            Err(RegistryError::DuplicatePlugin {
                kind,
                name: name.to_owned(),
            })
        } else {
            Ok(())
        }
    }

    pub(crate) fn register_scorer(&mut self, name: String, p: WorkerScorerProvider) -> Result<(), RegistryError> {
        self.check_name(PluginKind::Scorer, &name)?;
        self.scorers.insert(name, p);
        Ok(())
    }

    pub(crate) fn register_picker(&mut self, name: String, p: WorkerPickerProvider) -> Result<(), RegistryError> {
        self.check_name(PluginKind::Picker, &name)?;
        self.pickers.insert(name, p);
        Ok(())
    }

    pub(crate) fn scorer_names(&self) -> Vec<String> {
        sorted(&BUILTIN_SCORERS, self.scorers.keys())
    }

    pub(crate) fn picker_names(&self) -> Vec<String> {
        sorted(&BUILTIN_PICKERS, self.pickers.keys())
    }

    fn scorer(&self, spec: &PluginSpec) -> Result<ScorerNode, RegistryError> {
        let name = spec.plugin_type.as_str();
        let fail = |e| provider_error(PluginKind::Scorer, name, e);
        let p = &spec.parameters;
        let factory = match name {
            "preferred-taints" => {
                let inner: PreferredTaintParameters = p.deserialize().map_err(fail)?;
                let nodes = inner.scorers.iter().map(|s| self.scorer(s)).collect::<Result<_, _>>()?;
                return Ok(ScorerNode::PreferredTaints(nodes));
            }
            "prefill" => scorer_factory(PrefillScorer::new(p.deserialize().map_err(fail)?).map_err(fail)?),
            "decode" => scorer_factory(DecodeScorer::new(p.deserialize().map_err(fail)?).map_err(fail)?),
            "cache-credit" => scorer_factory(CacheCreditScorer::new(p.deserialize().map_err(fail)?).map_err(fail)?),
            _ => {
                let provider = self.scorers.get(name).ok_or_else(|| RegistryError::UnknownPluginType {
                    kind: PluginKind::Scorer,
                    name: name.to_owned(),
                    available: self.scorer_names().join(", "),
                })?;
                provider(p).map_err(fail)?
            }
        };
        Ok(ScorerNode::Factory(factory, name.to_owned()))
    }

    fn picker(&self, spec: &PluginSpec) -> Result<WorkerPickerFactory, RegistryError> {
        let name = spec.plugin_type.as_str();
        let fail = |e| provider_error(PluginKind::Picker, name, e);
        let p = &spec.parameters;
        // Each partition gets its own picker (and pick counter); a seeded
        // picker's partitions draw alike.
        Ok(match name {
            "argmin" | "power-of-two" => {
                let seed: SeedParameters = p.deserialize().map_err(fail)?;
                let argmin = name == "argmin";
                Arc::new(move |_: &KvRouterConfig, _: WorkerType, _: RoutingPartitionRef<'_>| {
                    if argmin {
                        Box::new(ArgminPicker::new(seed)) as Box<dyn WorkerPicker>
                    } else {
                        Box::new(PowerOfTwoPicker::new(seed))
                    }
                })
            }
            "softmax" => {
                let params = p.deserialize().map_err(fail)?;
                SoftmaxPicker::new(params).map_err(fail)?;
                Arc::new(move |_: &KvRouterConfig, _: WorkerType, _: RoutingPartitionRef<'_>| {
                    Box::new(SoftmaxPicker::checked(params)) as Box<dyn WorkerPicker>
                })
            }
            _ => {
                let provider = self.pickers.get(name).ok_or_else(|| RegistryError::UnknownPluginType {
                    kind: PluginKind::Picker,
                    name: name.to_owned(),
                    available: self.picker_names().join(", "),
                })?;
                provider(p).map_err(fail)?
            }
        })
    }

    /// The `composed` policy type's provider over these scorers and pickers.
    pub(crate) fn composed_provider(&self) -> super::WorkerSelectionPolicyProvider {
        let types = self.clone();
        Arc::new(move |p: &WorkerSelectionPolicyParameters| {
            let params: ComposedParameters = p.deserialize()?;
            let plugin = |e| WorkerSelectionPolicyProviderError::Plugin(Box::new(e));
            let scorers: Vec<ScorerNode> = params
                .scorers
                .iter()
                .map(|s| types.scorer(s))
                .collect::<Result<_, _>>()
                .map_err(plugin)?;
            let picker = match &params.picker {
                Some(spec) => types.picker(spec).map_err(plugin)?,
                None => Arc::new(|_: &KvRouterConfig, _: WorkerType, _: RoutingPartitionRef<'_>| {
                    Box::new(ArgminPicker::new(SeedParameters::default())) as Box<dyn WorkerPicker>
                }),
            };
            let labels: Vec<String> = scorers.iter().map(ScorerNode::label).collect();
            let picker_type = params.picker.as_ref().map_or("argmin", |p| p.plugin_type.as_str());
            let name = super::names::derived(labels.iter().map(String::as_str), picker_type);
            Ok(Arc::new(
                move |c: &KvRouterConfig, t: WorkerType, part: RoutingPartitionRef<'_>| {
                    let scorers = scorers.iter().map(|s| s.build(c, t, part)).collect();
                    WorkerSelectionPolicy::new(*c, t, scorers, picker(c, t, part)).with_name(name)
                },
            ) as super::WorkerSelectionPolicyFactory)
        })
    }
}

fn sorted<'a>(builtin: &[&str], custom: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = builtin.iter().map(|s| s.to_string()).collect();
    v.extend(custom.cloned());
    v.sort();
    v
}
