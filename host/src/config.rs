//! The worker-selection config file: which policy, with which parameters,
//! for each role (aggregated, prefill, decode). YAML (read with
//! `serde-saphyr`; the crate's `yaml` feature, on by default) or TOML (the
//! `toml` feature). A build without a format's feature refuses its files
//! with [`ConfigError::FormatNotBuilt`], naming the feature.
//!
//! ```yaml
//! aggregated: cache-heavy        # an instance name, or "default" (the kv policy)
//! decode: balanced
//! instances:
//!   - name: cache-heavy
//!     type: kv
//!     parameters: { overlap_score_credit: 2.0, router_temperature: 0.3 }
//!   - name: balanced
//!     type: least-loaded
//! ```
//!
//! The same in TOML:
//!
//! ```toml
//! aggregated = "cache-heavy"
//! decode = "balanced"
//! [[instances]]
//! name = "cache-heavy"
//! type = "kv"
//! parameters = { overlap_score_credit = 2.0, router_temperature = 0.3 }
//! [[instances]]
//! name = "balanced"
//! type = "least-loaded"
//! ```
//!
//! Before parsing, the text is bounded: at most [`MAX_CONFIG_BYTES`] long
//! and [`MAX_CONFIG_DEPTH`] levels deep, with at most
//! [`MAX_CONFIG_COLLECTIONS`] brackets and braces (counted in one pass over
//! the raw text without interpreting quotes or comments), so a hostile file
//! fails at once with [`ConfigError::TooLarge`], [`ConfigError::TooDeep`] or
//! [`ConfigError::TooManyCollections`]
//! instead of keeping the parser busy. Parsing checks the shape (unknown
//! fields, duplicate or reserved instance names, roles naming undefined
//! instances); [`WorkerSelectionConfig::resolve`]
//! builds the factory through a [`WorkerSelectionPolicyRegistry`], which checks
//! the type names and parameters. This module does no selection.

// Without a format to read, the parser's parts are unused.
#![cfg_attr(not(any(feature = "yaml", feature = "toml")), allow(dead_code))]

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::policy::{
    FiniteValue, WorkerSelectionPolicyFactory, WorkerSelectionPolicyParameters, WorkerSelectionPolicyRegistry,
};
use crate::types::WorkerType;

/// The longest config text accepted (1 MiB).
pub const MAX_CONFIG_BYTES: usize = 1 << 20;

/// The deepest nesting a config may have (a real one needs fewer than ten).
pub const MAX_CONFIG_DEPTH: usize = 64;

/// The most flow collections (`[` and `{`, wherever they stand) a config may
/// have (a real one has a few per policy instance).
pub const MAX_CONFIG_COLLECTIONS: usize = 4096;

/// Refuses text over [`MAX_CONFIG_BYTES`], nested deeper than
/// [`MAX_CONFIG_DEPTH`] or with more than [`MAX_CONFIG_COLLECTIONS`]
/// brackets and braces, in time linear in its length, before any parser
/// sees it.
///
/// Nothing here interprets quotes, comments, tags or anchors (a scanner
/// that did could be talked into skipping nesting that the parser then
/// sees):
///
/// * every `[` and `{` in the text counts towards
///   [`MAX_CONFIG_COLLECTIONS`], in strings and comments too. This bounds the
///   parser's work whatever the text hides: a closing `]` inside a string
///   can make the depth below look shallower than the real nesting, but
///   never let more than this many levels through;
/// * depth: every `[` and `{` opens a level and every `]` and `}` closes
///   one; for YAML (`indentation`), plus the block depth of each line that
///   is not blank and does not start with `#` (the stack of indentation
///   columns of the enclosing lines, one more per leading `- `).
fn check_bounds(text: &str, indentation: bool) -> Result<(), ConfigError> {
    if text.len() > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge {
            len: text.len(),
            limit: MAX_CONFIG_BYTES,
        });
    }
    let too_deep = |depth: usize| {
        if depth > MAX_CONFIG_DEPTH {
            Err(ConfigError::TooDeep {
                depth,
                limit: MAX_CONFIG_DEPTH,
            })
        } else {
            Ok(())
        }
    };
    let mut collections = 0usize;
    let mut columns: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    for line in text.lines() {
        let bytes = line.as_bytes();
        if indentation {
            let mut col = bytes.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
            if col < bytes.len() && bytes[col] != b'#' {
                while columns.last().is_some_and(|&top| top >= col) {
                    columns.pop();
                }
                columns.push(col);
                too_deep(flow + columns.len())?;
                while bytes[col..].starts_with(b"- ") || &bytes[col..] == b"-" {
                    col = (col + 2).min(bytes.len());
                    columns.push(col);
                    too_deep(flow + columns.len())?;
                }
            }
        }
        for &b in bytes {
            match b {
                b'[' | b'{' => {
                    flow += 1;
                    collections += 1;
                    if collections > MAX_CONFIG_COLLECTIONS {
                        return Err(ConfigError::TooManyCollections {
                            count: collections,
                            limit: MAX_CONFIG_COLLECTIONS,
                        });
                    }
                    too_deep(flow + columns.len())?;
                }
                b']' | b'}' => flow = flow.saturating_sub(1),
                _ => {}
            }
        }
    }
    Ok(())
}

