//! Harness of the `adversarial_policy` fuzz target, shared with the
//! regression replay in `host/tests/fuzz_regressions.rs` (both include this
//! file with `#[path]`; it uses only the public API and `arbitrary`).
//!
//! A custom policy of two filters, three scorers and a picker whose every
//! call follows a per-request [`Script`]: keep, drop, fail, panic (string and
//! non-string payloads), write NaN / ±inf / ±f64::MAX / tiny / -0 costs,
//! leave rows unwritten, pick out-of-range rows. Each plugin logs what it saw
//! and did; [`predict`] replays the log against a plain model of the
//! service's contract (filters per candidate in order, scorers
//! summed with finiteness checked per contribution and running total, the
//! picker's row checked against the table, bounded booking rescans) and of
//! the fleet (which ranks are live, which have room), and the service's
//! answer must equal the prediction exactly: the typed error naming the
//! scorer and row, the picker row and count, the panicking plugin.
//!
//! Between requests the fleet changes (add, update, remove, state) and
//! bookings are released, retargeted, prefilled and grown. After every step
//! each rank's counters must equal the sum of its outstanding bookings (a rank
//! given up while booked keeps its row, retired, and gets it back if it
//! returns before those bookings end); after
//! every failed request a well-behaved script on the same service, and a
//! built-in least-loaded service on the same thread, must still select; at
//! the end, with every booking dropped, every counter must be zero.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Once, PoisonError};

use arbitrary::Arbitrary;
use selkie::*;

/// The message of every scripted panic (the panic hook stays quiet for it).
pub const SCRIPTED_PANIC: &str = "selkie-fuzz: scripted plugin panic";

/// The payload of a scripted panic with a non-string payload.
pub struct ScriptedPanic;

/// Installs, once, a panic hook that is silent for scripted plugin panics and
/// hands every other panic to the previous hook (libFuzzer's, which aborts:
/// real failures are never hidden).
pub fn quiet_scripted_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let p = info.payload();
            let scripted = p.is::<ScriptedPanic>() || p.downcast_ref::<&str>().is_some_and(|s| *s == SCRIPTED_PANIC);
            if !scripted {
                previous(info);
            }
        }));
    });
}

// ---- input -------------------------------------------------------------

/// One worker: `id % 6`, ranks `dp_start % 4 .. + dp_size % 4` (size 0 is
/// invalid), admission limit `limit % 4 + 1`, state `state % 3`.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Worker {
    pub id: u8,
    pub dp_start: u8,
    pub dp_size: u8,
    pub limit: Option<u8>,
    pub state: u8,
}

/// A cost a scorer writes.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Cost {
    Finite(i32),
    Max,
    NegMax,
    Nan,
    Inf,
    NegInf,
    Tiny,
    NegZero,
}

impl Cost {
    fn value(self) -> f64 {
        match self {
            Cost::Finite(x) => x as f64,
            Cost::Max => f64::MAX,
            Cost::NegMax => -f64::MAX,
            Cost::Nan => f64::NAN,
            Cost::Inf => f64::INFINITY,
            Cost::NegInf => f64::NEG_INFINITY,
            Cost::Tiny => f64::from_bits(1),
            Cost::NegZero => -0.0,
        }
    }
}

/// What a filter does on its `n`-th call of a round.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum FilterAct {
    Keep,
    /// Drops calls whose index is a multiple of `k % 4 + 2`.
    DropEvery(u8),
    DropAll,
    /// Keeps, then fails on call `k % 4`.
    FailAt(u8),
    /// Keeps, then panics (string payload) on call `k % 4`.
    PanicAt(u8),
    /// Keeps, then panics (non-string payload) on call `k % 4`.
    PanicAnyAt(u8),
}

/// What a scorer does.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum ScorerAct {
    Zero,
    /// Row `i` gets `costs[i % 4]`.
    Costs([Cost; 4]),
    /// Every row but `row % n` gets `cost` (the skipped row keeps the host's NaN).
    Skip {
        row: u8,
        cost: Cost,
    },
    /// Writes `cost` to every row, then fails.
    WriteThenFail(Cost),
    Fail,
    Panic,
    PanicAny,
}

/// What the picker does.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum PickAct {
    Row(u16),
    /// `n`: one past the end.
    Len,
    UsizeMax,
    /// The lowest total cost (first on ties).
    MinCost,
    /// The first candidate with room (the well-behaved picker).
    Capacity,
    Fail,
    Panic,
    PanicAny,
}

