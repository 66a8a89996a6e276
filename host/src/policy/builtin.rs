//! The built-in load modes on the kernel's kernels: random,
//! round-robin, least-loaded, power-of-two, device-aware weighted, direct.
//!
//! With data-parallel workers, least-loaded and power-of-two first choose a
//! worker by the sum of its eligible ranks' in-flight requests, then the
//! least-loaded rank inside it, so a worker with eight ranks is not treated
//! as eight idle machines. This module must not book.

use selkie_kernel::kernels::device_aware::{device_aware as kernel_device_aware, DeviceGroup};
use selkie_kernel::kernels::index;
use selkie_kernel::kernels::least_loaded::{least_loaded as ll, least_loaded_weighted as llw};
use selkie_kernel::lanes::{F32Source, U32Source};
use selkie_kernel::mask;
use selkie_kernel::Rng;

use selkie_kernel::fleet::FleetView;

use super::scratch::Scratch;
use super::{Choice, DeviceAwareConfig, Drawn, Draws, Env, ListDraw, ScatteredTokens};
use crate::discovery::registry::WorkerRegistry;
use crate::error::SelectionError;
use crate::explain::Branch;
use crate::filter::for_each_row;
use crate::fleet::{HostFleet, FLEET_GROUPS};

pub(crate) fn choice(row: usize, cost: f64, branch: Branch, candidates: usize) -> Choice {
    Choice {
        row,
        cost,
        runner_up: None,
        branch,
        candidates,
        temperature: 0.0,
        cached_tokens: ScatteredTokens::NONE,
    }
}

/// In-flight requests per unit of weight of `row`.
pub(crate) fn load_of(env: &Env<'_>, row: usize) -> f64 {
    row_load(env.reg, &env.view, row)
}

/// The cheapest eligible row other than `chosen`, by load.
fn load_runner_up(env: &Env<'_>, words: &[u64], chosen: usize) -> Option<(usize, f64)> {
    let mut best: Option<(usize, f64)> = None;
    for_each_row(words, env.rows, |r| {
        if r != chosen {
            let c = load_of(env, r);
            if best.is_none_or(|(_, b)| c < b) {
                best = Some((r, c));
            }
        }
    });
    best
}

pub(crate) fn finish(env: &Env<'_>, mut c: Choice) -> Choice {
    if env.explain {
        c.runner_up = load_runner_up(env, env.mask, c.row);
    }
    c
}

pub(crate) fn none() -> SelectionError {
    SelectionError::AllEligibleWorkersOverloaded
}

/// The draw of random, round-robin and power-of-two from `list`, the
/// eligible rows as a sorted list (the snapshot's ready rows): O(1), the
/// same row the kernel's scan of the matching mask would give for the same
/// random numbers and ticket. `None` when the list is too short for the
/// draw (power-of-two needs two rows) or the fleet has data-parallel
/// workers (where power-of-two chooses by worker first).
///
/// `advance`: take the round-robin ticket (a selection) rather than read it
/// (a preview).
#[inline(always)]
pub(crate) fn draw_from_list(
    draw: ListDraw,
    reg: &WorkerRegistry,
    fleet: &HostFleet,
    view: &FleetView<'_, FLEET_GROUPS>,
    list: &[u32],
    advance: bool,
    rng: &mut impl Draws,
) -> Option<Drawn> {
    let n = list.len();
    let (row, branch, active) = match draw {
        ListDraw::Random => (rng.pick(list)? as usize, Branch::Random, None),
        ListDraw::RoundRobin if n != 0 => {
            let ticket = u64::from(if advance {
                fleet.next_ticket()
            } else {
                fleet.peek_ticket()
            });
            (list[(ticket % n as u64) as usize] as usize, Branch::RoundRobin, None)
        }
        ListDraw::PowerOfTwo if !reg.traits().multi_rank => {
            // The kernel's draws (Dynamo's): two distinct positions, the
            // lighter row wins, ties to the first draw.
            let active = view.active_requests();
            let (a, b) = rng.pick_two(list)?;
            let (a, b) = (a as usize, b as usize);
            let (load_a, load_b) = (U32Source::value(&active, a), U32Source::value(&active, b));
            let (row, load) = if load_a <= load_b { (a, load_a) } else { (b, load_b) };
            (row, Branch::PowerOfTwo, Some(load))
        }
        _ => return None,
    };
    Some(Drawn {
        row,
        branch,
        active,
        candidates: n,
    })
}

