//! The fleet states both routers are given: Dynamo's own `worker_selection`
//! fixture, and seeded random fleets with realistic spreads. A [`Scenario`]
//! is plain numbers per worker; the drivers ([`DynamoFixture`],
//! [`SelkieFixture`], [`ServiceFixture`]) each build their own inputs from
//! the same scenario, so every router sees exactly the same state.
//!
//! This module must not know about either router.
//!
//! [`DynamoFixture`]: super::DynamoFixture
//! [`SelkieFixture`]: super::SelkieFixture
//! [`ServiceFixture`]: super::ServiceFixture

use std::fmt;

use selkie_kernel::rng::SplitMix64;

use super::{BLOCK_SIZE, PROMPT_TOKENS};

/// Which fleet state a scenario holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Case {
    /// Dynamo's `worker_selection` fixture (see the [module docs](super)).
    Fixture,
    /// A seeded random fleet ([`Scenario::random`]).
    Random {
        /// The generator's seed.
        seed: u64,
    },
}

impl Case {
    /// The name tables print: `"fixture"` or `"random"`.
    pub fn name(self) -> &'static str {
        match self {
            Case::Fixture => "fixture",
            Case::Random { .. } => "random",
        }
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Case::Fixture => f.write_str("fixture"),
            Case::Random { seed } => write!(f, "random (seed {seed:#x})"),
        }
    }
}

/// One worker's cache hit for the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheHit {
    /// Prompt blocks cached on the device (Dynamo's effective overlap: no
    /// scenario has per-tier overlaps).
    pub device_blocks: u32,
    /// Prompt tokens cached on the worker.
    pub cached_tokens: u32,
}

/// One worker of a scenario. Worker `id` is the scenario's `id`-th worker,
/// one data-parallel rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScenarioWorker {
    /// The request's overlap with the worker's cache; `None`: the worker has
    /// no entry in the request's overlap maps.
    pub hit: Option<CacheHit>,
    /// Prompt tokens the worker is prefilling.
    pub active_prefill_tokens: u32,
    /// KV blocks the worker's running requests hold.
    pub active_decode_blocks: u32,
    /// Requests the worker is running.
    pub active_requests: u32,
}

/// A fleet state: every worker's load and the request's overlap with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    case: Case,
    workers: Vec<ScenarioWorker>,
}

/// Share of a random fleet's workers with a cache hit, in percent.
pub const RANDOM_HIT_PERCENT: u64 = 60;
/// Most requests a random fleet's worker runs.
pub const RANDOM_MAX_REQUESTS: u64 = 48;
/// Most KV blocks one running request of a random fleet holds (8,192
/// tokens of context).
pub const RANDOM_MAX_REQUEST_BLOCKS: u64 = 512;

impl Scenario {
    /// Dynamo's fixture for workers `0..n`: worker `id` has cached tokens
    /// `(id % 32) * 64` (an overlap entry on every worker, zero included),
    /// active prefill tokens `id * 16`, decode blocks `id % 127`, requests
    /// `id % 17`.
    pub fn fixture(n: usize) -> Self {
        let workers = (0..n as u32)
            .map(|id| {
                let (cached_tokens, active_prefill_tokens, active_decode_blocks, active_requests) =
                    crate::dynamo_fixture_worker(id);
                ScenarioWorker {
                    hit: Some(CacheHit {
                        // Exact: the fixture's cached tokens are whole blocks.
                        device_blocks: cached_tokens / BLOCK_SIZE,
                        cached_tokens,
                    }),
                    active_prefill_tokens,
                    active_decode_blocks,
                    active_requests,
                }
            })
            .collect();
        Scenario {
            case: Case::Fixture,
            workers,
        }
    }

