//! Workloads: the requests a simulation replays, generated from a
//! [`WorkloadSpec`] (Poisson or bursty arrivals, shared system prompts with
//! Zipf popularity, multi-turn sessions whose prompts extend the previous
//! turn, log-normal lengths) or read from a trace ([`super::trace`]).
//!
//! Prompts are described the way a router's KV indexer sees them: one hash
//! per block of `block_size` tokens, where equal hashes mean equal prefixes.
//! Generation is a pure function of the spec and the seed.

use serde::{Deserialize, Serialize};

use super::dist::{exponential, LengthDist, WorkloadRng, Zipf};
use super::memory::{request_bytes, MemoryLimit};
use super::SimError;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SimRequest {
    /// Arrival time in milliseconds from the start of the run.
    pub arrival_ms: f64,
    /// Prompt length in tokens.
    pub input_tokens: u32,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
    /// One hash per prompt block (`ceil(input_tokens / block_size)` of them).
    pub hash_ids: Vec<u64>,
    /// Hashes of the generated blocks that a later prompt reuses (the next
    /// turn of a session); cached by the worker when the request completes.
    pub output_hash_ids: Vec<u64>,
    /// The multi-turn session this request belongs to, if any.
    pub session: Option<u64>,
}

/// A list of requests in arrival order, with the block size their hashes use.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// Tokens per hashed block.
    pub block_size: u32,
    /// Requests, sorted by arrival.
    pub requests: Vec<SimRequest>,
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrivals {
    /// A Poisson process of `rate_per_s` requests per second.
    Poisson {
        /// Mean requests per second.
        rate_per_s: f64,
    },
    /// A two-state Markov-modulated Poisson process: bursts of
    /// `burst_factor` times the mean rate lasting `burst_ms` on average,
    /// separated by calm spells of `calm_ms` on average whose rate keeps the
    /// long-run mean at `rate_per_s`.
    Bursty {
        /// Long-run mean requests per second.
        rate_per_s: f64,
        /// Rate multiplier during a burst.
        burst_factor: f64,
        /// Mean burst length, in milliseconds.
        burst_ms: f64,
        /// Mean calm length, in milliseconds.
        calm_ms: f64,
    },
}

impl Arrivals {
    /// The long-run mean rate, in requests per second.
    pub fn rate_per_s(&self) -> f64 {
        match *self {
            Arrivals::Poisson { rate_per_s } | Arrivals::Bursty { rate_per_s, .. } => rate_per_s,
        }
    }

    /// The same process at another mean rate.
    pub fn with_rate(self, rate: f64) -> Self {
        match self {
            Arrivals::Poisson { .. } => Arrivals::Poisson { rate_per_s: rate },
            Arrivals::Bursty {
                burst_factor,
                burst_ms,
                calm_ms,
                ..
            } => Arrivals::Bursty {
                rate_per_s: rate,
                burst_factor,
                burst_ms,
                calm_ms,
            },
        }
    }

    /// `n` arrival times (ms) of new conversations at `scale` times the rate.
    fn times(&self, n: usize, scale: f64, rng: &mut WorkloadRng) -> Vec<f64> {
        let mut out = Vec::with_capacity(n);
        let mut t = 0.0;
        match *self {
            Arrivals::Poisson { rate_per_s } => {
                let mean_gap = 1000.0 / (rate_per_s * scale).max(1e-9);
                while out.len() < n {
                    t += exponential(rng, mean_gap);
                    out.push(t);
                }
            }
            Arrivals::Bursty {
                rate_per_s,
                burst_factor,
                burst_ms,
                calm_ms,
            } => {
                let rate = rate_per_s * scale;
                let burst_rate = rate * burst_factor.max(1.0);
                let calm_rate =
                    ((rate * (burst_ms + calm_ms) - burst_rate * burst_ms) / calm_ms.max(1e-9)).max(rate * 0.05);
                let mut in_burst = false;
                let mut state_end = exponential(rng, calm_ms);
                while out.len() < n {
                    let r = if in_burst { burst_rate } else { calm_rate };
                    let next = t + exponential(rng, 1000.0 / r.max(1e-9));
                    if next > state_end {
                        // Memorylessness: restart the draw at the switch.
                        t = state_end;
                        in_burst = !in_burst;
                        state_end = t + exponential(rng, if in_burst { burst_ms } else { calm_ms });
                    } else {
                        t = next;
                        out.push(t);
                    }
                }
            }
        }
        out
    }
}

