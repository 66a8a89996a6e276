//! selkie's kernel path: a [`Scenario`] as load columns, the request's overlap as
//! a sparse list of hits, and the measured call, [`SelkieFixture::select`],
//! which does all the per-request work Dynamo's `select_worker` does:
//!
//! ```text
//! eligibility: copy the fleet's selectable rows       (Fleet source only; Dynamo: per-worker checks)
//! clear the dense per-request overlap columns (device blocks, cached tokens)
//! scatter the sparse hits into them                  (Dynamo: one map lookup per worker)
//! kv_cost over every row                             (SIMD, f32)
//! pick at the temperature                            (argmin, or softmax with one draw)
//! ```
//!
//! The load columns come from a [`LoadSource`]: a real kernel `Fleet` whose
//! counters hold the scenario's load as bookings (the default), or plain
//! `u32` slices (the same numbers, no atomics). The public service's path is
//! [`ServiceFixture`](super::ServiceFixture).
//!
//! A hit names its worker by fleet row: selkie's host translates worker ids
//! to rows once, when it records the cache index, not per request (per request,
//! the caller supplies overlap columns).
//!
//! This module must not know about Dynamo.

use core::num::NonZeroU32;
use std::hint::black_box;
use std::sync::Arc;

use selkie_kernel::fleet::{BookLoad, Booking, Fleet, WorkerSpec};
use selkie_kernel::kernels::kv_cost::{kv_cost, CostRange, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole};
use selkie_kernel::kernels::pick::pick;
use selkie_kernel::lanes::{padded_rows, U32Source};
use selkie_kernel::Rng;

use super::{Scenario, ScenarioWorker, BLOCK_SIZE, PROMPT_TOKENS};

/// Lane groups of the benchmark's fleet: 1,280 * 8 = 10,240 rows, enough for
/// the largest scenario.
pub const FLEET_GROUPS: usize = 1_280;

/// The benchmark's fleet type.
pub type BenchFleet = Fleet<FLEET_GROUPS>;

/// One worker's cache hit for the request, as the cache index reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OverlapHit {
    /// The worker's fleet row.
    pub row: u32,
    /// Device overlap blocks (Dynamo's effective overlap: no scenario has
    /// per-tier overlaps).
    pub device_blocks: f32,
    /// Estimated cached tokens.
    pub cached_tokens: u32,
}

/// Where selkie reads the load columns from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadSource {
    /// A kernel [`Fleet`]: one slot per worker, the scenario's load held by
    /// [`Booking`] guards in its tagged atomic counters, read through
    /// `AtomicView`s; the eligibility mask is copied from the fleet's
    /// selectable rows on every call.
    Fleet,
    /// Plain `u32` slices padded to whole lane groups, and a fixed mask.
    Slices,
}

impl LoadSource {
    /// Both sources, the default first.
    pub const ALL: [LoadSource; 2] = [LoadSource::Fleet, LoadSource::Slices];

    /// A short name: `"fleet"` or `"slices"`.
    pub fn name(self) -> &'static str {
        match self {
            LoadSource::Fleet => "fleet",
            LoadSource::Slices => "slices",
        }
    }

    /// How the benchmark describes the source.
    pub fn describe(self) -> &'static str {
        match self {
            LoadSource::Fleet => {
                "a kernel Fleet<1280> (10,240 slots): workers added, load booked with Booking guards, \
                 columns read as AtomicViews of tagged counters, eligibility copied from the \
                 fleet's selectable bits on every call"
            }
            LoadSource::Slices => "plain u32 slices (padded to whole lane groups), fixed eligibility mask",
        }
    }
}

/// The load columns.
enum Loads {
    Fleet {
        fleet: Arc<BenchFleet>,
        /// The guards that hold the scenario's load; dropping them releases
        /// it.
        _bookings: Vec<Booking<Arc<BenchFleet>, FLEET_GROUPS>>,
    },
    Slices {
        active_prefill_tokens: Vec<u32>,
        active_decode_blocks: Vec<u32>,
        active_requests: Vec<u32>,
    },
}

