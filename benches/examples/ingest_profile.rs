//! KV index ingestion alone, to profile it: the fleet of `vs_dynamo_index`
//! (the same seeded chains, runs of at most 32 blocks) stored into an empty
//! index, synced to the service's rows after each worker's first event, as
//! that bench times it (Dynamo is built only with the `dynamo` feature:
//! see below).
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
//!
//! A fourth argument, `unplaced`, never syncs the rows: the ranks' own
//! tables and the sequence hashes alone, no block table (what the block
//! table costs is the difference); `reserved` builds each index with its
//! block table reserved for the fleet's distinct blocks
//! (`KvIndex::with_block_capacity`), so that it never grows.
//!
//! Built with the `dynamo` feature, each turn also builds Dynamo 1.6.1's
//! `RadixTree` from the same runs (its events made before its clock starts,
//! as `vs_dynamo_index` does), and the fastest of the turns of each is
//! compared at the end: `vs_dynamo_index`'s ingestion ratio in one process,
//! without that bench's queries and other indexers.
//!
//! ```text
//! cargo build --release -p selkie-benches --features dynamo --example ingest_profile
//! target/release/examples/ingest_profile 1024 10
//! valgrind --tool=callgrind --toggle-collect='*measured_radix*' \
//!     target/release/examples/ingest_profile 1024
//! ```
use std::hint::black_box;

use selkie::kv_index::{sequence_hashes_of, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::{
    KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType,
    WorkerWithDpRank,
};

use selkie_benches::{chain, SplitMix64 as Stream};

fn main() {
    let workers: usize = std::env::args().nth(1).map_or(1024, |a| a.parse().expect("workers"));
    let turns: usize = std::env::args().nth(2).map_or(1, |a| a.parse().expect("turns"));
    let queries: usize = std::env::args().nth(3).map_or(0, |a| a.parse().expect("queries"));
    let (place, reserve) = match std::env::args().nth(4).as_deref() {
        None => (true, false),
        Some("unplaced") => (false, false),
        Some("reserved") => (true, true),
        Some(other) => panic!("unknown mode {other}: the fourth argument is `unplaced`, `reserved` or nothing"),
    };
    assert!(
        place || queries == 0,
        "queries need the rows synced: `unplaced` takes no queries"
    );
    let mut rng = Stream::new(0x5e1c_1e1d_e000 + workers as u64);
    let system = chain(&mut rng, 64);
    let shared: Vec<Vec<u64>> = (0..64)
        .map(|_| {
            let mut p = system.clone();
            p.extend(chain(&mut rng, 32));
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
        first.extend(chain(&mut rng, cont));
        let alone = chain(&mut rng, root);
        own.push(first[..first.len().min(128)].to_vec());
        for all in [first, alone] {
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
    let capacity = if reserve {
        let distinct: std::collections::HashSet<u64> =
            runs.iter().flat_map(|r| r.3.iter().map(|b| b.block_hash)).collect();
        distinct.len()
    } else {
        0
    };
    let mut fastest = f64::MAX;
    #[cfg_attr(not(feature = "dynamo"), allow(unused_mut))]
    let mut fastest_radix = f64::MAX;
    for turn in 0..turns {
        let faults = minor_faults();
        let start = std::time::Instant::now();
        let index = measured_build(&runs, &service, place, capacity);
        let s = start.elapsed().as_secs_f64();
        fastest = fastest.min(s);
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
        drop(index);
        #[cfg(feature = "dynamo")]
        {
            let events = radix::events(&runs);
            let start = std::time::Instant::now();
            let tree = radix::measured_radix(events);
            fastest_radix = fastest_radix.min(start.elapsed().as_secs_f64());
            drop(tree);
        }
    }
    if fastest_radix < f64::MAX {
        let n = runs.len() as f64;
        println!(
            "fastest of {turns}: selkie {:.0} events/s, RadixTree {:.0} events/s: selkie {:.2}x",
            n / fastest,
            n / fastest_radix,
            fastest_radix / fastest
        );
    }
}

/// Dynamo's `RadixTree` fed the same runs.
#[cfg(feature = "dynamo")]
mod radix {
    use dynamo_kv_router::protocols::{KvCacheEvent, RouterEvent};
    use dynamo_kv_router::RadixTree;
    use selkie::kv_index::StoredBlock;
    use selkie_benches::vs_dynamo::dynamo_stored;

    /// The runs as Dynamo's events (each a stored run under its parent).
    pub fn events(runs: &[(u64, u64, Option<u64>, Vec<StoredBlock>)]) -> Vec<RouterEvent> {
        runs.iter()
            .map(|(worker, id, parent, blocks)| {
                let data = dynamo_stored(*parent, blocks.iter().copied());
                RouterEvent::new(
                    *worker,
                    KvCacheEvent {
                        event_id: *id,
                        dp_rank: 0,
                        data,
                    },
                )
            })
            .collect()
    }

    /// One build of a `RadixTree` (callgrind:
    /// `--toggle-collect='*measured_radix*'`).
    #[inline(never)]
    pub fn measured_radix(events: Vec<RouterEvent>) -> RadixTree {
        let mut tree = RadixTree::new();
        for event in events {
            tree.apply_event(event).expect("the runs are in order");
        }
        tree
    }
}

/// One build of the index from `runs`, each rank put on its row after its
/// first run if `place`, the block table reserved for `capacity` blocks
/// (callgrind: `--toggle-collect='*measured_build*'`).
#[inline(never)]
fn measured_build(
    runs: &[(u64, u64, Option<u64>, Vec<StoredBlock>)],
    service: &WorkerSelectionService,
    place: bool,
    capacity: usize,
) -> KvIndex {
    let mut index = KvIndex::new(16).with_block_capacity(capacity);
    for (w, id, parent, blocks) in runs {
        let data = KvEventData::Stored {
            parent: *parent,
            blocks,
        };
        index
            .apply(&KvEvent::new(WorkerWithDpRank::new(*w, 0), *id, data))
            .expect("in order");
        if *id == 0 && place {
            index
                .sync_rows(service.row_layout(), |r| service.row_of(r))
                .expect("the index has the service's block size");
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
