//! The hard filters: the rows a request may go to, before any policy sees a
//! row. They build the eligibility mask the kernel scans.
//!
//! Order (each step only narrows):
//! 1. live rows of the registry snapshot (draining and cordoned workers are
//!    out), kept per change rather than read per request;
//! 2. a pin (explicit, direct routing or hard session affinity) replaces the
//!    row set by the pinned worker's rows, after checking it is allowed,
//!    present, has the rank, and carries the required taints;
//! 3. otherwise the allowlist, the required taints and the LoRA adapter;
//! 4. busy thresholds and the overload mark.
//!
//! Each way of ending up with no row is its own [`SelectionError`]. The
//! filters allocate nothing: they write into the caller's mask words.
//! They must not look at costs or pick anything.
//!
//! Busy thresholds apply per rank: a busy rank is skipped while its
//! worker's other ranks stay eligible. (Dynamo's load monitor marks a
//! worker overloaded only when every rank is, and then skips all of them;
//! per-rank skipping never routes to a rank that is over its threshold.)

use selkie_kernel::mask;

use crate::discovery::registry::{RowMeta, WorkerEntry, WorkerRegistry};
use crate::discovery::WorkerState;
use crate::error::{SelectionError, UnavailableReason};
use crate::fleet::HostFleet;
use crate::request::{Pin, SelectionRequest};

/// What the hard filters left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FilterOutcome {
    /// Eligible rows.
    pub(crate) eligible: usize,
    /// The request is pinned to one worker.
    pub(crate) pinned: bool,
    /// The mask is the snapshot's ready rows, unchanged (see
    /// `RowIndex::ready_rows`).
    pub(crate) ready: bool,
}

/// Calls `f` for every set row below `rows`.
#[inline]
pub(crate) fn for_each_row(words: &[u64], rows: usize, mut f: impl FnMut(usize)) {
    for (wi, &w) in words.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let row = wi * 64 + w.trailing_zeros() as usize;
            if row >= rows {
                return;
            }
            f(row);
            w &= w - 1;
        }
    }
}

#[inline]
fn clear(words: &mut [u64], row: usize) {
    words[row / 64] &= !(1u64 << (row % 64));
}

#[inline]
fn set(words: &mut [u64], row: usize) {
    words[row / 64] |= 1u64 << (row % 64);
}

fn has_taints(entry: &WorkerEntry, required: &[&str]) -> bool {
    required.iter().all(|t| entry.record.taints.contains(*t))
}

/// Whether `row` is over a busy threshold or its worker is marked overloaded.
#[inline]
pub(crate) fn is_busy(meta: &RowMeta, fleet: &HostFleet, row: usize) -> bool {
    meta.entry.overloaded.load(std::sync::atomic::Ordering::Relaxed) || over_threshold(meta, fleet, row)
}

/// Whether `row`'s load is over one of its worker's busy thresholds.
#[inline]
fn over_threshold(meta: &RowMeta, fleet: &HostFleet, row: usize) -> bool {
    let e = &meta.entry;
    let o = fleet.outstanding(row).unwrap_or_default();
    (e.decode_limit != u64::MAX && u64::from(o.decode_blocks) > e.decode_limit)
        || (e.prefill_limit != u64::MAX && u64::from(o.prefill_tokens) > e.prefill_limit)
}

/// The rejection counters a selection may bump on its way to a booking
/// (`selkie_rejections_total` by reason), registered once per service: a
/// `metrics::counter!` call builds its key and asks the recorder for the
/// counter every time.
pub(crate) struct Rejections {
    /// `reason=busy`: rows skipped as over a busy threshold or marked
    /// overloaded.
    pub(crate) busy: metrics::Counter,
    /// `reason=booking_refused`: bookings the fleet refused (the selection
    /// rescans).
    pub(crate) booking_refused: metrics::Counter,
}

impl Rejections {
    /// Registers the counters with the current recorder.
    pub(crate) fn register() -> Self {
        Rejections {
            busy: metrics::counter!("selkie_rejections_total", "reason" => "busy"),
            booking_refused: metrics::counter!("selkie_rejections_total", "reason" => "booking_refused"),
        }
    }
}