    /// A random fleet of `n` workers drawn from `seed`, shaped like a busy
    /// deployment:
    ///
    /// * requests per worker uniform in `0..=48` (about 2% of workers idle);
    /// * each running request holds `1..=512` KV blocks (up to 8,192 tokens
    ///   of context), summed into the worker's decode blocks;
    /// * up to two of a worker's requests are still prefilling, each with a
    ///   uniform share of its own context left to prefill, summed into
    ///   active prefill tokens (so prefill tokens never exceed the blocks
    ///   held, as on a real worker);
    /// * 60% of workers hold a prefix of the 2,048-token prompt: `1..=128`
    ///   device blocks, cached tokens = blocks * 16.
    ///
    /// The same `(n, seed)` always gives the same fleet (drawn from
    /// SplitMix64, which does not change with the selections' generator).
    pub fn random(n: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let prompt_blocks = u64::from(PROMPT_TOKENS.div_ceil(BLOCK_SIZE));
        let workers = (0..n)
            .map(|_| {
                let requests = rng.below(RANDOM_MAX_REQUESTS + 1);
                let prefilling = requests.min(rng.below(3));
                let (mut decode, mut prefill) = (0u64, 0u64);
                for k in 0..requests {
                    let blocks = 1 + rng.below(RANDOM_MAX_REQUEST_BLOCKS);
                    decode += blocks;
                    if k < prefilling {
                        prefill += rng.below(blocks * u64::from(BLOCK_SIZE) + 1);
                    }
                }
                let hit = (rng.below(100) < RANDOM_HIT_PERCENT).then(|| {
                    let device_blocks = 1 + rng.below(prompt_blocks) as u32;
                    CacheHit {
                        device_blocks,
                        cached_tokens: device_blocks * BLOCK_SIZE,
                    }
                });
                ScenarioWorker {
                    hit,
                    active_prefill_tokens: prefill as u32,
                    active_decode_blocks: decode as u32,
                    active_requests: requests as u32,
                }
            })
            .collect();
        Scenario {
            case: Case::Random { seed },
            workers,
        }
    }

    /// Which state this is.
    pub fn case(&self) -> Case {
        self.case
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the fleet has no workers.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The workers; worker `id` is `workers()[id]`.
    pub fn workers(&self) -> &[ScenarioWorker] {
        &self.workers
    }

    /// Workers with a cache hit, with their ids, in id order.
    pub fn hits(&self) -> impl Iterator<Item = (u32, CacheHit)> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(id, w)| w.hit.map(|h| (id as u32, h)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixture_is_dynamos() {
        let s = Scenario::fixture(40);
        let w = s.workers()[35];
        assert_eq!(
            w,
            ScenarioWorker {
                hit: Some(CacheHit {
                    device_blocks: 12,
                    cached_tokens: 192
                }),
                active_prefill_tokens: 560,
                active_decode_blocks: 35,
                active_requests: 1,
            }
        );
        assert_eq!(s.hits().count(), 40, "every worker has an overlap entry");
    }

    #[test]
    fn random_fleets_replay_and_have_realistic_spreads() {
        let a = Scenario::random(10_000, 7);
        assert_eq!(a, Scenario::random(10_000, 7));
        assert_ne!(a, Scenario::random(10_000, 8));
        let hits = a.hits().count();
        assert!((5_700..6_300).contains(&hits), "about 60% hit, got {hits}");
        for w in a.workers() {
            assert!(w.active_decode_blocks >= w.active_prefill_tokens.div_ceil(BLOCK_SIZE));
            assert!(w.active_requests as u64 <= RANDOM_MAX_REQUESTS);
            if w.active_requests == 0 {
                assert_eq!((w.active_prefill_tokens, w.active_decode_blocks), (0, 0));
            }
            if let Some(h) = w.hit {
                assert!((1..=128).contains(&h.device_blocks));
            }
        }
        let distinct = |f: fn(&ScenarioWorker) -> u32| {
            let mut v: Vec<u32> = a.workers().iter().map(f).collect();
            v.sort_unstable();
            v.dedup();
            v.len()
        };
        assert!(distinct(|w| w.active_decode_blocks) > 1_000);
        assert!(distinct(|w| w.active_prefill_tokens) > 1_000);
        assert_eq!(distinct(|w| w.active_requests), 49);
    }
}
