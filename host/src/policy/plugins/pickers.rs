//! Built-in pickers: [`ArgminPicker`], [`SoftmaxPicker`] and
//! [`PowerOfTwoPicker`], over the summed costs of a policy's scorers.
//!
//! # Randomness
//!
//! Each picker draws from the kernel's [`Rng`](selkie_kernel::Rng), seeded
//! per pick from the picker's seed and a per-picker pick counter (one
//! relaxed `fetch_add` on a cache-padded atomic): pick `n` of a picker with
//! seed `s` always draws the same numbers, so a single-threaded run with a
//! seed replays exactly, and threads sharing a picker never share a
//! generator. A preview ([`WorkerSelectionContext::is_preview`]) reads the
//! counter without advancing it. Without a seed, one is taken from the clock
//! when the picker is built.
//!
//! Pickers must not compute costs: they read the view's totals.

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use selkie_kernel::rng::mix;
use selkie_kernel::Rng;
use serde::{Deserialize, Serialize};

use crate::error::{WorkerSelectionPolicyError, WorkerSelectionPolicyProviderError};
use crate::plugin::{WorkerInputView, WorkerPicker, WorkerSelectionContext};
use crate::KvConfigField;

type R<T> = Result<T, WorkerSelectionPolicyError>;

/// A picker's random source (see the module docs).
#[derive(Debug)]
struct PickRng {
    seed: u64,
    picks: CachePadded<AtomicU64>,
}

impl PickRng {
    fn new(seed: Option<u64>) -> Self {
        static BUILT: AtomicU64 = AtomicU64::new(0);
        let seed = seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            mix(t ^ BUILT.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed))
        });
        PickRng {
            seed,
            picks: CachePadded::new(AtomicU64::new(0)),
        }
    }

    fn rng(&self, ctx: &WorkerSelectionContext<'_>) -> Rng {
        let n = if ctx.is_preview() {
            self.picks.load(Ordering::Relaxed)
        } else {
            self.picks.fetch_add(1, Ordering::Relaxed)
        };
        Rng::new(mix(self.seed ^ mix(n.wrapping_add(0x9E37_79B9_7F4A_7C15))))
    }
}

fn empty() -> WorkerSelectionPolicyError {
    WorkerSelectionPolicyError::failed("no candidates to pick from")
}

/// The candidate of least cost, ties uniformly at random (one
/// `below(ties)` draw).
fn argmin(costs: &[f64], rng: &mut Rng) -> R<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let ties = costs.iter().filter(|&&c| c == min).count();
    if ties == 0 {
        return Err(empty());
    }
    let k = rng.below(ties as u64) as usize;
    costs
        .iter()
        .enumerate()
        .filter(|&(_, &c)| c == min)
        .nth(k)
        .map(|(i, _)| i)
        .ok_or_else(empty)
}

/// Parameters of [`ArgminPicker`] (picker type `argmin`) and
/// [`PowerOfTwoPicker`] (picker type `power-of-two`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SeedParameters {
    /// Seed of the picker's draws (default: from the clock).
    pub seed: Option<u64>,
}

/// The candidate of least total cost; ties uniformly at random.
///
/// ```
/// use selkie::*;
/// let policy = WorkerSelectionPolicy::new(
///     KvRouterConfig::default(),
///     WorkerType::Aggregated,
///     vec![Box::new(DecodeScorer::new(DecodeParameters::default())?)],
///     Box::new(ArgminPicker::new(SeedParameters { seed: Some(7) })),
/// );
/// let service = WorkerSelectionService::new(policy, ServiceConfig::default());
/// service.add_worker(WorkerRecord::new(1))?;
/// service.add_worker(WorkerRecord::new(2))?;
/// let first = service.select(&SelectionRequest::new(64))?;
/// // The first one now holds the first request's decode blocks.
/// assert_ne!(service.select(&SelectionRequest::new(64))?.worker(), first.worker());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ArgminPicker {
    rng: PickRng,
}

impl ArgminPicker {
    /// The picker (see the module docs on the seed).
    pub fn new(parameters: SeedParameters) -> Self {
        ArgminPicker {
            rng: PickRng::new(parameters.seed),
        }
    }
}

impl WorkerPicker for ArgminPicker {
    fn name(&self) -> &'static str {
        "argmin"
    }
    fn pick(&self, ctx: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) -> R<usize> {
        argmin(input.costs(), &mut self.rng.rng(ctx))
    }
}

/// Parameters of [`SoftmaxPicker`] (picker type `softmax`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SoftmaxParameters {
    /// `T`, finite and at least 0 (the KV configuration's
    /// `router_temperature` bounds; default 0: argmin).
    pub temperature: f64,
    /// Seed of the picker's draws (default: from the clock).
    pub seed: Option<u64>,
}