/// In-flight requests per unit of weight of `row`, from the snapshot's
/// traits and the fleet's columns.
#[inline(always)]
pub(crate) fn row_load(reg: &WorkerRegistry, view: &FleetView<'_, FLEET_GROUPS>, row: usize) -> f64 {
    let a = f64::from(U32Source::value(&view.active_requests(), row));
    if reg.traits().weighted {
        a * F32Source::value(&view.inv_capacity_weight(), row) as f64
    } else {
        a
    }
}

/// Random, round-robin or power-of-two over `env`: the O(1) draw from
/// `env.list` when there is one, else the kernel's scan of `env.mask`.
fn from_list_or_scan(
    env: &Env<'_>,
    draw: ListDraw,
    rng: &mut Rng,
    scan: impl FnOnce(&mut Rng) -> Option<usize>,
    branch: Branch,
) -> Result<Choice, SelectionError> {
    let advance = !env.ctx.is_preview();
    let (n, row) = match env.list.and_then(|list| {
        draw_from_list(draw, env.reg, env.fleet, &env.view, list, advance, rng).map(|d| (d.candidates, d.row))
    }) {
        Some(d) => d,
        None => (env.candidates(), scan(rng).ok_or_else(none)?),
    };
    Ok(finish(env, choice(row, load_of(env, row), branch, n)))
}

pub(crate) fn random(env: &Env<'_>, _s: &mut Scratch, rng: &mut Rng) -> Result<Choice, SelectionError> {
    from_list_or_scan(
        env,
        ListDraw::Random,
        rng,
        |rng| index::random(env.rows, env.mask, rng),
        Branch::Random,
    )
}

pub(crate) fn round_robin(env: &Env<'_>, _s: &mut Scratch, rng: &mut Rng) -> Result<Choice, SelectionError> {
    let advance = !env.ctx.is_preview();
    from_list_or_scan(
        env,
        ListDraw::RoundRobin,
        rng,
        |_| {
            let ticket = u64::from(if advance {
                env.fleet.next_ticket()
            } else {
                env.fleet.peek_ticket()
            });
            index::round_robin(env.rows, env.mask, ticket)
        },
        Branch::RoundRobin,
    )
}

/// Least-loaded row among `words` (weighted when the fleet has weights).
fn least_loaded_rows(env: &Env<'_>, words: &[u64], rng: &mut Rng) -> Option<usize> {
    let active = env.view.active_requests();
    if env.reg.traits().weighted {
        llw(&active, &env.view.inv_capacity_weight(), words, rng)
    } else {
        ll(&active, words, rng)
    }
}

/// Fills `s.sums` with each worker's summed in-flight requests at its first
/// rank's row ("leader"), and `s.aux` with the leaders that have an eligible
/// rank. Returns the number of such workers.
fn sum_by_worker(env: &Env<'_>, s: &mut Scratch) -> usize {
    let rows = env.rows;
    let active = env.view.active_requests();
    s.sums[..rows].fill(0);
    let nw = mask::words_for(rows);
    s.aux[..nw].fill(0);
    let (sums, aux) = (&mut s.sums, &mut s.aux);
    let mut workers = 0;
    for_each_row(&env.mask[..nw], rows, |row| {
        if let Some(leader) = env.reg.leader(row) {
            sums[leader] = sums[leader].saturating_add(U32Source::value(&active, row));
            if !mask::contains(aux, leader) {
                aux[leader / 64] |= 1 << (leader % 64);
                workers += 1;
            }
        }
    });
    workers
}

/// The least-loaded eligible rank of the worker whose leader row is `leader`.
fn rank_within(env: &Env<'_>, s: &mut Scratch, leader: usize, rng: &mut Rng) -> Option<usize> {
    let nw = mask::words_for(env.rows);
    s.aux2[..nw].fill(0);
    let m = env.reg.row(leader)?;
    for &(_, h) in &m.entry.rows {
        if mask::contains(env.mask, h.row) {
            s.aux2[h.row / 64] |= 1 << (h.row % 64);
        }
    }
    ll(&env.view.active_requests(), &s.aux2[..nw], rng)
}

fn by_worker(env: &Env<'_>) -> bool {
    env.reg.traits().multi_rank
}

fn pick_leader_least_loaded(env: &Env<'_>, s: &Scratch, rng: &mut Rng) -> Option<usize> {
    let sums = &s.sums[..env.rows];
    if env.reg.traits().weighted {
        llw(sums, &env.view.inv_capacity_weight(), &s.aux, rng)
    } else {
        ll(sums, &s.aux, rng)
    }
}

