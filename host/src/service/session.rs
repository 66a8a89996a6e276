//! Session affinity: which worker rank each live session is bound to, with
//! an idle timeout.
//!
//! The table is consulted only for requests that carry a session, under a
//! mutex held for one hash lookup; requests without a session never touch
//! it. Expired entries are dropped on lookup and swept every so often.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::types::WorkerWithDpRank;

struct Entry {
    worker: WorkerWithDpRank,
    last_used: Instant,
}

pub(crate) struct SessionTable {
    map: Mutex<HashMap<String, Entry>>,
    idle_timeout: Duration,
}

impl SessionTable {
    pub(crate) fn new(idle_timeout: Duration) -> Self {
        SessionTable {
            map: Mutex::new(HashMap::new()),
            idle_timeout,
        }
    }

    /// The session's worker, if bound and not idle past the timeout.
    pub(crate) fn get(&self, id: &str, now: Instant) -> Option<WorkerWithDpRank> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let e = map.get(id)?;
        if now.saturating_duration_since(e.last_used) > self.idle_timeout {
            map.remove(id);
            return None;
        }
        Some(e.worker)
    }

    /// Binds (or re-binds) a session and refreshes its idle clock.
    pub(crate) fn bind(&self, id: &str, worker: WorkerWithDpRank, now: Instant) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = map.get_mut(id) {
            e.worker = worker;
            e.last_used = now;
            return;
        }
        if map.len() >= 1024 && map.len().is_power_of_two() {
            let timeout = self.idle_timeout;
            map.retain(|_, e| now.saturating_duration_since(e.last_used) <= timeout);
        }
        map.insert(id.to_owned(), Entry { worker, last_used: now });
    }

    /// Forgets a session.
    pub(crate) fn end(&self, id: &str) -> bool {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id)
            .is_some()
    }

    /// Drops every session idle past the timeout; returns how many remain.
    pub(crate) fn expire(&self, now: Instant) -> usize {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let timeout = self.idle_timeout;
        map.retain(|_, e| now.saturating_duration_since(e.last_used) <= timeout);
        map.len()
    }
}
