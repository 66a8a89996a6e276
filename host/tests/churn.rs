//! Churn stress (issue 11): every policy selecting from 16 threads while
//! one thread churns the worker table, one samples worker status, and a
//! growth run that adds 4,096 workers (1,024 in debug) under 8 fresh threads.
//!
//! Checks, per policy: no call panics (panics are caught, counted and
//! reported with their message); every error is one churn explains (see
//! [`legit`]: a request that may use a core worker, which always has room,
//! must never fail); no rank ever holds more requests than its admission
//! limit; at each quiescent checkpoint no rank holds more requests than
//! the live bookings that report it (a booking that landed on another
//! worker than it reports shows here), and core ranks hold exactly theirs;
//! after every booking is dropped every worker's counters are 0.
//!
//! Bounded by time and by count: `SELKIE_CHURN_SECS` (default 1 in
//! release, 0.5 in debug) per policy, and at most [`MAX_OPS`] calls per
//! thread. `SELKIE_CHURN_BREAK=admission|ledger|leak|legit` breaks one
//! check on purpose, to see it fire (STYLE rule 9).

#[path = "churn/plan.rs"]
mod plan;
#[path = "churn/tally.rs"]
mod tally;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use plan::*;
use selkie::*;
use tally::{install_panic_hook, Tally, THREAD_PREFIX};

/// Calls one selector makes at most per policy.
const MAX_OPS: u64 = if cfg!(debug_assertions) { 20_000 } else { 200_000 };
/// Checkpoints per policy.
const ROUNDS: u32 = 4;
/// Growth workers one churn run adds at most (rows cross 64-row boundaries).
const GROWTH_CAP: usize = if cfg!(debug_assertions) { 320 } else { 1200 };

fn run_time() -> Duration {
    let default = if cfg!(debug_assertions) { 0.5 } else { 1.0 };
    let secs = std::env::var("SELKIE_CHURN_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(default);
    Duration::from_secs_f64(secs)
}

fn broken(check: &str) -> bool {
    std::env::var("SELKIE_CHURN_BREAK").is_ok_and(|b| b == check)
}

/// What a request asks for, which decides the errors churn explains.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Plain,
    /// KV overlaps on a few ranks.
    Overlaps,
    /// An allowlist holding one core worker and some churned ones.
    AllowWithCore,
    /// An allowlist of churned workers only.
    AllowChurnedOnly,
    /// Requires [`TAINT`] (some core workers carry it).
    Taint,
    Pin(Pin),
    /// Session `n` of this thread, hard or soft, bound to `bound` before the call.
    Session(usize, AffinityMode, Option<WorkerWithDpRank>),
}

impl Kind {
    /// A short label for tallies.
    fn label(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Overlaps => "overlaps",
            Kind::AllowWithCore => "allowlist with a core worker",
            Kind::AllowChurnedOnly => "allowlist of churned workers",
            Kind::Taint => "required taint",
            Kind::Pin(Pin::Worker(_)) => "pinned worker",
            Kind::Pin(Pin::Rank(_)) => "pinned rank",
            Kind::Session(_, AffinityMode::Hard, _) => "hard session",
            Kind::Session(_, AffinityMode::Soft, _) => "soft session",
        }
    }
}

/// Whether churn explains `e` for a request of `kind`. Core workers never
/// change and always have room, so only a request that cannot use one may
/// fail, and only for a reason about the workers it is limited to.
fn legit(kind: Kind, e: &SelectionError) -> bool {
    use SelectionError as E;
    if broken("legit") {
        return false;
    }
    let pin_error = |id: WorkerId| {
        matches!(e, E::PinnedWorkerUnavailable { worker_id, .. } | E::PinnedWorkerOverloaded { worker_id }
            if *worker_id == id)
    };
    match kind {
        Kind::AllowChurnedOnly => matches!(e, E::NoEligibleWorkers { .. } | E::AllEligibleWorkersOverloaded),
        Kind::Pin(Pin::Worker(id)) => !is_core(id) && pin_error(id),
        Kind::Pin(Pin::Rank(w)) => {
            !is_core(w.worker_id)
                && (pin_error(w.worker_id)
                    || matches!(e, E::DpRankUnavailable { worker_id, .. } if *worker_id == w.worker_id))
        }
        Kind::Session(_, AffinityMode::Hard, Some(w)) => !is_core(w.worker_id) && pin_error(w.worker_id),
        _ => false,
    }
}

