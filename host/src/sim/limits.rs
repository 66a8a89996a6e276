//! What the simulator accepts: every number of a scenario, a trace or the
//! command line is checked here before anything is generated or allocated
//! per request, and a bad one is refused with its field's name and the bound
//! it breaks ([`SimError::Invalid`]).
//!
//! The upper limits keep memory bounded by the workload's real size: a
//! request count, a token length or a rate past them would make the run
//! allocate far more than any fleet it models.
//!
//! ```
//! use selkie::sim::scenario::{Scenario, ScenarioName};
//! use selkie::sim::SimError;
//!
//! let mut scenario = Scenario::embedded(ScenarioName::Default);
//! scenario.fleet.timing.max_running = 0;
//! match scenario.validate() {
//!     Err(SimError::Invalid { field, .. }) => assert_eq!(field, "fleet.timing.max_running"),
//!     other => panic!("{other:?}"),
//! }
//! ```
//!
//! This module must not simulate: only check.

use super::dist::LengthDist;
use super::engine::TimingModel;
use super::run::FleetSpec;
use super::scenario::Scenario;
use super::workload::{Arrivals, WorkloadSpec};
use super::SimError;

/// The most requests one run simulates.
pub const MAX_REQUESTS: usize = 10_000_000;

/// The most tokens of one prompt or one output (a trace line, a length
/// distribution's largest value, and a generated conversation's prompt).
pub const MAX_TOKENS: u32 = 1 << 22;

/// The highest mean arrival rate, in requests per second.
pub const MAX_RATE_PER_S: f64 = 1e7;

/// The longest time a scenario names (think time, burst and calm spells), in
/// milliseconds: 30 days.
pub const MAX_MS: f64 = 30.0 * 24.0 * 3_600_000.0;

/// The largest block size, in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

/// The most router replicas a simulation runs (each holds a selection
/// service and a copy of every booking).
pub const MAX_ROUTERS: u32 = 64;

/// The error for `field` holding `value`, which breaks `bound`.
pub(crate) fn invalid(field: impl Into<String>, value: impl ToString, bound: impl Into<String>) -> SimError {
    SimError::Invalid {
        field: field.into(),
        value: value.to_string(),
        bound: bound.into(),
    }
}

/// `value` is at least 1.
pub(crate) fn positive<T: PartialOrd + Default + ToString>(field: &str, value: T) -> Result<(), SimError> {
    if value > T::default() {
        Ok(())
    } else {
        Err(invalid(field, value, "must be at least 1"))
    }
}

/// `value` is from 1 to `max`.
pub(crate) fn count<T: PartialOrd + Default + ToString + Copy>(field: &str, value: T, max: T) -> Result<(), SimError> {
    positive(field, value)?;
    if value > max {
        return Err(invalid(field, value, format!("must be at most {}", max.to_string())));
    }
    Ok(())
}

/// `value` is finite and in `lo..=hi`.
pub(crate) fn within(field: &str, value: f64, lo: f64, hi: f64) -> Result<(), SimError> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(invalid(
            field,
            value,
            format!("must be a finite number from {lo} to {hi}"),
        ))
    }
}

/// `value` is finite, above 0 and at most `hi`.
pub(crate) fn above_zero(field: &str, value: f64, hi: f64) -> Result<(), SimError> {
    if value.is_finite() && value > 0.0 && value <= hi {
        Ok(())
    } else {
        Err(invalid(
            field,
            value,
            format!("must be a finite number above 0 and at most {hi}"),
        ))
    }
}

/// A finite value above 0 and at most `hi`, for an option that may be absent
/// (`None` passes); public for the command line.
pub fn above_zero_option(field: &str, value: Option<f64>, hi: f64) -> Result<(), SimError> {
    value.map_or(Ok(()), |v| above_zero(field, v, hi))
}

/// A token count of at most [`MAX_TOKENS`].
pub(crate) fn tokens(field: &str, value: u32) -> Result<(), SimError> {
    if value <= MAX_TOKENS {
        Ok(())
    } else {
        Err(invalid(field, value, format!("must be at most {MAX_TOKENS} tokens")))
    }
}

impl Scenario {
    /// Checks every field (see the module docs): `Ok` only for a scenario
    /// the simulator runs to completion in bounded memory.
    pub fn validate(&self) -> Result<(), SimError> {
        self.fleet.validate()?;
        self.workload.validate()
    }
}

