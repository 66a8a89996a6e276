//! The fleet a churn run starts from, the records the churn thread moves it
//! through, the policies under test, and the test's seeded random numbers.
//!
//! Three kinds of worker:
//! * core workers (ids 1..=6) never change and have an admission limit
//!   above every booking the run can hold at once, so a request that may
//!   use a core worker always finds room: any overload error for it is a
//!   bug, not load;
//! * churned workers (ids 11..=20) are removed, re-added, drained,
//!   cordoned, re-weighted, re-ranked, marked overloaded and re-synced, with
//!   admission limits of 1 or 2 per rank, so the limits are reached;
//! * growth workers (ids 1000..) are added one by one and never removed, so
//!   the fleet's row count keeps crossing lane-group and 64-row boundaries
//!   while selections are in flight.
//!
//! This module does not select or assert.

use std::collections::BTreeMap;

use selkie::*;

/// Selector threads of a churn run.
pub const SELECTORS: usize = 16;
/// Bookings one selector holds at most.
pub const MAX_HELD: usize = 3;
/// Admission limit of every core rank: above every booking the run can hold.
pub const CORE_LIMIT: u32 = (SELECTORS * MAX_HELD) as u32 + 16;
/// Ranks of every core worker.
pub const CORE_RANKS: u32 = 2;
/// Core worker ids.
pub const CORE: std::ops::RangeInclusive<WorkerId> = 1..=6;
/// Churned worker ids.
pub const CHURNED: std::ops::RangeInclusive<WorkerId> = 11..=20;
/// First growth worker id.
pub const GROWTH_BASE: WorkerId = 1000;
/// The taint some core and some churned workers carry.
pub const TAINT: &str = "gpu";

/// The plan's stream: the kernel's SplitMix64, deterministic per seed,
/// with the plan's own draws (a remainder, so the plans stay those their
/// seeds have always made).
pub struct SplitMix(selkie_kernel::rng::SplitMix64);

impl SplitMix {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix(selkie_kernel::rng::SplitMix64::new(seed))
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// In `0..n` (`n > 0`), as the remainder of the next 64 bits.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `percent / 100`.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

pub fn is_core(id: WorkerId) -> bool {
    CORE.contains(&id)
}

/// Whether worker `id` carries [`TAINT`] (fixed per id for the whole run).
pub fn has_taint(id: WorkerId) -> bool {
    matches!(id, 1..=3) || (CHURNED.contains(&id) && id % 2 == 1)
}

pub fn core_record(id: WorkerId) -> WorkerRecord {
    let mut r = WorkerRecord::new(id)
        .with_dp(0, CORE_RANKS)
        .with_max_active_requests(CORE_LIMIT);
    if has_taint(id) {
        r = r.with_taint(TAINT);
    }
    if id >= 5 {
        r = r.with_device(DeviceKind::Cpu);
    }
    r
}

/// Admission limit per rank of a churned or growth worker (fixed per id).
pub fn churn_limit(id: WorkerId) -> u32 {
    1 + (id % 2) as u32
}

/// A churned worker with `ranks` ranks, `weight` and `state`.
pub fn churned_record(id: WorkerId, ranks: u32, weight: f32, state: WorkerState) -> WorkerRecord {
    let mut r = WorkerRecord::new(id)
        .with_dp(0, ranks)
        .with_capacity_weight(weight)
        .with_max_active_requests(churn_limit(id))
        .with_state(state);
    if has_taint(id) {
        r = r.with_taint(TAINT);
    }
    if id.is_multiple_of(4) {
        r = r.with_device(DeviceKind::Cpu);
    }
    r
}

pub fn growth_record(id: WorkerId) -> WorkerRecord {
    WorkerRecord::new(id).with_max_active_requests(churn_limit(id))
}

/// The churn thread's model of the worker table: exactly what it has told
/// the service (only the churn thread changes the table).
pub struct FleetModel {
    pub churned: BTreeMap<WorkerId, WorkerRecord>,
    pub growth: Vec<WorkerId>,
}

impl FleetModel {
    /// Every record the service holds now, core first.
    pub fn snapshot(&self) -> Vec<WorkerRecord> {
        let growth = self.growth.iter().map(|&id| growth_record(id));
        CORE.map(core_record)
            .chain(self.churned.values().cloned())
            .chain(growth)
            .collect()
    }
}

/// A random churned record for `id`: 1 to 3 ranks, a weight of 0.5 to 4,
/// mostly live.
pub fn random_churned(rng: &mut SplitMix, id: WorkerId) -> WorkerRecord {
    let state = match rng.below(6) {
        0 => WorkerState::Draining,
        1 => WorkerState::Cordoned,
        _ => WorkerState::Live,
    };
    churned_record(id, 1 + rng.below(3) as u32, 0.5 * (1 + rng.below(8)) as f32, state)
}

/// A service with the core workers and every churned worker, seeded.
pub fn service(policy: WorkerSelectionPolicy, seed: u64) -> (WorkerSelectionService, FleetModel) {
    let service = WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(seed),
            // Above the rows the run ever has live, so a request is refused
            // as overloaded only once every eligible row refused a booking.
            max_booking_attempts: 4096,
            ..ServiceConfig::default()
        },
    );
    let mut rng = SplitMix::new(seed);
    let model = FleetModel {
        churned: CHURNED.map(|id| (id, random_churned(&mut rng, id))).collect(),
        growth: Vec::new(),
    };
    for r in model.snapshot() {
        service.add_worker(r).expect("the initial fleet is valid");
    }
    (service, model)
}