/// A random rank of a random core, churned or (rarely) growth worker.
fn random_rank(rng: &mut SplitMix) -> WorkerWithDpRank {
    let id = match rng.below(10) {
        0..=3 => *CORE.start() + rng.below(6),
        4..=8 => *CHURNED.start() + rng.below(10),
        _ => GROWTH_BASE + rng.below(8),
    };
    WorkerWithDpRank::new(id, rng.below(3) as u32)
}

/// The buffers a request borrows.
#[derive(Default)]
struct RequestParts {
    overlaps: Vec<WorkerOverlap>,
    allow: Vec<WorkerId>,
}

fn random_kind(rng: &mut SplitMix, pinned_only: bool, sessions: &[String], service: &WorkerSelectionService) -> Kind {
    let pick = if pinned_only { 5 + rng.below(2) } else { rng.below(9) };
    match pick {
        0 => Kind::Plain,
        1 => Kind::Overlaps,
        2 => Kind::AllowWithCore,
        3 => Kind::AllowChurnedOnly,
        4 => Kind::Taint,
        5 => Kind::Pin(Pin::Worker(random_rank(rng).worker_id)),
        6 => {
            let mut w = random_rank(rng);
            if is_core(w.worker_id) {
                w.dp_rank %= CORE_RANKS;
            }
            Kind::Pin(Pin::Rank(w))
        }
        n => {
            let s = rng.below(sessions.len() as u64) as usize;
            let mode = if n == 7 { AffinityMode::Hard } else { AffinityMode::Soft };
            Kind::Session(s, mode, service.session_worker(&sessions[s]))
        }
    }
}

fn request<'a>(
    kind: Kind,
    rng: &mut SplitMix,
    parts: &'a mut RequestParts,
    sessions: &'a [String],
) -> SelectionRequest<'a> {
    parts.overlaps.clear();
    parts.allow.clear();
    let isl = 16 + rng.below(512) as usize;
    let mut req = SelectionRequest::new(isl);
    if rng.percent(30) || matches!(kind, Kind::Overlaps) {
        for _ in 0..1 + rng.below(4) {
            let blocks = rng.below(1 + isl as u64 / 16) as u32;
            parts.overlaps.push(WorkerOverlap::device(random_rank(rng), blocks, 16));
        }
        parts.overlaps.sort_by_key(|o| o.worker);
        parts.overlaps.dedup_by_key(|o| o.worker);
        req = req.with_required_cache_hits(rng.below(3) as u32);
    }
    match kind {
        Kind::AllowWithCore | Kind::AllowChurnedOnly => {
            if matches!(kind, Kind::AllowWithCore) {
                parts.allow.push(*CORE.start() + rng.below(6));
            }
            for _ in 0..1 + rng.below(3) {
                parts.allow.push(*CHURNED.start() + rng.below(10));
            }
        }
        Kind::Taint => req = req.with_required_taints(&[TAINT]),
        Kind::Pin(Pin::Worker(id)) => req = req.pinned_to_worker(id),
        Kind::Pin(Pin::Rank(w)) => req = req.pinned_to_rank(w),
        Kind::Session(s, mode, _) => req = req.with_session(&sessions[s], mode),
        Kind::Plain | Kind::Overlaps => {}
    }
    let req = req.with_overlaps(&parts.overlaps);
    if parts.allow.is_empty() {
        req
    } else {
        req.with_allowed_workers(&parts.allow)
    }
}

/// Whether a booking for `kind` went where the request allowed.
fn respects(kind: Kind, allow: &[WorkerId], w: WorkerWithDpRank) -> bool {
    match kind {
        Kind::Pin(Pin::Worker(id)) => w.worker_id == id,
        Kind::Pin(Pin::Rank(r)) => w == r,
        Kind::Taint => has_taint(w.worker_id),
        Kind::AllowWithCore | Kind::AllowChurnedOnly => allow.contains(&w.worker_id),
        _ => true,
    }
}

/// Bookings the selectors hold at a checkpoint, per rank.
type Ledger = Mutex<HashMap<WorkerWithDpRank, u32>>;

struct Run<'a> {
    policy: &'static str,
    service: &'a WorkerSelectionService,
    barrier: Barrier,
    ledger: Ledger,
    start: Instant,
    round: Duration,
}

