//! `selkie tune`: a search over the KV policy's weights with the simulator.
//!
//! The workload is split in time: the first half of the requests trains
//! (every candidate is simulated on it), the second half tests (the
//! winner and the default weights are simulated on it, so a user sees
//! whether the gain holds on requests the search never saw). Candidates are
//! the default weights and random draws over [`TuneSpace`], from a seed:
//! the cost weights, the temperature and the switching margin with its
//! bounded dwell.
//!
//! A candidate's score (lower is better) weighs its time-to-first-token
//! p99 and its cache misses against the default weights' on the same
//! requests: `ttft_p99 / default_ttft_p99 + (1 - hit) / (1 - default_hit)`;
//! the default scores 2, and a candidate that refuses more requests than
//! the default is never chosen.
//!
//! ```
//! use selkie::sim::scenario::{Scenario, ScenarioName};
//! use selkie::sim::tune::{split_in_time, tune, TuneSpace};
//! use selkie::WorkerSelectionPolicyRegistry;
//!
//! let mut scenario = Scenario::embedded(ScenarioName::Default);
//! scenario.workload.requests = 400;
//! scenario.fleet.workers = 4;
//! let (train, _test) = split_in_time(&scenario.workload.generate(1));
//! let trials = tune(&WorkerSelectionPolicyRegistry::new(), &train, &scenario.fleet, &TuneSpace::default(), 4, 1, 2, &|_| {})?;
//! assert_eq!(trials.len(), 4);
//! assert!(trials[0].score <= trials.iter().find(|t| t.is_default).unwrap().score);
//! # Ok::<(), selkie::sim::SimError>(())
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use super::compare::{run_policy_within, PolicyChoice};
use super::dist::WorkloadRng;
use super::metrics::{HitBounds, PolicyReport};
use super::run::FleetSpec;
use super::workload::Workload;
use super::SimError;
use crate::{KvRouterConfig, WorkerSelectionPolicyParameters, WorkerSelectionPolicyRegistry};

/// The ranges candidates are drawn from (log-uniform for the scales,
/// uniform for the temperature, which is 0 for half of the candidates).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TuneSpace {
    /// `overlap_score_credit`: credit per cached block.
    pub overlap_score_credit: (f64, f64),
    /// `prefill_load_scale`: weight of the prompt tokens still to prefill.
    pub prefill_load_scale: (f64, f64),
    /// `decode_active_request_weight`: cost per request decoding (0 half of
    /// the time).
    pub decode_active_request_weight: (f64, f64),
    /// `router_temperature`.
    pub router_temperature: (f64, f64),
    /// `switch_margin`: the absolute switching margin, in blocks (0 for a
    /// third of the candidates).
    pub switch_margin: (f64, f64),
    /// `switch_margin_relative` (0 for a third of the candidates).
    pub switch_margin_relative: (f64, f64),
    /// `max_dwell`, log-uniform over whole requests.
    pub max_dwell: (u32, u32),
}

impl Default for TuneSpace {
    fn default() -> Self {
        TuneSpace {
            overlap_score_credit: (0.25, 8.0),
            prefill_load_scale: (0.25, 8.0),
            decode_active_request_weight: (0.5, 64.0),
            router_temperature: (0.0, 0.5),
            switch_margin: (1.0, 512.0),
            switch_margin_relative: (0.02, 1.0),
            max_dwell: (1, 1024),
        }
    }
}

/// The KV weights a search varies.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct KvWeights {
    /// `overlap_score_credit`.
    pub overlap_score_credit: f64,
    /// `prefill_load_scale`.
    pub prefill_load_scale: f64,
    /// `decode_active_request_weight`.
    pub decode_active_request_weight: f64,
    /// `router_temperature`.
    pub router_temperature: f64,
    /// `switch_margin`.
    pub switch_margin: f64,
    /// `switch_margin_relative`.
    pub switch_margin_relative: f64,
    /// `max_dwell`.
    pub max_dwell: u32,
}

