//! Random distributions the workload generator draws from, over the
//! kernel's seedable [`Rng`] so that a whole simulation replays from one seed.
//!
//! Only what the generator needs: exponential gaps (Poisson arrivals),
//! log-normal and uniform lengths, and a Zipf sampler over a finite set.
//! This module must not read clocks or the OS.

use selkie_kernel::Rng;
use serde::{Deserialize, Serialize};

/// An exponential draw with the given mean (inverse transform).
pub fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    // 1 - u is in (0, 1], so the logarithm is finite.
    -mean * (1.0 - rng.unit_f64()).ln()
}

/// A standard normal draw (Box–Muller, one of the pair).
pub fn standard_normal(rng: &mut Rng) -> f64 {
    let u1 = 1.0 - rng.unit_f64();
    let u2 = rng.unit_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
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
    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> u32 {
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
                let v = median * (sigma * standard_normal(rng)).exp();
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
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// A sampler over `n >= 1` ranks with exponent `s >= 0` (`s = 0` is uniform).
    pub fn new(n: usize, s: f64) -> Self {
        let n = n.max(1);
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for k in 0..n {
            total += 1.0 / ((k + 1) as f64).powf(s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Zipf { cdf }
    }

    /// One rank.
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit_f64();
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_mean_is_close() {
        let mut rng = Rng::new(1);
        let n = 20_000;
        let mean = (0..n).map(|_| exponential(&mut rng, 5.0)).sum::<f64>() / n as f64;
        assert!((mean - 5.0).abs() < 0.2, "{mean}");
    }

    #[test]
    fn zipf_rank_zero_dominates_and_uniform_does_not() {
        let mut rng = Rng::new(2);
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

    #[test]
    fn lengths_stay_in_bounds() {
        let mut rng = Rng::new(3);
        let d = LengthDist::LogNormal {
            median: 100.0,
            sigma: 2.0,
            min: 10,
            max: 500,
        };
        let u = LengthDist::Uniform { lo: 3, hi: 5 };
        for _ in 0..5_000 {
            assert!((10..=500).contains(&d.sample(&mut rng)));
            assert!((3..=5).contains(&u.sample(&mut rng)));
        }
        assert_eq!(LengthDist::Fixed(7).sample(&mut rng), 7);
    }
}
