//! Worker-selection policies: [`WorkerSelectionPolicy`], the built-in modes
//! and the composition of custom filters, scorers and a picker.
//!
//! * `builtin`: random, round-robin, least-loaded, power-of-two,
//!   device-aware weighted and direct, on the kernel's SIMD kernels.
//! * `kv`: the default KV cost policy on the kernel's `kv_cost`
//!   and `pick`.
//! * `plugins`: built-in scorers and pickers (the KV cost's terms, argmin,
//!   softmax, power-of-two) on the public plugin traits.
//! * `prefix_hash`: bounded-load prefix hashing on the kernel's
//!   `rendezvous`.
//! * `composed`: custom policies, with the contract enforced (finite costs,
//!   in-range picks, caught panics).
//! * `registry`: the policy registry, which builds a policy by type name
//!   ([`WorkerSelectionPolicyRegistry`]).
//! * `scratch`: the per-thread buffers the policies fill.
//! * `names`: the names composed policies derive from their parts.
//!
//! A policy is built once per routing partition and shared by every thread
//! of the service; it holds no per-request state. A policy offers `choose`
//! and `costs`; it must not book load, and nothing here names the service:
//! the policies sit below it and above the hard filters, the plugin API,
//! discovery and the fleet.

pub(crate) mod builtin;
mod compose;
pub(crate) mod composed;
pub(crate) mod kv;
mod names;
pub(crate) mod plugins;
pub(crate) mod prefix_hash;
pub(crate) mod rank_inputs;
mod registry;
pub(crate) mod scratch;

use serde::{Deserialize, Serialize};

use selkie_kernel::kernels::kv_cost::{KvConfigField, KvCostConfig};

use crate::error::WorkerSelectionPolicyProviderError;
use crate::plugin::{WorkerFilter, WorkerInputs, WorkerPicker, WorkerScorer};
use crate::types::WorkerType;

pub use compose::{
    WorkerPickerFactory, WorkerPickerProvider, WorkerScorerFactory, WorkerScorerProvider, BUILTIN_PICKERS,
    BUILTIN_SCORERS,
};
pub use prefix_hash::{prefix_key, PrefixHashConfig};
pub(crate) use registry::FiniteValue;
pub use registry::{
    WorkerSelectionPolicyFactory, WorkerSelectionPolicyParameters, WorkerSelectionPolicyProvider,
    WorkerSelectionPolicyRegistry, BUILTIN_ALIASES, BUILTIN_POLICIES,
};

/// The KV policy's configuration, with Dynamo's names and defaults.
///
/// ```
/// let c = selkie::KvRouterConfig::default();
/// assert_eq!((c.overlap_score_credit, c.host_cache_hit_weight), (1.0, 0.75));
/// assert!(c.validate().is_ok());
/// let bad = selkie::KvRouterConfig { host_cache_hit_weight: 1.5, ..c };
/// assert_eq!(bad.validate().unwrap_err().to_string(), "host_cache_hit_weight must be at most 1, got 1.5");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvRouterConfig {
    /// Credit per device-cached block.
    pub overlap_score_credit: f64,
    /// Decay of the device credit with a worker's excess prefill load.
    pub overlap_score_credit_decay: f64,
    /// Weight of the prefill term.
    pub prefill_load_scale: f64,
    /// Cost per active request.
    pub decode_active_request_weight: f64,
    /// Credit per host-tier block.
    pub host_cache_hit_weight: f64,
    /// Credit per disk-tier block.
    pub disk_cache_hit_weight: f64,
    /// Credit per shared-cache block beyond the device overlap (in `[0, 1]`).
    pub shared_cache_multiplier: f64,
    /// Softmax temperature (0: always the minimum cost).
    pub router_temperature: f64,
    /// Switching margin, absolute, in cost units (blocks): a request stays
    /// on the eligible worker rank holding its longest cached prefix unless
    /// the cheapest rank's cost is lower by more than this and by more than
    /// [`switch_margin_relative`](Self::switch_margin_relative) of the
    /// holder's cost. This is checked before the temperature's draw: a
    /// request whose holder is within the margin (or is itself the
    /// cheapest) goes there and is not sampled. 0 with a relative margin of
    /// 0 (the default): no margin, Dynamo's decisions.
    pub switch_margin: f64,
    /// Switching margin, relative to the holder's cost (0.1: the cheapest
    /// rank must be more than 10% cheaper).
    pub switch_margin_relative: f64,
    /// Bounded dwell: the most requests in a row a rank may keep by the
    /// margin alone (not being the cheapest); the next one the margin would
    /// keep there is chosen on cost (the cheapest rank, or the temperature's
    /// draw), and the count starts again. Also restarted when the rank wins
    /// a request on its cost. Counted per fleet row: a worker that takes a
    /// freed row starts from its predecessor's count. At most
    /// [`MAX_DWELL`](Self::MAX_DWELL).
    pub max_dwell: u32,
}

