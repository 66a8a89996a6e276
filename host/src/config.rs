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
//! # Block size
//!
//! Some parameters are lengths in KV blocks: the `kv` policy's
//! `switch_margin` (its cost is in blocks) and `decode_active_request_weight`
//! (blocks per request), the `decode` scorer's
//! `decode_active_request_weight`, the `prefix-hash` policy's
//! `prefix_blocks` and the `device-aware-weighted` policy's
//! `required_cache_hits`. A block is as many tokens as the service's
//! [`ServiceConfig::block_size`](crate::ServiceConfig::block_size) says, so a
//! file may state the block size its lengths are in, at the top level
//! (`selkie tune` always does):
//!
//! ```yaml
//! block_size: 512                # tokens per block of the lengths below
//! aggregated: tuned
//! instances:
//!   - name: tuned
//!     type: kv
//!     parameters: { switch_margin: 230.27 }
//! ```
//!
//! Such a config is resolved at the service's block size,
//! [`WorkerSelectionConfig::resolve_at`], which **converts** every length
//! to the service's blocks, keeping its tokens:
//! `value * config block size / service block size` (230.27 blocks of 512
//! tokens are 7,368.64 blocks of 16, the same 117,898.24 tokens). A length
//! that is a real number is converted exactly when both block sizes are
//! powers of two (as a router's always is), else rounded to the nearest
//! `f64`; one that is a whole number of blocks (`prefix_blocks`,
//! `required_cache_hits`) must come out whole, else the config is refused
//! ([`ConfigError::BlockSizeNotWhole`]). Parameters a file leaves out take
//! their defaults, which are in the service's blocks. A policy, scorer or
//! picker type that is not built in is refused at another block size
//! ([`ConfigError::BlockSizeUnknownUnits`]): which of its parameters are
//! lengths is unknown. [`WorkerSelectionConfig::resolve`], which knows no
//! service, refuses a config that states its block size
//! ([`ConfigError::BlockSizeUnresolved`]), so its lengths are never read in
//! blocks of another size without a word.
//!
//! A config without `block_size` loads as it always did: its lengths are
//! read in the service's blocks, whatever they are.
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

/// The largest `block_size` a config may state, and the largest it is
/// resolved at (65,536 tokens, as the router's and the simulator's bound).
pub const MAX_CONFIG_BLOCK_SIZE: u32 = 1 << 16;

