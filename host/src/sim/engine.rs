//! One simulated inference engine (one data-parallel rank of a worker):
//! continuous batching with chunked prefill over a [`KvCache`].
//!
//! Each step runs every decoding request for one token and spends what is
//! left of the token budget on prefill, oldest request first. A step lasts
//!
//! ```text
//! step_overhead_ms + prefill_ms_per_token * prefill_tokens + decode_ms_per_seq * decoding_requests
//! ```
//!
//! so prefill time grows with the tokens the cache did not hold, and the time
//! per output token grows with the batch. A waiting request is admitted only
//! when its blocks fit in the cache next to the running ones (a lone request
//! always runs). The engine knows nothing of routing; the event loop in
//! [`super::run`] drives it.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::cache::KvCache;
use super::workload::SimRequest;

/// Speed and batch limits of one engine.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimingModel {
    /// Fixed cost of every step, in milliseconds.
    pub step_overhead_ms: f64,
    /// Prefill cost per uncached prompt token, in milliseconds.
    pub prefill_ms_per_token: f64,
    /// Decode cost per running request per step, in milliseconds.
    pub decode_ms_per_seq: f64,
    /// Token budget of one step (decode tokens count one each).
    pub max_batched_tokens: u32,
    /// Most requests running at once.
    pub max_running: u32,
}

