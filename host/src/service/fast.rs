//! The fast path of a plain selection: a request with no pin, session,
//! constraint, explanation or preview, under a built-in policy other than
//! direct, on a snapshot whose ready rows are exactly its live rows.
//! Random, round-robin and power-of-two draw from the ready rows in O(1);
//! the other policies read the snapshot's ready mask as it is; the row is
//! booked directly. It chooses what the general path (`run`) would, from
//! the same random numbers, and hands a refused booking back to it. It
//! must not filter, rescan or build an explanation's runner-up.

use std::ops::Deref;

use selkie_kernel::fleet::Booking;
use selkie_kernel::{mask, Rng};

use super::run::{refused, Plan, RngSlot};
use super::selection::{Booked, FleetHandle};
use super::WorkerSelectionService;
use crate::discovery::registry::WorkerRegistry;
use crate::error::SelectionError;
use crate::explain::Route;
use crate::plugin::WorkerSelectionContext;
use crate::policy::scratch::with_scratch;
use crate::policy::{draw_ready, Choice, Env, ReadyRows};
use crate::request::SelectionRequest;

/// How the fast path ended when it booked nothing.
pub(super) enum Fallback {
    /// The booking at this row was refused: the general path runs without
    /// it.
    Refused(usize),
    /// The policy failed (as it would on the general path).
    Failed(SelectionError),
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
    /// `None`: not such a request (the general path runs).
    #[inline(always)]
    pub(super) fn select_ready<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        plan: Plan,
        rng: &mut impl RngSlot,
        handle: impl Fn() -> H + Copy,
        traced: bool,
    ) -> Option<Result<Booked<H>, Fallback>> {
        if !plan.ready || !reg.ready_exact() {
            return None;
        }
        let (_, list) = reg.ready_rows();
        let rows = reg.scan_rows();
        #[cfg(test)]
        super::tests::hooks::after_rows_read(rows);
        let view = self.fleet.view(rows);
        let drawn = match self.ready_rows {
            ReadyRows::Draw(draw) => draw_ready(draw, reg, &self.fleet, &view, list, rng),
            _ => None,
        };
        let choice = match drawn {
            Some(choice) => choice,
            None => match self.choose_on_ready(reg, *req, rng.rng(self), list, rows) {
                Ok(choice) => choice,
                Err(e) => return Some(Err(Fallback::Failed(e))),
            },
        };
        let meta = reg.row(choice.row)?;
        let load = match plan.load {
            Some(load) => load,
            None => self.book_row_load(*req, choice.row, meta.worker()),
        };
        match Booking::new_for_slot(FleetHandle(handle()), meta.handle.slot, load) {
            Ok(booking) => Some(Ok(self.booked(booking, &choice, None, meta, Route::Policy, traced))),
            Err(e) => {
                refused(&self.rejections, &e);
                Some(Err(Fallback::Refused(choice.row)))
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