impl Default for KvRouterConfig {
    /// Dynamo's defaults, from the cost model's
    /// ([`KvCostConfig::DEFAULT`](selkie_kernel::kernels::kv_cost::KvCostConfig::DEFAULT)),
    /// and no switching margin.
    fn default() -> Self {
        let d = KvCostConfig::DEFAULT;
        KvRouterConfig {
            overlap_score_credit: f64::from(d.overlap_score_credit),
            overlap_score_credit_decay: f64::from(d.overlap_score_credit_decay),
            prefill_load_scale: f64::from(d.prefill_load_scale),
            decode_active_request_weight: f64::from(d.decode_active_request_weight),
            host_cache_hit_weight: f64::from(d.host_cache_hit_weight),
            disk_cache_hit_weight: f64::from(d.disk_cache_hit_weight),
            shared_cache_multiplier: f64::from(d.shared_cache_multiplier),
            router_temperature: f64::from(d.router_temperature),
            switch_margin: 0.0,
            switch_margin_relative: 0.0,
            max_dwell: 16,
        }
    }
}

impl KvRouterConfig {
    /// The largest [`max_dwell`](Self::max_dwell).
    pub const MAX_DWELL: u32 = 1_000_000;

    /// Whether the switching margin is on (either margin above 0).
    pub fn has_switch_margin(&self) -> bool {
        self.switch_margin > 0.0 || self.switch_margin_relative > 0.0
    }

    /// The value of one of the cost model's fields.
    fn weight(&self, field: KvConfigField) -> f64 {
        match field {
            KvConfigField::OverlapScoreCredit => self.overlap_score_credit,
            KvConfigField::OverlapScoreCreditDecay => self.overlap_score_credit_decay,
            KvConfigField::PrefillLoadScale => self.prefill_load_scale,
            KvConfigField::DecodeActiveRequestWeight => self.decode_active_request_weight,
            KvConfigField::HostCacheHitWeight => self.host_cache_hit_weight,
            KvConfigField::DiskCacheHitWeight => self.disk_cache_hit_weight,
            KvConfigField::SharedCacheMultiplier => self.shared_cache_multiplier,
            KvConfigField::RouterTemperature => self.router_temperature,
        }
    }

    /// Checks the cost model's weights with the cost model's own check
    /// ([`KvConfigField::check`](selkie_kernel::kernels::kv_cost::KvConfigField::check):
    /// finite, also as an `f32`, and non-negative; the host, disk and shared
    /// weights at most 1, as Dynamo does), then the switching margins
    /// (`0 ..= f32::MAX`) and [`max_dwell`](Self::max_dwell)
    /// (`0 ..= MAX_DWELL`). The first bad field, in declaration order, is
    /// reported with its bound.
    ///
    /// ```
    /// use selkie::{KvRouterConfig, WorkerSelectionPolicyProviderError as E};
    /// use selkie::{KvConfigField, KvConfigProblem};
    /// let c = KvRouterConfig { overlap_score_credit: 1e300, ..Default::default() };
    /// let E::KvWeight { source, .. } = c.validate().unwrap_err() else { panic!() };
    /// assert_eq!((source.field, source.problem), (KvConfigField::OverlapScoreCredit, KvConfigProblem::NotFinite));
    /// let c = KvRouterConfig { max_dwell: 2_000_000, ..Default::default() };
    /// assert_eq!(c.validate().unwrap_err().to_string(), "max_dwell must be within 0 ..= 1000000, got 2000000");
    /// ```
    pub fn validate(&self) -> Result<(), WorkerSelectionPolicyProviderError> {
        for field in KvConfigField::ALL {
            let value = self.weight(field);
            field
                .check(value)
                .map_err(|source| WorkerSelectionPolicyProviderError::KvWeight { value, source })?;
        }
        let margin_max = f64::from(f32::MAX);
        for (field, value) in [
            ("switch_margin", self.switch_margin),
            ("switch_margin_relative", self.switch_margin_relative),
        ] {
            if !(0.0..=margin_max).contains(&value) {
                return Err(WorkerSelectionPolicyProviderError::OutOfRange {
                    field,
                    value,
                    min: 0.0,
                    max: margin_max,
                });
            }
        }
        if self.max_dwell > Self::MAX_DWELL {
            return Err(WorkerSelectionPolicyProviderError::OutOfRange {
                field: "max_dwell",
                value: f64::from(self.max_dwell),
                min: 0.0,
                max: f64::from(Self::MAX_DWELL),
            });
        }
        Ok(())
    }
}

