//! Bounded-load prefix hashing (the `prefix-hash` policy): requests whose
//! prompts start alike go to the same rank while it has room, so its KV
//! cache serves them, and spill to their next ranks in a fixed order when
//! it is full. No cache state is needed: only the request's leading block
//! hashes and the ranks' in-flight requests.
//!
//! This is KubeAI's `PrefixHash` strategy (consistent hashing with bounded
//! loads, load factor 1.25) with rendezvous hashing in place of a ring of
//! virtual nodes: each rank's score for the key is computed over all rows at
//! once by the kernel's `rendezvous` module, so there is no ring to rebuild
//! when workers come and go, and a departing worker moves only its own keys.
//! Ranks are hashed separately (each has its own cache).
//!
//! The bound follows the fleet's load: on a nearly idle fleet it is one
//! request, so a second request of a prefix held alongside the first goes to
//! the prefix's next rank; as load grows, each rank keeps up to
//! `load_factor` times the average.

use selkie_kernel::kernels::rendezvous::{bounded_rendezvous, check_load_factor, DEFAULT_LOAD_FACTOR, MAX_LOAD_FACTOR};
use selkie_kernel::Rng;
use serde::{Deserialize, Serialize};

use super::builtin::{choice, finish, load_of, none};
use super::scratch::Scratch;
use super::{Choice, Env};
use crate::error::{SelectionError, WorkerSelectionPolicyProviderError};
use crate::explain::Branch;
use crate::request::SelectionRequest;

/// Leading blocks a request is keyed by, by default: 64 tokens at 16-token
/// blocks, about the 100 characters KubeAI hashes by default.
pub const DEFAULT_PREFIX_BLOCKS: u32 = 4;

/// The most leading blocks a key may cover.
pub const MAX_PREFIX_BLOCKS: u32 = 1 << 20;

/// Parameters of the `prefix-hash` policy.
///
/// ```
/// let c = selkie::PrefixHashConfig::default();
/// assert_eq!((c.load_factor, c.prefix_blocks), (1.25, 4));
/// assert!(c.validate().is_ok());
/// let bad = selkie::PrefixHashConfig { load_factor: 0.9, ..c };
/// assert_eq!(bad.validate().unwrap_err().to_string(), "load_factor must be within 1 ..= 1000000, got 0.9");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixHashConfig {
    /// A rank takes a request only while it holds fewer than
    /// `ceil(load_factor * (in flight + 1) / eligible ranks)` requests
    /// (`1 ..= 1e6`; 1 balances exactly, larger values keep more requests on
    /// their prefix's rank).
    pub load_factor: f64,
    /// Leading prompt blocks the key covers (`1 ..= 2^20`): requests that
    /// share them share a rank. Shorter prompts are keyed by all their
    /// blocks.
    pub prefix_blocks: u32,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        PrefixHashConfig {
            load_factor: DEFAULT_LOAD_FACTOR,
            prefix_blocks: DEFAULT_PREFIX_BLOCKS,
        }
    }
}

impl PrefixHashConfig {
    /// Checks both fields; names the bad one and its range.
    pub fn validate(&self) -> Result<(), WorkerSelectionPolicyProviderError> {
        if check_load_factor(self.load_factor).is_err() {
            return Err(WorkerSelectionPolicyProviderError::OutOfRange {
                field: "load_factor",
                value: self.load_factor,
                min: 1.0,
                max: MAX_LOAD_FACTOR,
            });
        }
        if !(1..=MAX_PREFIX_BLOCKS).contains(&self.prefix_blocks) {
            return Err(WorkerSelectionPolicyProviderError::OutOfRange {
                field: "prefix_blocks",
                value: f64::from(self.prefix_blocks),
                min: 1.0,
                max: f64::from(MAX_PREFIX_BLOCKS),
            });
        }
        Ok(())
    }

    /// The key of `request`: its explicit [`prefix_key`](SelectionRequest::prefix_key),
    /// else [`prefix_key`] of its first `prefix_blocks` prompt blocks;
    /// `None` for a request with neither.
    pub fn key_of(&self, request: &SelectionRequest<'_>) -> Option<u64> {
        request.prefix_key.or_else(|| {
            let blocks = request.prompt_blocks;
            let n = blocks.len().min(self.prefix_blocks as usize);
            (n > 0).then(|| prefix_key(&blocks[..n]))
        })
    }
}

/// The key of a prompt whose leading block hashes are `blocks`: a 64-bit
/// hash of all of them, in order.
///
/// ```
/// use selkie::prefix_key;
/// assert_eq!(prefix_key(&[1, 2]), prefix_key(&[1, 2]));
/// assert_ne!(prefix_key(&[1, 2]), prefix_key(&[2, 1]));
/// ```
pub fn prefix_key(blocks: &[u64]) -> u64 {
    blocks.iter().fold(0x243F_6A88_85A3_08D3, |k, &b| {
        let mut z = (k ^ b).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z ^ (z >> 32)
    })
}

/// Chooses among `env.mask` by the request's key; least-loaded for a
/// request without one.
pub(crate) fn choose(
    env: &Env<'_>,
    s: &mut Scratch,
    rng: &mut Rng,
    config: &PrefixHashConfig,
) -> Result<Choice, SelectionError> {
    let Some(key) = config.key_of(env.req) else {
        let mut c = super::builtin::least_loaded(env, s, rng)?;
        c.branch = Branch::PrefixHashUnkeyed;
        return Ok(c);
    };
    let n = env.candidates();
    let picked = bounded_rendezvous(
        key,
        &env.view.active_requests(),
        &env.view.rendezvous_salts(),
        env.mask,
        config.load_factor,
    )
    // The load factor was checked when the policy was built.
    .map_err(|_| none())?
    .ok_or_else(none)?;
    Ok(finish(
        env,
        choice(picked.row, load_of(env, picked.row), Branch::PrefixHash, n),
    ))
}
