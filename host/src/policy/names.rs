//! The names of composed policies built without one: derived from their
//! parts, `scorer+scorer/picker` (the picker's name alone without
//! scorers), and kept for the life of the process, since explanations,
//! metrics and logs hold a policy's name as a `&'static str`.
//!
//! Each distinct name is stored once and reused by every policy that
//! derives it. At most [`MAX_DERIVED_NAMES`](crate::WorkerSelectionPolicy::MAX_DERIVED_NAMES)
//! are stored: a policy that would derive one more is named
//! [`FALLBACK`] instead (and a warning is logged), so a program that builds
//! ever new compositions does not grow without bound.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};

/// The name of a composed policy whose derived name is past the bound.
pub(crate) const FALLBACK: &str = "composed";

static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

/// The name of a composition of `scorers` and `picker`.
pub(crate) fn derived<'a>(scorers: impl IntoIterator<Item = &'a str>, picker: &str) -> &'static str {
    let mut name = scorers.into_iter().collect::<Vec<_>>().join("+");
    if !name.is_empty() {
        name.push('/');
    }
    name.push_str(picker);
    intern(name, crate::WorkerSelectionPolicy::MAX_DERIVED_NAMES)
}

/// `name`, stored once; [`FALLBACK`] when `limit` names are stored already.
fn intern(name: String, limit: usize) -> &'static str {
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&kept) = names.get(name.as_str()) {
        return kept;
    }
    if names.len() >= limit {
        tracing::warn!(
            name,
            limit,
            fallback = FALLBACK,
            "too many derived policy names: this policy is named by the fallback"
        );
        return FALLBACK;
    }
    let kept: &'static str = Box::leak(name.into_boxed_str());
    names.insert(kept);
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_kept_once_and_bounded() {
        assert_eq!(derived(["prefill", "decode"], "argmin"), "prefill+decode/argmin");
        assert_eq!(derived([], "softmax"), "softmax");
        let a = derived(["x-names-test"], "p");
        assert!(std::ptr::eq(a, derived(["x-names-test"], "p")), "stored once");
        let stored = NAMES.lock().unwrap().len();
        // At the bound: a new name falls back, a stored one is still found.
        assert_eq!(intern("x-names-test-new".into(), stored), FALLBACK);
        assert!(std::ptr::eq(intern("x-names-test/p".into(), stored), a));
    }
}
