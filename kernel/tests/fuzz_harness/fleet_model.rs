//! Model-based target: arbitrary sequences of add / update / remove worker,
//! book, select-and-book, retarget, output blocks, prefill completion,
//! release and remote load (other replicas' bookings) against a plain model
//! of the fleet. After every step the fleet's
//! slots, states and counters must equal the model's, and every error must
//! be the one the model predicts.
//!
//! Shared by `fuzz/fuzz_targets/fleet_model.rs` and the regression replay in
//! `kernel/tests/fuzz_regressions.rs` (`#[path]`); see FUZZING.md.

use arbitrary::Arbitrary;
use selkie_kernel::fleet::{
    BookError, BookLoad, Booking, Fleet, FleetError, Outstanding, SelectError, SlotId, SlotState, WorkerSpec,
    WorkerState, COUNTER_MAX, UNLIMITED,
};
use selkie_kernel::kernels::least_loaded::{least_loaded, least_loaded_weighted};
use selkie_kernel::Rng;

const GROUPS: usize = 2;
const ROWS: usize = GROUPS * 8;

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Op {
    Add {
        worker_id: u16,
        limit: u8,
        weight: u8,
    },
    Remove {
        slot: u8,
    },
    SetState {
        slot: u8,
        state: u8,
    },
    SetLimit {
        slot: u8,
        limit: u8,
    },
    SetWeight {
        slot: u8,
        weight: u8,
    },
    Book {
        row: u8,
        prefill: u16,
        decode: u8,
    },
    Select {
        filter: u16,
        prefill: u16,
        decode: u8,
        seed: u64,
        weighted: bool,
    },
    Retarget {
        guard: u8,
        row: u8,
    },
    OutputBlock {
        guard: u8,
    },
    PrefillComplete {
        guard: u8,
    },
    Release {
        guard: u8,
    },
    SetRemote {
        slot: u8,
        requests: u8,
        prefill: u16,
        decode: u8,
    },
}

/// `Debug` prints a pasteable reproducer.
#[derive(Arbitrary, Debug)]
pub struct Input {
    pub ops: Vec<Op>,
}

#[derive(Clone, Copy, Debug)]
struct Occupant {
    worker_id: u64,
    state: SlotState,
    limit: u32,
    weight: f32,
}

#[derive(Clone, Copy, Debug, Default)]
struct ModelRow {
    generation: Option<u32>,
    occupant: Option<Occupant>,
    /// The remote load set on this generation (it stays in the counters
    /// after a remove, until the row is reused).
    remote: Outstanding,
}

#[derive(Clone, Copy, Debug)]
struct ModelGuard {
    slot: SlotId,
    prefill: u32,
    decode: u32,
}

fn limit_of(l: u8) -> u32 {
    if l >= 6 {
        UNLIMITED
    } else {
        l as u32
    }
}

/// `weight / 16`, or NaN (refused) for 0.
fn weight_of(w: u8) -> f32 {
    if w == 0 {
        f32::NAN
    } else {
        w as f32 / 16.0
    }
}

fn effective(limit: u32) -> u32 {
    limit.min(COUNTER_MAX)
}

struct Model {
    rows: [ModelRow; ROWS],
    slots: Vec<SlotId>,
}

impl Model {
    fn current(&self, slot: SlotId) -> bool {
        let r = &self.rows[slot.row as usize];
        r.occupant.is_some() && r.generation == Some(slot.generation)
    }
    /// Requests the row's counter holds: its generation's guards plus its
    /// remote requests.
    fn requests(&self, guards: &[ModelGuard], row: usize) -> u32 {
        let g = self.rows[row].generation;
        let local = guards
            .iter()
            .filter(|m| m.slot.row as usize == row && Some(m.slot.generation) == g)
            .count() as u32;
        local + self.rows[row].remote.requests
    }
    /// Why booking `row` must be refused, if it must.
    fn refusal(&self, guards: &[ModelGuard], row: usize) -> Option<&'static str> {
        match self.rows[row].occupant {
            None => Some("not live"),
            Some(o) if o.state != SlotState::Live => Some("not live"),
            Some(o) if self.requests(guards, row) >= effective(o.limit) => Some("overloaded"),
            Some(_) => None,
        }
    }
}

