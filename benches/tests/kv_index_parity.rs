//! selkie's KV index against dynamo-kv-router 1.6.1's `RadixTree` on seeded
//! random event streams: stores (some under parents the rank does not
//! hold, some naming their parent as a block), removals (some of unknown
//! blocks), clears, device / host / disk tiers, 1 to 1,000 workers, with and
//! without data-parallel ranks.
//!
//! * Streams without middle removals (only blocks without a held child
//!   are evicted, as engines evict), whose device stores chain under
//!   device blocks (mostly: see below): every device-tier event's accept /
//!   reject outcome and every query's per-rank device overlap equal
//!   `RadixTree::apply_event` and `RadixTree::find_matches`.
//! * Streams with middle removals, whose device stores also chain under
//!   blocks held only in host memory or on disk: every query's overlap
//!   equals the exact per-block answer and is never below the
//!   `RadixTree`'s (which forgets a rank's later blocks of a run when one
//!   in the middle is removed, and, fed the device events only, refuses a
//!   device store under a lower-tier parent, where selkie takes a parent
//!   in any tier). A rank that got such a store in the first kind of
//!   stream (a store under a random parent may find one) is held to the
//!   second kind's checks from then on.
//! * Always: host and disk overlaps (which `RadixTree` does not see) and
//!   every event's outcome equal a plain per-block model.
//!
//! A run stores blocks the rank does not hold yet in its tier (it stops at
//! the first one it holds), as an engine stores a block once per copy: a
//! second copy would be held until removed twice, where the `RadixTree`
//! forgets it at the first removal.
//!
//! ```text
//! cargo test -p selkie-benches --features dynamo --test kv_index_parity -- --nocapture
//! ```
use std::collections::{HashMap, HashSet};

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, LocalBlockHash, RouterEvent,
    WorkerWithDpRank as DynamoRank,
};
use dynamo_kv_router::RadixTree;
use selkie::kv_index::{sequence_hashes_of, KvEvent, KvEventData, KvIndex, KvOverlaps, StorageTier, StoredBlock};
use selkie::{
    KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService, WorkerType,
    WorkerWithDpRank,
};
use selkie_benches::vs_dynamo::dynamo_stored;
use selkie_kernel::Rng;

/// The engine hash of a block: a fixed function of its sequence hash, as
/// an engine's hash is a function of the block's prefix.
fn engine_hash(seq: u64) -> u64 {
    seq ^ 0x5bd1_e995_0000_0001
}

/// Prompts sharing prefixes: each copies a random prefix of an earlier one.
struct Prompts {
    local: Vec<Vec<u64>>,
    seq: Vec<Vec<u64>>,
}

impl Prompts {
    fn new(rng: &mut Rng, count: usize, blocks: usize) -> Self {
        let mut local: Vec<Vec<u64>> = Vec::new();
        for p in 0..count {
            let shared = if p == 0 || rng.below(4) == 0 {
                0
            } else {
                rng.below(blocks as u64) as usize
            };
            let mut hashes: Vec<u64> = if shared > 0 {
                local[rng.below(p as u64) as usize][..shared].to_vec()
            } else {
                Vec::new()
            };
            while hashes.len() < blocks {
                hashes.push(rng.next_u64());
            }
            local.push(hashes);
        }
        let seq = local
            .iter()
            .map(|l| {
                let mut s = Vec::new();
                sequence_hashes_of(l, &mut s);
                s
            })
            .collect();
        Prompts { local, seq }
    }
}

/// The exact per-block model: per rank, sequence hash -> tiers held.
#[derive(Default)]
struct Model {
    held: HashMap<WorkerWithDpRank, HashMap<u64, u8>>,
    /// Sequence hash -> parent sequence hash (None at the first block).
    parent: HashMap<u64, Option<u64>>,
}

fn bit(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => 1,
        StorageTier::Host => 2,
        StorageTier::Disk => 4,
    }
}

impl Model {
    fn holds(&self, rank: WorkerWithDpRank, seq: u64, tiers: u8) -> bool {
        self.held
            .get(&rank)
            .and_then(|h| h.get(&seq))
            .is_some_and(|&t| t & tiers != 0)
    }