impl Run<'_> {
    fn round_end(&self, round: u32) -> Instant {
        self.start + self.round * (round + 1)
    }

    /// One selector thread: selects, peeks, asks costs, and works on the
    /// bookings it holds.
    fn selector(&self, thread: usize) -> Tally {
        let mut t = Tally::default();
        let mut rng = SplitMix::new(0x5E1E_C70B ^ ((thread as u64) << 32));
        let sessions: Vec<String> = (0..4).map(|k| format!("t{thread}-s{k}")).collect();
        let mut held: Vec<Selection<'_>> = Vec::new();
        let mut parts = RequestParts::default();
        let (p, svc) = (self.policy, self.service);
        let pinned_only = p == "direct";
        for round in 0..ROUNDS {
            let end = self.round_end(round);
            let mut ops = 0;
            while ops < MAX_OPS / u64::from(ROUNDS) && Instant::now() < end {
                ops += 1;
                let action = rng.below(100);
                if action < 60 || held.is_empty() {
                    let kind = random_kind(&mut rng, pinned_only, &sessions, svc);
                    let req = request(kind, &mut rng, &mut parts, &sessions);
                    let ctx = || format!("policy {p}, {kind:?}, request {req:?}");
                    let (op, result) = match action % 4 {
                        0 | 1 => ("select", t.call("select", ctx, || svc.select(&req).map(Some))),
                        2 => ("peek", t.call("peek", ctx, || svc.peek(&req).map(|_| None))),
                        _ => ("costs", t.call("costs", ctx, || svc.costs(&req).map(|_| None))),
                    };
                    // `costs` ignores sessions: for it a session request is plain.
                    let kind = if op == "costs" && matches!(kind, Kind::Session(..)) {
                        Kind::Plain
                    } else {
                        kind
                    };
                    match result {
                        None => {}
                        Some(Ok(booking)) => {
                            t.ok(op);
                            if let Some(b) = booking {
                                if !respects(kind, &parts.allow, b.worker()) {
                                    t.violations.add("booking outside the request's constraints", || {
                                        format!("policy {p}: {kind:?} (allow {:?}) booked {}", parts.allow, b.worker())
                                    });
                                }
                                if held.len() == MAX_HELD {
                                    held.swap_remove(rng.below(MAX_HELD as u64) as usize);
                                }
                                held.push(b);
                            }
                        }
                        Some(Err(e)) => t.error(
                            op,
                            &format!("{} ({})", e.reason(), kind.label()),
                            legit(kind, &e),
                            || format!("policy {p}: {kind:?} -> {e:?} ({e})"),
                        ),
                    }
                    continue;
                }
                let i = rng.below(held.len() as u64) as usize;
                let b = &mut held[i];
                let from = b.worker();
                match action {
                    60..=71 => drop(held.swap_remove(i)),
                    72..=81 => {
                        t.call(
                            "prefill_complete",
                            || format!("policy {p}, booking on {from}"),
                            || b.prefill_complete(),
                        );
                    }
                    82..=91 => match t.call(
                        "add_output_block",
                        || format!("policy {p}, booking on {from}"),
                        || b.add_output_block(),
                    ) {
                        Some(Ok(())) => t.ok("add_output_block"),
                        Some(Err(e)) => {
                            let legit = !is_core(from.worker_id) && e == BookingError::WorkerGone { worker: from };
                            t.error("add_output_block", "worker_gone", legit && !broken("legit"), || {
                                format!("policy {p}: booking on {from} -> {e:?}")
                            });
                        }
                        None => {}
                    },
                    _ => {
                        let to = random_rank(&mut rng);
                        let to = if is_core(to.worker_id) {
                            WorkerWithDpRank::new(to.worker_id, to.dp_rank % CORE_RANKS)
                        } else {
                            to
                        };
                        match t.call(
                            "retarget",
                            || format!("policy {p}, booking on {from} to {to}"),
                            || b.retarget(to),
                        ) {
                            Some(Ok(())) => {
                                t.ok("retarget");
                                if b.worker() != to {
                                    t.violations.add("retarget reports another worker", || {
                                        format!("policy {p}: retarget {from} -> {to} reports {}", b.worker())
                                    });
                                }
                            }
                            Some(Err(e)) => {
                                let (reason, named) = match e {
                                    BookingError::UnknownWorker { worker } => ("unknown_worker", worker),
                                    BookingError::NotLive { worker } => ("not_live", worker),
                                    BookingError::Overloaded { worker, .. } => ("overloaded", worker),
                                    BookingError::WorkerGone { worker } => ("worker_gone", worker),
                                    _ => ("other", to),
                                };
                                let legit = !is_core(to.worker_id) && named == to && reason != "worker_gone";
                                t.error("retarget", reason, legit && !broken("legit"), || {
                                    format!("policy {p}: retarget {from} -> {to}: {e:?}")
                                });
                                if b.worker() != from {
                                    t.violations.add("refused retarget moved the booking", || {
                                        format!(
                                            "policy {p}: retarget {from} -> {to} refused ({e}) but booking now on {}",
                                            b.worker()
                                        )
                                    });
                                }
                            }
                            None => {}
                        }
                    }
                }
            }
            {
                let mut ledger = self.ledger.lock().unwrap();
                for (k, b) in held.iter().enumerate() {
                    if !(broken("ledger") && thread == 0 && k == 0) {
                        *ledger.entry(b.worker()).or_default() += 1;
                    }
                }
            }
            self.barrier.wait(); // quiescent: the churn thread checks
            self.barrier.wait();
        }
        if broken("leak") && thread == 0 {
            held.drain(..).for_each(std::mem::forget);
        }
        drop(held);
        t
    }

    /// The churn thread: changes the worker table until each round ends,
    /// then checks the quiescent fleet against the selectors' bookings.
    fn churn(&self, mut model: FleetModel) -> Tally {
        let mut t = Tally::default();
        let mut rng = SplitMix::new(0xC4u64 << 40);
        let mut ops = 0u64;
        for round in 0..ROUNDS {
            let end = self.round_end(round);
            while ops < MAX_OPS && Instant::now() < end {
                ops += 1;
                self.churn_once(&mut rng, &mut model, &mut t);
                t.ok("discovery change");
            }
            self.barrier.wait();
            self.check_ledger(&mut t);
            self.ledger.lock().unwrap().clear();
            self.barrier.wait();
        }
        t
    }

    fn churn_once(&self, rng: &mut SplitMix, model: &mut FleetModel, t: &mut Tally) {
        let (p, svc) = (self.policy, self.service);
        let id = *CHURNED.start() + rng.below(10);
        let mut expect = |what: &str, r: Result<(), DiscoveryError>| {
            if let Err(e) = r {
                t.violations.add("discovery change refused", || {
                    format!("policy {p}: {what} worker {id}: {e}")
                });
            }
        };
        if model.growth.len() < GROWTH_CAP && rng.percent(30) {
            let gid = GROWTH_BASE + model.growth.len() as u64;
            expect("add growth", svc.add_worker(growth_record(gid)));
            model.growth.push(gid);
            return;
        }
        let present = model.churned.get(&id).cloned();
        match (rng.below(10), present) {
            (0, Some(_)) => {
                expect("remove", svc.remove_worker(id));
                model.churned.remove(&id);
            }
            (_, None) => {
                let r = random_churned(rng, id);
                expect("add", svc.add_worker(r.clone()));
                model.churned.insert(id, r);
            }
            (1..=3, Some(r)) => {
                let state = [WorkerState::Draining, WorkerState::Cordoned, WorkerState::Live][rng.below(3) as usize];
                expect("set state", svc.set_worker_state(id, state));
                model.churned.insert(id, WorkerRecord { state, ..r });
            }
            (4 | 5, Some(r)) => {
                // A new weight, and half the time a new rank count.
                let ranks = if rng.percent(50) {
                    1 + rng.below(3) as u32
                } else {
                    r.data_parallel_size
                };
                let n = churned_record(id, ranks, 0.5 * (1 + rng.below(8)) as f32, r.state);
                expect("update", svc.update_worker(n.clone()));
                model.churned.insert(id, n);
            }
            (6 | 7, Some(_)) => expect("set overloaded", svc.set_overloaded(id, rng.percent(50))),
            (_, Some(_)) => {
                // A changed snapshot: one churned worker in or out, one re-drawn.
                let other = *CHURNED.start() + rng.below(10);
                if model.churned.remove(&other).is_none() {
                    model.churned.insert(other, random_churned(rng, other));
                }
                model.churned.insert(id, random_churned(rng, id));
                if let Err(e) = svc.sync(model.snapshot()) {
                    t.violations
                        .add("discovery change refused", || format!("policy {p}: sync: {e}"));
                }
            }
        }
    }

    /// At a checkpoint (every selector waiting): no rank holds more requests
    /// than the bookings that report it; core ranks hold exactly those.
    fn check_ledger(&self, t: &mut Tally) {
        let p = self.policy;
        let ledger = self.ledger.lock().unwrap();
        for r in self.service.workers() {
            let Some(status) = self.service.worker_status(r.worker_id) else {
                continue;
            };
            for rank in &status.ranks {
                let w = WorkerWithDpRank::new(r.worker_id, rank.dp_rank);
                let booked = ledger.get(&w).copied().unwrap_or(0);
                let exact = is_core(r.worker_id);
                if rank.active_requests > booked || (exact && rank.active_requests != booked) {
                    t.violations
                        .add("requests on a rank without a booking that reports it", || {
                            format!(
                                "policy {p}, worker {}, rank {}: {} requests active, {booked} live bookings report it",
                                r.worker_id, rank.dp_rank, rank.active_requests
                            )
                        });
                }
            }
        }
    }

    /// The sampler: reads every worker's status, asserting admission.
    fn sampler(&self) -> Tally {
        let mut t = Tally::default();
        let p = self.policy;
        for round in 0..ROUNDS {
            let end = self.round_end(round);
            let mut ops = 0;
            while ops < MAX_OPS / u64::from(ROUNDS) && Instant::now() < end {
                ops += 1;
                for r in self.service.workers() {
                    let Some(status) = self.service.worker_status(r.worker_id) else {
                        continue;
                    };
                    let Some(limit) = status.record.max_active_requests else {
                        continue;
                    };
                    let limit = if broken("admission") { limit - 1 } else { limit };
                    for rank in &status.ranks {
                        t.admission_checks += 1;
                        t.at_limit += u64::from(rank.active_requests == limit);
                        if rank.active_requests > limit {
                            t.violations.add("admission limit exceeded", || {
                                format!(
                                    "policy {p}, worker {}, rank {}: {} active requests, limit {limit}",
                                    r.worker_id, rank.dp_rank, rank.active_requests
                                )
                            });
                        }
                    }
                }
            }
            self.barrier.wait();
            self.barrier.wait();
        }
        t
    }
}