/// Parameters of the device-aware weighted policy: the kernel's
/// type, so a policy's configuration is what the kernel reads.
pub use selkie_kernel::kernels::device_aware::DeviceAwareConfig;

/// One plugin of a custom policy, with what it declared when the policy
/// was built: its inputs and its name (asked once, so a `name()` that
/// panics cannot take a selection down later).
pub(crate) struct Plugin<P: ?Sized> {
    pub(crate) inputs: WorkerInputs,
    pub(crate) name: &'static str,
    pub(crate) plugin: Box<P>,
}

impl<P: ?Sized> Plugin<P> {
    /// Asks `plugin` its name and inputs once, each under a panic guard: a
    /// name that panics reads as a placeholder, inputs that panic as every
    /// input.
    fn new(plugin: Box<P>, name: impl FnOnce(&P) -> &'static str, inputs: impl FnOnce(&P) -> WorkerInputs) -> Self {
        Plugin {
            inputs: crate::contain::contain(|| inputs(&plugin)).unwrap_or(WorkerInputs::ALL),
            name: crate::contain::contain(|| name(&plugin)).unwrap_or("<name() panicked>"),
            plugin,
        }
    }
}

pub(crate) struct Composed {
    pub(crate) filters: Vec<Plugin<dyn WorkerFilter>>,
    pub(crate) scorers: Vec<Plugin<dyn WorkerScorer>>,
    pub(crate) picker: Plugin<dyn WorkerPicker>,
    /// Union of every component's inputs: what the host materialises.
    pub(crate) inputs: WorkerInputs,
}

pub(crate) enum PolicyKind {
    Random,
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
    DeviceAware(DeviceAwareConfig),
    Direct,
    Kv(KvRouterConfig),
    PrefixHash(PrefixHashConfig),
    Composed(Composed),
}

/// How a policy takes a plain request's eligible rows when they are the
/// snapshot's ready rows (the selection's fast path): one byte to branch
/// on, where [`PolicyKind`] carries configurations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadyRows {
    /// It does not (direct needs a pin, a composed policy runs its own
    /// filters): the general path runs.
    No,
    /// Drawn from the ready list in O(1).
    Draw(ListDraw),
    /// Read as the ready mask by the policy's scan.
    Scan,
}

/// The built-in policies that draw from a list of eligible rows in O(1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ListDraw {
    Random,
    RoundRobin,
    PowerOfTwo,
}

/// Where a list draw takes its random numbers: the request's generator,
/// or none at all for a draw that takes none (round-robin's).
pub(crate) trait Draws {
    /// A row of `list` at a uniform position: [`Rng::pick`]'s.
    fn pick(&mut self, list: &[u32]) -> Option<u32>;

    /// Two rows of `list` at distinct positions: [`Rng::pick_two`]'s.
    fn pick_two(&mut self, list: &[u32]) -> Option<(u32, u32)>;
}

impl Draws for Rng {
    #[inline(always)]
    fn pick(&mut self, list: &[u32]) -> Option<u32> {
        Rng::pick(self, list)
    }

    #[inline(always)]
    fn pick_two(&mut self, list: &[u32]) -> Option<(u32, u32)> {
        Rng::pick_two(self, list)
    }
}

/// The row random, round-robin or power-of-two (`draw`) chooses for a
/// request whose eligible rows are exactly `list` (the snapshot's ready
/// rows), drawn in O(1) without a mask or the scratch, advancing the
/// round-robin cursor: the row the policy's `choose` would give for the
/// same random numbers. `None` when the draw needs the general path (see
/// `builtin::draw_from_list`).
#[cfg_attr(not(debug_assertions), inline(always))]
pub(crate) fn draw_ready(
    draw: ListDraw,
    reg: &WorkerRegistry,
    fleet: &HostFleet,
    view: &FleetView<'_, FLEET_GROUPS>,
    list: &[u32],
    rng: &mut impl Draws,
) -> Option<Drawn> {
    builtin::draw_from_list(draw, reg, fleet, view, list, true, rng)
}

