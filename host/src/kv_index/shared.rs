//! The index shared between one event-ingesting writer and any number of
//! querying threads, with queries that never wait for ingestion.
//!
//! The index is kept twice: queries read one copy while the
//! writer applies events to the other and logs them; [`KvIndexWriter::publish`]
//! swaps the copies, waits for the queries still inside the old one (never
//! longer than a query), and replays the log onto it.
//! A query never waits: entering and leaving a copy are one atomic
//! read-modify-write each. The price is memory (two copies) and ingestion
//! work (each event is applied twice). Queries see the rows the writer
//! synced last: when the service's layout moves, the writer must sync and
//! publish (a selection with the old rows is refused as stale, never
//! credited to the wrong worker).
//!
//! ```
//! use selkie::kv_index::{shared, KvBlockHasher, KvEvent, KvEventData, KvOverlaps, StoredBlock};
//! use selkie::*;
//!
//! let service = WorkerSelectionService::new(
//!     WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
//!     ServiceConfig::default(),
//! );
//! service.add_worker(WorkerRecord::new(7))?;
//! let (mut writer, reader) = shared(16);
//! let hasher = KvBlockHasher::new(16);
//! let prompt: Vec<u32> = (0..32).collect();
//! let mut local = Vec::new();
//! hasher.local_hashes(&prompt, &mut local);
//! let blocks = [StoredBlock { block_hash: 1, tokens_hash: local[0] }];
//!
//! // The event thread: apply, sync rows when the layout moves, publish.
//! let stored = KvEventData::Stored { parent: None, blocks: &blocks };
//! writer.apply(&KvEvent::new(WorkerWithDpRank::new(7, 0), 0, stored))?;
//! writer.sync_rows(service.row_layout(), |rank| service.row_of(rank))?;
//! writer.publish();
//!
//! // Any query thread, with its own columns.
//! let row = service.row_of(WorkerWithDpRank::new(7, 0)).unwrap();
//! let query = std::thread::spawn(move || {
//!     let mut out = KvOverlaps::new();
//!     let columns = reader.overlaps_for_tokens(&hasher, &prompt, &mut out).unwrap();
//!     columns.device_blocks[row]
//! });
//! assert_eq!(query.join().unwrap(), 1.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::event::{KvEvent, KvEventData, KvEventError, KvQueryError, StorageTier, StoredBlock};
use super::hash::KvBlockHasher;
use super::query::KvOverlaps;
use super::{KvIndex, KvIndexStats, RowAnswer};
use crate::request::{RowLayout, RowOverlaps};
use crate::types::{WorkerId, WorkerWithDpRank};
use selkie_kernel::two_copies::{CopyWriter, TwoCopies};

/// A shared index: the writer for the event thread and a reader to clone
/// for every query thread.
pub fn shared(block_size: u32) -> (KvIndexWriter, KvIndexReader) {
    shared_bounded(block_size, usize::MAX)
}

/// [`shared`], each copy bounded as by [`KvIndex::with_max_blocks`].
pub fn shared_bounded(block_size: u32, max_blocks: usize) -> (KvIndexWriter, KvIndexReader) {
    shared_with(|| KvIndex::new(block_size).with_max_blocks(max_blocks))
}

/// [`shared`], each of the two copies made by `make`: an empty index
/// configured as the router wants it (bounded, its block capacity
/// reserved).
///
/// ```
/// use selkie::kv_index::{shared_with, KvIndex};
///
/// let (writer, reader) = shared_with(|| KvIndex::new(16).with_block_capacity(100_000).with_max_blocks(400_000));
/// assert_eq!(writer.stats(), reader.stats());
/// ```
///
/// # Panics
/// If `make` returns an index that already knows a rank (the copies must
/// start equal and empty).
pub fn shared_with(make: impl Fn() -> KvIndex) -> (KvIndexWriter, KvIndexReader) {
    let copy = || {
        let index = make();
        assert_eq!(index.rank_count(), 0, "shared_with: `make` must return an empty index");
        index
    };
    let copies = CopyWriter::new(copy(), copy());
    let reader = KvIndexReader {
        copies: copies.readers(),
    };
    let writer = KvIndexWriter {
        copies,
        log: Vec::new(),
        blocks: Vec::new(),
        hashes: Vec::new(),
        rows: Vec::new(),
    };
    (writer, reader)
}

