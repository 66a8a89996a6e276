//! Trace replay: requests read from a JSON Lines file in the layout of the
//! public Mooncake traces, one request per line:
//!
//! ```text
//! {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49]}
//! ```
//!
//! `timestamp` is the arrival in milliseconds, `hash_ids` one hash per block
//! of the trace's block size (512 tokens in the Mooncake traces); equal ids
//! are equal prefixes. Extra fields are ignored, so users can replay their own
//! traffic after exporting it in this shape. [`write_trace`] writes a
//! workload back out in the same layout, with a `block_size` field on every
//! line (and a session's `session` and `output_hash_ids`), so that it reads
//! back exactly: the same requests at the same times.
//!
//! Every line is checked: its hash ids must number `ceil(input_length /
//! block_size)` (a trace read with the wrong block size is refused, not
//! misread), lengths stay within [`MAX_TOKENS`] and timestamps are finite
//! and at most [`MAX_TIMESTAMP_MS`] from 0.
//!
//! This module only parses and writes; it does not simulate.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use super::limits::{MAX_BLOCK_SIZE, MAX_TOKENS};
use super::memory::MemoryLimit;
use super::workload::{Earliest, SimRequest, Workload};
use super::SimError;

/// Tokens per hash id of a trace that does not record its block size (the
/// public Mooncake traces).
pub const DEFAULT_TRACE_BLOCK_SIZE: u32 = 512;

/// The largest timestamp magnitude, in milliseconds (about 317 years: Unix
/// epoch milliseconds fit).
pub const MAX_TIMESTAMP_MS: f64 = 1e13;

/// One line of a Mooncake-style trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRow {
    /// Arrival time in milliseconds.
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// One hash per prompt block.
    pub hash_ids: Vec<u64>,
    /// Tokens per hash id, where the trace records it (traces written by
    /// [`write_trace`] do).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Hashes of the generated blocks a later prompt reuses (written by
    /// [`write_trace`] for multi-turn sessions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub output_hash_ids: Vec<u64>,
    /// The multi-turn session of the request (written by [`write_trace`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("cannot read trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a trace row.
    #[error("trace line {line}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// The trace has no requests.
    #[error("trace has no requests")]
    Empty,
}

/// Reads a trace. Its block size is the one its lines record, else
/// `block_size`, else [`DEFAULT_TRACE_BLOCK_SIZE`]; a `block_size` that
/// disagrees with the recorded one is refused. Blank lines are skipped;
/// arrivals are sorted and, unless the trace records its block size (a trace
/// selkie wrote keeps its times), shifted so the first is at 0.
pub fn read_trace(reader: impl BufRead, block_size: Option<u32>) -> Result<Workload, TraceError> {
    match read_trace_within(reader, block_size, None, &MemoryLimit::none()) {
        Ok(w) => Ok(w),
        Err(SimError::Trace(e)) => Err(e),
        Err(e) => unreachable!("no request or memory limit, yet: {e}"),
    }
}

/// [`read_trace`] keeping only the `requests` earliest requests (all of
/// them if `None`) while it reads, refused with [`SimError::OverMemory`]
/// as soon as those kept pass `limit` (see [`super::memory`]).
pub fn read_trace_within(
    reader: impl BufRead,
    block_size: Option<u32>,
    requests: Option<usize>,
    limit: &MemoryLimit,
) -> Result<Workload, SimError> {
    if let Some(b) = block_size {
        super::limits::count("block_size", b, MAX_BLOCK_SIZE)?;
    }
    let mut kept = Earliest::new(requests.unwrap_or(usize::MAX), f64::NEG_INFINITY, limit);
    let mut any = false;
    let mut size: Option<(u32, usize)> = None;
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(TraceError::from)?;
        if line.trim().is_empty() {
            continue;
        }
        let at = i + 1;
        let bad = |message: String| SimError::Trace(TraceError::Parse { line: at, message });
        let row: TraceRow = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        if !(row.timestamp.is_finite() && row.timestamp.abs() <= MAX_TIMESTAMP_MS) {
            return Err(bad(format!(
                "timestamp {} is not a finite number of milliseconds within {MAX_TIMESTAMP_MS:e} of 0",
                row.timestamp
            )));
        }
        for (name, value) in [("input_length", row.input_length), ("output_length", row.output_length)] {
            if value > MAX_TOKENS {
                return Err(bad(format!("{name} {value} is above the limit of {MAX_TOKENS} tokens")));
            }
        }
        if row.input_length == 0 {
            return Err(bad("input_length 0: a request's prompt has at least 1 token".into()));
        }
        let bs = match (row.block_size, size) {
            (Some(0), _) => return Err(bad("block_size is 0".into())),
            (Some(b), _) if b > MAX_BLOCK_SIZE => {
                return Err(bad(format!(
                    "block_size {b} is above the limit of {MAX_BLOCK_SIZE} tokens"
                )))
            }
            (Some(b), Some((first, first_line))) if b != first => {
                return Err(bad(format!("block_size {b} differs from {first} on line {first_line}")))
            }
            (Some(b), None) => {
                if let Some(given) = block_size.filter(|&g| g != b) {
                    return Err(bad(format!("the trace records block_size {b}, not the {given} given")));
                }
                size = Some((b, at));
                b
            }
            (_, Some((first, _))) => first,
            (None, None) => block_size.unwrap_or(DEFAULT_TRACE_BLOCK_SIZE),
        };
        if bs == 0 {
            return Err(bad("the block size is 0".into()));
        }
        let input = row.input_length;
        let blocks = input.div_ceil(bs) as usize;
        if row.hash_ids.len() != blocks {
            return Err(bad(format!(
                "{} hash ids for {input} prompt tokens; blocks of {bs} tokens make {blocks} (is the block size right?)",
                row.hash_ids.len()
            )));
        }
        any = true;
        kept.push(SimRequest {
            arrival_ms: row.timestamp,
            input_tokens: input,
            output_tokens: row.output_length.max(1),
            hash_ids: row.hash_ids,
            output_hash_ids: row.output_hash_ids,
            session: row.session,
        })?;
    }
    let mut requests = kept.into_sorted();
    if !any || requests.is_empty() {
        return Err(TraceError::Empty.into());
    }
    let t0 = if size.is_some() { 0.0 } else { requests[0].arrival_ms };
    for r in &mut requests {
        r.arrival_ms -= t0;
    }
    Ok(Workload {
        block_size: size.map_or(block_size.unwrap_or(DEFAULT_TRACE_BLOCK_SIZE), |(b, _)| b),
        requests,
    })
}

