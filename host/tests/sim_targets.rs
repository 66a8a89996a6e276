//! The simulator's decision targets that run in seconds: on the default
//! scenario, the KV policy `selkie tune` picks (48 candidates, seed 42, as
//! the command does by default) beats the README's ten-line custom scorer
//! on both the KV hit rate and the TTFT p99, over the whole scenario.

use selkie::sim::compare::{run_policy, PolicyChoice};
use selkie::sim::scenario::{Scenario, ScenarioName};
use selkie::sim::tune::{split_in_time, tune, TuneSpace};

#[path = "../examples/simulate_custom_policy.rs"]
#[allow(dead_code)]
mod custom_policy;

#[test]
fn the_tuned_kv_policy_beats_the_ten_line_scorer_on_the_default_scenario() {
    let scenario = Scenario::embedded(ScenarioName::Default);
    let workload = scenario.workload.generate(42);
    let registry = custom_policy::registry().unwrap();
    let (train, _) = split_in_time(&workload);
    let trials = tune(
        &registry,
        &train,
        &scenario.fleet,
        &TuneSpace::default(),
        48,
        42,
        2,
        &|_| {},
    )
    .unwrap();
    let winner = trials[0].weights;
    let run = |choice: &PolicyChoice| {
        run_policy(&registry, choice, &workload, &scenario.fleet, 42, &mut |_| {})
            .unwrap()
            .report
    };
    let tuned = run(&winner.choice("tuned"));
    let scorer = run(&PolicyChoice::builtin("active-minus-cached"));
    let defaults = run(&PolicyChoice::kv_at(0.0));
    assert_eq!((tuned.failed, scorer.failed), (0, 0));
    assert!(
        tuned.hit_rate > scorer.hit_rate && tuned.ttft_p99_ms < scorer.ttft_p99_ms,
        "tuned {winner:?}: hit {:.3}, TTFT p99 {:.0} ms; scorer: hit {:.3}, {:.0} ms",
        tuned.hit_rate,
        tuned.ttft_p99_ms,
        scorer.hit_rate,
        scorer.ttft_p99_ms
    );
    assert!(tuned.hit_rate > defaults.hit_rate && tuned.ttft_p99_ms < defaults.ttft_p99_ms);
}
