//! The index kernels: random, power-of-two and round-robin. Each picks an
//! eligible row by its *position among the eligible rows*, so the fast
//! versions work on whole mask words (64 rows per `popcount`) and never look at
//! a row that is not chosen; only power-of-two reads load, and exactly two
//! values of it.
//!
//! ```text
//! n = popcount of the eligibility mask over 0..rows           (word-parallel)
//! random:        k = rng.below(n)                                  1 draw
//! round-robin:   k = ticket mod n                                  0 draws
//! power-of-two:  k1 = rng.below(n)                                 2 draws (0 if n == 1)
//!                k2 = (k1 + 1 + rng.below(n - 1)) mod n            (k2 != k1)
//!                lower load of rows k1, k2 wins, ties to k1
//! row = the k-th set bit                                      (mask::nth)
//! ```
//!
//! # Parity with Dynamo (`dynamo-runtime` 1.6.1 `RoutePicker`)
//!
//! Dynamo applies these policies to its candidate list (the eligible workers
//! in order), so "the k-th eligible row" is exactly its `candidates[k]`:
//!
//! * round-robin: Dynamo's candidate index is `cursor % candidate_count`,
//!   where the cursor is a 64-bit counter that `select` advances with a
//!   `fetch_add` and a preview only loads. The design states this as "the
//!   next eligible row at or after the cursor"; selkie follows Dynamo: the
//!   ticket counts selections, not rows, so over any `n` consecutive tickets
//!   each of the `n` eligible rows is chosen once even when the eligible set is
//!   sparse. The cursor itself (and advancing it, or not, for a preview) belongs
//!   to the fleet; this kernel only maps a ticket to a row.
//! * power-of-two: Dynamo draws the second candidate as
//!   `(first + 1 + uniform(0..n-1)) mod n`, which selkie reproduces (it is a
//!   uniform draw over the other `n - 1` rows), and keeps the first draw when
//!   `load(first) <= load(second)`. With one candidate Dynamo still draws once
//!   and discards nothing of consequence; selkie makes no draw at all then.
//!
//! This module must not book, filter or read any column other than the one
//! load column power-of-two is given.

use crate::lanes::U32Source;
use crate::mask::{contains, count, nth};
use crate::simd::dispatch;
use crate::Rng;

dispatch! {
    /// One eligible row, uniformly at random (word-parallel).
    ///
    /// Makes exactly one `rng.below(n)` draw when `n >= 1` rows among `0..rows`
    /// are eligible; returns `None` without drawing when none is.
    ///
    /// ```
    /// use selkie_kernel::{kernels::index::random, Rng};
    /// let mask = [0b1010_0000u64];
    /// let row = random(8, &mask, &mut Rng::new(3)).unwrap();
    /// assert!(row == 5 || row == 7);
    /// ```
    pub fn random / random_on [] (rows: usize, mask: &[u64], rng: &mut Rng) -> Option<usize>
        = |_s| random_in(rows, mask, rng)
}

/// The body of [`random`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn random_in(rows: usize, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let n = count(mask, rows);
    if n == 0 {
        return None;
    }
    let k = rng.below(n as u64) as usize;
    nth(mask, rows, k)
}

/// Scalar reference of [`random`]: tests each row's bit in turn.
pub fn random_reference(rows: usize, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let n = (0..rows).filter(|&r| contains(mask, r)).count();
    if n == 0 {
        return None;
    }
    let k = rng.below(n as u64) as usize;
    (0..rows).filter(|&r| contains(mask, r)).nth(k)
}

dispatch! {
    /// Power-of-two choices (word-parallel): two distinct eligible rows drawn
    /// uniformly, the one with the lower `load` wins, equal loads go to the first
    /// draw. Rows are `0..load.rows()`.
    ///
    /// Reads exactly two values of `load` (none with fewer than two eligible
    /// rows). Draws: none when no row or one row is eligible, otherwise exactly
    /// two `rng.below` draws (`below(n)` then `below(n - 1)`).
    ///
    /// ```
    /// use selkie_kernel::{kernels::index::power_of_two, Rng};
    /// let in_flight = [9u32, 1];
    /// // With two eligible rows both are always drawn; the lighter one wins.
    /// assert_eq!(power_of_two(&in_flight[..], &[0b11], &mut Rng::new(5)), Some(1));
    /// ```
    pub fn power_of_two / power_of_two_on [L: U32Source + ?Sized] (load: &L, mask: &[u64], rng: &mut Rng) -> Option<usize>
        = |_s| power_of_two_in(load, mask, rng)
}

