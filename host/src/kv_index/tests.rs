//! The index's semantics, one test each, and a randomized comparison with
//! a plain per-rank model.

use std::collections::HashMap;

use selkie_kernel::Rng;

use super::*;

const W1: WorkerWithDpRank = WorkerWithDpRank::new(1, 0);
const W2: WorkerWithDpRank = WorkerWithDpRank::new(2, 0);
const W1R1: WorkerWithDpRank = WorkerWithDpRank::new(1, 1);

fn layout(epoch: u64, rows: usize) -> RowLayout {
    RowLayout::new(epoch, rows, 16)
}

/// An index and the fleet it is synced to (rank `i` on row `i`).
struct Fx {
    index: KvIndex,
    ranks: Vec<WorkerWithDpRank>,
    epoch: u64,
    /// Reused by every query, as a router's thread reuses its columns.
    out: KvOverlaps,
}

impl std::ops::Deref for Fx {
    type Target = KvIndex;
    fn deref(&self) -> &KvIndex {
        &self.index
    }
}

impl std::ops::DerefMut for Fx {
    fn deref_mut(&mut self) -> &mut KvIndex {
        &mut self.index
    }
}

fn index_on(ranks: &[WorkerWithDpRank]) -> Fx {
    index_of(16, ranks)
}

/// [`index_on`] for blocks of `block_size` tokens (the layout's too).
fn index_of(block_size: u32, ranks: &[WorkerWithDpRank]) -> Fx {
    let mut fx = Fx {
        index: KvIndex::new(block_size),
        ranks: Vec::new(),
        epoch: 0,
        out: KvOverlaps::new(),
    };
    sync(&mut fx, 1, ranks);
    fx
}

/// Syncs to a layout of `ranks` under `epoch`, as a router does before
/// each query.
fn sync(fx: &mut Fx, epoch: u64, ranks: &[WorkerWithDpRank]) {
    fx.ranks = ranks.to_vec();
    fx.epoch = epoch;
    let rows: HashMap<WorkerWithDpRank, usize> = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    fx.index
        .sync_rows(RowLayout::new(epoch, ranks.len(), fx.index.block_size()), |r| {
            rows.get(&r).copied()
        })
        .unwrap();
}

/// One request's chain: its local hashes and their sequence hashes.
struct Chain {
    local: Vec<u64>,
    seq: Vec<u64>,
}

impl Chain {
    /// Blocks `range` of the chain as `(engine hash, local hash)` pairs,
    /// the engine hash being the sequence hash.
    fn blocks(&self, range: std::ops::Range<usize>) -> Vec<(u64, u64)> {
        range.map(|i| (self.seq[i], self.local[i])).collect()
    }
}

/// The chain of local hashes `locals`.
fn chain_of(locals: impl IntoIterator<Item = u64>) -> Chain {
    let local: Vec<u64> = locals.into_iter().collect();
    let mut seq = Vec::new();
    sequence_hashes_of(&local, &mut seq);
    Chain { local, seq }
}

/// Blocks `(engine hash, local hash)`.
fn blocks(pairs: &[(u64, u64)]) -> Vec<StoredBlock> {
    pairs
        .iter()
        .map(|&(block_hash, tokens_hash)| StoredBlock {
            block_hash,
            tokens_hash,
        })
        .collect()
}

fn store(
    index: &mut KvIndex,
    rank: WorkerWithDpRank,
    id: u64,
    tier: StorageTier,
    parent: Option<u64>,
    pairs: &[(u64, u64)],
) -> Result<(), KvEventError> {
    let blocks = blocks(pairs);
    index.apply(
        &KvEvent::new(
            rank,
            id,
            KvEventData::Stored {
                parent,
                blocks: &blocks,
            },
        )
        .in_tier(tier),
    )
}

fn remove(
    index: &mut KvIndex,
    rank: WorkerWithDpRank,
    id: u64,
    tier: StorageTier,
    hashes: &[u64],
) -> Result<(), KvEventError> {
    index.apply(&KvEvent::new(rank, id, KvEventData::Removed { blocks: hashes }).in_tier(tier))
}

/// `(device, host, disk)` of every row for a query by local hashes.
fn query(fx: &mut Fx, local: &[u64]) -> Vec<(u32, u32, u32)> {
    let (epoch, ranks) = (fx.epoch, fx.ranks.clone());
    sync(fx, epoch, &ranks);
    let block_size = fx.index.block_size() as f32;
    let columns = fx.index.overlaps_for_local_hashes(local, &mut fx.out).expect("synced");
    let (device, cached) = (columns.device_blocks, columns.cached_tokens.expect("written"));
    // Every row's cached-token estimate is its device blocks' tokens,
    // including the rows the last query gave a value and this one not.
    for (row, (&d, &c)) in device.iter().zip(cached).enumerate() {
        assert_eq!(c, d * block_size, "row {row}: cached tokens against {d} device blocks");
    }
    let rows = device.len();
    (0..rows).map(|r| fx.out.tiers(r)).collect()
}

use StorageTier::{Device, Disk, Host};

/// Vectors computed by dynamo-kv-router 1.6.1 (`compute_block_hash_for_seq`,
/// `compute_seq_hash_for_block`) for tokens 1..=40; the benches' Dynamo
/// parity test prints them and compares thousands more.
#[test]
fn hashes_equal_dynamo_vectors() {
    #[allow(clippy::type_complexity)]
    let vectors: [(u32, Option<&str>, Option<&str>, &[u64], &[u64]); 5] = [
        (
            4,
            None,
            None,
            &[
                14643705804678351452,
                16777012769546811212,
                483935686894639516,
                135165725823939817,
                1363306219480167028,
                2084387875073858317,
                6327381604936300363,
                7888692299608420700,
                13620872079913919147,
                11334768502514057929,
            ],
            &[
                14643705804678351452,
                4945711292740353085,
                12583592247330656132,
                1921452330601040443,
                16910271745392797383,
                1149017327988146166,
                4629705925025678689,
                14345716039754635305,
                8259790107429908153,
                7516174034486130740,
            ],
        ),
        (
            16,
            None,
            None,
            &[16863443419780771464, 2287610619914608821],
            &[16863443419780771464, 12466389667045779788],
        ),
        (
            16,
            Some("sql-lora"),
            None,
            &[11378806664395144175, 17474401326123925451],
            &[11378806664395144175, 5949679742622244304],
        ),
        (
            16,
            None,
            Some("tenant-a"),
            &[8175209796170318505, 13248293275458056256],
            &[8175209796170318505, 1199464708288223189],
        ),
        (
            16,
            Some("sql-lora"),
            Some("tenant-a"),
            &[14528514527592222645, 5458717965931986288],
            &[14528514527592222645, 6830170385776889933],
        ),
    ];
    let tokens: Vec<u32> = (1..=40).collect();
    for (block_size, lora, namespace, local, seq) in vectors {
        let mut hasher = KvBlockHasher::new(block_size);
        if let Some(lora) = lora {
            hasher = hasher.with_lora(lora);
        }
        if let Some(namespace) = namespace {
            hasher = hasher.with_cache_namespace(namespace);
        }
        let (mut l, mut s) = (Vec::new(), Vec::new());
        hasher.local_hashes(&tokens, &mut l);
        hasher.sequence_hashes(&tokens, &mut s);
        assert_eq!(
            l, local,
            "local hashes, block size {block_size}, {lora:?}, {namespace:?}"
        );
        assert_eq!(
            s, seq,
            "sequence hashes, block size {block_size}, {lora:?}, {namespace:?}"
        );
    }
    // An empty name is no name; block size 0 has no blocks.
    assert_eq!(KvBlockHasher::new(16).with_lora("").seed(), KV_HASH_SEED);
    assert_eq!(KvBlockHasher::new(0).block_count(100), 0);
    assert_eq!(KvBlockHasher::new(16).with_eagle(true).block_count(33), 2);
    assert_eq!(KvBlockHasher::new(16).with_eagle(true).block_count(32), 1);
}