    /// Whether the rank holds a device child of `seq`.
    fn has_device_child(&self, rank: WorkerWithDpRank, seq: u64) -> bool {
        self.held.get(&rank).is_some_and(|h| {
            h.iter()
                .any(|(s, &t)| t & 1 != 0 && self.parent.get(s) == Some(&Some(seq)))
        })
    }

    fn overlap(&self, rank: WorkerWithDpRank, seqs: &[u64]) -> (u32, u32, u32) {
        let mut i = 0;
        let mut run = |tier: u8| {
            let start = i;
            while i < seqs.len() && self.holds(rank, seqs[i], tier) {
                i += 1;
            }
            (i - start) as u32
        };
        (run(1), run(2), run(4))
    }
}

struct Stream {
    workers: u64,
    dp: u32,
    /// Middle removals, and device stores chained under lower-tier
    /// parents on purpose.
    middle_removals: bool,
    events: usize,
    queries: usize,
}

#[derive(Default, Debug)]
struct Tally {
    events: usize,
    refused: usize,
    queries: usize,
    rank_answers: usize,
    nonzero: usize,
    above_radix_tree: usize,
    host_or_disk: usize,
    /// Device stores under a parent held in a lower tier only.
    lower_tier_parents: usize,
}

fn run(stream: &Stream, seed: u64, off_by_one: bool) -> Result<Tally, String> {
    let mut rng = Rng::new(seed);
    let service = WorkerSelectionService::new(
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        ServiceConfig::default(),
    );
    let mut ranks = Vec::new();
    for w in 0..stream.workers {
        service
            .add_worker(WorkerRecord::new(w).with_dp(0, stream.dp))
            .map_err(|e| e.to_string())?;
        ranks.extend((0..stream.dp).map(|r| WorkerWithDpRank::new(w, r)));
    }
    let layout = service.row_layout();
    let rows: Vec<usize> = ranks
        .iter()
        .map(|&r| service.row_of(r).expect("a row per rank"))
        .collect();
    let prompts = Prompts::new(&mut rng, 64, 48);
    let mut model = Model::default();
    for seqs in &prompts.seq {
        for (i, &s) in seqs.iter().enumerate() {
            model.parent.insert(s, (i > 0).then(|| seqs[i - 1]));
        }
    }
    let mut tree = RadixTree::new();
    let mut index = KvIndex::new(16);
    let mut out = KvOverlaps::new();
    let mut next_id: HashMap<WorkerWithDpRank, u64> = HashMap::new();
    let mut tally = Tally::default();
    // Ranks whose device blocks the RadixTree refused (stores under a
    // lower-tier parent): their overlap may exceed the RadixTree's.
    let mut diverged: HashSet<WorkerWithDpRank> = HashSet::new();
    let hot = ranks.len().min(32);
    let query_every = stream.events / stream.queries;
    for step in 0..stream.events {
        let k = if rng.below(2) == 0 {
            rng.below(hot as u64)
        } else {
            rng.below(ranks.len() as u64)
        } as usize;
        let rank = ranks[k];
        let id = {
            let id = next_id.entry(rank).or_insert(0);
            *id += 1;
            *id
        };
        let tier = match rng.below(10) {
            0 => StorageTier::Host,
            1 => StorageTier::Disk,
            _ => StorageTier::Device,
        };
        let p = rng.below(prompts.seq.len() as u64) as usize;
        let (seqs, locals) = (&prompts.seq[p], &prompts.local[p]);
        let roll = rng.below(100);
        // The event, as (selkie data, dynamo data, the model's expected outcome).
        let stored_blocks: Vec<StoredBlock>;
        let removed: Vec<u64>;
        let mut lower_parent = false;
        let (data, expected): (KvEventData<'_>, bool);
        let dynamo_data;
        if roll < 60 {
            // Store a run: usually under a parent the rank holds (in any
            // tier), sometimes under one it does not; never a block the
            // rank holds in the tier already.
            let fresh = |i: usize| !model.holds(rank, seqs[i], bit(tier));
            let parent_tiers = if tier == StorageTier::Device && !stream.middle_removals {
                1
            } else {
                7
            };
            let held_starts: Vec<usize> = (0..seqs.len())
                .filter(|&i| fresh(i) && (i == 0 || model.holds(rank, seqs[i - 1], parent_tiers)))
                .collect();
            let start = if roll < 55 && !held_starts.is_empty() {
                held_starts[rng.below(held_starts.len() as u64) as usize]
            } else {
                rng.below(seqs.len() as u64) as usize
            };
            let end = (start + 1 + rng.below(8) as usize).min(seqs.len());
            let end = (start..end).find(|&i| !fresh(i)).unwrap_or(end);
            let parent = (start > 0).then(|| engine_hash(seqs[start - 1]));
            let mut blocks: Vec<StoredBlock> = (start..end)
                .map(|i| StoredBlock {
                    block_hash: engine_hash(seqs[i]),
                    tokens_hash: locals[i],
                })
                .collect();
            if roll == 54 {
                if let Some(parent) = parent {
                    blocks.push(StoredBlock {
                        block_hash: parent,
                        tokens_hash: 7,
                    });
                }
            }
            let self_parent = parent.is_some_and(|p| blocks.iter().any(|b| b.block_hash == p));
            expected = !self_parent && (start == 0 || model.holds(rank, seqs[start - 1], 7));
            if expected && tier == StorageTier::Device && start > 0 && !model.holds(rank, seqs[start - 1], 1) {
                // The RadixTree (device events only) refuses it.
                lower_parent = true;
            }
            if expected {
                for &seq in &seqs[start..end] {
                    *model.held.entry(rank).or_default().entry(seq).or_insert(0) |= bit(tier);
                }
            }
            dynamo_data = dynamo_stored(parent, blocks.iter().copied());
            stored_blocks = blocks;
            data = KvEventData::Stored {
                parent,
                blocks: &stored_blocks,
            };
        } else if roll < 97 {
            // Remove blocks the rank holds in the tier (on device, without
            // middle removals, only blocks without a held child), sometimes
            // with unknown ones.
            let mut candidates: Vec<u64> = model
                .held
                .get(&rank)
                .map(|h| h.iter().filter(|(_, &t)| t & bit(tier) != 0).map(|(&s, _)| s).collect())
                .unwrap_or_default();
            candidates.sort_unstable();
            let mut hashes = Vec::new();
            let mut chosen = HashSet::new();
            for _ in 0..1 + rng.below(3) {
                if candidates.is_empty() {
                    break;
                }
                let s = candidates[rng.below(candidates.len() as u64) as usize];
                let leaf = !model.has_device_child(rank, s) || tier != StorageTier::Device;
                if (stream.middle_removals || leaf) && chosen.insert(s) {
                    hashes.push(s);
                    let held = model.held.get_mut(&rank).expect("held");
                    let t = held.get_mut(&s).expect("held");
                    *t &= !bit(tier);
                    if *t == 0 {
                        held.remove(&s);
                    }
                }
            }
            let unknown = roll >= 93;
            if unknown {
                hashes.push(rng.next_u64());
            }
            expected = !unknown;
            removed = hashes
                .iter()
                .map(|&s| {
                    if unknown && s == *hashes.last().unwrap() {
                        s
                    } else {
                        engine_hash(s)
                    }
                })
                .collect();
            dynamo_data = KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: removed.iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
            });
            data = KvEventData::Removed { blocks: &removed };
        } else {
            if let Some(held) = model.held.get_mut(&rank) {
                held.retain(|_, t| {
                    *t &= !bit(tier);
                    *t != 0
                });
            }
            expected = true;
            dynamo_data = KvCacheEventData::Cleared;
            data = KvEventData::Cleared;
        }
        let got = index.apply(&KvEvent::new(rank, id, data).in_tier(tier));
        tally.events += 1;
        tally.refused += usize::from(got.is_err());
        if got.is_ok() != expected {
            return Err(format!(
                "step {step}: rank {rank} {tier} event: selkie {got:?}, the model expects ok = {expected}"
            ));
        }
        if tier == StorageTier::Device {
            let dynamo = tree.apply_event(RouterEvent::new(
                rank.worker_id,
                KvCacheEvent {
                    event_id: id,
                    data: dynamo_data,
                    dp_rank: rank.dp_rank,
                },
            ));
            if lower_parent {
                tally.lower_tier_parents += 1;
                if dynamo.is_ok() {
                    return Err(format!(
                        "step {step}: rank {rank} event {id}: the RadixTree took a store under a host parent"
                    ));
                }
                diverged.insert(rank);
            } else if !stream.middle_removals && !diverged.contains(&rank) && dynamo.is_ok() != got.is_ok() {
                return Err(format!(
                    "step {step}: rank {rank} event {id}: selkie {got:?}, Dynamo {dynamo:?}"
                ));
            }
        }
        if step % query_every == 0 {
            index
                .sync_rows(layout, |r| service.row_of(r))
                .expect("the index has the service's block size");
            let mut local = prompts.local[rng.below(prompts.local.len() as u64) as usize].clone();
            local.truncate(rng.below(local.len() as u64 + 1) as usize);
            if !local.is_empty() && rng.below(4) == 0 {
                let at = rng.below(local.len() as u64) as usize;
                local[at] = rng.next_u64();
            }
            let mut seqs = Vec::new();
            sequence_hashes_of(&local, &mut seqs);
            index
                .overlaps_for_local_hashes(&local, &mut out)
                .map_err(|e| e.to_string())?;
            let dynamo = tree.find_matches(local.iter().map(|&h| LocalBlockHash(h)).collect(), false);
            tally.queries += 1;
            for (k, &rank) in ranks.iter().enumerate() {
                let (mut device, host, disk) = out.tiers(rows[k]);
                if off_by_one && device > 0 {
                    device -= 1;
                }
                let radix = dynamo
                    .scores
                    .get(&DynamoRank::new(rank.worker_id, rank.dp_rank))
                    .copied()
                    .unwrap_or(0);
                let exact = model.overlap(rank, &seqs);
                tally.rank_answers += 1;
                tally.nonzero += usize::from(device > 0);
                tally.host_or_disk += usize::from(host + disk > 0);
                if (device, host, disk) != exact {
                    return Err(format!(
                        "step {step}: rank {rank}: selkie {:?}, exact {exact:?}",
                        (device, host, disk)
                    ));
                }
                if stream.middle_removals || diverged.contains(&rank) {
                    if device < radix {
                        return Err(format!(
                            "step {step}: rank {rank}: selkie {device} below the RadixTree's {radix}"
                        ));
                    }
                    tally.above_radix_tree += usize::from(device > radix);
                } else if device != radix {
                    return Err(format!("step {step}: rank {rank}: selkie {device}, RadixTree {radix}"));
                }
            }
        }
    }
    Ok(tally)
}