/// Parameters of a generated workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Number of requests.
    pub requests: usize,
    /// Tokens per block.
    pub block_size: u32,
    /// The arrival process of requests (session turns included).
    pub arrivals: Arrivals,
    /// Distinct shared system prompts.
    pub system_prompts: usize,
    /// Length of each system prompt (rounded up to whole blocks).
    pub system_prompt_tokens: LengthDist,
    /// Zipf exponent of system-prompt popularity (0 = uniform).
    pub zipf_s: f64,
    /// Probability that a new conversation is a multi-turn session.
    pub session_fraction: f64,
    /// Turns per multi-turn session.
    pub session_turns: LengthDist,
    /// Mean time between the turns of a session, in milliseconds.
    pub think_time_ms: f64,
    /// New user tokens per prompt (after the system prompt and history).
    pub user_tokens: LengthDist,
    /// Output tokens per request.
    pub output_tokens: LengthDist,
}

/// A hash for block `index` of `stream`, distinct across streams.
fn block_hash(stream: u64, index: u64, salt: u64) -> u64 {
    let mut r = WorkloadRng::new(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.rotate_left(32) ^ salt);
    r.next_u64()
}

impl WorkloadSpec {
    /// Generates the workload; the same spec and seed give the same
    /// requests. Check the spec first ([`validate`](Self::validate)): a
    /// spec outside the [`limits`](super::limits) may allocate without
    /// bound, and one inside them may still need more memory than the
    /// machine has (see [`generate_within`](Self::generate_within)).
    pub fn generate(&self, seed: u64) -> Workload {
        match self.generate_within(seed, &MemoryLimit::none()) {
            Ok(w) => w,
            Err(e) => unreachable!("no memory limit, yet: {e}"),
        }
    }

    /// [`generate`](Self::generate), refused with [`SimError::OverMemory`]
    /// as soon as the requests kept pass `limit` (see [`super::memory`]).
    /// Only the `requests` earliest requests are ever kept while
    /// generating.
    pub fn generate_within(&self, seed: u64, limit: &MemoryLimit) -> Result<Workload, SimError> {
        self.generate_keeping(seed, limit, self.requests)
    }

    /// The generator, keeping the `keep` earliest requests (the tests keep
    /// them all and truncate, to check that keeping only `requests` while
    /// generating changes nothing).
    fn generate_keeping(&self, seed: u64, limit: &MemoryLimit, keep: usize) -> Result<Workload, SimError> {
        let mut rng = WorkloadRng::new(seed);
        let bs = self.block_size.max(1);
        let prompts: Vec<Vec<u64>> = (0..self.system_prompts.max(1))
            .map(|p| {
                let blocks = self.system_prompt_tokens.sample(&mut rng).div_ceil(bs);
                (0..blocks)
                    .map(|j| block_hash(p as u64, u64::from(j), 0x5157))
                    .collect()
            })
            .collect();
        let popularity = Zipf::new(prompts.len(), self.zipf_s);
        let mean_turns = 1.0 + self.session_fraction * (self.session_turns.mean() - 1.0).max(0.0);
        // Conversations start a warm-up window before time 0, so that at
        // time 0 sessions are already in their later turns and the request
        // rate is the target one from the first request on; requests before
        // 0 are dropped. Conversations also run past the end (later turns of
        // the last ones), so more are started than needed and the first
        // `requests` arrivals kept.
        // The warm-up covers at most twice the run's expected span: at high
        // rates later turns fall past the run's end anyway, and a longer
        // warm-up would only generate conversations that are dropped.
        let conv_rate = self.arrivals.rate_per_s() / mean_turns;
        let span_ms = 1000.0 * self.requests as f64 / self.arrivals.rate_per_s();
        let warmup_ms = (self.think_time_ms * (self.session_turns.mean() - 1.0).max(0.0)).min(2.0 * span_ms);
        let in_warmup = conv_rate * warmup_ms / 1000.0;
        let conversations = ((1.5 * self.requests as f64 / mean_turns + in_warmup).ceil() as usize).max(1);
        let starts: Vec<f64> = self
            .arrivals
            .times(conversations, 1.0 / mean_turns, &mut rng)
            .into_iter()
            .map(|t| t - warmup_ms)
            .collect();
        let mut kept = Earliest::new(keep, 0.0, limit);
        for (c, &start) in starts.iter().enumerate() {
            // Conversations start in order, and their turns after their
            // start: once the earliest `requests` are all before this one,
            // no later conversation has a request to keep.
            if kept.full_before(start) {
                break;
            }
            let conv = (c as u64) << 20 | 0xC0;
            let is_session = rng.unit_f64() < self.session_fraction;
            let turns = if is_session {
                self.session_turns.sample(&mut rng).max(1)
            } else {
                1
            };
            let prompt = &prompts[popularity.sample(&mut rng)];
            let sys_tokens = prompt.len() as u32 * bs;
            // Tokens of the conversation after the system prompt so far.
            let mut history = 0u32;
            let mut t = start;
            for turn in 0..turns {
                let user = self.user_tokens.sample(&mut rng).max(1);
                let output = self.output_tokens.sample(&mut rng).max(1);
                let conv_tokens = history + user;
                let input = sys_tokens + conv_tokens;
                let full = conv_tokens / bs;
                let mut hash_ids = prompt.clone();
                hash_ids.extend((0..full).map(|j| block_hash(conv, u64::from(j), 0)));
                if conv_tokens > full * bs {
                    hash_ids.push(block_hash(conv, u64::from(full), 1 + u64::from(turn)));
                }
                let after = conv_tokens + output;
                let output_hash_ids = if turn + 1 < turns {
                    (full..after / bs).map(|j| block_hash(conv, u64::from(j), 0)).collect()
                } else {
                    Vec::new()
                };
                kept.push(SimRequest {
                    arrival_ms: t,
                    input_tokens: input,
                    output_tokens: output,
                    hash_ids,
                    output_hash_ids,
                    session: is_session.then_some(c as u64),
                })?;
                history = after;
                t += exponential(&mut rng, self.think_time_ms);
            }
        }
        Ok(Workload {
            block_size: bs,
            requests: kept.into_sorted(),
        })
    }
}

