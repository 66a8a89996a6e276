//! The discrete-event loop: arrivals are routed through a [`Router`] using
//! the overlaps the simulated caches report, engines step, and every
//! request's milestones are recorded in a [`RunRecord`].
//!
//! Events are kept in a binary heap ordered by time, ties by insertion order,
//! so a run is a pure function of its workload, fleet and router.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use super::engine::{Engine, StepEvent, TimingModel};
use super::index::OverlapIndex;
use super::router::{RouteRequest, Router, RowOverlap};
use super::workload::Workload;
use super::SimError;

/// KV cache tokens of a typical GPU worker, the capacity a trace replays
/// with when none is given: an 8B-parameter model (Llama 3.1 8B: 32 layers,
/// 8 KV heads of 128 dimensions, 16-bit keys and values, so 128 KiB per
/// token) served on one 80 GiB accelerator at 90% memory utilisation, less
/// 16 GB of weights and 4 GB of activations and runtime: about 437,000
/// tokens.
pub const TYPICAL_WORKER_KV_TOKENS: u64 = {
    let usable = 80 * (1u64 << 30) / 10 * 9 - 16_060_000_000 - 4_000_000_000;
    let per_token = 2 * 32 * 8 * 128 * 2;
    usable / per_token
};

/// A class of workers in a mixed fleet: faster or slower accelerators,
/// larger or smaller caches, CPU workers. Classes take the fleet's workers in
/// order (the first class the first `workers` of them, and so on); workers no
/// class takes are of the fleet's own model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerClass {
    /// Workers of this class.
    pub workers: u32,
    /// Speed relative to the fleet's timing model: every step takes
    /// `1 / speed` times as long (2.0: twice as fast).
    #[serde(default = "one")]
    pub speed: f64,
    /// KV cache capacity of each rank, in blocks (default: the fleet's).
    #[serde(default)]
    pub kv_blocks: Option<u32>,
    /// The capacity weight discovery reports for these workers (what the
    /// weighted policies read; default 1).
    #[serde(default = "one")]
    pub capacity_weight: f64,
    /// The workers run on CPUs (what `device-aware-weighted` reads).
    #[serde(default)]
    pub cpu: bool,
    /// Data-parallel ranks of each of these workers (default: the fleet's).
    #[serde(default)]
    pub dp_size: Option<u32>,
}

fn one() -> f64 {
    1.0
}

/// The model of one rank: its worker's class applied to the fleet's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankModel {
    /// Step timing, scaled by the class's speed.
    pub timing: TimingModel,
    /// KV cache capacity, in blocks.
    pub kv_blocks: u32,
    /// Capacity weight given to discovery.
    pub capacity_weight: f64,
    /// A CPU worker.
    pub cpu: bool,
    /// Data-parallel ranks of the worker.
    pub dp_size: u32,
}

/// The simulated fleet: `workers` workers of `dp_size` ranks each; every rank
/// is one engine with its own KV cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSpec {
    /// Number of workers.
    pub workers: u32,
    /// Data-parallel ranks per worker.
    pub dp_size: u32,
    /// KV cache capacity of each rank, in blocks.
    pub kv_blocks: u32,
    /// Speed of each rank.
    pub timing: TimingModel,
    /// The router's admission limit per rank (requests in flight), given to
    /// the selection service; a request every eligible rank refuses is
    /// counted as failed. `None`: no limit.
    #[serde(default)]
    pub max_active_requests: Option<u32>,
    /// Classes of workers that differ from the fleet's model (see
    /// [`WorkerClass`]); empty: every worker is alike.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<WorkerClass>,
    /// Router replicas, each with its own selection service; requests are
    /// spread over them in turn (1: one router).
    #[serde(default = "one_router", skip_serializing_if = "is_one")]
    pub routers: u32,
    /// With several routers, how long a replica's bookings (book, prefill
    /// complete, release) take to reach its peers, in ms; `None`: never
    /// (replicas without sync).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_delay_ms: Option<f64>,
}

fn one_router() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// The window of the herding column when no sync delay sets it, in ms.
pub const DEFAULT_HERD_WINDOW_MS: f64 = 10.0;

impl FleetSpec {
    /// The window in which herding is counted: the sync delay of several
    /// synced routers, else [`DEFAULT_HERD_WINDOW_MS`].
    pub fn herd_window_ms(&self) -> f64 {
        match self.sync_delay_ms {
            Some(d) if self.routers > 1 && d > 0.0 => d,
            _ => DEFAULT_HERD_WINDOW_MS,
        }
    }

    /// Number of ranks (rows).
    pub fn rows(&self) -> usize {
        let rows = self
            .runs()
            .fold(0u64, |a, (_, n, dp)| a.saturating_add(u64::from(n) * u64::from(dp)));
        usize::try_from(rows).unwrap_or(usize::MAX)
    }