fn streams(middle_removals: bool) -> Vec<Stream> {
    [(1, 1), (8, 2), (100, 1), (250, 4), (1_000, 1), (1_000, 2)]
        .into_iter()
        .map(|(workers, dp)| Stream {
            workers,
            dp,
            middle_removals,
            events: 20_000,
            queries: 5_000,
        })
        .collect()
}

#[test]
fn without_middle_removals_every_outcome_and_overlap_equals_the_radix_tree() {
    for (i, stream) in streams(false).iter().enumerate() {
        let tally = run(stream, 0x1d_0000 + i as u64, false)
            .unwrap_or_else(|e| panic!("{} workers x {} ranks: {e}", stream.workers, stream.dp));
        println!(
            "{} workers x {} ranks, no middle removals: {tally:?}",
            stream.workers, stream.dp
        );
        assert!(
            tally.nonzero > 0 && tally.refused > 0 && tally.host_or_disk > 0,
            "a vacuous stream: {tally:?}"
        );
    }
}

#[test]
fn with_middle_removals_every_overlap_is_exact_and_never_below_the_radix_tree() {
    let (mut above, mut lower_tier_parents) = (0, 0);
    for (i, stream) in streams(true).iter().enumerate() {
        let tally = run(stream, 0x2d_0000 + i as u64, false)
            .unwrap_or_else(|e| panic!("{} workers x {} ranks: {e}", stream.workers, stream.dp));
        println!(
            "{} workers x {} ranks, middle removals: {tally:?}",
            stream.workers, stream.dp
        );
        above += tally.above_radix_tree;
        lower_tier_parents += tally.lower_tier_parents;
    }
    assert!(above > 0, "no stream showed the RadixTree forgetting blocks");
    assert!(lower_tier_parents > 0, "no device store under a lower-tier parent");
}

/// The check is not vacuous: an overlap one block short fails it.
#[test]
fn an_off_by_one_overlap_fails() {
    let stream = Stream {
        workers: 8,
        dp: 2,
        middle_removals: false,
        events: 2_000,
        queries: 500,
    };
    assert!(run(&stream, 0x3d, true).is_err());
}
