//! Why a worker was chosen: [`Explanation`], small, `Copy`, printable.
//!
//! Every selection carries one. The chosen cost and the branch are always
//! filled; the runner-up (and so the margin) only when the request asked
//! for it ([`crate::SelectionRequest::explained`]) or for a
//! [`peek`](crate::WorkerSelectionService::peek), because it costs one more
//! pass over the rows.

use std::fmt;

use crate::types::WorkerWithDpRank;

/// Which path of the selection produced the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Branch {
    /// KV policy, temperature 0: the minimum cost.
    KvMinimum,
    /// KV policy, temperature > 0: softmax sampling.
    KvSoftmax,
    /// KV policy with a switching margin: the worker rank holding the
    /// request's longest cached prefix, within the margin of the cheapest
    /// (or the cheapest itself); not sampled by the temperature.
    KvHeld,
    /// Fewest in-flight requests (per unit of capacity weight).
    LeastLoaded,
    /// Data-parallel fleet: the worker with the fewest in-flight requests
    /// summed over its ranks, then its least-loaded rank.
    LeastLoadedWorkerThenRank,
    /// Power of two choices.
    PowerOfTwo,
    /// Data-parallel fleet: power of two choices among workers by summed
    /// load, then the worker's least-loaded rank.
    PowerOfTwoWorkerThenRank,
    /// Uniformly random.
    Random,
    /// Round robin.
    RoundRobin,
    /// Device-aware: a row with the required cache hits.
    DeviceAwareCacheHit,
    /// Device-aware: a CPU row (the CPU group is under its share).
    DeviceAwareCpu,
    /// Device-aware: an accelerator row.
    DeviceAwareAccelerator,
    /// Direct routing: the worker the request named.
    Direct,
    /// A custom policy's picker.
    CustomPicker,
    /// Prefix hashing: the eligible row under the load bound that ranks
    /// first for the request's prefix key.
    PrefixHash,
    /// Prefix hashing, for a request without a prefix key (no prompt
    /// blocks, no explicit key): least-loaded.
    PrefixHashUnkeyed,
}

impl Branch {
    /// Lowercase name for logs.
    pub const fn as_str(&self) -> &'static str {
        match self {
            Branch::KvMinimum => "kv-minimum",
            Branch::KvSoftmax => "kv-softmax",
            Branch::KvHeld => "kv-held",
            Branch::LeastLoaded => "least-loaded",
            Branch::LeastLoadedWorkerThenRank => "least-loaded-worker-then-rank",
            Branch::PowerOfTwo => "power-of-two",
            Branch::PowerOfTwoWorkerThenRank => "power-of-two-worker-then-rank",
            Branch::Random => "random",
            Branch::RoundRobin => "round-robin",
            Branch::DeviceAwareCacheHit => "device-aware-cache-hit",
            Branch::DeviceAwareCpu => "device-aware-cpu",
            Branch::DeviceAwareAccelerator => "device-aware-accelerator",
            Branch::Direct => "direct",
            Branch::CustomPicker => "custom-picker",
            Branch::PrefixHash => "prefix-hash",
            Branch::PrefixHashUnkeyed => "prefix-hash-unkeyed",
        }
    }
}

/// How the request reached the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// The policy chose among all eligible rows.
    Policy,
    /// The request was pinned (explicit pin or direct routing).
    Pinned,
    /// Hard session affinity pinned the request.
    SessionHard,
    /// Soft session affinity narrowed the rows to the session's worker.
    SessionSoft,
}

/// Why a worker was chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Explanation {
    /// The policy's name.
    pub policy: &'static str,
    /// How the request reached the policy.
    pub route: Route,
    /// The branch that chose the row.
    pub branch: Branch,
    /// The chosen worker rank.
    pub chosen: WorkerWithDpRank,
    /// The chosen row's cost (the KV cost, a custom policy's summed cost, or
    /// the load for the load modes: in-flight requests per unit of weight).
    /// A plain request's random, round-robin or power-of-two draw reads no
    /// load of its own: its cost is the requests its booking found there
    /// (power-of-two: those it compared), per unit of the weight the worker
    /// has when the explanation is built.
    pub cost: f64,
    /// The cheapest other eligible row and its cost, when computed.
    pub runner_up: Option<(WorkerWithDpRank, f64)>,
    /// Rows the policy chose from.
    pub candidates: usize,
    /// The temperature used (KV policy), else 0.
    pub temperature: f64,
}

/// What a booked selection keeps of its explanation: the parts that are
/// the choice's own. The policy's name and the chosen worker are the
/// service's and the booking's, so [`Explanation`] is built from these
/// only when asked for, and a booking moves fewer bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Why {
    pub(crate) route: Route,
    pub(crate) branch: Branch,
    pub(crate) cost: f64,
    /// `cost` is the chosen row's in-flight requests, still to be divided
    /// by its capacity weight (an O(1) draw's choice: the weight is read
    /// when the explanation is built, not on every selection).
    pub(crate) per_weight: bool,
    pub(crate) runner_up: Option<(WorkerWithDpRank, f64)>,
    /// At most the fleet's capacity (16,384 rows).
    pub(crate) candidates: u32,
    pub(crate) temperature: f64,
}

impl Why {
    /// The chosen row's cost, its weight's inverse read by `inv_weight`
    /// where `cost` still needs it.
    #[inline]
    pub(crate) fn cost(&self, inv_weight: impl FnOnce() -> f32) -> f64 {
        if self.per_weight {
            self.cost * f64::from(inv_weight())
        } else {
            self.cost
        }
    }

    /// The explanation of choosing `chosen` under `policy` (`inv_weight`:
    /// see [`cost`](Self::cost)).
    pub(crate) fn explain(
        &self,
        policy: &'static str,
        chosen: WorkerWithDpRank,
        inv_weight: impl FnOnce() -> f32,
    ) -> Explanation {
        Explanation {
            policy,
            route: self.route,
            branch: self.branch,
            chosen,
            cost: self.cost(inv_weight),
            runner_up: self.runner_up,
            candidates: self.candidates as usize,
            temperature: self.temperature,
        }
    }
}

impl Explanation {
    /// Runner-up cost minus chosen cost; `None` without a runner-up.
    /// Negative when the choice was not the cheapest row: softmax
    /// sampling ([`Branch::KvSoftmax`]) took a costlier one, or a switching
    /// margin kept the request on the rank holding its prefix
    /// ([`Branch::KvHeld`], at any temperature), a costlier one within the
    /// margin.
    pub fn margin(&self) -> Option<f64> {
        self.runner_up.map(|(_, c)| c - self.cost)
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} chose {} via {} ({:?}) at cost {:.4} among {} candidates",
            self.policy,
            self.chosen,
            self.branch.as_str(),
            self.route,
            self.cost,
            self.candidates
        )?;
        if self.temperature > 0.0 {
            write!(f, ", temperature {}", self.temperature)?;
        }
        match (self.runner_up, self.margin()) {
            (Some((w, c)), Some(m)) => write!(f, "; runner-up {w} at {c:.4}, margin {m:.4}"),
            _ => Ok(()),
        }
    }
}
