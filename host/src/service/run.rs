//! One selection, start to finish: session affinity, hard filters, the
//! policy, and booking with bounded rescans.
//!
//! A plain request (no pin, session, constraint, explanation or preview)
//! under a built-in policy first takes the fast path (`fast`); a booking
//! it is refused continues here without that row. Tracing costs one level check when
//! debug logging is off.
//!
//! Runs on the thread's registry snapshot and scratch; allocates nothing
//! with the built-in policies once the thread is warm.

use std::ops::Deref;
use std::sync::atomic::Ordering;
use std::time::Instant;

use selkie_kernel::fleet::{BookError, BookLoad, Booking, SelectError, SlotPick, COUNTER_MAX};
use selkie_kernel::lanes::F32Source;
use selkie_kernel::{mask, Rng};

use super::fast::Fallback;
use super::selection::{Booked, FleetHandle, Preview};
use super::WorkerSelectionService;
use crate::discovery::registry::{RowMeta, WorkerRegistry};
use crate::discovery::WorkerState;
use crate::error::SelectionError;
use crate::explain::{Route, Why};
use crate::filter::{eligible_rows, Rejections};
use crate::fleet::FLEET_GROUPS;
use crate::plugin::WorkerSelectionContext;
use crate::policy::scratch::{mix, thread_rng, with_scratch, Scratch};
use crate::policy::{Choice, Draws, Env, ListDraw, ReadyRows};
use crate::request::{AffinityMode, Pin, SelectionRequest};
use crate::types::WorkerWithDpRank;

/// The generator of the `n`-th selection of a service whose seed mixed
/// is `base` (`seed_base`): streams `n * STREAM_STEP` apart.
/// With this step, two selections fewer than 2^48 apart never reach a
/// common generator state within 10,000 draws of each other (the test
/// `seeded_streams_stay_apart`).
#[inline(always)]
fn seeded_stream(base: u64, n: u64) -> Rng {
    Rng::new(base.wrapping_add(n.wrapping_mul(STREAM_STEP)))
}

/// How far apart the generator states of consecutive selections of a
/// seeded service start.
const STREAM_STEP: u64 = 0xD1B5_4A32_D192_ED03;

/// The base of a seeded service's streams: its seed, mixed once.
pub(super) fn seed_base(seed: u64) -> u64 {
    mix(seed)
}

/// The result an out-of-line way of a selection (the debug span, the
/// reloaded snapshot, the general path) writes to `out`, as a value.
///
/// Each such way writes to a local of its own, not to the selection's
/// return slot, and takes the request by value (a copy made on that way
/// only): with neither the slot nor the request handed to a call, the
/// fast path keeps both in registers and builds only the fields its
/// caller reads (`host_profile random 1024` 341 -> 316 instructions per
/// call).
#[inline(always)]
fn written<T>(f: impl FnOnce(&mut Option<T>)) -> T {
    let mut out = None;
    f(&mut out);
    match out {
        Some(value) => value,
        None => unreachable!("an out-of-line way of a selection wrote no result"),
    }
}

/// A selection's generator: taken before the selection starts (an
/// [`Rng`]), or only when a path first needs one ([`Untaken`]).
pub(super) trait RngSlot: Draws {
    /// The generator, taken now if it was not.
    fn rng(&mut self, service: &WorkerSelectionService) -> &mut Rng;

    /// The generator, for the general path.
    fn into_rng(self, service: &WorkerSelectionService) -> Rng;

    /// Puts a taken generator back (see `keep_rng`).
    fn keep(self, service: &WorkerSelectionService);
}

impl RngSlot for Rng {
    #[inline(always)]
    fn rng(&mut self, _: &WorkerSelectionService) -> &mut Rng {
        self
    }

    #[inline(always)]
    fn into_rng(self, _: &WorkerSelectionService) -> Rng {
        self
    }

    #[inline(always)]
    fn keep(self, service: &WorkerSelectionService) {
        service.keep_rng(self);
    }
}

/// The generator of a round-robin selection, not taken until a path needs
/// one: its fast path's draw takes no random numbers.
pub(super) struct Untaken(Option<Rng>);