/// An operation applied to the writer's copy, to replay onto the other.
#[derive(Clone, Debug)]
enum Op {
    Stored {
        worker: WorkerWithDpRank,
        event_id: u64,
        tier: StorageTier,
        parent: Option<u64>,
        blocks: Range<usize>,
    },
    Removed {
        worker: WorkerWithDpRank,
        event_id: u64,
        tier: StorageTier,
        hashes: Range<usize>,
    },
    Cleared {
        worker: WorkerWithDpRank,
        event_id: u64,
        tier: StorageTier,
    },
    SyncRows {
        layout: RowLayout,
        rows: Range<usize>,
        now: Instant,
    },
    RemoveWorker(WorkerId),
}

/// The single writer of a shared index (see [`shared`]): applies events
/// and row changes, and publishes them to the readers.
#[derive(Debug)]
pub struct KvIndexWriter {
    copies: CopyWriter<KvIndex>,
    /// Operations applied to the writer's copy since the last publish.
    log: Vec<Op>,
    /// The logged events' blocks, hashes and row answers, flat.
    blocks: Vec<StoredBlock>,
    hashes: Vec<u64>,
    rows: Vec<(WorkerWithDpRank, RowAndTenure)>,
}

/// A rank's row and tenure as a sync got them (see [`RowAnswer`]).
type RowAndTenure = Option<(usize, Option<u64>)>;

impl KvIndexWriter {
    /// Applies one event (as [`KvIndex::apply`]); readers see it after the
    /// next [`publish`](Self::publish).
    pub fn apply(&mut self, event: &KvEvent<'_>) -> Result<(), KvEventError> {
        let (worker, event_id, tier) = (event.worker, event.event_id, event.tier);
        self.log.push(match event.data {
            KvEventData::Stored { parent, blocks } => {
                let start = self.blocks.len();
                self.blocks.extend_from_slice(blocks);
                Op::Stored {
                    worker,
                    event_id,
                    tier,
                    parent,
                    blocks: start..self.blocks.len(),
                }
            }
            KvEventData::Removed { blocks } => {
                let start = self.hashes.len();
                self.hashes.extend_from_slice(blocks);
                Op::Removed {
                    worker,
                    event_id,
                    tier,
                    hashes: start..self.hashes.len(),
                }
            }
            KvEventData::Cleared => Op::Cleared { worker, event_id, tier },
        });
        self.copies.write(|index| index.apply(event))
    }

    /// Places the index on the service's rows (as [`KvIndex::sync_rows`],
    /// refusing a layout of another block size, which changes nothing);
    /// readers see the new rows after the next [`publish`](Self::publish).
    pub fn sync_rows<A: RowAnswer>(
        &mut self,
        layout: RowLayout,
        mut row_of: impl FnMut(WorkerWithDpRank) -> A,
    ) -> Result<(), KvQueryError> {
        let start = self.rows.len();
        let answers = &mut self.rows;
        let now = Instant::now();
        self.copies.write(|index| {
            index.sync_rows_at(
                layout,
                |rank| {
                    let row = row_of(rank).row_and_tenure();
                    answers.push((rank, row));
                    row
                },
                now,
                true,
            )
        })?;
        self.log.push(Op::SyncRows {
            layout,
            rows: start..self.rows.len(),
            now,
        });
        Ok(())
    }

