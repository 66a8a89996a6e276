//! What a selection hands back: [`Selection`] (a booked request, released
//! on drop), [`Preview`] (a peek: nothing booked) and [`WorkerStatus`].

use std::ops::Deref;
use std::sync::Arc;

use selkie_kernel::fleet::{BookError, Booking};

use super::WorkerSelectionService;
use crate::discovery::WorkerRecord;
use crate::error::BookingError;
use crate::explain::{Explanation, Why};
use crate::fleet::{KernelFleet, FLEET_GROUPS};
use crate::types::{DpRank, WorkerWithDpRank};

/// A handle to a service that derefs to its fleet, so a kernel booking can
/// hold it (a borrow, or an `Arc` for bookings that outlive a scope).
#[doc(hidden)]
pub struct FleetHandle<H>(pub(crate) H);

impl<H: Deref<Target = WorkerSelectionService>> Deref for FleetHandle<H> {
    type Target = KernelFleet;
    fn deref(&self) -> &KernelFleet {
        &self.0.fleet
    }
}

/// A request booked on a worker rank: its in-flight request, prefill tokens
/// and decode blocks count against the worker until this is dropped (or
/// [`finish`](Self::finish)ed). Exactly one release, even if the worker was
/// removed meanwhile.
///
/// `H` is how the booking holds the service: [`Selection`] borrows it,
/// [`OwnedSelection`] holds an `Arc` (for bookings moved into tasks).
// `repr(C)` keeps the fields in declaration order, the order the fast path
// builds them in (without it, `host_profile` at 1,024 workers: random 14
// instructions more per call, round-robin 9, power-of-two 13).
#[repr(C)]
pub struct Booked<H: Deref<Target = WorkerSelectionService>> {
    pub(crate) booking: Booking<FleetHandle<H>, FLEET_GROUPS>,
    pub(crate) worker: WorkerWithDpRank,
    /// The explanation less what the service and the booking know.
    pub(crate) why: Why,
}

/// A booking that borrows the service ([`WorkerSelectionService::select`]).
///
/// Its methods are [`Booked`]'s, in the order a router calls them:
/// [`worker`](Booked::worker) (where to send the request),
/// [`explanation`](Booked::explanation) (why),
/// [`prefill_complete`](Booked::prefill_complete) (at the first token),
/// [`add_output_block`](Booked::add_output_block) (each time the output
/// fills a KV block), [`retarget`](Booked::retarget) (the request moved to
/// another rank), and [`finish`](Booked::finish) or drop (the request
/// ended: the booking is released once).
///
/// ```
/// use selkie::{SelectionRequest, ServiceConfig, WorkerRecord, WorkerSelectionPolicy, WorkerSelectionService};
/// let service = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
/// service.add_worker(WorkerRecord::new(1))?;
/// let mut selection = service.select(&SelectionRequest::new(100))?;
/// assert_eq!(selection.worker().worker_id, 1);
/// selection.prefill_complete();
/// selection.add_output_block()?;
/// selection.finish();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type Selection<'s> = Booked<&'s WorkerSelectionService>;

/// A booking that owns an `Arc` of the service
/// ([`WorkerSelectionService::select_owned`]): `'static`, `Send`, for a
/// request served on another task or thread. Its methods are [`Booked`]'s
/// (see [`Selection`]).
pub type OwnedSelection = Booked<Arc<WorkerSelectionService>>;