/// One request's plugin behaviour.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Script {
    pub filters: [FilterAct; 2],
    pub scorers: [ScorerAct; 3],
    pub picker: PickAct,
}

/// A script that keeps everything, costs nothing and picks a row with room.
pub const WELL_BEHAVED: Script = Script {
    filters: [FilterAct::Keep, FilterAct::Keep],
    scorers: [ScorerAct::Zero, ScorerAct::Zero, ScorerAct::Zero],
    picker: PickAct::Capacity,
};

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Op {
    Select { isl: u16, explained: bool, script: Script },
    Peek { isl: u16, script: Script },
    Release { booking: u8 },
    PrefillComplete { booking: u8 },
    OutputBlock { booking: u8 },
    Retarget { booking: u8, worker: u8, rank: u8 },
    Add(Worker),
    Update(Worker),
    Remove { id: u8 },
    SetState { id: u8, state: u8 },
}

/// `Debug` prints a pasteable reproducer (`vec![...]`, not `[...]`).
#[derive(Arbitrary)]
pub struct Input {
    pub workers: Vec<Worker>,
    pub ops: Vec<Op>,
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Input {{ workers: vec!{:?}, ops: vec!{:?} }}",
            self.workers, self.ops
        )
    }
}

// ---- plugins -----------------------------------------------------------

/// How a plugin call ended.
#[derive(Clone, Debug, PartialEq)]
enum Outcome<T> {
    Ok(T),
    Failed,
    Panicked { string: bool },
}

#[derive(Clone, Debug)]
enum Event {
    Filter {
        index: usize,
        worker: WorkerWithDpRank,
        outcome: Outcome<bool>,
    },
    Scorer {
        index: usize,
        workers: Vec<WorkerWithDpRank>,
        active: Option<Vec<usize>>,
        written: Vec<f64>,
        outcome: Outcome<()>,
    },
    Picker {
        workers: Vec<WorkerWithDpRank>,
        costs: Vec<f64>,
        outcome: Outcome<usize>,
    },
}

#[derive(Default)]
struct State {
    script: Option<Script>,
    /// Ranks with room now (for `PickAct::Capacity`).
    room: Vec<WorkerWithDpRank>,
    /// Calls of each filter in the current round.
    filter_calls: [usize; 2],
    log: Vec<Event>,
}

type Shared = Arc<Mutex<State>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

const FILTER_NAMES: [&str; 2] = ["fuzz-filter-0", "fuzz-filter-1"];
const SCORER_NAMES: [&str; 3] = ["fuzz-scorer-0", "fuzz-scorer-1", "fuzz-scorer-2"];
const PICKER_NAME: &str = "fuzz-picker";
const FAILURE: &str = "scripted failure";

/// Ends a plugin call the scripted way; the event is logged first, with the
/// lock released.
fn finish<T>(state: &Shared, event: Event, outcome: Outcome<T>) -> Result<T, WorkerSelectionPolicyError> {
    lock(state).log.push(event);
    match outcome {
        Outcome::Ok(v) => Ok(v),
        Outcome::Failed => Err(WorkerSelectionPolicyError::failed(FAILURE)),
        Outcome::Panicked { string: true } => std::panic::panic_any(SCRIPTED_PANIC),
        Outcome::Panicked { string: false } => std::panic::panic_any(ScriptedPanic),
    }
}

fn strip<T>(o: &Outcome<T>) -> Outcome<()> {
    match o {
        Outcome::Ok(_) => Outcome::Ok(()),
        Outcome::Failed => Outcome::Failed,
        Outcome::Panicked { string } => Outcome::Panicked { string: *string },
    }
}

struct ScriptedFilter {
    index: usize,
    state: Shared,
}

