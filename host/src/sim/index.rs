//! The router's view of every simulated cache: selkie's KV index
//! ([`KvIndex`]) fed with the caches' KV events (a block stored after its
//! parent, a block evicted), as a router's index is fed by its workers, and
//! queried per request for every rank's prefix overlap.
//!
//! [`OverlapIndex::overlaps`] must equal asking every cache for its
//! [`KvCache::prefix_match`](super::cache::KvCache::prefix_match); the
//! tests check it against exactly that.

use super::cache::CacheChange;
use super::router::RowOverlap;
use crate::kv_index::{KvEvent, KvEventData, KvIndex, KvOverlaps, StoredBlock};
use crate::request::RowLayout;
use crate::types::WorkerWithDpRank;

/// The block size of the index and of its layout. The trace's block ids
/// stand for the token blocks, so the block size only scales the
/// cached-token estimate, which the simulator does not read.
const BLOCK_SIZE: u32 = 1;

/// The index of a simulated fleet of `rows` ranks: rank `r` is row `r`.
#[derive(Debug)]
pub struct OverlapIndex {
    rows: usize,
    index: KvIndex,
    /// The next event id of each row.
    next_id: Vec<u64>,
    out: KvOverlaps,
}

impl OverlapIndex {
    /// An empty index of `rows` ranks.
    pub fn new(rows: usize) -> Self {
        let mut index = KvIndex::new(BLOCK_SIZE);
        // The layout is the index's own (its block size included): the
        // sync cannot be refused.
        let _ = index.sync_rows(RowLayout::new(1, rows, BLOCK_SIZE), row_of(rows));
        OverlapIndex {
            rows,
            index,
            next_id: vec![0; rows],
            out: KvOverlaps::new(),
        }
    }

    /// Applies row `row`'s cache changes as its worker's KV events: the
    /// engine hash and the local hash of a block are its trace id.
    pub fn apply(&mut self, row: usize, changes: impl IntoIterator<Item = CacheChange>) {
        let rank = WorkerWithDpRank::new(row as u64, 0);
        for change in changes {
            let id = self.next_id[row];
            self.next_id[row] += 1;
            let (stored, removed);
            let data = match change {
                CacheChange::Stored { hash, parent } => {
                    stored = [StoredBlock {
                        block_hash: hash,
                        tokens_hash: hash,
                    }];
                    KvEventData::Stored {
                        parent,
                        blocks: &stored,
                    }
                }
                CacheChange::Evicted(hash) => {
                    removed = [hash];
                    KvEventData::Removed { blocks: &removed }
                }
            };
            // The caches store a block only after its parent, so nothing
            // is refused.
            let applied = self.index.apply(&KvEvent::new(rank, id, data));
            debug_assert!(applied.is_ok(), "row {row}: {applied:?}");
        }
    }

    /// Every row's prefix overlap with the request's block ids `hashes`,
    /// rows without one left out, in row order.
    pub fn overlaps(&mut self, hashes: &[u64], out: &mut Vec<RowOverlap>) {
        out.clear();
        // Ranks seen for the first time since the last query get their row
        // (the layout itself never changes).
        let _ = self
            .index
            .sync_rows(RowLayout::new(1, self.rows, BLOCK_SIZE), row_of(self.rows));
        let columns = self
            .index
            .overlaps_for_local_hashes(hashes, &mut self.out)
            .expect("the index is placed on its rows at creation");
        for (row, &blocks) in columns.device_blocks[..self.rows].iter().enumerate() {
            if blocks > 0.0 {
                out.push(RowOverlap {
                    row: row as u32,
                    blocks: blocks as u32,
                });
            }
        }
    }
}

/// Rank `(r, 0)` is row `r`.
fn row_of(rows: usize) -> impl FnMut(WorkerWithDpRank) -> Option<usize> {
    move |r| {
        usize::try_from(r.worker_id)
            .ok()
            .filter(|&row| row < rows && r.dp_rank == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::cache::KvCache;
    use super::*;
    use selkie_kernel::Rng;

    /// The index agrees with asking every cache, across random traffic on
    /// 70 ranks (two mask groups) with small caches that evict constantly.
    #[test]
    fn index_equals_per_cache_prefix_match() {
        let rows = 70;
        let mut caches: Vec<KvCache> = (0..rows).map(|_| KvCache::new(24)).collect();
        let mut index = OverlapIndex::new(rows);
        let mut rng = Rng::new(11);
        let mut got = Vec::new();
        for step in 0..4_000 {
            let root = rng.below(4);
            let len = 1 + rng.below(10) as usize;
            let branch = rng.below(3);
            let hashes: Vec<u64> = (0..len)
                .map(|j| {
                    if j < 3 {
                        root * 100 + j as u64
                    } else {
                        root * 100 + branch * 10 + j as u64
                    }
                })
                .collect();
            let row = rng.below(rows as u64) as usize;
            let extra = rng.below(3) as u32;
            if caches[row].acquire(&hashes, extra, false).is_some() {
                caches[row].release(&hashes, extra, &[], None);
            }
            index.apply(row, caches[row].drain_changes());
            if step % 7 == 3 {
                index.overlaps(&hashes, &mut got);
                let want: Vec<RowOverlap> = (0..rows)
                    .filter_map(|r| {
                        let blocks = caches[r].prefix_match(&hashes);
                        (blocks > 0).then_some(RowOverlap { row: r as u32, blocks })
                    })
                    .collect();
                assert_eq!(got, want, "step {step}");
            }
        }
    }
}
