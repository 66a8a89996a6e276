//! Kernel inputs for the instruction-count benches: Dynamo's
//! `worker_selection` fixture as a real kernel [`Fleet`] holding
//! the load as [`Booking`]s, the same numbers as plain slices, and the
//! per-request columns (overlap, costs, cache hits, CPU rows).
//!
//! Worker `id` sits in row `id`: cached tokens `(id % 32) * 64` (overlap
//! blocks `cached / 16`), active prefill tokens `id * 16`, active decode
//! blocks `id % 127`, active requests `id % 17` (at least 1 in the fleet when
//! it carries prefill or decode load: a booking is one request), capacity
//! weight 2 for every fourth worker and 1 otherwise, every eighth worker a
//! CPU worker. The request: 2,048 prompt tokens, block size 16, default cost
//! config.
//!
//! Everything here is built before and dropped after the measured call;
//! nothing here is measured.

use core::num::NonZeroU32;
use std::sync::Arc;

use selkie_kernel::fleet::{BookLoad, Booking, Fleet, WorkerSpec};
use selkie_kernel::kernels::kv_cost::{kv_cost, KvCostConfig, KvLoad, KvOverlap, KvRequest, WorkerRole};
use selkie_kernel::lanes::padded_rows;
use selkie_kernel::Rng;

use crate::dynamo_fixture_worker;

/// Lane groups of the benches' fleet: 1,280 * 8 = 10,240 rows, enough for
/// the largest worker count.
pub const GROUPS: usize = 1_280;

/// The benches' fleet type.
pub type BenchFleet = Fleet<GROUPS>;

/// Prompt length of the fixture's request, in tokens.
pub const PROMPT_TOKENS: u32 = 2_048;
/// KV block size, in tokens.
pub const BLOCK_SIZE: u32 = 16;

/// The fixture for `n` workers: a fleet with the load booked, the same load
/// as slices, and the request's columns.
pub struct KernelFixture {
    /// Number of workers (rows `0..workers` are occupied).
    pub workers: usize,
    /// The fleet, its counters holding the fixture's load.
    pub fleet: Arc<BenchFleet>,
    /// The guards that hold the load; dropping them releases it.
    pub bookings: Vec<Booking<Arc<BenchFleet>, GROUPS>>,
    /// The fleet's selectable rows (every worker).
    pub mask: Vec<u64>,
    /// In-flight requests per row, a plain slice padded to whole lane groups.
    pub active: Vec<u32>,
    /// Active prefill tokens per row (slice).
    pub prefill: Vec<u32>,
    /// Active decode blocks per row (slice).
    pub decode: Vec<u32>,
    /// `1 / capacity_weight` per row (slice).
    pub inv_weight: Vec<f32>,
    /// The request's device overlap blocks per row.
    pub device_blocks: Vec<f32>,
    /// The request's cached tokens per row.
    pub cached_tokens: Vec<f32>,
    /// The request's cache hits per row (device-aware).
    pub cache_hits: Vec<u32>,
    /// CPU rows as a bitmask (device-aware).
    pub is_cpu: Vec<u64>,
    /// Every row's default KV cost for the request, from the fleet's load
    /// (ineligible rows `+inf`).
    pub costs: Vec<f32>,
    /// Default cost configuration.
    pub config: KvCostConfig,
    /// The request.
    pub request: KvRequest,
    /// The random source of the measured call.
    pub rng: Rng,
}

impl KernelFixture {
    /// Builds the fixture for `n <= 10,240` workers.
    ///
    /// # Panics
    /// If the fleet refuses a worker or a booking.
    pub fn new(n: usize) -> Self {
        let rows = padded_rows(n);
        let fleet = new_fleet();
        let mut bookings = Vec::new();
        let (mut active, mut prefill, mut decode) = (vec![0u32; rows], vec![0u32; rows], vec![0u32; rows]);
        let mut inv_weight = vec![1.0f32; rows];
        let (mut device_blocks, mut cached_tokens) = (vec![0.0f32; rows], vec![0.0f32; rows]);
        let mut cache_hits = vec![0u32; rows];
        let mut is_cpu = vec![0u64; rows.div_ceil(64)];
        for id in 0..n {
            let (cached, prefill_tokens, decode_blocks, requests) = dynamo_fixture_worker(id as u32);
            let weight = if id % 4 == 0 { 2.0 } else { 1.0 };
            let spec = WorkerSpec {
                capacity_weight: weight,
                ..WorkerSpec::new(id as u64)
            };
            let row = fleet.add(spec).expect("the fleet has room").row as usize;
            assert_eq!(row, id, "the fleet fills rows in order");
            let load = BookLoad {
                prefill_tokens,
                decode_blocks,
            };
            let requests = if load == BookLoad::default() {
                requests
            } else {
                requests.max(1)
            };
            for k in 0..requests {
                let load = if k == 0 { load } else { BookLoad::default() };
                bookings.push(Booking::new(Arc::clone(&fleet), row, load).expect("an unlimited worker admits"));
            }
            active[row] = requests;
            prefill[row] = prefill_tokens;
            decode[row] = decode_blocks;
            inv_weight[row] = 1.0 / weight;
            device_blocks[row] = (cached / BLOCK_SIZE) as f32;
            cached_tokens[row] = cached as f32;
            cache_hits[row] = cached / BLOCK_SIZE;
            if id % 8 == 7 {
                is_cpu[row / 64] |= 1 << (row % 64);
            }
        }
        let mut mask = vec![0u64; rows.div_ceil(64)];
        fleet.selectable(&mut mask);
        let mut fixture = KernelFixture {
            workers: n,
            fleet,
            bookings,
            mask,
            active,
            prefill,
            decode,
            inv_weight,
            device_blocks,
            cached_tokens,
            cache_hits,
            is_cpu,
            costs: vec![0.0; rows],
            config: KvCostConfig::default(),
            request: KvRequest::new(
                PROMPT_TOKENS,
                NonZeroU32::new(BLOCK_SIZE).expect("block size is not 0"),
                true,
                WorkerRole::Prefill,
            ),
            rng: Rng::new(42),
        };
        let fleet = Arc::clone(&fixture.fleet);
        let (p, d, a) = (
            fleet.active_prefill_tokens(),
            fleet.active_decode_blocks(),
            fleet.active_requests(),
        );
        let overlap = fixture.overlap();
        let mut costs = vec![0.0; rows];
        kv_cost(
            &fixture.config,
            &fixture.request,
            &KvLoad::new(&p, &d, &a),
            &overlap,
            &fixture.mask,
            &mut costs,
        )
        .expect("the fixture's columns are consistent");
        fixture.costs = costs;
        fixture
    }

    /// The request's overlap columns.
    pub fn overlap(&self) -> KvOverlap<'_> {
        KvOverlap {
            device_blocks: Some(&self.device_blocks),
            cached_tokens: Some(&self.cached_tokens),
            ..KvOverlap::default()
        }
    }
}

/// An empty fleet built on the heap (it is about 500 KiB).
fn new_fleet() -> Arc<BenchFleet> {
    Arc::from(BenchFleet::boxed())
}