fn check_refusal(err: BookError, expected: &str, row: usize) {
    match (err, expected) {
        (BookError::NotLive { row: r, .. }, "not live") | (BookError::Overloaded { row: r, .. }, "overloaded") => {
            assert_eq!(r as usize, row)
        }
        other => panic!("row {row}: expected {expected}, got {other:?}"),
    }
}

/// The check the fuzz target runs on every input (panics on a finding).
pub fn check(input: &Input) {
    let fleet = Fleet::<GROUPS>::new();
    let mut model = Model {
        rows: [ModelRow::default(); ROWS],
        slots: Vec::new(),
    };
    let mut guards: Vec<(Booking<&Fleet<GROUPS>, GROUPS>, ModelGuard)> = Vec::new();

    for op in input.ops.iter().take(256).copied() {
        let model_guards: Vec<ModelGuard> = guards.iter().map(|g| g.1).collect();
        match op {
            Op::Add {
                worker_id,
                limit,
                weight,
            } => {
                let spec = WorkerSpec {
                    worker_id: worker_id as u64,
                    dp_rank: 0,
                    capacity_weight: weight_of(weight),
                    admission_limit: limit_of(limit),
                };
                let free = (0..ROWS).find(|&r| model.rows[r].occupant.is_none());
                match (fleet.add(spec), free) {
                    (Err(FleetError::BadCapacityWeight { worker_id: w, .. }), _) if weight == 0 => {
                        assert_eq!(w, worker_id as u64)
                    }
                    (Ok(slot), Some(row)) if weight != 0 => {
                        assert_eq!(slot.row as usize, row, "add takes the lowest free row");
                        assert_ne!(
                            Some(slot.generation),
                            model.rows[row].generation,
                            "a reused row gets a new generation"
                        );
                        model.rows[row] = ModelRow {
                            generation: Some(slot.generation),
                            occupant: Some(Occupant {
                                worker_id: worker_id as u64,
                                state: SlotState::Live,
                                limit: spec.admission_limit,
                                weight: spec.capacity_weight,
                            }),
                            remote: Outstanding::default(),
                        };
                        model.slots.push(slot);
                    }
                    (Err(FleetError::Full { capacity }), None) if weight != 0 => assert_eq!(capacity, ROWS),
                    (got, free) => panic!("add: got {got:?}, free row {free:?}, weight {weight}"),
                }
            }
            Op::Remove { slot }
            | Op::SetState { slot, .. }
            | Op::SetLimit { slot, .. }
            | Op::SetWeight { slot, .. } => {
                let Some(&id) = model.slots.get(slot as usize % model.slots.len().max(1)) else {
                    continue;
                };
                let result = match op {
                    Op::Remove { .. } => fleet.remove(id),
                    Op::SetState { state, .. } => {
                        let s = [WorkerState::Live, WorkerState::Draining, WorkerState::Cordoned][state as usize % 3];
                        fleet.set_state(id, s).map(|()| {
                            if model.current(id) {
                                model.rows[id.row as usize].occupant.as_mut().unwrap().state = s.into();
                            }
                        })
                    }
                    Op::SetLimit { limit, .. } => fleet.set_admission_limit(id, limit_of(limit)).map(|()| {
                        if model.current(id) {
                            model.rows[id.row as usize].occupant.as_mut().unwrap().limit = limit_of(limit);
                        }
                    }),
                    Op::SetWeight { weight, .. } => fleet.set_capacity_weight(id, weight_of(weight)).map(|()| {
                        if model.current(id) {
                            model.rows[id.row as usize].occupant.as_mut().unwrap().weight = weight_of(weight);
                        }
                    }),
                    _ => unreachable!(),
                };
                let current = model.current(id);
                match result {
                    Ok(()) => {
                        assert!(
                            current,
                            "{op:?} on {id:?} succeeded but the model says it is not current"
                        );
                        assert!(
                            !matches!(op, Op::SetWeight { weight: 0, .. }),
                            "{op:?}: a NaN weight accepted"
                        );
                    }
                    Err(FleetError::BadCapacityWeight { worker_id, .. }) => {
                        assert!(
                            current && matches!(op, Op::SetWeight { weight: 0, .. }),
                            "{op:?} on {id:?}: bad weight"
                        );
                        assert_eq!(
                            Some(worker_id),
                            model.rows[id.row as usize].occupant.map(|o| o.worker_id)
                        );
                    }
                    Err(FleetError::Vacant { row, .. }) | Err(FleetError::StaleSlot { row, .. }) => {
                        assert!(!current, "{op:?} on current {id:?} refused");
                        assert_eq!(row, id.row);
                    }
                    Err(e) => panic!("{op:?}: unexpected {e:?}"),
                }
                if matches!(op, Op::Remove { .. }) && current {
                    model.rows[id.row as usize].occupant = None;
                }
            }
            Op::Book { row, prefill, decode } => {
                let row = row as usize % (ROWS + 2);
                let load = BookLoad {
                    prefill_tokens: prefill as u32,
                    decode_blocks: decode as u32,
                };
                let result = Booking::new(&fleet, row, load);
                if row >= ROWS {
                    assert!(matches!(result, Err(BookError::NoSuchRow { .. })), "{result:?}");
                    continue;
                }
                match (result, model.refusal(&model_guards, row)) {
                    (Ok(b), None) => {
                        let slot = b.slot();
                        assert_eq!(Some(slot.generation), model.rows[row].generation);
                        guards.push((
                            b,
                            ModelGuard {
                                slot,
                                prefill: prefill as u32,
                                decode: decode as u32,
                            },
                        ));
                    }
                    (Err(e), Some(why)) => check_refusal(e, why, row),
                    (got, want) => panic!("book row {row}: got {got:?}, model refusal {want:?}"),
                }
            }
            Op::Select {
                filter,
                prefill,
                decode,
                seed,
                weighted,
            } => {
                let mut mask = [0u64; 1];
                fleet.selectable(&mut mask);
                mask[0] &= filter as u64;
                let eligible: Vec<usize> = (0..ROWS).filter(|&r| mask[0] >> r & 1 == 1).collect();
                for &r in &eligible {
                    assert_eq!(
                        model.rows[r].occupant.map(|o| o.state),
                        Some(SlotState::Live),
                        "selectable row {r}"
                    );
                }
                let bookable: Vec<usize> = eligible
                    .iter()
                    .copied()
                    .filter(|&r| model.refusal(&model_guards, r).is_none())
                    .collect();
                let load = BookLoad {
                    prefill_tokens: prefill as u32,
                    decode_blocks: decode as u32,
                };
                let scan = |m: &[u64], rng: &mut Rng| {
                    if weighted {
                        least_loaded_weighted(&fleet.active_requests(), &fleet.inv_capacity_weight(), m, rng)
                    } else {
                        least_loaded(&fleet.active_requests(), m, rng)
                    }
                };
                // The load the scan compares: requests, or requests / weight
                // as the kernel computes it (one f32 multiply by 1 / weight).
                let key = |r: usize| {
                    let requests = model.requests(&model_guards, r) as f32;
                    if weighted {
                        requests * (1.0 / model.rows[r].occupant.unwrap().weight)
                    } else {
                        requests
                    }
                };
                match Booking::select(&fleet, &mut mask, load, &mut Rng::new(seed), scan, ROWS as u32) {
                    Ok(b) => {
                        let row = b.row();
                        assert!(bookable.contains(&row), "selected row {row} not bookable: {bookable:?}");
                        // Refused rows leave the mask and the scan repeats, so
                        // the booked row is the least loaded bookable one.
                        let least = bookable.iter().map(|&r| key(r)).fold(f32::INFINITY, f32::min);
                        assert_eq!(
                            key(row),
                            least,
                            "selected row {row} is not least loaded among {bookable:?}"
                        );
                        let slot = b.slot();
                        guards.push((
                            b,
                            ModelGuard {
                                slot,
                                prefill: prefill as u32,
                                decode: decode as u32,
                            },
                        ));
                    }
                    Err(SelectError::NoEligible) => assert!(eligible.is_empty(), "NoEligible with {eligible:?}"),
                    Err(SelectError::AllOverloaded { .. }) => {
                        assert!(
                            !eligible.is_empty() && bookable.is_empty(),
                            "AllOverloaded with {bookable:?}"
                        )
                    }
                    Err(e) => panic!("select: {e:?}"),
                }
            }
            Op::Retarget { guard, row } => {
                if guards.is_empty() {
                    continue;
                }
                let i = guard as usize % guards.len();
                let row = row as usize % ROWS;
                let same = guards[i].1.slot.row as usize == row && model.current(guards[i].1.slot);
                let refusal = if same { None } else { model.refusal(&model_guards, row) };
                match (guards[i].0.retarget(row), refusal) {
                    (Ok(()), None) => {
                        let slot = guards[i].0.slot();
                        assert_eq!(slot.row as usize, row);
                        guards[i].1.slot = slot;
                    }
                    (Err(e), Some(why)) => check_refusal(e, why, row),
                    (got, want) => panic!("retarget to {row}: got {got:?}, model refusal {want:?}"),
                }
            }
            Op::OutputBlock { guard } => {
                if guards.is_empty() {
                    continue;
                }
                let i = guard as usize % guards.len();
                let current = model.rows[guards[i].1.slot.row as usize].generation == Some(guards[i].1.slot.generation);
                match guards[i].0.add_output_block() {
                    Ok(()) => {
                        assert!(current);
                        guards[i].1.decode += 1;
                    }
                    Err(BookError::Stale { .. }) => assert!(!current, "output block refused on a current booking"),
                    Err(e) => panic!("output block: {e:?}"),
                }
            }
            Op::PrefillComplete { guard } => {
                if guards.is_empty() {
                    continue;
                }
                let i = guard as usize % guards.len();
                guards[i].0.prefill_complete();
                guards[i].1.prefill = 0;
            }
            Op::Release { guard } => {
                if guards.is_empty() {
                    continue;
                }
                let i = guard as usize % guards.len();
                drop(guards.swap_remove(i));
            }
            Op::SetRemote {
                slot,
                requests,
                prefill,
                decode,
            } => {
                let Some(&id) = model.slots.get(slot as usize % model.slots.len().max(1)) else {
                    continue;
                };
                let load = Outstanding {
                    requests: requests as u32,
                    prefill_tokens: prefill as u32,
                    decode_blocks: decode as u32,
                };
                let current = model.current(id);
                match fleet.set_remote_load(id, load) {
                    Ok(held) => {
                        assert!(current, "remote load set on {id:?}, which the model says is gone");
                        assert_eq!(held, load, "small remote loads are held whole");
                        model.rows[id.row as usize].remote = load;
                        assert_eq!(fleet.remote_load(id.row as usize), load);
                    }
                    Err(FleetError::Vacant { row, .. }) | Err(FleetError::StaleSlot { row, .. }) => {
                        assert!(!current, "remote load on current {id:?} refused");
                        assert_eq!(row, id.row);
                    }
                    Err(e) => panic!("{op:?}: unexpected {e:?}"),
                }
            }
        }
        // The fleet equals the model after every step.
        let model_guards: Vec<ModelGuard> = guards.iter().map(|g| g.1).collect();
        for row in 0..ROWS {
            let m = &model.rows[row];
            let info = fleet.worker(row);
            match (m.occupant, info) {
                (None, None) => {}
                (Some(o), Some(i)) => {
                    assert_eq!(
                        (i.worker_id, i.state, i.admission_limit),
                        (o.worker_id, o.state, o.limit),
                        "row {row}"
                    );
                    assert_eq!(i.capacity_weight.to_bits(), o.weight.to_bits(), "row {row}: weight");
                    assert_eq!(Some(i.slot.generation), m.generation, "row {row}");
                }
                (m, f) => panic!("row {row}: model {m:?}, fleet {f:?}"),
            }
            let Some(generation) = m.generation else { continue };
            let mine = model_guards
                .iter()
                .filter(|g| g.slot.row as usize == row && g.slot.generation == generation);
            let remote = m.remote;
            let (requests, prefill, decode) = mine.fold(
                (remote.requests, remote.prefill_tokens, remote.decode_blocks),
                |(r, p, d), g| (r + 1, p + g.prefill, d + g.decode),
            );
            let out = fleet.outstanding(row).expect("row in range");
            assert_eq!(
                (out.requests, out.prefill_tokens, out.decode_blocks),
                (requests, prefill, decode),
                "row {row} counters"
            );
        }
    }
    drop(guards);
    for row in 0..ROWS {
        let out = fleet.outstanding(row).expect("row in range");
        assert_eq!(out, model.rows[row].remote, "row {row}: only the remote load is left");
        if let (Some(generation), Some(_)) = (model.rows[row].generation, model.rows[row].occupant) {
            let slot = SlotId {
                row: row as u32,
                generation,
            };
            fleet
                .set_remote_load(slot, Outstanding::default())
                .expect("a current slot");
        }
        let out = fleet.outstanding(row).expect("row in range");
        if model.rows[row].occupant.is_some() {
            assert_eq!(out, Outstanding::default(), "row {row} leaked");
        }
    }
}