/// A row drawn from a list of eligible rows ([`draw_ready`]), before its
/// booking.
#[derive(Clone, Copy)]
pub(crate) struct Drawn {
    pub(crate) row: usize,
    pub(crate) branch: Branch,
    /// The row's in-flight requests as the draw read them (power-of-two
    /// compares them); random and round-robin read none.
    pub(crate) active: Option<u32>,
    /// The rows it was drawn from.
    pub(crate) candidates: usize,
}

impl Drawn {
    /// Why it was chosen, once booked: its cost is the row's in-flight
    /// requests as the draw read them, else as the booking found them
    /// (`found`, before its own), so a draw that reads nothing costs no
    /// read of its own; the weight is applied when the explanation is
    /// built (`Why::per_weight`).
    #[inline(always)]
    pub(crate) fn why(self, found: u32) -> Why {
        Why {
            route: Route::Policy,
            branch: self.branch,
            cost: f64::from(self.active.unwrap_or(found)),
            per_weight: true,
            runner_up: None,
            candidates: self.candidates as u32,
            temperature: 0.0,
            terms: 0,
        }
    }
}

/// One worker-selection policy: a built-in mode, or custom filters, scorers
/// and a picker. Built once per routing partition; `Send + Sync`.
pub struct WorkerSelectionPolicy {
    pub(crate) kind: PolicyKind,
    pub(crate) worker_type: WorkerType,
    pub(crate) name: &'static str,
    pub(crate) config: KvRouterConfig,
    /// The KV policy's dwell counters, one per fleet row, when it has a
    /// switching margin (empty otherwise).
    pub(crate) dwell: Box<[std::sync::atomic::AtomicU32]>,
}