pub(crate) fn least_loaded(env: &Env<'_>, s: &mut Scratch, rng: &mut Rng) -> Result<Choice, SelectionError> {
    let n = env.candidates();
    if by_worker(env) {
        sum_by_worker(env, s);
        let leader = pick_leader_least_loaded(env, s, rng).ok_or_else(none)?;
        let row = rank_within(env, s, leader, rng).ok_or_else(none)?;
        return Ok(finish(
            env,
            choice(row, load_of(env, row), Branch::LeastLoadedWorkerThenRank, n),
        ));
    }
    let row = least_loaded_rows(env, env.mask, rng).ok_or_else(none)?;
    Ok(finish(env, choice(row, load_of(env, row), Branch::LeastLoaded, n)))
}

pub(crate) fn power_of_two(env: &Env<'_>, s: &mut Scratch, rng: &mut Rng) -> Result<Choice, SelectionError> {
    let n = env.candidates();
    if by_worker(env) {
        sum_by_worker(env, s);
        let leader = index::power_of_two(&s.sums[..env.rows], &s.aux, rng).ok_or_else(none)?;
        let row = rank_within(env, s, leader, rng).ok_or_else(none)?;
        return Ok(finish(
            env,
            choice(row, load_of(env, row), Branch::PowerOfTwoWorkerThenRank, n),
        ));
    }
    if let Some(d) = env
        .list
        .and_then(|list| draw_from_list(ListDraw::PowerOfTwo, env.reg, env.fleet, &env.view, list, true, rng))
    {
        return Ok(finish(env, choice(d.row, load_of(env, d.row), d.branch, n)));
    }
    let row = index::power_of_two(&env.view.active_requests(), env.mask, rng).ok_or_else(none)?;
    Ok(finish(env, choice(row, load_of(env, row), Branch::PowerOfTwo, n)))
}

pub(crate) fn direct(env: &Env<'_>, _s: &mut Scratch, rng: &mut Rng) -> Result<Choice, SelectionError> {
    if !env.pinned {
        return Err(SelectionError::DirectWorkerMissing);
    }
    let n = env.candidates();
    let row = ll(&env.view.active_requests(), env.mask, rng).ok_or_else(none)?;
    Ok(finish(env, choice(row, load_of(env, row), Branch::Direct, n)))
}

/// Device-aware weighted on the kernel's `device_aware`: a row
/// with the required cache hits if any (least-loaded among them); else CPU
/// rows while the CPU group's total load is below
/// `accel_total * cpu_count / (ratio * accel_count)`, else accelerator rows;
/// least-loaded within the group. A row's cache hits are its overlap's
/// `device_blocks`. Unlike Dynamo, a full-cache choice is booked too (the
/// service books every selection).
pub(crate) fn device_aware(
    env: &Env<'_>,
    s: &mut Scratch,
    rng: &mut Rng,
    cfg: &DeviceAwareConfig,
) -> Result<Choice, SelectionError> {
    let rows = env.rows;
    let n = env.candidates();
    let hits = &mut s.sums[..rows];
    hits.fill(0);
    // The request's requirement, else the policy's.
    let required = match env.req.required_cache_hits {
        0 => cfg.required_cache_hits,
        n => n,
    };
    if required > 0 {
        if env.req.row_overlaps.is_some() {
            let view = super::kv::overlap_view::<false>(env, &mut s.overlap)?;
            if let Some(device) = view.device {
                for (h, &d) in hits.iter_mut().zip(device) {
                    *h = d as u32;
                }
            }
        } else {
            for o in env.req.overlaps {
                if let Some(row) = env.reg.table_row_of(o.worker).filter(|&r| r < rows) {
                    hits[row] = o.device_blocks;
                }
            }
        }
    }
    let kcfg = DeviceAwareConfig {
        required_cache_hits: required,
        ..*cfg
    };
    let picked = kernel_device_aware(
        &env.view.active_requests(),
        &*hits,
        env.reg.cpu_rows(),
        env.mask,
        &kcfg,
        rng,
    )
    .map_err(|_| none())?
    .ok_or_else(none)?;
    let branch = match picked.group {
        DeviceGroup::FullCache => Branch::DeviceAwareCacheHit,
        DeviceGroup::Cpu => Branch::DeviceAwareCpu,
        DeviceGroup::Accelerator => Branch::DeviceAwareAccelerator,
    };
    Ok(finish(env, choice(picked.row, load_of(env, picked.row), branch, n)))
}