impl Default for KvWeights {
    /// Dynamo's defaults (no switching margin).
    fn default() -> Self {
        let d = KvRouterConfig::default();
        KvWeights {
            overlap_score_credit: d.overlap_score_credit,
            prefill_load_scale: d.prefill_load_scale,
            decode_active_request_weight: d.decode_active_request_weight,
            router_temperature: d.router_temperature,
            switch_margin: d.switch_margin,
            switch_margin_relative: d.switch_margin_relative,
            max_dwell: d.max_dwell,
        }
    }
}

impl KvWeights {
    /// The `kv` policy's parameters (a config file's `parameters:`).
    pub fn parameters(&self) -> WorkerSelectionPolicyParameters {
        #[derive(serde::Serialize)]
        struct Parameters {
            overlap_score_credit: f64,
            prefill_load_scale: f64,
            decode_active_request_weight: f64,
            router_temperature: f64,
            switch_margin: f64,
            switch_margin_relative: f64,
            max_dwell: u32,
        }
        WorkerSelectionPolicyParameters::from_serialize(&Parameters {
            overlap_score_credit: self.overlap_score_credit,
            prefill_load_scale: self.prefill_load_scale,
            decode_active_request_weight: self.decode_active_request_weight,
            router_temperature: self.router_temperature,
            switch_margin: self.switch_margin,
            switch_margin_relative: self.switch_margin_relative,
            max_dwell: self.max_dwell,
        })
        .expect("a struct serializes as a mapping")
    }

    /// The `kv` policy with these weights, labelled `label`.
    pub fn choice(&self, label: &str) -> PolicyChoice {
        PolicyChoice {
            label: label.to_owned(),
            policy_type: "kv".to_owned(),
            parameters: self.parameters(),
            session_affinity: None,
        }
    }

    /// A worker-selection config file (YAML) whose one instance, `name`, is
    /// the `kv` policy with these weights, tuned on a workload of
    /// `block_size`-token blocks: the file states that block size, and a
    /// service of another converts the lengths in blocks (`switch_margin`,
    /// `decode_active_request_weight`) to its own (see
    /// [`WorkerSelectionConfig`](crate::WorkerSelectionConfig)).
    pub fn config_yaml(&self, name: &str, block_size: u32) -> String {
        format!(
            "# Written by `selkie tune`. Lengths are in blocks of block_size tokens; a router or simulation of\n\
             # another block size converts them to its own blocks (the same tokens).\nblock_size: {block_size}\n\
             aggregated: {name}\ninstances:\n  - name: {name}\n    type: kv\n    parameters:\n      \
             overlap_score_credit: {:?}\n      prefill_load_scale: {:?}\n      decode_active_request_weight: {:?}\n      \
             router_temperature: {:?}\n      switch_margin: {:?}\n      switch_margin_relative: {:?}\n      \
             max_dwell: {}\n",
            self.overlap_score_credit,
            self.prefill_load_scale,
            self.decode_active_request_weight,
            self.router_temperature,
            self.switch_margin,
            self.switch_margin_relative,
            self.max_dwell
        )
    }
}

/// One simulated candidate.
#[derive(Clone, Debug)]
pub struct Trial {
    /// Its weights.
    pub weights: KvWeights,
    /// Whether these are the default weights.
    pub is_default: bool,
    /// Its report on the requests it was simulated on.
    pub report: PolicyReport,
    /// Its score (see the module docs; lower is better).
    pub score: f64,
}

/// The first and the second half of `workload`'s requests, in arrival
/// order; the second half's arrivals are shifted to start at 0 (its caches
/// start empty, as a fresh fleet's do).
pub fn split_in_time(workload: &Workload) -> (Workload, Workload) {
    split_in_time_owned(workload.clone())
}

