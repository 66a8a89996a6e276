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
//! workload back out in the same layout.
//!
//! This module only parses and writes; it does not simulate.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use super::workload::{SimRequest, Workload};

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

/// Reads a trace whose hashes are per `block_size` tokens. Blank lines are
/// skipped; arrivals are shifted so the first is at 0 and sorted.
pub fn read_trace(reader: impl BufRead, block_size: u32) -> Result<Workload, TraceError> {
    let mut requests = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let row: TraceRow = serde_json::from_str(&line).map_err(|e| TraceError::Parse {
            line: i + 1,
            message: e.to_string(),
        })?;
        if !row.timestamp.is_finite() {
            return Err(TraceError::Parse {
                line: i + 1,
                message: "timestamp is not finite".into(),
            });
        }
        requests.push(SimRequest {
            arrival_ms: row.timestamp,
            input_tokens: row.input_length.max(1),
            output_tokens: row.output_length.max(1),
            hash_ids: row.hash_ids,
            output_hash_ids: Vec::new(),
            session: None,
        });
    }
    if requests.is_empty() {
        return Err(TraceError::Empty);
    }
    requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    let t0 = requests[0].arrival_ms;
    for r in &mut requests {
        r.arrival_ms -= t0;
    }
    Ok(Workload {
        block_size: block_size.max(1),
        requests,
    })
}

/// Writes `workload` as a Mooncake-style trace (output hashes and sessions
/// are not part of the layout and are dropped).
pub fn write_trace(workload: &Workload, mut out: impl Write) -> std::io::Result<()> {
    for r in &workload.requests {
        let row = TraceRow {
            timestamp: r.arrival_ms,
            input_length: r.input_tokens,
            output_length: r.output_tokens,
            hash_ids: r.hash_ids.clone(),
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

{"timestamp": 100, "input_length": 600, "output_length": 9, "hash_ids": [1], "extra": true}
"#;
        let w = read_trace(text.as_bytes(), 512).unwrap();
        assert_eq!(w.block_size, 512);
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].arrival_ms, 0.0);
        assert_eq!(w.requests[0].input_tokens, 600);
        assert_eq!(w.requests[1].arrival_ms, 20.0);
        assert_eq!(w.requests[1].hash_ids, vec![1, 2]);
    }

    #[test]
    fn bad_lines_name_their_line_number() {
        let text =
            "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\n{\"timestamp\": 2}\n";
        match read_trace(text.as_bytes(), 16) {
            Err(TraceError::Parse { line: 2, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(read_trace("".as_bytes(), 16), Err(TraceError::Empty)));
    }

    #[test]
    fn written_traces_read_back() {
        let w = read_trace(
            "{\"timestamp\": 0, \"input_length\": 30, \"output_length\": 2, \"hash_ids\": [4, 5]}\n".as_bytes(),
            16,
        )
        .unwrap();
        let mut buf = Vec::new();
        write_trace(&w, &mut buf).unwrap();
        assert_eq!(read_trace(&buf[..], 16).unwrap(), w);
    }
}