/// A request kept while generating, ordered by arrival, then by when it
/// was generated (so the order is that of a stable sort by arrival).
struct Kept {
    seq: u64,
    request: SimRequest,
}

impl Kept {
    fn key(&self) -> (f64, u64) {
        (self.request.arrival_ms, self.seq)
    }
}

impl PartialEq for Kept {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Kept {}
impl PartialOrd for Kept {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Kept {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let ((a, i), (b, j)) = (self.key(), other.key());
        a.total_cmp(&b).then(i.cmp(&j))
    }
}

/// The `n` earliest requests at or after time `from` of those pushed, in a
/// max-heap (the latest on top, dropped when one more arrives), with the
/// bytes they hold counted against a memory limit.
pub(crate) struct Earliest<'a> {
    n: usize,
    from: f64,
    heap: std::collections::BinaryHeap<Kept>,
    seq: u64,
    bytes: u64,
    limit: &'a MemoryLimit,
}

impl<'a> Earliest<'a> {
    pub(crate) fn new(n: usize, from: f64, limit: &'a MemoryLimit) -> Self {
        Earliest {
            n,
            from,
            heap: std::collections::BinaryHeap::new(),
            seq: 0,
            bytes: 0,
            limit,
        }
    }

    /// Whether `n` requests are kept and all arrive before `t`.
    pub(crate) fn full_before(&self, t: f64) -> bool {
        self.heap.len() >= self.n && self.heap.peek().is_some_and(|k| k.request.arrival_ms < t)
    }

    /// Keeps `request` if it is among the `n` earliest so far.
    pub(crate) fn push(&mut self, request: SimRequest) -> Result<(), SimError> {
        if request.arrival_ms < self.from || self.n == 0 {
            return Ok(());
        }
        self.seq += 1;
        self.bytes += request_bytes(&request);
        self.heap.push(Kept { seq: self.seq, request });
        if self.heap.len() > self.n {
            if let Some(latest) = self.heap.pop() {
                self.bytes -= request_bytes(&latest.request);
            }
        }
        // A run of `n` requests; of those read so far when `n` is open.
        let requests = if self.n == usize::MAX { self.heap.len() } else { self.n };
        self.limit.check(requests, self.bytes, true)
    }

