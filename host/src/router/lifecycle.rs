//! A booking that follows its response: [`Lifecycle`] holds the
//! selection service's booking of one request and moves it along as the
//! worker's answer arrives, whichever front door passes the answer on.
//!
//! * Booked when the worker is chosen (the prompt's tokens as prefill
//!   tokens, its blocks as decode blocks).
//! * Prefill complete at the first body chunk of a streamed response (the
//!   first token), or at the response head of one that does not stream.
//! * One more decode block each time the generated tokens fill a block:
//!   generated tokens are counted from the response as it passes (one per
//!   SSE `data:` event, or the `completion_tokens` of a `usage` object when
//!   the worker sends one, which then wins), at most the request's
//!   `max_tokens` (or [`MAX_COUNTED_OUTPUT_TOKENS`]), so a worker cannot
//!   make the router book without bound.
//! * Released exactly once: at the end of the response, when the client
//!   goes away (the lifecycle is dropped), or on a worker error.
//!
//! Counting reads the bytes in place (no copy of the response, no JSON
//! parse): a search for `data:` at line starts and for
//! `"completion_tokens"`, carried over chunk boundaries.

use std::sync::{Arc, LazyLock};

use memchr::memmem;

use super::metrics::{Metrics, UpstreamErrorKind};
use crate::{BookingError, OwnedSelection, WorkerWithDpRank};

/// Output tokens counted at most for a request without `max_tokens`.
pub const MAX_COUNTED_OUTPUT_TOKENS: u64 = 1 << 20;

/// How a response ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The body ended normally.
    Complete,
    /// The client went away first.
    ClientGone,
    /// The worker failed (broken connection, stall).
    Upstream(UpstreamErrorKind),
    /// The router refused the request after booking it (no next choice
    /// after a refused connection, a worker it cannot address).
    Refused,
}

/// One request's booking, following its response.
pub struct Lifecycle {
    booking: Option<OwnedSelection>,
    metrics: Arc<Metrics>,
    block_size: u64,
    prompt_tokens: u64,
    max_output: u64,
    streaming: bool,
    prefilled: bool,
    /// Output tokens counted so far, and the blocks they were booked as.
    counted: u64,
    booked_blocks: u64,
    scanner: TokenScanner,
    /// The prompt's credit to its rank while it prefills.
    in_flight: Option<super::overlaps::InFlightTicket>,
}

impl Lifecycle {
    /// Follows `booking` of a request with `prompt_tokens` prompt tokens,
    /// at most `max_tokens` output tokens, whose response streams or not.
    pub fn new(
        booking: OwnedSelection,
        metrics: Arc<Metrics>,
        block_size: u32,
        prompt_tokens: usize,
        max_tokens: Option<u64>,
        streaming: bool,
    ) -> Self {
        Lifecycle {
            booking: Some(booking),
            metrics,
            block_size: u64::from(block_size.max(1)),
            prompt_tokens: prompt_tokens as u64,
            max_output: max_tokens
                .unwrap_or(MAX_COUNTED_OUTPUT_TOKENS)
                .min(MAX_COUNTED_OUTPUT_TOKENS),
            streaming,
            prefilled: false,
            counted: 0,
            booked_blocks: 0,
            scanner: TokenScanner::default(),
            in_flight: None,
        }
    }

    /// Holds `ticket` (the prompt's credit to its rank) until the prefill
    /// completes or the request moves to another rank.
    pub fn with_in_flight(mut self, ticket: Option<super::overlaps::InFlightTicket>) -> Self {
        self.in_flight = ticket;
        self
    }

    /// The worker rank booked.
    pub fn worker(&self) -> Option<WorkerWithDpRank> {
        self.booking.as_ref().map(|b| b.worker())
    }

    /// Moves the booking to `to` (the next choice after a refused
    /// connection): booked there first, then released here.
    pub fn retarget(&mut self, to: WorkerWithDpRank) -> Result<(), BookingError> {
        self.in_flight = None;
        match &mut self.booking {
            Some(b) => b.retarget(to),
            None => Ok(()),
        }
    }

    /// The response head arrived.
    pub fn response_head(&mut self) {
        if !self.streaming {
            self.prefill_complete();
        }
    }

    /// A body chunk passed to the client.
    pub fn body_chunk(&mut self, chunk: &[u8]) {
        if chunk.is_empty() {
            return;
        }
        self.metrics.response_bytes(chunk.len());
        self.prefill_complete();
        self.scanner.feed(chunk);
        self.book_output();
    }

