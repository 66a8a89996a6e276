//! Host inputs for the instruction-count, wall-clock and throughput benches:
//! a [`WorkerSelectionService`] per built-in mode, its workers, the load it
//! holds, and the request each selection sends.
//!
//! Worker ids are `0..n`, one data-parallel rank each; every eighth worker
//! (`id % 8 == 7`) is a CPU worker (device-aware); worker `id` holds
//! `id % 3` bookings of 256-token requests pinned to it (made in setup with
//! `select_owned`), so the load counters are non-zero and least-loaded has
//! ties among a third of the fleet. The request: 2,048 prompt tokens; for
//! `kv`, Dynamo's fixture overlap on every worker (`(id % 32) * 4` device
//! blocks, cached tokens = blocks * 16) as row-indexed columns
//! ([`RowOverlaps`], what a KV indexer produces; or keyed by worker with
//! [`HostFixture::worker_keyed`]) and the temperature of the case; for
//! `direct`, pinned to worker `n / 2`. The seed is fixed, so a
//! single-threaded run replays exactly.
//!
//! Building a fixture is not measured; a measured call is one
//! [`HostFixture::select_and_release`].

use std::sync::Arc;

use selkie::{
    DeviceAwareConfig, DeviceKind, KvRouterConfig, OwnedSelection, PrefixHashConfig, RowLayout, RowOverlaps,
    SelectionRequest, ServiceConfig, WorkerOverlap, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService,
    WorkerType, WorkerWithDpRank,
};

/// Prompt length of the measured request, in tokens.
pub const PROMPT_TOKENS: usize = 2_048;
/// Prompt length of the bookings the fixture holds, in tokens.
const HELD_PROMPT_TOKENS: usize = 256;

/// A built-in policy of the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `random`.
    Random,
    /// `round-robin`.
    RoundRobin,
    /// `least-loaded`.
    LeastLoaded,
    /// `power-of-two`.
    PowerOfTwo,
    /// `device-aware-weighted` (default config).
    DeviceAwareWeighted,
    /// `direct` (the request is pinned to one worker).
    Direct,
    /// `kv`, the default policy (default `KvRouterConfig`, aggregated).
    Kv,
    /// `prefix-hash` (default config): the request carries its prompt's
    /// block hashes.
    PrefixHash,
}

impl Mode {
    /// Every built-in mode; `Random` first (the wall-clock report's
    /// reference).
    pub const ALL: [Mode; 8] = [
        Mode::Random,
        Mode::RoundRobin,
        Mode::LeastLoaded,
        Mode::PowerOfTwo,
        Mode::DeviceAwareWeighted,
        Mode::Direct,
        Mode::Kv,
        Mode::PrefixHash,
    ];

    /// The policy's name as configs spell it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Random => "random",
            Mode::RoundRobin => "round-robin",
            Mode::LeastLoaded => "least-loaded",
            Mode::PowerOfTwo => "power-of-two",
            Mode::DeviceAwareWeighted => "device-aware-weighted",
            Mode::Direct => "direct",
            Mode::Kv => "kv",
            Mode::PrefixHash => "prefix-hash",
        }
    }

    /// Whether the fixture's request of this mode is plain:
    /// `SelectionRequest::new(PROMPT_TOKENS)`, nothing added.
    pub fn plain(self) -> bool {
        !matches!(self, Mode::Direct | Mode::Kv | Mode::PrefixHash)
    }

    /// A new policy of this mode.
    pub fn policy(self) -> WorkerSelectionPolicy {
        match self {
            Mode::Random => WorkerSelectionPolicy::random(),
            Mode::RoundRobin => WorkerSelectionPolicy::round_robin(),
            Mode::LeastLoaded => WorkerSelectionPolicy::least_loaded(),
            Mode::PowerOfTwo => WorkerSelectionPolicy::power_of_two(),
            Mode::DeviceAwareWeighted => WorkerSelectionPolicy::device_aware_weighted(DeviceAwareConfig::default()),
            Mode::Direct => WorkerSelectionPolicy::direct(),
            Mode::Kv => WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            Mode::PrefixHash => {
                WorkerSelectionPolicy::prefix_hash(PrefixHashConfig::default()).expect("the defaults are valid")
            }
        }
    }
}

/// A service of `n` workers under one mode, with its held load and request.
pub struct HostFixture {
    /// The service every selection goes through.
    pub service: Arc<WorkerSelectionService>,
    /// The bookings that hold the fixture's load.
    held: Vec<OwnedSelection>,
    overlaps: Vec<WorkerOverlap>,
    /// The same overlaps as row columns: the layout, device blocks and
    /// cached tokens.
    rows: (RowLayout, Vec<f32>, Vec<f32>),
    /// Send the worker-keyed overlaps instead of the row columns.
    keyed: bool,
    /// The prompt's block hashes (`prefix-hash`).
    blocks: Vec<u64>,
    mode: Mode,
    temperature: f64,
    workers: usize,
}

