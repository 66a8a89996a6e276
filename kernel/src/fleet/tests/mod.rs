//! Unit tests of the fleet: every operation and every error, single-threaded
//! (`ops`, `reads`, `booking`, `select`, `remote`), and small concurrent tests that miri runs
//! (`concurrent`).

mod booking;
mod concurrent;
mod ops;
mod reads;
mod remote;
mod select;

use super::*;

/// A worker with an admission limit.
pub(super) fn worker(id: u64, limit: u32) -> WorkerSpec {
    WorkerSpec {
        admission_limit: limit,
        ..WorkerSpec::new(id)
    }
}

/// A load of `tokens` prefill tokens and `blocks` decode blocks.
pub(super) fn load(tokens: u32, blocks: u32) -> BookLoad {
    BookLoad {
        prefill_tokens: tokens,
        decode_blocks: blocks,
    }
}

/// The counters of `row`.
pub(super) fn out<const G: usize>(fleet: &Fleet<G>, row: u32) -> Outstanding {
    fleet.outstanding(row as usize).unwrap()
}

/// `Outstanding` from its three values.
pub(super) fn held(requests: u32, prefill_tokens: u32, decode_blocks: u32) -> Outstanding {
    Outstanding {
        requests,
        prefill_tokens,
        decode_blocks,
    }
}

/// Asserts every row's counters are zero.
pub(super) fn assert_all_released<const G: usize>(fleet: &Fleet<G>) {
    for row in 0..Fleet::<G>::CAPACITY {
        assert_eq!(fleet.outstanding(row), Some(Outstanding::default()), "row {row}");
    }
}
