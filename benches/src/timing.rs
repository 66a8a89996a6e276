//! The hand-rolled timing loop of the side-by-side benches: the calls being
//! compared take turns in batches of about [`Timing::batch`] wall time (the
//! order rotates every round) for [`Timing::rounds`] rounds, and each call's
//! figure is its median batch time per call. Criterion is not used because
//! the point is ratios measured in one run.

use std::time::{Duration, Instant};

/// Rounds and the target wall time of one batch.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Timed rounds; each round times one batch of each call.
    pub rounds: usize,
    /// Target wall time of one batch.
    pub batch: Duration,
}

/// A timer for `f`: given `k`, calls `f` `k` times and returns ns per call.
/// The loop is generic over `f`, so only the batch call is dynamic.
pub fn batch(mut f: impl FnMut()) -> impl FnMut(usize) -> f64 {
    move |k| {
        let start = Instant::now();
        for _ in 0..k {
            f();
        }
        start.elapsed().as_nanos() as f64 / k as f64
    }
}

impl Timing {
    /// Median ns per call of each timer, timed in turns after a warm-up.
    pub fn interleaved<const K: usize>(&self, mut timers: [&mut dyn FnMut(usize) -> f64; K]) -> [f64; K] {
        let sizes: [usize; K] = core::array::from_fn(|i| self.batch_size(&mut *timers[i]));
        let mut samples: [Vec<f64>; K] = core::array::from_fn(|_| Vec::with_capacity(self.rounds));
        for round in 0..self.rounds {
            for j in 0..K {
                let i = (round + j) % K;
                samples[i].push(timers[i](sizes[i]));
            }
        }
        core::array::from_fn(|i| median(&mut samples[i]))
    }

    /// Median ns per call of `f` alone.
    pub fn one(&self, f: impl FnMut()) -> f64 {
        let [ns] = self.interleaved([&mut batch(f)]);
        ns
    }

    /// Calls per batch so that a batch takes about `self.batch`, after a
    /// 50 ms warm-up.
    fn batch_size(&self, timer: &mut dyn FnMut(usize) -> f64) -> usize {
        let warm_until = Instant::now() + Duration::from_millis(50);
        let mut k = 1;
        let mut ns = timer(k);
        while Instant::now() < warm_until {
            ns = timer(k);
            if ns * (k as f64) < 1e5 {
                k *= 2;
            }
        }
        ((self.batch.as_nanos() as f64 / ns) as usize).max(1)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
