//! Why a worker was chosen: [`Explanation`] (see its docs), its cost's
//! [`CostTerms`], and what a booking keeps of it ([`Why`], [`TermsLog`]).

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
    /// A composed policy's picker (its name: [`Explanation::picker`]).
    Picker,
    /// Prefix hashing: the eligible row under the load bound that ranks
    /// first for the request's prefix key.
    PrefixHash,
    /// Prefix hashing, for a request without a prefix key (no prompt
    /// blocks, no explicit key): least-loaded.
    PrefixHashUnkeyed,
}

impl Branch {
    /// Lowercase name for logs (a composed policy's picker is named by
    /// [`Explanation::via`]).
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
            Branch::Picker => "picker",
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

/// Why a worker was chosen: `Copy`, printable.
///
/// Every selection carries one. The chosen cost and the branch are always
/// filled; the runner-up (and so the margin) and the chosen row's and the
/// runner-up's cost split into its terms ([`CostTerms`]: the KV formula's
/// prefill, cache credit, decode and preferred-taint terms, or a composed
/// policy's scorers) only when the request asked for them
/// ([`crate::SelectionRequest::explained`]) or for a
/// [`peek`](crate::WorkerSelectionService::peek), because they cost one more
/// pass over the rows (and for the KV policy, the terms of the two rows
/// worked out again in `f64`). A plain selection computes none of it. A
/// booking keeps its runner-up; the service keeps the terms of its last
/// [`TERMS_KEPT`](Self::TERMS_KEPT) explained selections (a booking's
/// explanation built after that many more explained selections of the same
/// service has its runner-up but no terms), so a booking carries no
/// allocation for them. A peek allocates
/// nothing. [`costs`](crate::WorkerSelectionService::costs) and
/// [`cost_terms`](crate::WorkerSelectionService::cost_terms) give every
/// eligible row's cost and terms, for debugging.
///
/// An explanation names the policy ([`WorkerSelectionPolicy::name`]: a
/// built-in's type name, or a composed policy's name, given or derived from
/// its parts) and the path that chose ([`via`](Self::via): the branch, or
/// the name of the composed policy's picker).
///
/// ```
/// use selkie::*;
/// let policy = WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated);
/// let service = WorkerSelectionService::new(policy, ServiceConfig::default());
/// service.add_worker(WorkerRecord::new(1))?;
/// service.add_worker(WorkerRecord::new(2))?;
/// // Worker 2 holds 12 of the prompt's 16 blocks of 16 tokens.
/// let overlaps = [WorkerOverlap::device(WorkerWithDpRank::new(2, 0), 12, 16)];
/// let request = SelectionRequest::new(256).with_overlaps(&overlaps).explained();
/// let e = service.select(&request)?.explanation();
/// // The decode term counts the blocks the request itself adds: its prompt's 16.
/// assert_eq!(
///     e.to_string(),
///     "kv chose 2/dp0 via kv-minimum (Policy) at cost 20.0000 \
///      (prefill 16.0000 + cache-credit -12.0000 + decode 16.0000) among 2 candidates; \
///      runner-up 1/dp0 at 32.0000 (prefill 16.0000 + cache-credit 0.0000 + decode 16.0000), \
///      margin 12.0000"
/// );
/// let terms = e.terms.expect("an explained selection has its terms");
/// assert_eq!(terms.get("cache-credit"), Some(-12.0));
/// assert_eq!(terms.sum(), e.cost);
/// // A plain selection: the cost and branch only.
/// let plain = service.select(&SelectionRequest::new(256).with_overlaps(&overlaps))?;
/// assert_eq!((plain.explanation().terms, plain.explanation().runner_up), (None, None));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`WorkerSelectionPolicy::name`]: crate::WorkerSelectionPolicy::name
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Explanation {
    /// The policy's name ([`WorkerSelectionPolicy::name`](crate::WorkerSelectionPolicy::name)).
    pub policy: &'static str,
    /// How the request reached the policy.
    pub route: Route,
    /// The branch that chose the row.
    pub branch: Branch,
    /// The picker that chose, for a composed policy ([`Branch::Picker`]):
    /// its [`WorkerPicker::name`](crate::WorkerPicker::name).
    pub picker: Option<&'static str>,
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
    /// [`cost`](Self::cost) split into its terms, when computed (an
    /// explained choice of the KV policy or of a composed one; for a
    /// booking, while its service keeps them: see [the type](Self)).
    pub terms: Option<CostTerms>,
    /// The runner-up's cost split into its terms, when computed.
    pub runner_up_terms: Option<CostTerms>,
}

/// A cost split into the terms it is the sum of, in order, by name: for
/// the `kv` policy the formula's `prefill` (the prompt's and the rank's
/// prefill blocks, scaled), `cache-credit` (the credit as it counts, at
/// most 0: the formula clamps the prefill blocks net of it at 0), `decode`
/// (decode blocks and the per-request weight) and, for a request with
/// preferred taints, `preferred-taints` (what the multiplier adds); for a
/// composed policy each scorer's contribution, by
/// [`WorkerScorer::name`](crate::WorkerScorer::name) (two scorers of one
/// name give two terms).
///
/// At most [`CAPACITY`](Self::CAPACITY) terms: a composed policy with more
/// scorers has its last terms summed into one named `other`, so the terms
/// still sum to the cost.
///
/// The KV policy's terms are worked out in `f64` from the inputs its `f32`
/// cost was computed from, so they sum to the cost within that cost's
/// rounding (about `1.2e-6` of the terms' absolute sum); with other
/// selections booking at the same time, a rank's load may have moved
/// between the cost and its terms. A composed policy's are the
/// contributions its scorers returned, summed in order as the cost was.
///
/// ```
/// use selkie::*;
/// let policy = WorkerSelectionPolicy::new(
///     KvRouterConfig::default(),
///     WorkerType::Aggregated,
///     vec![
///         Box::new(PrefillScorer::new(PrefillParameters::default())?),
///         Box::new(DecodeScorer::new(DecodeParameters::default())?),
///     ],
///     Box::new(ArgminPicker::new(SeedParameters { seed: Some(1) })),
/// );
/// let service = WorkerSelectionService::new(policy, ServiceConfig::default());
/// service.add_worker(WorkerRecord::new(1))?;
/// let e = service.peek(&SelectionRequest::new(64))?.explanation;
/// let terms = e.terms.expect("a peek is explained");
/// // 64 tokens: 4 blocks to prefill, 4 blocks the request adds to decode.
/// assert_eq!(terms.iter().collect::<Vec<_>>(), [("prefill", 4.0), ("decode", 4.0)]);
/// assert_eq!(terms.to_string(), "prefill 4.0000 + decode 4.0000");
/// assert_eq!(terms.sum(), e.cost);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, PartialEq)]
pub struct CostTerms {
    len: u8,
    terms: [(&'static str, f64); CostTerms::CAPACITY],
}

impl CostTerms {
    /// The most terms kept.
    pub const CAPACITY: usize = 8;

    /// The name of the term that sums a composed policy's terms past
    /// [`CAPACITY`](Self::CAPACITY) - 1.
    pub const OTHER: &'static str = "other";

    /// No terms.
    pub(crate) const fn new() -> Self {
        CostTerms {
            len: 0,
            terms: [("", 0.0); CostTerms::CAPACITY],
        }
    }

    /// Adds a term; past the capacity, into the last one, renamed
    /// [`OTHER`](Self::OTHER).
    pub(crate) fn push(&mut self, name: &'static str, value: f64) {
        let len = usize::from(self.len);
        if len < Self::CAPACITY {
            self.terms[len] = (name, value);
            self.len += 1;
        } else {
            let last = &mut self.terms[Self::CAPACITY - 1];
            *last = (Self::OTHER, last.1 + value);
        }
    }

    /// The terms, in order.
    pub fn as_slice(&self) -> &[(&'static str, f64)] {
        &self.terms[..usize::from(self.len)]
    }

    /// The terms, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&'static str, f64)> + '_ {
        self.as_slice().iter().copied()
    }

    /// The first term named `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// How many terms.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// No terms (a composed policy without scorers).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The terms' sum, in order: the cost (see [the type](Self) on rounding).
    pub fn sum(&self) -> f64 {
        self.iter().fold(0.0, |a, (_, v)| a + v)
    }
}

impl fmt::Debug for CostTerms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// `prefill 8.0000 + cache-credit -4.0000 + decode 2.0000`.
impl fmt::Display for CostTerms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, value)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(" + ")?;
            }
            // `+ 0.0`: a scorer's `-0.0` prints as 0.
            write!(f, "{name} {:.4}", value + 0.0)?;
        }
        Ok(())
    }
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
    /// An explained choice's key in its service's [`TermsLog`]; 0 for
    /// none.
    pub(crate) terms: u64,
}

