//! The random distributions the workload generator draws from: `rand_distr`'s,
//! over the kernel's seedable SplitMix64 ([`WorkloadRng`], which implements
//! the rand ecosystem's generator interface), so that a whole simulation
//! replays from one seed.
//!
//! Only the shapes the generator needs: exponential gaps (Poisson arrivals),
//! log-normal and uniform lengths ([`LengthDist`], a scenario's field), and
//! Zipf popularity over a finite set of ranks ([`Zipf`]). This module must
//! not read clocks or the OS.

use rand_distr::{Distribution, Exp1};
use selkie_kernel::rng::SplitMix64;
use serde::{Deserialize, Serialize};

/// The generator a simulation's workload and the tuner's search draw
/// from: SplitMix64, apart from the kernel's [`Rng`](selkie_kernel::Rng)
/// that selections draw from, so that a scenario's requests (and a
/// tuning's candidates) stay the same whatever generator selections use.
pub type WorkloadRng = SplitMix64;

/// An exponential draw with the given mean.
pub fn exponential(rng: &mut WorkloadRng, mean: f64) -> f64 {
    let unit: f64 = Exp1.sample(rng);
    mean * unit
}

/// A distribution of token counts (prompt, output or turn lengths).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LengthDist {
    /// Always `n`.
    Fixed(u32),
    /// Uniform in `lo..=hi`.
    Uniform {
        /// Smallest value.
        lo: u32,
        /// Largest value.
        hi: u32,
    },
    /// Log-normal with the given median and log-space standard deviation,
    /// clamped to `min..=max`.
    LogNormal {
        /// The median (`exp(mu)`).
        median: f64,
        /// Standard deviation of the logarithm.
        sigma: f64,
        /// Smallest value.
        min: u32,
        /// Largest value.
        max: u32,
    },
}

impl LengthDist {
    /// One draw. A log-normal whose parameters `rand_distr` refuses (a
    /// median that is not positive and finite, a negative or non-finite
    /// sigma: the scenario limits refuse them first) gives its median,
    /// clamped.
    pub fn sample(&self, rng: &mut WorkloadRng) -> u32 {
        match *self {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { lo, hi } => {
                let (lo, hi) = (lo.min(hi), lo.max(hi));
                lo + rng.below(u64::from(hi - lo) + 1) as u32
            }
            LengthDist::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                let v = rand_distr::LogNormal::new(median.ln(), sigma).map_or(median, |d| d.sample(rng));
                (v.round().clamp(f64::from(min), f64::from(max.max(min)))) as u32
            }
        }
    }

    /// The distribution's mean (before clamping, for log-normal).
    pub fn mean(&self) -> f64 {
        match *self {
            LengthDist::Fixed(n) => f64::from(n),
            LengthDist::Uniform { lo, hi } => (f64::from(lo) + f64::from(hi)) / 2.0,
            LengthDist::LogNormal { median, sigma, .. } => median * (sigma * sigma / 2.0).exp(),
        }
    }
}

/// Zipf-distributed ranks in `0..n`: rank `k` has probability proportional
/// to `1 / (k + 1)^s`. Rank 0 is the most popular.
#[derive(Clone, Copy, Debug)]
pub struct Zipf {
    zipf: rand_distr::Zipf<f64>,
    n: usize,
}

impl Zipf {
    /// A sampler over `n >= 1` ranks with exponent `s >= 0` (`s = 0` is
    /// uniform; a negative or non-finite `s` counts as 0).
    pub fn new(n: usize, s: f64) -> Self {
        let n = n.max(1);
        let s = if s.is_finite() && s > 0.0 { s } else { 0.0 };
        let zipf = rand_distr::Zipf::new(n as f64, s).expect("n >= 1 and s >= 0 are valid");
        Zipf { zipf, n }
    }

    /// One rank.
    pub fn sample(&self, rng: &mut WorkloadRng) -> usize {
        // `rand_distr` draws in `1..=n`, as a float.
        (self.zipf.sample(rng) as usize).clamp(1, self.n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rand_distr` draws the kernel generator's own words: a `u64` is one
    /// `next_u64`, a `u32` its high half.
    #[test]
    fn rand_distr_draws_the_kernel_generators_words() {
        use rand_distr::StandardUniform;
        let (mut a, mut b) = (WorkloadRng::new(11), WorkloadRng::new(11));
        for _ in 0..4 {
            let x: u64 = StandardUniform.sample(&mut a);
            assert_eq!(x, b.next_u64());
            let y: u32 = StandardUniform.sample(&mut a);
            assert_eq!(y, (b.next_u64() >> 32) as u32);
        }
    }

    #[test]
    fn exponential_mean_is_close() {
        let mut rng = WorkloadRng::new(1);
        let n = 20_000;
        let mean = (0..n).map(|_| exponential(&mut rng, 5.0)).sum::<f64>() / n as f64;
        assert!((mean - 5.0).abs() < 0.2, "{mean}");
    }

    #[test]
    fn zipf_rank_zero_dominates_and_uniform_does_not() {
        let mut rng = WorkloadRng::new(2);
        let skewed = Zipf::new(10, 1.5);
        let mut counts = [0u32; 10];
        for _ in 0..10_000 {
            counts[skewed.sample(&mut rng)] += 1;
        }
        // P(0) = 1 / H(10, 1.5) ~ 0.50; P(9) ~ 0.016.
        assert!(counts[0] > 4_600 && counts[0] < 5_400, "{counts:?}");
        assert!(counts[0] > 10 * counts[9], "{counts:?}");
        let flat = Zipf::new(4, 0.0);
        let mut counts = [0u32; 4];
        for _ in 0..8_000 {
            counts[flat.sample(&mut rng)] += 1;
        }
        assert!(counts.iter().all(|&c| (1_800..2_200).contains(&c)), "{counts:?}");
    }

    /// The log-normal's median is its parameter: half the draws fall below.
    #[test]
    fn log_normal_lengths_have_their_median_and_stay_in_bounds() {
        let mut rng = WorkloadRng::new(3);
        let d = LengthDist::LogNormal {
            median: 100.0,
            sigma: 2.0,
            min: 10,
            max: 500,
        };
        let u = LengthDist::Uniform { lo: 3, hi: 5 };
        let mut below = 0;
        for _ in 0..5_000 {
            let v = d.sample(&mut rng);
            assert!((10..=500).contains(&v));
            below += usize::from(v < 100);
            assert!((3..=5).contains(&u.sample(&mut rng)));
        }
        assert!((2_300..2_700).contains(&below), "{below} of 5000 below the median");
        assert_eq!(LengthDist::Fixed(7).sample(&mut rng), 7);
    }
}