impl WorkerFilter for ScriptedFilter {
    fn name(&self) -> &'static str {
        FILTER_NAMES[self.index]
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        [WorkerInputs::NONE, WorkerInputs::OCCUPANCY][self.index]
    }
    fn keep(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidate<'_>) -> Result<bool, WorkerSelectionPolicyError> {
        // Each component sees only what it declared.
        assert_eq!(
            c.occupancy().is_some(),
            self.index == 1,
            "filter {} occupancy",
            self.index
        );
        assert!(
            c.load().is_none() && c.cache().is_none(),
            "filter {} saw undeclared inputs",
            self.index
        );
        let (act, call) = {
            let mut s = lock(&self.state);
            let call = s.filter_calls[self.index];
            s.filter_calls[self.index] += 1;
            (s.script.expect("script set").filters[self.index], call)
        };
        let at = |k: u8| call == (k % 4) as usize;
        let outcome = match act {
            FilterAct::Keep => Outcome::Ok(true),
            FilterAct::DropEvery(k) => Outcome::Ok(call % (k % 4 + 2) as usize != 0),
            FilterAct::DropAll => Outcome::Ok(false),
            FilterAct::FailAt(k) if at(k) => Outcome::Failed,
            FilterAct::PanicAt(k) if at(k) => Outcome::Panicked { string: true },
            FilterAct::PanicAnyAt(k) if at(k) => Outcome::Panicked { string: false },
            FilterAct::FailAt(_) | FilterAct::PanicAt(_) | FilterAct::PanicAnyAt(_) => Outcome::Ok(true),
        };
        let event = Event::Filter {
            index: self.index,
            worker: c.worker(),
            outcome: outcome.clone(),
        };
        finish(&self.state, event, outcome)
    }
}

struct ScriptedScorer {
    index: usize,
    state: Shared,
}

impl WorkerScorer for ScriptedScorer {
    fn name(&self) -> &'static str {
        SCORER_NAMES[self.index]
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        [
            WorkerInputs::LOAD,
            WorkerInputs::CACHE | WorkerInputs::PREFERRED_TAINT,
            WorkerInputs::ALL,
        ][self.index]
    }
    fn score(
        &self,
        _: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        assert_eq!(costs.len(), candidates.len(), "cost buffer length");
        assert!(costs.iter().all(|c| c.is_nan()), "cost buffer not NaN-filled");
        let act = lock(&self.state).script.expect("script set").scorers[self.index];
        let n = costs.len();
        let outcome = match act {
            ScorerAct::Zero => {
                costs.fill(0.0);
                Outcome::Ok(())
            }
            ScorerAct::Costs(cs) => {
                for (i, c) in costs.iter_mut().enumerate() {
                    *c = cs[i % 4].value();
                }
                Outcome::Ok(())
            }
            ScorerAct::Skip { row, cost } => {
                let skip = row as usize % n.max(1);
                for (i, c) in costs.iter_mut().enumerate() {
                    if i != skip {
                        *c = cost.value();
                    }
                }
                Outcome::Ok(())
            }
            ScorerAct::WriteThenFail(cost) => {
                costs.fill(cost.value());
                Outcome::Failed
            }
            ScorerAct::Fail => Outcome::Failed,
            ScorerAct::Panic => Outcome::Panicked { string: true },
            ScorerAct::PanicAny => Outcome::Panicked { string: false },
        };
        let event = Event::Scorer {
            index: self.index,
            workers: candidates.iter().map(|c| c.worker()).collect(),
            active: (self.index == 0).then(|| {
                candidates
                    .iter()
                    .map(|c| c.load().expect("LOAD declared").active_requests())
                    .collect()
            }),
            written: costs.to_vec(),
            outcome: outcome.clone(),
        };
        finish(&self.state, event, outcome)
    }
}

struct ScriptedPicker {
    state: Shared,
}

impl WorkerPicker for ScriptedPicker {
    fn name(&self) -> &'static str {
        PICKER_NAME
    }
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD | WorkerInputs::CACHE
    }
    fn pick(
        &self,
        _: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let n = input.len();
        assert_eq!(input.costs().len(), n);
        assert_eq!(input.candidates().len(), n);
        assert_eq!(input.load().map(<[_]>::len), Some(n), "LOAD column");
        assert_eq!(input.cache().map(<[_]>::len), Some(n), "CACHE column");
        let workers: Vec<WorkerWithDpRank> = input.iter().map(|c| c.worker()).collect();
        let (act, room) = {
            let mut s = lock(&self.state);
            s.filter_calls = [0; 2]; // the round ends here
            (s.script.expect("script set").picker, s.room.clone())
        };
        let costs = input.costs();
        let outcome = match act {
            PickAct::Row(r) => Outcome::Ok(r as usize),
            PickAct::Len => Outcome::Ok(n),
            PickAct::UsizeMax => Outcome::Ok(usize::MAX),
            PickAct::MinCost => Outcome::Ok((0..n).min_by(|&a, &b| costs[a].total_cmp(&costs[b])).unwrap_or(0)),
            PickAct::Capacity => Outcome::Ok(workers.iter().position(|w| room.contains(w)).unwrap_or(0)),
            PickAct::Fail => Outcome::Failed,
            PickAct::Panic => Outcome::Panicked { string: true },
            PickAct::PanicAny => Outcome::Panicked { string: false },
        };
        let event = Event::Picker {
            workers,
            costs: costs.to_vec(),
            outcome: outcome.clone(),
        };
        finish(&self.state, event, outcome)
    }
}

