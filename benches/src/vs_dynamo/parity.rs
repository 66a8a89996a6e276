//! The parity check the side-by-side benchmark runs before it times
//! anything, on every [`Scenario`] it times (Dynamo's fixture and the random
//! fleets), and that `tests/dynamo_parity.rs` runs on its own:
//!
//! 1. every worker's selkie cost equals Dynamo's exact `f64` cost within
//!    [`REL_TOLERANCE`] relative;
//! 2. at temperature 0, Dynamo's choice and selkie's choice both have
//!    Dynamo's minimum cost (and the cost Dynamo logs for its choice is that
//!    minimum);
//! 3. at temperature 0.7, both samplers match the softmax distribution that
//!    Dynamo's sampler defines over its costs: over `samples` picks each, the mean
//!    Dynamo cost of the picked workers is within [`SIGMAS`] standard errors
//!    of its exact expectation.
//!
//! selkie is checked three times: its kernel path reading its load columns
//! from each [`LoadSource`] (a kernel `Fleet`, plain slices), and its public
//! service ([`ServiceFixture`], the request built by
//! [`kv_request`](super::kv_request)).
//!
//! This module must not time anything.

use std::fmt;

use super::{Case, Drivers, DynamoFixture, LoadSource, OverlapForm, Scenario, SelkieFixture, ServiceFixture};

/// Largest accepted `|selkie - dynamo| / |dynamo|` per worker.
pub const REL_TOLERANCE: f64 = 1e-6;
/// How many standard errors a sampler's mean cost may stray from the exact
/// expectation (a false alarm is a 1-in-10^8 event).
pub const SIGMAS: f64 = 6.0;
/// The temperature the sampling check uses.
pub const SAMPLING_TEMPERATURE: f64 = 0.7;

/// How parity reports name selkie's public service, overlaps as row columns.
pub const SERVICE: &str = "selkie/service";
/// How parity reports name selkie's public service, overlaps keyed by worker.
pub const SERVICE_KEYED: &str = "selkie/service (worker-keyed)";

/// How parity reports name the service with overlaps in `form`.
pub fn service_name(form: OverlapForm) -> &'static str {
    match form {
        OverlapForm::Rows => SERVICE,
        OverlapForm::Keyed => SERVICE_KEYED,
    }
}

/// What the check found for one scenario.
#[derive(Clone, Debug)]
pub struct ParityReport {
    /// The scenario's case.
    pub case: Case,
    /// Workers compared.
    pub workers: usize,
    /// Largest relative cost difference over all workers and selkie paths.
    pub max_rel_error: f64,
    /// Dynamo's minimum cost.
    pub min_cost: f64,
    /// Worker Dynamo chose at temperature 0.
    pub dynamo_pick: u64,
    /// Worker selkie chose at temperature 0, per path
    /// (`"selkie/fleet"`, `"selkie/slices"`, [`SERVICE`]).
    pub selkie_picks: Vec<(&'static str, u64)>,
    /// Sampling check at [`SAMPLING_TEMPERATURE`]; `None` when skipped.
    pub sampling: Option<SamplingReport>,
}

/// The temperature-0.7 sampling check's numbers.
#[derive(Clone, Debug)]
pub struct SamplingReport {
    /// Picks per sampler.
    pub samples: usize,
    /// Exact expected Dynamo cost of a pick under Dynamo's softmax.
    pub expected: f64,
    /// Standard error of a mean over `samples` picks.
    pub standard_error: f64,
    /// Dynamo's mean picked cost.
    pub dynamo: f64,
    /// selkie's mean picked cost, per path.
    pub selkie: Vec<(&'static str, f64)>,
}

impl fmt::Display for ParityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<7} {:>6} workers: max rel err {:.1e}; T=0 min cost {}, picked by dynamo {}",
            self.case.name(),
            self.workers,
            self.max_rel_error,
            self.min_cost,
            self.dynamo_pick
        )?;
        for (who, pick) in &self.selkie_picks {
            write!(f, ", {who} {pick}")?;
        }
        if let Some(s) = &self.sampling {
            write!(
                f,
                "; T={SAMPLING_TEMPERATURE} mean picked cost over {} picks: expected {:.2} (s.e. {:.2}), dynamo {:.2}",
                s.samples, s.expected, s.standard_error, s.dynamo
            )?;
            for (who, mean) in &s.selkie {
                write!(f, ", {who} {mean:.2}")?;
            }
        }
        Ok(())
    }
}

