//! Small seedable random generators, so every random choice can be replayed.
//!
//! [`Rng`], the generator every selection draws from, is wyrand (Wang Yi's
//! generator of wyhash, with the constants of its final version, 4.2): 64
//! bits of state advanced by an odd constant (a Weyl sequence, period
//! 2^64), each output one 64x64->128-bit multiply of the state with itself
//! xored with a second constant, the product's two halves xored; it passes
//! BigCrush and PractRand. About half the instructions of a SplitMix64
//! output. [`SplitMix64`] (Steele, Lea & Flood, "Fast splittable
//! pseudorandom number generators", OOPSLA 2014: one add and a 3-round
//! mixer per output, period 2^64, passes BigCrush) is the same
//! [`Generator`] with SplitMix64's output, for callers whose streams must
//! not change with the selections' generator (the host's simulated
//! workloads). Neither is cryptographic; selection only needs draws that
//! are uniform and cheap.
//!
//! Every kernel takes `&mut Rng`, and each documents exactly how many draws it
//! makes, so a SIMD kernel and its scalar reference seeded alike make the same
//! choice, and a selection can be replayed from its seed.
//!
//! [`mix`] is SplitMix64's output function on its own, a bijection, for
//! callers that derive seeds (one per thread, one per request) from a base
//! seed.
//!
//! This module must not read clocks or the OS: seeding is the caller's job.

use core::marker::PhantomData;

/// SplitMix64's output function: spreads the bits of `z` over all 64 (a
/// bijection; consecutive inputs give unrelated outputs). [`SplitMix64`]
/// applies it to its state; a host seeds generators with it.
///
/// ```
/// use selkie_kernel::rng::mix;
/// // SplitMix64's first output from seed 0.
/// assert_eq!(mix(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
/// ```
#[inline]
pub const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How a [`Generator`] advances its state and turns it into 64 random
/// bits.
pub trait Output {
    /// What each draw adds to the state (odd: a generator's states repeat
    /// only after 2^64 draws). Generators seeded `k * INCREMENT` apart run
    /// the same sequence `k` draws apart.
    const INCREMENT: u64;

    /// The output of the state just advanced to `state`.
    fn output(state: u64) -> u64;
}

/// wyrand's output ([`Rng`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WyRand;

impl Output for WyRand {
    const INCREMENT: u64 = 0x2D35_8DCC_AA6C_78A5;

    #[inline(always)]
    fn output(state: u64) -> u64 {
        let m = (state as u128) * ((state ^ 0x8BB8_4B93_962E_ACC9) as u128);
        (m >> 64) as u64 ^ m as u64
    }
}

/// SplitMix64's output ([`SplitMix64`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix;

impl Output for SplitMix {
    const INCREMENT: u64 = 0x9E37_79B9_7F4A_7C15;

    #[inline(always)]
    fn output(state: u64) -> u64 {
        mix(state)
    }
}

/// The generator every selection draws from: wyrand (see the
/// [module](self)).
pub type Rng = Generator<WyRand>;

/// SplitMix64, for streams that must not change with [`Rng`].
pub type SplitMix64 = Generator<SplitMix>;

/// A 64-bit-state generator whose output is `O`'s: [`Rng`] or
/// [`SplitMix64`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generator<O> {
    state: u64,
    output: PhantomData<O>,
}

impl<O: Output> Generator<O> {
    /// What each draw adds to the state ([`Output::INCREMENT`]).
    pub const INCREMENT: u64 = O::INCREMENT;