fn unavailable(worker_id: u64, reason: UnavailableReason) -> SelectionError {
    metrics::counter!("selkie_rejections_total", "reason" => reason.as_str()).increment(1);
    SelectionError::PinnedWorkerUnavailable { worker_id, reason }
}

/// Builds the eligibility mask for `req` into `words` (at least
/// `mask::words_for(rows)` long) over the first `rows` rows (the registry
/// snapshot's scan length, read once by the caller for the whole
/// selection); `pin` is the effective pin (explicit or from hard session
/// affinity).
#[allow(clippy::too_many_arguments)]
pub(crate) fn eligible_rows(
    reg: &WorkerRegistry,
    fleet: &HostFleet,
    rows: usize,
    req: &SelectionRequest<'_>,
    pin: Option<Pin>,
    lora_required: bool,
    rejections: &Rejections,
    words: &mut [u64],
    aux: &mut [u64],
) -> Result<FilterOutcome, SelectionError> {
    let nw = mask::words_for(rows);
    let (words, aux) = (&mut words[..nw], &mut aux[..nw]);
    // The live rows of this (possibly stale) registry snapshot, kept per
    // change: a row that left since is refused by its booking.
    let (live_rows, live) = reg.live_rows();
    let copy = |to: &mut [u64], from: &[u64]| {
        let n = from.len().min(to.len());
        to[..n].copy_from_slice(&from[..n]);
        to[n..].fill(0);
    };
    let unconstrained = req.allowed_worker_ids.is_none() && req.required_taints.is_empty() && req.lora.is_none();
    if pin.is_none() && reg.len() != 0 && live != 0 && unconstrained {
        // No constraint: every live row is eligible; the overload marks
        // are already out of the snapshot's ready rows.
        let (ready, list) = reg.ready_rows();
        copy(words, ready);
        return busy_rows(reg, fleet, rows, words, aux, live, live - list.len(), true, rejections);
    }
    copy(words, live_rows);
    if let Some(pin) = pin {
        return pinned_rows(reg, fleet, req, pin, rows, words, aux);
    }
    if reg.len() == 0 || live == 0 {
        return Err(SelectionError::NoEndpoints);
    }
    if let Some(ids) = req.allowed_worker_ids {
        aux.copy_from_slice(words);
        words.fill(0);
        for id in ids {
            if let Some(e) = reg.get(*id) {
                for &(_, h) in &e.rows {
                    if mask::contains(aux, h.row) {
                        set(words, h.row);
                    }
                }
            }
        }
    }
    if !req.required_taints.is_empty() {
        aux.copy_from_slice(words);
        for_each_row(aux, rows, |row| {
            if reg.row(row).is_none_or(|m| !has_taints(&m.entry, req.required_taints)) {
                clear(words, row);
            }
        });
    }
    if let Some(adapter) = req.lora {
        // Narrow to the workers that have the adapter loaded; when none has
        // it, keep the set (the worker loads it lazily) unless the service
        // requires a loaded adapter.
        aux.fill(0);
        let mut any = false;
        for_each_row(words, rows, |row| {
            if reg
                .row(row)
                .is_some_and(|m| m.entry.record.lora_adapters.contains(adapter))
            {
                set(aux, row);
                any = true;
            }
        });
        if any {
            words.copy_from_slice(aux);
        } else if lora_required {
            words.fill(0);
        }
    }
    let eligible = mask::count(words, rows);
    if eligible == 0 {
        metrics::counter!("selkie_rejections_total", "reason" => "constraints").increment(live as u64);
        return Err(SelectionError::NoEligibleWorkers { rejected: live });
    }
    // Busy: the overload marks are a mask of the snapshot (one AND-NOT per
    // word).
    let mut busy = 0usize;
    if reg.any_overloaded_mark() {
        let marked = reg.overloaded_rows();
        for (i, w) in words.iter_mut().enumerate() {
            let m = *w & marked.get(i).copied().unwrap_or(0);
            busy += m.count_ones() as usize;
            *w &= !m;
        }
    }
    busy_rows(reg, fleet, rows, words, aux, eligible, busy, false, rejections)
}

