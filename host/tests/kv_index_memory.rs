//! The KV index's memory bound holds for any event stream: a counting
//! global allocator measures the heap the index holds (and the resident
//! set is read from `/proc`), not only its counters.
//!
//! * A flood of single-block events from ranks that never get a row: the
//!   ranks awaiting a row are bounded in number, so is the heap.
//! * A flood of `Cleared` events, from new ranks and from one rank: the
//!   heap does not grow with the flood.
//! * One `Stored` event of far more blocks than the bound: refused whole
//!   (`KvEventError::TooManyBlocks`), and the heap is as before.
//! * A rank that held many blocks and cleared them gives the memory back.
//!
//! The streams are small enough for a debug build to run them in seconds,
//! and each is large enough that an index without these bounds holds many
//! times the heap the assertions allow.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use selkie::kv_index::{KvEvent, KvEventData, KvEventError, KvIndex, StoredBlock};
use selkie::*;

/// Live heap bytes of the process (allocated minus freed).
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The measured tests run one at a time (the counter is process-wide).
static SERIAL: Mutex<()> = Mutex::new(());

struct Counting;

// SAFETY: forwards every call to the system allocator with the same
// arguments; only counts the bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Resident set bytes, from `/proc/self/statm` (0 where there is none).
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

const MIB: isize = 1 << 20;

fn rank(i: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(1_000_000 + i, 0)
}

fn stored(rank: WorkerWithDpRank, id: u64, parent: Option<u64>, blocks: &[StoredBlock]) -> KvEvent<'_> {
    KvEvent::new(rank, id, KvEventData::Stored { parent, blocks })
}

/// A service of four workers, and an index synced to it.
fn fleet(index: &mut KvIndex) -> WorkerSelectionService {
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig::default(),
    );
    for w in 0..4 {
        service.add_worker(WorkerRecord::new(w)).expect("a new worker");
    }
    index
        .sync_rows(service.row_layout(), |r| service.row_of(r))
        .expect("the index has the service's block size");
    service
}

/// 20,000 single-block events, each from a rank that never gets a row,
/// with the bound at 10,000 blocks: the ranks awaiting a row are bounded,
/// and so are the heap and the resident set (without a bound on them the
/// index holds every rank and a table of its own for each: 130 MB).
#[test]
fn a_flood_of_ranks_without_rows_is_bounded() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut index = KvIndex::new(16).with_max_blocks(10_000);
    let _service = fleet(&mut index);
    let (heap0, rss0) = (live(), rss());
    for i in 0..20_000u64 {
        let block = [StoredBlock {
            block_hash: i,
            tokens_hash: i,
        }];
        index.apply(&stored(rank(i), 7, None, &block)).expect("a root store");
    }
    let (heap, grown_rss) = (live() - heap0, rss().saturating_sub(rss0));
    println!(
        "20,000 ranks without rows: {} ranks kept, {} blocks held, heap +{:.1} MiB, resident set +{:.1} MiB",
        index.rank_count(),
        index.held_blocks(),
        heap as f64 / MIB as f64,
        grown_rss as f64 / MIB as f64
    );
    assert!(index.rank_count() <= 4_096, "{} ranks kept", index.rank_count());
    assert!(heap < 8 * MIB, "heap +{heap} bytes");
    assert!(grown_rss < 32 << 20, "resident set +{grown_rss} bytes");
}

