//! A request's per-rank KV cost inputs ([`KvRankInputs`]) as the kernel's
//! per-row columns: the decode blocks each row would add, the rows with a
//! load observation, and each row's shared-cache hits beyond its device
//! overlap. Built in the thread's scratch, once per selection, only for a
//! request that carries them.

use selkie_kernel::mask::words_for;

use super::Env;
use crate::error::SelectionError;
use crate::filter::for_each_row;
use crate::request::{AddedBlocks, KvRankInputs};

/// The per-row columns of one request (`None`: the kernel's uniform
/// default applies).
pub(crate) struct RankColumns<'s> {
    /// The decode blocks added on a row not in `added`.
    pub(crate) uniform_added: u32,
    /// Decode blocks added per row.
    pub(crate) added: Option<&'s [u32]>,
    /// Rows with a load observation, one bit per row.
    pub(crate) observed: Option<&'s [u64]>,
}

/// The request's per-rank inputs, refused if malformed.
pub(crate) fn rank_inputs<'a>(env: &Env<'a>) -> Result<Option<&'a KvRankInputs<'a>>, SelectionError> {
    match env.req.rank_inputs {
        Some(r) if !r.shared_cache_hits_are_valid() => Err(SelectionError::InvalidRequest(
            "shared_cache_hits must be sorted, non-overlapping, non-empty ranges",
        )),
        r => Ok(r),
    }
}

/// Builds the added-blocks and observed-load columns over `env.rows` rows
/// into `added` and `observed` (grown to cover them). `prompt_blocks` is
/// `ceil(isl_tokens / block_size)`.
pub(crate) fn rank_columns<'s>(
    env: &Env<'_>,
    inputs: Option<&KvRankInputs<'_>>,
    prompt_blocks: u32,
    added: &'s mut Vec<u32>,
    observed: &'s mut Vec<u64>,
) -> RankColumns<'s> {
    let rows = env.rows;
    let Some(inputs) = inputs else {
        return RankColumns {
            uniform_added: prompt_blocks,
            added: None,
            observed: None,
        };
    };
    let lookup = env.reg.rank_lookup();
    let (uniform_added, added) = match inputs.added_blocks {
        AddedBlocks::Prompt => (prompt_blocks, None),
        AddedBlocks::Uniform(n) => (n, None),
        AddedBlocks::PerRank { blocks, others } => {
            if added.len() < rows {
                added.resize(rows, 0);
            }
            let column = &mut added[..rows];
            column.fill(others);
            for &(w, n) in blocks {
                if let Some(slot) = column.get_mut(lookup.row(w) as usize) {
                    *slot = n;
                }
            }
            (others, Some(&added[..rows]))
        }
    };
    let observed = if inputs.unobserved_load.is_empty() {
        None
    } else {
        let words = words_for(rows);
        if observed.len() < words {
            observed.resize(words, 0);
        }
        let mask = &mut observed[..words];
        mask.fill(!0);
        for &w in inputs.unobserved_load {
            let row = lookup.row(w) as usize;
            if row < rows {
                mask[row / 64] &= !(1 << (row % 64));
            }
        }
        Some(&observed[..words])
    };
    RankColumns {
        uniform_added,
        added,
        observed,
    }
}

/// Writes every eligible row's shared-cache hits beyond its device overlap
/// (`device[row]` rounded, as Dynamo rounds it) into `out`; returns the
/// column, or `None` when the request has no shared-cache hits.
pub(crate) fn shared_hits_column<'s>(
    env: &Env<'_>,
    inputs: Option<&KvRankInputs<'_>>,
    device: Option<&[f32]>,
    out: &'s mut Vec<f32>,
) -> Option<&'s [f32]> {
    let inputs = inputs.filter(|r| !r.shared_cache_hits.is_empty())?;
    let rows = env.rows;
    if out.len() < rows {
        out.resize(rows, 0.0);
    }
    let column = &mut out[..rows];
    for_each_row(env.mask, rows, |row| {
        let d = device.map_or(0.0, |d| d[row]).round().max(0.0) as u32;
        column[row] = inputs.shared_hits_beyond(d) as f32;
    });
    Some(&out[..rows])
}
