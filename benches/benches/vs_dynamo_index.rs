//! selkie's KV index against dynamo-kv-router 1.6.1's indexers, side by side
//! in one run.
//!
//! ```text
//! cargo bench -p selkie-benches --features dynamo-core --bench vs_dynamo_index
//! cargo bench -p selkie-benches --features dynamo-core --bench vs_dynamo_index -- --family
//! ```
//!
//! **Fleets.** 128, 1,024 and 4,096 workers (one DP rank each) holding about
//! 100,000 distinct blocks together: a 64-block system prompt every worker
//! holds, continued by 64 shared prompts of 32 blocks (worker `w` holds
//! prompt `w % 64`), each worker's own continuation of its shared prompt,
//! and a chain of its own that shares nothing. Engines report runs of at
//! most 32 blocks per stored event, each run under the previous run's last
//! block, as they report a request's blocks.
//!
//! **Indexers.** selkie's [`KvIndex`] (its query writes every row's device,
//! host and disk overlap into the columns the selection service reads),
//! Dynamo's `RadixTree` (`apply_event`, `find_matches`) and its
//! `ConcurrentRadixTreeCompressed` (queried directly through
//! `SyncIndexer::find_matches`; fed through a one-thread
//! `ThreadPoolIndexer`, as Dynamo's router and its `indexer_delegate` bench
//! feed it). Before anything is timed, every query's answer of the three is
//! compared (the device overlap of every worker) and the bench exits
//! non-zero on any difference.
//!
//! **Queries** of 128 blocks: *shared*, the system prompt and a shared
//! prompt (96 blocks) then 32 blocks nobody holds (every worker scores 64,
//! those of that prompt 96); *own*, a worker's prompt and its continuation
//! (one worker scores up to 128, the others of its prompt 96, everyone 64);
//! *unshared*, a worker's own chain (one worker scores, nobody else).
//!
//! **Ingestion**: every stored event of the fleet applied to an empty index,
//! events per second (selkie's index synced to the service's rows after
//! each worker's first event, so every block goes onto its row as it is
//! applied; for the thread-pool indexer: enqueue all, then wait for its
//! flush), the fastest of fifteen builds that take turns (a build takes
//! milliseconds, and the fastest of five moved by up to 15% between runs);
//! selkie twice, as `KvIndex::new` grows its block table and with the table
//! reserved for the fleet's distinct blocks (`with_block_capacity`).
//! **Memory**: live heap bytes the index holds after ingestion (a counting
//! global allocator; Dynamo's thread pool included) per distinct block and
//! per (worker, block) entry; and the resident set's growth while each
//! index is built alone in a fresh process (this binary run again with
//! `--rss <selkie|radix|concurrent> <workers>`: the fleet's events built
//! first, then the resident set read from `/proc/self/status` before and
//! after the build; Dynamo's indexers are given clones of the events, so
//! that the events' memory they free is not what their index reuses; Linux
//! only). The resident set counts what the allocator keeps: tables freed
//! as they grow, fragmentation, the pool thread's stack.
//!
//! **Full path**: tokens to a booked and released worker at 1,024 workers,
//! 2,048-token prompt, nothing cached: selkie hashes the prompt, queries its
//! index (the fleet's events applied), selects, books and releases through
//! `WorkerSelectionService`; Dynamo's `SelectionCore::select_and_reserve` +
//! `free_reservation` (its own hashing and indexer) on a local core of the
//! same size and prompt, as `vs_dynamo`'s full-path anchor drives it.
//! selkie hashes a prompt's blocks as its index walk goes and stops where
//! no row holds a block, so a second row measures a prompt whose first 64
//! blocks every worker holds and whose next 32 the workers of one shared
//! prompt hold ([`IndexFixture`], the `host_kv_index_t0` instruction-count
//! case): 97 blocks hashed and walked, the selection crediting every row.
//! There Dynamo's core is fed the same fleet's events (and checked to
//! credit the prompt's blocks as selkie's index does) and asked for the
//! same prompt; in the first row its core holds nothing (it hashes every
//! block of the prompt either way).
//!
//! **Mixed stream** (the claim in Dynamo's indexer README of over 10 million
//! events + requests per second with p99 latency under 10 µs): at 1,024
//! workers, one thread applies evictions and re-stores of each worker's
//! last run with a query every fourth operation, to selkie's index and to
//! `RadixTree`, timing every call; afterwards both still answer alike.
//!
//! **Generated streams** (`-- --family` runs only these): the family of
//! `selkie_benches::index_streams`, branching shared prefixes of Zipf
//! popularity at 8, 200 and 1,000 workers, DP 1 and 2, a decode-heavy
//! stream and one of events and queries interleaved, with tail, middle,
//! scattered and duplicate removals, duplicate stores, unknown parents and
//! clears. selkie's and `RadixTree`'s answers must equal the streams'
//! per-block model (the bench exits non-zero otherwise);
//! `ConcurrentRadixTreeCompressed`'s differing answers are counted. Then
//! ingestion, queries, memory per block and, for the interleaved stream,
//! events and queries in order.
//!
//! Timing: the calls compared take turns in batches of about a millisecond
//! for 51 rounds; the tables report the median batch time per call and the
//! ratio of the medians. One run on the machine it runs on: quote the
//! ratios, not the times.
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use selkie_benches::index_fixture::IndexFixture;
use selkie_benches::timing::{batch, Timing};
use selkie_benches::{chain, SplitMix64 as Stream};

