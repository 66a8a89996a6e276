//! Your own policy in the simulator: a ten-line scorer (cost = 4 x active
//! requests - 0.1 x cached device blocks, lowest wins), registered under a
//! type name next to the built-ins, simulated on the default scenario
//! against the default KV policy and least-loaded.
//!
//! ```sh
//! cargo run --release -p selkie --features sim --example simulate_custom_policy [REQUESTS]
//! ```
//!
//! The same registry serves a router: `registry.build("active-minus-cached",
//! ...)`, or a worker-selection config file naming the type.

use std::sync::Arc;

use selkie::sim::compare::{run_policy, PolicyChoice};
use selkie::sim::metrics::render_table;
use selkie::sim::scenario::{Scenario, ScenarioName};
use selkie::*;

/// Cost = 4 x active requests - 0.1 x cached device blocks.
struct ActiveMinusCached;

impl WorkerScorer for ActiveMinusCached {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD | WorkerInputs::CACHE
    }
    fn score(
        &self,
        _: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (cost, c) in costs.iter_mut().zip(candidates.iter()) {
            let load = c
                .load()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("LOAD not given"))?;
            let cache = c
                .cache()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("CACHE not given"))?;
            *cost = 4.0 * load.active_requests() as f64 - 0.1 * cache.device_overlap_blocks();
        }
        Ok(())
    }
}

/// The lowest cost wins (the first one on a tie).
struct LowestCost;

impl WorkerPicker for LowestCost {
    fn pick(
        &self,
        _: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let costs = input.costs();
        (0..costs.len())
            .min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
            .ok_or_else(|| WorkerSelectionPolicyError::failed("no candidate"))
    }
}

/// The built-ins and the scorer, as the type `active-minus-cached`.
pub fn registry() -> Result<WorkerSelectionPolicyRegistry, RegistryError> {
    let provider: WorkerSelectionPolicyProvider = Arc::new(|_: &WorkerSelectionPolicyParameters| {
        let factory: WorkerSelectionPolicyFactory = Arc::new(|config: &KvRouterConfig, role, _| {
            WorkerSelectionPolicy::new(*config, role, vec![Box::new(ActiveMinusCached)], Box::new(LowestCost))
        });
        Ok(factory)
    });
    let mut registry = WorkerSelectionPolicyRegistry::new();
    registry.register("active-minus-cached", provider)?;
    Ok(registry)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let registry = registry()?;

    let mut scenario = Scenario::embedded(ScenarioName::Default);
    if let Some(n) = std::env::args().nth(1) {
        scenario.workload.requests = n.parse()?;
    }
    scenario.validate()?;
    let workload = scenario.workload.generate(42);
    let mut reports = Vec::new();
    for choice in [
        PolicyChoice::kv_at(0.0),
        PolicyChoice::builtin("least-loaded"),
        PolicyChoice::builtin("active-minus-cached"),
    ] {
        choice.validate(&registry)?;
        let run = run_policy(&registry, &choice, &workload, &scenario.fleet, 42, &mut |_| {})?;
        assert_eq!(run.report.failed, 0, "{}: every request is routed", choice.label);
        reports.push(run.report);
    }
    print!("{}", render_table(&reports));
    Ok(())
}
