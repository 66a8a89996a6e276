//! Where a request's cache overlaps come from ([`OverlapSource`]) and the
//! source `selkie serve` has without engine events: [`LearnedOverlaps`],
//! the router's own decisions (Dynamo's approximate mode).
//!
//! A source is asked for every worker rank's overlap with a prompt's
//! blocks before the selection, and told which rank was chosen after it. A
//! source fed by the engines' KV events answers from what the engines
//! hold and has nothing to learn from the choice.
//!
//! [`LearnedOverlaps`] takes a chosen rank to hold the prompt's blocks for
//! a time to live. Its memory is bounded by
//! [`Limits::max_index_blocks`](super::Limits::max_index_blocks) twice
//! over: the blocks it holds, and the records waiting to expire (each
//! record of a prompt queues every one of its blocks, held already or not).
//! A decision that would pass either bound is not recorded (counted in
//! `selkie_bound_hits_total{bound="max_index_blocks"}`); a decision whose
//! rank already held every block of the prompt is not recorded again until
//! the blocks expire, so a hot prompt costs one record per time to live.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::prompt::PromptBlocks;
use crate::kv_index::{ApproxKvIndex, KvOverlaps};
use crate::{RowOverlaps, WorkerSelectionService, WorkerWithDpRank};

/// What became of a chosen rank's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// Recorded.
    Yes,
    /// Not needed: the rank held every block already, or the source
    /// learns nothing from choices.
    Unneeded,
    /// Not recorded: a memory bound.
    Full,
}

/// A source of per-rank cache overlaps for the `kv` policy (and every
/// policy that reads overlaps).
pub trait OverlapSource: Send + Sync {
    /// Writes every rank's overlap with the prompt whose blocks have these
    /// sequence hashes into `out`, on `service`'s current rows.
    fn overlaps<'o>(
        &self,
        service: &WorkerSelectionService,
        sequence: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Option<RowOverlaps<'o>>;

    /// The request of `blocks` went to `rank`, which held `held` of them.
    fn chosen(&self, rank: WorkerWithDpRank, blocks: &PromptBlocks, held: usize) -> Recorded;

    /// Blocks the source holds (`selkie_kv_index_blocks`).
    fn blocks(&self) -> usize;

    /// The request of `blocks` went to `rank`, which computes them now: a
    /// ticket that credits them to `rank` until dropped (at the request's
    /// first token), for sources that only learn of blocks once computed.
    fn in_flight(&self, _rank: WorkerWithDpRank, _blocks: &PromptBlocks) -> Option<InFlightTicket> {
        None
    }

    /// `worker` refused a connection: what it held is unknown now (an
    /// engine that died lost its cache; one that restarts tells again).
    /// The default keeps what the source holds.
    fn unreachable(&self, _worker: crate::WorkerId) {}

    /// The block size the source counts overlaps in, if it has one:
    /// [`RouterCore::with_overlaps`](super::RouterCore::with_overlaps)
    /// refuses a source of another block size than the service's. The
    /// default, `None`, is not checked.
    fn block_size(&self) -> Option<u32> {
        None
    }
}

/// The most requests whose prompts are credited to their ranks while
/// they prefill ([`InFlight`]); past it, the oldest stops counting.
pub const MAX_IN_FLIGHT_CREDITED: usize = 256;

/// Prompts being prefilled, each credited to the rank computing it: an
/// engine reports a block only once computed, so without this, requests
/// sharing a prefix that arrive together are spread before the first one's
/// blocks are reported. Bounded by [`MAX_IN_FLIGHT_CREDITED`].
#[derive(Default)]
pub struct InFlight {
    inner: Mutex<InFlightInner>,
}

#[derive(Default)]
struct InFlightInner {
    next_id: u64,
    /// (id, rank, the prompt's block sequence hashes), oldest first.
    entries: VecDeque<(u64, WorkerWithDpRank, Box<[u64]>)>,
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, InFlightInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Credits `sequence` to `rank` until the ticket is dropped.
    pub fn begin(self: &std::sync::Arc<Self>, rank: WorkerWithDpRank, sequence: &[u64]) -> Option<InFlightTicket> {
        if sequence.is_empty() {
            return None;
        }
        let mut l = self.lock();
        let id = l.next_id;
        l.next_id += 1;
        if l.entries.len() >= MAX_IN_FLIGHT_CREDITED {
            l.entries.pop_front();
        }
        l.entries.push_back((id, rank, sequence.into()));
        Some(InFlightTicket { set: self.clone(), id })
    }

    /// Per rank, the most leading blocks of `sequence` that a prompt being
    /// prefilled there shares.
    pub fn credits(&self, sequence: &[u64]) -> Vec<(WorkerWithDpRank, u32)> {
        let l = self.lock();
        let mut out: Vec<(WorkerWithDpRank, u32)> = Vec::new();
        for (_, rank, blocks) in &l.entries {
            let shared = blocks.iter().zip(sequence).take_while(|(a, b)| a == b).count() as u32;
            if shared == 0 {
                continue;
            }
            match out.iter_mut().find(|(r, _)| r == rank) {
                Some((_, n)) => *n = (*n).max(shared),
                None => out.push((*rank, shared)),
            }
        }
        out
    }