/// A scenario as selkie's kernel sees it, with the preallocated per-request
/// scratch.
pub struct SelkieFixture {
    workers: usize,
    loads: Loads,
    eligible: Vec<u64>,
    hits: Vec<OverlapHit>,
    config: KvCostConfig,
    request: KvRequest,
    scratch: Scratch,
    rng: Rng,
}

/// Per-request columns, allocated once and overwritten by every call.
struct Scratch {
    device_blocks: Vec<f32>,
    cached_tokens: Vec<f32>,
    costs: Vec<f32>,
}

impl SelkieFixture {
    /// `scenario`'s workers (row `id` is worker `id`), every row eligible,
    /// default cost config, the request's hits in row order.
    ///
    /// # Panics
    /// If the scenario exceeds the fleet's capacity, or the fleet refuses a
    /// worker or a booking.
    pub fn new(scenario: &Scenario, source: LoadSource) -> Self {
        let n = scenario.len();
        let rows = padded_rows(n);
        let workers = scenario.workers();
        let loads = match source {
            LoadSource::Fleet => fleet_loads(workers),
            LoadSource::Slices => {
                let column = |f: fn(&ScenarioWorker) -> u32| {
                    let mut c: Vec<u32> = workers.iter().map(f).collect();
                    c.resize(rows, 0);
                    c
                };
                Loads::Slices {
                    active_prefill_tokens: column(|w| w.active_prefill_tokens),
                    active_decode_blocks: column(|w| w.active_decode_blocks),
                    active_requests: column(|w| w.active_requests),
                }
            }
        };
        // One hit per overlap entry Dynamo gets (its fixture has one for
        // every worker, zero hits included).
        let hits = scenario
            .hits()
            .map(|(row, hit)| OverlapHit {
                row,
                device_blocks: hit.device_blocks as f32,
                cached_tokens: hit.cached_tokens,
            })
            .collect();
        SelkieFixture {
            workers: n,
            loads,
            eligible: crate::all_eligible(rows),
            hits,
            config: KvCostConfig::default(),
            request: KvRequest::new(
                PROMPT_TOKENS,
                NonZeroU32::new(BLOCK_SIZE).expect("block size is not 0"),
                true,
                WorkerRole::Prefill,
            ),
            scratch: Scratch {
                device_blocks: vec![0.0; rows],
                cached_tokens: vec![0.0; rows],
                costs: vec![0.0; rows],
            },
            rng: Rng::new(0x005e_1c1e),
        }
        .with_mask()
    }

    /// Replaces the cost configuration (the parity tests break it on
    /// purpose).
    pub fn with_config(mut self, config: KvCostConfig) -> Self {
        self.config = config;
        self
    }

    /// The initial eligibility: the fleet's selectable rows, or rows `0..n`.
    fn with_mask(mut self) -> Self {
        self.eligible.fill(0);
        match &self.loads {
            Loads::Fleet { fleet, .. } => fleet.selectable(&mut self.eligible),
            Loads::Slices { .. } => {
                for r in 0..self.workers {
                    self.eligible[r / 64] |= 1 << (r % 64);
                }
            }
        }
        self
    }

