//! The router's view of every simulated cache: which ranks hold each block,
//! kept up to date from the caches' add / evict events (as a router's KV
//! indexer is fed by workers' KV events), and the per-rank prefix overlap of
//! a request computed in one walk over its blocks.
//!
//! [`OverlapIndex::overlaps`] must equal asking every cache for its
//! [`KvCache::prefix_match`](super::cache::KvCache::prefix_match); the
//! tests check it against exactly that.

use super::cache::BlockMap;
use super::router::RowOverlap;

/// Block → set of ranks holding it, as one 64-bit mask per group of 64 ranks.
#[derive(Clone, Debug)]
pub struct OverlapIndex {
    rows: usize,
    groups: Vec<BlockMap<u64>>,
}

impl OverlapIndex {
    /// An empty index over `rows` ranks.
    pub fn new(rows: usize) -> Self {
        OverlapIndex {
            rows,
            groups: (0..rows.div_ceil(64)).map(|_| BlockMap::default()).collect(),
        }
    }

    /// Applies one rank's cache events (`true`: added, `false`: evicted).
    pub fn apply(&mut self, row: usize, changes: impl IntoIterator<Item = (u64, bool)>) {
        let map = &mut self.groups[row / 64];
        let bit = 1u64 << (row % 64);
        for (hash, added) in changes {
            if added {
                *map.entry(hash).or_insert(0) |= bit;
            } else if let Some(m) = map.get_mut(&hash) {
                *m &= !bit;
                if *m == 0 {
                    map.remove(&hash);
                }
            }
        }
    }

    /// Writes the prefix overlap of `hashes` for every rank that has one,
    /// in rank order, into `out` (cleared first).
    pub fn overlaps(&self, hashes: &[u64], out: &mut Vec<RowOverlap>) {
        out.clear();
        for (g, map) in self.groups.iter().enumerate() {
            let in_group = (self.rows - g * 64).min(64);
            let mut active = if in_group == 64 {
                u64::MAX
            } else {
                (1u64 << in_group) - 1
            };
            let mut depth = 0;
            let start = out.len();
            while active != 0 && depth < hashes.len() {
                let holding = map.get(&hashes[depth]).copied().unwrap_or(0) & active;
                let dropped = active & !holding;
                if depth > 0 {
                    push_rows(out, g, dropped, depth as u32);
                }
                active = holding;
                depth += 1;
            }
            if depth > 0 {
                push_rows(out, g, active, depth as u32);
            }
            out[start..].sort_unstable_by_key(|o| o.row);
        }
    }
}

fn push_rows(out: &mut Vec<RowOverlap>, group: usize, mut mask: u64, blocks: u32) {
    while mask != 0 {
        let bit = mask.trailing_zeros();
        mask &= mask - 1;
        out.push(RowOverlap {
            row: (group * 64) as u32 + bit,
            blocks,
        });
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
                caches[row].release(&hashes, extra, &[]);
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