/// A parser's error, kept as the source of [`ConfigError::Parse`].
fn parse_error(format: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> ConfigError {
    ConfigError::Parse {
        format,
        source: Box::new(e),
    }
}

/// One named policy instance: a type and its parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSelectionInstance {
    policy_type: String,
    parameters: WorkerSelectionPolicyParameters,
}

impl WorkerSelectionInstance {
    /// The policy type name.
    pub fn policy_type(&self) -> &str {
        &self.policy_type
    }
    /// The parameters.
    pub fn parameters(&self) -> &WorkerSelectionPolicyParameters {
        &self.parameters
    }
}

/// A parsed worker-selection config (see the module docs).
///
/// ```
/// use selkie::*;
/// let yaml = "decode: balanced\ninstances:\n  - { name: balanced, type: least-loaded }\n";
/// let config = WorkerSelectionConfig::from_yaml_str(yaml)?;
/// let registry = WorkerSelectionPolicyRegistry::new();
/// let factory = config.resolve(&registry, WorkerType::Decode)?;
/// let policy = factory(&KvRouterConfig::default(), WorkerType::Decode, RoutingPartitionRef::model("llama"));
/// assert_eq!(policy.name(), "least-loaded");
/// // Roles the file does not mention get the kv policy.
/// let prefill = config.resolve(&registry, WorkerType::Prefill)?;
/// assert_eq!(prefill(&KvRouterConfig::default(), WorkerType::Prefill, RoutingPartitionRef::model("llama")).name(), "kv");
/// # Ok::<(), selkie::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WorkerSelectionConfig {
    aggregated: Option<String>,
    prefill: Option<String>,
    decode: Option<String>,
    instances: BTreeMap<String, WorkerSelectionInstance>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    aggregated: Option<String>,
    prefill: Option<String>,
    decode: Option<String>,
    #[serde(default)]
    instances: Vec<RawInstance>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInstance {
    name: String,
    #[serde(rename = "type")]
    policy_type: String,
    /// Any value here; a mapping (or nothing) is checked for below, to
    /// name the instance in the error.
    #[serde(default)]
    parameters: FiniteValue,
}