    /// A generator whose whole future is determined by `seed`.
    ///
    /// ```
    /// use selkie_kernel::Rng;
    /// let mut a = Rng::new(7);
    /// let mut b = Rng::new(7);
    /// assert_eq!(a.next_u64(), b.next_u64());
    /// ```
    pub const fn new(seed: u64) -> Self {
        Generator {
            state: seed,
            output: PhantomData,
        }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(O::INCREMENT);
        O::output(self.state)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias.
    ///
    /// Lemire's multiply-shift with rejection ("Fast random integer
    /// generation in an interval", 2019). Usually one draw; rejection adds a
    /// draw with probability below `n / 2^64`.
    ///
    /// # Panics
    /// If `n == 0` (debug builds; release returns 0).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0, "Rng::below(0)");
        if n == 0 {
            return 0;
        }
        let mut m = (self.next_u64() as u128) * (n as u128);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = (self.next_u64() as u128) * (n as u128);
            }
        }
        (m >> 64) as u64
    }

    /// [`below`](Self::below), split so that its common case (one draw
    /// and one multiply) inlines where it is called: the same draws and
    /// the same value. For a single draw on a hot path (the host's O(1)
    /// picks); the kernels' loops call `below`, whose one body their code
    /// is tuned with.
    ///
    /// ```
    /// use selkie_kernel::Rng;
    /// let (mut a, mut b) = (Rng::new(9), Rng::new(9));
    /// for n in [1, 2, 7, 1 << 40, u64::MAX] {
    ///     assert_eq!(a.below_inlined(n), b.below(n));
    /// }
    /// ```
    #[inline(always)]
    pub fn below_inlined(&mut self, n: u64) -> u64 {
        if n == 0 {
            return self.below(n);
        }
        let m = (self.next_u64() as u128) * (n as u128);
        if (m as u64) < n {
            return self.below_rejecting(n, m);
        }
        (m >> 64) as u64
    }

    /// [`below_inlined`](Self::below_inlined)'s rare case (probability
    /// below `n / 2^64`): `below`'s rejection loop from its first product
    /// `m`. Out of line, so the common case stays small.
    #[cold]
    #[inline(never)]
    fn below_rejecting(&mut self, n: u64, mut m: u128) -> u64 {
        let threshold = n.wrapping_neg() % n;
        while (m as u64) < threshold {
            m = (self.next_u64() as u128) * (n as u128);
        }
        (m >> 64) as u64
    }

    /// An element of `items` at a uniform position (`None` if it is
    /// empty): `items[self.below_inlined(items.len())]`, the same draws,
    /// without the bounds check a caller's index would need.
    ///
    /// ```
    /// use selkie_kernel::Rng;
    /// let (mut a, mut b) = (Rng::new(5), Rng::new(5));
    /// let rows = [3u32, 9, 27, 81];
    /// assert_eq!(a.pick(&rows), Some(rows[b.below(4) as usize]));
    /// assert_eq!(a.pick::<u32>(&[]), None);
    /// ```
    #[inline(always)]
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> Option<T> {
        let n = items.len();
        if n == 0 {
            return None;
        }
        let k = self.below_inlined(n as u64) as usize;
        debug_assert!(k < n);
        // SAFETY: `below_inlined(n)` is the high word of the 128-bit
        // product of a 64-bit draw and `n`, which is below `n`.
        Some(unsafe { *items.get_unchecked(k) })
    }

    /// Two elements of `items` at distinct positions (`None` if it has
    /// fewer than two): the first position uniform, the second uniform
    /// among the others, `(first + 1 + below(n - 1)) mod n` (power of two
    /// choices' draw, as [`power_of_two`](crate::kernels::index::power_of_two)
    /// makes it), without bounds checks.
    ///
    /// ```
    /// use selkie_kernel::Rng;
    /// let (mut a, mut b) = (Rng::new(5), Rng::new(5));
    /// let rows = [3u32, 9, 27, 81];
    /// let first = b.below(4) as usize;
    /// let second = (first + 1 + b.below(3) as usize) % 4;
    /// assert_eq!(a.pick_two(&rows), Some((rows[first], rows[second])));
    /// assert_eq!(a.pick_two(&rows[..1]), None);
    /// ```
    #[inline(always)]
    pub fn pick_two<T: Copy>(&mut self, items: &[T]) -> Option<(T, T)> {
        let n = items.len();
        if n < 2 {
            return None;
        }
        let first = self.below_inlined(n as u64) as usize;
        let after = first + 1 + self.below_inlined(n as u64 - 1) as usize;
        let second = if after >= n { after - n } else { after };
        debug_assert!(first < n && second < n && first != second);
        // SAFETY: `first < n` (see `pick`); `after` is at most
        // `(n - 1) + 1 + (n - 2) = 2n - 2`, so `second` is `after` below
        // `n`, else `after - n <= n - 2`.
        Some(unsafe { (*items.get_unchecked(first), *items.get_unchecked(second)) })
    }

    /// A uniform `f64` in `[0, 1)`, with 53 random bits (one draw).
    #[inline]
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The current state, to record a selection for replay.
    pub const fn state(&self) -> u64 {
        self.state
    }
}