#[test]
fn overlap_is_the_leading_run_of_held_blocks() {
    let mut index = index_on(&[W1, W2]);
    store(&mut index, W1, 0, Device, None, &[(101, 1), (102, 2), (103, 3)]).unwrap();
    store(&mut index, W2, 0, Device, None, &[(201, 1), (202, 2)]).unwrap();
    assert_eq!(query(&mut index, &[1, 2, 3, 4]), [(3, 0, 0), (2, 0, 0)]);
    assert_eq!(query(&mut index, &[1, 2]), [(2, 0, 0), (2, 0, 0)]);
    assert_eq!(query(&mut index, &[1, 9, 3]), [(1, 0, 0), (1, 0, 0)]);
    // The same local hashes under another first block are other blocks.
    assert_eq!(query(&mut index, &[2, 3]), [(0, 0, 0), (0, 0, 0)]);
    let (epoch, ranks) = (index.epoch, index.ranks.clone());
    sync(&mut index, epoch, &ranks);
    let mut out = KvOverlaps::new();
    let columns = index.overlaps_for_local_hashes(&[1, 2, 3], &mut out).unwrap();
    assert_eq!(
        columns.cached_tokens.unwrap(),
        [48.0, 32.0],
        "device blocks times the block size"
    );
}

/// The walk asks for no hash past the first block no row holds (a
/// prompt's tail nobody holds is never chained), and runs to the end of a
/// prompt held whole.
#[test]
fn the_walk_hashes_nothing_past_the_first_block_no_row_holds() {
    let mut index = index_on(&[W1, W2]);
    let pairs: Vec<(u64, u64)> = (1..=5).map(|i| (100 + i, i)).collect();
    store(&mut index, W1, 0, Device, None, &pairs).unwrap();
    let held: Vec<(u64, u64)> = (1..=40).map(|i| (200 + i, i)).collect();
    store(&mut index, W2, 0, Device, None, &held).unwrap();
    let (epoch, ranks) = (index.epoch, index.ranks.clone());
    sync(&mut index, epoch, &ranks);
    let mut sequences = Vec::new();
    sequence_hashes_of(
        &(1..=40).chain([99]).chain(41..=60).collect::<Vec<u64>>(),
        &mut sequences,
    );
    let mut out = KvOverlaps::new();
    // Blocks 0..40 are held (W2), block 40 by no row: 41 asked of 61.
    assert_eq!(index.hashes_walked(&sequences, &mut out), 41);
    assert_eq!(index.hashes_walked(&sequences[..40], &mut out), 40);
    // Five blocks both hold, then one neither holds (77 where W2 holds
    // 6): the walk stops there, at the sixth.
    let mut other = Vec::new();
    sequence_hashes_of(&[1, 2, 3, 4, 5, 77, 7, 8, 9, 10], &mut other);
    assert_eq!(index.hashes_walked(&other, &mut out), 6);
}

/// A block whose rows turned dense while the fleet had two words of rows
/// is read after the fleet grew to four: a new rank holding the block
/// before it, in the words past the set's bitsets, leaves the device stage
/// there (those words hold nothing of the block).
#[test]
fn rows_added_after_a_set_turned_dense_leave_at_it() {
    let first: Vec<WorkerWithDpRank> = (0..100).map(|w| WorkerWithDpRank::new(w, 0)).collect();
    let mut fx = index_on(&first);
    let chain = chain_of(500..503);
    for &rank in &first {
        store(&mut fx, rank, 0, Device, None, &chain.blocks(0..3)).unwrap();
    }
    // The ranks take their rows (two words' worth) before the fleet grows.
    sync(&mut fx, 1, &first);
    let grown: Vec<WorkerWithDpRank> = (0..250).map(|w| WorkerWithDpRank::new(w, 0)).collect();
    sync(&mut fx, 2, &grown);
    store(&mut fx, grown[200], 0, Device, None, &chain.blocks(0..1)).unwrap();
    assert!(
        fx.blocks.get(&chain.seq[1]).unwrap().is_dense(),
        "block 1's rows are dense"
    );
    let got = query(&mut fx, &chain.local);
    for (w, &g) in got.iter().enumerate() {
        let want = match w {
            0..100 => (3, 0, 0),
            200 => (1, 0, 0),
            _ => (0, 0, 0),
        };
        assert_eq!(g, want, "rank {w}");
    }
}

/// A fleet wider than a mask word, where whole words leave the device
/// stage at once while some of their rows go on: 200 ranks hold blocks
/// 0..10, ranks 0..70 blocks 10..20 (ranks 0..3 of those in host memory
/// after), ranks 0..5 blocks 20..30; the query has 30 blocks. Asked twice,
/// so the second answer also shows the columns were cleared.
#[test]
fn whole_words_leave_the_device_stage_together() {
    let ranks: Vec<WorkerWithDpRank> = (0..200).map(|w| WorkerWithDpRank::new(w, 0)).collect();
    let mut fx = index_on(&ranks);
    let chain = chain_of(1000..1030);
    for (w, &rank) in ranks.iter().enumerate() {
        let mut id = 0;
        let mut put = |fx: &mut Fx, tier, parent: Option<u64>, r: std::ops::Range<usize>| {
            store(fx, rank, id, tier, parent, &chain.blocks(r)).unwrap();
            id += 1;
        };
        put(&mut fx, Device, None, 0..10);
        if w < 70 {
            put(&mut fx, Device, Some(chain.seq[9]), 10..20);
        }
        if w < 3 {
            put(&mut fx, Host, Some(chain.seq[19]), 20..24);
        }
        if (3..5).contains(&w) {
            put(&mut fx, Device, Some(chain.seq[19]), 20..30);
        }
    }
    let expected = |w: usize| match w {
        0..3 => (20, 4, 0),
        3..5 => (30, 0, 0),
        5..70 => (20, 0, 0),
        _ => (10, 0, 0),
    };
    for _ in 0..2 {
        let got = query(&mut fx, &chain.local);
        for (w, &g) in got.iter().enumerate() {
            assert_eq!(g, expected(w), "rank {w}");
        }
        let cached = fx.out.row_overlaps().unwrap().cached_tokens.unwrap();
        for (w, &c) in cached.iter().enumerate() {
            assert_eq!(c, expected(w).0 as f32 * 16.0, "rank {w}: cached tokens");
        }
    }
    // A query scoring only the first rows leaves nothing of the last.
    let got = query(&mut fx, &chain.local[..1]);
    assert!(got.iter().all(|&g| g == (1, 0, 0)));
}

#[test]
fn a_first_block_miss_or_an_empty_query_scores_nothing() {
    let mut index = index_on(&[W1]);
    store(&mut index, W1, 0, Device, None, &[(101, 1), (102, 2)]).unwrap();
    assert_eq!(query(&mut index, &[7, 1, 2]), [(0, 0, 0)]);
    assert_eq!(query(&mut index, &[]), [(0, 0, 0)]);
}