impl FleetSpec {
    /// Checks the fleet's numbers and that it fits in the selection
    /// service's fleet ([`FLEET_GROUPS`](crate::FLEET_GROUPS) `* 8` rows),
    /// before anything is allocated per rank.
    pub fn validate(&self) -> Result<(), SimError> {
        positive("fleet.workers", self.workers)?;
        positive("fleet.dp_size", self.dp_size)?;
        positive("fleet.kv_blocks", self.kv_blocks)?;
        if let Some(limit) = self.max_active_requests {
            positive("fleet.max_active_requests", limit)?;
        }
        positive("fleet.routers", self.routers)?;
        if self.routers > MAX_ROUTERS {
            return Err(invalid(
                "fleet.routers",
                self.routers.to_string(),
                format!("must be at most {MAX_ROUTERS}"),
            ));
        }
        if let Some(d) = self.sync_delay_ms {
            within("fleet.sync_delay_ms", d, 0.0, MAX_MS)?;
        }
        self.timing.validate()?;
        let mut classed = 0u64;
        for (i, class) in self.classes.iter().enumerate() {
            let field = |name: &str| format!("fleet.classes[{i}].{name}");
            positive(&field("workers"), class.workers)?;
            above_zero(&field("speed"), class.speed, 1e3)?;
            if let Some(blocks) = class.kv_blocks {
                positive(&field("kv_blocks"), blocks)?;
            }
            above_zero(&field("capacity_weight"), class.capacity_weight, 1e6)?;
            if let Some(dp) = class.dp_size {
                positive(&field("dp_size"), dp)?;
            }
            classed += u64::from(class.workers);
        }
        if classed > u64::from(self.workers) {
            return Err(invalid(
                "fleet.classes",
                format!("{classed} workers"),
                format!("must be at most the fleet's {} workers", self.workers),
            ));
        }
        let capacity = crate::FLEET_GROUPS * 8;
        if self.rows() > capacity {
            return Err(SimError::FleetTooLarge {
                workers: self.workers,
                dp_size: self.dp_size,
                capacity,
            });
        }
        Ok(())
    }
}

impl TimingModel {
    /// Checks that every step takes a finite, positive time and admits
    /// work (a step that admits nothing would never end the run).
    pub fn validate(&self) -> Result<(), SimError> {
        above_zero("fleet.timing.step_overhead_ms", self.step_overhead_ms, MAX_MS)?;
        within(
            "fleet.timing.prefill_ms_per_token",
            self.prefill_ms_per_token,
            0.0,
            MAX_MS,
        )?;
        within("fleet.timing.decode_ms_per_seq", self.decode_ms_per_seq, 0.0, MAX_MS)?;
        positive("fleet.timing.max_batched_tokens", self.max_batched_tokens)?;
        positive("fleet.timing.max_running", self.max_running)
    }
}

impl LengthDist {
    /// Checks the parameters: ordered bounds of at most [`MAX_TOKENS`], a
    /// finite positive median and a finite, non-negative spread.
    pub fn validate(&self, field: &str) -> Result<(), SimError> {
        match *self {
            LengthDist::Fixed(n) => tokens(field, n),
            LengthDist::Uniform { lo, hi } => {
                tokens(&format!("{field}.hi"), hi)?;
                if lo > hi {
                    return Err(invalid(format!("{field}.lo"), lo, format!("must be at most hi ({hi})")));
                }
                Ok(())
            }
            LengthDist::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                above_zero(&format!("{field}.median"), median, f64::from(MAX_TOKENS))?;
                within(&format!("{field}.sigma"), sigma, 0.0, 10.0)?;
                tokens(&format!("{field}.max"), max)?;
                if min > max {
                    return Err(invalid(
                        format!("{field}.min"),
                        min,
                        format!("must be at most max ({max})"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// The largest value a draw can take.
    pub fn max_value(&self) -> u32 {
        match *self {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { lo, hi } => lo.max(hi),
            LengthDist::LogNormal { min, max, .. } => min.max(max),
        }
    }
}

impl Arrivals {
    /// Checks the rate and, for bursts, the spells.
    pub fn validate(&self, field: &str) -> Result<(), SimError> {
        above_zero(&format!("{field}.rate_per_s"), self.rate_per_s(), MAX_RATE_PER_S)?;
        if let Arrivals::Bursty {
            burst_factor,
            burst_ms,
            calm_ms,
            ..
        } = *self
        {
            within(&format!("{field}.burst_factor"), burst_factor, 1.0, 1e6)?;
            above_zero(&format!("{field}.burst_ms"), burst_ms, MAX_MS)?;
            above_zero(&format!("{field}.calm_ms"), calm_ms, MAX_MS)?;
        }
        Ok(())
    }
}

impl WorkloadSpec {
    /// Checks every parameter, and that the longest conversation's last
    /// prompt stays within [`MAX_TOKENS`].
    pub fn validate(&self) -> Result<(), SimError> {
        count("workload.requests", self.requests, MAX_REQUESTS)?;
        count("workload.block_size", self.block_size, MAX_BLOCK_SIZE)?;
        self.arrivals.validate("workload.arrivals")?;
        count("workload.system_prompts", self.system_prompts, MAX_REQUESTS)?;
        self.system_prompt_tokens.validate("workload.system_prompt_tokens")?;
        within("workload.zipf_s", self.zipf_s, 0.0, 100.0)?;
        within("workload.session_fraction", self.session_fraction, 0.0, 1.0)?;
        self.session_turns.validate("workload.session_turns")?;
        within("workload.think_time_ms", self.think_time_ms, 0.0, MAX_MS)?;
        self.user_tokens.validate("workload.user_tokens")?;
        self.output_tokens.validate("workload.output_tokens")?;
        // A session's last prompt holds the system prompt and every earlier
        // turn's user tokens and output.
        let turns = u64::from(self.session_turns.max_value().max(1));
        let per_turn =
            u64::from(self.user_tokens.max_value().max(1)) + u64::from(self.output_tokens.max_value().max(1));
        let longest = u64::from(self.system_prompt_tokens.max_value()) + u64::from(self.block_size) + turns * per_turn;
        if longest > u64::from(MAX_TOKENS) {
            return Err(invalid(
                "workload.session_turns",
                self.session_turns.max_value(),
                format!(
                    "a session of this many turns reaches {longest} prompt tokens, above the limit of {MAX_TOKENS}"
                ),
            ));
        }
        Ok(())
    }
}
