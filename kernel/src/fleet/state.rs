//! The slot state word, the identity of a slot occupant, and the plain data
//! types that describe a worker.
//!
//! ```text
//!  31                                   3    2     1   0
//! +--------------------------------------+--------+-------+
//! | generation (29 bits, wraps)          | WRITER | state |
//! +--------------------------------------+--------+-------+
//! state: 0 Empty, 1 Live, 2 Draining, 3 Cordoned
//! ```
//!
//! All-zero is `Empty`, generation 0, which is what a zeroed fleet holds.
//! `add` bumps the generation; nothing else changes it. The `WRITER` bit is
//! held by `set_capacity_weight` / `set_admission_limit` while they write a
//! row's metadata, so two updates, or an update and a `remove`, never
//! interleave their stores (see `slots`). Bookings ignore it.
//!
//! (The generation is 29 bits, not 30, to make room for the writer bit: a
//! `SlotId` goes stale only after 2^29 reuses of its row.)
//!
//! This module must not touch atomics: only encodings and data.

/// Bits of the state word that hold the [`SlotState`].
const STATE_MASK: u32 = 0b11;
/// The writer bit (see module docs).
pub(crate) const WRITER: u32 = 0b100;
/// Shift of the generation in the state word.
const GENERATION_SHIFT: u32 = 3;
/// Generations wrap modulo `2^29`.
pub(crate) const GENERATION_MASK: u32 = u32::MAX >> GENERATION_SHIFT;

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotState {
    /// No worker (never added, or removed).
    Empty,
    /// A worker that takes new requests.
    Live,
    /// A worker finishing its requests: no new bookings.
    Draining,
    /// A worker taken out of rotation by an operator: no new bookings.
    Cordoned,
}

/// Whether a worker takes new requests: the state a worker may be put in
/// with `Fleet::set_state` (and, in the host, a worker record's state).
///
/// With the `serde` feature it is written in lowercase (`"live"`,
/// `"draining"`, `"cordoned"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum WorkerState {
    /// Takes new requests.
    #[default]
    Live,
    /// Finishing its requests: no new bookings; about to leave.
    Draining,
    /// Out of rotation (maintenance): no new bookings until it is made
    /// live again.
    Cordoned,
}

impl From<WorkerState> for SlotState {
    fn from(s: WorkerState) -> Self {
        match s {
            WorkerState::Live => SlotState::Live,
            WorkerState::Draining => SlotState::Draining,
            WorkerState::Cordoned => SlotState::Cordoned,
        }
    }
}

/// A decoded state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StateWord(pub(crate) u32);

impl StateWord {
    #[inline(always)]
    pub(crate) const fn new(state: SlotState, generation: u32) -> Self {
        let s = match state {
            SlotState::Empty => 0,
            SlotState::Live => 1,
            SlotState::Draining => 2,
            SlotState::Cordoned => 3,
        };
        StateWord((generation & GENERATION_MASK) << GENERATION_SHIFT | s)
    }
    #[inline(always)]
    pub(crate) const fn state(self) -> SlotState {
        match self.0 & STATE_MASK {
            0 => SlotState::Empty,
            1 => SlotState::Live,
            2 => SlotState::Draining,
            _ => SlotState::Cordoned,
        }
    }
    #[inline(always)]
    pub(crate) const fn generation(self) -> u32 {
        self.0 >> GENERATION_SHIFT
    }
    #[inline(always)]
    pub(crate) const fn is_live(self) -> bool {
        self.0 & STATE_MASK == 1
    }
    /// Whether this is `Live` with generation `generation` (the writer bit
    /// ignored): one comparison of the whole word. A `generation` above
    /// [`GENERATION_MASK`] never matches.
    #[inline(always)]
    pub(crate) const fn is_live_of(self, generation: u32) -> bool {
        (self.0 & !WRITER) as u64 == ((generation as u64) << GENERATION_SHIFT | 1)
    }
    /// Whether `now` holds what this word held, the writer bit ignored:
    /// for a word found `Live`, whether `now` is `Live` with the same
    /// generation (`now.is_live_of(self.generation())`, compared with the
    /// masked word already at hand).
    #[inline(always)]
    pub(crate) const fn unchanged_in(self, now: StateWord) -> bool {
        now.0 & !WRITER == self.0 & !WRITER
    }
    #[inline(always)]
    pub(crate) const fn writer_held(self) -> bool {
        self.0 & WRITER != 0
    }
    /// The same word with another state (generation and writer bit kept).
    #[inline(always)]
    pub(crate) const fn with_state(self, state: SlotState) -> Self {
        StateWord(self.0 & !STATE_MASK | StateWord::new(state, 0).0)
    }
}