impl WorkerSelectionPolicy {
    /// A custom policy from additive scorers and a picker (Dynamo's
    /// `WorkerSelectionPolicy::new`). `config` is kept for the context (its
    /// temperature is the default a picker may read); `worker_type` is the
    /// pool's role.
    ///
    /// Its [`name`](Self::name), in explanations, metrics and logs, is
    /// derived from its parts' [`WorkerScorer::name`]s and
    /// [`WorkerPicker::name`]: `scorer+scorer/picker` (see
    /// [`MAX_DERIVED_NAMES`](Self::MAX_DERIVED_NAMES)); name it with
    /// [`with_name`](Self::with_name). Its explanations say which picker
    /// chose ([`Explanation::via`](crate::Explanation::via)) and, when
    /// explained, each scorer's part of the cost
    /// ([`Explanation::terms`](crate::Explanation::terms)).
    ///
    /// ```
    /// use selkie::*;
    /// let parts = || -> Result<(Vec<Box<dyn WorkerScorer>>, Box<dyn WorkerPicker>), WorkerSelectionPolicyProviderError> {
    ///     Ok((
    ///         vec![
    ///             Box::new(PrefillScorer::new(PrefillParameters::default())?),
    ///             Box::new(CacheCreditScorer::new(CacheCreditParameters::default())?),
    ///         ],
    ///         Box::new(ArgminPicker::new(SeedParameters::default())),
    ///     ))
    /// };
    /// let (scorers, picker) = parts()?;
    /// let policy = WorkerSelectionPolicy::new(KvRouterConfig::default(), WorkerType::Aggregated, scorers, picker);
    /// assert_eq!(policy.name(), "prefill+cache-credit/argmin");
    /// let (scorers, picker) = parts()?;
    /// let policy = WorkerSelectionPolicy::new(KvRouterConfig::default(), WorkerType::Aggregated, scorers, picker)
    ///     .with_name("cache-aware");
    /// let service = WorkerSelectionService::new(policy, ServiceConfig::default());
    /// service.add_worker(WorkerRecord::new(1))?;
    /// let e = service.peek(&SelectionRequest::new(64))?.explanation;
    /// assert_eq!((e.policy, e.via()), ("cache-aware", "argmin"));
    /// assert!(e.to_string().starts_with("cache-aware chose 1/dp0 via argmin (Policy) at cost 4.0000 (prefill 4.0000 + cache-credit"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(
        config: KvRouterConfig,
        worker_type: WorkerType,
        scorers: Vec<Box<dyn WorkerScorer>>,
        picker: Box<dyn WorkerPicker>,
    ) -> Self {
        Self::new_with_filters(config, worker_type, Vec::new(), scorers, picker)
    }

    /// A custom policy from ordered filters, additive scorers and a picker,
    /// named as by [`new`](Self::new) (the filters are not part of the
    /// name).
    pub fn new_with_filters(
        config: KvRouterConfig,
        worker_type: WorkerType,
        filters: Vec<Box<dyn WorkerFilter>>,
        scorers: Vec<Box<dyn WorkerScorer>>,
        picker: Box<dyn WorkerPicker>,
    ) -> Self {
        let filters: Vec<_> = filters
            .into_iter()
            .map(|f| Plugin::new(f, |p| p.name(), |p| p.required_worker_inputs()))
            .collect();
        let scorers: Vec<_> = scorers
            .into_iter()
            .map(|s| Plugin::new(s, |p| p.name(), |p| p.required_worker_inputs()))
            .collect();
        let picker = Plugin::new(picker, |p| p.name(), |p| p.required_worker_inputs());
        let inputs = filters
            .iter()
            .map(|f| f.inputs)
            .chain(scorers.iter().map(|s| s.inputs))
            .fold(picker.inputs, |a, b| a | b);
        let name = names::derived(scorers.iter().map(|s| s.name), picker.name);
        WorkerSelectionPolicy {
            kind: PolicyKind::Composed(Composed {
                filters,
                scorers,
                picker,
                inputs,
            }),
            worker_type,
            name,
            config,
            dwell: Box::default(),
        }
    }

    fn builtin(kind: PolicyKind, name: &'static str, worker_type: WorkerType) -> Self {
        WorkerSelectionPolicy {
            kind,
            worker_type,
            name,
            config: KvRouterConfig::default(),
            dwell: Box::default(),
        }
    }

    /// The default KV cost policy, with the switching margin of
    /// `config` if it has one. It reads the request's cache overlaps
    /// ([`SelectionRequest::with_row_overlaps`](crate::SelectionRequest::with_row_overlaps)
    /// from a [`KvIndex`](crate::kv_index::KvIndex), or
    /// [`with_overlaps`](crate::SelectionRequest::with_overlaps)); a
    /// request that carries block hashes and no overlaps is refused
    /// ([`SelectionError::PromptBlocksUnused`](crate::SelectionError::PromptBlocksUnused)).
    pub fn kv(config: KvRouterConfig, worker_type: WorkerType) -> Self {
        let dwell = if config.has_switch_margin() {
            (0..crate::fleet::KernelFleet::CAPACITY)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect()
        } else {
            Box::default()
        };
        WorkerSelectionPolicy {
            kind: PolicyKind::Kv(config),
            worker_type,
            name: "kv",
            config,
            dwell,
        }
    }
    /// Uniformly random over eligible rows.
    pub fn random() -> Self {
        Self::builtin(PolicyKind::Random, "random", WorkerType::Aggregated)
    }
    /// Round robin over eligible rows; `peek` does not advance the cursor.
    pub fn round_robin() -> Self {
        Self::builtin(PolicyKind::RoundRobin, "round-robin", WorkerType::Aggregated)
    }
    /// Fewest in-flight requests (per unit of capacity weight).
    pub fn least_loaded() -> Self {
        Self::builtin(PolicyKind::LeastLoaded, "least-loaded", WorkerType::Aggregated)
    }
    /// Power of two choices by in-flight requests.
    pub fn power_of_two() -> Self {
        Self::builtin(PolicyKind::PowerOfTwo, "power-of-two", WorkerType::Aggregated)
    }
    /// Device-aware weighted (CPU and accelerator workers).
    pub fn device_aware_weighted(config: DeviceAwareConfig) -> Self {
        Self::builtin(
            PolicyKind::DeviceAware(config),
            "device-aware-weighted",
            WorkerType::Aggregated,
        )
    }
    /// Bounded-load prefix hashing: requests whose prompts share their
    /// leading blocks go to the same rank while it has room (see
    /// [`PrefixHashConfig`]). Requests carry their prompt's block hashes
    /// ([`SelectionRequest::with_prompt_blocks`]) or a key
    /// ([`SelectionRequest::with_prefix_key`]); a request with neither is
    /// routed least-loaded.
    ///
    /// ```
    /// use selkie::{PrefixHashConfig, WorkerSelectionPolicy};
    /// let p = WorkerSelectionPolicy::prefix_hash(PrefixHashConfig::default()).unwrap();
    /// assert_eq!(p.name(), "prefix-hash");
    /// let bad = PrefixHashConfig { prefix_blocks: 0, ..Default::default() };
    /// let err = WorkerSelectionPolicy::prefix_hash(bad).unwrap_err();
    /// assert_eq!(err.to_string(), "prefix_blocks must be within 1 ..= 1048576, got 0");
    /// ```
    pub fn prefix_hash(config: PrefixHashConfig) -> Result<Self, WorkerSelectionPolicyProviderError> {
        config.validate()?;
        Ok(Self::builtin(
            PolicyKind::PrefixHash(config),
            "prefix-hash",
            WorkerType::Aggregated,
        ))
    }
    /// Direct routing: the request names its worker; no fallback.
    pub fn direct() -> Self {
        Self::builtin(PolicyKind::Direct, "direct", WorkerType::Aggregated)
    }

    /// Sets the role (for a built-in constructed without one).
    pub fn with_worker_type(mut self, worker_type: WorkerType) -> Self {
        self.worker_type = worker_type;
        self
    }

    /// Sets the name used in metrics, logs and explanations.
    pub fn with_name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// The most distinct names composed policies built without one derive
    /// from their parts in one process (each is kept for the life of the
    /// process, once). A composed policy that would derive one more is named
    /// `composed`, and a warning is logged.
    pub const MAX_DERIVED_NAMES: usize = 1024;

    /// The policy's name: a built-in's type name (`kv`, `least-loaded`,
    /// ...), or a composed policy's, given ([`with_name`](Self::with_name))
    /// or derived from its parts (see [`new`](Self::new)).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// A composed policy's picker's name.
    pub(crate) fn picker_name(&self) -> Option<&'static str> {
        match &self.kind {
            PolicyKind::Composed(c) => Some(c.picker.name),
            _ => None,
        }
    }

    /// The pool's role.
    pub fn worker_type(&self) -> WorkerType {
        self.worker_type
    }

    /// The KV configuration the policy was built with.
    pub fn kv_router_config(&self) -> &KvRouterConfig {
        &self.config
    }

    /// The signal groups this policy makes the host compute.
    pub fn required_worker_inputs(&self) -> WorkerInputs {
        match &self.kind {
            PolicyKind::Random | PolicyKind::RoundRobin | PolicyKind::Direct => WorkerInputs::NONE,
            PolicyKind::LeastLoaded | PolicyKind::PowerOfTwo | PolicyKind::PrefixHash(_) => WorkerInputs::OCCUPANCY,
            PolicyKind::DeviceAware(_) => WorkerInputs::OCCUPANCY | WorkerInputs::DEVICE_AWARE | WorkerInputs::CACHE,
            PolicyKind::Kv(_) => WorkerInputs::LOAD | WorkerInputs::CACHE | WorkerInputs::PREFERRED_TAINT,
            PolicyKind::Composed(c) => c.inputs,
        }
    }
}