/// The body of [`power_of_two`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn power_of_two_in<L: U32Source + ?Sized>(load: &L, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let rows = load.rows();
    let n = count(mask, rows);
    if n <= 1 {
        return if n == 1 { nth(mask, rows, 0) } else { None };
    }
    let (k1, k2) = two_distinct(n, rng);
    let first = nth(mask, rows, k1)?;
    let second = nth(mask, rows, k2)?;
    Some(if load.value(first) <= load.value(second) {
        first
    } else {
        second
    })
}

/// Scalar reference of [`power_of_two`]: same draws, same two load reads.
pub fn power_of_two_reference<L: U32Source + ?Sized>(load: &L, mask: &[u64], rng: &mut Rng) -> Option<usize> {
    let rows = load.rows();
    let n = (0..rows).filter(|&r| contains(mask, r)).count();
    match n {
        0 => None,
        1 => (0..rows).find(|&r| contains(mask, r)),
        _ => {
            let k1 = rng.below(n as u64) as usize;
            let k2 = (k1 + 1 + rng.below(n as u64 - 1) as usize) % n;
            let first = (0..rows).filter(|&r| contains(mask, r)).nth(k1)?;
            let second = (0..rows).filter(|&r| contains(mask, r)).nth(k2)?;
            let (a, b) = (load.value(first), load.value(second));
            Some(if a <= b { first } else { second })
        }
    }
}

/// Two distinct positions in `0..n` (`n >= 2`), each pair equally likely,
/// drawn the way Dynamo draws them (see the module docs).
#[cfg_attr(not(debug_assertions), inline(always))]
fn two_distinct(n: usize, rng: &mut Rng) -> (usize, usize) {
    let k1 = rng.below(n as u64) as usize;
    let offset = 1 + rng.below(n as u64 - 1) as usize;
    // k1 + offset < 2n, so one conditional subtraction is the modulo.
    let k2 = k1 + offset;
    (k1, if k2 >= n { k2 - n } else { k2 })
}

dispatch! {
    /// Round-robin (word-parallel): the `(ticket mod n)`-th of the `n` eligible
    /// rows among `0..rows`, so consecutive tickets visit every eligible row once
    /// per round. Makes no draws; `None` when no row is eligible.
    ///
    /// `ticket` is the value of the caller's selection counter: the fleet takes it
    /// with a `fetch_add` to select and with a plain load to peek (see the module
    /// docs for why it counts selections rather than rows).
    ///
    /// ```
    /// use selkie_kernel::kernels::index::round_robin;
    /// let mask = [0b1_0010_0100u64]; // rows 2, 5 and 8
    /// let picks: Vec<_> = (0..4).map(|t| round_robin(9, &mask, t).unwrap()).collect();
    /// assert_eq!(picks, [2, 5, 8, 2]);
    /// ```
    pub fn round_robin / round_robin_on [] (rows: usize, mask: &[u64], ticket: u64) -> Option<usize>
        = |_s| round_robin_in(rows, mask, ticket)
}

/// The body of [`round_robin`].
#[cfg_attr(not(debug_assertions), inline(always))]
fn round_robin_in(rows: usize, mask: &[u64], ticket: u64) -> Option<usize> {
    let n = count(mask, rows);
    if n == 0 {
        return None;
    }
    nth(mask, rows, (ticket % n as u64) as usize)
}

/// Scalar reference of [`round_robin`]: tests each row's bit in turn.
pub fn round_robin_reference(rows: usize, mask: &[u64], ticket: u64) -> Option<usize> {
    let n = (0..rows).filter(|&r| contains(mask, r)).count();
    if n == 0 {
        return None;
    }
    (0..rows)
        .filter(|&r| contains(mask, r))
        .nth((ticket % n as u64) as usize)
}