/// [`split_in_time`], taking the workload (its requests are moved, not
/// copied).
pub fn split_in_time_owned(mut workload: Workload) -> (Workload, Workload) {
    let half = workload.requests.len() / 2;
    let mut second = Workload {
        block_size: workload.block_size,
        requests: workload.requests.split_off(half),
    };
    let first = workload;
    let t0 = second.requests.first().map_or(0.0, |r| r.arrival_ms);
    for r in &mut second.requests {
        r.arrival_ms -= t0;
    }
    (first, second)
}

/// `n` candidates from `seed`: the default weights first, then draws over
/// `space` ([`Candidates`], collected).
pub fn candidates(space: &TuneSpace, n: usize, seed: u64) -> Vec<KvWeights> {
    Candidates::new(space, seed).take(n.max(1)).collect()
}

/// The candidates of `seed`, drawn one at a time: the default weights
/// first, then draws over the space, without end. A search takes as many
/// as it simulates, so memory does not grow with the number of trials.
#[derive(Clone, Debug)]
pub struct Candidates {
    space: TuneSpace,
    rng: WorkloadRng,
    first: bool,
}

impl Candidates {
    /// The candidates of `seed` over `space`.
    pub fn new(space: &TuneSpace, seed: u64) -> Self {
        Candidates {
            space: *space,
            rng: WorkloadRng::new(seed ^ 0x7E57_7E57),
            first: true,
        }
    }
}

impl Iterator for Candidates {
    type Item = KvWeights;

    fn next(&mut self) -> Option<KvWeights> {
        if std::mem::take(&mut self.first) {
            return Some(KvWeights::default());
        }
        let (space, rng) = (&self.space, &mut self.rng);
        let log_uniform =
            |(lo, hi): (f64, f64), rng: &mut WorkloadRng| (lo.ln() + rng.unit_f64() * (hi.ln() - lo.ln())).exp();
        Some(KvWeights {
            overlap_score_credit: log_uniform(space.overlap_score_credit, rng),
            prefill_load_scale: log_uniform(space.prefill_load_scale, rng),
            decode_active_request_weight: if rng.unit_f64() < 0.5 {
                0.0
            } else {
                log_uniform(space.decode_active_request_weight, rng)
            },
            router_temperature: if rng.unit_f64() < 0.5 {
                0.0
            } else {
                let (lo, hi) = space.router_temperature;
                lo + rng.unit_f64() * (hi - lo)
            },
            switch_margin: if rng.unit_f64() < 1.0 / 3.0 {
                0.0
            } else {
                log_uniform(space.switch_margin, rng)
            },
            switch_margin_relative: if rng.unit_f64() < 1.0 / 3.0 {
                0.0
            } else {
                log_uniform(space.switch_margin_relative, rng)
            },
            max_dwell: {
                let (lo, hi) = space.max_dwell;
                log_uniform((f64::from(lo.max(1)), f64::from(hi.max(lo).max(1))), rng).round() as u32
            },
        })
    }
}