impl std::fmt::Debug for WorkerSelectionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSelectionPolicy")
            .field("name", &self.name)
            .field("worker_type", &self.worker_type)
            .field("inputs", &self.required_worker_inputs())
            .finish()
    }
}

use crate::discovery::registry::WorkerRegistry;
use crate::error::SelectionError;
use crate::explain::{Branch, CostTerms, Route, Why};
use crate::filter::for_each_row;
use crate::fleet::{HostFleet, FLEET_GROUPS};
use crate::plugin::WorkerSelectionContext;
use crate::request::SelectionRequest;
use crate::types::WorkerWithDpRank;
use scratch::Scratch;
use selkie_kernel::fleet::FleetView;
use selkie_kernel::lanes::U32Source;
use selkie_kernel::Rng;

/// Everything a policy reads for one request.
pub(crate) struct Env<'a> {
    pub(crate) reg: &'a WorkerRegistry,
    pub(crate) fleet: &'a HostFleet,
    /// The eligible rows (at least `mask::words_for(rows)` words): the
    /// policy chooses among them.
    pub(crate) mask: &'a [u64],
    /// The eligible rows as a sorted list, when the caller has one that
    /// matches `mask` exactly (the snapshot's request-independent set):
    /// random, round-robin and power-of-two then draw in O(1).
    pub(crate) list: Option<&'a [u32]>,
    /// Every load column, over exactly `rows` rows.
    pub(crate) view: FleetView<'a, FLEET_GROUPS>,
    pub(crate) req: &'a SelectionRequest<'a>,
    pub(crate) ctx: &'a WorkerSelectionContext<'a>,
    /// Rows to scan: the registry snapshot's scan length, read once per
    /// selection (`view.rows()`, the scratch buffers and the masks all
    /// cover exactly this many).
    pub(crate) rows: usize,
    /// The hard filters pinned the request to one worker.
    pub(crate) pinned: bool,
    /// Compute the runner-up.
    pub(crate) explain: bool,
}