/// A parity failure: which check, which worker, which values.
#[derive(Clone, Debug, PartialEq)]
pub enum ParityError {
    /// A worker's costs differ by more than [`REL_TOLERANCE`].
    Cost {
        /// `"selkie/fleet"`, `"selkie/slices"` or [`SERVICE`].
        who: &'static str,
        /// The worker.
        worker: u64,
        /// Dynamo's cost.
        dynamo: f64,
        /// selkie's cost.
        selkie: f32,
    },
    /// A temperature-0 pick does not have the minimum cost.
    NotMinimum {
        /// `"dynamo"`, `"selkie/fleet"`, `"selkie/slices"` or [`SERVICE`].
        who: &'static str,
        /// The picked worker.
        worker: u64,
        /// Its Dynamo cost.
        cost: f64,
        /// The minimum.
        min: f64,
    },
    /// A sampler's mean cost is off its expectation.
    Sampling {
        /// `"dynamo"`, `"selkie/fleet"`, `"selkie/slices"` or [`SERVICE`].
        who: &'static str,
        /// Observed mean cost.
        mean: f64,
        /// Exact expectation.
        expected: f64,
        /// Standard error of the mean.
        standard_error: f64,
    },
}

impl fmt::Display for ParityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParityError::Cost {
                who,
                worker,
                dynamo,
                selkie,
            } => write!(
                f,
                "worker {worker}: {who} cost {selkie} vs dynamo {dynamo} (rel err {:.2e} > {REL_TOLERANCE:e})",
                rel_error(*selkie, *dynamo)
            ),
            ParityError::NotMinimum { who, worker, cost, min } => write!(
                f,
                "{who} picked worker {worker} at T=0 with dynamo cost {cost}, minimum is {min}"
            ),
            ParityError::Sampling {
                who,
                mean,
                expected,
                standard_error,
            } => write!(
                f,
                "{who} at T={SAMPLING_TEMPERATURE}: mean picked cost {mean} vs expected {expected} \
                 ({:.1} standard errors of {standard_error})",
                (mean - expected).abs() / standard_error
            ),
        }
    }
}

impl std::error::Error for ParityError {}

/// `|selkie - dynamo| / |dynamo|`, or the absolute difference when Dynamo's
/// cost is 0.
pub fn rel_error(selkie: f32, dynamo: f64) -> f64 {
    let diff = (selkie as f64 - dynamo).abs();
    if dynamo == 0.0 {
        diff
    } else {
        diff / dynamo.abs()
    }
}

/// Dynamo's side of the check: every worker's exact cost and its
/// temperature-0 choice.
pub struct DynamoTruth {
    /// Dynamo's cost per worker id.
    pub costs: Vec<f64>,
    /// The minimum cost.
    pub min: f64,
    /// The worker Dynamo picks at temperature 0.
    pub pick: u64,
}

impl DynamoTruth {
    /// Reads every cost from Dynamo and checks its own temperature-0 pick.
    pub fn new(dynamo: &DynamoFixture, n: usize) -> Result<Self, ParityError> {
        let costs: Vec<f64> = (0..n as u32).map(|id| dynamo.cost_of(id)).collect();
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let (pick, logged) = dynamo.choose_with_cost(&DynamoFixture::selector(0.0));
        if costs[pick as usize] != min || logged != min {
            return Err(ParityError::NotMinimum {
                who: "dynamo",
                worker: pick,
                cost: logged,
                min,
            });
        }
        Ok(DynamoTruth { costs, min, pick })
    }
}

/// Checks 1 and 2 for selkie's kernel path: returns the largest relative
/// cost error and selkie's temperature-0 pick.
pub fn check_selkie(truth: &DynamoTruth, selkie: &mut SelkieFixture) -> Result<(f64, u64), ParityError> {
    let who = who(selkie.load_source());
    let max_rel_error = check_costs(truth, who, &selkie.costs())?;
    let row = selkie.select(0.0);
    let pick = check_minimum(truth, who, selkie.worker_of(row))?;
    Ok((max_rel_error, pick))
}

/// Checks 1 and 2 for selkie's public service with the overlaps in `form`:
/// returns the largest relative cost error and the service's
/// temperature-0 pick.
pub fn check_service(
    truth: &DynamoTruth,
    service: &ServiceFixture,
    form: OverlapForm,
) -> Result<(f64, u64), ParityError> {
    let who = service_name(form);
    let max_rel_error = check_costs(truth, who, &service.costs(form))?;
    let pick = check_minimum(truth, who, service.select_as(form, 0.0))?;
    Ok((max_rel_error, pick))
}

