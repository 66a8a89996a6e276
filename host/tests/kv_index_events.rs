//! The KV index against the event streams engines send, through the public
//! API with a selection service: engines that restart, workers that leave
//! and come back, engine hashes that alias one block, blocks stored and
//! removed several times, and stores chained across storage tiers.

use selkie::kv_index::{KvEvent, KvEventData, KvEventError, KvIndex, KvOverlaps, StorageTier, StoredBlock};
use selkie::*;

const W1: WorkerWithDpRank = WorkerWithDpRank::new(1, 0);
const W2: WorkerWithDpRank = WorkerWithDpRank::new(2, 0);

struct Router {
    service: WorkerSelectionService,
    index: KvIndex,
    out: KvOverlaps,
}

impl Router {
    fn new(workers: &[u64]) -> Self {
        let service = WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig::default(),
        );
        for &w in workers {
            service.add_worker(WorkerRecord::new(w)).expect("a new worker");
        }
        let mut router = Router {
            service,
            index: KvIndex::new(16),
            out: KvOverlaps::new(),
        };
        router.sync();
        router
    }

    /// What a router does before each query (with the ranks' tenures, so
    /// that the index sees a worker that left and came back).
    fn sync(&mut self) {
        let service = &self.service;
        self.index
            .sync_rows(service.row_layout(), |r| service.rank_row(r))
            .expect("the index has the service's block size");
    }

    fn store(
        &mut self,
        rank: WorkerWithDpRank,
        id: u64,
        tier: StorageTier,
        parent: Option<u64>,
        pairs: &[(u64, u64)],
    ) -> Result<(), KvEventError> {
        let blocks: Vec<StoredBlock> = pairs
            .iter()
            .map(|&(block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect();
        let data = KvEventData::Stored {
            parent,
            blocks: &blocks,
        };
        self.index.apply(&KvEvent::new(rank, id, data).in_tier(tier))
    }

    fn remove(
        &mut self,
        rank: WorkerWithDpRank,
        id: u64,
        tier: StorageTier,
        hashes: &[u64],
    ) -> Result<(), KvEventError> {
        self.index
            .apply(&KvEvent::new(rank, id, KvEventData::Removed { blocks: hashes }).in_tier(tier))
    }

    /// `(device, host, disk)` of `rank` for a query by local hashes, after
    /// a sync (0s for a rank without a row).
    fn overlap(&mut self, rank: WorkerWithDpRank, local: &[u64]) -> (u32, u32, u32) {
        self.sync();
        self.index
            .overlaps_for_local_hashes(local, &mut self.out)
            .expect("synced");
        self.service.row_of(rank).map_or((0, 0, 0), |row| self.out.tiers(row))
    }
}

use StorageTier::{Device, Host};

/// A router of workers 1 and 2 whose worker 1's engine stored `events`
/// one-block runs (engine hashes 100.., local hashes 7..), synced.
fn engine_ran(events: u64) -> Router {
    let mut r = Router::new(&[1, 2]);
    for id in 0..events {
        r.store(W1, id, Device, None, &[(100 + id, 7 + id)]).unwrap();
    }
    assert_eq!(r.overlap(W1, &[7]), (1, 0, 0));
    r
}

/// Worker `w` leaves the service and joins it again.
fn rejoin(r: &Router, w: u64) {
    r.service.remove_worker(w).unwrap();
    r.service.add_worker(WorkerRecord::new(w)).unwrap();
}

/// A worker removed and added again between two syncs (its engine
/// restarted): the old engine's blocks stop counting, and the new engine's
/// events, numbered from 0 again, are applied.
#[test]
fn a_worker_removed_and_added_again_between_two_syncs_starts_clean() {
    let mut r = engine_ran(5);
    rejoin(&r, 1);
    assert_eq!(r.overlap(W1, &[7]), (0, 0, 0), "the old engine's block still counts");
    // The new engine numbers its events from 0.
    for id in 0..3 {
        r.store(W1, id, Device, None, &[(500 + id, 70 + id)])
            .unwrap_or_else(|e| panic!("the new engine's event {id}: {e}"));
    }
    assert_eq!(r.overlap(W1, &[70]), (1, 0, 0));
    assert_eq!(r.overlap(W1, &[7]), (0, 0, 0));
}

/// The new engine's first events arrive before the router syncs: they are
/// applied, the old engine's blocks are dropped with the first, and the
/// sync that sees the worker back keeps them.
#[test]
fn a_restarted_engines_event_0_starts_a_new_incarnation() {
    let mut r = engine_ran(5);
    rejoin(&r, 1);
    r.store(W1, 0, Device, None, &[(500, 70)])
        .unwrap_or_else(|e| panic!("the new engine's event 0: {e}"));
    r.store(W1, 1, Device, Some(500), &[(501, 71)])
        .unwrap_or_else(|e| panic!("the new engine's event 1: {e}"));
    assert_eq!(r.overlap(W1, &[70, 71]), (2, 0, 0));
    assert_eq!(r.overlap(W1, &[7]), (0, 0, 0));
}

/// A late event of a removed worker's dead engine arrives after the sync
/// that dropped the worker: when the worker comes back with a new engine,
/// the dead engine's block does not count and the new engine's events
/// (numbered from 0) are applied.
#[test]
fn a_late_event_of_a_removed_worker_is_not_credited_when_it_returns() {
    let mut r = engine_ran(20);
    r.service.remove_worker(1).unwrap();
    r.sync();
    // Late: event 20 of the dead engine.
    r.store(W1, 20, Device, None, &[(999, 99)]).unwrap();
    r.service.add_worker(WorkerRecord::new(1)).unwrap();
    assert_eq!(r.overlap(W1, &[99]), (0, 0, 0), "the dead engine's block counts");
    let refused: Vec<u64> = (0..20)
        .filter(|&id| r.store(W1, id, Device, None, &[(500 + id, 70 + id)]).is_err())
        .collect();
    assert!(refused.is_empty(), "the new engine's events {refused:?} were refused");
    assert_eq!(r.overlap(W1, &[70]), (1, 0, 0));
    assert_eq!(r.overlap(W1, &[99]), (0, 0, 0));
}

/// One event id of `u64::MAX` does not freeze a rank: it is refused, and
/// the rank's next events are applied.
#[test]
fn an_event_id_far_ahead_is_not_believed() {
    let mut r = Router::new(&[1, 2]);
    r.store(W1, 0, Device, None, &[(100, 7)]).unwrap();
    let e = r.store(W1, u64::MAX, Device, None, &[(666, 66)]).unwrap_err();
    println!("{e}");
    for id in 1..10 {
        r.store(W1, id, Device, Some(99 + id), &[(100 + id, 7 + id)])
            .unwrap_or_else(|e| panic!("event {id}: {e}"));
    }
    let chain: Vec<u64> = (7..17).collect();
    assert_eq!(r.overlap(W1, &chain), (10, 0, 0));
    assert_eq!(r.overlap(W1, &[66]), (0, 0, 0));
}

/// Two engine hashes with one sequence hash (an engine that keys blocks by
/// more than the router hashes): removing one leaves the block held by the
/// other.
#[test]
fn two_engine_hashes_of_one_block_are_both_counted() {
    let mut r = Router::new(&[1, 2]);
    r.store(W1, 0, Device, None, &[(100, 7)]).unwrap();
    r.sync();
    r.store(W1, 1, Device, None, &[(200, 7)]).unwrap();
    r.remove(W1, 2, Device, &[100]).unwrap();
    assert_eq!(r.overlap(W1, &[7]), (1, 0, 0), "200 still holds the block");
    r.remove(W1, 3, Device, &[200]).unwrap();
    assert_eq!(r.overlap(W1, &[7]), (0, 0, 0));
    // Without a sync in between, and with the engine reusing a hash for
    // another block in a run: 300 and 400 hold block [7], then 300 names
    // block [5] instead.
    r.store(W1, 4, Device, None, &[(300, 7)]).unwrap();
    r.store(W1, 5, Device, None, &[(400, 7), (401, 8)]).unwrap();
    r.store(W1, 6, Device, None, &[(300, 5)]).unwrap();
    assert_eq!(r.overlap(W1, &[7, 8]), (2, 0, 0), "400 still holds the block");
    assert_eq!(r.overlap(W1, &[5]), (1, 0, 0));
}

/// A block stored again is held once more (vLLM keeps a second copy of a
/// block it caches twice and removes each copy with its own event): it is
/// gone only once removed as often as stored, and three removals of a hash
/// in one event remove three copies.
#[test]
fn a_block_stored_twice_is_held_until_removed_twice() {
    let mut r = Router::new(&[1, 2]);
    r.store(W1, 0, Device, None, &[(100, 7)]).unwrap();
    r.store(W1, 1, Device, None, &[(100, 7), (101, 8)]).unwrap();
    r.remove(W1, 2, Device, &[100]).unwrap();
    assert_eq!(r.overlap(W1, &[7, 8]), (2, 0, 0), "one copy of 100 is left");
    r.remove(W1, 3, Device, &[100]).unwrap();
    assert_eq!(r.overlap(W1, &[7, 8]), (0, 0, 0));
    for id in 4..7 {
        r.store(W2, id, Device, None, &[(200, 9)]).unwrap();
    }
    r.remove(W2, 7, Device, &[200, 200, 200])
        .unwrap_or_else(|e| panic!("three removals of three copies: {e}"));
    assert_eq!(r.overlap(W2, &[9]), (0, 0, 0));
    assert!(r.remove(W2, 8, Device, &[200]).is_err(), "no copy is left");
}

/// A device store under a parent the rank holds only in host memory (the
/// engine loaded it back, or offloaded the parent first: the two tiers'
/// events are not ordered) is applied, and so is every store chained on
/// it; the device blocks count once the parent is on device again.
#[test]
fn a_device_store_under_a_host_parent_is_applied() {
    let mut r = Router::new(&[1, 2]);
    r.store(W1, 0, Host, None, &[(100, 1)]).unwrap();
    r.store(W1, 1, Device, Some(100), &[(101, 2)])
        .unwrap_or_else(|e| panic!("a device store under a host parent: {e}"));
    r.store(W1, 2, Device, Some(101), &[(102, 3)])
        .unwrap_or_else(|e| panic!("a device store chained on it: {e}"));
    // The parent is host-only: the device run is empty, the host run is
    // block 0 (device blocks after it do not continue a host run).
    assert_eq!(r.overlap(W1, &[1, 2, 3]), (0, 1, 0));
    r.store(W1, 3, Device, None, &[(100, 1)]).unwrap();
    assert_eq!(r.overlap(W1, &[1, 2, 3]), (3, 0, 0));
}