impl Env<'_> {
    /// The number of eligible rows: the list's length when there is one,
    /// else a count of the mask (one pass over its words).
    #[inline]
    pub(crate) fn candidates(&self) -> usize {
        match self.list {
            Some(list) => list.len(),
            None => selkie_kernel::mask::count(self.mask, self.rows),
        }
    }
}

/// What a policy chose.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub(crate) row: usize,
    pub(crate) cost: f64,
    pub(crate) runner_up: Option<(usize, f64)>,
    pub(crate) branch: Branch,
    pub(crate) candidates: usize,
    pub(crate) temperature: f64,
    /// The request's cached tokens on `row` as the policy read them from
    /// the worker-keyed overlaps it scattered into per-row columns, so the
    /// booking need not search the overlaps for the row's worker.
    pub(crate) cached_tokens: ScatteredTokens,
}

// A choice stays within a cache line (see `ScatteredTokens`).
const _: () = assert!(std::mem::size_of::<Choice>() <= 64);

/// A request's cached tokens on a chosen row, as a policy read them from
/// the worker-keyed overlaps it scattered, or [`NONE`](Self::NONE) (the
/// booking looks them up). Four bytes, in what was padding of a [`Choice`]:
/// a choice is moved about on every selection, and an `Option<u32>` made it
/// eight bytes longer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScatteredTokens(u32);

impl ScatteredTokens {
    /// Not read: the booking looks the tokens up.
    pub(crate) const NONE: Self = Self(u32::MAX);

    /// 2^24: every integer below it is exact in an `f32`.
    const F32_EXACT: f32 = 16_777_216.0;

    /// A scattered column's value: [`NONE`](Self::NONE) for a count an
    /// `f32` does not hold exactly (at or above 2^24; the booking looks it
    /// up).
    pub(crate) fn from_column(tokens: f32) -> Self {
        if tokens < Self::F32_EXACT {
            Self(tokens as u32)
        } else {
            Self::NONE
        }
    }

    /// The tokens read, if any.
    pub(crate) fn get(self) -> Option<u32> {
        (self.0 != u32::MAX).then_some(self.0)
    }
}

impl WorkerSelectionPolicy {
    /// Chooses one row among the set bits of `env.mask`.
    pub(crate) fn choose(&self, env: &Env<'_>, s: &mut Scratch, rng: &mut Rng) -> Result<Choice, SelectionError> {
        match &self.kind {
            PolicyKind::Random => builtin::random(env, s, rng),
            PolicyKind::RoundRobin => builtin::round_robin(env, s, rng),
            PolicyKind::LeastLoaded => builtin::least_loaded(env, s, rng),
            PolicyKind::PowerOfTwo => builtin::power_of_two(env, s, rng),
            PolicyKind::DeviceAware(c) => builtin::device_aware(env, s, rng, c),
            PolicyKind::Direct => builtin::direct(env, s, rng),
            PolicyKind::Kv(c) => kv::choose(env, s, rng, c, self.worker_type, &self.dwell),
            PolicyKind::PrefixHash(c) => prefix_hash::choose(env, s, rng, c),
            PolicyKind::Composed(c) => composed::choose(env, s, c),
        }
    }

    /// How the policy takes a plain request's eligible rows when they are
    /// the snapshot's ready rows (the selection's fast path).
    pub(crate) fn ready_rows(&self) -> ReadyRows {
        match self.kind {
            PolicyKind::Direct | PolicyKind::Composed(_) => ReadyRows::No,
            PolicyKind::Random => ReadyRows::Draw(ListDraw::Random),
            PolicyKind::RoundRobin => ReadyRows::Draw(ListDraw::RoundRobin),
            PolicyKind::PowerOfTwo => ReadyRows::Draw(ListDraw::PowerOfTwo),
            PolicyKind::LeastLoaded | PolicyKind::DeviceAware(_) | PolicyKind::Kv(_) | PolicyKind::PrefixHash(_) => {
                ReadyRows::Scan
            }
        }
    }

