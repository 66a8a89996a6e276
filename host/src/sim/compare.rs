//! Running one workload under several policies: the policy set
//! ([`PolicyChoice`]: every built-in, the `kv` policy with and without a
//! switching margin, and the instances of a config file), each built through
//! the host's [`WorkerSelectionPolicyRegistry`] and simulated against a
//! fresh fleet with the same seed.

use std::path::Path;

use crate::{
    AffinityMode, KvRouterConfig, RoutingPartitionRef, WorkerSelectionConfig, WorkerSelectionPolicyParameters,
    WorkerSelectionPolicyRegistry, WorkerType,
};

use super::metrics::{HitBounds, PolicyReport};
use super::run::{simulate, FleetSpec, RunRecord};
use super::service_router::{fleet_service, ReplicatedRouter, ServiceRouter};
use super::workload::Workload;
use super::SimError;

/// The relative switching margin of the `kv` variant in the default policy
/// set (`kv:{switch_margin_relative: 0.3}`, labelled `kv margin 30%`): a
/// request stays on the worker holding its longest cached prefix unless
/// another is cheaper by more than 30% of that worker's cost. This is the
/// setting the README's stability section recommends; the `kv` policy's own
/// default is no margin.
pub const DEFAULT_SET_SWITCH_MARGIN_RELATIVE: f64 = 0.3;

/// One policy to simulate: a registry type name and its parameters.
#[derive(Clone, Debug)]
pub struct PolicyChoice {
    /// Label in the report.
    pub label: String,
    /// Registry type name.
    pub policy_type: String,
    /// Parameters for the type's provider.
    pub parameters: WorkerSelectionPolicyParameters,
    /// Session affinity requests carry (`None`: no session).
    pub session_affinity: Option<AffinityMode>,
}

impl PolicyChoice {
    /// A policy type without parameters, labelled by its name.
    pub fn builtin(name: &str) -> Self {
        PolicyChoice {
            label: name.to_owned(),
            policy_type: name.to_owned(),
            parameters: WorkerSelectionPolicyParameters::default(),
            session_affinity: None,
        }
    }

    /// The `kv` policy with its default weights at `temperature`.
    pub fn kv_at(temperature: f64) -> Self {
        #[derive(serde::Serialize)]
        struct Temperature {
            router_temperature: f64,
        }
        let parameters = WorkerSelectionPolicyParameters::from_serialize(&Temperature {
            router_temperature: temperature,
        })
        .expect("a struct serializes as a mapping");
        PolicyChoice {
            label: format!("kv T={temperature}"),
            policy_type: "kv".to_owned(),
            parameters,
            session_affinity: None,
        }
    }

    /// The `kv` policy with its default weights and a relative switching
    /// margin of `relative` (`switch_margin_relative`), labelled
    /// `kv margin 30%` for 0.3.
    ///
    /// ```
    /// use selkie::sim::compare::PolicyChoice;
    /// let margin = PolicyChoice::kv_with_relative_margin(0.3);
    /// assert_eq!(margin.label, "kv margin 30%");
    /// let spelled = PolicyChoice::parse("kv:{switch_margin_relative: 0.3}").unwrap();
    /// assert_eq!(margin.parameters, spelled.parameters);
    /// ```
    pub fn kv_with_relative_margin(relative: f64) -> Self {
        #[derive(serde::Serialize)]
        struct Margin {
            switch_margin_relative: f64,
        }
        let parameters = WorkerSelectionPolicyParameters::from_serialize(&Margin {
            switch_margin_relative: relative,
        })
        .expect("a struct serializes as a mapping");
        PolicyChoice {
            // Rounded, so that 0.3 reads 30, not 30.000000000000004.
            label: format!("kv margin {}%", (relative * 1e8).round() / 1e6),
            policy_type: "kv".to_owned(),
            parameters,
            session_affinity: None,
        }
    }

    /// The default policy set of `selkie simulate`: every built-in that can
    /// route requests that do not name their worker (all but `direct`), the
    /// `kv` policy at temperature 0 (its defaults, `kv T=0`) and with the
    /// relative switching margin [`DEFAULT_SET_SWITCH_MARGIN_RELATIVE`]
    /// (`kv margin 30%`).
    pub fn builtins() -> Vec<Self> {
        let mut v = vec![
            Self::kv_at(0.0),
            Self::kv_with_relative_margin(DEFAULT_SET_SWITCH_MARGIN_RELATIVE),
        ];
        for name in [
            "round-robin",
            "random",
            "least-loaded",
            "power-of-two",
            "device-aware-weighted",
            "prefix-hash",
        ] {
            v.push(Self::builtin(name));
        }
        v
    }

