//! Running a model, counting its interleavings, and expecting a broken
//! variant to fail.

use selkie_kernel::fleet::{BookLoad, Outstanding, WorkerSpec};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A loom builder with the environment's settings, and a preemption bound
/// of 2 unless `LOOM_MAX_PREEMPTIONS` says otherwise.
fn builder() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(2);
    }
    builder
}

/// Runs `model` in every interleaving loom explores; a failing assertion
/// fails the test. Returns (and prints) the number of interleavings.
pub fn explore<M: Fn() + Sync + Send + 'static>(name: &str, model: M) -> usize {
    let count = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&count);
    builder().check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        model();
    });
    let n = count.load(Ordering::Relaxed);
    println!("loom model {name}: passed all {n} interleavings");
    n
}

/// Runs `model` with a broken variant and asserts that some interleaving
/// fails, and fails as expected: the panic's message must contain
/// `expected` (a model assertion's message, or loom's own report such as
/// `Causality violation`), so a model that breaks for another reason (a
/// typo, an unwrap, a deadlock) does not pass as catching the fault.
/// Returns (and prints) the number of interleavings explored up to and
/// including the failing one.
pub fn expect_violation<M: Fn() + Sync + Send + 'static>(name: &str, expected: &str, model: M) -> usize {
    let count = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&count);
    let result = catch_unwind(AssertUnwindSafe(|| {
        builder().check(move || {
            counter.fetch_add(1, Ordering::Relaxed);
            model();
        })
    }));
    let n = count.load(Ordering::Relaxed);
    let Err(panic) = result else {
        panic!("loom model {name}: the broken variant passed all {n} interleavings; the model cannot catch it");
    };
    let message = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(non-string panic)");
    assert!(
        message.contains(expected),
        "loom model {name}: the broken variant failed after {n} interleavings, but not as expected \
         (a message containing {expected:?}): {message}"
    );
    println!("loom model {name}: broken variant caught after {n} interleavings: {message}");
    n
}

/// A worker with an admission limit.
pub fn worker(id: u64, admission_limit: u32) -> WorkerSpec {
    WorkerSpec {
        admission_limit,
        ..WorkerSpec::new(id)
    }
}

/// A load of `prefill_tokens` tokens and `decode_blocks` blocks.
pub fn load(prefill_tokens: u32, decode_blocks: u32) -> BookLoad {
    BookLoad {
        prefill_tokens,
        decode_blocks,
    }
}

/// `Outstanding` from its three values.
pub fn held(requests: u32, prefill_tokens: u32, decode_blocks: u32) -> Outstanding {
    Outstanding {
        requests,
        prefill_tokens,
        decode_blocks,
    }
}