use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use selkie::kv_index::{sequence_hashes_of, KvBlockHasher, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::{
    KvRouterConfig, SelectionRequest, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService,
    WorkerType, WorkerWithDpRank,
};
use selkie_benches::vs_dynamo::{dynamo_stored, DynamoCore};

#[path = "vs_dynamo_index/family.rs"]
mod family;

/// Live heap bytes of the whole process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes.
struct CountingAllocator;

// SAFETY: every call is forwarded to `System` with the caller's arguments;
// the counter only observes sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const WORKER_COUNTS: [usize; 3] = [128, 1024, 4096];
const DISTINCT_BLOCKS: usize = 100_000;
const SYSTEM_BLOCKS: usize = 64;
const SHARED_PROMPTS: usize = 64;
const SHARED_BLOCKS: usize = 32;
const QUERY_BLOCKS: usize = 128;
const RUN_BLOCKS: usize = 32;
const BLOCK_SIZE: u32 = 16;
const ROUNDS: usize = 51;
/// Builds of each index from its events, taking turns.
const INGEST_TURNS: usize = 15;
const BATCH: Duration = Duration::from_millis(1);
/// The timing loop of the run.
const TIMING: Timing = Timing {
    rounds: ROUNDS,
    batch: BATCH,
};
const FULL_PATH_WORKERS: usize = 1024;
const FULL_PATH_TOKENS: u32 = 2048;

/// One stored run: the worker, its event id, the parent's sequence hash and
/// the run's (sequence hash, local hash) pairs.
struct Run {
    worker: u64,
    id: u64,
    parent: Option<u64>,
    blocks: Vec<(u64, u64)>,
}

impl Run {
    /// The run as Dynamo's stored-event data.
    fn dynamo_stored(&self) -> KvCacheEventData {
        dynamo_stored(
            self.parent,
            self.blocks.iter().map(|&(block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            }),
        )
    }
}

/// A fleet: its stored runs (in event order) and the query chains.
struct Fleet {
    workers: usize,
    runs: Vec<Run>,
    distinct: usize,
    entries: usize,
    shared: Vec<Vec<u64>>,
    own: Vec<Vec<u64>>,
    unshared: Vec<Vec<u64>>,
}

/// `chain`'s local hashes as runs of at most [`RUN_BLOCKS`] under `parent`
/// (the sequence hash of the block before `chain[0]`, if any).
fn runs_of(worker: u64, next_id: &mut u64, prefix: &[u64], chain: &[u64], runs: &mut Vec<Run>) {
    let mut all = prefix.to_vec();
    all.extend_from_slice(chain);
    let mut seq = Vec::new();
    sequence_hashes_of(&all, &mut seq);
    let mut at = prefix.len();
    while at < all.len() {
        let end = (at + RUN_BLOCKS).min(all.len());
        runs.push(Run {
            worker,
            id: *next_id,
            parent: at.checked_sub(1).map(|p| seq[p]),
            blocks: (at..end).map(|i| (seq[i], all[i])).collect(),
        });
        *next_id += 1;
        at = end;
    }
}

impl Fleet {
    fn new(workers: usize) -> Self {
        let mut rng = Stream::new(0x5e1c_1e1d_e000 + workers as u64);
        let system = chain(&mut rng, SYSTEM_BLOCKS);
        let shared: Vec<Vec<u64>> = (0..SHARED_PROMPTS)
            .map(|_| {
                let mut p = system.clone();
                p.extend(chain(&mut rng, SHARED_BLOCKS));
                p
            })
            .collect();
        let own_blocks = (DISTINCT_BLOCKS - SYSTEM_BLOCKS - SHARED_PROMPTS * SHARED_BLOCKS) / workers;
        let (cont, root) = (own_blocks / 2, own_blocks - own_blocks / 2);
        let mut runs = Vec::new();
        let (mut own, mut unshared) = (Vec::new(), Vec::new());
        let mut entries = 0;
        for w in 0..workers {
            let mut next_id = 0;
            let prompt = &shared[w % SHARED_PROMPTS];
            let continuation = chain(&mut rng, cont);
            let alone = chain(&mut rng, root);
            let mut first = prompt.clone();
            first.extend_from_slice(&continuation);
            runs_of(w as u64, &mut next_id, &[], &first, &mut runs);
            runs_of(w as u64, &mut next_id, &[], &alone, &mut runs);
            entries += first.len() + alone.len();
            own.push(first);
            unshared.push(alone);
        }
        Fleet {
            workers,
            runs,
            distinct: SYSTEM_BLOCKS + SHARED_PROMPTS * SHARED_BLOCKS + workers * own_blocks,
            entries,
            shared,
            own,
            unshared,
        }
    }

    /// The query of `kind` for worker (or shared prompt) `i`: its chain,
    /// padded to [`QUERY_BLOCKS`] with blocks nobody holds.
    fn query(&self, kind: Query, i: usize) -> Vec<u64> {
        let mut q = match kind {
            Query::Shared => self.shared[i % SHARED_PROMPTS].clone(),
            Query::Own => self.own[i % self.workers].clone(),
            Query::Unshared => self.unshared[i % self.workers].clone(),
        };
        q.truncate(QUERY_BLOCKS);
        let mut pad = Stream::new(0xAD ^ i as u64);
        while q.len() < QUERY_BLOCKS {
            q.push(pad.next_u64());
        }
        q
    }

    fn dynamo_events(&self) -> Vec<RouterEvent> {
        self.runs
            .iter()
            .map(|r| {
                RouterEvent::new(
                    r.worker,
                    KvCacheEvent {
                        event_id: r.id,
                        dp_rank: 0,
                        data: r.dynamo_stored(),
                    },
                )
            })
            .collect()
    }

    fn selkie_blocks(&self) -> Vec<Vec<StoredBlock>> {
        self.runs
            .iter()
            .map(|r| {
                r.blocks
                    .iter()
                    .map(|&(block_hash, tokens_hash)| StoredBlock {
                        block_hash,
                        tokens_hash,
                    })
                    .collect()
            })
            .collect()
    }

    /// Applies every run to `index`, syncing it to `service`'s rows after
    /// each worker's first event, as a router that syncs before each query
    /// does: every block is put on its row as its event is applied.
    fn feed(&self, index: &mut KvIndex, blocks: &[Vec<StoredBlock>], service: &WorkerSelectionService) {
        for (r, b) in self.runs.iter().zip(blocks) {
            let data = KvEventData::Stored {
                parent: r.parent,
                blocks: b,
            };
            index
                .apply(&KvEvent::new(WorkerWithDpRank::new(r.worker, 0), r.id, data))
                .expect("the fleet's events are in order");
            if r.id == 0 {
                index
                    .sync_rows(service.row_layout(), |rank| service.row_of(rank))
                    .expect("the index has the service's block size");
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Query {
    Shared,
    Own,
    Unshared,
}

const QUERIES: [Query; 3] = [Query::Shared, Query::Own, Query::Unshared];

fn service(workers: usize) -> WorkerSelectionService {
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig {
            block_size: BLOCK_SIZE,
            seed: Some(7),
            ..ServiceConfig::default()
        },
    );
    service
        .sync((0..workers as u64).map(WorkerRecord::new).collect())
        .expect("the fleet has room");
    service
}

/// Dynamo's `ConcurrentRadixTreeCompressed` behind a one-thread
/// `ThreadPoolIndexer`, as Dynamo's router feeds it: every event enqueued,
/// then flushed; the indexer and the seconds from its creation to the
/// flush (the events are built before the clock starts).
fn build_concurrent(
    events: Vec<RouterEvent>,
    runtime: &tokio::runtime::Runtime,
) -> (ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, f64) {
    let start = Instant::now();
    let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK_SIZE);
    for e in events {
        pool.enqueue_event(e).expect("the indexer thread runs");
    }
    runtime.block_on(pool.flush_and_wait()).expect("the indexer flushes");
    (pool, start.elapsed().as_secs_f64())
}

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

struct IndexRow {
    workers: usize,
    query: Query,
    /// By sequence hashes (`KvIndex::overlaps`).
    selkie_seq_ns: f64,
    /// By local hashes (`KvIndex::overlaps_for_local_hashes`: the
    /// sequence-hash chain computed first, Dynamo's input).
    selkie_ns: f64,
    radix_ns: f64,
    concurrent_ns: f64,
}

struct IngestRow {
    workers: usize,
    events: usize,
    selkie_eps: f64,
    /// With the block table reserved for the fleet's distinct blocks.
    reserved_eps: f64,
    radix_eps: f64,
    concurrent_eps: f64,
    distinct: usize,
    entries: usize,
    selkie_bytes: isize,
    radix_bytes: isize,
    concurrent_bytes: isize,
    /// Resident set growth of each index built alone (`None` where the
    /// child process could not say).
    rss: [Option<usize>; 3],
}

/// The indexes of the resident-set measurement, as named on the command
/// line of the child process.
const RSS_INDEXES: [&str; 3] = ["selkie", "radix", "concurrent"];

/// This process's resident set in bytes (`VmRSS` of `/proc/self/status`;
/// `None` where there is none).
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// How much the resident set grows while `build` runs (what it returns is
/// kept until after the second reading).
fn resident_growth<T>(build: impl FnOnce() -> T) -> Option<usize> {
    let before = resident_bytes();
    let built = build();
    let after = resident_bytes();
    black_box(&built);
    after.zip(before).map(|(a, b)| a.saturating_sub(b))
}

/// The child process of the resident-set measurement: builds `index` from
/// the events of a fleet of `workers` and prints `rss_growth <bytes>`.
fn rss_child(index: &str, workers: usize) -> ExitCode {
    let fleet = Fleet::new(workers);
    let service = service(workers);
    let growth = match index {
        "selkie" => {
            let blocks = fleet.selkie_blocks();
            resident_growth(|| {
                let mut built = KvIndex::new(BLOCK_SIZE);
                fleet.feed(&mut built, &blocks, &service);
                built
            })
        }
        "radix" => {
            let events = fleet.dynamo_events();
            resident_growth(|| {
                let mut radix = RadixTree::new();
                for e in &events {
                    radix.apply_event(e.clone()).expect("the fleet's events are in order");
                }
                radix
            })
        }
        "concurrent" => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime");
            let events = fleet.dynamo_events();
            resident_growth(|| {
                let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK_SIZE);
                // A batch at a time, so that few clones wait in the queue.
                for batch in events.chunks(64) {
                    for e in batch {
                        pool.enqueue_event(e.clone()).expect("the indexer thread runs");
                    }
                    runtime.block_on(pool.flush_and_wait()).expect("the indexer flushes");
                }
                pool
            })
        }
        other => {
            eprintln!("vs_dynamo_index: unknown index {other:?} (selkie, radix or concurrent)");
            return ExitCode::FAILURE;
        }
    };
    match growth {
        Some(bytes) => {
            println!("rss_growth {bytes}");
            ExitCode::SUCCESS
        }
        None => ExitCode::FAILURE,
    }
}

/// Runs [`rss_child`] for `index` in a fresh process of this binary.
fn rss_growth(index: &str, workers: usize) -> Option<usize> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .args(["--rss", index, &workers.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        progress(format_args!(
            "{workers} workers: the resident-set child for {index} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("rss_growth ")?.trim().parse().ok())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--rss") {
        let (Some(index), Some(workers)) = (args.get(at + 1), args.get(at + 2).and_then(|w| w.parse().ok())) else {
            eprintln!("vs_dynamo_index: --rss <selkie|radix|concurrent> <workers>");
            return ExitCode::FAILURE;
        };
        return rss_child(index, workers);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
    let family_only = args.iter().any(|a| a == "--family");
    let family_rows = match family::run(&runtime) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("PARITY FAILED: {e}");
            return ExitCode::FAILURE;
        }
    };
    if family_only {
        println!("# selkie's KV index against dynamo-kv-router 1.6.1's indexers: generated streams");
        println!();
        family::report(&family_rows);
        return ExitCode::SUCCESS;
    }
    let mut index_rows = Vec::new();
    let mut ingest_rows = Vec::new();
    let mut full_path_index = None;
    for &workers in &WORKER_COUNTS {
        progress(format_args!("{workers} workers: building the fleet"));
        let fleet = Fleet::new(workers);
        let service = service(workers);

        // Ingestion and memory, each index built alone from its events,
        // the three taking turns; the fastest of the turns is reported (a
        // first build also pays for fresh pages). The last build of each
        // stays for the queries.
        let (mut selkie_s, mut reserved_s, mut radix_s, mut concurrent_s) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
        let mut built = None;
        // Each index's events are built just before its build, as a
        // router's are just received (Dynamo's below too), so that no build
        // finds them warmer in cache than another; selkie borrows them and
        // drops them after the clock stops, so they are left out of its
        // live bytes.
        let selkie_build = |mut index: KvIndex| {
            let blocks = fleet.selkie_blocks();
            let start = Instant::now();
            fleet.feed(&mut index, &blocks, &service);
            (index, start.elapsed().as_secs_f64())
        };
        for _ in 0..INGEST_TURNS {
            drop(built.take());
            let before = live();
            let (index, s) = selkie_build(KvIndex::new(BLOCK_SIZE));
            selkie_s = selkie_s.min(s);
            let selkie_bytes = live() - before;

            // The same, the block table reserved for the fleet's distinct
            // blocks up front (`with_block_capacity`): it never grows.
            let (reserved, s) = selkie_build(KvIndex::new(BLOCK_SIZE).with_block_capacity(fleet.distinct));
            reserved_s = reserved_s.min(s);
            drop(reserved);

            // Dynamo's indexers consume and drop their events: the live
            // bytes are taken before the events are built, so what stays
            // is the index alone.
            let before = live();
            let events = fleet.dynamo_events();
            let start = Instant::now();
            let mut radix = RadixTree::new();
            for e in events {
                radix.apply_event(e).expect("the fleet's events are in order");
            }
            radix_s = radix_s.min(start.elapsed().as_secs_f64());
            let radix_bytes = live() - before;

            let before = live();
            let (pool, s) = build_concurrent(fleet.dynamo_events(), &runtime);
            concurrent_s = concurrent_s.min(s);
            let concurrent_bytes = live() - before;
            built = Some((index, radix, pool, [selkie_bytes, radix_bytes, concurrent_bytes]));
        }
        let (mut index, radix, pool, [selkie_bytes, radix_bytes, concurrent_bytes]) = built.expect("at least one turn");
        let n = fleet.runs.len();
        ingest_rows.push(IngestRow {
            workers,
            events: n,
            selkie_eps: n as f64 / selkie_s,
            reserved_eps: n as f64 / reserved_s,
            radix_eps: n as f64 / radix_s,
            concurrent_eps: n as f64 / concurrent_s,
            distinct: fleet.distinct,
            entries: fleet.entries,
            selkie_bytes,
            radix_bytes,
            concurrent_bytes,
            rss: RSS_INDEXES.map(|name| rss_growth(name, workers)),
        });

        // Parity of every answer, then the query times.
        index
            .sync_rows(service.row_layout(), |r| service.row_of(r))
            .expect("the index has the service's block size");
        let rows: Vec<usize> = (0..workers as u64)
            .map(|w| service.row_of(WorkerWithDpRank::new(w, 0)).expect("a row per worker"))
            .collect();
        let concurrent = pool.backend();
        let mut out = KvOverlaps::new();
        for kind in QUERIES {
            for i in [0, 1, workers / 2, workers - 1] {
                let q = fleet.query(kind, i);
                let local: Vec<LocalBlockHash> = q.iter().map(|&h| LocalBlockHash(h)).collect();
                let a = radix.find_matches(local.clone(), false);
                let b = concurrent.find_matches(&local, false);
                let columns = index.overlaps_for_local_hashes(&q, &mut out).expect("rows are synced");
                let mut scored = 0;
                for (w, &row) in rows.iter().enumerate() {
                    let dynamo_rank = dynamo_kv_router::protocols::WorkerWithDpRank::new(w as u64, 0);
                    let ra = a.scores.get(&dynamo_rank).copied().unwrap_or(0);
                    let rb = b.scores.get(&dynamo_rank).copied().unwrap_or(0);
                    let s = columns.device_blocks[row] as u32;
                    scored += usize::from(s > 0);
                    if ra != s || rb != s {
                        eprintln!(
                            "PARITY FAILED: {workers} workers, {kind:?} query {i}, worker {w}: selkie {s}, \
                             RadixTree {ra}, ConcurrentRadixTreeCompressed {rb}"
                        );
                        return ExitCode::FAILURE;
                    }
                }
                if scored == 0 {
                    eprintln!("PARITY FAILED: {workers} workers, {kind:?} query {i}: no worker scores");
                    return ExitCode::FAILURE;
                }
            }
        }
        for kind in QUERIES {
            progress(format_args!("{workers} workers: timing {kind:?} queries"));
            let q = fleet.query(kind, 1);
            let local: Vec<LocalBlockHash> = q.iter().map(|&h| LocalBlockHash(h)).collect();
            let mut seq = Vec::new();
            sequence_hashes_of(&q, &mut seq);
            let mut out_seq = KvOverlaps::new();
            let [selkie_seq_ns, selkie_ns, radix_ns, concurrent_ns] = TIMING.interleaved([
                &mut batch(|| {
                    let c = index.overlaps(black_box(&seq), &mut out_seq).expect("synced");
                    black_box(c.device_blocks.len());
                }),
                &mut batch(|| {
                    let c = index
                        .overlaps_for_local_hashes(black_box(&q), &mut out)
                        .expect("synced");
                    black_box(c.device_blocks.len());
                }),
                &mut batch(|| {
                    black_box(radix.find_matches(black_box(local.clone()), false));
                }),
                &mut batch(|| {
                    black_box(concurrent.find_matches(black_box(&local), false));
                }),
            ]);
            index_rows.push(IndexRow {
                workers,
                query: kind,
                selkie_seq_ns,
                selkie_ns,
                radix_ns,
                concurrent_ns,
            });
        }
        pool.shutdown();
        if workers == FULL_PATH_WORKERS {
            full_path_index = Some((index, service, radix, fleet));
        }
    }

    progress(format_args!(
        "full path: {FULL_PATH_WORKERS} workers, {FULL_PATH_TOKENS}-token prompt"
    ));
    let (mut index, service, mut radix, fleet) = full_path_index.expect("the full path's fleet was built");
    let hasher = KvBlockHasher::new(BLOCK_SIZE);
    let tokens: Vec<u32> = (1..=FULL_PATH_TOKENS).collect();
    let mut out = KvOverlaps::new();
    let mut dynamo = DynamoCore::with_prompt(FULL_PATH_WORKERS as u64, FULL_PATH_TOKENS);
    let mut shared = IndexFixture::new(FULL_PATH_WORKERS);
    assert_eq!(shared.prompt.len(), FULL_PATH_TOKENS as usize);
    let mut dynamo_shared = dynamo_holding(&shared, &hasher);
    let [dynamo_ns, dynamo_shared_ns, selkie_shared_ns, selkie_ns] = TIMING.interleaved([
        &mut batch(|| {
            black_box(dynamo.select_and_free());
        }),
        &mut batch(|| {
            black_box(dynamo_shared.select_and_free());
        }),
        &mut batch(|| {
            black_box(shared.select_and_release());
        }),
        &mut batch(|| {
            let columns = index
                .overlaps_for_tokens(&hasher, black_box(&tokens), &mut out)
                .expect("rows are synced");
            let req = SelectionRequest::new(tokens.len()).with_row_overlaps(columns);
            let selection = service.select(&req).expect("an idle fleet admits");
            black_box(selection.worker());
        }),
    ]);

    progress(format_args!("mixed events and requests: {FULL_PATH_WORKERS} workers"));
    let queries: Vec<MixedQuery> = (0..MIXED_QUERIES)
        .map(|i| MixedQuery::new(fleet.query(QUERIES[i % QUERIES.len()], i)))
        .collect();
    let selkie_mixed = mixed_stream(
        &fleet,
        &mut SelkieMixed {
            index: &mut index,
            out: KvOverlaps::new(),
        },
        &queries,
    );
    let radix_mixed = mixed_stream(&fleet, &mut RadixMixed(&mut radix), &queries);
    // The stream leaves both indexes as it found them: their answers still
    // agree.
    let mut out = KvOverlaps::new();
    for q in &queries {
        let a = radix.find_matches(q.local.clone(), false);
        let columns = index
            .overlaps_for_local_hashes(&q.hashes, &mut out)
            .expect("rows are synced");
        for w in 0..FULL_PATH_WORKERS as u64 {
            let row = service.row_of(WorkerWithDpRank::new(w, 0)).expect("a row per worker");
            let dynamo_rank = dynamo_kv_router::protocols::WorkerWithDpRank::new(w, 0);
            let ra = a.scores.get(&dynamo_rank).copied().unwrap_or(0);
            if ra != columns.device_blocks[row] as u32 {
                eprintln!(
                    "PARITY FAILED after the mixed stream: worker {w}: selkie {}, RadixTree {ra}",
                    columns.device_blocks[row]
                );
                return ExitCode::FAILURE;
            }
        }
    }

    println!("# selkie's KV index against dynamo-kv-router 1.6.1's indexers");
    println!();
    println!(
        "One run. Fleets of about {DISTINCT_BLOCKS} distinct blocks (a {SYSTEM_BLOCKS}-block system prompt all \
         hold, {SHARED_PROMPTS} shared prompts of {SHARED_BLOCKS} blocks after it, each worker's continuation and \
         a chain of its own), stored in runs of at most \
         {RUN_BLOCKS} blocks; queries of {QUERY_BLOCKS} blocks. Every answer of the three indexers was compared \
         first (every worker's device overlap): equal. Per call: median of {ROUNDS} interleaved batches of \
         ~{BATCH:?}; ratio = Dynamo / selkie."
    );
    println!();
    println!("## Query");
    println!();
    println!(
        "Both indexes answer from local block hashes (Dynamo's input; selkie first chains them into sequence \
         hashes, which a router gets with the local hashes when it hashes the prompt's tokens). \"by sequence \
         hashes\" is selkie's query alone."
    );
    println!();
    println!(
        "| workers | query | selkie ns, by sequence hashes | selkie ns | RadixTree ns | \
         ConcurrentRadixTreeCompressed ns | ratio to RadixTree | ratio to the fastest Dynamo |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for r in &index_rows {
        println!(
            "| {} | {:?} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}x | {:.1}x |",
            r.workers,
            r.query,
            r.selkie_seq_ns,
            r.selkie_ns,
            r.radix_ns,
            r.concurrent_ns,
            r.radix_ns / r.selkie_ns,
            r.radix_ns.min(r.concurrent_ns) / r.selkie_ns
        );
    }
    println!();
    println!("## Ingestion and memory");
    println!();
    println!(
        "Events per second applying the fleet's stored events to an empty index, the fastest of \
         {INGEST_TURNS} builds taking turns (selkie: synced to the service's rows after each worker's first \
         event, so blocks go onto rows as they are applied; reserved: its block table reserved for the \
         fleet's distinct blocks, `with_block_capacity`; ConcurrentRadixTreeCompressed: a one-thread \
         ThreadPoolIndexer, enqueue then flush). Bytes: live heap the index holds after ingestion, per \
         distinct block and per (worker, block) entry."
    );
    println!();
    println!(
        "| workers | events | entries | selkie events/s | selkie reserved events/s | RadixTree events/s | \
         Concurrent events/s | selkie B/block | RadixTree B/block | Concurrent B/block | selkie B/entry | RadixTree B/entry | \
         Concurrent B/entry |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &ingest_rows {
        let per = |b: isize, n: usize| b as f64 / n as f64;
        println!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |",
            r.workers,
            r.events,
            r.entries,
            r.selkie_eps,
            r.reserved_eps,
            r.radix_eps,
            r.concurrent_eps,
            per(r.selkie_bytes, r.distinct),
            per(r.radix_bytes, r.distinct),
            per(r.concurrent_bytes, r.distinct),
            per(r.selkie_bytes, r.entries),
            per(r.radix_bytes, r.entries),
            per(r.concurrent_bytes, r.entries),
        );
    }
    println!();
    println!(
        "Resident set growth while each index is built alone in a fresh process (its events built \
         first; Dynamo's indexers fed clones, a batch of 64 at a time for the thread pool), per \
         distinct block; \"-\" where it could not be read."
    );
    println!();
    println!("| workers | selkie B/block | RadixTree B/block | Concurrent B/block | selkie / RadixTree |");
    println!("|---:|---:|---:|---:|---:|");
    for r in &ingest_rows {
        let per = |b: Option<usize>| b.map_or("-".to_string(), |b| format!("{:.0}", b as f64 / r.distinct as f64));
        let ratio = match (r.rss[0], r.rss[1]) {
            (Some(a), Some(b)) if b > 0 => format!("{:.2}", a as f64 / b as f64),
            _ => "-".to_string(),
        };
        println!(
            "| {} | {} | {} | {} | {ratio} |",
            r.workers,
            per(r.rss[0]),
            per(r.rss[1]),
            per(r.rss[2])
        );
    }
    println!();
    println!("## Full path: tokens to a booked and released worker");
    println!();
    println!(
        "{FULL_PATH_WORKERS} workers, a {FULL_PATH_TOKENS}-token prompt. selkie: hash (block by block as the \
         index walk goes, so not past the first block no row holds), index query, select + book + release. \
         Dynamo: `SelectionCore::select_and_reserve` + `free_reservation` on a local core of \
         {FULL_PATH_WORKERS} idle workers (it hashes every block of the prompt). First row: a prompt nobody \
         holds (selkie's index holds the {FULL_PATH_WORKERS}-worker fleet above, Dynamo's core nothing). \
         Second row: the `host_kv_index_t0` fixture, both indexes fed the same events, the prompt's first 64 \
         blocks held by every worker and the next 32 by the workers of one shared prompt."
    );
    println!();
    println!("| prompt | Dynamo ns | selkie ns | ratio |");
    println!("|---|---:|---:|---:|");
    println!(
        "| nobody holds it | {dynamo_ns:.0} | {selkie_ns:.0} | {:.1}x |",
        dynamo_ns / selkie_ns
    );
    println!(
        "| 64 blocks held by all, 96 by a shared prompt's workers | {dynamo_shared_ns:.0} | \
         {selkie_shared_ns:.0} | {:.1}x |",
        dynamo_shared_ns / selkie_shared_ns
    );
    println!();
    println!("## Events and requests mixed (the claim in Dynamo's indexer README)");
    println!();
    println!(
        "Dynamo's indexer README: its concurrent indexers reach \"a combined throughput of over 10 million \
         events + requests per second with p99 latency under 10 microseconds\". The same kind of stream, on \
         one thread of this machine, {FULL_PATH_WORKERS} workers: every worker in turn evicts its last stored \
         run (up to {RUN_BLOCKS} blocks) and stores it again, and every {}th operation is a {QUERY_BLOCKS}-block \
         query (shared, own and unshared prefixes in turn); {MIXED_OPS} operations. Rate: operations per second \
         of time inside the calls; latency: per call. Both indexes answered every query alike afterwards.",
        EVENTS_PER_QUERY + 1
    );
    println!();
    println!("| index | events + requests per second | event p50 ns | event p99 ns | query p50 ns | query p99 ns |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, m) in [
        ("selkie `KvIndex`", &selkie_mixed),
        ("Dynamo `RadixTree`", &radix_mixed),
    ] {
        println!(
            "| {name} | {:.0} | {} | {} | {} | {} |",
            m.ops_per_s, m.event_p50, m.event_p99, m.query_p50, m.query_p99
        );
    }
    println!();
    family::report(&family_rows);
    ExitCode::SUCCESS
}

/// Dynamo's core of the full path fed `shared`'s fleet (fixture worker `w`
/// is Dynamo's worker `w + 1`), asking for `shared`'s prompt; returns once
/// its indexer credits the prompt's blocks as selkie's index does.
fn dynamo_holding(shared: &IndexFixture, hasher: &KvBlockHasher) -> DynamoCore {
    let workers = shared.runs.iter().map(|r| r.worker + 1).max().unwrap_or(0);
    let mut core = DynamoCore::with_tokens(workers, shared.prompt.clone());
    let events = shared
        .runs
        .iter()
        .map(|r| {
            RouterEvent::new(
                r.worker + 1,
                KvCacheEvent {
                    event_id: r.event_id,
                    dp_rank: 0,
                    data: dynamo_stored(r.parent, r.blocks.iter().copied()),
                },
            )
        })
        .collect();
    let mut local = Vec::new();
    hasher.local_hashes(&shared.prompt, &mut local);
    let mut out = KvOverlaps::new();
    shared
        .index
        .overlaps_for_tokens(hasher, &shared.prompt, &mut out)
        .expect("the fixture's index is synced");
    let credited: u64 = (0..workers as usize).map(|r| u64::from(out.tiers(r).0)).sum();
    core.apply_events(events, &local, credited);
    core
}

/// Operations of the mixed stream.
const MIXED_OPS: usize = 200_000;
/// Events between two queries of the mixed stream.
const EVENTS_PER_QUERY: usize = 3;
/// Distinct queries the mixed stream cycles through.
const MIXED_QUERIES: usize = 48;

/// A query of the mixed stream: local block hashes, for each index's input.
struct MixedQuery {
    hashes: Vec<u64>,
    local: Vec<LocalBlockHash>,
}

impl MixedQuery {
    fn new(hashes: Vec<u64>) -> Self {
        let local = hashes.iter().map(|&h| LocalBlockHash(h)).collect();
        MixedQuery { hashes, local }
    }
}

/// An index the mixed stream drives; events are built before the timed
/// call.
trait MixedIndex {
    type Event;
    fn event(run: &Run, id: u64, remove: bool) -> Self::Event;
    fn apply(&mut self, event: Self::Event);
    fn query(&mut self, q: &MixedQuery);
}

struct SelkieMixed<'a> {
    index: &'a mut KvIndex,
    out: KvOverlaps,
}