    /// Parses a `--policy` value: a registry type name (`least-loaded`),
    /// `kv@TEMPERATURE`, or `TYPE:PARAMETERS` with the parameters as inline
    /// YAML (`kv:{overlap_score_credit: 2, router_temperature: 0.1}`),
    /// exactly as they would appear in a config file.
    ///
    /// ```
    /// use selkie::sim::compare::PolicyChoice;
    /// assert_eq!(PolicyChoice::parse("kv@0.5").unwrap().label, "kv T=0.5");
    /// let custom = PolicyChoice::parse("kv:{overlap_score_credit: 2}").unwrap();
    /// assert_eq!((custom.policy_type.as_str(), custom.label.as_str()), ("kv", "kv:{overlap_score_credit: 2}"));
    /// assert!(PolicyChoice::parse("kv:{unclosed").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Self, SimError> {
        if let Some((name, yaml)) = text.split_once(':') {
            let parameters: WorkerSelectionPolicyParameters = serde_saphyr::from_str(yaml)
                .map_err(|e| SimError::Usage(format!("bad parameters in {text:?}: {e}")))?;
            return Ok(PolicyChoice {
                label: text.to_owned(),
                policy_type: name.to_owned(),
                parameters,
                session_affinity: None,
            });
        }
        match text.split_once('@') {
            Some(("kv", t)) => {
                let t: f64 = t
                    .parse()
                    .map_err(|_| SimError::Usage(format!("bad temperature in {text:?}")))?;
                Ok(Self::kv_at(t))
            }
            Some(_) => Err(SimError::Usage(format!("only kv takes @TEMPERATURE, got {text:?}"))),
            None => Ok(Self::builtin(text)),
        }
    }

    /// Checks that `registry` can build this policy (type name and
    /// parameters), so that a bad choice fails before any simulation runs.
    ///
    /// `direct` is refused: it routes only requests pinned to a worker, and
    /// the simulator's requests name none (every one would fail).
    pub fn validate(&self, registry: &WorkerSelectionPolicyRegistry) -> Result<(), SimError> {
        registry.factory(&self.policy_type, &self.parameters)?;
        if self.policy_type == "direct" {
            return Err(SimError::Usage(format!(
                "{}: `direct` routes only requests pinned to a worker, and simulated requests name none",
                self.label
            )));
        }
        Ok(())
    }

    /// The same policy with requests carrying their session under `mode`
    /// (labelled `+soft` / `+hard`).
    pub fn with_session_affinity(mut self, mode: AffinityMode) -> Self {
        self.label.push_str(match mode {
            AffinityMode::Soft => " +soft",
            AffinityMode::Hard => " +hard",
        });
        self.session_affinity = Some(mode);
        self
    }

    /// Every instance of a worker-selection config file, labelled
    /// `config:NAME`, for a workload of `block_size`-token blocks: a file
    /// that states another block size has its lengths in blocks converted
    /// to `block_size` ([`WorkerSelectionConfig::at_block_size`]); one
    /// that states none is read as it is.
    pub fn from_config(path: &Path, block_size: u32) -> Result<Vec<Self>, SimError> {
        let config = WorkerSelectionConfig::from_path(path)?.at_block_size(block_size)?;
        Ok(config
            .instance_names()
            .into_iter()
            .filter_map(|name| {
                let i = config.instance(&name)?;
                Some(PolicyChoice {
                    label: format!("config:{name}"),
                    policy_type: i.policy_type().to_owned(),
                    parameters: i.parameters().clone(),
                    session_affinity: None,
                })
            })
            .collect())
    }
}

/// One policy's simulated outcome.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    /// The summary.
    pub report: PolicyReport,
    /// The raw record (for plots).
    pub record: RunRecord,
}

/// Simulates `workload` on `fleet` under `choice`, through the real
/// selection service built by `registry`. `progress` gets requests routed.
pub fn run_policy(
    registry: &WorkerSelectionPolicyRegistry,
    choice: &PolicyChoice,
    workload: &Workload,
    fleet: &FleetSpec,
    seed: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<PolicyRun, SimError> {
    // Checked before the bounds, which walk every worker of the fleet.
    fleet.validate()?;
    let bounds = HitBounds::of(workload, fleet);
    run_policy_within(registry, choice, workload, fleet, &bounds, seed, progress)
}

/// [`run_policy`] for a comparison that computed the workload's hit-rate
/// bounds once (`bounds`: [`HitBounds::of`] the same workload and fleet).
pub fn run_policy_within(
    registry: &WorkerSelectionPolicyRegistry,
    choice: &PolicyChoice,
    workload: &Workload,
    fleet: &FleetSpec,
    bounds: &HitBounds,
    seed: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<PolicyRun, SimError> {
    // The service of router replica `r`, each seeded apart (replicas do
    // not draw the same random numbers); replica 0 is the one router.
    let service = |r: u32| {
        let policy = registry.build(
            &choice.policy_type,
            &choice.parameters,
            &KvRouterConfig::default(),
            WorkerType::Aggregated,
            RoutingPartitionRef::model("simulated"),
        )?;
        fleet_service(policy, fleet, workload.block_size, seed.wrapping_add(u64::from(r)))
    };
    let record = if fleet.routers > 1 {
        let services = (0..fleet.routers).map(service).collect::<Result<Vec<_>, SimError>>()?;
        let replicas = services
            .iter()
            .map(|s| ServiceRouter::new(s, fleet).with_session_affinity(choice.session_affinity))
            .collect();
        let mut router = ReplicatedRouter::new(replicas, fleet.sync_delay_ms);
        let record = simulate(workload, fleet, &mut router, progress)?;
        router.flush();
        debug_assert_eq!(router.outstanding(), 0, "every booking is released");
        record
    } else {
        let service = service(0)?;
        let mut router = ServiceRouter::new(&service, fleet).with_session_affinity(choice.session_affinity);
        let record = simulate(workload, fleet, &mut router, progress)?;
        debug_assert_eq!(router.outstanding(), 0, "every booking is released");
        record
    };
    let report = PolicyReport::new(choice.label.clone(), &record, bounds);
    Ok(PolicyRun { report, record })
}