impl HostFixture {
    /// The fixture for `mode` over `n >= 1` workers; `temperature` is used by
    /// `kv` only. Makes one warm-up selection (the thread's scratch and
    /// registry snapshot), so a measured call allocates nothing.
    ///
    /// # Panics
    /// If the service refuses a worker or a booking.
    pub fn new(mode: Mode, n: usize, temperature: f64) -> Self {
        let config = ServiceConfig {
            seed: Some(42),
            ..ServiceConfig::default()
        };
        let service = Arc::new(WorkerSelectionService::new(mode.policy(), config));
        let records = (0..n as u64)
            .map(|id| {
                let r = WorkerRecord::new(id);
                if id % 8 == 7 {
                    r.with_device(DeviceKind::Cpu)
                } else {
                    r
                }
            })
            .collect();
        service.sync(records).expect("the fleet has room for every worker");
        let mut held = Vec::new();
        for id in 0..n as u64 {
            for _ in 0..id % 3 {
                let req = SelectionRequest::new(HELD_PROMPT_TOKENS).pinned_to_worker(id);
                held.push(service.select_owned(&req).expect("an unlimited worker admits"));
            }
        }
        let overlaps: Vec<WorkerOverlap> = (0..n as u32)
            .map(|id| WorkerOverlap::device(WorkerWithDpRank::new(u64::from(id), 0), (id % 32) * 4, 16))
            .collect();
        let layout = service.row_layout();
        let (mut device, mut cached) = (vec![0.0; layout.rows()], vec![0.0; layout.rows()]);
        for o in &overlaps {
            let row = service.row_of(o.worker).expect("every worker has a row");
            (device[row], cached[row]) = (o.device_blocks as f32, o.cached_tokens as f32);
        }
        let fixture = HostFixture {
            service,
            held,
            overlaps,
            rows: (layout, device, cached),
            keyed: false,
            blocks: (0..PROMPT_TOKENS as u64 / 16).map(|i| 0x5EED_0000 + i).collect(),
            mode,
            temperature,
            workers: n,
        };
        fixture.select_and_release();
        fixture
    }

    /// The same fixture, sending the `kv` overlaps keyed by worker rank
    /// ([`SelectionRequest::with_overlaps`]) instead of as row columns.
    pub fn worker_keyed(mut self) -> Self {
        self.keyed = true;
        self.select_and_release();
        self
    }

    /// The same fixture's worker-keyed overlaps in a shuffled order (a
    /// fixed Fisher-Yates shuffle): what a router passes when its overlaps
    /// come from a hash map.
    pub fn shuffled(mut self) -> Self {
        let mut state = 0x5e1c_1e00_d1a0_u64;
        for i in (1..self.overlaps.len()).rev() {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let j = ((state >> 33) % (i as u64 + 1)) as usize;
            self.overlaps.swap(i, j);
        }
        self.select_and_release();
        self
    }

    /// The fixture's mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The measured request: built per call (it borrows the overlaps).
    #[inline]
    pub fn request(&self) -> SelectionRequest<'_> {
        let req = SelectionRequest::new(PROMPT_TOKENS);
        match self.mode {
            Mode::Kv if self.keyed => req.with_overlaps(&self.overlaps).with_temperature(self.temperature),
            Mode::Kv => {
                let (layout, device, cached) = &self.rows;
                let overlaps = RowOverlaps::new(*layout, device).with_cached_tokens(cached);
                req.with_row_overlaps(overlaps).with_temperature(self.temperature)
            }
            Mode::Direct => req.pinned_to_worker((self.workers / 2) as u64),
            Mode::PrefixHash => req.with_prompt_blocks(&self.blocks),
            mode => {
                debug_assert!(mode.plain());
                req
            }
        }
    }

    /// One select + book, then the release (drop of the booking); returns
    /// the chosen worker.
    ///
    /// # Panics
    /// If the selection fails (the fixture never overloads).
    #[inline]
    pub fn select_and_release(&self) -> WorkerWithDpRank {
        let selection = self
            .service
            .select(&self.request())
            .expect("the fixture admits every request");
        let worker = selection.worker();
        drop(selection);
        worker
    }

    /// [`select_and_release`](Self::select_and_release) for a mode whose
    /// request is plain (random, round-robin, least-loaded,
    /// power-of-two, device-aware): the same request,
    /// `SelectionRequest::new(PROMPT_TOKENS)`, built as a router builds
    /// it, without the fixture's match on its mode.
    ///
    /// # Panics
    /// If the selection fails, or (debug builds) the mode's request is not
    /// plain.
    #[inline]
    pub fn select_plain_and_release(&self) -> WorkerWithDpRank {
        debug_assert!(self.mode.plain(), "{:?} requests are not plain", self.mode);
        let selection = self
            .service
            .select(&SelectionRequest::new(std::hint::black_box(PROMPT_TOKENS)))
            .expect("the fixture admits every request");
        let worker = selection.worker();
        drop(selection);
        worker
    }

    /// Releases the held load.
    pub fn release_held(&mut self) {
        self.held.clear();
    }

    /// Total (requests, prefill tokens, decode blocks) still booked on the
    /// service's workers.
    pub fn outstanding(&self) -> (u64, u64, u64) {
        let mut total = (0, 0, 0);
        for id in 0..self.workers as u64 {
            let status = self.service.worker_status(id).expect("every worker is known");
            for r in status.ranks {
                total.0 += u64::from(r.active_requests);
                total.1 += u64::from(r.active_prefill_tokens);
                total.2 += u64::from(r.active_decode_blocks);
            }
        }
        total
    }
}
