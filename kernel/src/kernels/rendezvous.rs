//! Bounded-load rendezvous hashing: the prefix-hash policy's kernel.
//!
//! A request carries a 64-bit key (a hash of its prompt's leading blocks).
//! Every row has a salt derived from its worker id and rank
//! ([`worker_salt`]); the row's score for a key is
//! [`rendezvous_score`]`(key, salt)`, and the request goes to the eligible
//! row with the *lowest* score among those under the load bound
//! (rendezvous, or highest-random-weight, hashing). Requests with the same
//! key go to the same row while it has room, and a worker joining or leaving
//! moves only the keys it wins or held.
//!
//! The load bound is consistent hashing with bounded loads (Mirrokni,
//! Thorup and Zadimoghaddam, 2018), with the factor KubeAI's prefix-hash
//! strategy defaults to (1.25): with `n` eligible rows holding `total`
//! requests in flight, a row may take the request only if
//! `load + 1 <= ceil(load_factor * (total + 1) / n)`. At least one eligible
//! row always passes (they cannot all be above the average), so a key's
//! preferred rows fill up to the bound and the rest spill to the key's next
//! rows in score order, never to one fixed overflow row.
//!
//! ```text
//! pass 0: total, n = sum and count of the eligible rows' loads
//!         bound    = ceil(load_factor * (total + 1) / n)
//! key(row) = score(key, salt[row]) >> 1   if load[row] < bound
//!          = u32::MAX                      otherwise
//! then the argmin of `argmin`; ties (two rows with equal salts, or scores
//! that agree in 31 bits) are broken by a draw from a generator seeded by
//! the key, so a key's row depends only on the key and the fleet's state
//! and a key does not bounce between two rows whose salts collide
//! ```
//!
//! Scores are 32-bit: murmur3's finaliser (two multiply-xorshift rounds, a
//! bijection) of the salt xor the key folded to 32 bits, over eight rows at
//! once; for one key, distinct salts never tie on the full score. Loads are unweighted request counts, as KubeAI counts them.

use super::argmin::{argmin, argmin_reference, ArgminKey};
use super::KernelError;
use crate::lanes::{U32Source, LANES};
use crate::mask::contains;
use crate::simd::{dispatch, Simd, U32Lanes};
use crate::Rng;

/// The load factor KubeAI's prefix-hash strategy ships with (its
/// `meanLoadFactor: 125`).
pub const DEFAULT_LOAD_FACTOR: f64 = 1.25;

/// The largest load factor accepted: beyond it the bound never binds on any
/// fleet a `u32` can count.
pub const MAX_LOAD_FACTOR: f64 = 1.0e6;

/// What [`bounded_rendezvous`] chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RendezvousPick {
    /// The chosen row.
    pub row: usize,
    /// The load bound of this request: the chosen row held fewer requests
    /// than this when it was scanned.
    pub load_bound: u64,
}

const C1: u32 = 0x85EB_CA6B;
const C2: u32 = 0xC2B2_AE35;

#[cfg_attr(not(debug_assertions), inline(always))]
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(C1);
    h ^= h >> 13;
    h = h.wrapping_mul(C2);
    h ^ (h >> 16)
}

#[cfg_attr(not(debug_assertions), inline(always))]
fn fmix_lanes<S: Simd>(s: S, h: S::U32) -> S::U32 {
    let h = h.xor(h.shr(16)).mul_lo(s.splat_u32(C1));
    let h = h.xor(h.shr(13)).mul_lo(s.splat_u32(C2));
    h.xor(h.shr(16))
}