/// The last hard filter: of `eligible` rows, `marked` were marked
/// overloaded (already out of `words`); only rows whose worker has a busy
/// threshold are checked against their load, one row at a time. `ready`:
/// `words` holds the snapshot's ready rows.
#[allow(clippy::too_many_arguments)]
fn busy_rows(
    reg: &WorkerRegistry,
    fleet: &HostFleet,
    rows: usize,
    words: &mut [u64],
    aux: &mut [u64],
    eligible: usize,
    marked: usize,
    ready: bool,
    rejections: &Rejections,
) -> Result<FilterOutcome, SelectionError> {
    let mut busy = marked;
    if reg.traits().thresholds {
        let limited = reg.threshold_rows();
        for (i, a) in aux.iter_mut().enumerate() {
            *a = words[i] & limited.get(i).copied().unwrap_or(0);
        }
        for_each_row(aux, rows, |row| {
            if reg.row(row).is_some_and(|m| over_threshold(m, fleet, row)) {
                clear(words, row);
                busy += 1;
            }
        });
    }
    if busy > 0 {
        rejections.busy.increment(busy as u64);
    }
    if busy == eligible {
        return Err(SelectionError::AllEligibleWorkersOverloaded);
    }
    Ok(FilterOutcome {
        eligible: eligible - busy,
        pinned: false,
        // The snapshot's ready rows exactly: no constraint, no threshold.
        ready: ready && busy == marked,
    })
}

fn pinned_rows(
    reg: &WorkerRegistry,
    fleet: &HostFleet,
    req: &SelectionRequest<'_>,
    pin: Pin,
    rows: usize,
    words: &mut [u64],
    aux: &mut [u64],
) -> Result<FilterOutcome, SelectionError> {
    let worker_id = pin.worker_id();
    if req.allowed_worker_ids.is_some_and(|ids| !ids.contains(&worker_id)) {
        metrics::counter!("selkie_rejections_total", "reason" => "pinned_not_allowed").increment(1);
        return Err(SelectionError::PinnedWorkerNotAllowed { worker_id });
    }
    let Some(entry) = reg.get(worker_id) else {
        return Err(unavailable(worker_id, UnavailableReason::Unknown));
    };
    if let Pin::Rank(r) = pin {
        let ranks = entry.record.dp_ranks();
        if !ranks.contains(&r.dp_rank) {
            metrics::counter!("selkie_rejections_total", "reason" => "dp_rank_unavailable").increment(1);
            return Err(SelectionError::DpRankUnavailable {
                worker_id,
                dp_rank: r.dp_rank,
                start: ranks.start,
                end: ranks.end,
            });
        }
    }
    match entry.record.state {
        WorkerState::Live => {}
        WorkerState::Draining => return Err(unavailable(worker_id, UnavailableReason::Draining)),
        WorkerState::Cordoned => return Err(unavailable(worker_id, UnavailableReason::Cordoned)),
    }
    if !has_taints(entry, req.required_taints) {
        return Err(unavailable(worker_id, UnavailableReason::MissingRequiredTaint));
    }
    // The LoRA adapter does not narrow a pin: the pinned worker loads it
    // lazily (a pin is about where the KV cache is).
    aux.copy_from_slice(words);
    words.fill(0);
    let mut eligible = 0;
    for &(rank, h) in &entry.rows {
        if matches!(pin, Pin::Rank(r) if r.dp_rank != rank) || !mask::contains(aux, h.row) {
            continue;
        }
        eligible += 1;
        let busy = reg.row(h.row).is_some_and(|m| is_busy(m, fleet, h.row));
        if !busy {
            set(words, h.row);
        }
    }
    if eligible == 0 {
        // Registered and live in the registry, yet no selectable row: the
        // fleet is mid-update. Report it as unavailable.
        return Err(unavailable(worker_id, UnavailableReason::Unknown));
    }
    let left = mask::count(words, rows);
    if left == 0 {
        metrics::counter!("selkie_rejections_total", "reason" => "pinned_overloaded").increment(1);
        return Err(SelectionError::PinnedWorkerOverloaded { worker_id });
    }
    Ok(FilterOutcome {
        eligible: left,
        pinned: true,
        ready: false,
    })
}