impl Draws for Untaken {
    fn pick(&mut self, _list: &[u32]) -> Option<u32> {
        unreachable!("round-robin's draw takes no random numbers")
    }

    fn pick_two(&mut self, _list: &[u32]) -> Option<(u32, u32)> {
        unreachable!("round-robin's draw takes no random numbers")
    }
}

impl RngSlot for Untaken {
    fn rng(&mut self, service: &WorkerSelectionService) -> &mut Rng {
        self.0.get_or_insert_with(|| service.take_rng())
    }

    fn into_rng(self, service: &WorkerSelectionService) -> Rng {
        self.0.unwrap_or_else(|| service.take_rng())
    }

    #[inline(always)]
    fn keep(self, service: &WorkerSelectionService) {
        if let Some(rng) = self.0 {
            service.keep_rng(rng);
        }
    }
}

impl WorkerSelectionService {
    /// The request's generator: drawn from the service's seed and a
    /// counter when the service has a seed, else the thread's (one
    /// thread-local read; written back by [`keep_rng`](Self::keep_rng)).
    #[inline]
    pub(super) fn take_rng(&self) -> Rng {
        match self.seed_base {
            Some(base) => seeded_stream(base, self.seed_counter.fetch_add(1, Ordering::Relaxed)),
            None => thread_rng::take(),
        }
    }

    /// The generator the next selection on this thread would take, left
    /// where it is: a preview draws what that selection will draw (unless
    /// another selection comes first) and advances nothing.
    fn preview_rng(&self) -> Rng {
        match self.seed_base {
            Some(base) => seeded_stream(base, self.seed_counter.load(Ordering::Relaxed)),
            None => {
                let rng = thread_rng::take();
                thread_rng::put(rng.clone());
                rng
            }
        }
    }

    /// Puts the thread's generator back after a selection (unseeded
    /// services).
    #[inline]
    fn keep_rng(&self, rng: Rng) {
        if self.seed_base.is_none() {
            thread_rng::put(rng);
        }
    }

    /// A selection (`select`, `select_owned`): traced, on the thread's
    /// snapshot. Returns the booking itself, not an [`Outcome`].
    ///
    /// With the thread's snapshot in its hot entry (every selection but
    /// the first after a change of the workers), the whole fast path
    /// inlines into the caller and the selection is returned by value: no
    /// closure, no frame of its own. Errors are logged and counted where
    /// they arise. With debug logging on, the selection runs in its span,
    /// out of line: an `Option` of the span held across the selection,
    /// even `None`, cost `host_random` 13 instructions.
    #[inline(always)]
    pub(super) fn run_select<H: Deref<Target = Self>>(
        &self,
        req: &SelectionRequest<'_>,
        handle: impl Fn() -> H + Copy,
    ) -> Result<Booked<H>, SelectionError> {
        // What the selection needs of the request alone is worked out
        // before the registry's version is read: that load (`Acquire`) is
        // a barrier to the compiler, which ahead of it can still use what
        // it knows of a request built just before the call.
        if tracing::level_enabled!(tracing::Level::DEBUG) {
            // `written` spelt out: through it, this way cost the fast path
            // `host_power_of_two` 6 instructions more.
            let mut out = None;
            self.select_in_span(*req, handle, &mut out);
            return match out {
                Some(r) => r,
                None => unreachable!("the selection in a span wrote no result"),
            };
        }
        if let Err(e) = self.check_basics(req) {
            self.failed(&e);
            return Err(e);
        }
        let plan = self.plan(req);
        if let Some(hot) = self.hot_snapshot() {
            // The selection in the caller's code, on the hot entry's
            // snapshot; the way past it out of line. (Not `with_snapshot`,
            // which does the same: its closure, called at both of its
            // sites, is compiled out of line, a frame of its own.)
            self.select_on_snapshot(hot.registry(), req, handle, plan, false)
        } else {
            let req = *req;
            written(|out| {
                self.with_reloaded_snapshot(move |reg| {
                    *out = Some(self.select_on_snapshot(reg, &req, handle, plan, false))
                })
            })
        }
    }