/// Runs one policy's churn and asserts every check.
fn churn(policy: &'static str) {
    install_panic_hook();
    let (service, model) = plan::service(plan::policy(policy), 0x5E1C);
    let run = Run {
        policy,
        service: &service,
        barrier: Barrier::new(SELECTORS + 2),
        ledger: Mutex::new(HashMap::new()),
        start: Instant::now(),
        round: run_time() / ROUNDS,
    };
    let mut tally = Tally::default();
    std::thread::scope(|s| {
        let run = &run;
        let named = |name: String| std::thread::Builder::new().name(format!("{THREAD_PREFIX}{name}"));
        let mut handles = Vec::new();
        for i in 0..SELECTORS {
            handles.push(
                named(format!("select-{i}"))
                    .spawn_scoped(s, move || run.selector(i))
                    .expect("spawn"),
            );
        }
        handles.push(
            named("sampler".into())
                .spawn_scoped(s, move || run.sampler())
                .expect("spawn"),
        );
        handles.push(
            named("discovery".into())
                .spawn_scoped(s, move || run.churn(model))
                .expect("spawn"),
        );
        for h in handles {
            match h.join() {
                Ok(t) => tally.merge(t),
                Err(e) => std::panic::resume_unwind(e),
            }
        }
    });
    // Every booking is dropped: nothing may remain counted.
    for r in service.workers() {
        for rank in service.worker_status(r.worker_id).map(|s| s.ranks).unwrap_or_default() {
            if (
                rank.active_requests,
                rank.active_prefill_tokens,
                rank.active_decode_blocks,
            ) != (0, 0, 0)
            {
                tally.violations.add("load left after every booking was dropped", || {
                    format!(
                        "policy {policy}, worker {}, rank {}: {rank:?}",
                        r.worker_id, rank.dp_rank
                    )
                });
            }
        }
    }
    println!("{}", tally.render(policy));
    let selected = tally.ok.get("select").copied().unwrap_or(0);
    assert!(selected > 0, "policy {policy}: no selection succeeded");
    assert!(
        tally.admission_checks > 0,
        "policy {policy}: the sampler checked nothing"
    );
    assert!(
        tally.panics.total() == 0,
        "policy {policy}: {} library calls panicked:\n{}",
        tally.panics.total(),
        tally.panics.render()
    );
    assert!(
        tally.illegit.total() == 0,
        "policy {policy}: {} errors that churn does not explain:\n{}",
        tally.illegit.total(),
        tally.illegit.render()
    );
    assert!(
        tally.violations.total() == 0,
        "policy {policy}: {} broken invariants:\n{}",
        tally.violations.total(),
        tally.violations.render()
    );
}