/// One occupancy of one row: the row, and the generation `add` gave it.
///
/// Every operation that takes a `SlotId` checks the generation, so an id
/// kept after its worker was removed can never act on the row's next
/// occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId {
    /// Row of the fleet's columns.
    pub row: u32,
    /// Generation of the occupancy (29 bits, wraps).
    pub generation: u32,
}

/// A worker to add to the fleet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerSpec {
    /// The caller's worker id (the kernel does not check uniqueness: the
    /// host does).
    pub worker_id: u64,
    /// Data-parallel rank of the worker.
    pub dp_rank: u32,
    /// Relative capacity (finite, `> 0`); least-loaded-weighted divides the
    /// load by it.
    pub capacity_weight: f32,
    /// Most requests in flight at once (bookings are refused at this count).
    /// [`UNLIMITED`] is no limit but the counter's ([`COUNTER_MAX`]); `0`
    /// admits nothing.
    ///
    /// [`COUNTER_MAX`]: crate::fleet::COUNTER_MAX
    pub admission_limit: u32,
}

/// An admission limit that never refuses (up to [`crate::fleet::COUNTER_MAX`]
/// requests in flight).
pub const UNLIMITED: u32 = u32::MAX;

impl WorkerSpec {
    /// A worker of weight 1, rank 0, no admission limit.
    pub const fn new(worker_id: u64) -> Self {
        WorkerSpec {
            worker_id,
            dp_rank: 0,
            capacity_weight: 1.0,
            admission_limit: UNLIMITED,
        }
    }
}

/// A consistent read of one occupied row (see `Fleet::worker`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerInfo {
    /// The occupancy.
    pub slot: SlotId,
    /// Live, Draining or Cordoned.
    pub state: SlotState,
    /// The caller's worker id.
    pub worker_id: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Capacity weight.
    pub capacity_weight: f32,
    /// Admission limit ([`UNLIMITED`] for none). A limit set at or above
    /// [`COUNTER_MAX`](crate::fleet::COUNTER_MAX) admits as `UNLIMITED`
    /// does (up to that many requests) and reads back as `UNLIMITED`.
    pub admission_limit: u32,
}

/// The load a row carries, as its counters hold it now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outstanding {
    /// Requests in flight (including reservations).
    pub requests: u32,
    /// Prefill tokens not yet prefilled.
    pub prefill_tokens: u32,
    /// KV blocks held by decoding requests.
    pub decode_blocks: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `is_live_of` is `is_live` and the generation, whatever the writer
    /// bit; a generation too large for the word never matches.
    #[test]
    fn live_of_a_generation_is_the_state_and_the_generation() {
        for generation in [0, 1, 255, 256, GENERATION_MASK] {
            for state in [
                SlotState::Empty,
                SlotState::Live,
                SlotState::Draining,
                SlotState::Cordoned,
            ] {
                let word = StateWord::new(state, generation);
                for w in [word, StateWord(word.0 | WRITER)] {
                    let live = state == SlotState::Live;
                    assert_eq!(w.is_live_of(generation), live, "{w:?} of {generation}");
                    assert!(!w.is_live_of(generation ^ 1), "{w:?} of another generation");
                    assert!(
                        !w.is_live_of(generation | (GENERATION_MASK + 1)),
                        "{w:?}: a generation past the mask"
                    );
                }
            }
        }
    }

    /// For a word found Live, `unchanged_in(now)` is
    /// `now.is_live_of(generation)`, whatever either writer bit.
    #[test]
    fn an_unchanged_live_word_is_live_of_its_generation() {
        let states = [
            SlotState::Empty,
            SlotState::Live,
            SlotState::Draining,
            SlotState::Cordoned,
        ];
        for generation in [0, 1, 255, 256, GENERATION_MASK] {
            for writer in [0, WRITER] {
                let found = StateWord(StateWord::new(SlotState::Live, generation).0 | writer);
                for now_generation in [generation, generation ^ 1, generation.wrapping_sub(1) & GENERATION_MASK] {
                    for state in states {
                        for now_writer in [0, WRITER] {
                            let now = StateWord(StateWord::new(state, now_generation).0 | now_writer);
                            assert_eq!(
                                found.unchanged_in(now),
                                now.is_live_of(generation),
                                "{found:?} then {now:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