#[test]
fn queries_by_tokens_local_and_sequence_hashes_agree() {
    let hashers = [
        KvBlockHasher::new(4),
        KvBlockHasher::new(4).with_lora("adapter"),
        KvBlockHasher::new(4).with_cache_namespace("tenant"),
        KvBlockHasher::new(4).with_eagle(true),
    ];
    for (h, hasher) in hashers.iter().enumerate() {
        let tokens: Vec<u32> = (0..21).collect();
        let (mut local, mut seq) = (Vec::new(), Vec::new());
        hasher.local_hashes(&tokens, &mut local);
        hasher.sequence_hashes(&tokens, &mut seq);
        assert_eq!(local.len(), 5, "hasher {h}");
        // W1 holds the first 3 blocks, W2 all 5 (the walk reaches the end).
        let mut index = index_of(hasher.block_size(), &[W1, W2]);
        for (rank, held) in [(W1, 3), (W2, 5)] {
            let pairs: Vec<(u64, u64)> = local
                .iter()
                .take(held)
                .enumerate()
                .map(|(i, &l)| (500 + i as u64, l))
                .collect();
            store(&mut index, rank, 0, Device, None, &pairs).unwrap();
        }
        sync(&mut index, 1, &[W1, W2]);
        let mut out = KvOverlaps::new();
        let by_tokens = index.overlaps_for_tokens(hasher, &tokens, &mut out).unwrap();
        assert_eq!(by_tokens.device_blocks, [3.0, 5.0], "hasher {h}");
        let by_local = index.overlaps_for_local_hashes(&local, &mut out).unwrap();
        assert_eq!(by_local.device_blocks, [3.0, 5.0], "hasher {h}");
        assert_eq!(
            index.overlaps(&seq, &mut out).unwrap().device_blocks,
            [3.0, 5.0],
            "hasher {h}"
        );
        // A shorter prompt stops at its own end.
        let short = index.overlaps_for_tokens(hasher, &tokens[..13], &mut out).unwrap();
        assert_eq!(short.device_blocks, [3.0, hasher.block_count(13) as f32], "hasher {h}");
    }
}

#[test]
fn a_store_under_an_unknown_parent_is_refused_whole() {
    let mut index = index_on(&[W1, W2]);
    store(&mut index, W2, 0, Device, None, &[(101, 1)]).unwrap();
    // Never seen by W1 (only W2 holds 101).
    let e = store(&mut index, W1, 0, Device, Some(101), &[(102, 2)]).unwrap_err();
    assert!(matches!(
        e,
        KvEventError::UnknownParent {
            worker_id: 1,
            dp_rank: 0,
            event_id: 0,
            parent: 101,
            blocks: 1
        }
    ));
    assert_eq!(index.rank_blocks(W1, Device), 0);
    // Removed parent.
    store(&mut index, W1, 1, Device, None, &[(101, 1)]).unwrap();
    remove(&mut index, W1, 2, Device, &[101]).unwrap();
    assert!(store(&mut index, W1, 3, Device, Some(101), &[(102, 2), (103, 3)]).is_err());
    assert_eq!(index.rank_blocks(W1, Device), 0);
    assert_eq!(index.stats().unknown_parent, 2);
    // A parent held in any tier will do: here in host memory only.
    store(&mut index, W1, 4, Host, None, &[(101, 1)]).unwrap();
    store(&mut index, W1, 5, Disk, Some(101), &[(102, 2)]).unwrap();
    assert_eq!(query(&mut index, &[1, 2]), [(0, 1, 1), (1, 0, 0)]);
    store(&mut index, W1, 6, Device, Some(101), &[(102, 2)]).unwrap();
    // On disk too: the device copy after a host block does not count,
    // the disk one does.
    assert_eq!(query(&mut index, &[1, 2]), [(0, 1, 1), (1, 0, 0)]);
    remove(&mut index, W1, 7, Disk, &[102]).unwrap();
    assert_eq!(query(&mut index, &[1, 2]), [(0, 1, 0), (1, 0, 0)]);
}

#[test]
fn a_store_naming_its_parent_as_a_block_is_refused() {
    let mut index = index_on(&[W1]);
    store(&mut index, W1, 0, Device, None, &[(101, 1)]).unwrap();
    let e = store(&mut index, W1, 1, Device, Some(101), &[(102, 2), (101, 3)]).unwrap_err();
    assert!(matches!(e, KvEventError::SelfParent { parent: 101, .. }));
    assert_eq!(index.rank_blocks(W1, Device), 1);
}

#[test]
fn storing_held_blocks_again_changes_nothing() {
    let mut index = index_on(&[W1]);
    store(&mut index, W1, 0, Device, None, &[(101, 1), (102, 2)]).unwrap();
    let before = (
        query(&mut index, &[1, 2, 3]),
        index.block_count(),
        index.rank_blocks(W1, Device),
    );
    store(&mut index, W1, 1, Device, None, &[(101, 1), (102, 2)]).unwrap();
    store(&mut index, W1, 2, Device, Some(101), &[(102, 2)]).unwrap();
    assert_eq!(
        (
            query(&mut index, &[1, 2, 3]),
            index.block_count(),
            index.rank_blocks(W1, Device)
        ),
        before
    );
}