/// 200,000 `Cleared` events from new ranks, then 200,000 from one rank:
/// the heap does not grow with the flood (what the first 50,000 took, a
/// few MiB for the ranks awaiting a row, is all it takes).
#[test]
fn a_flood_of_clears_is_bounded() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut index = KvIndex::new(16).with_max_blocks(10_000);
    let _service = fleet(&mut index);
    let heap0 = live();
    let mut after_50k = 0;
    for i in 0..200_000u64 {
        let _ = index.apply(&KvEvent::new(rank(i), i, KvEventData::Cleared));
        if i == 50_000 {
            after_50k = live() - heap0;
        }
    }
    let after_new_ranks = live() - heap0;
    for i in 0..200_000u64 {
        let _ = index.apply(&KvEvent::new(rank(0), i, KvEventData::Cleared));
    }
    let after_one_rank = live() - heap0;
    println!(
        "200,000 clears from new ranks: heap +{after_50k} B after 50,000, +{after_new_ranks} B after 200,000 \
         ({} ranks kept); 200,000 more from one rank: +{after_one_rank} B",
        index.rank_count()
    );
    assert!(after_new_ranks < 4 * MIB, "heap +{after_new_ranks} bytes");
    assert!(
        after_new_ranks - after_50k < 64 << 10,
        "the heap grew with the flood: +{after_50k} B after 50,000, +{after_new_ranks} B after 200,000"
    );
    assert!(
        after_one_rank - after_new_ranks < 64 << 10,
        "heap +{after_one_rank} bytes"
    );
}

/// One `Stored` event of 1,000,000 blocks with the bound at 1,000: refused
/// whole, and the heap is as before (without the refusal the rank's table
/// is sized for the million blocks and stays so, after the eviction and
/// after a `Cleared`).
#[test]
fn one_oversized_store_is_refused_and_holds_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let blocks: Vec<StoredBlock> = (1..=1_000_000u64)
        .map(|i| StoredBlock {
            block_hash: i,
            tokens_hash: i,
        })
        .collect();
    let mut index = KvIndex::new(16).with_max_blocks(1_000);
    let _service = fleet(&mut index);
    let (heap0, rss0) = (live(), rss());
    let worker = WorkerWithDpRank::new(0, 0);
    let outcome = index.apply(&stored(worker, 0, None, &blocks));
    let after_store = live() - heap0;
    let _ = index.apply(&KvEvent::new(worker, 1, KvEventData::Cleared));
    let after_clear = live() - heap0;
    let grown_rss = rss().saturating_sub(rss0);
    println!(
        "a store of 1,000,000 blocks, bound 1,000: {outcome:?}; heap +{after_store} B, +{after_clear} B after a clear; \
         resident set +{grown_rss} B"
    );
    assert!(
        matches!(
            outcome,
            Err(KvEventError::TooManyBlocks {
                blocks: 1_000_000,
                max_blocks: 1_000,
                ..
            })
        ),
        "{outcome:?}"
    );
    assert!(after_store < MIB, "heap +{after_store} bytes after the store");
    assert!(after_clear < MIB / 4, "heap +{after_clear} bytes after the clear");
    assert!(grown_rss < 16 << 20, "resident set +{grown_rss} bytes");
}

/// A rank that held 40,000 blocks and cleared them gives the memory back:
/// its table and the block table shrink.
#[test]
fn memory_comes_back_after_a_clear() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut index = KvIndex::new(16).with_max_blocks(50_000);
    let service = fleet(&mut index);
    let heap0 = live();
    let worker = WorkerWithDpRank::new(1, 0);
    let mut parent = None;
    for (id, run) in (1..=40_000u64).collect::<Vec<u64>>().chunks(1_000).enumerate() {
        let blocks: Vec<StoredBlock> = run
            .iter()
            .map(|&i| StoredBlock {
                block_hash: i,
                tokens_hash: i,
            })
            .collect();
        index
            .apply(&stored(worker, id as u64, parent, &blocks))
            .expect("a chain");
        parent = run.last().copied();
    }
    index
        .sync_rows(service.row_layout(), |r| service.row_of(r))
        .expect("the index has the service's block size");
    let held = live() - heap0;
    index
        .apply(&KvEvent::new(worker, 40, KvEventData::Cleared))
        .expect("a clear");
    let after_clear = live() - heap0;
    println!("40,000 blocks held: heap +{held} B; after a clear +{after_clear} B");
    assert!(held > 40_000 * 24, "the blocks were held ({held} bytes)");
    assert!(after_clear < MIB / 4, "heap +{after_clear} bytes after the clear");
}