/// Check 1: every cost within [`REL_TOLERANCE`]; returns the largest error.
fn check_costs(truth: &DynamoTruth, who: &'static str, costs: &[f32]) -> Result<f64, ParityError> {
    assert_eq!(costs.len(), truth.costs.len(), "{who}: one cost per worker");
    let mut max_rel_error = 0.0f64;
    for (id, (&d, &s)) in truth.costs.iter().zip(costs).enumerate() {
        let e = rel_error(s, d);
        // NaN (a non-finite cost on either side) fails too.
        if e.is_nan() || e > REL_TOLERANCE {
            return Err(ParityError::Cost {
                who,
                worker: id as u64,
                dynamo: d,
                selkie: s,
            });
        }
        max_rel_error = max_rel_error.max(e);
    }
    Ok(max_rel_error)
}

/// Check 2: a temperature-0 pick has Dynamo's minimum cost.
fn check_minimum(truth: &DynamoTruth, who: &'static str, pick: u64) -> Result<u64, ParityError> {
    let cost = truth.costs[pick as usize];
    if cost != truth.min {
        return Err(ParityError::NotMinimum {
            who,
            worker: pick,
            cost,
            min: truth.min,
        });
    }
    Ok(pick)
}

fn who(source: LoadSource) -> &'static str {
    match source {
        LoadSource::Fleet => "selkie/fleet",
        LoadSource::Slices => "selkie/slices",
    }
}

/// Runs the check on `scenario`, against selkie's kernel path reading its
/// load from every [`LoadSource`] and against its public service;
/// `samples` picks per sampler for the temperature-0.7 check (0 skips it).
pub fn check(scenario: &Scenario, samples: usize) -> Result<ParityReport, ParityError> {
    check_drivers(scenario, &mut Drivers::new(scenario), samples)
}

/// [`check`] on drivers already built from `scenario` (the bench times the
/// same drivers afterwards).
pub fn check_drivers(scenario: &Scenario, drivers: &mut Drivers, samples: usize) -> Result<ParityReport, ParityError> {
    let n = scenario.len();
    let truth = DynamoTruth::new(&drivers.dynamo, n)?;
    let mut max_rel_error = 0.0f64;
    let mut selkie_picks = Vec::new();
    for selkie in &mut drivers.kernel {
        let (e, pick) = check_selkie(&truth, selkie)?;
        max_rel_error = max_rel_error.max(e);
        selkie_picks.push((who(selkie.load_source()), pick));
    }
    for form in OverlapForm::ALL {
        let (e, pick) = check_service(&truth, &drivers.service, form)?;
        max_rel_error = max_rel_error.max(e);
        selkie_picks.push((service_name(form), pick));
    }
    let sampling = if samples == 0 {
        None
    } else {
        Some(check_sampling(drivers, &truth.costs, samples)?)
    };
    Ok(ParityReport {
        case: scenario.case(),
        workers: n,
        max_rel_error,
        min_cost: truth.min,
        dynamo_pick: truth.pick,
        selkie_picks,
        sampling,
    })
}

/// Check 3 (see the module docs).
fn check_sampling(drivers: &mut Drivers, costs: &[f64], samples: usize) -> Result<SamplingReport, ParityError> {
    let Drivers {
        dynamo,
        kernel: selkies,
        service,
    } = drivers;
    let t = SAMPLING_TEMPERATURE;
    let lo = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weight = |c: f64| {
        if lo == hi {
            1.0
        } else {
            (-(c - lo) / ((hi - lo) * t)).exp()
        }
    };
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let expected: f64 = costs.iter().map(|&c| c * weight(c)).sum::<f64>() / total;
    let variance: f64 = costs.iter().map(|&c| (c - expected).powi(2) * weight(c)).sum::<f64>() / total;
    let standard_error = (variance / samples as f64).sqrt();
    let judge = |who: &'static str, mean: f64| {
        if (mean - expected).abs() > SIGMAS * standard_error + 1e-9 * expected.abs() {
            Err(ParityError::Sampling {
                who,
                mean,
                expected,
                standard_error,
            })
        } else {
            Ok(mean)
        }
    };

    let selector = DynamoFixture::selector(t);
    let dynamo_mean = (0..samples)
        .map(|_| costs[dynamo.select(&selector) as usize])
        .sum::<f64>()
        / samples as f64;
    let dynamo_mean = judge("dynamo", dynamo_mean)?;
    let mut selkie = Vec::new();
    for s in selkies {
        let mean = (0..samples)
            .map(|_| {
                let row = s.select(t as f32);
                costs[s.worker_of(row) as usize]
            })
            .sum::<f64>()
            / samples as f64;
        let who = who(s.load_source());
        selkie.push((who, judge(who, mean)?));
    }
    let mean = (0..samples)
        .map(|_| costs[service.select(t as f32) as usize])
        .sum::<f64>()
        / samples as f64;
    selkie.push((SERVICE, judge(SERVICE, mean)?));
    Ok(SamplingReport {
        samples,
        expected,
        standard_error,
        dynamo: dynamo_mean,
        selkie,
    })
}