    /// The response ended.
    pub fn end(&mut self, ending: Ending) {
        if self.booking.is_none() {
            return;
        }
        match ending {
            Ending::Complete => {
                self.prefill_complete();
                self.scanner.finish();
                self.book_output();
            }
            Ending::ClientGone => self.metrics.client_disconnected(),
            Ending::Upstream(kind) => self.metrics.upstream_error(kind),
            Ending::Refused => {}
        }
        if let Some(b) = self.booking.take() {
            b.finish();
        }
    }

    /// Output tokens counted so far.
    pub fn output_tokens(&self) -> u64 {
        self.counted
    }

    fn prefill_complete(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            self.in_flight = None;
            if let Some(b) = &mut self.booking {
                b.prefill_complete();
            }
        }
    }

    fn book_output(&mut self) {
        let tokens = self.scanner.tokens().min(self.max_output);
        if tokens <= self.counted {
            return;
        }
        self.counted = tokens;
        // Blocks the generated tokens add beyond the prompt's last block.
        let bs = self.block_size;
        let blocks = (self.prompt_tokens + tokens).div_ceil(bs) - self.prompt_tokens.div_ceil(bs);
        if let Some(b) = &mut self.booking {
            while self.booked_blocks < blocks {
                if b.add_output_block().is_err() {
                    break;
                }
                self.booked_blocks += 1;
            }
        }
    }
}

impl Drop for Lifecycle {
    fn drop(&mut self) {
        if self.booking.is_some() {
            self.end(Ending::ClientGone);
        }
    }
}

/// Counts generated tokens in a response's bytes: SSE `data:` events (not
/// `[DONE]`) and the last `"completion_tokens": N`.
#[derive(Default)]
pub struct TokenScanner {
    events: u64,
    usage: Option<u64>,
    /// The last bytes of the previous chunk (a needle may straddle chunks).
    carry: Vec<u8>,
    /// Digits of a `completion_tokens` value cut by a chunk boundary.
    pending: Option<Pending>,
    started: bool,
}

#[derive(Clone, Copy)]
struct Pending {
    value: u64,
    digits: bool,
}

const DATA: &[u8] = b"\ndata:";
const DONE: &[u8] = b"data: [DONE]";
const USAGE: &[u8] = b"\"completion_tokens\"";

/// The needles' searchers, built once.
static FINDERS: LazyLock<[memmem::Finder<'static>; 3]> = LazyLock::new(|| {
    [
        memmem::Finder::new(DATA),
        memmem::Finder::new(DONE),
        memmem::Finder::new(USAGE),
    ]
});
/// The longest needle less one: what a chunk boundary can cut.
const CARRY: usize = 19;

impl TokenScanner {
    /// Generated tokens so far: the usage's count if one came, else the
    /// events.
    pub fn tokens(&self) -> u64 {
        self.usage.unwrap_or(self.events)
    }

    /// Scans the next chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.started {
            self.started = true;
            // A body that starts with an event has no newline before it.
            self.carry.push(b'\n');
        }
        if let Some(p) = self.pending.take() {
            let (p, used) = continue_number(p, chunk);
            match used {
                Some(_) => self.usage = Some(p.value),
                None => {
                    self.pending = Some(p);
                    self.shift_carry(chunk);
                    return;
                }
            }
        }
        // Needles that straddle the boundary: in carry + the chunk's head,
        // starting in the carry.
        let head = &chunk[..chunk.len().min(CARRY)];
        let cut = self.carry.len();
        let mut edge = [0u8; 2 * CARRY];
        edge[..cut].copy_from_slice(&self.carry);
        edge[cut..cut + head.len()].copy_from_slice(head);
        let edge = &edge[..cut + head.len()];
        self.count_in(edge, |start, len| start < cut && start + len > cut, Some((cut, chunk)));
        self.count_in(chunk, |_, _| true, None);
        self.shift_carry(chunk);
    }

    /// The body ended: a `completion_tokens` value cut at the very end
    /// counts as it stands.
    pub fn finish(&mut self) {
        if let Some(p) = self.pending.take() {
            if p.digits {
                self.usage = Some(p.value);
            }
        }
    }

    /// Counts the needles in `bytes` that `keep` (start, length) takes; for the
    /// edge, `tail` is the cut and the chunk the number continues in.
    fn count_in(&mut self, bytes: &[u8], keep: impl Fn(usize, usize) -> bool, tail: Option<(usize, &[u8])>) {
        let [data, done, usage] = &*FINDERS;
        for start in data.find_iter(bytes) {
            if keep(start, DATA.len()) {
                self.events += 1;
            }
        }
        for start in done.find_iter(bytes) {
            if keep(start, DONE.len()) {
                self.events = self.events.saturating_sub(1);
            }
        }
        for start in usage.find_iter(bytes) {
            if !keep(start, USAGE.len()) {
                continue;
            }
            let after = start + USAGE.len();
            let rest: &[u8] = match tail {
                // In the edge: the number continues in the chunk itself.
                Some((cut, chunk)) => &chunk[after.saturating_sub(cut)..],
                None => &bytes[after..],
            };
            let (p, used) = continue_number(
                Pending {
                    value: 0,
                    digits: false,
                },
                rest,
            );
            match used {
                Some(_) => self.usage = Some(p.value),
                None => self.pending = Some(p),
            }
        }
    }

    fn shift_carry(&mut self, chunk: &[u8]) {
        if chunk.len() >= CARRY {
            self.carry.clear();
            self.carry.extend_from_slice(&chunk[chunk.len() - CARRY..]);
        } else {
            self.carry.extend_from_slice(chunk);
            let excess = self.carry.len().saturating_sub(CARRY);
            self.carry.drain(..excess);
        }
    }
}

