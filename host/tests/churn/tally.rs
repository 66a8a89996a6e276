//! What one thread of a churn run saw: calls, errors (legitimate under
//! churn or not), caught panics and broken invariants, each with a first
//! example. Threads never assert (a panicking thread would leave the others
//! waiting at a barrier): they tally, and the test asserts on the merged
//! tally after joining them.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

/// Threads whose panics the hook records instead of printing.
pub const THREAD_PREFIX: &str = "churn-";

thread_local! {
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Installs (once) a panic hook that, on the test's own worker threads,
/// remembers the message and location for [`Tally::call`] instead of
/// printing thousands of backtraces; other threads panic as usual.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with(THREAD_PREFIX));
            if !ours {
                return default(info);
            }
            let payload = info.payload();
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(non-string payload)".into());
            let at = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            LAST_PANIC.with(|p| *p.borrow_mut() = format!("{msg} (at {at})"));
        }));
    });
}

/// Counts per key, with the first example of each.
#[derive(Default)]
pub struct Counted {
    pub counts: BTreeMap<String, u64>,
    pub examples: BTreeMap<String, String>,
}

impl Counted {
    pub fn add(&mut self, key: &str, example: impl FnOnce() -> String) {
        *self.counts.entry(key.to_owned()).or_default() += 1;
        if !self.examples.contains_key(key) {
            self.examples.insert(key.to_owned(), example());
        }
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    fn merge(&mut self, other: Counted) {
        for (k, n) in other.counts {
            *self.counts.entry(k).or_default() += n;
        }
        for (k, e) in other.examples {
            self.examples.entry(k).or_insert(e);
        }
    }

    /// One line per key: count, then the first example.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for (k, n) in &self.counts {
            let _ = writeln!(s, "    {n:>7} x {k}: e.g. {}", self.examples[k]);
        }
        s
    }
}

/// One thread's (or the merged) record of a run.
#[derive(Default)]
pub struct Tally {
    /// Successful calls, by operation.
    pub ok: BTreeMap<&'static str, u64>,
    /// Errors that churn explains, by `op: reason`.
    pub legit: BTreeMap<String, u64>,
    /// Errors that churn does not explain, by `op: reason`.
    pub illegit: Counted,
    /// Panics caught in library calls, by operation.
    pub panics: Counted,
    /// Broken invariants (admission, ledger, leaks, results), by check.
    pub violations: Counted,
    /// Admission checks made, and how many saw a rank exactly at its limit.
    pub admission_checks: u64,
    pub at_limit: u64,
}

impl Tally {
    /// Runs one library call, catching a panic (counted under `op`).
    pub fn call<R>(&mut self, op: &'static str, context: impl FnOnce() -> String, f: impl FnOnce() -> R) -> Option<R> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => Some(r),
            Err(_) => {
                let msg = LAST_PANIC.with(|p| std::mem::take(&mut *p.borrow_mut()));
                self.panics.add(op, || format!("{msg}; {}", context()));
                None
            }
        }
    }

    pub fn ok(&mut self, op: &'static str) {
        *self.ok.entry(op).or_default() += 1;
    }

    /// Records an error, legitimate under churn or not.
    pub fn error(&mut self, op: &'static str, reason: &str, legit: bool, example: impl FnOnce() -> String) {
        let key = format!("{op}: {reason}");
        if legit {
            *self.legit.entry(key).or_default() += 1;
        } else {
            self.illegit.add(&key, example);
        }
    }

    pub fn merge(&mut self, other: Tally) {
        for (k, n) in other.ok {
            *self.ok.entry(k).or_default() += n;
        }
        for (k, n) in other.legit {
            *self.legit.entry(k).or_default() += n;
        }
        self.illegit.merge(other.illegit);
        self.panics.merge(other.panics);
        self.violations.merge(other.violations);
        self.admission_checks += other.admission_checks;
        self.at_limit += other.at_limit;
    }

    /// The whole record, for `--nocapture` runs and failure messages.
    pub fn render(&self, policy: &str) -> String {
        let mut s = format!("policy {policy}:\n  calls that succeeded: {:?}\n", self.ok);
        let _ = writeln!(s, "  errors churn explains: {:?}", self.legit);
        let _ = writeln!(
            s,
            "  admission checks: {} ({} saw a rank at its limit)",
            self.admission_checks, self.at_limit
        );
        let _ = write!(
            s,
            "  errors churn does not explain ({}):\n{}",
            self.illegit.total(),
            self.illegit.render()
        );
        let _ = write!(
            s,
            "  panics caught ({}):\n{}",
            self.panics.total(),
            self.panics.render()
        );
        let _ = write!(
            s,
            "  broken invariants ({}):\n{}",
            self.violations.total(),
            self.violations.render()
        );
        s
    }
}