/// Writes `workload` as a Mooncake-style trace, with the fields that make it
/// read back exactly (see the module docs).
pub fn write_trace(workload: &Workload, mut out: impl Write) -> std::io::Result<()> {
    for r in &workload.requests {
        let row = TraceRow {
            timestamp: r.arrival_ms,
            input_length: r.input_tokens,
            output_length: r.output_tokens,
            hash_ids: r.hash_ids.clone(),
            block_size: Some(workload.block_size),
            output_hash_ids: r.output_hash_ids.clone(),
            session: r.session,
        };
        serde_json::to_writer(&mut out, &row)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mooncake_rows_and_ignores_extra_fields() {
        let text = r#"{"timestamp": 120, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}

{"timestamp": 100, "input_length": 500, "output_length": 9, "hash_ids": [1], "extra": true}
"#;
        let w = read_trace(text.as_bytes(), None).unwrap();
        assert_eq!(w.block_size, 512);
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].arrival_ms, 0.0);
        assert_eq!(w.requests[0].input_tokens, 500);
        assert_eq!(w.requests[1].arrival_ms, 20.0);
        assert_eq!(w.requests[1].hash_ids, vec![1, 2]);
    }

    #[test]
    fn bad_lines_name_their_line_number() {
        let text =
            "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [7]}\n{\"timestamp\": 2}\n";
        match read_trace(text.as_bytes(), Some(16)) {
            Err(TraceError::Parse { line: 2, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(read_trace("".as_bytes(), Some(16)), Err(TraceError::Empty)));
    }

    #[test]
    fn reading_keeps_the_earliest_requests_and_stops_at_the_memory_limit() {
        let text: String = [50, 10, 40, 10, 30, 20]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                format!("{{\"timestamp\": {t}, \"input_length\": 16, \"output_length\": {i}, \"hash_ids\": [{i}]}}\n")
            })
            .collect();
        let mut all = read_trace(text.as_bytes(), Some(16)).unwrap();
        let some = read_trace_within(text.as_bytes(), Some(16), Some(3), &MemoryLimit::none()).unwrap();
        all.requests.truncate(3);
        assert_eq!(some, all, "the 3 earliest, ties in file order");
        assert_eq!(
            some.requests.iter().map(|r| r.hash_ids[0]).collect::<Vec<_>>(),
            [1, 3, 5]
        );
        let e = read_trace_within(text.as_bytes(), Some(16), None, &MemoryLimit::cli(100)).unwrap_err();
        assert!(
            matches!(&e, SimError::OverMemory { requests: 1, need, .. } if need.starts_with("at least")),
            "{e}"
        );
    }

    #[test]
    fn written_traces_read_back() {
        let w = read_trace(
            "{\"timestamp\": 0, \"input_length\": 30, \"output_length\": 2, \"hash_ids\": [4, 5]}\n".as_bytes(),
            Some(16),
        )
        .unwrap();
        let mut buf = Vec::new();
        write_trace(&w, &mut buf).unwrap();
        // The block size travels with the trace: read back without it.
        assert_eq!(read_trace(&buf[..], None).unwrap(), w);
        match read_trace(&buf[..], Some(512)) {
            Err(TraceError::Parse { line: 1, message }) => {
                assert!(message.contains("records block_size 16"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// Lines that would be misread or overflow are refused with their line
    /// number.
    #[test]
    fn inconsistent_lines_are_refused_with_their_line_number() {
        let line = |ts: &str, input: u64, output: u64, ids: usize| {
            let ids: Vec<String> = (0..ids).map(|i| i.to_string()).collect();
            format!(
                "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [{}]}}\n",
                ids.join(",")
            )
        };
        let good = line("0", 1000, 5, 2);
        for (bad, needle) in [
            (line("1", 1277, 5, 80), "80 hash ids for 1277 prompt tokens"),
            (line("1", 1000, 100_000_000, 2), "output_length 100000000"),
            (line("1", 4_294_967_295, 5, 2), "input_length"),
            (line("1.7e308", 1000, 5, 2), "timestamp"),
            (line("-1.7e308", 1000, 5, 2), "timestamp"),
        ] {
            match read_trace(format!("{good}{bad}").as_bytes(), None) {
                Err(TraceError::Parse { line: 2, message }) => assert!(message.contains(needle), "{message}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
