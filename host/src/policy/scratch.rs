//! Per-thread scratch memory for the selection path, so a selection
//! allocates nothing once a thread has served its first request.
//!
//! Each thread keeps one [`Scratch`]: the eligibility mask, helper masks and
//! every per-row column a policy fills (costs, overlaps, taint multipliers,
//! per-worker load sums, custom-policy candidate tables). Buffers only grow.
//! A re-entrant selection (a plugin that calls the service) gets a fresh,
//! temporary scratch instead of a panic.
//!
//! The policies own these buffers (they are what the policies fill); the
//! service only fetches a thread's scratch and passes it down. This module
//! holds memory and nothing else: it must not select, filter or book, and it
//! names nothing above the policies.

use std::cell::RefCell;

use selkie_kernel::kernels::keyed::clear_column;
use selkie_kernel::mask::words_for;

use crate::plugin::{CandidateData, ScoredWorkerCandidate, WorkerCacheInput, WorkerLoadInput};

/// Per-row overlap columns for one request: zero outside what the last
/// scatter wrote (its `touched` rows, or its first `dirty` rows).
#[derive(Default)]
pub(crate) struct OverlapColumns {
    pub(crate) device: Vec<f32>,
    pub(crate) host: Vec<f32>,
    pub(crate) disk: Vec<f32>,
    pub(crate) shared: Vec<f32>,
    pub(crate) cached_tokens: Vec<f32>,
    /// The rows written, when the scatter kept a list (few entries against
    /// the rows).
    pub(crate) touched: Vec<u32>,
    /// Rows to clear whole, when the scatter kept no list.
    pub(crate) dirty: usize,
    /// Whether any row got a non-zero host / disk / shared value (the
    /// other columns are then all zero and skipped).
    pub(crate) any_host: bool,
    pub(crate) any_disk: bool,
    pub(crate) any_shared: bool,
    /// Whether any entry had a lower tier (those rows were written in all
    /// three lower columns).
    pub(crate) any_lower: bool,
}

impl OverlapColumns {
    /// A scatter keeps a list of the rows it writes only when it has fewer
    /// than one entry per this many rows: clearing a row from the list
    /// costs about as much as clearing 16 rows of two columns whole.
    pub(crate) const CLEAR_RATIO: usize = 16;

    fn grow(&mut self, rows: usize) {
        for c in [
            &mut self.device,
            &mut self.host,
            &mut self.disk,
            &mut self.shared,
            &mut self.cached_tokens,
        ] {
            if c.len() < rows {
                c.resize(rows, 0.0);
            }
        }
    }

    /// Zeroes what the last scatter wrote.
    pub(crate) fn reset(&mut self) {
        let n = self.dirty;
        clear_column(&mut self.device[..n]);
        clear_column(&mut self.cached_tokens[..n]);
        for &r in &self.touched {
            let r = r as usize;
            self.device[r] = 0.0;
            self.cached_tokens[r] = 0.0;
        }
        if self.any_lower {
            clear_column(&mut self.host[..n]);
            clear_column(&mut self.disk[..n]);
            clear_column(&mut self.shared[..n]);
            for &r in &self.touched {
                let r = r as usize;
                (self.host[r], self.disk[r], self.shared[r]) = (0.0, 0.0, 0.0);
            }
        }
        self.touched.clear();
        self.dirty = 0;
        (self.any_host, self.any_disk, self.any_shared, self.any_lower) = (false, false, false, false);
    }
}

/// SplitMix64's finaliser (the kernel's): spreads a seed over every bit.
pub(crate) use selkie_kernel::rng::mix;

/// The thread's random generator for services without a seed: seeded
/// from the clock and a process-wide counter (two threads started in the
/// same nanosecond still differ) on the thread's first selection; later
/// selections take it and put it back, one thread-local read and write
/// each. A re-entrant selection (a plugin that selects) finds it taken and
/// seeds its own.
pub(crate) mod thread_rng {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};

    use selkie_kernel::Rng;

    thread_local! {
        static RNG: Cell<Option<Rng>> = const { Cell::new(None) };
    }

    fn seeded() -> Rng {
        static THREAD_SEEDS: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Rng::new(super::mix(
            t ^ THREAD_SEEDS.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed),
        ))
    }

    /// The thread's generator (seeded now if the thread has none).
    #[inline]
    pub(crate) fn take() -> Rng {
        RNG.with(Cell::take).unwrap_or_else(seeded)
    }

    /// Gives the generator back to the thread.
    #[inline]
    pub(crate) fn put(rng: Rng) {
        RNG.with(|c| c.set(Some(rng)));
    }
}

/// Reusable buffers for one thread's selections.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) mask: Vec<u64>,
    pub(crate) aux: Vec<u64>,
    pub(crate) aux2: Vec<u64>,
    /// The eligible rows beyond a soft session's row, kept for the fallback.
    pub(crate) rest: Vec<u64>,
    pub(crate) costs: Vec<f32>,
    pub(crate) taint: Vec<f32>,
    pub(crate) sums: Vec<u32>,
    pub(crate) overlap: OverlapColumns,
    pub(crate) candidates: Vec<CandidateData>,
    pub(crate) filtered: Vec<CandidateData>,
    pub(crate) total: Vec<f64>,
    pub(crate) contrib: Vec<f64>,
    /// An explained composed choice's contributions, scorer by scorer
    /// (`scorer * candidates + candidate`).
    pub(crate) terms: Vec<f64>,
    /// The last explained choice's cost terms (`WorkerSelectionPolicy::terms`).
    pub(crate) explained: Option<crate::explain::Terms>,
    pub(crate) scored: Vec<ScoredWorkerCandidate>,
    pub(crate) loads: Vec<WorkerLoadInput>,
    pub(crate) caches: Vec<WorkerCacheInput>,
    /// A request's per-rank inputs as columns (`rank_inputs`): grown on
    /// first use, only for requests that carry them.
    pub(crate) added: Vec<u32>,
    pub(crate) observed: Vec<u64>,
    pub(crate) shared_hits: Vec<f32>,
    /// Rows every buffer covers already (they only grow).
    prepared: usize,
}

impl Scratch {
    /// Makes every buffer cover `rows` rows.
    pub(crate) fn prepare(&mut self, rows: usize) {
        let words = words_for(rows);
        // The mask leaves the scratch during a selection: checked too, so
        // a selection that unwound without putting it back cannot leave it
        // short.
        if rows <= self.prepared && self.mask.len() >= words {
            return;
        }
        self.prepared = self.prepared.max(rows);
        for m in [&mut self.mask, &mut self.aux, &mut self.aux2, &mut self.rest] {
            if m.len() < words {
                m.resize(words, 0);
            }
        }
        for c in [&mut self.costs, &mut self.taint] {
            if c.len() < rows {
                c.resize(rows, 0.0);
            }
        }
        if self.sums.len() < rows {
            self.sums.resize(rows, 0);
        }
        self.overlap.grow(rows);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch (a temporary one if it is in use).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}