    pub(crate) fn into_sorted(self) -> Vec<SimRequest> {
        self.heap.into_sorted_vec().into_iter().map(|k| k.request).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeping_the_earliest_while_generating_gives_the_whole_workload_truncated() {
        for (rate, sessions) in [(100.0, 0.5), (1e6, 0.9), (5.0, 0.0)] {
            let spec = WorkloadSpec {
                arrivals: Arrivals::Poisson { rate_per_s: rate },
                session_fraction: sessions,
                ..spec()
            };
            let kept = spec.generate(11);
            let mut all = spec.generate_keeping(11, &MemoryLimit::none(), usize::MAX).unwrap();
            assert!(all.requests.len() >= kept.requests.len(), "rate {rate}");
            all.requests.truncate(spec.requests);
            assert_eq!(kept, all, "rate {rate}");
        }
    }

    #[test]
    fn generating_stops_at_the_memory_limit() {
        let limit = MemoryLimit::cli(64 << 10);
        match spec().generate_within(3, &limit) {
            Err(SimError::OverMemory {
                field, requests, need, ..
            }) => {
                assert_eq!((field.as_str(), requests), ("--requests", 2_000));
                assert!(need.starts_with("at least 64."), "{need}");
            }
            other => panic!("{:?}", other.map(|w| w.requests.len())),
        }
        assert!(spec().generate_within(3, &MemoryLimit::cli(64 << 20)).is_ok());
    }

    fn spec() -> WorkloadSpec {
        WorkloadSpec {
            requests: 2_000,
            block_size: 16,
            arrivals: Arrivals::Poisson { rate_per_s: 100.0 },
            system_prompts: 8,
            system_prompt_tokens: LengthDist::Fixed(256),
            zipf_s: 1.2,
            session_fraction: 0.5,
            session_turns: LengthDist::Uniform { lo: 2, hi: 4 },
            think_time_ms: 500.0,
            user_tokens: LengthDist::Uniform { lo: 10, hi: 100 },
            output_tokens: LengthDist::Uniform { lo: 20, hi: 60 },
        }
    }

    #[test]
    fn generation_is_reproducible_and_sorted() {
        let a = spec().generate(7);
        assert_eq!(a, spec().generate(7));
        assert_ne!(a, spec().generate(8));
        assert_eq!(a.requests.len(), 2_000);
        assert!(a.requests.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        for r in &a.requests {
            assert_eq!(r.hash_ids.len() as u32, r.input_tokens.div_ceil(16));
        }
        // Arrival rate is the requested one (within 10%).
        let span_s = a.requests.last().unwrap().arrival_ms / 1000.0;
        let rate = 2_000.0 / span_s;
        assert!((rate - 100.0).abs() < 10.0, "{rate}");
    }

    #[test]
    fn session_turns_extend_the_previous_prompt_and_output() {
        let w = spec().generate(3);
        let mut checked = 0;
        for (i, r) in w.requests.iter().enumerate() {
            let Some(s) = r.session else { continue };
            let Some(next) = w.requests[i + 1..].iter().find(|n| n.session == Some(s)) else {
                continue;
            };
            // The next turn starts with this prompt's full blocks, then the
            // cached output blocks.
            let full = (r.input_tokens / 16) as usize;
            assert_eq!(next.hash_ids[..full], r.hash_ids[..full]);
            let outs = r.output_hash_ids.len();
            assert_eq!(next.hash_ids[full..full + outs], r.output_hash_ids[..]);
            checked += 1;
        }
        assert!(checked > 100, "{checked}");
    }

    #[test]
    fn zipf_makes_one_system_prompt_dominant() {
        let w = spec().generate(5);
        let mut counts = std::collections::HashMap::new();
        for r in &w.requests {
            *counts.entry(r.hash_ids[0]).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 8);
        let max = *counts.values().max().unwrap();
        let min = *counts.values().min().unwrap();
        assert!(max > 5 * min, "{counts:?}");
    }

    #[test]
    fn bursty_arrivals_keep_the_mean_rate_but_cluster() {
        let mut rng = WorkloadRng::new(1);
        let bursty = Arrivals::Bursty {
            rate_per_s: 100.0,
            burst_factor: 5.0,
            burst_ms: 500.0,
            calm_ms: 2_000.0,
        };
        let t = bursty.times(20_000, 1.0, &mut rng);
        let rate = 20_000.0 / (t.last().unwrap() / 1000.0);
        assert!((rate - 100.0).abs() < 15.0, "{rate}");
        // Squared coefficient of variation of gaps: 1 for Poisson, larger here.
        let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!(var / (mean * mean) > 1.5, "{}", var / (mean * mean));
    }
}