/// The score of `report` against the default weights' `baseline` on the
/// same requests (module docs).
pub fn score(report: &PolicyReport, baseline: &PolicyReport) -> f64 {
    if report.failed > baseline.failed {
        return f64::INFINITY;
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { a + 1.0 };
    let s = ratio(report.ttft_p99_ms, baseline.ttft_p99_ms) + ratio(1.0 - report.hit_rate, 1.0 - baseline.hit_rate);
    if s.is_finite() {
        s
    } else {
        f64::INFINITY
    }
}

/// The trials [`tune`] returns: the best this many (and the defaults'
/// trial when it is not among them).
pub const KEPT_TRIALS: usize = 16;

/// Simulates `trials` candidates ([`Candidates`] of `seed`) on `workload`
/// over `threads` threads; returns the best [`KEPT_TRIALS`] of them, best
/// first (ties in candidate order), and the defaults' trial after them when
/// it is not among them. `progress` gets the number of candidates done.
///
/// The defaults run first (every score is against them); the other
/// candidates are drawn as threads take them and dropped once scored, so
/// memory does not grow with `trials`. The first error stops the search.
#[allow(clippy::too_many_arguments)]
pub fn tune(
    registry: &WorkerSelectionPolicyRegistry,
    workload: &Workload,
    fleet: &FleetSpec,
    space: &TuneSpace,
    trials: usize,
    seed: u64,
    threads: usize,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<Vec<Trial>, SimError> {
    // Checked before the bounds, which walk every worker of the fleet.
    fleet.validate()?;
    let bounds = HitBounds::of(workload, fleet);
    let run = |w: &KvWeights| {
        run_policy_within(
            registry,
            &w.choice("candidate"),
            workload,
            fleet,
            &bounds,
            seed,
            &mut |_| {},
        )
        .map(|r| {
            let mut report = r.report;
            report.ttft_sorted_ms = Vec::new();
            report
        })
    };
    let mut drawn = Candidates::new(space, seed);
    let defaults = drawn.next().unwrap_or_default();
    let baseline = run(&defaults)?;
    progress(1);
    let default_trial = Trial {
        score: score(&baseline, &baseline),
        is_default: true,
        weights: defaults,
        report: baseline.clone(),
    };
    // (candidate index, trial), best first; the next index to draw.
    let best = Mutex::new(vec![(0usize, default_trial.clone())]);
    let source = Mutex::new((drawn, 1usize));
    let failed: Mutex<Option<SimError>> = Mutex::new(None);
    let done = AtomicUsize::new(1);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, trials.saturating_sub(1).max(1)) {
            scope.spawn(|| loop {
                if failed.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                    break;
                }
                let (i, weights) = {
                    let mut s = source.lock().unwrap_or_else(PoisonError::into_inner);
                    if s.1 >= trials {
                        break;
                    }
                    let i = s.1;
                    s.1 += 1;
                    match s.0.next() {
                        Some(w) => (i, w),
                        None => break,
                    }
                };
                match run(&weights) {
                    Ok(report) => {
                        let trial = Trial {
                            score: score(&report, &baseline),
                            is_default: false,
                            weights,
                            report,
                        };
                        keep_best(&mut best.lock().unwrap_or_else(PoisonError::into_inner), i, trial);
                    }
                    Err(e) => {
                        failed.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
                        break;
                    }
                }
                progress(done.fetch_add(1, Ordering::Relaxed) + 1);
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    let best = best.into_inner().unwrap_or_else(PoisonError::into_inner);
    let has_default = best.iter().any(|(i, _)| *i == 0);
    let mut trials: Vec<Trial> = best.into_iter().map(|(_, t)| t).collect();
    if !has_default {
        trials.push(default_trial);
    }
    Ok(trials)
}

/// Adds candidate `i`'s `trial` to `best` (sorted by score, then index) if
/// it is among the [`KEPT_TRIALS`] best, keeping the defaults' trial
/// (index 0) until it falls out of them.
fn keep_best(best: &mut Vec<(usize, Trial)>, i: usize, trial: Trial) {
    let at = best.partition_point(|(j, t)| t.score.total_cmp(&trial.score).then(j.cmp(&i)).is_lt());
    if at < KEPT_TRIALS {
        best.insert(at, (i, trial));
        best.truncate(KEPT_TRIALS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::scenario::{Scenario, ScenarioName};

    #[test]
    fn the_halves_split_in_time_and_the_second_starts_at_zero() {
        let w = Scenario::embedded(ScenarioName::Default).workload.generate(3);
        let (a, b) = split_in_time(&w);
        assert_eq!(a.requests.len() + b.requests.len(), w.requests.len());
        assert_eq!(a.requests[..], w.requests[..a.requests.len()]);
        assert_eq!(b.requests[0].arrival_ms, 0.0);
        assert_eq!(b.requests[0].hash_ids, w.requests[a.requests.len()].hash_ids);
    }

    #[test]
    fn candidates_start_with_the_defaults_and_stay_in_the_space() {
        let space = TuneSpace::default();
        let c = candidates(&space, 200, 9);
        assert_eq!(c, candidates(&space, 200, 9), "seeded");
        assert_eq!(c[0], KvWeights::default());
        let inside = |v: f64, (lo, hi): (f64, f64)| (lo * 0.999..=hi * 1.001).contains(&v);
        for w in &c[1..] {
            assert!(inside(w.overlap_score_credit, space.overlap_score_credit), "{w:?}");
            assert!(inside(w.prefill_load_scale, space.prefill_load_scale), "{w:?}");
            assert!(
                w.decode_active_request_weight == 0.0
                    || inside(w.decode_active_request_weight, space.decode_active_request_weight)
            );
            assert!(w.router_temperature == 0.0 || inside(w.router_temperature, space.router_temperature));
            assert!(
                w.switch_margin == 0.0 || inside(w.switch_margin, space.switch_margin),
                "{w:?}"
            );
            assert!(
                w.switch_margin_relative == 0.0 || inside(w.switch_margin_relative, space.switch_margin_relative),
                "{w:?}"
            );
            assert!((space.max_dwell.0..=space.max_dwell.1).contains(&w.max_dwell), "{w:?}");
        }
        assert!(
            c.iter().filter(|w| w.switch_margin > 0.0).count() > 100,
            "margins are searched"
        );
        assert!(c.iter().filter(|w| w.router_temperature == 0.0).count() > 50);
    }

    #[test]
    fn scores_weigh_tail_latency_and_misses_against_the_default() {
        let mut base = crate::sim::metrics::tests_support::report("kv", 0.5, 0);
        base.ttft_p99_ms = 100.0;
        assert_eq!(score(&base, &base), 2.0);
        let mut better = base.clone();
        (better.ttft_p99_ms, better.hit_rate) = (50.0, 0.75);
        assert_eq!(score(&better, &base), 1.0);
        let mut refusing = better.clone();
        refusing.failed = 1;
        assert_eq!(score(&refusing, &base), f64::INFINITY);
    }

    /// The written config file builds the same policy through the config
    /// path.
    #[test]
    fn the_written_config_states_its_block_size() {
        let w = KvWeights {
            switch_margin: 230.27,
            decode_active_request_weight: 2.0,
            ..KvWeights::default()
        };
        let yaml = w.config_yaml("tuned", 512);
        assert!(yaml.contains("\nblock_size: 512\n"), "{yaml}");
        let config = crate::WorkerSelectionConfig::from_yaml_str(&yaml).unwrap();
        assert_eq!(config.block_size(), Some(512));
        // Simulated (or routed) at 16 tokens a block: the same tokens.
        let dir = std::env::temp_dir().join(format!("selkie-tune-bs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tuned.yaml");
        std::fs::write(&path, &yaml).unwrap();
        let at_16 = PolicyChoice::from_config(&path, 16).unwrap();
        let kv: KvRouterConfig = at_16[0].parameters.deserialize().unwrap();
        assert_eq!(
            (kv.switch_margin, kv.decode_active_request_weight),
            (230.27 * 32.0, 64.0)
        );
        let at_512 = PolicyChoice::from_config(&path, 512).unwrap();
        assert_eq!(at_512[0].parameters, w.parameters());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_winner_is_written_as_a_config_the_simulator_reads() {
        let w = KvWeights {
            overlap_score_credit: 2.5,
            prefill_load_scale: 0.75,
            decode_active_request_weight: 4.0,
            router_temperature: 0.125,
            switch_margin: 12.5,
            switch_margin_relative: 0.25,
            max_dwell: 7,
        };
        let dir = std::env::temp_dir().join(format!("selkie-tune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tuned.yaml");
        std::fs::write(&path, w.config_yaml("tuned", 16)).unwrap();
        let choices = PolicyChoice::from_config(&path, 16).unwrap();
        assert_eq!(choices.len(), 1);
        assert_eq!(choices[0].label, "config:tuned");
        assert_eq!(choices[0].parameters, w.parameters());
        choices[0].validate(&WorkerSelectionPolicyRegistry::new()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