/// The rand ecosystem's generator interface (with the `rand_core` feature):
/// `rand_core::Rng` follows, so `rand_distr`'s distributions draw from a
/// seeded [`Generator`]. `next_u32` is the high half of one 64-bit draw; bytes are
/// filled from whole draws, little-endian.
#[cfg(feature = "rand_core")]
impl<O: Output> rand_core::TryRng for Generator<O> {
    type Error = core::convert::Infallible;

    #[inline]
    fn try_next_u32(&mut self) -> Result<u32, Self::Error> {
        Ok((self.next_u64() >> 32) as u32)
    }

    #[inline]
    fn try_next_u64(&mut self) -> Result<u64, Self::Error> {
        Ok(self.next_u64())
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Self::Error> {
        rand_core::utils::fill_bytes_via_next_word(dst, || self.try_next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_known_answer() {
        // First outputs of SplitMix64 seeded with 0 (reference values from
        // the published algorithm).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    /// `pick` and `pick_two` draw what indexing with `below` would, for
    /// every length up to 70 and many seeds, and draw nothing from a list
    /// too short for them.
    #[test]
    fn picks_are_the_draws_of_below() {
        let items: [u32; 70] = core::array::from_fn(|i| 1000 + i as u32);
        for n in 0..=items.len() {
            let list = &items[..n];
            // Under Miri (which checks the unchecked indexing) fewer seeds.
            for seed in 0..if cfg!(miri) { 30 } else { 300 } {
                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let expected = (n > 0).then(|| list[b.below(n as u64) as usize]);
                assert_eq!(a.pick(list), expected, "n {n}, seed {seed}");
                assert_eq!(a.state(), b.state(), "n {n}, seed {seed}: the same draws");

                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let expected = (n >= 2).then(|| {
                    let first = b.below(n as u64) as usize;
                    let second = (first + 1 + b.below(n as u64 - 1) as usize) % n;
                    assert_ne!(first, second);
                    (list[first], list[second])
                });
                assert_eq!(a.pick_two(list), expected, "n {n}, seed {seed}");
                assert_eq!(a.state(), b.state(), "n {n}, seed {seed}: the same draws");
            }
        }
    }

    /// Every ordered pair of distinct positions is drawn by `pick_two`,
    /// about equally often (the wrap-around included).
    #[test]
    fn pick_two_covers_every_distinct_pair() {
        let items = [0usize, 1, 2, 3, 4];
        let mut seen = [[0u32; 5]; 5];
        let mut r = Rng::new(3);
        // Each of the 20 ordered pairs is expected DRAWS / 20 times.
        const DRAWS: u32 = if cfg!(miri) { 4_000 } else { 20_000 };
        let expected = DRAWS / 20;
        for _ in 0..DRAWS {
            let (a, b) = r.pick_two(&items).unwrap();
            seen[a][b] += 1;
        }
        for (a, row) in seen.iter().enumerate() {
            for (b, &count) in row.iter().enumerate() {
                if a == b {
                    assert_eq!(count, 0, "({a}, {a}) drawn");
                } else {
                    assert!(
                        (expected * 4 / 5..expected * 6 / 5).contains(&count),
                        "({a}, {b}) drawn {count} times of {DRAWS}: {seen:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn wyrand_known_answer() {
        // First outputs of wyrand (wyhash 4.2's constants) seeded with 0,
        // as `fastrand` 2.3's `Rng::with_seed(0).u64(..)` gives them.
        let mut r = Rng::new(0);
        assert_eq!(r.next_u64(), 0x9A45_CD88_8D59_F0D6);
        assert_eq!(r.next_u64(), 0x0144_5B6A_1896_63F5);
        assert_eq!(r.next_u64(), 0x1842_218B_97E7_A496);
    }

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut r = Rng::new(1);
        let mut seen = [0u32; 7];
        for _ in 0..7000 {
            let v = r.below(7) as usize;
            seen[v] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800 && c < 1200), "{seen:?}");
    }

    #[test]
    fn unit_is_half_open() {
        let mut r = Rng::new(3);
        for _ in 0..10_000 {
            let u = r.unit_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