enum SelkieMixedEvent {
    Removed(WorkerWithDpRank, u64, Vec<u64>),
    Stored(WorkerWithDpRank, u64, Option<u64>, Vec<StoredBlock>),
}

impl MixedIndex for SelkieMixed<'_> {
    type Event = SelkieMixedEvent;

    fn event(run: &Run, id: u64, remove: bool) -> SelkieMixedEvent {
        let rank = WorkerWithDpRank::new(run.worker, 0);
        if remove {
            SelkieMixedEvent::Removed(rank, id, run.blocks.iter().map(|&(h, _)| h).collect())
        } else {
            let blocks = run
                .blocks
                .iter()
                .map(|&(block_hash, tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect();
            SelkieMixedEvent::Stored(rank, id, run.parent, blocks)
        }
    }

    fn apply(&mut self, event: SelkieMixedEvent) {
        let (rank, id, data) = match &event {
            SelkieMixedEvent::Removed(rank, id, blocks) => (*rank, *id, KvEventData::Removed { blocks }),
            SelkieMixedEvent::Stored(rank, id, parent, blocks) => (
                *rank,
                *id,
                KvEventData::Stored {
                    parent: *parent,
                    blocks,
                },
            ),
        };
        self.index
            .apply(&KvEvent::new(rank, id, data))
            .expect("the stream's events are in order");
    }

    fn query(&mut self, q: &MixedQuery) {
        let c = self
            .index
            .overlaps_for_local_hashes(&q.hashes, &mut self.out)
            .expect("rows are synced");
        black_box(c.device_blocks.len());
    }
}

struct RadixMixed<'a>(&'a mut RadixTree);