/// The rendezvous salt of a worker's rank: a 32-bit hash of its worker id
/// and data-parallel rank (what a fleet row stores when it is added, so
/// that a worker keeps its keys whichever row it lands on).
///
/// ```
/// use selkie_kernel::kernels::rendezvous::worker_salt;
/// assert_ne!(worker_salt(7, 0), worker_salt(7, 1));
/// assert_ne!(worker_salt(7, 0), worker_salt(8, 0));
/// ```
pub const fn worker_salt(worker_id: u64, dp_rank: u32) -> u32 {
    // splitmix64's finaliser over the id, with the rank added as a multiple
    // of the golden ratio.
    let mut z = worker_id.wrapping_add((dp_rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z ^ (z >> 32)) as u32
}

/// The score of a row with salt `salt` for `key`: the row with the lowest
/// score among those under the load bound wins. For one key, distinct salts
/// have distinct scores.
///
/// ```
/// use selkie_kernel::kernels::rendezvous::{rendezvous_score, worker_salt};
/// let (a, b) = (worker_salt(1, 0), worker_salt(2, 0));
/// // Different keys order the same two workers differently, about half the time.
/// let flips = (0..1000u64)
///     .filter(|&k| (rendezvous_score(k, a) < rendezvous_score(k, b)) != (rendezvous_score(0, a) < rendezvous_score(0, b)))
///     .count();
/// assert!((400..600).contains(&flips), "{flips}");
/// ```
#[inline]
pub fn rendezvous_score(key: u64, salt: u32) -> u32 {
    fmix32(salt ^ fold(key))
}

/// The 32 bits of a key the score mixes in.
#[cfg_attr(not(debug_assertions), inline(always))]
const fn fold(key: u64) -> u32 {
    (key ^ (key >> 32)) as u32
}

/// The load bound of a request: `ceil(load_factor * (total + 1) / eligible)`
/// (`eligible > 0`; a bound above `u32::MAX` admits every row).
///
/// ```
/// use selkie_kernel::kernels::rendezvous::load_bound;
/// // 4 rows holding 7 requests: the 8th may go where fewer than ceil(1.25 * 8 / 4) = 3 are.
/// assert_eq!(load_bound(7, 4, 1.25), 3);
/// ```
pub fn load_bound(total: u64, eligible: u32, load_factor: f64) -> u64 {
    // The ceiling by hand (`f64::ceil` needs std); `as` saturates. The
    // bound is at least 1 for a factor of at least 1.
    let x = load_factor * (total as f64 + 1.0) / f64::from(eligible.max(1));
    let t = x as u64;
    let ceil = if (t as f64) < x { t.saturating_add(1) } else { t };
    ceil.max(1)
}

/// The highest load under `bound`, as the lanes compare it.
fn room(bound: u64) -> u32 {
    u32::try_from(bound - 1).unwrap_or(u32::MAX)
}

/// Checks a load factor: finite, at least 1 (below 1 no row may be under
/// the bound) and at most [`MAX_LOAD_FACTOR`].
pub fn check_load_factor(load_factor: f64) -> Result<(), KernelError> {
    if load_factor.is_finite() && (1.0..=MAX_LOAD_FACTOR).contains(&load_factor) {
        Ok(())
    } else {
        Err(KernelError::BadLoadFactor)
    }
}

struct Bounded<'a, A: ?Sized, S: ?Sized> {
    key: u64,
    active: &'a A,
    salts: &'a S,
    /// `bound - 1`: a row is under the bound iff its load is at most this.
    room: u32,
}