/// Softmax sampling with Dynamo's normalisation: candidate `i` with
/// probability proportional to `exp(-(c_i - c_min) / ((c_max - c_min) *
/// T))`, every candidate alike when all costs are equal, and the argmin
/// (ties at random) at `T = 0`. A request's router temperature override
/// replaces `T`.
///
/// One draw per pick: `u` uniform in `[0, 1)`, and the first candidate whose
/// cumulative weight reaches `u` times the total.
///
/// ```
/// use selkie::*;
/// let picker = SoftmaxPicker::new(SoftmaxParameters { temperature: 0.5, seed: Some(1) })?;
/// assert_eq!(picker.probabilities(&[1.0, 2.0, 3.0], 0.0), vec![1.0, 0.0, 0.0]);
/// let p = picker.probabilities(&[1.0, 2.0, 3.0], 0.5);
/// assert!((p[0] / p[1] - std::f64::consts::E).abs() < 1e-12); // exp(-(1-1)/(2*0.5)) / exp(-(2-1)/(2*0.5))
/// let err = SoftmaxPicker::new(SoftmaxParameters { temperature: -1.0, seed: None }).unwrap_err();
/// assert_eq!(err.to_string(), "router_temperature must be at least 0, got -1");
/// # Ok::<(), WorkerSelectionPolicyProviderError>(())
/// ```
#[derive(Debug)]
pub struct SoftmaxPicker {
    temperature: f64,
    rng: PickRng,
}

impl SoftmaxPicker {
    /// The picker, if the temperature is within the KV configuration's
    /// bounds for `router_temperature`.
    pub fn new(parameters: SoftmaxParameters) -> Result<Self, WorkerSelectionPolicyProviderError> {
        let value = parameters.temperature;
        KvConfigField::RouterTemperature
            .check(value)
            .map_err(|source| WorkerSelectionPolicyProviderError::KvWeight { value, source })?;
        Ok(Self::checked(parameters))
    }

    /// The picker, for parameters [`new`](Self::new) accepted.
    pub(crate) fn checked(parameters: SoftmaxParameters) -> Self {
        SoftmaxPicker {
            temperature: parameters.temperature,
            rng: PickRng::new(parameters.seed),
        }
    }

    /// The probability of each candidate at `temperature` (for finite
    /// costs): what a pick samples from. At `T = 0` the cheapest share 1
    /// equally.
    pub fn probabilities(&self, costs: &[f64], temperature: f64) -> Vec<f64> {
        let w = weights(costs, temperature);
        let total: f64 = w.iter().sum();
        w.into_iter().map(|x| x / total).collect()
    }
}

/// The least and the largest cost.
fn range(costs: &[f64]) -> (f64, f64) {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

/// The unnormalised weight of cost `c` in Dynamo's softmax over costs
/// ranging over `min..=max` at temperature `t` (see [`SoftmaxPicker`]).
fn weight(c: f64, (min, max): (f64, f64), t: f64) -> f64 {
    if t == 0.0 {
        f64::from(u8::from(c == min))
    } else if min == max {
        1.0
    } else {
        (-(c - min) / ((max - min) * t)).exp()
    }
}

/// The unnormalised weights of every cost.
fn weights(costs: &[f64], t: f64) -> Vec<f64> {
    let r = range(costs);
    costs.iter().map(|&c| weight(c, r, t)).collect()
}

impl WorkerPicker for SoftmaxPicker {
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn pick(&self, ctx: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) -> R<usize> {
        let t = ctx.router_temperature_override().unwrap_or(self.temperature);
        if !(t.is_finite() && t >= 0.0) {
            return Err(WorkerSelectionPolicyError::failed(format!(
                "softmax temperature must be finite and at least 0, got {t}"
            )));
        }
        let costs = input.costs();
        let mut rng = self.rng.rng(ctx);
        if t == 0.0 {
            return argmin(costs, &mut rng);
        }
        if costs.is_empty() {
            return Err(empty());
        }
        let r = range(costs);
        let total: f64 = costs.iter().map(|&c| weight(c, r, t)).sum();
        let target = rng.unit_f64() * total;
        let mut cumulative = 0.0;
        for (i, &c) in costs.iter().enumerate() {
            cumulative += weight(c, r, t);
            if target <= cumulative {
                return Ok(i);
            }
        }
        Ok(costs.len() - 1)
    }
}

/// Power of two choices on cost: two distinct candidates drawn uniformly
/// at random, the cheaper wins (the first drawn on a tie). A single
/// candidate is picked without a draw.
///
/// ```
/// use selkie::*;
/// let picker = PowerOfTwoPicker::new(SeedParameters { seed: Some(3) });
/// assert_eq!(picker.name(), "power-of-two");
/// ```
#[derive(Debug)]
pub struct PowerOfTwoPicker {
    rng: PickRng,
}

impl PowerOfTwoPicker {
    /// The picker (see the module docs on the seed).
    pub fn new(parameters: SeedParameters) -> Self {
        PowerOfTwoPicker {
            rng: PickRng::new(parameters.seed),
        }
    }
}

impl WorkerPicker for PowerOfTwoPicker {
    fn name(&self) -> &'static str {
        "power-of-two"
    }
    fn pick(&self, ctx: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) -> R<usize> {
        let costs = input.costs();
        let n = costs.len() as u64;
        match n {
            0 => Err(empty()),
            1 => Ok(0),
            _ => {
                let mut rng = self.rng.rng(ctx);
                let a = rng.below(n) as usize;
                let mut b = rng.below(n - 1) as usize;
                if b >= a {
                    b += 1;
                }
                Ok(if costs[b] < costs[a] { b } else { a })
            }
        }
    }
}
