//! The fast path of a plain selection: a request with no pin, session,
//! constraint, explanation or preview, under a built-in policy other than
//! direct, on a snapshot whose ready rows are exactly its live rows.
//! Random, round-robin and power-of-two draw from the ready rows in O(1)
//! (a draw that cannot be made there, with no ready row or power-of-two
//! on ranks, is the general path's); the other policies read the
//! snapshot's ready mask as it is; the row is booked directly. It chooses
//! what the general path (`run`) would, from the same random numbers, and
//! hands a refused booking back to it. It must not filter, rescan or
//! build an explanation's runner-up.

use std::ops::Deref;

use selkie_kernel::fleet::Booking;
use selkie_kernel::{mask, Rng};

use super::run::{refused, why, Plan, RngSlot};
use super::selection::{Booked, FleetHandle};
use super::WorkerSelectionService;
use crate::discovery::registry::WorkerRegistry;
use crate::error::SelectionError;
use crate::explain::Route;
use crate::plugin::WorkerSelectionContext;
use crate::policy::scratch::with_scratch;
use crate::policy::{draw_ready, Choice, Drawn, Env, ReadyRows};
use crate::request::SelectionRequest;

/// How the fast path ended when it booked nothing.
pub(super) enum Fallback {
    /// The booking at this row was refused: the general path runs without
    /// it.
    Refused(usize),
    /// The policy failed (as it would on the general path).
    Failed(SelectionError),
}

/// How the fast path came to its row.
enum Pick {
    /// Drawn from the ready list in O(1).
    Drawn(Drawn),
    /// Chosen by the policy's scan of the ready mask.
    Chosen(Choice),
}

impl WorkerSelectionService {
    /// The fast path of a plain selection: no pin, session, constraint,
    /// explanation or preview, under a built-in policy, on a snapshot whose
    /// ready rows are exactly its live rows (no overload mark, no busy
    /// threshold). Random, round-robin and power-of-two draw from the ready
    /// rows in O(1); the other policies read the snapshot's ready mask as
    /// it is (no copy). The row is booked directly: the same row, from the
    /// same random numbers, as the general path (`Some(Ok(..))`).
    ///
    /// `ready` is the policy's [`ReadyRows`], a constant where the caller
    /// matched it. `None`: not such a request, or a draw the general path
    /// makes (the general path runs).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select_ready<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        plan: Plan,
        ready: ReadyRows,
        rng: &mut impl RngSlot,
        handle: impl Fn() -> H + Copy,
        traced: bool,
    ) -> Option<Result<Booked<H>, Fallback>> {
        if ready == ReadyRows::No || !plan.ready || !reg.ready_exact() {
            return None;
        }
        let (_, list) = reg.ready_rows();
        let rows = reg.scan_rows();
        #[cfg(test)]
        super::tests::hooks::after_rows_read(rows);
        let view = self.fleet.view(rows);
        // A drawn row's cost is the load its booking found (see
        // `Drawn::why`).
        let (row, pick) = match ready {
            ReadyRows::Draw(draw) => {
                let drawn = draw_ready(draw, reg, &self.fleet, &view, list, rng)?;
                (drawn.row, Pick::Drawn(drawn))
            }
            _ => match self.choose_on_ready(reg, *req, rng.rng(self), list, rows) {
                Ok(choice) => (choice.row, Pick::Chosen(choice)),
                Err(e) => return Some(Err(Fallback::Failed(e))),
            },
        };
        let meta = reg.row(row)?;
        let load = match plan.load {
            Some(load) => load,
            None => {
                let cached = match &pick {
                    Pick::Chosen(choice) => choice.cached_tokens.get(),
                    Pick::Drawn(_) => None,
                };
                self.book_row_load(*req, row, cached, meta.worker())
            }
        };
        match Booking::new_for_slot_with_active(FleetHandle(handle()), meta.handle.slot, load) {
            Ok((booking, found)) => Some(Ok(match pick {
                Pick::Drawn(drawn) => self.booked_why(booking, drawn.why(found), meta, traced),
                Pick::Chosen(choice) => self.booked_why(booking, why(&choice, None, Route::Policy, 0), meta, traced),
            })),
            Err(e) => {
                refused(&self.rejections, &e);
                Some(Err(Fallback::Refused(row)))
            }
        }
    }

    /// The fast path's choice for the policies that scan: the policy reads
    /// the snapshot's ready mask (and list) as the eligible rows. Out of
    /// line, and the mask's words taken here, so the O(1) draws stay
    /// short; the request by value (see `written` in `run`).
    #[inline(never)]
    fn choose_on_ready(
        &self,
        reg: &WorkerRegistry,
        req: SelectionRequest<'_>,
        rng: &mut Rng,
        list: &[u32],
        rows: usize,
    ) -> Result<Choice, SelectionError> {
        let ready = &reg.ready_rows().0[..mask::words_for(rows)];
        let ctx = WorkerSelectionContext {
            request: &req,
            block_size: self.config.block_size,
            worker_type: self.policy.worker_type,
            preview: false,
        };
        with_scratch(|s| {
            s.prepare(rows);
            let env = Env {
                reg,
                fleet: &self.fleet,
                mask: ready,
                list: Some(list),
                view: self.fleet.view(rows),
                req: &req,
                ctx: &ctx,
                rows,
                pinned: false,
                explain: false,
            };
            self.policy.choose(&env, s, rng)
        })
    }
}
