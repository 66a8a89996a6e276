//! The KV cost's configuration: Dynamo's weights and defaults, and the
//! validation Dynamo applies to them, with an error that names the field.
//!
//! This module must not compute costs.

/// The default KV cost's weights, with Dynamo's defaults.
///
/// ```
/// use selkie_kernel::kernels::kv_cost::{KvConfigField, KvCostConfig};
/// let mut config = KvCostConfig::default();
/// assert_eq!(config.host_cache_hit_weight, 0.75);
/// config.disk_cache_hit_weight = 1.5;
/// assert_eq!(config.validate().unwrap_err().field, KvConfigField::DiskCacheHitWeight);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCostConfig {
    /// Blocks of credit per device-cached block (default 1).
    pub overlap_score_credit: f32,
    /// `k`: how fast the device credit decays with prefill backlog above the
    /// least-loaded eligible row (default 0: no decay).
    pub overlap_score_credit_decay: f32,
    /// Weight of the uncached prefill blocks (default 1).
    pub prefill_load_scale: f32,
    /// Blocks charged per active request (default 0).
    pub decode_active_request_weight: f32,
    /// Credit per host-cached block (default 0.75, at most 1).
    pub host_cache_hit_weight: f32,
    /// Credit per disk-cached block (default 0.25, at most 1).
    pub disk_cache_hit_weight: f32,
    /// Credit per shared-cache hit beyond the device prefix (default 0, at
    /// most 1; Dynamo uses 0.5 for HiCache when it is not set).
    pub shared_cache_multiplier: f32,
    /// Softmax temperature of the pick (default 0: argmin). Not used by the
    /// cost itself; validated with it.
    pub router_temperature: f32,
}

impl Default for KvCostConfig {
    fn default() -> Self {
        KvCostConfig {
            overlap_score_credit: 1.0,
            overlap_score_credit_decay: 0.0,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
            router_temperature: 0.0,
        }
    }
}

/// A field of [`KvCostConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvConfigField {
    /// `overlap_score_credit`.
    OverlapScoreCredit,
    /// `overlap_score_credit_decay`.
    OverlapScoreCreditDecay,
    /// `prefill_load_scale`.
    PrefillLoadScale,
    /// `decode_active_request_weight`.
    DecodeActiveRequestWeight,
    /// `host_cache_hit_weight`.
    HostCacheHitWeight,
    /// `disk_cache_hit_weight`.
    DiskCacheHitWeight,
    /// `shared_cache_multiplier`.
    SharedCacheMultiplier,
    /// `router_temperature`.
    RouterTemperature,
}

impl KvConfigField {
    /// The field's name, as in Dynamo's configuration.
    pub const fn name(self) -> &'static str {
        match self {
            KvConfigField::OverlapScoreCredit => "overlap_score_credit",
            KvConfigField::OverlapScoreCreditDecay => "overlap_score_credit_decay",
            KvConfigField::PrefillLoadScale => "prefill_load_scale",
            KvConfigField::DecodeActiveRequestWeight => "decode_active_request_weight",
            KvConfigField::HostCacheHitWeight => "host_cache_hit_weight",
            KvConfigField::DiskCacheHitWeight => "disk_cache_hit_weight",
            KvConfigField::SharedCacheMultiplier => "shared_cache_multiplier",
            KvConfigField::RouterTemperature => "router_temperature",
        }
    }
}

/// What is wrong with a configuration value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvConfigProblem {
    /// NaN or infinite.
    NotFinite,
    /// Below 0.
    Negative,
    /// Above 1, for the weights Dynamo bounds to `[0, 1]`.
    AboveOne,
}

/// A [`KvCostConfig`] value Dynamo would reject, and which field holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvConfigError {
    /// The offending field.
    pub field: KvConfigField,
    /// What is wrong with it.
    pub problem: KvConfigProblem,
}

impl core::fmt::Display for KvConfigError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let why = match self.problem {
            KvConfigProblem::NotFinite => "must be finite",
            KvConfigProblem::Negative => "must be non-negative",
            KvConfigProblem::AboveOne => "must be at most 1",
        };
        write!(f, "{} {why}", self.field.name())
    }
}

impl KvCostConfig {
    /// Checks every field as Dynamo's `KvRouterConfig::validate` does: all
    /// finite and `>= 0`; the host, disk and shared weights at most 1. The
    /// first bad field, in declaration order, is reported.
    pub fn validate(&self) -> Result<(), KvConfigError> {
        use KvConfigField as F;
        let fields = [
            (F::OverlapScoreCredit, self.overlap_score_credit, false),
            (F::OverlapScoreCreditDecay, self.overlap_score_credit_decay, false),
            (F::PrefillLoadScale, self.prefill_load_scale, false),
            (F::DecodeActiveRequestWeight, self.decode_active_request_weight, false),
            (F::HostCacheHitWeight, self.host_cache_hit_weight, true),
            (F::DiskCacheHitWeight, self.disk_cache_hit_weight, true),
            (F::SharedCacheMultiplier, self.shared_cache_multiplier, true),
            (F::RouterTemperature, self.router_temperature, false),
        ];
        for (field, v, at_most_one) in fields {
            let problem = if !v.is_finite() {
                KvConfigProblem::NotFinite
            } else if v < 0.0 {
                KvConfigProblem::Negative
            } else if at_most_one && v > 1.0 {
                KvConfigProblem::AboveOne
            } else {
                continue;
            };
            return Err(KvConfigError { field, problem });
        }
        Ok(())
    }
}