    /// Prompts credited now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether no prompt is credited.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A prompt credited to its rank while it prefills; the credit ends when
/// this is dropped.
pub struct InFlightTicket {
    set: std::sync::Arc<InFlight>,
    id: u64,
}

impl Drop for InFlightTicket {
    fn drop(&mut self) {
        let mut l = self.set.lock();
        if let Some(i) = l.entries.iter().position(|(id, _, _)| *id == self.id) {
            l.entries.remove(i);
        }
    }
}

/// The router's own decisions as cache overlaps: an [`ApproxKvIndex`]
/// behind a lock, bounded (see the module docs).
pub struct LearnedOverlaps {
    inner: Mutex<Learned>,
    ttl: Duration,
    max_blocks: usize,
}

struct Learned {
    index: ApproxKvIndex,
    /// Blocks queued for expiry, per second of recording.
    queued: VecDeque<(Instant, usize)>,
    queued_total: usize,
}

impl LearnedOverlaps {
    /// Blocks of `block_size` tokens, each record forgotten after `ttl`, at
    /// most `max_blocks` held and `max_blocks` queued.
    pub fn new(block_size: u32, ttl: Duration, max_blocks: usize) -> Self {
        LearnedOverlaps {
            inner: Mutex::new(Learned {
                index: ApproxKvIndex::new(block_size).with_ttl(ttl),
                queued: VecDeque::new(),
                queued_total: 0,
            }),
            ttl,
            max_blocks,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Learned> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl OverlapSource for LearnedOverlaps {
    fn overlaps<'o>(
        &self,
        service: &WorkerSelectionService,
        sequence: &[u64],
        out: &'o mut KvOverlaps,
    ) -> Option<RowOverlaps<'o>> {
        let mut l = self.lock();
        // A source of another block size than the service's has no
        // overlaps for it (`RouterCore::with_overlaps` refuses it).
        l.index
            .sync_rows(service.row_layout(), |rank| service.row_of(rank))
            .ok()?;
        l.index.overlaps(sequence, out, Instant::now()).ok()
    }

    fn chosen(&self, rank: WorkerWithDpRank, blocks: &PromptBlocks, held: usize) -> Recorded {
        if blocks.local.is_empty() || held >= blocks.local.len() {
            return Recorded::Unneeded;
        }
        let now = Instant::now();
        let mut l = self.lock();
        l.index.expire(now);
        while let Some(&(at, n)) = l.queued.front() {
            if now.duration_since(at) < self.ttl {
                break;
            }
            l.queued.pop_front();
            l.queued_total -= n;
        }
        let n = blocks.local.len();
        if l.index.recorded_blocks().saturating_add(n) > self.max_blocks
            || l.queued_total.saturating_add(n) > self.max_blocks
        {
            return Recorded::Full;
        }
        l.index.record(rank, &blocks.local, now);
        match l.queued.back_mut() {
            Some((at, count)) if now.duration_since(*at) < Duration::from_secs(1) => *count += n,
            _ => l.queued.push_back((now, n)),
        }
        l.queued_total += n;
        Recorded::Yes
    }

    fn blocks(&self) -> usize {
        self.lock().index.recorded_blocks()
    }

    fn block_size(&self) -> Option<u32> {
        Some(self.lock().index.block_size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvRouterConfig, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerType};

    fn blocks(n: usize) -> PromptBlocks {
        let local: Vec<u64> = (1..=n as u64).collect();
        let mut sequence = Vec::new();
        crate::kv_index::sequence_hashes_of(&local, &mut sequence);
        PromptBlocks {
            tokens: n * 16,
            local,
            sequence,
        }
    }

    #[test]
    fn learns_holds_and_stays_bounded() {
        let service = WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig::default(),
        );
        service.add_worker(WorkerRecord::new(1)).unwrap();
        let rank = WorkerWithDpRank::new(1, 0);
        let source = LearnedOverlaps::new(16, Duration::from_secs(60), 10);
        let b = blocks(4);
        assert_eq!(source.chosen(rank, &b, 0), Recorded::Yes);
        let mut out = KvOverlaps::new();
        let o = source.overlaps(&service, &b.sequence, &mut out).unwrap();
        assert_eq!(o.device_blocks[service.row_of(rank).unwrap()], 4.0);
        assert_eq!(
            source.chosen(rank, &b, 4),
            Recorded::Unneeded,
            "held whole: not queued again"
        );
        // A longer prompt sharing the prefix is recorded; the queue counts
        // its 6 blocks (4 + 6 = 10, the bound).
        assert_eq!(source.chosen(rank, &blocks(6), 4), Recorded::Yes);
        assert_eq!(source.blocks(), 6);
        // The queue is at the bound though the index holds 6: refused.
        assert_eq!(source.chosen(rank, &blocks(7), 6), Recorded::Full);
        assert_eq!(source.blocks(), 6);
    }
}