    /// The model of worker `worker` (0-based): its class's, else the
    /// fleet's.
    pub fn worker_model(&self, worker: u32) -> RankModel {
        let mut first = 0u32;
        for class in &self.classes {
            if worker < first.saturating_add(class.workers) {
                let speed = class.speed;
                return RankModel {
                    timing: TimingModel {
                        step_overhead_ms: self.timing.step_overhead_ms / speed,
                        prefill_ms_per_token: self.timing.prefill_ms_per_token / speed,
                        decode_ms_per_seq: self.timing.decode_ms_per_seq / speed,
                        ..self.timing
                    },
                    kv_blocks: class.kv_blocks.unwrap_or(self.kv_blocks),
                    capacity_weight: class.capacity_weight,
                    cpu: class.cpu,
                    dp_size: class.dp_size.unwrap_or(self.dp_size).max(1),
                };
            }
            first = first.saturating_add(class.workers);
        }
        RankModel {
            timing: self.timing,
            kv_blocks: self.kv_blocks,
            capacity_weight: 1.0,
            cpu: false,
            dp_size: self.dp_size.max(1),
        }
    }

    /// The workers' runs of rows, in worker order: `(first worker, workers,
    /// ranks of each)` per class, then the workers of the fleet's own model.
    fn runs(&self) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
        let workers = self.workers.max(1);
        let mut first = 0u32;
        let classes = self.classes.iter().map(move |c| {
            let run = (
                first,
                c.workers.min(workers.saturating_sub(first)),
                c.dp_size.unwrap_or(self.dp_size).max(1),
            );
            first = first.saturating_add(c.workers).min(workers);
            run
        });
        let classed = self
            .classes
            .iter()
            .fold(0u32, |a, c| a.saturating_add(c.workers))
            .min(workers);
        classes.chain(std::iter::once((classed, workers - classed, self.dp_size.max(1))))
    }

    /// The first row of worker `worker` (0-based; its ranks' rows follow).
    pub fn first_row(&self, worker: u32) -> usize {
        let mut row = 0usize;
        for (first, n, dp) in self.runs() {
            if worker < first + n {
                return row + (worker - first) as usize * dp as usize;
            }
            row += n as usize * dp as usize;
        }
        row
    }

    /// Total KV cache blocks of every rank.
    pub fn total_kv_blocks(&self) -> u64 {
        (0..self.workers.max(1))
            .map(|w| {
                let m = self.worker_model(w);
                u64::from(m.kv_blocks) * u64::from(m.dp_size)
            })
            .sum()
    }

    /// The worker (0-based) and rank of a row: rows are worker-major.
    pub fn worker_and_rank(&self, row: usize) -> (u32, u32) {
        let mut start = 0usize;
        let mut last = (0, 0);
        for (first, n, dp) in self.runs() {
            let dp_rows = dp as usize;
            let end = start + n as usize * dp_rows;
            if row < end {
                let at = row - start;
                return (first + (at / dp_rows) as u32, (at % dp_rows) as u32);
            }
            if n > 0 {
                last = (first + n - 1, dp - 1);
            }
            start = end;
        }
        last
    }
}

/// Milestones of one request (times in ms; NaN when it never got there).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestRecord {
    /// The rank it was routed to (`None`: the router refused it).
    pub row: Option<u32>,
    /// Arrival.
    pub arrival_ms: f64,
    /// First token.
    pub first_token_ms: f64,
    /// Last token.
    pub finish_ms: f64,
    /// Prompt tokens served from the rank's cache.
    pub cached_tokens: u32,
    /// The longest prompt prefix any rank held when the request was routed,
    /// in tokens (as the engine would serve it: at most the prompt less one
    /// token).
    pub best_cached_tokens: u32,
    /// The prefix the chosen rank held when the request was routed, in
    /// tokens (same rule).
    pub routed_cached_tokens: u32,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Time the router spent selecting, in ns.
    pub selection_ns: u64,
}

/// Everything one simulated run produced.
#[derive(Clone, Debug)]
pub struct RunRecord {
    /// Per request, in workload order.
    pub requests: Vec<RequestRecord>,
    /// Time the last request finished, in ms.
    pub makespan_ms: f64,
    /// Per rank: integral of in-flight requests over time (request·ms).
    pub load_area: Vec<f64>,
    /// Sample times of `load_samples`, in ms.
    pub sample_times_ms: Vec<f64>,
    /// In-flight requests per rank at each sample time.
    pub load_samples: Vec<Vec<u32>>,
    /// Router refusals, with the first message.
    pub failures: usize,
    /// The first refusal's message.
    pub first_failure: Option<String>,
    /// The window of the herding measure ([`FleetSpec::herd_window_ms`]).
    pub herd_window_ms: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Arrival(usize),
    StepDone(usize),
    Sample,
}