impl<H: Deref<Target = WorkerSelectionService>> Booked<H> {
    /// The worker rank the request goes to.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.worker
    }

    /// Why this worker was chosen (built on request from what the
    /// booking keeps, and for an O(1) draw the worker's capacity weight as
    /// the fleet holds it now: a few copies and one read, no allocation).
    /// The runner-up and the cost's terms only for an explained request
    /// ([`SelectionRequest::explained`](crate::SelectionRequest::explained);
    /// the terms while the service keeps them: see [`Explanation`]).
    pub fn explanation(&self) -> Explanation {
        let service = &self.booking.fleet().0;
        self.why.explain(
            &service.policy,
            self.worker,
            || service.inv_weight(self.booking.row()),
            service.explained.get(self.why.terms),
        )
    }

    /// Prefill tokens still booked.
    pub fn prefill_tokens(&self) -> u32 {
        self.booking.prefill_tokens()
    }

    /// Decode blocks booked.
    pub fn decode_blocks(&self) -> u32 {
        self.booking.decode_blocks()
    }

    /// The prompt is prefilled: release its prefill tokens (the request and
    /// its decode blocks stay booked).
    pub fn prefill_complete(&mut self) {
        self.booking.prefill_complete();
    }

    /// The request produced another KV block.
    ///
    /// A worker removed while this request is in flight keeps its row until
    /// its bookings end, so the block is still counted there (and on the
    /// worker again if it comes back meanwhile).
    /// [`BookingError::WorkerGone`] only if the row has nevertheless been
    /// reused by another worker (a booking outliving its fleet row).
    pub fn add_output_block(&mut self) -> Result<(), BookingError> {
        self.booking
            .add_output_block()
            .map_err(|_| BookingError::WorkerGone { worker: self.worker })
    }

    /// Moves the booking to another worker rank (transport fallback): books
    /// the same load there first, then releases it here. On error the
    /// booking stays where it was.
    ///
    /// The target is booked by its slot (row and generation) as the registry
    /// names it: if the worker leaves and another takes its row in between,
    /// the move is refused ([`BookingError::UnknownWorker`]) rather than
    /// booked on the newcomer.
    pub fn retarget(&mut self, to: WorkerWithDpRank) -> Result<(), BookingError> {
        let slot = {
            let reg = self.booking.fleet().0.read_registry();
            let row = reg.row_of(to).ok_or(BookingError::UnknownWorker { worker: to })?;
            reg.row(row)
                .map(|m| m.handle.slot)
                .ok_or(BookingError::UnknownWorker { worker: to })?
        };
        #[cfg(test)]
        super::tests::hooks::before_retarget_claim();
        self.booking.retarget_slot(slot).map_err(|e| match e {
            BookError::Overloaded { limit, .. } => BookingError::Overloaded { worker: to, limit },
            BookError::NotLive { .. } => BookingError::NotLive { worker: to },
            _ => BookingError::UnknownWorker { worker: to },
        })?;
        tracing::debug!(from = %self.worker, %to, "booking retargeted");
        self.worker = to;
        Ok(())
    }

    /// The request is finished: release everything now.
    pub fn finish(self) {}
}

impl<H: Deref<Target = WorkerSelectionService>> std::fmt::Debug for Booked<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Selection")
            .field("worker", &self.worker)
            .field("booking", &self.booking)
            .finish()
    }
}

/// The result of a [`peek`](WorkerSelectionService::peek): the worker a
/// selection would choose now. Nothing is booked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preview {
    /// The worker rank.
    pub worker: WorkerWithDpRank,
    /// Why (with the runner-up).
    pub explanation: Explanation,
}

/// One rank's load as the fleet holds it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStatus {
    /// The rank.
    pub dp_rank: DpRank,
    /// Requests in flight (booked included; with replica sync, the other
    /// replicas' too, as last applied).
    pub active_requests: u32,
    /// Prefill tokens booked and not yet prefilled (with replica sync,
    /// the other replicas' too).
    pub active_prefill_tokens: u32,
    /// Decode blocks booked (with replica sync, the other replicas' too).
    pub active_decode_blocks: u32,
    /// Over a busy threshold.
    pub busy: bool,
}

/// A worker's record, per-rank load and overload state.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerStatus {
    /// What discovery said.
    pub record: WorkerRecord,
    /// Per-rank load, in rank order.
    pub ranks: Vec<RankStatus>,
    /// Marked overloaded, or every rank over a busy threshold.
    pub overloaded: bool,
}