impl WorkerSelectionConfig {
    /// Parses YAML (bounded first: see the module docs). An empty text is
    /// an empty config. Feature `yaml` (on by default).
    #[cfg(feature = "yaml")]
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        check_bounds(text, true)?;
        let raw: Option<RawConfig> = serde_saphyr::from_str(text).map_err(|e| parse_error("YAML", e))?;
        Self::resolve_raw(raw.unwrap_or_default())
    }

    /// Parses TOML (bounded first: see the module docs). Feature `toml`.
    #[cfg(feature = "toml")]
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        check_bounds(text, false)?;
        let raw: RawConfig = toml::from_str(text).map_err(|e| parse_error("TOML", e))?;
        Self::resolve_raw(raw)
    }

    /// Reads a file: `.toml` is TOML, anything else YAML. A file over
    /// [`MAX_CONFIG_BYTES`] is refused before it is read; a file whose
    /// format this build does not read is refused with
    /// [`ConfigError::FormatNotBuilt`].
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let io = |source| ConfigError::Io {
            path: path.to_owned(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_CONFIG_BYTES as u64 {
            return Err(ConfigError::TooLarge {
                len: usize::try_from(len).unwrap_or(usize::MAX),
                limit: MAX_CONFIG_BYTES,
            });
        }
        let toml = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse_as(&text, toml).unwrap_or_else(|| {
            let (format, feature) = if toml { ("TOML", "toml") } else { ("YAML", "yaml") };
            Err(ConfigError::FormatNotBuilt {
                path: path.to_owned(),
                format,
                feature,
            })
        })
    }

    /// `text` parsed as TOML or YAML; `None` when this build does not read
    /// that format.
    fn parse_as(text: &str, toml: bool) -> Option<Result<Self, ConfigError>> {
        #[cfg(feature = "toml")]
        if toml {
            return Some(Self::from_toml_str(text));
        }
        #[cfg(feature = "yaml")]
        if !toml {
            return Some(Self::from_yaml_str(text));
        }
        let _ = (text, toml);
        None
    }

    fn resolve_raw(raw: RawConfig) -> Result<Self, ConfigError> {
        let mut instances = BTreeMap::new();
        for (index, i) in raw.instances.into_iter().enumerate() {
            if i.name.is_empty() || i.policy_type.is_empty() {
                return Err(ConfigError::EmptyInstanceField { index });
            }
            if i.name == "default" {
                return Err(ConfigError::ReservedInstanceName);
            }
            let Ok(parameters) = WorkerSelectionPolicyParameters::from_value(i.parameters.0) else {
                return Err(ConfigError::ParametersNotAMapping { instance: i.name });
            };
            let inst = WorkerSelectionInstance {
                policy_type: i.policy_type,
                parameters,
            };
            if instances.insert(i.name.clone(), inst).is_some() {
                return Err(ConfigError::DuplicateInstance { instance: i.name });
            }
        }
        let config = WorkerSelectionConfig {
            aggregated: raw.aggregated,
            prefill: raw.prefill,
            decode: raw.decode,
            instances,
        };
        for role in [WorkerType::Aggregated, WorkerType::Prefill, WorkerType::Decode] {
            if let Some(name) = config.selected(role) {
                if name != "default" && !config.instances.contains_key(name) {
                    return Err(ConfigError::UnknownInstance {
                        role: role.as_str(),
                        name: name.to_owned(),
                        available: config.instance_names().join(", "),
                    });
                }
            }
        }
        Ok(config)
    }

    /// The instance name selected for `role`, if the file selects one.
    pub fn selected(&self, role: WorkerType) -> Option<&str> {
        match role {
            WorkerType::Aggregated => self.aggregated.as_deref(),
            WorkerType::Prefill => self.prefill.as_deref(),
            WorkerType::Decode => self.decode.as_deref(),
        }
    }

    /// One instance.
    pub fn instance(&self, name: &str) -> Option<&WorkerSelectionInstance> {
        self.instances.get(name)
    }

    /// Instance names, sorted.
    pub fn instance_names(&self) -> Vec<String> {
        self.instances.keys().cloned().collect()
    }

    /// The policy factory for `role`: the selected instance's type and
    /// parameters, or the `kv` policy when the file selects nothing (or
    /// `default`) for the role.
    pub fn resolve(
        &self,
        registry: &WorkerSelectionPolicyRegistry,
        role: WorkerType,
    ) -> Result<WorkerSelectionPolicyFactory, ConfigError> {
        match self
            .selected(role)
            .filter(|n| *n != "default")
            .and_then(|n| self.instances.get(n))
        {
            Some(i) => Ok(registry.factory(&i.policy_type, &i.parameters)?),
            None => Ok(registry.factory("kv", &WorkerSelectionPolicyParameters::default())?),
        }
    }
}
