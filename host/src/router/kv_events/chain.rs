//! How a request's blocks are keyed so they meet the blocks the engines
//! report ([`KvHashing`]).
//!
//! * [`KvHashing::Tokens`] (the default): every `BlockStored` event carries
//!   its blocks' token ids; the router hashes them as it hashes a request
//!   (its own block hash, [`KvBlockHasher`](crate::kv_index::KvBlockHasher)) and the index maps the
//!   engine's hash of each block to that key, so later events (a child's
//!   parent, a removal) naming the engine hash resolve. It works whatever
//!   hash algorithm the engine runs (vLLM's `--prefix-caching-hash-algo`).
//!   A block stored with a LoRA adapter or with extra keys (multimodal
//!   inputs, a cache salt) is keyed with them folded in, so it is another
//!   block than the same tokens without them.
//! * [`KvHashing::EngineSha256Cbor`]: the router recomputes vLLM's
//!   `sha256_cbor` chain for a request (engines started with
//!   `--prefix-caching-hash-algo sha256_cbor`): block `i`'s digest is the
//!   SHA-256 of the canonical CBOR of `[digest of block i-1 (32 bytes),
//!   [block i's token ids], null]`, block `-1`'s digest is the SHA-256 of
//!   the CBOR text `"vllm-none-hash"` (or of the engine's `PYTHONHASHSEED`
//!   text when it runs with one set), only whole blocks, and the engine
//!   reports the digest's low 64 bits (big-endian). A store's token ids are
//!   not needed then; requests with extra keys (multimodal, LoRA, cache
//!   salt) do not match.

use sha2::{Digest, Sha256};

/// How requests' and events' blocks are keyed (`--kv-hash`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KvHashing {
    /// selkie's own hash of the token ids each store carries.
    #[default]
    Tokens,
    /// vLLM's `sha256_cbor` chain, from `NONE_HASH` of this seed
    /// (`PYTHONHASHSEED`; none: `"vllm-none-hash"`).
    EngineSha256Cbor {
        /// The engine's `PYTHONHASHSEED`, if it runs with one.
        seed: Option<String>,
    },
}

impl KvHashing {
    /// Parses `tokens`, `engine-sha256-cbor` or
    /// `engine-sha256-cbor:SEED`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "tokens" => Some(KvHashing::Tokens),
            "engine-sha256-cbor" => Some(KvHashing::EngineSha256Cbor { seed: None }),
            _ => text
                .strip_prefix("engine-sha256-cbor:")
                .filter(|s| !s.is_empty())
                .map(|s| KvHashing::EngineSha256Cbor {
                    seed: Some(s.to_owned()),
                }),
        }
    }
}

/// vLLM's `sha256_cbor` block hash chain.
#[derive(Clone, Debug)]
pub struct Sha256CborChain {
    block_size: usize,
    none_hash: [u8; 32],
}

fn sha256_cbor(value: &ciborium::Value) -> [u8; 32] {
    let mut bytes = Vec::new();
    // Writing to a Vec cannot fail; ciborium writes integers and lengths in
    // their shortest form, as canonical CBOR asks.
    let _ = ciborium::into_writer(value, &mut bytes);
    Sha256::digest(&bytes).into()
}

impl Sha256CborChain {
    /// The chain of `block_size`-token blocks from the `NONE_HASH` of
    /// `seed` (`PYTHONHASHSEED`; none: `"vllm-none-hash"`).
    pub fn new(block_size: u32, seed: Option<&str>) -> Self {
        let text = seed.unwrap_or("vllm-none-hash");
        Sha256CborChain {
            block_size: block_size.max(1) as usize,
            none_hash: sha256_cbor(&ciborium::Value::Text(text.to_owned())),
        }
    }

    /// Tokens per block (at least 1).
    pub fn block_size(&self) -> u32 {
        self.block_size as u32
    }

    /// Writes the engine's 64-bit hash of each whole block of `tokens` to
    /// `out` (cleared first).
    pub fn block_hashes(&self, tokens: &[u32], out: &mut Vec<u64>) {
        use ciborium::Value;
        out.clear();
        let mut parent = self.none_hash;
        for block in tokens.chunks_exact(self.block_size) {
            let value = Value::Array(vec![
                Value::Bytes(parent.to_vec()),
                Value::Array(block.iter().map(|&t| Value::Integer(t.into())).collect()),
                Value::Null,
            ]);
            parent = sha256_cbor(&value);
            let low: [u8; 8] = parent[24..].try_into().unwrap_or_default();
            out.push(u64::from_be_bytes(low));
        }
    }
}