    /// Drops every rank of a worker (as [`KvIndex::remove_worker`]);
    /// readers see it after the next [`publish`](Self::publish).
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        self.log.push(Op::RemoveWorker(worker_id));
        self.copies.write(|index| index.remove_worker(worker_id))
    }

    /// Operations applied since the last publish.
    pub fn unpublished(&self) -> usize {
        self.log.len()
    }

    /// What the writer's copy did so far (it leads the readers' copy by
    /// the unpublished operations).
    pub fn stats(&self) -> KvIndexStats {
        self.copies.read_own(|index| index.stats())
    }

    /// [`KvIndex::held_blocks`] of the writer's copy.
    pub fn held_blocks(&self) -> usize {
        self.copies.read_own(KvIndex::held_blocks)
    }

    /// Makes everything applied so far visible to queries. Waits for the
    /// queries still reading the previous copy, then replays the
    /// operations onto it, so both copies are equal again.
    pub fn publish(&mut self) {
        if self.log.is_empty() {
            return;
        }
        self.copies.publish();
        let (log, blocks, hashes, rows) = (&self.log, &self.blocks, &self.hashes, &self.rows);
        self.copies.write(|index| {
            for op in log {
                replay(index, op, blocks, hashes, rows);
            }
        });
        self.log.clear();
        self.blocks.clear();
        self.hashes.clear();
        self.rows.clear();
    }

    /// A reader of this index.
    pub fn reader(&self) -> KvIndexReader {
        KvIndexReader {
            copies: self.copies.readers(),
        }
    }
}

/// Applies a logged operation again, on the other copy, reporting nothing.
fn replay(
    index: &mut KvIndex,
    op: &Op,
    blocks: &[StoredBlock],
    hashes: &[u64],
    rows: &[(WorkerWithDpRank, RowAndTenure)],
) {
    let event = |worker, event_id, tier, data| KvEvent {
        worker,
        event_id,
        tier,
        data,
    };
    match op {
        Op::Stored {
            worker,
            event_id,
            tier,
            parent,
            blocks: range,
        } => {
            let data = KvEventData::Stored {
                parent: *parent,
                blocks: &blocks[range.clone()],
            };
            let _ = index.apply_reporting(&event(*worker, *event_id, *tier, data), false);
        }
        Op::Removed {
            worker,
            event_id,
            tier,
            hashes: range,
        } => {
            let data = KvEventData::Removed {
                blocks: &hashes[range.clone()],
            };
            let _ = index.apply_reporting(&event(*worker, *event_id, *tier, data), false);
        }
        Op::Cleared { worker, event_id, tier } => {
            let _ = index.apply_reporting(&event(*worker, *event_id, *tier, KvEventData::Cleared), false);
        }
        Op::SyncRows {
            layout,
            rows: range,
            now,
        } => {
            let answers: HashMap<WorkerWithDpRank, RowAndTenure> = rows[range.clone()].iter().copied().collect();
            // Both copies have the block size the first sync checked.
            let _ = index.sync_rows_at(*layout, |rank| answers.get(&rank).copied().flatten(), *now, false);
        }
        Op::RemoveWorker(worker_id) => {
            index.remove_worker_reporting(*worker_id, false);
        }
    }
}

/// A query handle of a shared index (see [`shared`]); clone one per
/// thread. Queries read the last published state and never wait for the
/// writer.
#[derive(Clone, Debug)]
pub struct KvIndexReader {
    copies: Arc<TwoCopies<KvIndex>>,
}

impl KvIndexReader {
    /// [`KvIndex::overlaps`] on the published index.
    pub fn overlaps<'o>(
        &self,
        sequence_hashes: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        self.copies.read(|index| index.overlaps(sequence_hashes, out))
    }

    /// [`KvIndex::overlaps_for_local_hashes`] on the published index.
    pub fn overlaps_for_local_hashes<'o>(
        &self,
        local_hashes: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        self.copies
            .read(|index| index.overlaps_for_local_hashes(local_hashes, out))
    }

    /// [`KvIndex::overlaps_for_tokens`] on the published index.
    pub fn overlaps_for_tokens<'o>(
        &self,
        hasher: &KvBlockHasher,
        tokens: &[u32],
        out: &'o mut KvOverlaps,
    ) -> Result<RowOverlaps<'o>, KvQueryError> {
        self.copies.read(|index| index.overlaps_for_tokens(hasher, tokens, out))
    }

    /// The row layout of the published index.
    pub fn row_layout(&self) -> Option<RowLayout> {
        self.copies.read(KvIndex::row_layout)
    }

    /// The published index's counts.
    pub fn stats(&self) -> KvIndexStats {
        self.copies.read(KvIndex::stats)
    }
}