/// Refuses a block size of 0 or past [`MAX_CONFIG_BLOCK_SIZE`].
fn check_block_size(value: u32) -> Result<u32, ConfigError> {
    if (1..=MAX_CONFIG_BLOCK_SIZE).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::InvalidBlockSize {
            value,
            limit: MAX_CONFIG_BLOCK_SIZE,
        })
    }
}

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
    block_size: Option<u32>,
    aggregated: Option<String>,
    prefill: Option<String>,
    decode: Option<String>,
    instances: BTreeMap<String, WorkerSelectionInstance>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    block_size: Option<u32>,
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
            block_size: raw.block_size.map(check_block_size).transpose()?,
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

    /// The block size the file's lengths are in (its `block_size`), if it
    /// states one (see the module docs).
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// This config with its lengths in blocks of `block_size` tokens (the
    /// service's): each instance's parameters converted from the file's
    /// block size, keeping their tokens (see the module docs). A config
    /// that states no block size is returned as it is (its lengths are
    /// read in the service's blocks).
    ///
    /// ```
    /// use selkie::*;
    /// let yaml = "block_size: 512\ninstances:\n  - { name: t, type: kv, parameters: { switch_margin: 4.5 } }\n";
    /// let at_16 = WorkerSelectionConfig::from_yaml_str(yaml)?.at_block_size(16)?;
    /// assert_eq!(at_16.block_size(), Some(16));
    /// let margin = at_16.instance("t").unwrap().parameters().deserialize::<KvRouterConfig>()?.switch_margin;
    /// assert_eq!(margin, 144.0, "4.5 blocks of 512 tokens are 144 blocks of 16");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn at_block_size(&self, block_size: u32) -> Result<Self, ConfigError> {
        let to = check_block_size(block_size)?;
        let Some(from) = self.block_size else {
            return Ok(self.clone());
        };
        let mut config = self.clone();
        config.block_size = Some(to);
        if from != to {
            for (name, instance) in &mut config.instances {
                let rescale = Rescale {
                    instance: name,
                    from,
                    to,
                };
                instance.parameters = rescale.policy(&instance.policy_type, &instance.parameters)?;
            }
        }
        Ok(config)
    }

    /// The policy factory for `role`: the selected instance's type and
    /// parameters, or the `kv` policy when the file selects nothing (or
    /// `default`) for the role.
    ///
    /// A config that states its block size is refused
    /// ([`ConfigError::BlockSizeUnresolved`]): resolve it at the service's
    /// with [`resolve_at`](Self::resolve_at).
    pub fn resolve(
        &self,
        registry: &WorkerSelectionPolicyRegistry,
        role: WorkerType,
    ) -> Result<WorkerSelectionPolicyFactory, ConfigError> {
        if let Some(block_size) = self.block_size {
            return Err(ConfigError::BlockSizeUnresolved { block_size });
        }
        self.resolve_as_written(registry, role)
    }

    /// [`resolve`](Self::resolve) for a service of `block_size` tokens per
    /// block ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size)):
    /// the lengths of a config that states another block size are
    /// converted to the service's first ([`at_block_size`](Self::at_block_size));
    /// those of a config that states none are read as they are.
    ///
    /// ```
    /// use selkie::*;
    /// let yaml = "block_size: 32\naggregated: p\ninstances:\n  - { name: p, type: prefix-hash, parameters: { prefix_blocks: 3 } }\n";
    /// let config = WorkerSelectionConfig::from_yaml_str(yaml)?;
    /// let registry = WorkerSelectionPolicyRegistry::new();
    /// // 3 blocks of 32 tokens are 6 blocks of 16...
    /// assert!(config.resolve_at(&registry, WorkerType::Aggregated, 16).is_ok());
    /// // ...but not a whole number of blocks of 64.
    /// assert!(matches!(
    ///     config.resolve_at(&registry, WorkerType::Aggregated, 64),
    ///     Err(ConfigError::BlockSizeNotWhole { value: 3, from: 32, to: 64, .. })
    /// ));
    /// // Without the service's block size, it is refused.
    /// assert!(matches!(config.resolve(&registry, WorkerType::Aggregated), Err(ConfigError::BlockSizeUnresolved { block_size: 32 })));
    /// # Ok::<(), ConfigError>(())
    /// ```
    pub fn resolve_at(
        &self,
        registry: &WorkerSelectionPolicyRegistry,
        role: WorkerType,
        block_size: u32,
    ) -> Result<WorkerSelectionPolicyFactory, ConfigError> {
        self.at_block_size(block_size)?.resolve_as_written(registry, role)
    }

    /// The factory for `role`, the lengths read as written.
    fn resolve_as_written(
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

/// Converts the lengths in blocks of one instance's parameters from blocks
/// of `from` tokens to blocks of `to` (see the module docs).
struct Rescale<'a> {
    instance: &'a str,
    from: u32,
    to: u32,
}

type Map = serde_json::Map<String, serde_json::Value>;

impl Rescale<'_> {
    /// `parameters` of a policy of type `policy_type`, converted.
    fn policy(
        &self,
        policy_type: &str,
        parameters: &WorkerSelectionPolicyParameters,
    ) -> Result<WorkerSelectionPolicyParameters, ConfigError> {
        let mut value = serde_json::to_value(parameters).unwrap_or_default();
        if let Some(map) = value.as_object_mut() {
            match policy_type {
                "kv" | "default" => {
                    self.real(map, "switch_margin");
                    self.real(map, "decode_active_request_weight");
                }
                "prefix-hash" => self.whole(map, "prefix_blocks")?,
                "device-aware-weighted" => self.whole(map, "required_cache_hits")?,
                "composed" => self.plugins(map)?,
                "random" | "round-robin" | "least-loaded" | "power-of-two" | "power-of-two-choices" | "direct" => {}
                other => return Err(self.unknown(format!("policy type {other:?}"))),
            }
        }
        // A mapping stays a mapping.
        Ok(WorkerSelectionPolicyParameters::from_value(value).unwrap_or_default())
    }

    /// The `scorers` and `picker` of a `composed` policy (or the `scorers`
    /// of a `preferred-taints` scorer). No built-in scorer has a whole
    /// number of blocks.
    fn plugins(&self, map: &mut Map) -> Result<(), ConfigError> {
        if let Some(scorers) = map.get_mut("scorers").and_then(|s| s.as_array_mut()) {
            for spec in scorers {
                let Some((kind, parameters)) = plugin(spec) else {
                    continue;
                };
                match kind.as_str() {
                    "decode" => self.real(parameters, "decode_active_request_weight"),
                    "preferred-taints" => self.plugins(parameters)?,
                    "prefill" | "cache-credit" => {}
                    other => return Err(self.unknown(format!("scorer type {other:?}"))),
                }
            }
        }
        if let Some((kind, _)) = map.get_mut("picker").and_then(plugin) {
            if !matches!(kind.as_str(), "argmin" | "power-of-two" | "softmax") {
                return Err(self.unknown(format!("picker type {kind:?}")));
            }
        }
        Ok(())
    }

    /// A real number of blocks: `value * from / to` (left as it is if that
    /// is not a finite number; the policy then refuses the value).
    fn real(&self, map: &mut Map, field: &str) {
        if let Some(v) = map.get_mut(field) {
            let converted = v.as_f64().map(|x| x * f64::from(self.from) / f64::from(self.to));
            if let Some(n) = converted.and_then(serde_json::Number::from_f64) {
                *v = serde_json::Value::Number(n);
            }
        }
    }

    /// A whole number of blocks: `value * from / to`, which must be whole.
    fn whole(&self, map: &mut Map, field: &str) -> Result<(), ConfigError> {
        let Some(v) = map.get_mut(field) else { return Ok(()) };
        let Some(value) = v.as_u64() else { return Ok(()) };
        let tokens = u128::from(value) * u128::from(self.from);
        if tokens % u128::from(self.to) != 0 {
            return Err(ConfigError::BlockSizeNotWhole {
                instance: self.instance.to_owned(),
                field: field.to_owned(),
                value,
                from: self.from,
                to: self.to,
            });
        }
        // Past u64, the number is left as it was; the policy refuses it.
        if let Ok(blocks) = u64::try_from(tokens / u128::from(self.to)) {
            *v = blocks.into();
        }
        Ok(())
    }

    fn unknown(&self, plugin: String) -> ConfigError {
        ConfigError::BlockSizeUnknownUnits {
            instance: self.instance.to_owned(),
            plugin,
            from: self.from,
            to: self.to,
        }
    }
}