#[derive(Clone, Copy, Debug)]
struct Event {
    at: f64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    /// Reversed: the earliest event is the heap's maximum.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.seq.cmp(&self.seq))
    }
}

struct Queue {
    heap: BinaryHeap<Event>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at: f64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Event {
            at,
            seq: self.seq,
            kind,
        });
    }
}

/// Keeps every other element, the first included.
fn thin<T>(v: &mut Vec<T>) {
    let mut i = 0;
    v.retain(|_| {
        i += 1;
        i % 2 == 1
    });
}

/// Number of load samples taken over a run (for the load-over-time plot).
pub const LOAD_SAMPLES: usize = 240;

/// Runs `workload` on `fleet` with `router`. `progress` is called with the
/// number of requests routed so far, every 64 arrivals and at the end.
///
/// A router whose service counts blocks of another size than the
/// workload's ([`Router::block_size`]) is refused before any request is
/// routed ([`SimError::BlockSizeMismatch`]).
pub fn simulate(
    workload: &Workload,
    fleet: &FleetSpec,
    router: &mut dyn Router,
    progress: &mut dyn FnMut(usize),
) -> Result<RunRecord, SimError> {
    if let Some(b) = router.block_size().filter(|&b| b != workload.block_size) {
        return Err(SimError::BlockSizeMismatch {
            workload: workload.block_size,
            router: b,
        });
    }
    let rows = fleet.rows();
    let reqs = &workload.requests;
    let bs = workload.block_size;
    let models: Vec<RankModel> = (0..rows)
        .map(|row| fleet.worker_model(fleet.worker_and_rank(row).0))
        .collect();
    let mut engines: Vec<Engine> = models.iter().map(|m| Engine::new(m.kv_blocks)).collect();
    let mut records: Vec<RequestRecord> = reqs
        .iter()
        .map(|r| RequestRecord {
            row: None,
            arrival_ms: r.arrival_ms,
            first_token_ms: f64::NAN,
            finish_ms: f64::NAN,
            cached_tokens: 0,
            best_cached_tokens: 0,
            routed_cached_tokens: 0,
            input_tokens: r.input_tokens,
            selection_ns: 0,
        })
        .collect();
    let mut queue = Queue {
        heap: BinaryHeap::with_capacity(rows + 16),
        seq: 0,
    };
    if let Some(first) = reqs.first() {
        queue.push(first.arrival_ms, Kind::Arrival(0));
    }
    let span = reqs.last().map_or(0.0, |r| r.arrival_ms);
    // Sample the load at a fixed interval sized to the arrival span (the
    // tail after the last arrival is sampled at the same pace). A tail much
    // longer than the span (a long output) thins the samples taken so far
    // to every other one and doubles the interval, so at most
    // `2 * LOAD_SAMPLES` are ever held.
    let mut sample_every = (span / LOAD_SAMPLES as f64).max(1.0);
    queue.push(0.0, Kind::Sample);
    let mut load_area = vec![0.0; rows];
    let mut last_change = vec![0.0; rows];
    let mut sample_times = Vec::new();
    let mut samples = Vec::new();
    let mut overlaps: Vec<RowOverlap> = Vec::with_capacity(rows);
    let mut index = OverlapIndex::new(rows);
    let mut events = Vec::new();
    let mut outstanding = 0usize;
    let (mut failures, mut first_failure) = (0, None);
    let mut now = 0.0;

    let touch = |row: usize, now: f64, engines: &[Engine], area: &mut [f64], last: &mut [f64]| {
        area[row] += engines[row].in_flight() as f64 * (now - last[row]);
        last[row] = now;
    };

    while let Some(ev) = queue.heap.pop() {
        now = ev.at;
        router.advance_to(now);
        match ev.kind {
            Kind::Arrival(i) => {
                if i + 1 < reqs.len() {
                    queue.push(reqs[i + 1].arrival_ms, Kind::Arrival(i + 1));
                }
                let r = &reqs[i];
                index.overlaps(&r.hash_ids, &mut overlaps);
                // Debug builds (the tests) check the index against the
                // caches themselves on every request.
                if cfg!(debug_assertions) {
                    let caches: Vec<RowOverlap> = (0..rows)
                        .filter_map(|row| {
                            let blocks = engines[row].cache.prefix_match(&r.hash_ids);
                            (blocks > 0).then_some(RowOverlap {
                                row: row as u32,
                                blocks,
                            })
                        })
                        .collect();
                    assert_eq!(overlaps, caches, "request {i}: the KV index disagrees with the caches");
                }
                let route = RouteRequest {
                    id: i as u64,
                    input_tokens: r.input_tokens,
                    output_tokens: r.output_tokens,
                    overlaps: &overlaps,
                    prompt_blocks: &r.hash_ids,
                    session: r.session,
                };
                // What the engine would serve from `blocks` cached blocks.
                let served = |blocks: u32| blocks.saturating_mul(bs).min(r.input_tokens.saturating_sub(1));
                records[i].best_cached_tokens = served(overlaps.iter().map(|o| o.blocks).max().unwrap_or(0));
                match router.select(&route) {
                    Ok(routed) if routed.row < rows => {
                        let row = routed.row;
                        records[i].row = Some(row as u32);
                        records[i].routed_cached_tokens =
                            served(overlaps.iter().find(|o| o.row as usize == row).map_or(0, |o| o.blocks));
                        records[i].selection_ns = routed.selection_ns;
                        touch(row, now, &engines, &mut load_area, &mut last_change);
                        engines[row].enqueue(i);
                        outstanding += 1;
                        if !engines[row].is_stepping() {
                            start(
                                &mut engines[row],
                                row,
                                now,
                                reqs,
                                bs,
                                &models[row].timing,
                                &mut records,
                                &mut queue,
                                &mut events,
                            );
                            index.apply(row, engines[row].cache.drain_changes());
                        }
                    }
                    Ok(routed) => {
                        router.release(i as u64);
                        failures += 1;
                        first_failure.get_or_insert_with(|| format!("router chose row {} of {rows}", routed.row));
                    }
                    Err(e) => {
                        failures += 1;
                        first_failure.get_or_insert_with(|| e.to_string());
                    }
                }
                if i % 64 == 63 {
                    progress(i + 1);
                }
            }
            Kind::StepDone(row) => {
                touch(row, now, &engines, &mut load_area, &mut last_change);
                events.clear();
                engines[row].finish_step(reqs, bs, &mut events);
                index.apply(row, engines[row].cache.drain_changes());
                for &e in &events {
                    match e {
                        StepEvent::FirstToken(r) => {
                            records[r].first_token_ms = now;
                            router.prefill_complete(r as u64);
                        }
                        StepEvent::OutputBlock(r) => router.output_block(r as u64),
                        StepEvent::Finished(r) => {
                            records[r].finish_ms = now;
                            router.release(r as u64);
                            outstanding -= 1;
                        }
                        StepEvent::Admitted { .. } => {}
                    }
                }
                start(
                    &mut engines[row],
                    row,
                    now,
                    reqs,
                    bs,
                    &models[row].timing,
                    &mut records,
                    &mut queue,
                    &mut events,
                );
                index.apply(row, engines[row].cache.drain_changes());
            }
            Kind::Sample => {
                sample_times.push(now);
                samples.push(engines.iter().map(|e| e.in_flight() as u32).collect());
                if samples.len() >= 2 * LOAD_SAMPLES {
                    thin(&mut sample_times);
                    thin(&mut samples);
                    sample_every *= 2.0;
                }
                let arrivals_left = queue.heap.iter().any(|e| matches!(e.kind, Kind::Arrival(_)));
                if arrivals_left || outstanding > 0 {
                    queue.push(now + sample_every, Kind::Sample);
                }
            }
        }
    }
    progress(reqs.len());
    let makespan = records
        .iter()
        .map(|r| r.finish_ms)
        .filter(|t| t.is_finite())
        .fold(0.0, f64::max)
        .max(now);
    for row in 0..rows {
        touch(row, makespan, &engines, &mut load_area, &mut last_change);
    }
    Ok(RunRecord {
        requests: records,
        makespan_ms: makespan,
        load_area,
        sample_times_ms: sample_times,
        load_samples: samples,
        failures,
        first_failure,
        herd_window_ms: fleet.herd_window_ms(),
    })
}

/// Starts a step on an idle engine, if it has work, and records admissions.
#[allow(clippy::too_many_arguments)]
fn start(
    engine: &mut Engine,
    row: usize,
    now: f64,
    reqs: &[super::workload::SimRequest],
    bs: u32,
    timing: &TimingModel,
    records: &mut [RequestRecord],
    queue: &mut Queue,
    events: &mut Vec<StepEvent>,
) {
    events.clear();
    if let Some(duration) = engine.start_step(reqs, bs, timing, events) {
        queue.push(now + duration, Kind::StepDone(row));
    }
    for &e in events.iter() {
        if let StepEvent::Admitted { request, cached_tokens } = e {
            records[request].cached_tokens = cached_tokens;
        }
    }
}