/// The custom policy: one scorer (active requests) and one picker (least cost).
pub mod custom {
    use selkie::*;

    type R<T> = Result<T, WorkerSelectionPolicyError>;

    pub struct ActiveRequests;
    impl WorkerScorer for ActiveRequests {
        fn name(&self) -> &'static str {
            "active-requests"
        }
        fn required_worker_inputs(&self) -> WorkerInputs {
            WorkerInputs::LOAD
        }
        fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
            for (cost, c) in costs.iter_mut().zip(c.iter()) {
                let load = c.load().ok_or_else(|| WorkerSelectionPolicyError::failed("no LOAD"))?;
                *cost = load.active_requests() as f64;
            }
            Ok(())
        }
    }

    pub struct MinCost;
    impl WorkerPicker for MinCost {
        fn name(&self) -> &'static str {
            "min-cost"
        }
        fn pick(&self, _: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) -> R<usize> {
            let c = input.costs();
            (0..c.len())
                .min_by(|&a, &b| c[a].total_cmp(&c[b]))
                .ok_or_else(|| WorkerSelectionPolicyError::failed("no candidate"))
        }
    }
}

/// Every policy the churn and growth tests run, by the name the reports use.
pub fn policy(name: &str) -> WorkerSelectionPolicy {
    let kv = |t: f64| {
        let c = KvRouterConfig {
            router_temperature: t,
            ..KvRouterConfig::default()
        };
        WorkerSelectionPolicy::kv(c, WorkerType::Aggregated)
    };
    match name {
        "random" => WorkerSelectionPolicy::random(),
        "round-robin" => WorkerSelectionPolicy::round_robin(),
        "least-loaded" => WorkerSelectionPolicy::least_loaded(),
        "power-of-two" => WorkerSelectionPolicy::power_of_two(),
        "device-aware-weighted" => WorkerSelectionPolicy::device_aware_weighted(DeviceAwareConfig::default()),
        "kv-t0" => kv(0.0),
        "kv-t0.7" => kv(0.7),
        "custom" => WorkerSelectionPolicy::new(
            KvRouterConfig::default(),
            WorkerType::Aggregated,
            vec![Box::new(custom::ActiveRequests)],
            Box::new(custom::MinCost),
        ),
        "direct" => WorkerSelectionPolicy::direct(),
        other => panic!("no policy {other}"),
    }
}

/// Names of every policy, as [`policy`] takes them.
pub const POLICIES: [&str; 9] = [
    "random",
    "round-robin",
    "least-loaded",
    "power-of-two",
    "device-aware-weighted",
    "kv-t0",
    "kv-t0.7",
    "custom",
    "direct",
];
