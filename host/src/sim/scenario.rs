//! The embedded scenarios: a fleet and a workload that together ask a
//! routing question, sized to simulate every policy in seconds.
//!
//! * `default`: 16 workers, 4,000 requests of Poisson arrivals at 250/s
//!   (the fleet's knee: random routing queues, cache-aware does not), 48 shared system
//!   prompts of Zipf(1.0) popularity, half the conversations multi-turn, and
//!   KV caches of 4,096 blocks of 16 tokens, small enough that where a prefix
//!   goes decides whether it hits.
//! * `skewed`: 16 workers of 2 data-parallel ranks, bursty arrivals (bursts
//!   at 4x the mean rate), 256 long system prompts of Zipf(1.2) popularity
//!   (a few very hot, a long tail that no single cache holds) and a fleet
//!   pushed past saturation during bursts: the case where cache affinity and
//!   load balance pull hardest against each other.
//! * `mixed`: the `default` workload on a mixed fleet of 16 workers: 4 of a
//!   newer generation (twice as fast, twice the cache, capacity weight 2),
//!   8 of the default model, and 4 CPU workers (a quarter of the speed, half
//!   the cache, capacity weight 0.25): the case for device-aware and
//!   weighted policies.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::dist::LengthDist;
use super::engine::TimingModel;
use super::run::{FleetSpec, WorkerClass};
use super::workload::{Arrivals, WorkloadSpec};

/// A named fleet and workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name shown in reports.
    pub name: String,
    /// The simulated fleet.
    pub fleet: FleetSpec,
    /// The generated workload.
    pub workload: WorkloadSpec,
}

/// The embedded scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ScenarioName {
    /// See the module docs.
    #[default]
    Default,
    /// See the module docs.
    Skewed,
    /// See the module docs.
    Mixed,
}

impl ScenarioName {
    /// Every embedded scenario.
    pub const ALL: [ScenarioName; 3] = [ScenarioName::Default, ScenarioName::Skewed, ScenarioName::Mixed];

    /// The name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            ScenarioName::Default => "default",
            ScenarioName::Skewed => "skewed",
            ScenarioName::Mixed => "mixed",
        }
    }
}

impl fmt::Display for ScenarioName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ScenarioName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|n| n.as_str() == s)
            .ok_or_else(|| format!("unknown scenario {s:?}; available: default, skewed, mixed"))
    }
}

impl Scenario {
    /// One of the embedded scenarios.
    pub fn embedded(name: ScenarioName) -> Self {
        match name {
            ScenarioName::Default => Scenario {
                name: "default".into(),
                fleet: FleetSpec {
                    workers: 16,
                    dp_size: 1,
                    kv_blocks: 4_096,
                    timing: TimingModel::default(),
                    max_active_requests: None,
                    classes: Vec::new(),
                    routers: 1,
                    sync_delay_ms: None,
                },
                workload: WorkloadSpec {
                    requests: 4_000,
                    block_size: 16,
                    arrivals: Arrivals::Poisson { rate_per_s: 250.0 },
                    system_prompts: 48,
                    system_prompt_tokens: LengthDist::LogNormal {
                        median: 1024.0,
                        sigma: 0.5,
                        min: 256,
                        max: 4096,
                    },
                    zipf_s: 1.0,
                    session_fraction: 0.5,
                    session_turns: LengthDist::Uniform { lo: 2, hi: 6 },
                    think_time_ms: 3_000.0,
                    user_tokens: LengthDist::LogNormal {
                        median: 200.0,
                        sigma: 0.8,
                        min: 16,
                        max: 4096,
                    },
                    output_tokens: LengthDist::LogNormal {
                        median: 150.0,
                        sigma: 0.7,
                        min: 8,
                        max: 1024,
                    },
                },
            },
            ScenarioName::Mixed => {
                let mut s = Scenario::embedded(ScenarioName::Default);
                s.name = "mixed".into();
                s.fleet.classes = vec![
                    WorkerClass {
                        workers: 4,
                        speed: 2.0,
                        kv_blocks: Some(8_192),
                        capacity_weight: 2.0,
                        cpu: false,
                        dp_size: None,
                    },
                    WorkerClass {
                        workers: 8,
                        speed: 1.0,
                        kv_blocks: None,
                        capacity_weight: 1.0,
                        cpu: false,
                        dp_size: None,
                    },
                    WorkerClass {
                        workers: 4,
                        speed: 0.25,
                        kv_blocks: Some(2_048),
                        capacity_weight: 0.25,
                        cpu: true,
                        dp_size: None,
                    },
                ];
                s
            }
            ScenarioName::Skewed => Scenario {
                name: "skewed".into(),
                fleet: FleetSpec {
                    workers: 16,
                    dp_size: 2,
                    kv_blocks: 4_096,
                    timing: TimingModel::default(),
                    max_active_requests: None,
                    classes: Vec::new(),
                    routers: 1,
                    sync_delay_ms: None,
                },
                workload: WorkloadSpec {
                    requests: 4_000,
                    block_size: 16,
                    arrivals: Arrivals::Bursty {
                        rate_per_s: 200.0,
                        burst_factor: 4.0,
                        burst_ms: 1_000.0,
                        calm_ms: 4_000.0,
                    },
                    system_prompts: 256,
                    system_prompt_tokens: LengthDist::LogNormal {
                        median: 3000.0,
                        sigma: 0.4,
                        min: 1024,
                        max: 8192,
                    },
                    zipf_s: 1.2,
                    session_fraction: 0.3,
                    session_turns: LengthDist::Uniform { lo: 2, hi: 4 },
                    think_time_ms: 2_000.0,
                    user_tokens: LengthDist::LogNormal {
                        median: 300.0,
                        sigma: 1.0,
                        min: 16,
                        max: 8192,
                    },
                    output_tokens: LengthDist::LogNormal {
                        median: 200.0,
                        sigma: 0.8,
                        min: 8,
                        max: 2048,
                    },
                },
            },
        }
    }
}