#[test]
fn churn_random() {
    churn("random");
}

#[test]
fn churn_round_robin() {
    churn("round-robin");
}

#[test]
fn churn_least_loaded() {
    churn("least-loaded");
}

#[test]
fn churn_power_of_two() {
    churn("power-of-two");
}

#[test]
fn churn_device_aware_weighted() {
    churn("device-aware-weighted");
}

#[test]
fn churn_kv_greedy() {
    churn("kv-t0");
}

#[test]
fn churn_kv_sampled() {
    churn("kv-t0.7");
}

#[test]
fn churn_custom_scorer_and_picker() {
    churn("custom");
}

#[test]
fn churn_direct_pinned_only() {
    churn("direct");
}

/// Workers the growth run adds, one by one: 4,096 in release (64 64-row
/// boundaries); 1,024 in debug, where each add's snapshot reload costs far
/// more, so the file stays well under a minute there.
const GROWTH_WORKERS: u64 = if cfg!(debug_assertions) { 1024 } else { 4096 };

/// Every policy: 8 fresh threads select, peek and ask costs while one
/// thread adds workers 1..=[`GROWTH_WORKERS`] one by one, crossing a 64-row
/// boundary every 64 adds. Fresh threads start with empty scratch buffers.
#[test]
fn growth_one_worker_at_a_time_under_selection() {
    install_panic_hook();
    let mut failures = Vec::new();
    for policy in POLICIES {
        let service = WorkerSelectionService::new(
            plan::policy(policy),
            ServiceConfig {
                seed: Some(7),
                ..ServiceConfig::default()
            },
        );
        let added = AtomicU64::new(0);
        let mut tally = Tally::default();
        std::thread::scope(|s| {
            let (service, added) = (&service, &added);
            let selectors: Vec<_> = (0..8u64)
                .map(|i| {
                    let f = move || {
                        let mut t = Tally::default();
                        let mut rng = SplitMix::new(i);
                        while added.load(Ordering::Acquire) < GROWTH_WORKERS {
                            let n = added.load(Ordering::Acquire);
                            let req = SelectionRequest::new(64);
                            let req = if policy == "direct" && n > 0 {
                                req.pinned_to_worker(1 + rng.below(n))
                            } else {
                                req
                            };
                            let ctx = || format!("policy {policy}, {n} workers added");
                            let results = [
                                ("select", t.call("select", ctx, || service.select(&req).map(drop))),
                                ("peek", t.call("peek", ctx, || service.peek(&req).map(drop))),
                                ("costs", t.call("costs", ctx, || service.costs(&req).map(drop))),
                            ];
                            for (op, r) in results {
                                match r {
                                    Some(Ok(())) => t.ok(op),
                                    Some(Err(e)) => {
                                        let legit = n == 0
                                            && matches!(
                                                e,
                                                SelectionError::NoEndpoints | SelectionError::DirectWorkerMissing
                                            );
                                        t.error(op, e.reason(), legit, || {
                                            format!("policy {policy}, {n} workers added: {e:?}")
                                        });
                                    }
                                    None => {}
                                }
                            }
                        }
                        t
                    };
                    std::thread::Builder::new()
                        .name(format!("{THREAD_PREFIX}growth-{i}"))
                        .spawn_scoped(s, f)
                        .expect("spawn")
                })
                .collect();
            for id in 1..=GROWTH_WORKERS {
                service
                    .add_worker(WorkerRecord::new(id))
                    .expect("room for 4096 workers");
                added.store(id, Ordering::Release);
            }
            for h in selectors {
                match h.join() {
                    Ok(t) => tally.merge(t),
                    Err(e) => std::panic::resume_unwind(e),
                }
            }
        });
        println!("growth, {}", tally.render(policy));
        if tally.panics.total() + tally.illegit.total() > 0 {
            failures.push(format!(
                "policy {policy}: {} panics, {} errors growth does not explain\n{}{}",
                tally.panics.total(),
                tally.illegit.total(),
                tally.panics.render(),
                tally.illegit.render()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "growth to {GROWTH_WORKERS} workers:\n{}",
        failures.join("\n")
    );
}