    /// Whether the policy may read a request's
    /// [`prompt_blocks`](crate::SelectionRequest::prompt_blocks): the
    /// prefix-hash policy does, a composed policy's plugins may, the others
    /// do not (a router need not hash prompts for them). The `kv` policy
    /// reads cache overlaps instead, and refuses a request that carries
    /// block hashes and no overlaps
    /// ([`SelectionError::PromptBlocksUnused`](crate::SelectionError::PromptBlocksUnused)).
    ///
    /// ```
    /// use selkie::*;
    /// assert!(!WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated).reads_prompt_blocks());
    /// assert!(WorkerSelectionPolicy::prefix_hash(PrefixHashConfig::default()).unwrap().reads_prompt_blocks());
    /// ```
    pub fn reads_prompt_blocks(&self) -> bool {
        matches!(self.kind, PolicyKind::PrefixHash(_) | PolicyKind::Composed(_))
    }

    /// Whether this is the direct policy, which needs a pinned request.
    #[inline]
    pub(crate) fn is_direct(&self) -> bool {
        matches!(self.kind, PolicyKind::Direct)
    }

    /// The cost of `choice`'s row and of its runner-up split into terms,
    /// for an explained choice (`env` and `s` as `choose` left them): the
    /// KV formula's, worked out again for the two rows; a composed policy's
    /// scorers' contributions, kept by `choose` when `env.explain`. `None`
    /// for the other policies. Out of line: only explained choices call it.
    #[cold]
    #[inline(never)]
    pub(crate) fn terms(
        &self,
        env: &Env<'_>,
        s: &mut Scratch,
        choice: &Choice,
    ) -> Option<(CostTerms, Option<CostTerms>)> {
        let runner_up = choice.runner_up.map(|(row, _)| row);
        match &self.kind {
            PolicyKind::Kv(c) => kv::terms(env, s, c, self.worker_type, choice.row, runner_up),
            PolicyKind::Composed(c) => composed::terms(s, c, choice.row, runner_up),
            _ => None,
        }
    }

    /// Appends every row of `env.mask` that the policy would consider, with
    /// its cost split into terms, to `out` (unsorted): the KV formula's
    /// terms for the KV policy, each scorer's contribution for a composed
    /// policy (after its filters; `env.explain` must be set, for the
    /// scorers' contributions to be kept); nothing for the other policies,
    /// whose cost is one number. Books nothing (the slow path of
    /// `WorkerSelectionService::cost_terms`).
    pub(crate) fn cost_terms(
        &self,
        env: &Env<'_>,
        s: &mut Scratch,
        out: &mut Vec<(WorkerWithDpRank, CostTerms)>,
    ) -> Result<(), SelectionError> {
        let reg = env.reg;
        match &self.kind {
            PolicyKind::Kv(c) => {
                for (r, t) in kv::all_terms(env, s, c, self.worker_type)? {
                    if let Some(m) = reg.row(r) {
                        out.push((m.worker(), t));
                    }
                }
            }
            PolicyKind::Composed(c) => {
                composed::score(env, s, c)?;
                for (i, cand) in s.candidates.iter().enumerate() {
                    if let Some(t) = composed::terms_at(s, c, i) {
                        out.push((cand.worker, t));
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Appends every row of `env.mask` that the policy would consider, with
    /// its cost as the policy sees it, to `out` (unsorted): the KV cost for
    /// the KV policy, the summed scorer costs for a custom policy (after its
    /// filters), in-flight requests per unit of weight for the load modes.
    /// Books nothing and advances no cursor (the slow path of
    /// `WorkerSelectionService::costs`).
    pub(crate) fn costs(
        &self,
        env: &Env<'_>,
        s: &mut Scratch,
        out: &mut Vec<(WorkerWithDpRank, f64)>,
    ) -> Result<(), SelectionError> {
        let reg = env.reg;
        match &self.kind {
            PolicyKind::Kv(c) => {
                let (_, rows, _) = kv::fill_costs(env, s, c, self.worker_type)?;
                for_each_row(env.mask, rows, |r| {
                    if let Some(m) = reg.row(r) {
                        out.push((m.worker(), f64::from(s.costs[r])));
                    }
                });
            }
            PolicyKind::Composed(c) => {
                composed::score(env, s, c)?;
                out.extend(s.candidates.iter().zip(&s.total).map(|(c, &t)| (c.worker, t)));
            }
            _ => {
                let weighted = reg.traits().weighted;
                for_each_row(env.mask, env.rows, |r| {
                    if let Some(m) = reg.row(r) {
                        let a = f64::from(env.view.active_requests().value(r));
                        let w = f64::from(m.entry.record.capacity_weight);
                        out.push((m.worker(), if weighted { a / w } else { a }));
                    }
                });
            }
        }
        Ok(())
    }
}
