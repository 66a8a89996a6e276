//! The memory a run holds, and the bound on it.
//!
//! A simulation keeps its workload whole (each request with one hash id per
//! prompt block), and while one policy runs, per request: its record, its
//! time to first token, its booking while it is in flight, and an entry for
//! each of its distinct blocks in the hit-rate bounds' map. All of it grows
//! with the request count and the prompt length, so a request count inside
//! [`MAX_REQUESTS`](super::limits::MAX_REQUESTS) can still need more memory
//! than the machine has.
//!
//! The bound is a number of bytes ([`MemoryLimit`], `--max-memory` on the
//! command line, [`DEFAULT_MAX_MEMORY`] by default). Before anything is
//! generated, [`estimate`] sizes a run from a small sample of the same
//! workload, and a run over the bound is refused with
//! [`SimError::OverMemory`], which names the option to lower and what the
//! run would need. While requests are generated or read, the bytes they
//! take are counted and the run is refused as soon as they pass the bound,
//! so the bound holds whatever the estimate said. A workload is generated
//! (or a trace read) keeping only the requests the run replays, never more.
//!
//! What is not per request (the fleet, the engines' caches, the selection
//! service) is bounded by the fleet's own limits and not counted here.
//!
//! This module must not simulate: it only sizes and checks.

use super::workload::{SimRequest, Workload};
use super::SimError;

/// The default bound on a run's per-request memory: 4 GiB.
pub const DEFAULT_MAX_MEMORY: u64 = 4 << 30;

/// Bytes one request takes over one policy's run besides its hash ids: its
/// record, its time to first token, its booking and the engine's state
/// while in flight (all of them may be in flight at once at a high rate).
/// Measured: 200,000 requests of the default scenario at 10,000,000 per
/// second peaked at 874 MiB, where the workload and the bounds' map
/// account for 773 MiB; rounded up.
pub const RUN_BYTES_PER_REQUEST: u64 = 1024;

/// Bytes the hit-rate bounds' map takes per hash id (an 8-byte key in a
/// hash table between 7/16 and 7/8 full, with its control byte).
pub const BOUNDS_BYTES_PER_HASH: u64 = 24;

/// Requests generated to size a run ([`estimate`]).
pub const SAMPLE_REQUESTS: usize = 2_048;

/// A bound on a run's per-request memory, and the names an error gives:
/// the option that sizes the run (`field`, e.g. `--requests`) and the one
/// that sets the bound (`limit_field`, e.g. `--max-memory`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// The most bytes the run may take.
    pub bytes: u64,
    /// The option or field that sizes the run.
    pub field: String,
    /// The option or field that sets `bytes`.
    pub limit_field: String,
}

impl MemoryLimit {
    /// `bytes`, with the command line's names (`--requests`,
    /// `--max-memory`).
    pub fn cli(bytes: u64) -> Self {
        MemoryLimit {
            bytes,
            field: "--requests".into(),
            limit_field: "--max-memory".into(),
        }
    }

    /// No bound.
    pub fn none() -> Self {
        MemoryLimit {
            bytes: u64::MAX,
            field: String::new(),
            limit_field: String::new(),
        }
    }

    /// The same bound, naming `field` as what sizes the run.
    pub fn for_field(mut self, field: impl Into<String>) -> Self {
        self.field = field.into();
        self
    }

    /// Refuses `need` bytes for `requests` requests if they are over the
    /// bound (`at_least`: `need` is what was counted so far, not the whole).
    pub fn check(&self, requests: usize, need: u64, at_least: bool) -> Result<(), SimError> {
        if need <= self.bytes {
            return Ok(());
        }
        Err(SimError::OverMemory {
            field: self.field.clone(),
            requests,
            need: format!(
                "{}{}",
                if at_least { "at least " } else { "about " },
                format_bytes(need)
            ),
            limit: format_bytes(self.bytes),
            limit_field: self.limit_field.clone(),
        })
    }
}

/// Bytes `request` holds in a workload.
pub fn request_bytes(request: &SimRequest) -> u64 {
    (std::mem::size_of::<SimRequest>() + 8 * (request.hash_ids.capacity() + request.output_hash_ids.capacity())) as u64
}

/// Bytes `requests` requests like `sample`'s take over one run, `runs` of
/// them at once ([`RUN_BYTES_PER_REQUEST`] and the bounds' map per hash id
/// on top of the workload itself); `None` for an empty sample.
pub fn run_bytes(sample: &Workload, requests: usize, runs: usize) -> Option<u64> {
    let n = sample.requests.len() as u64;
    if n == 0 {
        return None;
    }
    let workload: u64 = sample.requests.iter().map(request_bytes).sum();
    let hashes: u64 = sample
        .requests
        .iter()
        .map(|r| (r.hash_ids.len() + r.output_hash_ids.len()) as u64)
        .sum();
    let per_request =
        (workload + hashes * BOUNDS_BYTES_PER_HASH).div_ceil(n) + RUN_BYTES_PER_REQUEST * runs.max(1) as u64;
    Some(per_request.saturating_mul(requests as u64))
}

/// Checks that a run of `requests` requests like `sample`'s, `runs` at once,
/// fits `limit`.
pub fn estimate(sample: &Workload, requests: usize, runs: usize, limit: &MemoryLimit) -> Result<(), SimError> {
    match run_bytes(sample, requests, runs) {
        Some(need) => limit.check(requests, need, false),
        None => Ok(()),
    }
}

/// `bytes` in binary units: `512 B`, `3.0 KiB`, `23.4 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Parses a byte count: a whole number, optionally followed by `K`, `M`,
/// `G` or `T` (binary multiples; `KiB`, `MiB`, ... and a trailing `B` are
/// accepted too), e.g. `4G`, `512MiB`, `1073741824`. At least 1 byte.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches('B')
        .trim_end_matches('I')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("{text:?}: not a byte count (e.g. 4G, 512M, 1073741824)")),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: not a byte count (e.g. 4G, 512M, 1073741824)"))?;
    match n.checked_mul(1 << shift) {
        Some(0) => Err(format!("{text:?}: must be at least 1 byte")),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{text:?}: more than {} bytes", u64::MAX)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_and_print_in_binary_units() {
        assert_eq!(parse_bytes("4G"), Ok(4 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes(" 2 kb "), Ok(2048));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("-1G").is_err());
        assert!(parse_bytes("4X").is_err());
        assert!(parse_bytes("99999999999T").is_err());
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 10), "3.0 KiB");
        assert_eq!(format_bytes(23_400_000_000), "21.8 GiB");
    }

    #[test]
    fn a_need_over_the_bound_is_refused_by_name() {
        let limit = MemoryLimit::cli(1 << 30);
        assert!(limit.check(10, 1 << 30, false).is_ok());
        let e = limit.check(10_000_000, 23 << 30, false).unwrap_err().to_string();
        assert!(
            e.starts_with("--requests: 10000000 requests need about 23.0 GiB") && e.contains("1.0 GiB (--max-memory)"),
            "{e}"
        );
    }
}
