//! KV index ingestion alone, to profile it: the fleet of `vs_dynamo_index`
//! (the same seeded chains, runs of at most 32 blocks) stored into an empty
//! index, synced to the service's rows after each worker's first event, as
//! that bench times it, without building Dynamo.
//!
//! Each build prints its time and the page faults it took. glibc hands a
//! dropped index's memory back to the system, so every build here faults
//! its tables in afresh, where the bench's process (Dynamo's indexes built
//! in between) reuses it; glibc's `MALLOC_TRIM_THRESHOLD_` and
//! `MALLOC_MMAP_THRESHOLD_` keep it, as there:
//!
//! ```text
//! cargo build --release -p selkie-benches --example ingest_profile
//! target/release/examples/ingest_profile 1024 5     # workers, builds
//! MALLOC_TRIM_THRESHOLD_=4000000000 MALLOC_MMAP_THRESHOLD_=4000000000 \
//!     target/release/examples/ingest_profile 1024 5
//! valgrind --tool=callgrind --toggle-collect='*measured_build*' \
//!     target/release/examples/ingest_profile 1024
//! ```
//!
//! A third argument runs that many own-prefix queries (by local hashes, as
//! `vs_dynamo_index` times them: a worker's shared prompt and continuation,
//! 128 blocks) on the last build, in `measured_queries`:
//!
//! ```text
//! valgrind --tool=callgrind --toggle-collect='*measured_queries*' \
//!     target/release/examples/ingest_profile 1024 1 640
//! ```
use std::hint::black_box;

use selkie::kv_index::{sequence_hashes_of, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::{
    KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType,
    WorkerWithDpRank,
};

use selkie_benches::SplitMix64 as Stream;

fn main() {
    let workers: usize = std::env::args().nth(1).map_or(1024, |a| a.parse().expect("workers"));
    let turns: usize = std::env::args().nth(2).map_or(1, |a| a.parse().expect("turns"));
    let queries: usize = std::env::args().nth(3).map_or(0, |a| a.parse().expect("queries"));
    let mut rng = Stream(0x5e1c_1e1d_e000 + workers as u64);
    let system = rng.chain(64);
    let shared: Vec<Vec<u64>> = (0..64)
        .map(|_| {
            let mut p = system.clone();
            p.extend(rng.chain(32));
            p
        })
        .collect();
    let own_blocks = (100_000 - 64 - 64 * 32) / workers;
    let (cont, root) = (own_blocks / 2, own_blocks - own_blocks / 2);
    let mut runs: Vec<(u64, u64, Option<u64>, Vec<StoredBlock>)> = Vec::new();
    let mut own = Vec::new();
    for w in 0..workers {
        let mut id = 0;
        let mut first = shared[w % 64].clone();
        first.extend(rng.chain(cont));
        let chain = rng.chain(root);
        own.push(first[..first.len().min(128)].to_vec());
        for all in [first, chain] {
            let mut seq = Vec::new();
            sequence_hashes_of(&all, &mut seq);
            let mut at = 0;
            while at < all.len() {
                let end = (at + 32).min(all.len());
                let blocks = (at..end)
                    .map(|i| StoredBlock {
                        block_hash: seq[i],
                        tokens_hash: all[i],
                    })
                    .collect();
                runs.push((w as u64, id, at.checked_sub(1).map(|p| seq[p]), blocks));
                id += 1;
                at = end;
            }
        }
    }
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig {
            block_size: 16,
            seed: Some(7),
            ..ServiceConfig::default()
        },
    );
    service
        .sync((0..workers as u64).map(WorkerRecord::new).collect())
        .expect("the fleet has room");
    for turn in 0..turns {
        let faults = minor_faults();
        let start = std::time::Instant::now();
        let index = measured_build(&runs, &service);
        let s = start.elapsed().as_secs_f64();
        let faults = minor_faults() - faults;
        println!(
            "{workers} workers: {} events in {:.2} ms ({:.0} events/s, {faults} page faults), {} blocks, heap {} B ({:.1} B/block)",
            runs.len(),
            s * 1e3,
            runs.len() as f64 / s,
            index.block_count(),
            index.heap_bytes(),
            index.heap_bytes() as f64 / index.block_count() as f64
        );
        // Each build's index is dropped before the next starts, as the
        // bench drops it; the last one answers the queries first.
        if turn + 1 == turns && queries > 0 {
            measured_queries(&index, &own, queries);
            println!("{queries} own-prefix queries");
        }
    }
}

/// One build of the index from `runs` (callgrind:
/// `--toggle-collect='*measured_build*'`).
#[inline(never)]
fn measured_build(runs: &[(u64, u64, Option<u64>, Vec<StoredBlock>)], service: &WorkerSelectionService) -> KvIndex {
    let mut index = KvIndex::new(16);
    for (w, id, parent, blocks) in runs {
        let data = KvEventData::Stored {
            parent: *parent,
            blocks,
        };
        index
            .apply(&KvEvent::new(WorkerWithDpRank::new(*w, 0), *id, data))
            .expect("in order");
        if *id == 0 {
            index.sync_rows(service.row_layout(), |r| service.row_of(r));
        }
    }
    index
}

/// `queries` own-prefix queries, worker after worker.
#[inline(never)]
fn measured_queries(index: &KvIndex, own: &[Vec<u64>], queries: usize) {
    let mut out = KvOverlaps::new();
    for i in 0..queries {
        let columns = index
            .overlaps_for_local_hashes(&own[i % own.len()], &mut out)
            .expect("rows are synced");
        black_box(columns.device_blocks[0]);
    }
}

/// Minor page faults of this process so far (Linux; 0 elsewhere).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Field 10, counted after the parenthesised command name.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7))
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}