#[test]
fn a_removal_with_unknown_blocks_removes_the_others() {
    let mut index = index_on(&[W1]);
    store(&mut index, W1, 0, Device, None, &[(101, 1), (102, 2), (103, 3)]).unwrap();
    let e = remove(&mut index, W1, 1, Device, &[103, 999, 102, 998]).unwrap_err();
    assert!(
        matches!(
            e,
            KvEventError::UnknownBlocks {
                unknown: 2,
                first: 999,
                tier: Device,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(index.rank_blocks(W1, Device), 1);
    assert_eq!(query(&mut index, &[1, 2, 3]), [(1, 0, 0)]);
    // A block held only in another tier is unknown to a device removal.
    store(&mut index, W1, 2, Host, Some(101), &[(102, 2)]).unwrap();
    assert!(remove(&mut index, W1, 3, Device, &[102]).is_err());
    assert_eq!(query(&mut index, &[1, 2]), [(1, 1, 0)]);
}

#[test]
fn cleared_clears_only_its_rank_and_tier() {
    let mut index = index_on(&[W1, W1R1, W2]);
    for (rank, base) in [(W1, 100), (W1R1, 200), (W2, 300)] {
        store(&mut index, rank, 0, Device, None, &[(base + 1, 1), (base + 2, 2)]).unwrap();
    }
    store(&mut index, W1, 1, Host, Some(102), &[(103, 3)]).unwrap();
    index.apply(&KvEvent::new(W1, 2, KvEventData::Cleared)).unwrap();
    assert_eq!(query(&mut index, &[1, 2, 3]), [(0, 0, 0), (2, 0, 0), (2, 0, 0)]);
    assert_eq!(index.rank_blocks(W1, Host), 1, "the host tier is kept");
    index
        .apply(&KvEvent::new(W1, 3, KvEventData::Cleared).in_tier(Host))
        .unwrap();
    assert_eq!(index.rank_blocks(W1, Host), 0);
}

#[test]
fn ranks_of_one_worker_are_independent() {
    let mut index = index_on(&[W1, W1R1]);
    store(&mut index, W1, 0, Device, None, &[(101, 1), (102, 2)]).unwrap();
    // Rank 1 does not hold rank 0's blocks, even under the same engine hash.
    assert!(store(&mut index, W1R1, 0, Device, Some(101), &[(102, 2)]).is_err());
    store(&mut index, W1R1, 1, Device, None, &[(101, 1)]).unwrap();
    assert_eq!(query(&mut index, &[1, 2]), [(2, 0, 0), (1, 0, 0)]);
    remove(&mut index, W1R1, 2, Device, &[101]).unwrap();
    assert_eq!(query(&mut index, &[1, 2]), [(2, 0, 0), (0, 0, 0)]);
}

/// Removing a block in the middle of a run: the later blocks stop counting
/// while it is missing and count again once it is stored again (exact per
/// block; Dynamo's `RadixTree` forgets them).
#[test]
fn a_middle_removal_is_exact_per_block() {
    let mut index = index_on(&[W1]);
    store(
        &mut index,
        W1,
        0,
        Device,
        None,
        &[(101, 1), (102, 2), (103, 3), (104, 4)],
    )
    .unwrap();
    remove(&mut index, W1, 1, Device, &[102]).unwrap();
    assert_eq!(query(&mut index, &[1, 2, 3, 4]), [(1, 0, 0)]);
    assert_eq!(index.rank_blocks(W1, Device), 3);
    store(&mut index, W1, 2, Device, Some(101), &[(102, 2)]).unwrap();
    assert_eq!(query(&mut index, &[1, 2, 3, 4]), [(4, 0, 0)]);
    // The later blocks are still the rank's: removing them is no error.
    remove(&mut index, W1, 3, Device, &[104, 103]).unwrap();
}

/// Device, then host after the device run, then disk after both
/// (Dynamo's lower-tier continuation).
#[test]
fn tiers_continue_one_another() {
    let (a, b, c, d) = (
        WorkerWithDpRank::new(3, 0),
        WorkerWithDpRank::new(4, 0),
        WorkerWithDpRank::new(5, 0),
        WorkerWithDpRank::new(6, 0),
    );
    let mut index = index_on(&[W1, W2, a, b, c, d]);
    let run = [(11, 1), (12, 2), (13, 3), (14, 4), (15, 5), (16, 6)];
    // W1: device 0..2, host 2..4, disk 4..6.
    store(&mut index, W1, 0, Device, None, &run[..2]).unwrap();
    store(&mut index, W1, 1, Host, Some(12), &run[2..4]).unwrap();
    store(&mut index, W1, 2, Disk, Some(14), &run[4..]).unwrap();
    // W2: host from the first block, then device blocks do not count again.
    store(&mut index, W2, 0, Host, None, &run[..3]).unwrap();
    store(&mut index, W2, 1, Device, None, &run[..1]).unwrap();
    store(&mut index, W2, 2, Device, Some(11), &run[1..2]).unwrap();
    // a: device 0..1, disk 1..3 (no host).
    store(&mut index, a, 0, Device, None, &run[..1]).unwrap();
    store(&mut index, a, 1, Disk, Some(11), &run[1..3]).unwrap();
    // b: disk only, whole run; also device block 0.
    store(&mut index, b, 0, Disk, None, &run).unwrap();
    store(&mut index, b, 1, Device, None, &run[..1]).unwrap();
    // c: every tier for every block: device wins.
    for (id, tier) in [Device, Host, Disk].into_iter().enumerate() {
        store(&mut index, c, id as u64, tier, None, &run).unwrap();
    }
    // d: device 0..3, host 0..1 only: the host run is inside the device run.
    store(&mut index, d, 0, Device, None, &run[..3]).unwrap();
    store(&mut index, d, 1, Host, None, &run[..1]).unwrap();
    assert_eq!(
        query(&mut index, &[1, 2, 3, 4, 5, 6]),
        [(2, 2, 2), (2, 1, 0), (1, 0, 2), (1, 0, 5), (6, 0, 0), (3, 0, 0)]
    );
    // A host continuation stops at the first block missing from the host.
    remove(&mut index, W1, 3, Host, &[14]).unwrap();
    assert_eq!(query(&mut index, &[1, 2, 3, 4, 5, 6])[0], (2, 1, 0));
}

#[test]
fn a_gap_drops_the_rank_and_a_stale_event_is_ignored() {
    let mut index = index_on(&[W1, W2]);
    store(&mut index, W1, 10, Device, None, &[(101, 1), (102, 2)]).unwrap();
    store(&mut index, W2, 0, Device, None, &[(201, 1)]).unwrap();
    let e = store(&mut index, W1, 13, Device, None, &[(301, 3)]).unwrap_err();
    assert_eq!(
        e,
        KvEventError::EventGap {
            worker_id: 1,
            dp_rank: 0,
            event_id: 13,
            last: 10,
            missing: 2
        }
    );
    assert_eq!(
        query(&mut index, &[1, 2]),
        [(0, 0, 0), (1, 0, 0)],
        "W1 dropped, W2 kept"
    );
    assert_eq!(
        query(&mut index, &[3]),
        [(1, 0, 0), (0, 0, 0)],
        "the event after the gap is applied"
    );
    // The late events 11 and 12, and a duplicate 13, are ignored.
    for id in [11, 12, 13] {
        let e = store(&mut index, W1, id, Device, None, &[(101, 1)]).unwrap_err();
        assert!(matches!(e, KvEventError::StaleEvent { event_id, last: 13, .. } if event_id == id));
    }
    assert_eq!(query(&mut index, &[1]), [(0, 0, 0), (1, 0, 0)]);
    let stats = index.stats();
    assert_eq!((stats.event_gaps, stats.stale_events, stats.events_applied), (1, 3, 3));
    // Ids are per rank: rank 1 of worker 1 starts its own sequence.
    store(&mut index, W1R1, 0, Device, None, &[(101, 1)]).unwrap();
}

#[test]
fn rows_follow_the_layout() {
    let mut index = index_on(&[]);
    // Events before the worker joins the fleet are kept aside.
    store(&mut index, W2, 0, Device, None, &[(201, 1)]).unwrap();
    sync(&mut index, 1, &[W1]);
    assert_eq!(query(&mut index, &[1]), [(0, 0, 0)]);
    sync(&mut index, 2, &[W1, W2]);
    assert_eq!(query(&mut index, &[1]), [(0, 0, 0), (1, 0, 0)]);
    // A rank first seen after the sync is placed by the next sync, even
    // when the layout did not change.
    store(&mut index, W1, 0, Device, None, &[(101, 1)]).unwrap();
    let mut out = KvOverlaps::new();
    assert_eq!(
        index.overlaps_for_local_hashes(&[1], &mut out).unwrap().device_blocks,
        [0.0, 1.0]
    );
    sync(&mut index, 2, &[W1, W2]);
    assert_eq!(
        index.overlaps_for_local_hashes(&[1], &mut out).unwrap().device_blocks,
        [1.0, 1.0]
    );
    // W1 leaves; W3 takes its row: it does not inherit W1's block, and
    // W1's blocks are gone.
    let w3 = WorkerWithDpRank::new(3, 0);
    sync(&mut index, 3, &[w3, W2]);
    assert_eq!(query(&mut index, &[1]), [(0, 0, 0), (1, 0, 0)]);
    assert_eq!(index.rank_blocks(W1, Device), 0);
    assert_eq!(index.stats().ranks_removed, 1);
    // Rows swap: the blocks move with their ranks.
    store(&mut index, w3, 0, Device, None, &[(301, 1), (302, 2)]).unwrap();
    sync(&mut index, 3, &[w3, W2]);
    assert_eq!(query(&mut index, &[1, 2]), [(2, 0, 0), (1, 0, 0)]);
    sync(&mut index, 4, &[W2, w3]);
    assert_eq!(query(&mut index, &[1, 2]), [(1, 0, 0), (2, 0, 0)]);
    // remove_worker drops every rank of the worker.
    assert_eq!(index.remove_worker(3), 1);
    assert_eq!(query(&mut index, &[1, 2]), [(1, 0, 0), (0, 0, 0)]);
    assert_eq!(index.block_count(), 1);
}

/// A rank that reports its first blocks after its peers makes room at once
/// for what they hold on average, and holds its blocks as any rank does.
#[test]
fn a_late_ranks_first_run_makes_room_for_what_its_peers_hold() {
    const W3: WorkerWithDpRank = WorkerWithDpRank::new(3, 0);
    let mut index = index_on(&[W1, W2, W3]);
    let room = |index: &KvIndex, rank| index.ranks[&rank].blocks.capacity();
    let chain = |base: u64, n: u64| -> Vec<(u64, u64)> { (1..=n).map(|i| (base + i, base + i)).collect() };
    let (first, second) = (chain(10_000, 600), chain(20_000, 400));
    for (rank, pairs) in [(W1, &first), (W2, &second)] {
        let mut parent = None;
        for (id, run) in pairs.chunks(32).enumerate() {
            store(&mut index, rank, id as u64, Device, parent, run).unwrap();
            parent = Some(run[run.len() - 1].0);
        }
    }
    // The peers hold 500 on average: room for 500 at once (as much as the
    // first peer grew to), where a first rank gets room for 200.
    // W3 joins as engines do, with an empty event, and gets its row.
    index.apply(&KvEvent::new(W3, 0, KvEventData::Cleared)).unwrap();
    sync(&mut index, 1, &[W1, W2, W3]);
    store(&mut index, W3, 1, Device, None, &chain(30_000, 1)).unwrap();
    assert!(room(&index, W3) >= 500, "room for {}", room(&index, W3));
    assert_eq!(room(&index, W3), room(&index, W1));
    let locals: Vec<u64> = second.iter().map(|p| p.1).collect();
    assert_eq!(query(&mut index, &locals)[1], (400, 0, 0));
    assert_eq!(query(&mut index, &[30_001])[2], (1, 0, 0));
}

/// A fleet whose ranks all report before the router's first sync (its
/// engines started first): each rank placed at that sync makes the room of
/// the other ranks' average, not of every block the fleet holds, so the
/// index takes what it takes when each rank is placed as it reports.
#[test]
fn ranks_placed_together_make_the_room_of_their_average() {
    const RANKS: u64 = 300;
    let ranks: Vec<WorkerWithDpRank> = (0..RANKS).map(|w| WorkerWithDpRank::new(w, 0)).collect();
    let build = |sync_each: bool| {
        let mut index = index_on(&[]);
        for &rank in &ranks {
            let base = 1_000_000 * (rank.worker_id + 1);
            let pairs: Vec<(u64, u64)> = (1..=100).map(|i| (base + i, base + i)).collect();
            store(&mut index, rank, 0, Device, None, &pairs).unwrap();
            if sync_each {
                sync(&mut index, 1, &ranks);
            }
        }
        sync(&mut index, 1, &ranks);
        let own: Vec<u64> = (1..=100).map(|i| 1_000_000 * RANKS + i).collect();
        assert_eq!(query(&mut index, &own)[RANKS as usize - 1], (100, 0, 0));
        let rooms: Vec<usize> = ranks.iter().map(|r| index.index.ranks[r].blocks.capacity()).collect();
        (index.heap_bytes(), rooms.into_iter().max().unwrap())
    };
    let (each, each_room) = build(true);
    let (together, together_room) = build(false);
    assert!(
        together_room <= each_room.max(2 * RANK_FIRST_ROOM),
        "a rank's room: {together_room} placed together, {each_room} one by one"
    );
    assert!(
        together * 2 <= each * 3,
        "{together} heap bytes placed together, {each} one by one"
    );
}

/// A placed rank's table takes room for `RANK_FIRST_ROOM` blocks at its
/// first stored run and does not grow again (nor shrink) until it holds
/// them; a run more and it grows.
#[test]
fn a_ranks_first_run_makes_room_for_the_runs_to_come() {
    let mut index = index_on(&[W1]);
    let room = |index: &KvIndex| index.ranks[&W1].blocks.capacity();
    let pairs: Vec<(u64, u64)> = (1..=RANK_FIRST_ROOM as u64 + 32).map(|i| (1000 + i, i)).collect();
    index.apply(&KvEvent::new(W1, 0, KvEventData::Cleared)).unwrap();
    sync(&mut index, 1, &[W1]);
    store(&mut index, W1, 1, Device, None, &pairs[..1]).unwrap();
    let first = room(&index);
    assert!(first >= RANK_FIRST_ROOM);
    let mut id = 2;
    let mut at = 1;
    while at < RANK_FIRST_ROOM {
        let end = (at + 32).min(RANK_FIRST_ROOM);
        store(&mut index, W1, id, Device, Some(pairs[at - 1].0), &pairs[at..end]).unwrap();
        assert_eq!(room(&index), first, "grown at {end} blocks");
        (id, at) = (id + 1, end);
    }
    store(&mut index, W1, id, Device, Some(pairs[at - 1].0), &pairs[at..]).unwrap();
    assert!(room(&index) > first, "not grown past {first} blocks");
    // Every block is on the row: the leading run of the whole chain.
    let locals: Vec<u64> = pairs.iter().map(|p| p.1).collect();
    assert_eq!(query(&mut index, &locals), vec![(pairs.len() as u32, 0, 0)]);
}

/// A run longer than the stride the store loop prefetches by (runs of 1 to
/// 3 strides and a bit) indexes every block, onto a rank that already
/// holds its first third (stored again, unchanged) while another rank holds
/// its first half: the overlap of every prefix is its length on the first
/// rank and at most half of the run on the other.
#[test]
fn long_runs_are_indexed_whole() {
    for len in [1, STRIDE - 1, STRIDE, STRIDE + 1, 3 * STRIDE + 5] {
        let mut index = index_on(&[W1, W2]);
        let pairs: Vec<(u64, u64)> = (1..=len as u64).map(|i| (500 + i, i)).collect();
        store(&mut index, W2, 0, Device, None, &pairs[..len / 2]).unwrap();
        store(&mut index, W1, 0, Device, None, &pairs[..len / 3]).unwrap();
        store(&mut index, W1, 1, Device, None, &pairs).unwrap();
        assert_eq!(index.index.ranks[&W1].blocks.len(), len);
        let locals: Vec<u64> = pairs.iter().map(|p| p.1).collect();
        for n in 1..=len {
            let got = query(&mut index, &locals[..n]);
            assert_eq!(got[0], (n as u32, 0, 0), "run of {len}, prefix {n}");
            assert_eq!(got[1], ((n.min(len / 2)) as u32, 0, 0), "run of {len}, prefix {n}");
        }
    }
}

/// A block table reserved for the blocks to come takes its size up front,
/// keeps it while they arrive, and answers as a table grown to them.
#[test]
fn a_reserved_block_table_never_grows_and_answers_alike() {
    let blocks = 1_000u64;
    let mut reserved = Fx {
        index: KvIndex::new(16).with_block_capacity(blocks as usize),
        ranks: Vec::new(),
        epoch: 0,
        out: KvOverlaps::new(),
    };
    sync(&mut reserved, 1, &[W1, W2]);
    let mut grown = index_on(&[W1, W2]);
    let slots = reserved.blocks.table_capacity();
    assert!(slots >= blocks as usize, "{slots} slots reserved for {blocks} blocks");
    // W1 stores the whole chain in runs of 100, W2 its first half.
    let pairs: Vec<(u64, u64)> = (1..=blocks).map(|i| (7_000 + i, i)).collect();
    for (rank, len) in [(W1, blocks as usize), (W2, blocks as usize / 2)] {
        for (id, run) in pairs[..len].chunks(100).enumerate() {
            let parent = (id > 0).then(|| pairs[id * 100 - 1].0);
            store(&mut reserved, rank, id as u64, Device, parent, run).unwrap();
            store(&mut grown, rank, id as u64, Device, parent, run).unwrap();
            // Synced after each event, as a router syncs before each query.
            sync(&mut reserved, 1, &[W1, W2]);
            sync(&mut grown, 1, &[W1, W2]);
            assert_eq!(
                reserved.blocks.table_capacity(),
                slots,
                "{rank:?} run {id}: the table grew"
            );
        }
    }
    assert_eq!(reserved.block_count(), blocks as usize);
    assert_eq!(grown.block_count(), blocks as usize);
    let locals: Vec<u64> = pairs.iter().map(|p| p.1).collect();
    for n in [1, 99, 100, 101, 500, 501, 1_000] {
        assert_eq!(
            query(&mut reserved, &locals[..n]),
            query(&mut grown, &locals[..n]),
            "prefix {n}"
        );
    }
    assert_eq!(query(&mut reserved, &locals)[1], (500, 0, 0));
}

/// An empty stored run leaves a new rank's table unallocated: the room a
/// first run makes is for ranks that store blocks.
#[test]
fn an_empty_first_run_allocates_nothing() {
    let mut index = index_on(&[W1]);
    store(&mut index, W1, 0, Device, None, &[]).unwrap();
    assert_eq!(index.index.ranks[&W1].blocks.heap_bytes(), 0);
}

#[test]
fn a_query_before_any_sync_is_an_error() {
    let index = KvIndex::new(16);
    let mut out = KvOverlaps::new();
    assert_eq!(index.overlaps(&[1], &mut out).unwrap_err(), KvQueryError::NoRowLayout);
}

#[test]
fn columns_are_reused_without_stale_values() {
    let mut index = index_on(&[W1, W2]);
    store(&mut index, W1, 0, Device, None, &[(101, 1)]).unwrap();
    store(&mut index, W2, 0, Host, None, &[(201, 5)]).unwrap();
    sync(&mut index, 1, &[W1, W2]);
    let mut out = KvOverlaps::new();
    index.overlaps_for_local_hashes(&[1], &mut out).unwrap();
    assert_eq!(out.tiers(0), (1, 0, 0));
    let columns = index.overlaps_for_local_hashes(&[5], &mut out).unwrap();
    assert_eq!(columns.device_blocks, [0.0, 0.0]);
    assert_eq!(columns.host_blocks.unwrap(), [0.0, 1.0]);
    assert_eq!(columns.cached_tokens.unwrap(), [0.0, 0.0]);
}

/// The plain model: per rank, engine hash -> (sequence hash, copies per
/// tier); a block is in a tier while it has a copy there, and a rank's
/// overlap walks the query's sequence hashes against the sequence hashes
/// it holds per tier under any engine hash.
#[derive(Default)]
struct Model {
    ranks: HashMap<WorkerWithDpRank, HashMap<u64, (u64, [u32; 3])>>,
}

fn tier_index(tier: StorageTier) -> usize {
    tier.bit().trailing_zeros() as usize
}

impl Model {
    fn store(&mut self, rank: WorkerWithDpRank, tier: StorageTier, parent: Option<u64>, pairs: &[(u64, u64)]) -> bool {
        let held = self.ranks.entry(rank).or_default();
        if parent.is_some_and(|p| pairs.iter().any(|b| b.0 == p)) {
            return false;
        }
        // A parent held in any tier.
        let mut chain = match parent {
            None => None,
            Some(p) => match held.get(&p) {
                Some(&(seq, _)) => Some(seq),
                None => return false,
            },
        };
        for &(ext, local) in pairs {
            let seq = chain.map_or(local, |p| next_sequence_hash(p, local));
            chain = Some(seq);
            let e = held.entry(ext).or_insert((seq, [0; 3]));
            if e.0 != seq {
                *e = (seq, [0; 3]);
            }
            e.1[tier_index(tier)] += 1;
        }
        true
    }

    fn remove(&mut self, rank: WorkerWithDpRank, tier: StorageTier, hashes: &[u64]) -> bool {
        let held = self.ranks.entry(rank).or_default();
        let mut ok = true;
        for h in hashes {
            match held.get_mut(h) {
                Some(e) if e.1[tier_index(tier)] > 0 => {
                    e.1[tier_index(tier)] -= 1;
                    if e.1 == [0; 3] {
                        held.remove(h);
                    }
                }
                _ => ok = false,
            }
        }
        ok
    }

    fn clear(&mut self, rank: WorkerWithDpRank, tier: StorageTier) {
        if let Some(held) = self.ranks.get_mut(&rank) {
            held.retain(|_, e| {
                e.1[tier_index(tier)] = 0;
                e.1 != [0; 3]
            });
        }
    }

    fn overlap(&self, rank: WorkerWithDpRank, seqs: &[u64]) -> (u32, u32, u32) {
        let Some(held) = self.ranks.get(&rank) else {
            return (0, 0, 0);
        };
        let holds = |seq: u64, tier: StorageTier| held.values().any(|&(s, c)| s == seq && c[tier_index(tier)] > 0);
        let mut i = 0;
        let mut run = |tier| {
            let start = i;
            while i < seqs.len() && holds(seqs[i], tier) {
                i += 1;
            }
            (i - start) as u32
        };
        (run(Device), run(Host), run(Disk))
    }
}

/// Random stores, removals and clears on 150 ranks (three words of rows,
/// so blocks turn dense) against the model; every query of every rank.
/// Engines alias: a block is stored under one of two engine hashes (the
/// second an engine that keys blocks by more than the router hashes), and
/// blocks are stored again while held (a copy more) and removed several
/// times in one event.
#[test]
fn random_events_match_the_model() {
    for seed in 0..4u64 {
        let mut rng = Rng::new(0xc0ffee + seed);
        let mut ranks: Vec<WorkerWithDpRank> = (0..150).map(|i| WorkerWithDpRank::new(i / 2, (i % 2) as u32)).collect();
        let mut index = index_on(&ranks);
        let mut epoch = 1;
        let mut model = Model::default();
        let mut ids: HashMap<WorkerWithDpRank, u64> = HashMap::new();
        let mut aliased_removals = 0;
        // A few shared prompts of 12 blocks; local hash of block j of prompt p.
        let local = |p: u64, j: u64| p * 100 + j;
        let ext = |p: u64, j: u64, alias: bool| (p * 100 + j) * 7 + 3 + if alias { 1 << 40 } else { 0 };
        for step in 0..3_000 {
            let rank = if rng.below(3) == 0 {
                ranks[rng.below(4) as usize]
            } else {
                ranks[rng.below(150) as usize]
            };
            let id = ids.entry(rank).or_insert(0);
            *id += 1;
            let tier = [Device, Device, Host, Disk][rng.below(4) as usize];
            let p = rng.below(4);
            let (from, len) = (rng.below(12), 1 + rng.below(4));
            let alias = rng.below(2) == 0;
            let pairs: Vec<(u64, u64)> = (from..(from + len).min(12))
                .map(|j| (ext(p, j, alias), local(p, j)))
                .collect();
            match rng.below(10) {
                0..=5 => {
                    let parent = (from > 0).then(|| ext(p, from - 1, alias != (rng.below(4) == 0)));
                    let expected = model.store(rank, tier, parent, &pairs);
                    let got = store(&mut index, rank, *id, tier, parent, &pairs);
                    assert_eq!(got.is_ok(), expected, "seed {seed} step {step}: {got:?}");
                    if expected && rng.below(2) == 0 {
                        // The same blocks under their other engine hashes.
                        *id += 1;
                        let other: Vec<(u64, u64)> = (from..(from + len).min(12))
                            .map(|j| (ext(p, j, !alias), local(p, j)))
                            .collect();
                        let expected = model.store(rank, tier, parent, &other);
                        let got = store(&mut index, rank, *id, tier, parent, &other);
                        assert_eq!(got.is_ok(), expected, "seed {seed} step {step}: {got:?}");
                    }
                }
                6..=8 => {
                    let k = tier_index(tier);
                    let held = model.ranks.entry(rank).or_default();
                    let mut hashes: Vec<u64> = pairs.iter().map(|b| b.0).collect();
                    let mut in_tier: Vec<u64> = held.iter().filter(|e| e.1 .1[k] > 0).map(|e| *e.0).collect();
                    if !in_tier.is_empty() && rng.below(2) == 0 {
                        // Blocks the rank holds in the tier, as engines evict.
                        in_tier.sort_unstable();
                        hashes = (0..1 + rng.below(2))
                            .map(|_| in_tier[rng.below(in_tier.len() as u64) as usize])
                            .collect();
                    }
                    if rng.below(4) == 0 {
                        hashes.push(hashes[0]);
                    }
                    let aliased = hashes.iter().any(|h| {
                        held.get(h).is_some_and(|&(seq, c)| {
                            c[k] > 0 && held.iter().any(|(o, &(s, oc))| o != h && s == seq && oc[k] > 0)
                        })
                    });
                    aliased_removals += usize::from(aliased);
                    let expected = model.remove(rank, tier, &hashes);
                    let got = remove(&mut index, rank, *id, tier, &hashes);
                    assert_eq!(got.is_ok(), expected, "seed {seed} step {step}: {got:?}");
                }
                _ => {
                    model.clear(rank, tier);
                    index
                        .apply(&KvEvent::new(rank, *id, KvEventData::Cleared).in_tier(tier))
                        .unwrap();
                }
            }
            if step % 500 == 499 {
                // Every rank moves to another row: its blocks are taken off
                // the old row and placed on the new one (up to 48 per rank,
                // in every tier: several strides of the placing loop).
                ranks.rotate_left(1 + rng.below(149) as usize);
                epoch += 1;
                sync(&mut index, epoch, &ranks);
            }
            if step % 20 == 0 {
                let p = rng.below(4);
                let locals: Vec<u64> = (0..12).map(|j| local(p, j)).collect();
                let mut seqs = Vec::new();
                sequence_hashes_of(&locals, &mut seqs);
                let got = query(&mut index, &locals);
                for (row, &rank) in ranks.iter().enumerate() {
                    assert_eq!(
                        got[row],
                        model.overlap(rank, &seqs),
                        "seed {seed} step {step} rank {rank}"
                    );
                }
            }
        }
        let dense = index.blocks.values().filter(|s| s.is_dense()).count();
        assert!(dense > 0, "seed {seed}: no block turned dense");
        assert!(
            aliased_removals > 20,
            "seed {seed}: {aliased_removals} removals of an aliased block"
        );
        index.blocks.check();
    }
}

/// Device and host events of two ranks interleaved, as an engine that
/// offloads blocks to host memory and loads them back reports them (the
/// two tiers' events in no order against each other): stores chain under
/// parents held in either tier, and every rank's overlap follows the tier
/// rule, against the model.
#[test]
fn an_interleaved_two_tier_stream_matches_the_model() {
    let ranks = [W1, W2];
    let mut index = index_on(&ranks);
    let mut model = Model::default();
    let mut rng = Rng::new(0x71e5);
    let local = |j: u64| 500 + j;
    let ext = |j: u64| 9_000 + j;
    let mut ids = [0u64; 2];
    let (mut stored, mut refused) = (0, 0);
    for step in 0..4_000 {
        let k = rng.below(2) as usize;
        let rank = ranks[k];
        ids[k] += 1;
        let tier = if rng.below(10) < 3 { Host } else { Device };
        let from = rng.below(24);
        let pairs: Vec<(u64, u64)> = (from..(from + 1 + rng.below(4)).min(24))
            .map(|j| (ext(j), local(j)))
            .collect();
        if rng.below(3) == 0 {
            let hashes: Vec<u64> = pairs.iter().map(|p| p.0).collect();
            let expected = model.remove(rank, tier, &hashes);
            let got = remove(&mut index, rank, ids[k], tier, &hashes);
            assert_eq!(got.is_ok(), expected, "step {step}: {got:?}");
        } else {
            let parent = (from > 0).then(|| ext(from - 1));
            let expected = model.store(rank, tier, parent, &pairs);
            let got = store(&mut index, rank, ids[k], tier, parent, &pairs);
            assert_eq!(got.is_ok(), expected, "step {step}: {got:?}");
            if expected {
                stored += 1;
            } else {
                refused += 1;
            }
        }
        if step % 10 == 0 {
            let locals: Vec<u64> = (0..24).map(local).collect();
            let mut seqs = Vec::new();
            sequence_hashes_of(&locals, &mut seqs);
            let got = query(&mut index, &locals);
            for (row, &rank) in ranks.iter().enumerate() {
                assert_eq!(got[row], model.overlap(rank, &seqs), "step {step} rank {rank}");
            }
        }
    }
    assert!(stored > 1_000 && refused > 100, "{stored} stored, {refused} refused");
}

/// The shared index: what readers see is the last publish, and after each
/// publish it equals a plain index fed the same operations (so the replay
/// onto the second copy loses nothing).
#[test]
fn a_shared_index_publishes_what_a_plain_index_holds() {
    for bound in [usize::MAX, 40] {
        shared_equals_plain(bound);
    }
}

/// A capacity no table could hold is refused with a panic, not a hang or
/// a table sized by an overflowed count.
#[test]
#[should_panic(expected = "capacity overflow")]
fn an_impossible_block_capacity_is_refused() {
    let _ = KvIndex::new(16).with_block_capacity(usize::MAX);
}

/// The copies of a shared index must start empty: an index that already
/// knows a rank is refused.
#[test]
#[should_panic(expected = "must return an empty index")]
fn a_shared_index_refuses_a_copy_that_knows_a_rank() {
    shared_with(|| {
        let mut index = KvIndex::new(16);
        store(&mut index, W1, 0, Device, None, &[(1, 1)]).unwrap();
        index
    });
}

fn shared_equals_plain(bound: usize) {
    let ranks: Vec<WorkerWithDpRank> = (0..70).map(|i| WorkerWithDpRank::new(i, 0)).collect();
    let rows: HashMap<WorkerWithDpRank, usize> = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    let layout = layout(1, ranks.len());
    let (mut writer, reader) = shared_bounded(16, bound);
    let mut plain = KvIndex::new(16).with_max_blocks(bound);
    let mut rng = Rng::new(99);
    let (mut out, mut expected) = (KvOverlaps::new(), KvOverlaps::new());
    assert_eq!(reader.overlaps(&[1], &mut out).unwrap_err(), KvQueryError::NoRowLayout);
    let local = |j: u64| 1000 + j;
    for step in 0..2_000u64 {
        let rank = ranks[rng.below(ranks.len() as u64) as usize];
        let from = rng.below(10);
        let pairs: Vec<(u64, u64)> = (from..from + 1 + rng.below(3))
            .map(|j| (j * 31 + 7, local(j)))
            .collect();
        let tier = [Device, Device, Host, Disk][rng.below(4) as usize];
        let blocks = blocks(&pairs);
        let hashes: Vec<u64> = pairs.iter().map(|p| p.0).collect();
        let parent = (from > 0).then(|| (from - 1) * 31 + 7);
        let data = match rng.below(5) {
            0..=2 => KvEventData::Stored {
                parent,
                blocks: &blocks,
            },
            3 => KvEventData::Removed { blocks: &hashes },
            _ => KvEventData::Cleared,
        };
        // Some event ids skip, to exercise gaps on both copies.
        let event = KvEvent::new(rank, step + rng.below(2), data).in_tier(tier);
        assert_eq!(writer.apply(&event), plain.apply(&event));
        if rng.below(50) == 0 {
            assert_eq!(
                writer.remove_worker(rank.worker_id),
                plain.remove_worker(rank.worker_id)
            );
        }
        if step % 7 == 0 {
            writer.sync_rows(layout, |r| rows.get(&r).copied()).unwrap();
            plain.sync_rows(layout, |r| rows.get(&r).copied()).unwrap();
            assert!(writer.unpublished() > 0);
            writer.publish();
            assert_eq!(writer.unpublished(), 0);
            let query: Vec<u64> = (0..10).map(local).collect();
            let got = reader.overlaps_for_local_hashes(&query, &mut out).unwrap();
            let want = plain.overlaps_for_local_hashes(&query, &mut expected).unwrap();
            assert_eq!(got, want, "step {step}");
            assert_eq!(reader.stats(), plain.stats(), "step {step}");
            assert!(plain.held_blocks() <= bound);
            assert_eq!(writer.stats(), plain.stats(), "step {step}");
            assert_eq!(reader.row_layout(), Some(layout));
        }
    }
    // Unpublished events are not visible.
    let first = [StoredBlock {
        block_hash: 5,
        tokens_hash: 77,
    }];
    writer
        .apply(&KvEvent::new(
            WorkerWithDpRank::new(900, 0),
            0,
            KvEventData::Stored {
                parent: None,
                blocks: &first,
            },
        ))
        .unwrap();
    writer
        .sync_rows(layout, |r| rows.get(&r).copied().or((r.worker_id == 900).then_some(0)))
        .unwrap();
    assert!(reader
        .overlaps_for_local_hashes(&[77], &mut out)
        .unwrap()
        .device_blocks
        .iter()
        .all(|&v| v == 0.0));
    writer.publish();
    assert_eq!(
        reader.overlaps_for_local_hashes(&[77], &mut out).unwrap().device_blocks[0],
        1.0
    );
}

/// Queries on other threads while the writer stores a prompt block by
/// block and publishes each: every query sees a whole publish, so the
/// overlap never goes back and ends at the whole prompt.
#[test]
fn queries_run_while_the_writer_publishes() {
    let rank = WorkerWithDpRank::new(1, 0);
    let (mut writer, reader) = shared(16);
    writer.sync_rows(layout(1, 1), |r| (r == rank).then_some(0)).unwrap();
    writer.publish();
    const BLOCKS: u64 = 64;
    let local: Vec<u64> = (0..BLOCKS).map(|j| 500 + j).collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (reader, local) = (reader.clone(), local.clone());
            std::thread::spawn(move || {
                let mut out = KvOverlaps::new();
                let mut last = 0.0;
                while last < BLOCKS as f32 {
                    let seen = reader
                        .overlaps_for_local_hashes(&local, &mut out)
                        .unwrap()
                        .device_blocks[0];
                    assert!(seen >= last, "the overlap went back from {last} to {seen}");
                    last = seen;
                }
            })
        })
        .collect();
    for j in 0..BLOCKS {
        let block = [StoredBlock {
            block_hash: j,
            tokens_hash: local[j as usize],
        }];
        let parent = j.checked_sub(1);
        writer
            .apply(&KvEvent::new(rank, j, KvEventData::Stored { parent, blocks: &block }))
            .unwrap();
        writer.sync_rows(layout(1, 1), |r| (r == rank).then_some(0)).unwrap();
        writer.publish();
    }
    for r in readers {
        r.join().unwrap();
    }
}

/// Past the bound the blocks stored longest ago go first; storing a block
/// again makes it the newest.
#[test]
fn the_coldest_blocks_are_evicted_past_the_bound() {
    let mut index = index_on(&[W1, W2]);
    index.index = KvIndex::new(16).with_max_blocks(4);
    sync(&mut index, 2, &[W1, W2]);
    store(&mut index, W1, 0, Device, None, &[(101, 1), (102, 2), (103, 3)]).unwrap();
    // Stored again: 101 is now newer than 102 and 103.
    store(&mut index, W1, 1, Device, None, &[(101, 1)]).unwrap();
    assert_eq!(index.stats().evicted_blocks, 0);
    store(&mut index, W2, 0, Device, None, &[(201, 1), (202, 2), (203, 3)]).unwrap();
    assert_eq!(index.held_blocks(), 4);
    assert_eq!(index.stats().evicted_blocks, 2);
    assert_eq!(index.rank_blocks(W1, Device), 1, "102 and 103 went first");
    assert_eq!(query(&mut index, &[1, 2, 3]), [(1, 0, 0), (3, 0, 0)]);
    // An evicted block is forgotten: a store under it is refused.
    assert!(store(&mut index, W1, 2, Device, Some(102), &[(103, 3)]).is_err());
    // Removals free room: nothing more is evicted.
    remove(&mut index, W2, 1, Device, &[203]).unwrap();
    store(&mut index, W1, 3, Device, Some(101), &[(102, 2)]).unwrap();
    assert_eq!(index.stats().evicted_blocks, 2);
    assert_eq!(query(&mut index, &[1, 2, 3]), [(2, 0, 0), (2, 0, 0)]);
    // Without a bound nothing is ever evicted.
    let mut unbounded = index_on(&[W1]);
    let pairs: Vec<(u64, u64)> = (0..500).map(|j| (j + 1, j + 1)).collect();
    store(&mut unbounded, W1, 0, Device, None, &pairs).unwrap();
    assert_eq!((unbounded.held_blocks(), unbounded.stats().evicted_blocks), (500, 0));
}

/// Many rows leaving a word at once: a word whose rows all held every block
/// so far is written whole, and a word where some rows left earlier keeps
/// their values (a query over 200 rows, each holding its own number of
/// leading blocks of one chain).
#[test]
fn rows_leaving_in_bulk_keep_their_own_depths() {
    let ranks: Vec<WorkerWithDpRank> = (0..200).map(|id| WorkerWithDpRank::new(id, 0)).collect();
    let mut fx = index_on(&ranks);
    let chain = chain_of((0..10).map(|i| 0xB0_0000 + i));
    let depth = |row: usize| -> usize {
        match row {
            0..=2 => 10,
            3..=63 => 5,
            64..=73 => 3,
            74..=127 => 7,
            _ => row % 11,
        }
    };
    for (row, &rank) in ranks.iter().enumerate() {
        let pairs = chain.blocks(0..depth(row));
        if !pairs.is_empty() {
            store(&mut fx, rank, 0, Device, None, &pairs).expect("a first run");
        }
    }
    let got = query(&mut fx, &chain.local);
    for (row, &(device, host, disk)) in got.iter().enumerate() {
        assert_eq!((device, host, disk), (depth(row) as u32, 0, 0), "row {row}");
        assert_eq!(
            fx.out.row_overlaps().unwrap().cached_tokens.unwrap()[row],
            (depth(row) * 16) as f32,
            "row {row}"
        );
    }
}

/// Ranks without a row: at most the bound (the one waiting longest goes
/// first, with its blocks), and dropped once they waited the time to live
/// from the first sync that found them without a row. A dropped rank's
/// next event is its first again.
#[test]
fn ranks_awaiting_a_row_are_bounded_in_number_and_age() {
    use std::time::{Duration, Instant};
    let ttl = Duration::from_secs(60);
    let mut index = KvIndex::new(16).with_max_awaiting_ranks(3).with_awaiting_rank_ttl(ttl);
    let layout = layout(1, 1);
    let none = |_| None;
    let t0 = Instant::now();
    index.sync_rows_at(layout, none, t0, true).unwrap();
    let r = |w| WorkerWithDpRank::new(w, 0);
    for w in 1..=4 {
        store(&mut index, r(w), 5, Device, None, &[(w, w)]).unwrap();
    }
    // Rank 1 waited longest: dropped with its block for rank 4.
    assert_eq!((index.awaiting_rank_count(), index.held_blocks()), (3, 3));
    assert_eq!(index.rank_blocks(r(1), Device), 0);
    assert_eq!(index.stats().awaiting_ranks_dropped, 1);
    index
        .sync_rows_at(layout, none, t0 + Duration::from_secs(10), true)
        .unwrap();
    store(&mut index, r(5), 5, Device, None, &[(5, 5)]).unwrap();
    // Ranks 2..=4 were first found without a row at 10 s, rank 5 at 30 s.
    index
        .sync_rows_at(layout, none, t0 + Duration::from_secs(30), true)
        .unwrap();
    assert_eq!(index.awaiting_rank_count(), 3, "rank 2 dropped for rank 5");
    index
        .sync_rows_at(layout, none, t0 + Duration::from_secs(69), true)
        .unwrap();
    assert_eq!(index.awaiting_rank_count(), 3);
    index
        .sync_rows_at(layout, none, t0 + Duration::from_secs(70), true)
        .unwrap();
    assert_eq!(
        (index.awaiting_rank_count(), index.held_blocks()),
        (1, 1),
        "ranks 3 and 4 waited 60 s"
    );
    index
        .sync_rows_at(layout, none, t0 + Duration::from_secs(90), true)
        .unwrap();
    assert_eq!(
        (index.awaiting_rank_count(), index.rank_count(), index.held_blocks()),
        (0, 0, 0)
    );
    assert_eq!(index.stats().awaiting_ranks_dropped, 5);
    // Rank 5's next event is a first one: any id.
    store(&mut index, r(5), 2, Device, None, &[(5, 5)]).unwrap();
    // A rank that gets a row in time keeps its blocks, whatever it waited.
    index
        .sync_rows_at(
            layout,
            |rank| (rank == r(5)).then_some((0, None)),
            t0 + Duration::from_secs(200),
            true,
        )
        .unwrap();
    assert_eq!((index.awaiting_rank_count(), index.held_blocks()), (0, 1));
}