/// An explained choice's cost and its runner-up's, split into terms.
pub(crate) type Terms = (CostTerms, Option<CostTerms>);

/// The cost terms of a service's last [`Explanation::TERMS_KEPT`]
/// explained selections, for their bookings' explanations: a booking keeps only a
/// key (a plain selection's is 0), so a booking carries no allocation and
/// moves no more bytes for terms it does not have.
pub(crate) struct TermsLog {
    /// The last key given, and the slots (`(key - 1) % TERMS_KEPT`), grown
    /// to `TERMS_KEPT` on use.
    slots: std::sync::Mutex<(u64, Vec<(u64, Terms)>)>,
}

impl TermsLog {
    const KEPT: usize = Explanation::TERMS_KEPT;

    pub(crate) const fn new() -> Self {
        TermsLog {
            slots: std::sync::Mutex::new((0, Vec::new())),
        }
    }

    /// Keeps `terms`, in place of the oldest once full; returns its key.
    pub(crate) fn put(&self, terms: Terms) -> u64 {
        let mut guard = self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (last, slots) = &mut *guard;
        *last += 1;
        let key = *last;
        let index = ((key - 1) % Self::KEPT as u64) as usize;
        match slots.get_mut(index) {
            Some(slot) => *slot = (key, terms),
            None => slots.push((key, terms)),
        }
        key
    }

