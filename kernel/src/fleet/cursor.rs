//! The round-robin cursor: a cache-padded ticket counter.
//!
//! Each selection takes a ticket with one `fetch_add`, so concurrent callers
//! always get distinct, consecutive tickets; the round-robin kernel maps
//! ticket `t` to the `t mod n`-th of the `n` eligible rows, so over any `n`
//! consecutive tickets (with an unchanged eligible set) each worker is chosen
//! exactly once. A preview reads the counter without advancing it.
//!
//! The counter is 32 bits (the kernel uses only 32-bit atomics) and wraps
//! after 2^32 tickets; unless `n` divides 2^32, the round in which it wraps is
//! uneven once (one worker is chosen one time fewer or more).
//!
//! This module must not choose rows: the kernel does.

use super::Fleet;
use crate::sync::Ordering;

impl<const GROUPS: usize> Fleet<GROUPS> {
    /// Takes the next round-robin ticket (for a selection that books).
    #[inline]
    pub fn next_ticket(&self) -> u32 {
        #[cfg(selkie_loom)]
        if self.fault == super::fault::Fault::TicketLoadThenStore {
            let t = self.ticket.load(Ordering::Relaxed);
            self.ticket.store(t.wrapping_add(1), Ordering::Relaxed);
            return t;
        }
        self.ticket.fetch_add(1, Ordering::Relaxed)
    }

    /// The ticket the next selection will get, without taking it (for a
    /// preview: does not advance the cursor).
    #[inline]
    pub fn peek_ticket(&self) -> u32 {
        #[cfg(selkie_loom)]
        if self.fault == super::fault::Fault::PeekAdvances {
            return self.ticket.fetch_add(1, Ordering::Relaxed);
        }
        self.ticket.load(Ordering::Relaxed)
    }
}