// ---- model -------------------------------------------------------------

struct ModelWorker {
    record: WorkerRecord,
}

struct ModelBooking {
    worker: WorkerWithDpRank,
    incarnation: u64,
}

/// The fleet as rows: each registered rank's row has an incarnation (a
/// new one per new row). A rank given up while bookings hold its row is
/// retired with its incarnation; the same rank taken again before they end
/// gets it back, and a change frees retired rows no booking holds.
#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerId, ModelWorker>,
    ranks: BTreeMap<WorkerWithDpRank, u64>,
    retired: BTreeMap<WorkerWithDpRank, u64>,
    next_incarnation: u64,
}

fn held(bookings: &[(Selection<'_>, ModelBooking)], w: WorkerWithDpRank, inc: u64) -> bool {
    bookings.iter().any(|(_, b)| b.worker == w && b.incarnation == inc)
}

fn record_of(w: Worker) -> WorkerRecord {
    let mut r = WorkerRecord::new(u64::from(w.id % 6))
        .with_dp(u32::from(w.dp_start % 4), u32::from(w.dp_size % 4))
        .with_state([WorkerState::Live, WorkerState::Draining, WorkerState::Cordoned][(w.state % 3) as usize]);
    if let Some(l) = w.limit {
        r = r.with_max_active_requests(u32::from(l % 4 + 1));
    }
    r
}

impl Model {
    fn incarnation_of(&self, w: WorkerWithDpRank) -> Option<u64> {
        self.ranks.get(&w).copied()
    }
    /// A change starts by freeing the retired rows no booking holds.
    fn sweep(&mut self, bookings: &[(Selection<'_>, ModelBooking)]) {
        self.retired.retain(|&w, &mut inc| held(bookings, w, inc));
    }
    fn release(&mut self, bookings: &[(Selection<'_>, ModelBooking)], w: WorkerWithDpRank) {
        if let Some(inc) = self.ranks.remove(&w) {
            if held(bookings, w, inc) {
                self.retired.insert(w, inc);
            }
        }
    }
    fn take(&mut self, w: WorkerWithDpRank) {
        let inc = match self.retired.remove(&w) {
            Some(inc) => inc,
            None => self.bump(),
        };
        self.ranks.insert(w, inc);
    }
    fn current(&self, b: &ModelBooking) -> bool {
        self.incarnation_of(b.worker) == Some(b.incarnation)
    }
    fn count(&self, bookings: &[(Selection<'_>, ModelBooking)], w: WorkerWithDpRank) -> usize {
        let inc = self.incarnation_of(w);
        bookings
            .iter()
            .filter(|(_, b)| b.worker == w && Some(b.incarnation) == inc)
            .count()
    }
    fn limit(&self, w: WorkerWithDpRank) -> usize {
        self.workers[&w.worker_id]
            .record
            .max_active_requests
            .map_or(usize::MAX, |l| l as usize)
    }
    fn has_room(&self, bookings: &[(Selection<'_>, ModelBooking)], w: WorkerWithDpRank) -> bool {
        self.count(bookings, w) < self.limit(w)
    }
    fn live_ranks(&self) -> Vec<WorkerWithDpRank> {
        self.workers
            .values()
            .filter(|m| m.record.state == WorkerState::Live)
            .flat_map(|m| {
                m.record
                    .dp_ranks()
                    .map(move |r| WorkerWithDpRank::new(m.record.worker_id, r))
            })
            .collect()
    }
    fn bump(&mut self) -> u64 {
        self.next_incarnation += 1;
        self.next_incarnation
    }
}

/// Replays the plugins' log against the contract and the model: the result
/// the service must return.
fn predict(
    log: &[Event],
    model: &Model,
    bookings: &[(Selection<'_>, ModelBooking)],
    preview: bool,
) -> Result<WorkerWithDpRank, SelectionError> {
    let mut remaining = model.live_ranks();
    let mut events = log.iter();
    fn end(
        r: Result<WorkerWithDpRank, SelectionError>,
        events: std::slice::Iter<'_, Event>,
    ) -> Result<WorkerWithDpRank, SelectionError> {
        assert_eq!(
            events.as_slice().len(),
            0,
            "plugin calls after the outcome {r:?}: {:?}",
            events.as_slice()
        );
        r
    }
    if remaining.is_empty() {
        return end(Err(SelectionError::NoEndpoints), events);
    }
    let panicked = |kind, name, string: bool| {
        Err(SelectionError::Policy(WorkerSelectionPolicyError::PluginPanicked {
            kind,
            name,
            message: if string {
                SCRIPTED_PANIC.to_owned()
            } else {
                "non-string panic payload".to_owned()
            },
        }))
    };
    let failed = || Err(SelectionError::Policy(WorkerSelectionPolicyError::failed(FAILURE)));
    for _attempt in 0..4 {
        // Filters: each candidate through filter 0, then filter 1 if kept.
        let mut seen = Vec::new();
        let mut survivors = Vec::new();
        while seen.len() < remaining.len() {
            let mut kept = true;
            let mut worker = None;
            for (index, &name) in FILTER_NAMES.iter().enumerate() {
                match events.next() {
                    Some(Event::Filter {
                        index: i,
                        worker: w,
                        outcome,
                    }) if *i == index => {
                        match worker {
                            None => {
                                assert!(
                                    remaining.contains(w),
                                    "filter saw ineligible {w}; eligible {remaining:?}"
                                );
                                assert!(!seen.contains(w), "filter saw {w} twice in one round");
                                seen.push(*w);
                                worker = Some(*w);
                            }
                            Some(prev) => assert_eq!(prev, *w, "filter 1 saw another candidate than filter 0"),
                        }
                        match outcome {
                            Outcome::Ok(true) => {}
                            Outcome::Ok(false) => {
                                kept = false;
                                break;
                            }
                            Outcome::Failed => return end(failed(), events),
                            Outcome::Panicked { string } => {
                                return end(panicked(PluginKind::Filter, name, *string), events)
                            }
                        }
                    }
                    other => panic!("expected filter {index} call, got {other:?}"),
                }
            }
            if kept {
                survivors.extend(worker);
            }
        }
        if survivors.is_empty() {
            return end(Err(SelectionError::AllEligibleWorkersFiltered), events);
        }
        // Scorers, summed; every contribution and running total finite.
        let n = survivors.len();
        let mut total = vec![0.0f64; n];
        for (index, &name) in SCORER_NAMES.iter().enumerate() {
            match events.next() {
                Some(Event::Scorer {
                    index: i,
                    workers,
                    active,
                    written,
                    outcome,
                }) if *i == index => {
                    assert_eq!(workers, &survivors, "scorer {index} candidates");
                    if let Some(active) = active {
                        for (w, a) in workers.iter().zip(active) {
                            assert_eq!(*a, model.count(bookings, *w), "LOAD active_requests of {w}");
                        }
                    }
                    match outcome {
                        Outcome::Ok(()) => {}
                        Outcome::Failed => return end(failed(), events),
                        Outcome::Panicked { string } => {
                            return end(panicked(PluginKind::Scorer, name, *string), events)
                        }
                    }
                    for (row, (t, &x)) in total.iter_mut().zip(written).enumerate() {
                        let sum = *t + x;
                        if !x.is_finite() || !sum.is_finite() {
                            let e = WorkerSelectionPolicyError::NonFiniteCost {
                                scorer_index: index,
                                scorer: name,
                                row,
                            };
                            return end(Err(e.into()), events);
                        }
                        *t = sum;
                    }
                }
                other => panic!("expected scorer {index} call, got {other:?}"),
            }
        }
        // The picker.
        let row = match events.next() {
            Some(Event::Picker {
                workers,
                costs,
                outcome,
            }) => {
                assert_eq!(workers, &survivors, "picker candidates");
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(costs), bits(&total), "picker costs are the scorers' sums");
                match outcome {
                    Outcome::Ok(row) => *row,
                    Outcome::Failed => return end(failed(), events),
                    Outcome::Panicked { string } => {
                        return end(panicked(PluginKind::Picker, PICKER_NAME, *string), events)
                    }
                }
            }
            other => panic!("expected picker call, got {other:?}"),
        };
        if row >= n {
            let e = WorkerSelectionPolicyError::InvalidPickerRow {
                row,
                candidate_count: n,
            };
            return end(Err(e.into()), events);
        }
        let chosen = survivors[row];
        if preview || model.has_room(bookings, chosen) {
            return end(Ok(chosen), events);
        }
        // Booking refused: rescan without the row.
        remaining.retain(|w| *w != chosen);
        if remaining.is_empty() {
            break;
        }
    }
    end(Err(SelectionError::AllEligibleWorkersOverloaded), events)
}

// ---- the run -------------------------------------------------------------

fn check_counters(service: &WorkerSelectionService, model: &Model, bookings: &[(Selection<'_>, ModelBooking)]) {
    let ids: Vec<WorkerId> = service.workers().iter().map(|r| r.worker_id).collect();
    assert_eq!(
        ids,
        model.workers.keys().copied().collect::<Vec<_>>(),
        "registered workers"
    );
    for m in model.workers.values() {
        let status = service.worker_status(m.record.worker_id).expect("registered");
        assert_eq!(status.record, m.record);
        let ranks: Vec<_> = status.ranks.iter().map(|r| r.dp_rank).collect();
        assert_eq!(ranks, m.record.dp_ranks().collect::<Vec<_>>());
        for r in &status.ranks {
            let w = WorkerWithDpRank::new(m.record.worker_id, r.dp_rank);
            let mine: Vec<&Selection<'_>> = bookings
                .iter()
                .filter(|(_, b)| b.worker == w && model.current(b))
                .map(|(s, _)| s)
                .collect();
            assert_eq!(
                r.active_requests as usize,
                mine.len(),
                "{w}: active requests vs outstanding bookings"
            );
            let prefill: u32 = mine.iter().map(|s| s.prefill_tokens()).sum();
            let decode: u32 = mine.iter().map(|s| s.decode_blocks()).sum();
            assert_eq!(
                r.active_prefill_tokens, prefill,
                "{w}: prefill tokens vs outstanding bookings"
            );
            assert_eq!(
                r.active_decode_blocks, decode,
                "{w}: decode blocks vs outstanding bookings"
            );
        }
    }
}

/// Runs one request with `script` and checks the answer against [`predict`].
fn request<'s>(
    service: &'s WorkerSelectionService,
    state: &Shared,
    model: &Model,
    bookings: &[(Selection<'s>, ModelBooking)],
    script: Script,
    req: &SelectionRequest<'_>,
    preview: bool,
) -> Result<Option<Selection<'s>>, SelectionError> {
    {
        let mut s = lock(state);
        s.script = Some(script);
        s.room = model
            .live_ranks()
            .into_iter()
            .filter(|w| model.has_room(bookings, *w))
            .collect();
        s.filter_calls = [0; 2];
        s.log.clear();
    }
    let (got, selection) = if preview {
        match service.peek(req) {
            Ok(p) => {
                assert_eq!(p.explanation.chosen, p.worker);
                (Ok(p.worker), None)
            }
            Err(e) => (Err(e), None),
        }
    } else {
        match service.select(req) {
            Ok(s) => (Ok(s.worker()), Some(s)),
            Err(e) => (Err(e), None),
        }
    };
    let log = std::mem::take(&mut lock(state).log);
    let expected = predict(&log, model, bookings, preview);
    assert_eq!(got, expected, "{script:?}, preview {preview}; plugin log {log:?}");
    got.map(|_| selection)
}

/// After a failed request: a well-behaved script on the same service, and a
/// built-in policy on the same thread, still select.
fn still_serves<'s>(
    service: &'s WorkerSelectionService,
    twin: &WorkerSelectionService,
    state: &Shared,
    model: &Model,
    bookings: &[(Selection<'s>, ModelBooking)],
) {
    let req = SelectionRequest::new(64);
    let room = model.live_ranks().iter().any(|w| model.has_room(bookings, *w));
    let live = !model.live_ranks().is_empty();
    let peeked = request(service, state, model, bookings, WELL_BEHAVED, &req, true);
    assert_eq!(peeked.is_ok(), live, "well-behaved peek after a failure: {peeked:?}");
    let selected = request(service, state, model, bookings, WELL_BEHAVED, &req, false);
    assert_eq!(
        selected.is_ok(),
        room,
        "well-behaved select after a failure: {selected:?}"
    );
    drop(selected);
    let builtin = twin.select(&req);
    assert_eq!(
        builtin.is_ok(),
        live,
        "built-in least-loaded after a failure: {builtin:?}"
    );
}

/// The whole check: panics on any deviation.
pub fn check(input: &Input) {
    quiet_scripted_panics();
    let state: Shared = Arc::default();
    let policy = WorkerSelectionPolicy::new_with_filters(
        KvRouterConfig::default(),
        WorkerType::Aggregated,
        (0..2)
            .map(|index| {
                Box::new(ScriptedFilter {
                    index,
                    state: state.clone(),
                }) as Box<dyn WorkerFilter>
            })
            .collect(),
        (0..3)
            .map(|index| {
                Box::new(ScriptedScorer {
                    index,
                    state: state.clone(),
                }) as Box<dyn WorkerScorer>
            })
            .collect(),
        Box::new(ScriptedPicker { state: state.clone() }),
    );
    let config = ServiceConfig {
        seed: Some(7),
        ..ServiceConfig::default()
    };
    let service = WorkerSelectionService::new(policy, config.clone());
    let twin = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), config);
    let mut model = Model::default();
    let mut bookings: Vec<(Selection<'_>, ModelBooking)> = Vec::new();

    let adds = input.workers.iter().take(8).map(|w| Op::Add(*w));
    for op in adds.chain(input.ops.iter().take(64).copied()) {
        match op {
            Op::Select { isl, explained, script } => {
                let mut req = SelectionRequest::new(isl as usize);
                if explained {
                    req = req.explained();
                }
                match request(&service, &state, &model, &bookings, script, &req, false) {
                    Ok(Some(s)) => {
                        assert_eq!(s.prefill_tokens(), u32::from(isl), "booked prefill tokens");
                        assert_eq!(s.decode_blocks(), u32::from(isl).div_ceil(16), "booked decode blocks");
                        let worker = s.worker();
                        let incarnation = model.incarnation_of(worker).expect("selected a registered rank");
                        bookings.push((s, ModelBooking { worker, incarnation }));
                    }
                    Ok(None) => unreachable!("select books"),
                    Err(_) => still_serves(&service, &twin, &state, &model, &bookings),
                }
            }
            Op::Peek { isl, script } => {
                let req = SelectionRequest::new(isl as usize);
                if request(&service, &state, &model, &bookings, script, &req, true).is_err() {
                    still_serves(&service, &twin, &state, &model, &bookings);
                }
            }
            Op::Release { booking } if !bookings.is_empty() => {
                let i = booking as usize % bookings.len();
                drop(bookings.swap_remove(i));
            }
            Op::PrefillComplete { booking } if !bookings.is_empty() => {
                let i = booking as usize % bookings.len();
                bookings[i].0.prefill_complete();
                assert_eq!(bookings[i].0.prefill_tokens(), 0);
            }
            Op::OutputBlock { booking } if !bookings.is_empty() => {
                let i = booking as usize % bookings.len();
                let before = bookings[i].0.decode_blocks();
                let current = model.current(&bookings[i].1);
                let worker = bookings[i].1.worker;
                // A booking whose worker was removed may still add blocks while
                // its row is free (the kernel refuses once the row is reused);
                // the counter checks catch a block landing on a new occupant.
                match bookings[i].0.add_output_block() {
                    Ok(()) => assert_eq!(bookings[i].0.decode_blocks(), before + 1),
                    Err(e) => {
                        assert!(!current, "output block refused on current worker {worker}: {e}");
                        assert_eq!(e, BookingError::WorkerGone { worker });
                    }
                }
            }
            Op::Retarget { booking, worker, rank } if !bookings.is_empty() => {
                let i = booking as usize % bookings.len();
                let to = WorkerWithDpRank::new(u64::from(worker % 6), u32::from(rank % 4));
                let got = bookings[i].0.retarget(to);
                let expected = match model.incarnation_of(to) {
                    None => Err(vec![BookingError::UnknownWorker { worker: to }]),
                    Some(inc) if bookings[i].1.worker == to && bookings[i].1.incarnation == inc => Ok(()),
                    Some(_) => {
                        let live = model.workers[&to.worker_id].record.state == WorkerState::Live;
                        let full = !model.has_room(&bookings, to);
                        let mut refusals = Vec::new();
                        if !live {
                            refusals.push(BookingError::NotLive { worker: to });
                        }
                        if full {
                            let limit = model.limit(to) as u32;
                            refusals.push(BookingError::Overloaded { worker: to, limit });
                        }
                        if refusals.is_empty() {
                            Ok(())
                        } else {
                            Err(refusals)
                        }
                    }
                };
                match (&got, &expected) {
                    (Ok(()), Ok(())) => {
                        let inc = model.incarnation_of(to).expect("checked");
                        bookings[i].1 = ModelBooking {
                            worker: to,
                            incarnation: inc,
                        };
                        assert_eq!(bookings[i].0.worker(), to);
                    }
                    (Err(e), Err(allowed)) if allowed.contains(e) => {}
                    _ => panic!("retarget to {to}: got {got:?}, expected {expected:?}"),
                }
            }
            Op::Release { .. } | Op::PrefillComplete { .. } | Op::OutputBlock { .. } | Op::Retarget { .. } => {}
            Op::Add(w) => {
                let r = record_of(w);
                let got = service.add_worker(r.clone());
                let twin_got = twin.add_worker(r.clone());
                assert_eq!(got.is_ok(), twin_got.is_ok());
                match got {
                    Ok(()) => {
                        assert!(r.data_parallel_size > 0 && !model.workers.contains_key(&r.worker_id));
                        model.sweep(&bookings);
                        for rank in r.dp_ranks() {
                            model.take(WorkerWithDpRank::new(r.worker_id, rank));
                        }
                        model.workers.insert(r.worker_id, ModelWorker { record: r });
                    }
                    Err(DiscoveryError::InvalidWorker { worker_id, .. }) => {
                        assert_eq!((worker_id, r.data_parallel_size), (r.worker_id, 0))
                    }
                    Err(DiscoveryError::DuplicateWorker { worker_id }) => {
                        assert!(worker_id == r.worker_id && model.workers.contains_key(&worker_id))
                    }
                    Err(e) => panic!("add {r:?}: {e}"),
                }
            }
            Op::Update(w) => {
                let r = record_of(w);
                let got = service.update_worker(r.clone());
                let twin_got = twin.update_worker(r.clone());
                assert_eq!(got.is_ok(), twin_got.is_ok());
                match got {
                    Ok(()) => {
                        model.sweep(&bookings);
                        let old = model.workers[&r.worker_id].record.dp_ranks();
                        for rank in old.clone().filter(|x| !r.dp_ranks().contains(x)) {
                            model.release(&bookings, WorkerWithDpRank::new(r.worker_id, rank));
                        }
                        for rank in r.dp_ranks().filter(|x| !old.contains(x)) {
                            model.take(WorkerWithDpRank::new(r.worker_id, rank));
                        }
                        model
                            .workers
                            .get_mut(&r.worker_id)
                            .expect("update of a registered worker")
                            .record = r.clone();
                    }
                    Err(DiscoveryError::InvalidWorker { worker_id, .. }) => {
                        assert_eq!((worker_id, r.data_parallel_size), (r.worker_id, 0))
                    }
                    Err(DiscoveryError::UnknownWorker { worker_id }) => {
                        assert!(worker_id == r.worker_id && !model.workers.contains_key(&worker_id))
                    }
                    Err(e) => panic!("update {r:?}: {e}"),
                }
            }
            Op::Remove { id } => {
                let id = u64::from(id % 6);
                let got = service.remove_worker(id);
                let _ = twin.remove_worker(id);
                match got {
                    Ok(()) => {
                        let m = model.workers.remove(&id).expect("registered");
                        for rank in m.record.dp_ranks() {
                            model.release(&bookings, WorkerWithDpRank::new(id, rank));
                        }
                        model.sweep(&bookings);
                    }
                    Err(DiscoveryError::UnknownWorker { worker_id }) => {
                        assert!(worker_id == id && !model.workers.contains_key(&id))
                    }
                    Err(e) => panic!("remove {id}: {e}"),
                }
            }
            Op::SetState { id, state: st } => {
                let id = u64::from(id % 6);
                let st = [WorkerState::Live, WorkerState::Draining, WorkerState::Cordoned][(st % 3) as usize];
                let got = service.set_worker_state(id, st);
                let _ = twin.set_worker_state(id, st);
                match got {
                    Ok(()) => {
                        model.sweep(&bookings);
                        model.workers.get_mut(&id).expect("registered").record.state = st;
                    }
                    Err(DiscoveryError::UnknownWorker { worker_id }) => {
                        assert!(worker_id == id && !model.workers.contains_key(&id))
                    }
                    Err(e) => panic!("set_state {id}: {e}"),
                }
            }
        }
        check_counters(&service, &model, &bookings);
    }
    still_serves(&service, &twin, &state, &model, &bookings);
    bookings.clear();
    check_counters(&service, &model, &bookings);
    for m in model.workers.values() {
        let status = service.worker_status(m.record.worker_id).expect("registered");
        for r in status.ranks {
            assert_eq!(
                (r.active_requests, r.active_prefill_tokens, r.active_decode_blocks),
                (0, 0, 0),
                "worker {} rank {} leaked load",
                m.record.worker_id,
                r.dp_rank
            );
        }
    }
}