impl Default for TimingModel {
    /// Roughly an 8B model on one modern accelerator: ~40k prefill tokens/s,
    /// 6 ms per decode step at batch 1, 11 ms at batch 64.
    fn default() -> Self {
        TimingModel {
            step_overhead_ms: 6.0,
            prefill_ms_per_token: 0.025,
            decode_ms_per_seq: 0.08,
            max_batched_tokens: 8192,
            max_running: 128,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Running {
    request: usize,
    remaining_prefill: u32,
    chunk: u32,
    remaining_decode: u32,
    generated: u32,
    anonymous_blocks: u32,
}

/// Something that happened to a request during a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepEvent {
    /// The request was admitted with this many prompt tokens served from cache.
    Admitted {
        /// Request index.
        request: usize,
        /// Prompt tokens found in the cache.
        cached_tokens: u32,
    },
    /// The prefill finished and the first token came out.
    FirstToken(usize),
    /// The request filled another output block.
    OutputBlock(usize),
    /// The last token came out; the request left the engine.
    Finished(usize),
}

/// One engine: a queue, a running batch and a KV cache.
#[derive(Clone, Debug)]
pub struct Engine {
    /// The engine's KV cache.
    pub cache: KvCache,
    waiting: VecDeque<usize>,
    prefilling: Vec<Running>,
    decoding: Vec<Running>,
    stepping: bool,
}

impl Engine {
    /// An idle engine with a cache of `kv_blocks` blocks.
    pub fn new(kv_blocks: u32) -> Self {
        Engine {
            cache: KvCache::new(kv_blocks),
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            decoding: Vec::new(),
            stepping: false,
        }
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        self.waiting.len() + self.prefilling.len() + self.decoding.len()
    }

    /// Whether a step is under way.
    pub fn is_stepping(&self) -> bool {
        self.stepping
    }

    /// Queues a routed request.
    pub fn enqueue(&mut self, request: usize) {
        self.waiting.push_back(request);
    }

    /// Admits what fits and plans one step. Returns its duration in ms, or
    /// `None` when there is nothing to run. Admissions go to `events`.
    pub fn start_step(
        &mut self,
        requests: &[SimRequest],
        block_size: u32,
        model: &TimingModel,
        events: &mut Vec<StepEvent>,
    ) -> Option<f64> {
        debug_assert!(!self.stepping);
        while let Some(&r) = self.waiting.front() {
            if self.prefilling.len() + self.decoding.len() >= model.max_running as usize {
                break;
            }
            let req = &requests[r];
            let total_blocks = (req.input_tokens + req.output_tokens).div_ceil(block_size);
            let anonymous_blocks = total_blocks.saturating_sub(req.hash_ids.len() as u32);
            let alone = self.prefilling.is_empty() && self.decoding.is_empty();
            let Some(got) = self.cache.acquire(&req.hash_ids, anonymous_blocks, alone) else {
                break;
            };
            self.waiting.pop_front();
            // The last prompt token is always computed, even on a full hit.
            let cached_tokens = (got.hit_blocks * block_size).min(req.input_tokens - 1);
            events.push(StepEvent::Admitted {
                request: r,
                cached_tokens,
            });
            self.prefilling.push(Running {
                request: r,
                remaining_prefill: req.input_tokens - cached_tokens,
                chunk: 0,
                remaining_decode: req.output_tokens - 1,
                generated: 1,
                anonymous_blocks,
            });
        }
        let mut budget = model.max_batched_tokens.saturating_sub(self.decoding.len() as u32);
        let mut prefill_tokens = 0u64;
        for p in &mut self.prefilling {
            p.chunk = p.remaining_prefill.min(budget);
            budget -= p.chunk;
            prefill_tokens += u64::from(p.chunk);
        }
        if prefill_tokens == 0 && self.decoding.is_empty() {
            return None;
        }
        self.stepping = true;
        Some(
            model.step_overhead_ms
                + model.prefill_ms_per_token * prefill_tokens as f64
                + model.decode_ms_per_seq * self.decoding.len() as f64,
        )
    }

    /// Applies the planned step: decoding requests gain a token, prefill
    /// chunks complete. Events go to `events`.
    pub fn finish_step(&mut self, requests: &[SimRequest], block_size: u32, events: &mut Vec<StepEvent>) {
        debug_assert!(self.stepping);
        self.stepping = false;
        let cache = &mut self.cache;
        self.decoding.retain_mut(|d| {
            d.generated += 1;
            d.remaining_decode -= 1;
            if d.generated == d.generated / block_size * block_size {
                events.push(StepEvent::OutputBlock(d.request));
            }
            if d.remaining_decode == 0 {
                let req = &requests[d.request];
                cache.release(
                    &req.hash_ids,
                    d.anonymous_blocks,
                    &req.output_hash_ids,
                    output_parent(req, block_size),
                );
                events.push(StepEvent::Finished(d.request));
                false
            } else {
                true
            }
        });
        let mut i = 0;
        while i < self.prefilling.len() {
            let p = &mut self.prefilling[i];
            p.remaining_prefill -= p.chunk;
            p.chunk = 0;
            if p.remaining_prefill > 0 {
                i += 1;
                continue;
            }
            let p = self.prefilling.remove(i);
            events.push(StepEvent::FirstToken(p.request));
            if p.remaining_decode == 0 {
                let req = &requests[p.request];
                self.cache.release(
                    &req.hash_ids,
                    p.anonymous_blocks,
                    &req.output_hash_ids,
                    output_parent(req, block_size),
                );
                events.push(StepEvent::Finished(p.request));
            } else {
                self.decoding.push(p);
            }
        }
    }
}

/// The block a request's output blocks continue: its prompt's last full
/// block (the output fills a partial last prompt block in their place).
pub(crate) fn output_parent(req: &SimRequest, block_size: u32) -> Option<u64> {
    let full = (req.input_tokens / block_size.max(1)) as usize;
    full.checked_sub(1).and_then(|i| req.hash_ids.get(i).copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input: u32, output: u32, hashes: &[u64]) -> SimRequest {
        SimRequest {
            arrival_ms: 0.0,
            input_tokens: input,
            output_tokens: output,
            hash_ids: hashes.to_vec(),
            output_hash_ids: Vec::new(),
            session: None,
        }
    }

    fn model() -> TimingModel {
        TimingModel {
            step_overhead_ms: 1.0,
            prefill_ms_per_token: 0.01,
            decode_ms_per_seq: 0.5,
            max_batched_tokens: 64,
            max_running: 8,
        }
    }

    #[test]
    fn prefill_is_chunked_then_decode_runs_one_token_per_step() {
        let reqs = [req(100, 3, &[1, 2, 3, 4, 5, 6, 7])];
        let mut e = Engine::new(100);
        e.enqueue(0);
        let mut ev = Vec::new();
        // 100 prompt tokens, budget 64: two prefill steps.
        let d = e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
        assert!((d - (1.0 + 0.64)).abs() < 1e-9, "{d}");
        e.finish_step(&reqs, 16, &mut ev);
        assert_eq!(
            ev,
            vec![StepEvent::Admitted {
                request: 0,
                cached_tokens: 0
            }]
        );
        let d = e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
        assert!((d - (1.0 + 0.36)).abs() < 1e-9);
        e.finish_step(&reqs, 16, &mut ev);
        assert_eq!(ev[1], StepEvent::FirstToken(0));
        // Two more tokens, one decode step each at batch 1.
        assert_eq!(e.start_step(&reqs, 16, &model(), &mut ev), Some(1.5));
        e.finish_step(&reqs, 16, &mut ev);
        e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
        e.finish_step(&reqs, 16, &mut ev);
        assert_eq!(ev.last(), Some(&StepEvent::Finished(0)));
        assert_eq!(e.in_flight(), 0);
        assert_eq!(e.cache.pinned(), 0);
        assert_eq!(e.start_step(&reqs, 16, &model(), &mut ev), None);
    }

    #[test]
    fn cached_prefix_shortens_prefill() {
        let reqs = [req(64, 1, &[1, 2, 3, 4]), req(64, 1, &[1, 2, 3, 9])];
        let mut e = Engine::new(100);
        let mut ev = Vec::new();
        e.enqueue(0);
        let cold = e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
        e.finish_step(&reqs, 16, &mut ev);
        e.enqueue(1);
        let warm = e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
        assert!(warm < cold, "{warm} < {cold}");
        assert!(ev.contains(&StepEvent::Admitted {
            request: 1,
            cached_tokens: 48
        }));
    }

    #[test]
    fn decode_steps_slow_down_as_the_batch_grows() {
        let reqs: Vec<SimRequest> = (0..4).map(|i| req(16, 10, &[100 + i])).collect();
        let decode_step = |batch: usize| {
            let mut e = Engine::new(100);
            let mut ev = Vec::new();
            for r in 0..batch {
                e.enqueue(r);
            }
            e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
            e.finish_step(&reqs, 16, &mut ev);
            e.start_step(&reqs, 16, &model(), &mut ev).unwrap()
        };
        assert_eq!(decode_step(1), 1.5);
        assert_eq!(decode_step(4), 3.0);
    }

    #[test]
    fn a_full_cache_makes_requests_wait() {
        let reqs = [req(64, 20, &[1, 2, 3, 4]), req(64, 20, &[5, 6, 7, 8])];
        let mut e = Engine::new(8);
        let mut ev = Vec::new();
        e.enqueue(0);
        e.enqueue(1);
        e.start_step(&reqs, 16, &model(), &mut ev).unwrap();
        // Request 0 needs 4 prompt + 2 output blocks of 8; request 1 waits.
        assert_eq!(ev.len(), 1);
        assert_eq!(e.in_flight(), 2);
    }
}
