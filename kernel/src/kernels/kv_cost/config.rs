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

impl KvCostConfig {
    /// Dynamo's defaults. This is their one definition: the host's
    /// `KvRouterConfig` takes its defaults from here.
    pub const DEFAULT: KvCostConfig = KvCostConfig {
        overlap_score_credit: 1.0,
        overlap_score_credit_decay: 0.0,
        prefill_load_scale: 1.0,
        decode_active_request_weight: 0.0,
        host_cache_hit_weight: 0.75,
        disk_cache_hit_weight: 0.25,
        shared_cache_multiplier: 0.0,
        router_temperature: 0.0,
    };

    /// The value of `field`.
    pub const fn get(&self, field: KvConfigField) -> f32 {
        match field {
            KvConfigField::OverlapScoreCredit => self.overlap_score_credit,
            KvConfigField::OverlapScoreCreditDecay => self.overlap_score_credit_decay,
            KvConfigField::PrefillLoadScale => self.prefill_load_scale,
            KvConfigField::DecodeActiveRequestWeight => self.decode_active_request_weight,
            KvConfigField::HostCacheHitWeight => self.host_cache_hit_weight,
            KvConfigField::DiskCacheHitWeight => self.disk_cache_hit_weight,
            KvConfigField::SharedCacheMultiplier => self.shared_cache_multiplier,
            KvConfigField::RouterTemperature => self.router_temperature,
        }
    }
}

impl Default for KvCostConfig {
    fn default() -> Self {
        Self::DEFAULT
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
    /// Every field, in declaration order (the order [`KvCostConfig::validate`]
    /// checks them in).
    pub const ALL: [KvConfigField; 8] = [
        KvConfigField::OverlapScoreCredit,
        KvConfigField::OverlapScoreCreditDecay,
        KvConfigField::PrefillLoadScale,
        KvConfigField::DecodeActiveRequestWeight,
        KvConfigField::HostCacheHitWeight,
        KvConfigField::DiskCacheHitWeight,
        KvConfigField::SharedCacheMultiplier,
        KvConfigField::RouterTemperature,
    ];

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

    /// Whether Dynamo bounds the field to `[0, 1]` (the host, disk and
    /// shared cache weights); the others are bounded below by 0 only.
    pub const fn at_most_one(self) -> bool {
        matches!(
            self,
            KvConfigField::HostCacheHitWeight
                | KvConfigField::DiskCacheHitWeight
                | KvConfigField::SharedCacheMultiplier
        )
    }

    /// Checks one value of the field as Dynamo's `KvRouterConfig::validate`
    /// does (finite, at least 0, and at most 1 where
    /// [`at_most_one`](Self::at_most_one)), and finite as an `f32` too: the
    /// kernel computes in `f32`, where a weight above `f32::MAX` (about
    /// 3.4e38) would be infinite. Takes an `f64`, as Dynamo's configuration
    /// holds it, so that a host can check its own values before rounding
    /// them.
    ///
    /// ```
    /// use selkie_kernel::kernels::kv_cost::{KvConfigField, KvConfigProblem};
    /// let host = KvConfigField::HostCacheHitWeight;
    /// assert!(host.check(1.0).is_ok());
    /// assert_eq!(host.check(1.5).unwrap_err().problem, KvConfigProblem::AboveOne);
    /// let credit = KvConfigField::OverlapScoreCredit;
    /// assert!(credit.check(1.5).is_ok());
    /// assert_eq!(credit.check(1e300).unwrap_err().problem, KvConfigProblem::NotFinite);
    /// ```
    pub fn check(self, value: f64) -> Result<(), KvConfigError> {
        match problem(value, self.at_most_one()) {
            None => Ok(()),
            Some(problem) => Err(KvConfigError { field: self, problem }),
        }
    }
}

/// The bound `value` breaks, if any (see [`KvConfigField::check`]).
#[inline(always)]
fn problem(value: f64, at_most_one: bool) -> Option<KvConfigProblem> {
    if !(value as f32).is_finite() {
        Some(KvConfigProblem::NotFinite)
    } else if value < 0.0 {
        Some(KvConfigProblem::Negative)
    } else if at_most_one && value > 1.0 {
        Some(KvConfigProblem::AboveOne)
    } else {
        None
    }
}

/// What is wrong with a configuration value: which bound it breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvConfigProblem {
    /// NaN or infinite (in `f32`: above `f32::MAX`, about 3.4e38).
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
            KvConfigProblem::NotFinite => "must be finite (and at most f32::MAX, about 3.4e38)",
            KvConfigProblem::Negative => "must be at least 0",
            KvConfigProblem::AboveOne => "must be at most 1",
        };
        write!(f, "{} {why}", self.field.name())
    }
}

impl core::error::Error for KvConfigError {}

impl KvCostConfig {
    /// Checks every field with [`KvConfigField::check`]: all finite and
    /// `>= 0`; the host, disk and shared weights at most 1, as Dynamo's
    /// `KvRouterConfig::validate` does. The first bad field, in declaration
    /// order, is reported.
    pub fn validate(&self) -> Result<(), KvConfigError> {
        for field in KvConfigField::ALL {
            if let Some(problem) = problem(f64::from(self.get(field)), field.at_most_one()) {
                return Err(KvConfigError { field, problem });
            }
        }
        Ok(())
    }
}
