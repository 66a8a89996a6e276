//! A custom scorer next to the built-in `decode` term and `softmax` picker,
//! combined from a few lines of YAML and run on a small fleet.
//!
//! ```sh
//! cargo run -p selkie --example custom_scorer_softmax
//! ```

use std::sync::Arc;

use selkie::*;

/// `penalty` blocks per active request on CPU workers.
#[derive(Clone)]
struct CpuPenalty {
    penalty: f64,
}

impl WorkerScorer for CpuPenalty {
    fn name(&self) -> &'static str {
        "cpu-penalty"
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::DEVICE_AWARE | WorkerInputs::LOAD
    }
    fn score(
        &self,
        _: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (cost, c) in costs.iter_mut().zip(candidates.iter()) {
            let cpu = c.device() == Some(DeviceKind::Cpu);
            let active = c.load().map_or(0, |l| l.active_requests()) as f64;
            *cost = if cpu { self.penalty * (1.0 + active) } else { 0.0 };
        }
        Ok(())
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CpuPenaltyParameters {
    penalty: f64,
}

const CONFIG: &str = "
aggregated: mixed
instances:
  - name: mixed
    type: composed
    parameters:
      scorers:
        - { type: decode }
        - { type: cpu-penalty, parameters: { penalty: 40 } }
      picker: { type: softmax, parameters: { temperature: 0.5, seed: 7 } }
";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut registry = WorkerSelectionPolicyRegistry::new();
    let provider: WorkerScorerProvider = Arc::new(|p: &WorkerSelectionPolicyParameters| {
        let CpuPenaltyParameters { penalty } = p.deserialize()?;
        if !(penalty.is_finite() && penalty >= 0.0) {
            return Err(WorkerSelectionPolicyProviderError::new(format!(
                "penalty must be finite and at least 0, got {penalty}"
            )));
        }
        let factory: WorkerScorerFactory = Arc::new(move |_, _, _| Box::new(CpuPenalty { penalty }));
        Ok(factory)
    });
    registry.register_scorer("cpu-penalty", provider)?;

    let factory = WorkerSelectionConfig::from_yaml_str(CONFIG)?.resolve(&registry, WorkerType::Aggregated)?;
    let policy = factory(
        &KvRouterConfig::default(),
        WorkerType::Aggregated,
        RoutingPartitionRef::model("llama"),
    );
    let service = WorkerSelectionService::new(policy, ServiceConfig::default());
    service.add_worker(WorkerRecord::new(1))?;
    service.add_worker(WorkerRecord::new(2))?;
    service.add_worker(WorkerRecord::new(3).with_device(DeviceKind::Cpu))?;

    let mut held = Vec::new();
    let mut picks = [0usize; 3];
    for i in 0..24 {
        let isl = 64 + 32 * (i % 5);
        let selection = service.select(&SelectionRequest::new(isl))?;
        let worker = selection.worker();
        picks[worker.worker_id as usize - 1] += 1;
        println!(
            "request {i:>2} ({isl:>3} tokens) -> worker {} (cost {:.1})",
            worker.worker_id,
            selection.explanation().cost
        );
        held.push(selection); // keep the load booked
    }
    println!("picks per worker (1, 2, 3 = CPU): {picks:?}");
    Ok(())
}
