//! Wall-clock time of the KV index: one query of a 128-block prompt on
//! fleets of 128, 1,024 and 4,096 worker ranks that together hold about
//! 100,000 distinct blocks (more at 4,096: each rank holds at least 128
//! blocks of its own), with a prompt that shares a 96-block prefix with
//! every worker and one that only its own worker holds; event
//! ingestion rate; heap bytes per indexed block.
//!
//! ```text
//! cargo bench -p selkie-benches --bench kv_index
//! ```
//!
//! Each figure is the best of several runs (the machine is shared), and
//! the queries of one run are the same prompt repeated, through the public
//! API as a router calls it.
use std::hint::black_box;
use std::time::Instant;

use selkie::kv_index::{sequence_hashes_of, KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use selkie::{
    KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType,
    WorkerWithDpRank,
};

const PROMPT_BLOCKS: usize = 128;
const SHARED_BLOCKS: usize = 96;
const DISTINCT_BLOCKS: usize = 100_000;
const STORE_RUN: usize = 16;

/// A local hash for block `j` of worker `w`'s private continuation (or of
/// the shared prefix when `w` is `None`).
fn local(w: Option<usize>, j: usize) -> u64 {
    let w = w.map_or(0, |w| w as u64 + 1);
    (w << 32 | j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234
}

fn main() {
    for workers in [128usize, 1_024, 4_096] {
        let service = WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig::default(),
        );
        for w in 0..workers {
            service.add_worker(WorkerRecord::new(w as u64)).expect("worker");
        }
        // Every worker holds the shared prefix and 32 blocks of its own
        // after it, and a chain of its own from the first block, so the
        // fleet holds about DISTINCT_BLOCKS distinct blocks.
        let own = (DISTINCT_BLOCKS / workers)
            .saturating_sub(PROMPT_BLOCKS)
            .max(PROMPT_BLOCKS);
        let mut events: Vec<(WorkerWithDpRank, u64, Option<u64>, Vec<StoredBlock>)> = Vec::new();
        for w in 0..workers {
            let rank = WorkerWithDpRank::new(w as u64, 0);
            let shared_chain: Vec<u64> = (0..SHARED_BLOCKS)
                .map(|j| local(None, j))
                .chain((0..PROMPT_BLOCKS - SHARED_BLOCKS).map(|j| local(Some(w), j)))
                .collect();
            let own_chain: Vec<u64> = (0..own).map(|j| local(Some(w), 1_000_000 + j)).collect();
            let mut id = 0;
            for locals in [shared_chain, own_chain] {
                let mut seqs = Vec::new();
                sequence_hashes_of(&locals, &mut seqs);
                for (run, chunk) in locals.chunks(STORE_RUN).enumerate() {
                    let start = run * STORE_RUN;
                    let blocks = chunk
                        .iter()
                        .enumerate()
                        .map(|(i, &tokens_hash)| StoredBlock {
                            block_hash: seqs[start + i],
                            tokens_hash,
                        })
                        .collect();
                    let parent = start.checked_sub(1).map(|p| seqs[p]);
                    id += 1;
                    events.push((rank, id, parent, blocks));
                }
            }
        }
        let mut best_ingest = f64::MAX;
        let mut index = KvIndex::new(16);
        for _ in 0..3 {
            index = KvIndex::new(16);
            // Each rank's first event (an empty clear) before the rows are
            // synced, as when workers join: stores then land on rows.
            for w in 0..workers {
                let rank = WorkerWithDpRank::new(w as u64, 0);
                index
                    .apply(&KvEvent::new(rank, 0, KvEventData::Cleared))
                    .expect("cleared");
            }
            index
                .sync_rows(service.row_layout(), |r| service.row_of(r))
                .expect("the index has the service's block size");
            let t = Instant::now();
            for (rank, id, parent, blocks) in &events {
                let data = KvEventData::Stored {
                    parent: *parent,
                    blocks,
                };
                index.apply(&KvEvent::new(*rank, *id, data)).expect("stored");
            }
            best_ingest = best_ingest.min(t.elapsed().as_secs_f64());
        }
        let holdings: usize = events.iter().map(|e| e.3.len()).sum();
        let distinct = index.block_count();
        println!(
            "{workers:>5} ranks: {} events ({holdings} blocks stored, {distinct} distinct): ingestion {:.2} M events/s, \
             {:.2} M blocks/s; heap {:.1} MiB = {:.0} B per distinct block, {:.1} B per stored block",
            events.len(),
            events.len() as f64 / best_ingest / 1e6,
            holdings as f64 / best_ingest / 1e6,
            index.heap_bytes() as f64 / (1 << 20) as f64,
            index.heap_bytes() as f64 / distinct as f64,
            index.heap_bytes() as f64 / holdings as f64,
        );
        let mut out = KvOverlaps::new();
        for (name, owner, shared) in [
            ("shared 96-block prefix", workers / 2, true),
            ("unshared", workers / 2, false),
        ] {
            let locals: Vec<u64> = if shared {
                (0..SHARED_BLOCKS)
                    .map(|j| local(None, j))
                    .chain((0..PROMPT_BLOCKS - SHARED_BLOCKS).map(|j| local(Some(owner), j)))
                    .collect()
            } else {
                (0..PROMPT_BLOCKS).map(|j| local(Some(owner), 1_000_000 + j)).collect()
            };
            let mut seqs = Vec::new();
            sequence_hashes_of(&locals, &mut seqs);
            let columns = index.overlaps(&seqs, &mut out).expect("synced");
            let row = service.row_of(WorkerWithDpRank::new(owner as u64, 0)).expect("row");
            assert_eq!(columns.device_blocks[row] as usize, PROMPT_BLOCKS, "{name}");
            let held_by = columns.device_blocks.iter().filter(|&&d| d > 0.0).count();
            assert_eq!(held_by, if shared { workers } else { 1 }, "{name}");
            let mut best = f64::MAX;
            const QUERIES: usize = 2_000;
            for _ in 0..7 {
                let t = Instant::now();
                for _ in 0..QUERIES {
                    black_box(index.overlaps(black_box(&seqs), &mut out).expect("synced"));
                }
                best = best.min(t.elapsed().as_secs_f64() / QUERIES as f64);
            }
            println!(
                "{workers:>5} ranks: query, 128-block prompt, {name}: {:.2} µs",
                best * 1e6
            );
        }
    }
}