/// Reads `: 123` (spaces and the colon before the digits) from `bytes`,
/// continuing `p`; `Some(consumed)` once the number ended, `None` when
/// `bytes` ran out first.
fn continue_number(mut p: Pending, bytes: &[u8]) -> (Pending, Option<usize>) {
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'0'..=b'9' => {
                p.digits = true;
                p.value = p.value.saturating_mul(10).saturating_add(u64::from(b - b'0'));
            }
            b' ' | b':' | b'\t' | b'\n' | b'\r' if !p.digits => {}
            _ => return (p, Some(i)),
        }
    }
    (p, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(n: usize, usage: Option<u64>) -> Vec<u8> {
        let mut s = String::new();
        for i in 0..n {
            s.push_str(&format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n"));
        }
        if let Some(u) = usage {
            s.push_str(&format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\": {u},\"total_tokens\":9}}}}\n\n"
            ));
        }
        s.push_str("data: [DONE]\n\n");
        s.into_bytes()
    }

    fn scan_in_pieces(bytes: &[u8], piece: usize) -> u64 {
        let mut s = TokenScanner::default();
        for c in bytes.chunks(piece) {
            s.feed(c);
        }
        s.finish();
        s.tokens()
    }

    #[test]
    fn events_counted_whatever_the_chunking() {
        let body = sse(37, None);
        for piece in [1, 2, 3, 5, 7, 13, 19, 20, 64, 4096] {
            assert_eq!(scan_in_pieces(&body, piece), 37, "piece {piece}");
        }
    }

    #[test]
    fn usage_wins_whatever_the_chunking() {
        let body = sse(5, Some(1234));
        for piece in [1, 2, 3, 4, 5, 7, 11, 19, 20, 21, 64, 4096] {
            assert_eq!(scan_in_pieces(&body, piece), 1234, "piece {piece}");
        }
        let json = br#"{"id":"x","choices":[{"text":"hello"}],"usage":{"prompt_tokens":3,"completion_tokens":42,"total_tokens":45}}"#;
        for piece in [1, 2, 3, 17, 19, 20, 4096] {
            assert_eq!(scan_in_pieces(json, piece), 42, "piece {piece}");
        }
        // A number cut at the very end of the body.
        assert_eq!(scan_in_pieces(br#"{"completion_tokens": 17"#, 3), 17);
        assert_eq!(scan_in_pieces(b"{}", 1), 0);
    }

    #[test]
    fn the_in_flight_credit_ends_at_the_first_token() {
        use crate::{
            KvRouterConfig, SelectionRequest, ServiceConfig, WorkerRecord, WorkerSelectionPolicy,
            WorkerSelectionService, WorkerType,
        };
        let service = Arc::new(WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig::default(),
        ));
        service.add_worker(WorkerRecord::new(1)).unwrap();
        let rank = WorkerWithDpRank::new(1, 0);
        let in_flight = std::sync::Arc::new(super::super::overlaps::InFlight::default());
        for streaming in [true, false] {
            let booking = service.select_owned(&SelectionRequest::new(64)).unwrap();
            let metrics = Arc::new(Metrics::new("kv", &super::super::Limits::default()));
            let mut l = Lifecycle::new(booking, metrics, 32, 64, Some(4), streaming)
                .with_in_flight(in_flight.begin(rank, &[7, 8]));
            assert_eq!(in_flight.credits(&[7, 8, 9]), vec![(rank, 2)]);
            l.response_head();
            assert_eq!(in_flight.len(), usize::from(streaming), "streaming {streaming}: head");
            l.body_chunk(b"data: {}\n\n");
            assert!(in_flight.is_empty(), "streaming {streaming}: first chunk");
            l.end(Ending::Complete);
        }
    }
}