    /// [`run_select`](Self::run_select)'s selection in a debug span,
    /// written to `out` (see [`written`]).
    #[cold]
    #[inline(never)]
    fn select_in_span<H: Deref<Target = Self>>(
        &self,
        req: SelectionRequest<'_>,
        handle: impl Fn() -> H + Copy,
        out: &mut Option<Result<Booked<H>, SelectionError>>,
    ) {
        let _span = self.span(false);
        if let Err(e) = self.check_basics(&req) {
            self.failed(&e);
            *out = Some(Err(e));
            return;
        }
        let plan = self.plan(&req);
        *out = Some(self.with_snapshot(|reg| self.select_on_snapshot(reg, &req, handle, plan, true)));
    }

    /// One selection on the thread's snapshot of a request that passed
    /// `check_basics` (`plan`: what was worked out before), an
    /// error logged and counted (`failed`): the fast path of a plain
    /// request, else (or after its refused booking) the general path on
    /// the thread's scratch. `traced`: the caller runs it in a debug span
    /// (the "selected" event is then logged; without the span debug
    /// logging was off when the selection started, and the event's level
    /// check is skipped).
    #[inline(always)]
    fn select_on_snapshot<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        handle: impl Fn() -> H + Copy,
        plan: Plan,
        traced: bool,
    ) -> Result<Booked<H>, SelectionError> {
        // The policy's way to the ready rows, matched once here: each arm
        // runs with it as a constant, so the fast path branches on it no
        // further.
        match self.ready_rows {
            // Round-robin's fast path draws no random numbers: its
            // generator is taken only if the general path runs.
            ReadyRows::Draw(ListDraw::RoundRobin) => {
                let ready = ReadyRows::Draw(ListDraw::RoundRobin);
                self.select_taking(reg, req, handle, plan, ready, Untaken(None), traced)
            }
            ReadyRows::Draw(ListDraw::Random) => {
                let ready = ReadyRows::Draw(ListDraw::Random);
                self.select_taking(reg, req, handle, plan, ready, self.take_rng(), traced)
            }
            ReadyRows::Draw(ListDraw::PowerOfTwo) => {
                let ready = ReadyRows::Draw(ListDraw::PowerOfTwo);
                self.select_taking(reg, req, handle, plan, ready, self.take_rng(), traced)
            }
            ready => self.select_taking(reg, req, handle, plan, ready, self.take_rng(), traced),
        }
    }

    /// [`select_on_snapshot`](Self::select_on_snapshot) with the
    /// request's generator in `rng`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn select_taking<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        handle: impl Fn() -> H + Copy,
        plan: Plan,
        ready: ReadyRows,
        mut rng: impl RngSlot,
        traced: bool,
    ) -> Result<Booked<H>, SelectionError> {
        let skip = match self.select_ready(reg, req, plan, ready, &mut rng, handle, traced) {
            Some(Ok(booked)) => {
                rng.keep(self);
                return Ok(booked);
            }
            Some(Err(Fallback::Failed(e))) => {
                rng.keep(self);
                self.failed(&e);
                return Err(e);
            }
            Some(Err(Fallback::Refused(row))) => Some(row),
            None => None,
        };
        written(|out| self.select_general(reg, *req, handle, rng.into_rng(self), skip, out))
    }

    /// A preview (`peek`): traced, on the thread's snapshot.
    pub(super) fn run_peek(&self, req: &SelectionRequest<'_>) -> Result<Preview, SelectionError> {
        self.traced(true, || {
            self.with_snapshot(|reg| {
                self.check_basics(req)?;
                let mut rng = self.preview_rng();
                with_scratch(|s| match self.run_with(reg, req, true, s, &mut rng, &|| self, None)? {
                    Outcome::Previewed(worker, why) => Ok(Preview {
                        worker,
                        explanation: why.explain(&self.policy, worker, || 1.0, s.explained.take()),
                    }),
                    Outcome::Booked(_) => unreachable!("a preview books nothing"),
                })
            })
        })
    }

    /// Runs `f` in a debug span when debug logging is on (one check of
    /// the level filter otherwise), and logs and counts its error.
    #[inline(always)]
    fn traced<T>(&self, preview: bool, f: impl FnOnce() -> Result<T, SelectionError>) -> Result<T, SelectionError> {
        // One call of `f` (so it is inlined here): the span is entered only
        // when debug logging is on.
        let span = self.span(preview);
        let result = f();
        // Dropped only where there is one: the drop glue of an `Option`
        // is an out-of-line call even for `None`.
        if let Some(span) = span {
            drop(span);
        }
        if let Err(e) = &result {
            self.failed(e);
        }
        result
    }

    /// The debug span of a selection, when debug logging is on.
    #[inline(always)]
    fn span(&self, preview: bool) -> Option<tracing::span::EnteredSpan> {
        tracing::level_enabled!(tracing::Level::DEBUG)
            .then(|| tracing::debug_span!("selkie.select", policy = self.policy.name(), preview).entered())
    }

    /// A selection failed: logged and counted.
    #[inline(never)]
    fn failed(&self, e: &SelectionError) {
        tracing::debug!(error = %e, "selection failed");
        metrics::counter!("selkie_selection_errors_total", "reason" => e.reason()).increment(1);
    }

    /// What a selection of `req` can work out before it reads the
    /// registry (see [`Plan`]).
    #[inline(always)]
    fn plan(&self, req: &SelectionRequest<'_>) -> Plan {
        Plan {
            ready: req.pin.is_none()
                && req.session.is_none()
                && !req.explain
                && req.allowed_worker_ids.is_none()
                && req.required_taints.is_empty()
                && req.lora.is_none(),
            load: self.uniform_load(req),
        }
    }

    /// What every selection checks first.
    #[inline(always)]
    fn check_basics(&self, req: &SelectionRequest<'_>) -> Result<(), SelectionError> {
        if req.temperature.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
            return Err(SelectionError::InvalidRequest("temperature must be finite and >= 0"));
        }
        // A power-of-two block size (`block_shift`) is not 0: the check a
        // selection makes next, for the request's blocks.
        if self.block_shift.is_none() && self.config.block_size == 0 {
            return Err(SelectionError::InvalidRequest("block_size is 0"));
        }
        Ok(())
    }

    /// The general path of a selection (`skip`: the row whose booking the
    /// fast path was refused), on the thread's scratch; written to `out`
    /// (see [`written`]), an error logged and counted.
    #[inline(never)]
    fn select_general<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: SelectionRequest<'_>,
        handle: impl Fn() -> H + Copy,
        mut rng: Rng,
        skip: Option<usize>,
        out: &mut Option<Result<Booked<H>, SelectionError>>,
    ) {
        let r = with_scratch(|s| self.run_with(reg, &req, false, s, &mut rng, &handle, skip));
        self.keep_rng(rng);
        *out = Some(match r {
            Ok(Outcome::Booked(booked)) => Ok(booked),
            Ok(Outcome::Previewed(..)) => unreachable!("a selection books"),
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        });
    }

    /// The load a booking of `req` on the chosen row (`worker`) carries:
    /// the decode blocks it adds there (its prompt's blocks, or the rank's
    /// [`AddedBlocks`](crate::AddedBlocks)), and its prefill tokens beyond
    /// the cached ones when the request tracks them.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(super) fn book_load(&self, req: &SelectionRequest<'_>, choice: &Choice, worker: WorkerWithDpRank) -> BookLoad {
        match self.uniform_load(req) {
            Some(load) => load,
            None => self.book_row_load(*req, choice.row, choice.cached_tokens.get(), worker),
        }
    }

    /// The load a booking of `req` carries on every row alike, when it has
    /// no per-rank inputs or overlaps (`None`: the row's own, from
    /// `book_row_load`). Reads the request only, so a selection works it
    /// out before it reads the registry.
    #[inline(always)]
    pub(super) fn uniform_load(&self, req: &SelectionRequest<'_>) -> Option<BookLoad> {
        if req.rank_inputs.is_some() || req.row_overlaps.is_some() || !req.overlaps.is_empty() {
            return None;
        }
        // Capped where the fleet's counters saturate (a booking of more
        // adds that much), so that the booking's own cap is known to hold.
        let request_blocks = self.request_blocks(req).min(u64::from(COUNTER_MAX)) as u32;
        let prefill = if req.track_prefill_tokens { req.isl_tokens } else { 0 };
        Some(BookLoad {
            prefill_tokens: prefill.min(COUNTER_MAX as usize) as u32,
            decode_blocks: request_blocks,
        })
    }

    /// [`SelectionRequest::request_blocks`] at the service's block size: a
    /// shift when the block size is a power of two (the same value).
    #[inline(always)]
    fn request_blocks(&self, req: &SelectionRequest<'_>) -> u64 {
        match self.block_shift {
            Some((shift, mask)) => {
                let tokens = req.isl_tokens as u64;
                (tokens >> shift) + u64::from(tokens & mask != 0)
            }
            None => req.request_blocks(self.config.block_size),
        }
    }

    /// [`book_load`](Self::book_load) of a request with per-rank inputs or
    /// overlaps: the request's cached tokens on `row` are `cached` where the
    /// policy read them there ([`Choice::cached_tokens`]), else looked up.
    #[inline(never)]
    pub(super) fn book_row_load(
        &self,
        req: SelectionRequest<'_>,
        row: usize,
        cached: Option<u32>,
        worker: WorkerWithDpRank,
    ) -> BookLoad {
        let request_blocks = u32::try_from(req.request_blocks(self.config.block_size)).unwrap_or(u32::MAX);
        let decode_blocks = match req.rank_inputs {
            Some(r) => r.added_blocks.on(worker, request_blocks),
            None => request_blocks,
        };
        let prefill = if req.track_prefill_tokens {
            let cached = match (req.row_overlaps, cached) {
                (Some(r), _) => r.cached_tokens_at(row),
                (None, _) if req.overlaps.is_empty() => 0,
                (None, Some(tokens)) => tokens as usize,
                (None, None) => cached_tokens(req.overlaps, worker),
            };
            req.isl_tokens.saturating_sub(cached)
        } else {
            0
        };
        BookLoad {
            prefill_tokens: u32::try_from(prefill).unwrap_or(u32::MAX),
            decode_blocks,
        }
    }

    /// A booking made: counts it and wraps it with the choice's [`Why`] as
    /// it is kept (the general path binds the request's session; a request
    /// on the fast path has none).
    #[inline(always)]
    pub(super) fn booked_why<H: Deref<Target = Self>>(
        &self,
        booking: Booking<FleetHandle<H>, FLEET_GROUPS>,
        why: Why,
        meta: &RowMeta,
        traced: bool,
    ) -> Booked<H> {
        let worker = meta.worker();
        meta.entry.selections.increment(1);
        self.selections.increment(1);
        if traced {
            tracing::debug!(
                worker = %worker,
                cost = why.cost(|| self.inv_weight(booking.row())),
                branch = why.branch.as_str(),
                "selected"
            );
        }
        Booked { booking, worker, why }
    }

    /// The inverse of `row`'s capacity weight, as the fleet holds it now.
    pub(super) fn inv_weight(&self, row: usize) -> f32 {
        F32Source::value(&self.fleet.inv_capacity_weight(), row)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_with<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        preview: bool,
        s: &mut Scratch,
        rng: &mut Rng,
        handle: &impl Fn() -> H,
        skip: Option<usize>,
    ) -> Result<Outcome<H>, SelectionError> {
        // The clock is read only for requests that carry a session.
        let now = req.session.map(|_| Instant::now());
        // Session affinity.
        let mut pin = req.pin;
        let mut route = if pin.is_some() { Route::Pinned } else { Route::Policy };
        let mut soft: Option<WorkerWithDpRank> = None;
        if let (None, Some(sess)) = (pin, req.session) {
            if let Some(w) = self
                .sessions
                .get(sess.id, now.unwrap_or_else(Instant::now))
                // A session whose worker left, or is draining or cordoned,
                // moves on (and rebinds) instead of failing.
                .filter(|w| {
                    reg.get(w.worker_id)
                        .is_some_and(|e| e.record.state == WorkerState::Live)
                })
            {
                match sess.mode {
                    AffinityMode::Hard => {
                        pin = Some(if reg.row_of(w).is_some() {
                            Pin::Rank(w)
                        } else {
                            Pin::Worker(w.worker_id)
                        });
                        route = Route::SessionHard;
                    }
                    AffinityMode::Soft => soft = Some(w),
                }
            }
        }
        if self.policy.is_direct() && pin.is_none() {
            return Err(SelectionError::DirectWorkerMissing);
        }
        // The row count, the scratch buffers, the masks and every column
        // the policy reads are sized once, here, from the snapshot: a worker
        // added meanwhile is simply not part of this selection.
        let rows = reg.scan_rows();
        s.prepare(rows);
        #[cfg(test)]
        super::tests::hooks::after_rows_read(rows);
        // The mask leaves the scratch for the selection (the kernel's
        // select-and-book clears refused rows in it while the policy reads
        // the rest of the scratch) and goes back afterwards, whatever the
        // outcome: nothing is allocated.
        let mut mask = std::mem::take(&mut s.mask);
        let r = self.select_on(
            reg, req, preview, s, rng, handle, rows, &mut mask, pin, route, soft, now, skip,
        );
        s.mask = mask;
        r
    }

    /// The hard filters, the policy and the booking on `mask` (see
    /// `run_with`).
    #[allow(clippy::too_many_arguments)]
    fn select_on<H: Deref<Target = Self>>(
        &self,
        reg: &WorkerRegistry,
        req: &SelectionRequest<'_>,
        preview: bool,
        s: &mut Scratch,
        rng: &mut Rng,
        handle: &impl Fn() -> H,
        rows: usize,
        mask: &mut [u64],
        pin: Option<Pin>,
        mut route: Route,
        soft: Option<WorkerWithDpRank>,
        now: Option<Instant>,
        skip: Option<usize>,
    ) -> Result<Outcome<H>, SelectionError> {
        let nw = mask::words_for(rows);
        let mask = &mut mask[..nw];
        let outcome = eligible_rows(
            reg,
            &self.fleet,
            rows,
            req,
            pin,
            self.config.lora_required,
            &self.rejections,
            mask,
            &mut s.aux,
        )?;
        // The fast path's refused row is out (and the mask no longer the
        // snapshot's ready rows).
        let ready = match skip {
            Some(row) if row < rows => {
                mask[row / 64] &= !(1u64 << (row % 64));
                false
            }
            _ => outcome.ready,
        };
        // Soft affinity: try the session's row first; if it refuses the
        // booking, fall back to the rest of the eligible rows.
        let mut soft_row = None;
        if let Some(w) = soft {
            if let Some(row) = reg.row_of(w).filter(|&r| r < rows && mask::contains(mask, r)) {
                s.rest[..nw].copy_from_slice(mask);
                mask.fill(0);
                mask[row / 64] |= 1 << (row % 64);
                route = Route::SessionSoft;
                soft_row = Some(row);
            }
        }
        // The snapshot's ready rows as a list, while the mask is exactly
        // them (no constraint, no soft row, no refusal yet).
        let list = (ready && soft_row.is_none()).then(|| reg.ready_rows().1);
        let ctx = WorkerSelectionContext {
            request: req,
            block_size: self.config.block_size,
            worker_type: self.policy.worker_type,
            preview,
        };
        let view = self.fleet.view(rows);
        let explain = req.explain || preview;
        // Leaves soft affinity: the rest of the eligible rows, without the
        // session's row, go to the policy.
        let leave_soft = |mask: &mut [u64], rest: &[u64], row: usize| {
            mask.copy_from_slice(&rest[..nw]);
            mask[row / 64] &= !(1u64 << (row % 64));
        };
        // One choice; a policy that refuses the soft session's worker (a
        // custom filter, say) gets the rest of the fleet instead. Other
        // errors (a plugin's panic or NaN cost) are the request's, as
        // without a session. An explained choice comes with its cost's
        // terms, worked out on the inputs it was made on.
        let mut choose = |mask: &mut [u64],
                          list: Option<&[u32]>,
                          s: &mut Scratch,
                          soft_row: &mut Option<usize>,
                          route: &mut Route|
         -> Result<Choice, SelectionError> {
            loop {
                let env = Env {
                    reg,
                    fleet: &self.fleet,
                    mask,
                    list,
                    view,
                    req,
                    ctx: &ctx,
                    rows,
                    pinned: outcome.pinned,
                    explain,
                };
                match self.policy.choose(&env, s, rng) {
                    Err(
                        e @ (SelectionError::AllEligibleWorkersFiltered
                        | SelectionError::AllEligibleWorkersOverloaded
                        | SelectionError::NoEligibleWorkers { .. }),
                    ) if soft_row.is_some() => {
                        tracing::debug!(error = %e, "soft session's worker refused by the policy");
                        leave_soft(mask, &s.rest, soft_row.take().unwrap_or_default());
                        *route = Route::Policy;
                    }
                    Ok(choice) => {
                        if explain {
                            s.explained = self.policy.terms(&env, s, &choice);
                        }
                        return Ok(choice);
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let runner_up = |choice: &Choice| choice.runner_up.and_then(|(r, c)| reg.row(r).map(|m| (m.worker(), c)));
        if preview {
            loop {
                let choice = choose(mask, list, s, &mut soft_row, &mut route)?;
                let worker = reg
                    .row(choice.row)
                    .ok_or(SelectionError::AllEligibleWorkersOverloaded)?
                    .worker();
                if soft_row.is_some() && self.fleet.at_admission_limit(choice.row) {
                    // What select would do: the session's worker would
                    // refuse the booking, so the request would go elsewhere.
                    leave_soft(mask, &s.rest, choice.row);
                    (soft_row, route) = (None, Route::Policy);
                    continue;
                }
                tracing::debug!(worker = %worker, branch = choice.branch.as_str(), "previewed");
                return Ok(Outcome::Previewed(worker, why(&choice, runner_up(&choice), route, 0)));
            }
        }
        // The soft session's try does not count against the attempts, and
        // a refusal on the fast path does.
        let attempts = self
            .config
            .max_booking_attempts
            .max(1)
            .saturating_add(u32::from(soft_row.is_some()))
            .saturating_sub(u32::from(skip.is_some()));
        if attempts == 0 {
            return Err(overloaded(pin));
        }
        let mut picked = None;
        let booked = Booking::select_slot(FleetHandle(handle()), mask, attempts, |mask, last| {
            let list = match last {
                None => list,
                Some(e) => {
                    refused(&self.rejections, &e);
                    if let Some(row) = soft_row.take() {
                        // The session's worker is full: the rest of the
                        // fleet, without the refused row, by the policy.
                        leave_soft(mask, &s.rest, row);
                        route = Route::Policy;
                    }
                    if mask::count(mask, rows) == 0 {
                        return Ok::<_, SelectionError>(None);
                    }
                    None
                }
            };
            let choice = choose(mask, list, s, &mut soft_row, &mut route)?;
            let meta = reg
                .row(choice.row)
                .ok_or(SelectionError::AllEligibleWorkersOverloaded)?;
            let load = self.book_load(req, &choice, meta.worker());
            picked = Some((choice, meta));
            Ok(Some(SlotPick {
                slot: meta.handle.slot,
                load,
            }))
        })?;
        match (booked, picked) {
            (Ok(booking), Some((choice, meta))) => {
                let runner_up = runner_up(&choice);
                // An explained selection's terms are kept by the service
                // under a key; a plain one's key is 0.
                let terms = if explain { self.keep_terms(s) } else { 0 };
                if let Some(sess) = req.session {
                    self.sessions
                        .bind(sess.id, meta.worker(), now.unwrap_or_else(Instant::now));
                }
                Ok(Outcome::Booked(self.booked_why(
                    booking,
                    why(&choice, runner_up, route, terms),
                    meta,
                    true,
                )))
            }
            (booked, _) => {
                if let Err(SelectError::BadPick { row }) = booked {
                    tracing::error!(row, "the policy chose a row outside the eligible rows");
                }
                Err(overloaded(pin))
            }
        }
    }

    /// Keeps the explained choice's terms the scratch holds (if any) in
    /// the service's log; returns their key (0: none). Out of line: a
    /// plain selection does not move them.
    #[cold]
    #[inline(never)]
    fn keep_terms(&self, s: &mut Scratch) -> u64 {
        s.explained.take().map_or(0, |t| self.explained.put(t))
    }
}

/// A booking was refused: logged and counted; the selection rescans.
pub(super) fn refused(rejections: &Rejections, e: &BookError) {
    tracing::debug!(error = %e, "booking refused; rescanning");
    rejections.booking_refused.increment(1);
}

/// The explanation's parts a booking keeps (see [`Why`]).
#[inline(always)]
pub(super) fn why(choice: &Choice, runner_up: Option<(WorkerWithDpRank, f64)>, route: Route, terms: u64) -> Why {
    debug_assert!(choice.candidates <= crate::fleet::HostFleet::CAPACITY);
    Why {
        route,
        branch: choice.branch,
        cost: choice.cost,
        per_weight: false,
        runner_up,
        // Rows the policy chose from: at most the fleet's 16,384.
        candidates: choice.candidates as u32,
        temperature: choice.temperature,
        terms,
    }
}

/// Every booking tried was refused.
fn overloaded(pin: Option<Pin>) -> SelectionError {
    match pin {
        Some(p) => SelectionError::PinnedWorkerOverloaded {
            worker_id: p.worker_id(),
        },
        None => SelectionError::AllEligibleWorkersOverloaded,
    }
}

/// The request's cached tokens on `worker`: a binary search (overlaps are
/// usually sorted by worker), confirmed, else a linear scan.
fn cached_tokens(overlaps: &[crate::WorkerOverlap], worker: WorkerWithDpRank) -> usize {
    let i = overlaps.partition_point(|o| o.worker < worker);
    let hit = overlaps
        .get(i)
        .filter(|o| o.worker == worker)
        .or_else(|| overlaps.iter().find(|o| o.worker == worker));
    hit.map_or(0, |o| o.cached_tokens as usize)
}

/// What a selection can work out before it reads the registry: from its
/// request, and from the service's policy.
#[derive(Clone, Copy)]
pub(super) struct Plan {
    /// A plain request (no pin, session, constraint or explanation): the
    /// fast path may take it, if the policy reads ready rows and the
    /// snapshot's ready rows are exactly its live rows.
    pub(super) ready: bool,
    /// The load it books on every row alike ([`uniform_load`]).
    ///
    /// [`uniform_load`]: WorkerSelectionService::uniform_load
    pub(super) load: Option<BookLoad>,
}

pub(super) enum Outcome<H: Deref<Target = WorkerSelectionService>> {
    Booked(Booked<H>),
    /// The worker a selection would choose and why, its cost's terms left
    /// in the scratch (`Scratch::explained`): the explanation, with its
    /// terms the largest part of a preview, is built by `run_peek`, so
    /// every selection's outcome stays the size of a booking.
    Previewed(WorkerWithDpRank, Why),
}

#[cfg(test)]
mod stream_tests {
    use super::STREAM_STEP;
    use selkie_kernel::Rng;

    /// What `Rng::next_u64` adds to the state before each draw.
    const GAMMA: u64 = Rng::INCREMENT;

    /// The inverse of an odd `x` modulo 2^64 (Newton's iteration).
    fn inverse(x: u64) -> u64 {
        let mut y = x;
        for _ in 0..6 {
            y = y.wrapping_mul(2u64.wrapping_sub(x.wrapping_mul(y)));
        }
        assert_eq!(x.wrapping_mul(y), 1);
        y
    }

    /// Selection `n + d` draws, at its `k + e`-th draw, the state selection
    /// `n` reaches at its `k`-th exactly when `d * STEP == -e * GAMMA`
    /// (mod 2^64): for every `e` up to 10,000 the `d` that does so is at
    /// least 2^48 away from 0.
    #[test]
    fn seeded_streams_stay_apart() {
        let step_inverse = inverse(STREAM_STEP);
        for e in 1..=10_000u64 {
            let d = e.wrapping_mul(GAMMA).wrapping_mul(step_inverse);
            let distance = d.min(d.wrapping_neg());
            assert!(distance >= 1 << 48, "draw offset {e}: streams {distance} apart meet");
        }
    }
}