impl<A: U32Source + ?Sized, T: U32Source + ?Sized> ArgminKey for Bounded<'_, A, T> {
    type Key = u32;
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn rows(&self) -> usize {
        self.active.rows().min(self.salts.rows())
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn key(&self, row: usize) -> u32 {
        if self.active.value(row) <= self.room {
            rendezvous_score(self.key, self.salts.value(row)) >> 1
        } else {
            u32::MAX
        }
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys<S: Simd>(&self, s: S, group: usize) -> S::U32 {
        self.of(s, self.active.lanes(s, group), self.salts.lanes(s, group))
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn keys8<S: Simd>(&self, s: S, first_group: usize) -> [S::U32; 8] {
        let (load, salt) = (self.active.lanes8(s, first_group), self.salts.lanes8(s, first_group));
        let mut keys = load;
        for (i, k) in keys.iter_mut().enumerate() {
            *k = self.of(s, load[i], salt[i]);
        }
        keys
    }
}

impl<'a, A: ?Sized, T: ?Sized> Bounded<'a, A, T> {
    /// The keys of `key` for `n` eligible rows holding `total` requests,
    /// with the request's load bound; `None` when no row is eligible.
    fn new(key: u64, active: &'a A, salts: &'a T, total: u64, n: u32, load_factor: f64) -> Option<(Self, u64)> {
        if n == 0 {
            return None;
        }
        let load_bound = load_bound(total, n, load_factor);
        let room = room(load_bound);
        Some((
            Bounded {
                key,
                active,
                salts,
                room,
            },
            load_bound,
        ))
    }

    /// The keys of eight rows from their loads and salts.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn of<S: Simd>(&self, s: S, load: S::U32, salt: S::U32) -> S::U32 {
        let over = !load.min(s.splat_u32(self.room)).cmp_eq(load);
        let score = fmix_lanes(s, salt.xor(s.splat_u32(fold(self.key))));
        score.shr(1) | over
    }
}

/// Sum and count of the eligible rows' loads. Each lane sums the low and
/// the high 16 bits of at most 8 loads per mask word apart, so nothing
/// wraps whatever the loads.
#[cfg_attr(not(debug_assertions), inline(always))]
fn eligible_load<S: Simd, A: U32Source + ?Sized>(s: S, active: &A, rows: usize, mask: &[u64]) -> (u64, u32) {
    let full_groups = rows / LANES;
    let low = s.splat_u32(0xFFFF);
    let (mut total, mut n) = (0u64, 0u32);
    for (w, &word) in mask.iter().enumerate().take(rows.div_ceil(64)) {
        if word == 0 {
            continue;
        }
        let (mut lo, mut hi) = (s.splat_u32(0), s.splat_u32(0));
        let mut add = |load: S::U32| {
            lo = lo + (load & low);
            hi = hi + load.shr(16);
        };
        if (w + 1) * 8 <= full_groups {
            // A whole mask word of lane groups: one bounds check.
            let loads = active.lanes8(s, w * 8);
            for (i, &load) in loads.iter().enumerate() {
                let bits = (word >> (8 * i)) as u8;
                add(if word == u64::MAX {
                    load
                } else {
                    load & s.lane_mask(bits)
                });
            }
            n += word.count_ones();
        } else {
            for g in w * 8..full_groups {
                let bits = (word >> (8 * (g - w * 8))) as u8;
                if bits != 0 {
                    add(active.lanes(s, g) & s.lane_mask(bits));
                    n += bits.count_ones();
                }
            }
        }
        total += u64::from(lo.reduce_add()) + (u64::from(hi.reduce_add()) << 16);
    }
    for row in full_groups * LANES..rows {
        if contains(mask, row) {
            total += u64::from(active.value(row));
            n += 1;
        }
    }
    (total, n)
}

/// The generator that breaks a key's ties.
fn tie_breaker(key: u64) -> Rng {
    Rng::new(key ^ 0x7131_E5B2_EA4F_0D1C)
}

#[cfg_attr(not(debug_assertions), inline(always))]
fn bounded_rendezvous_in<S: Simd, A: U32Source + ?Sized, T: U32Source + ?Sized>(
    s: S,
    key: u64,
    active: &A,
    salts: &T,
    mask: &[u64],
    load_factor: f64,
) -> Result<Option<RendezvousPick>, KernelError> {
    check_load_factor(load_factor)?;
    let rows = active.rows().min(salts.rows());
    let (total, n) = eligible_load(s, active, rows, mask);
    let Some((k, load_bound)) = Bounded::new(key, active, salts, total, n, load_factor) else {
        return Ok(None);
    };
    Ok(argmin(s, &k, mask, &mut tie_breaker(key)).map(|row| RendezvousPick { row, load_bound }))
}

dispatch! {
    /// The eligible row (set bit of `mask`) with the lowest
    /// [`rendezvous_score`] for `key` among those whose load (`active`) is
    /// under the request's [`load_bound`]; see the module docs.
    ///
    /// `salts` holds each row's [`worker_salt`]; rows past the shorter of
    /// the two columns are not scanned. `None` iff no row is eligible; an
    /// error iff `load_factor` fails [`check_load_factor`]. Deterministic:
    /// ties are broken by a generator seeded by `key`. Over a live load column that changes during the scan, the row may be
    /// at or over the bound by the time it is booked.
    ///
    /// ```
    /// use selkie_kernel::kernels::rendezvous::{bounded_rendezvous, worker_salt};
        /// let salts: Vec<u32> = (0..4).map(|w| worker_salt(w, 0)).collect();
    /// let mask = [0b1111u64];
    /// let idle = [0u32; 4];
    /// let first = bounded_rendezvous(42, &idle[..], &salts[..], &mask, 1.25).unwrap().unwrap();
    /// // The same key goes to the same row while it has room...
    /// let mut busy = [1u32; 4];
    /// let again = bounded_rendezvous(42, &busy[..], &salts[..], &mask, 1.25).unwrap().unwrap();
    /// assert_eq!(first.row, again.row);
    /// // ...and elsewhere once it holds the bound (ceil(1.25 * 6 / 4) = 2).
    /// busy[first.row] = 2;
    /// let spilled = bounded_rendezvous(42, &busy[..], &salts[..], &mask, 1.25).unwrap().unwrap();
    /// assert_ne!(spilled.row, first.row);
    /// assert_eq!(spilled.load_bound, 2);
    /// ```
    pub fn bounded_rendezvous / bounded_rendezvous_on [A: U32Source + ?Sized, T: U32Source + ?Sized]
        (key: u64, active: &A, salts: &T, mask: &[u64], load_factor: f64)
        -> Result<Option<RendezvousPick>, KernelError>
        = |s| bounded_rendezvous_in(s, key, active, salts, mask, load_factor)
}

/// Scalar reference of [`bounded_rendezvous`].
pub fn bounded_rendezvous_reference<A: U32Source + ?Sized, T: U32Source + ?Sized>(
    key: u64,
    active: &A,
    salts: &T,
    mask: &[u64],
    load_factor: f64,
) -> Result<Option<RendezvousPick>, KernelError> {
    check_load_factor(load_factor)?;
    let rows = active.rows().min(salts.rows());
    let (mut total, mut n) = (0u64, 0u32);
    for row in (0..rows).filter(|&r| contains(mask, r)) {
        total += u64::from(active.value(row));
        n += 1;
    }
    let Some((k, load_bound)) = Bounded::new(key, active, salts, total, n, load_factor) else {
        return Ok(None);
    };
    Ok(argmin_reference(&k, mask, &mut tie_breaker(key)).map(|row| RendezvousPick { row, load_bound }))
}