/// A plugin spec's type and parameters (made a mapping if absent), if it
/// has that shape (the registry refuses any other).
fn plugin(spec: &mut serde_json::Value) -> Option<(String, &mut Map)> {
    let spec = spec.as_object_mut()?;
    let kind = spec.get("type")?.as_str()?.to_owned();
    let parameters = spec
        .entry("parameters")
        .or_insert_with(|| serde_json::Value::Object(Map::new()));
    if parameters.is_null() {
        *parameters = serde_json::Value::Object(Map::new());
    }
    Some((kind, parameters.as_object_mut()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvRouterConfig, PrefixHashConfig};

    /// What `selkie tune` writes for a trace of 512-token blocks.
    const TUNED_AT_512: &str = "block_size: 512\naggregated: tuned\ninstances:\n  - name: tuned\n    type: kv\n    \
                                parameters: { switch_margin: 230.27, decode_active_request_weight: 2.0 }\n";

    fn kv_parameters(config: &WorkerSelectionConfig, name: &str) -> KvRouterConfig {
        config.instance(name).unwrap().parameters().deserialize().unwrap()
    }

    #[test]
    fn a_config_states_its_block_size_and_is_converted_to_the_services() {
        let config = WorkerSelectionConfig::from_yaml_str(TUNED_AT_512).unwrap();
        assert_eq!(config.block_size(), Some(512));
        let registry = WorkerSelectionPolicyRegistry::new();
        let role = WorkerType::Aggregated;
        // Without the service's block size it is refused, not read in
        // blocks of another size.
        let err = config.resolve(&registry, role).err().unwrap();
        assert!(
            matches!(err, ConfigError::BlockSizeUnresolved { block_size: 512 }),
            "{err}"
        );
        // At 16 tokens a block: the same tokens, 32 times the blocks.
        let at_16 = config.at_block_size(16).unwrap();
        assert_eq!(at_16.block_size(), Some(16));
        let kv = kv_parameters(&at_16, "tuned");
        assert_eq!(
            (kv.switch_margin, kv.decode_active_request_weight),
            (230.27 * 32.0, 64.0)
        );
        assert_eq!(kv.switch_margin * 16.0, 230.27 * 512.0, "tokens kept exactly");
        assert_eq!(kv.router_temperature, KvRouterConfig::default().router_temperature);
        assert!(config.resolve_at(&registry, role, 16).is_ok());
        // At its own block size, nothing changes.
        assert_eq!(
            kv_parameters(&config.at_block_size(512).unwrap(), "tuned").switch_margin,
            230.27
        );
        // TOML states it the same way.
        #[cfg(feature = "toml")]
        {
            let toml = "block_size = 512\n[[instances]]\nname = \"tuned\"\ntype = \"kv\"\nparameters = { switch_margin = 2.0 }\n";
            let from_toml = WorkerSelectionConfig::from_toml_str(toml).unwrap();
            assert_eq!(
                kv_parameters(&from_toml.at_block_size(64).unwrap(), "tuned").switch_margin,
                16.0
            );
        }
    }

    #[test]
    fn a_config_without_a_block_size_is_read_in_the_services_blocks() {
        let yaml = TUNED_AT_512.replace("block_size: 512\n", "");
        let config = WorkerSelectionConfig::from_yaml_str(&yaml).unwrap();
        assert_eq!(config.block_size(), None);
        let registry = WorkerSelectionPolicyRegistry::new();
        assert!(config.resolve(&registry, WorkerType::Aggregated).is_ok());
        let at_16 = config.at_block_size(16).unwrap();
        assert_eq!(
            (at_16.block_size(), kv_parameters(&at_16, "tuned").switch_margin),
            (None, 230.27)
        );
    }

    #[test]
    fn block_sizes_are_bounded() {
        for (text, value) in [("block_size: 0\n", 0), ("block_size: 65537\n", 65_537)] {
            let err = WorkerSelectionConfig::from_yaml_str(text).unwrap_err();
            assert!(
                matches!(err, ConfigError::InvalidBlockSize { value: v, limit: 65_536 } if v == value),
                "{err}"
            );
        }
        let config = WorkerSelectionConfig::from_yaml_str(TUNED_AT_512).unwrap();
        assert!(matches!(
            config.at_block_size(0),
            Err(ConfigError::InvalidBlockSize { value: 0, .. })
        ));
    }

    #[test]
    fn whole_blocks_stay_whole_or_are_refused() {
        let yaml =
            "block_size: 32\ninstances:\n  - { name: p, type: prefix-hash, parameters: { prefix_blocks: 4 } }\n  \
                    - { name: d, type: device-aware-weighted, parameters: { required_cache_hits: 3 } }\n";
        let config = WorkerSelectionConfig::from_yaml_str(yaml).unwrap();
        let at_16 = config.at_block_size(16).unwrap();
        let p: PrefixHashConfig = at_16.instance("p").unwrap().parameters().deserialize().unwrap();
        assert_eq!(p.prefix_blocks, 8);
        let err = config.at_block_size(64).unwrap_err();
        assert_eq!(
            err.to_string(),
            "instance \"d\": required_cache_hits = 3 blocks of 32 tokens is not a whole number of blocks of 64 tokens"
        );
    }

    #[test]
    fn composed_scorers_are_converted_and_unknown_types_refused() {
        let yaml = "block_size: 64\ninstances:\n  - name: c\n    type: composed\n    parameters:\n      scorers:\n        \
                    - { type: prefill }\n        - { type: decode, parameters: { decode_active_request_weight: 1.5 } }\n        \
                    - type: preferred-taints\n          parameters: { scorers: [{ type: decode, parameters: { decode_active_request_weight: 2 } }] }\n      \
                    picker: { type: softmax, parameters: { temperature: 0.5 } }\n";
        let config = WorkerSelectionConfig::from_yaml_str(yaml).unwrap();
        let at_16 = config.at_block_size(16).unwrap();
        let p = serde_json::to_value(at_16.instance("c").unwrap().parameters()).unwrap();
        assert_eq!(p["scorers"][1]["parameters"]["decode_active_request_weight"], 6.0);
        assert_eq!(
            p["scorers"][2]["parameters"]["scorers"][0]["parameters"]["decode_active_request_weight"],
            8.0
        );
        assert_eq!(p["picker"]["parameters"]["temperature"], 0.5);
        assert!(at_16
            .resolve_at(&WorkerSelectionPolicyRegistry::new(), WorkerType::Aggregated, 16)
            .is_ok());
        for (yaml, plugin) in [
            ("type: mine", "policy type \"mine\""),
            (
                "type: composed, parameters: { scorers: [{ type: mine }] }",
                "scorer type \"mine\"",
            ),
            (
                "type: composed, parameters: { picker: { type: mine } }",
                "picker type \"mine\"",
            ),
        ] {
            let text = format!("block_size: 64\ninstances:\n  - {{ name: x, {yaml} }}\n");
            let config = WorkerSelectionConfig::from_yaml_str(&text).unwrap();
            assert!(config.at_block_size(64).is_ok(), "{yaml}: at its own block size");
            let err = config.at_block_size(16).unwrap_err();
            assert!(
                matches!(&err, ConfigError::BlockSizeUnknownUnits { plugin: p, from: 64, to: 16, .. } if p == plugin),
                "{yaml}: {err}"
            );
        }
    }
}