impl MixedIndex for RadixMixed<'_> {
    type Event = RouterEvent;

    fn event(run: &Run, id: u64, remove: bool) -> RouterEvent {
        let data = if remove {
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: run.blocks.iter().map(|&(h, _)| ExternalSequenceBlockHash(h)).collect(),
            })
        } else {
            run.dynamo_stored()
        };
        RouterEvent::new(
            run.worker,
            KvCacheEvent {
                event_id: id,
                dp_rank: 0,
                data,
            },
        )
    }

    fn apply(&mut self, event: RouterEvent) {
        self.0.apply_event(event).expect("the stream's events are in order");
    }

    fn query(&mut self, q: &MixedQuery) {
        black_box(self.0.find_matches(q.local.clone(), false));
    }
}

/// What the mixed stream measured.
struct Mixed {
    ops_per_s: f64,
    event_p50: u128,
    event_p99: u128,
    query_p50: u128,
    query_p99: u128,
}

/// Drives `index` with [`MIXED_OPS`] operations: every worker in turn
/// removes its last stored run and stores it again (two events), and every
/// `EVENTS_PER_QUERY + 1`-th operation is one of `queries`; each call is
/// timed alone.
fn mixed_stream<M: MixedIndex>(fleet: &Fleet, index: &mut M, queries: &[MixedQuery]) -> Mixed {
    let mut last: Vec<Option<&Run>> = vec![None; fleet.workers];
    for r in &fleet.runs {
        last[r.worker as usize] = Some(r);
    }
    let mut last: Vec<(&Run, u64)> = last
        .into_iter()
        .map(|r| {
            let r = r.expect("every worker stored a run");
            (r, r.id + 1)
        })
        .collect();
    let (mut events, mut asked) = (Vec::new(), Vec::new());
    for op in 0..MIXED_OPS {
        if op % (EVENTS_PER_QUERY + 1) == EVENTS_PER_QUERY {
            let q = &queries[(op / (EVENTS_PER_QUERY + 1)) % queries.len()];
            let start = Instant::now();
            index.query(q);
            asked.push(start.elapsed());
        } else {
            let e = events.len();
            let (run, id) = &mut last[(e / 2) % fleet.workers];
            let event = M::event(run, *id, e % 2 == 0);
            *id += 1;
            let start = Instant::now();
            index.apply(event);
            events.push(start.elapsed());
        }
    }
    let total: Duration = events.iter().chain(&asked).sum();
    events.sort_unstable();
    asked.sort_unstable();
    let at = |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q) as usize].as_nanos();
    Mixed {
        ops_per_s: MIXED_OPS as f64 / total.as_secs_f64(),
        event_p50: at(&events, 0.5),
        event_p99: at(&events, 0.99),
        query_p50: at(&asked, 0.5),
        query_p99: at(&asked, 0.99),
    }
}

fn progress(what: std::fmt::Arguments<'_>) {
    eprintln!("vs_dynamo_index: {what}");
}