    /// The terms kept under `key`, unless 0 or replaced since.
    pub(crate) fn get(&self, key: u64) -> Option<Terms> {
        if key == 0 {
            return None;
        }
        let guard = self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let index = ((key - 1) % Self::KEPT as u64) as usize;
        guard.1.get(index).filter(|(k, _)| *k == key).map(|(_, t)| *t)
    }
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
    /// see [`cost`](Self::cost)), with the cost's `terms` if any.
    pub(crate) fn explain(
        &self,
        policy: &crate::WorkerSelectionPolicy,
        chosen: WorkerWithDpRank,
        inv_weight: impl FnOnce() -> f32,
        terms: Option<Terms>,
    ) -> Explanation {
        Explanation {
            policy: policy.name(),
            route: self.route,
            branch: self.branch,
            picker: if self.branch == Branch::Picker {
                policy.picker_name()
            } else {
                None
            },
            chosen,
            cost: self.cost(inv_weight),
            runner_up: self.runner_up,
            candidates: self.candidates as usize,
            temperature: self.temperature,
            terms: terms.map(|(t, _)| t),
            runner_up_terms: terms.and_then(|(_, t)| t),
        }
    }
}

impl Explanation {
    /// The explained selections whose cost terms a service keeps for their
    /// bookings' explanations (see [the type](Self)): 256, about 100 KiB
    /// per service once it explains.
    pub const TERMS_KEPT: usize = 256;

    /// Runner-up cost minus chosen cost; `None` without a runner-up.
    /// Negative when the choice was not the cheapest row: softmax
    /// sampling ([`Branch::KvSoftmax`]) took a costlier one, or a switching
    /// margin kept the request on the rank holding its prefix
    /// ([`Branch::KvHeld`], at any temperature), a costlier one within the
    /// margin.
    pub fn margin(&self) -> Option<f64> {
        self.runner_up.map(|(_, c)| c - self.cost)
    }

    /// What chose the row: a composed policy's [`picker`](Self::picker),
    /// else the [`branch`](Self::branch)'s name.
    pub fn via(&self) -> &'static str {
        self.picker.unwrap_or(self.branch.as_str())
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} chose {} via {} ({:?}) at cost {:.4}",
            self.policy,
            self.chosen,
            self.via(),
            self.route,
            self.cost,
        )?;
        if let Some(t) = &self.terms {
            write!(f, " ({t})")?;
        }
        write!(f, " among {} candidates", self.candidates)?;
        if self.temperature > 0.0 {
            write!(f, ", temperature {}", self.temperature)?;
        }
        if let (Some((w, c)), Some(m)) = (self.runner_up, self.margin()) {
            write!(f, "; runner-up {w} at {c:.4}")?;
            if let Some(t) = &self.runner_up_terms {
                write!(f, " ({t})")?;
            }
            write!(f, ", margin {m:.4}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(v: f64) -> Terms {
        let mut t = CostTerms::new();
        t.push("x", v);
        (t, None)
    }

    #[test]
    fn the_log_keeps_the_last_terms_and_forgets_older_ones() {
        let log = TermsLog::new();
        assert_eq!(log.get(0), None);
        let first = log.put(terms(1.0));
        assert_eq!(log.get(first), Some(terms(1.0)));
        let keys: Vec<u64> = (0..TermsLog::KEPT).map(|i| log.put(terms(i as f64))).collect();
        assert_eq!(log.get(first), None, "replaced by the newest");
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(log.get(k), Some(terms(i as f64)));
        }
        assert_eq!(log.get(keys[TermsLog::KEPT - 1] + 1), None, "not given yet");
        assert!(std::mem::size_of::<(u64, Terms)>() * TermsLog::KEPT <= 110 * 1024);
    }

    #[test]
    fn terms_past_the_capacity_are_summed_into_other() {
        let mut t = CostTerms::new();
        for i in 0..CostTerms::CAPACITY + 3 {
            t.push("s", i as f64);
        }
        assert_eq!(t.len(), CostTerms::CAPACITY);
        let total: f64 = (0..CostTerms::CAPACITY + 3).map(|i| i as f64).sum();
        assert_eq!(t.sum(), total);
        let last = t.as_slice()[CostTerms::CAPACITY - 1];
        assert_eq!(last, (CostTerms::OTHER, (7 + 8 + 9 + 10) as f64));
        assert_eq!(format!("{:?}", CostTerms::new()), "[]");
    }
}
