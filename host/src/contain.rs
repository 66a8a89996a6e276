//! Containing panics from code the host does not control (plugins,
//! discovery sources, metrics recorders): a panic becomes a message, and
//! nothing of it, not even a payload whose own `Drop` panics, unwinds past
//! the caller. This module must not know what it runs.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f`; a panic becomes `Err(message)`. A payload whose own `Drop`
/// panics is dropped under a second guard, and a payload of *that* panic is
/// leaked rather than dropped.
pub(crate) fn contain_message<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_owned());
        drop_quietly(payload);
        message
    })
}

/// Runs `f`, turning a panic into `None` (see [`contain_message`]).
pub(crate) fn contain<T>(f: impl FnOnce() -> T) -> Option<T> {
    contain_message(f).ok()
}

/// Drops a panic payload; a panic from its `Drop` is caught, and that
/// panic's own payload leaked.
pub(crate) fn drop_quietly(payload: Box<dyn std::any::Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}