    /// Where the load columns come from.
    pub fn load_source(&self) -> LoadSource {
        match self.loads {
            Loads::Fleet { .. } => LoadSource::Fleet,
            Loads::Slices { .. } => LoadSource::Slices,
        }
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The measured call: eligibility, scatter the request's hits, cost
    /// every row, pick one at `temperature`. Returns the row.
    #[inline]
    pub fn select(&mut self, temperature: f32) -> usize {
        self.scatter_hits();
        self.cost_rows();
        self.pick_row(temperature)
    }

    /// Stage 1 of [`select`](Self::select): refresh the eligibility mask
    /// (Fleet source), clear the per-request overlap columns and scatter
    /// the request's hits into them.
    #[inline]
    pub fn scatter_hits(&mut self) {
        if let Loads::Fleet { fleet, .. } = &self.loads {
            fleet.selectable(&mut self.eligible);
        }
        let Scratch {
            device_blocks,
            cached_tokens,
            ..
        } = &mut self.scratch;
        device_blocks.fill(0.0);
        cached_tokens.fill(0.0);
        for hit in black_box(&self.hits[..]) {
            let row = hit.row as usize;
            device_blocks[row] = hit.device_blocks;
            cached_tokens[row] = hit.cached_tokens as f32;
        }
    }

    /// Stage 2 of [`select`](Self::select): every row's KV cost from the
    /// load columns and the scattered overlap.
    #[inline]
    pub fn cost_rows(&mut self) -> CostRange {
        match &self.loads {
            Loads::Fleet { fleet, .. } => {
                let (prefill, decode, requests) = (
                    fleet.active_prefill_tokens(),
                    fleet.active_decode_blocks(),
                    fleet.active_requests(),
                );
                let load = KvLoad::new(&prefill, &decode, &requests);
                cost_into(&self.config, &self.request, &load, &self.eligible, &mut self.scratch)
            }
            Loads::Slices {
                active_prefill_tokens,
                active_decode_blocks,
                active_requests,
            } => {
                let load = KvLoad::new(
                    &active_prefill_tokens[..],
                    &active_decode_blocks[..],
                    &active_requests[..],
                );
                cost_into(&self.config, &self.request, &load, &self.eligible, &mut self.scratch)
            }
        }
    }

    /// Stage 3 of [`select`](Self::select): pick a row from the costs.
    #[inline]
    pub fn pick_row(&mut self, temperature: f32) -> usize {
        let costs = black_box(&self.scratch.costs[..]);
        pick(costs, &self.eligible, temperature, &mut self.rng)
            .expect("finite costs and a valid temperature")
            .expect("some row is eligible")
    }

    /// Every worker's cost, as [`select`](Self::select) computes it.
    pub fn costs(&mut self) -> Vec<f32> {
        self.scatter_hits();
        self.cost_rows();
        self.scratch.costs[..self.workers].to_vec()
    }

    /// The worker at `row` (rows are worker ids here).
    pub fn worker_of(&self, row: usize) -> u64 {
        row as u64
    }
}

/// `kv_cost` over `load` and the scratch's overlap columns, into its costs.
#[inline(always)]
fn cost_into<L: U32Source + ?Sized>(
    config: &KvCostConfig,
    request: &KvRequest,
    load: &KvLoad<'_, L>,
    eligible: &[u64],
    scratch: &mut Scratch,
) -> CostRange {
    let overlap = KvOverlap {
        device_blocks: Some(&scratch.device_blocks),
        cached_tokens: Some(&scratch.cached_tokens),
        ..KvOverlap::default()
    };
    kv_cost(config, request, load, &overlap, eligible, &mut scratch.costs)
        .expect("the scenario's columns are consistent")
}

/// A fleet holding a scenario: worker `id` in row `id`, its load booked.
///
/// A booking carries one request, so a worker with prefill tokens or decode
/// blocks but no requests (in Dynamo's fixture, ids that are multiples of
/// 17) holds one request instead of none. No cost term reads active
/// requests at the default `decode_active_request_weight` of 0, so the
/// costs are the scenario's.
fn fleet_loads(workers: &[ScenarioWorker]) -> Loads {
    let fleet = new_fleet();
    let mut bookings = Vec::new();
    for (id, w) in workers.iter().enumerate() {
        let slot = fleet
            .add(WorkerSpec::new(id as u64))
            .expect("the fleet has room for the scenario");
        let row = slot.row as usize;
        assert_eq!(row, id, "the fleet fills rows in order");
        let load = BookLoad {
            prefill_tokens: w.active_prefill_tokens,
            decode_blocks: w.active_decode_blocks,
        };
        let requests = if load == BookLoad::default() {
            w.active_requests
        } else {
            w.active_requests.max(1)
        };
        for k in 0..requests {
            let load = if k == 0 { load } else { BookLoad::default() };
            let booking = Booking::new(Arc::clone(&fleet), row, load).expect("an unlimited worker admits");
            bookings.push(booking);
        }
        let held = fleet.outstanding(row).expect("row in range");
        assert_eq!(
            (held.requests, held.prefill_tokens, held.decode_blocks),
            (requests, w.active_prefill_tokens, w.active_decode_blocks),
            "row {row} holds the scenario's load"
        );
    }
    Loads::Fleet {
        fleet,
        _bookings: bookings,
    }
}

/// An empty fleet built on the heap (it is about 500 KiB).
fn new_fleet() -> Arc<BenchFleet> {
    Arc::from(BenchFleet::boxed())
}
