//! A request's block hashes, computed the way Dynamo's router and the
//! engines that publish KV events for it compute them, so that the hashes a
//! router queries with are the hashes engines report.
//!
//! Two hashes per block of `block_size` tokens:
//!
//! * the **local block hash** (Dynamo's `LocalBlockHash`, the `tokens_hash`
//!   of a stored block): XXH3-64 of the block's token ids as little-endian
//!   `u32` bytes, followed (for a block holding multimodal objects) by the
//!   objects' hashes as little-endian `u64` in ascending order, seeded with
//!   the request's [`seed`](KvBlockHasher::seed);
//! * the **sequence hash**: the first block's is its local hash; each next
//!   one is XXH3-64 of the 16 bytes `parent sequence hash (LE) ++ local hash
//!   (LE)` seeded with [`KV_HASH_SEED`]. It names a block together with
//!   everything before it, and it is what [`KvIndex`](super::KvIndex) is
//!   keyed by.
//!
//! The seed is [`KV_HASH_SEED`] (1337), plus (wrapping) XXH3-64 of the LoRA
//! adapter's name with seed 0, plus XXH3-64 of the cache namespace with seed
//! 1; an empty name counts as no name. Only whole blocks are hashed: a
//! trailing partial block has no hash. In Eagle (speculative decoding) mode a
//! block is hashed over a window of `block_size + 1` tokens that starts
//! every `block_size` tokens, so `n` tokens give `(n - 1) / block_size`
//! blocks.
//!
//! This module computes hashes only; it holds no state and allocates only
//! into the vectors it is given.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The XXH3 seed of Dynamo's block hashing: the seed of a request without
/// LoRA adapter or cache namespace, and the seed of every step of the
/// sequence-hash chain.
pub const KV_HASH_SEED: u64 = 1337;

/// The sequence hash of a block whose parent's sequence hash is `parent` and
/// whose local block hash is `local`.
///
/// ```
/// use selkie::kv_index::{next_sequence_hash, KvBlockHasher};
/// let hasher = KvBlockHasher::new(4);
/// let tokens: Vec<u32> = (0..8).collect();
/// let (mut local, mut seq) = (Vec::new(), Vec::new());
/// hasher.local_hashes(&tokens, &mut local);
/// hasher.sequence_hashes(&tokens, &mut seq);
/// assert_eq!(seq[0], local[0]);
/// assert_eq!(seq[1], next_sequence_hash(seq[0], local[1]));
/// ```
#[inline]
pub fn next_sequence_hash(parent: u64, local: u64) -> u64 {
    // XXH3-64's case for 9 to 16 input bytes, at exactly 16 with the seed
    // folded into the constants: no length dispatch, one 64x64->128
    // multiply (equal to the library's answer: see the tests).
    let lo = parent ^ SEQUENCE_FLIP_LO;
    let hi = local ^ SEQUENCE_FLIP_HI;
    let acc = 16u64
        .wrapping_add(lo.swap_bytes())
        .wrapping_add(hi)
        .wrapping_add(fold_product(lo, hi));
    avalanche(acc)
}

/// XXH3's 64x64 -> 128-bit multiply folded to 64 bits (low half XOR high).
#[inline(always)]
const fn fold_product(lo: u64, hi: u64) -> u64 {
    let product = (lo as u128) * (hi as u128);
    product as u64 ^ (product >> 64) as u64
}

/// XXH3's final mix of its short cases.
#[inline(always)]
const fn avalanche(acc: u64) -> u64 {
    let acc = (acc ^ (acc >> 37)).wrapping_mul(0x1656_6791_9e37_79f9);
    acc ^ (acc >> 32)
}

/// The first 128 bytes of XXH3's default secret as the little-endian
/// words its cases up to 128 input bytes read.
const SECRET_WORDS: [u64; 16] = [
    0xbe4b_a423_396c_feb8,
    0x1cad_21f7_2c81_017c,
    0xdb97_9083_e96d_d4de,
    0x1f67_b3b7_a4a4_4072,
    0x78e5_c0cc_4ee6_79cb,
    0x2172_ffcc_7dd0_5a82,
    0x8e24_43f7_7446_08b8,
    0x4c26_3a81_e690_35e0,
    0xcb00_c391_bb52_283c,
    0xa32e_531b_8b65_d088,
    0x4ef9_0da2_9748_6471,
    0xd8ac_dea9_46ef_1938,
    0x3f34_9ce3_3f76_faa8,
    0x1d4f_0bc7_c7bb_dcf9,
    0x3159_b4cd_4be0_518a,
    0x6473_78d9_c97e_9fc8,
];
/// What the first 8 input bytes (the parent) are XORed with.
/// (The 9-to-16-byte case mixes in the words of bytes 24..56.)
const SEQUENCE_FLIP_LO: u64 = (SECRET_WORDS[3] ^ SECRET_WORDS[4]).wrapping_add(KV_HASH_SEED);
/// What the last 8 input bytes (the local hash) are XORed with.
const SEQUENCE_FLIP_HI: u64 = (SECRET_WORDS[5] ^ SECRET_WORDS[6]).wrapping_sub(KV_HASH_SEED);

/// Appends the sequence hashes of a run of local block hashes that starts at
/// the first block of a request (precomputed hashes, for example from
/// Dynamo's `compute_block_hash_for_seq`) to `out`.
pub fn sequence_hashes_of(local: &[u64], out: &mut Vec<u64>) {
    out.reserve(local.len());
    let mut parent = None;
    for &hash in local {
        let seq = parent.map_or(hash, |p| next_sequence_hash(p, hash));
        out.push(seq);
        parent = Some(seq);
    }
}

/// Computes a request's block hashes from its token ids (see the module
/// documentation for the exact definition).
///
/// ```
/// use selkie::kv_index::KvBlockHasher;
/// let hasher = KvBlockHasher::new(16).with_lora("my-adapter");
/// let tokens: Vec<u32> = (0..40).collect();
/// let mut hashes = Vec::new();
/// hasher.sequence_hashes(&tokens, &mut hashes);
/// assert_eq!(hashes.len(), 2, "the last 8 tokens are a partial block");
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KvBlockHasher {
    block_size: u32,
    lora: u64,
    namespace: u64,
    eagle: bool,
    /// The seeded XXH3 keys of blocks of 17 to 128 bytes (derived from the
    /// seed whenever it changes).
    mid: MidKeys,
}

impl core::fmt::Debug for KvBlockHasher {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KvBlockHasher")
            .field("block_size", &self.block_size)
            .field("lora", &self.lora)
            .field("namespace", &self.namespace)
            .field("eagle", &self.eagle)
            .finish()
    }
}

/// XXH3-64 of 17 to 128 input bytes under one seed, the seed folded into
/// the secret's words once (the library adds it to each word it reads, per
/// hash): a block of 5 to 32 tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MidKeys([u64; 16]);

/// XXH3's first 64-bit prime (the length multiplier of its short cases).
const PRIME64_1: u64 = 0x9e37_79b1_85eb_ca87;

impl MidKeys {
    const fn new(seed: u64) -> Self {
        let mut keys = [0; 16];
        let mut i = 0;
        while i < 16 {
            // Even words take the seed added, odd words subtracted.
            keys[i] = if i % 2 == 0 {
                SECRET_WORDS[i].wrapping_add(seed)
            } else {
                SECRET_WORDS[i].wrapping_sub(seed)
            };
            i += 1;
        }
        MidKeys(keys)
    }

    /// The 16 input bytes at `at` mixed with key pair `pair`: the 128-bit
    /// product of the two keyed words, folded to 64 bits.
    #[inline(always)]
    fn mix(&self, input: &[u8], at: usize, pair: usize) -> u64 {
        let word = |i: usize| u64::from_le_bytes(input[i..i + 8].try_into().expect("8 bytes"));
        let lo = word(at) ^ self.0[2 * pair];
        let hi = word(at + 8) ^ self.0[2 * pair + 1];
        fold_product(lo, hi)
    }

    /// XXH3-64 of `input`, which holds 17 to 128 bytes: the input's first
    /// and last 16 bytes, then (above 32) the next 16 from each end, and so
    /// on, each mixed with its key pair, summed, then avalanched.
    ///
    /// Blocks of 16 tokens (64 bytes, engines' usual block size) get a copy
    /// of the body for that length: every offset a constant, no bounds
    /// check. (A second copy for 32 tokens made the query loop that inlines
    /// this dearer for 16.)
    #[inline(always)]
    fn hash(&self, input: &[u8]) -> u64 {
        if let Ok(block) = <&[u8; 64]>::try_from(input) {
            self.hash_any(block)
        } else {
            self.hash_any(input)
        }
    }

    /// The body of [`hash`](Self::hash), for any length it takes.
    #[inline(always)]
    fn hash_any(&self, input: &[u8]) -> u64 {
        let len = input.len();
        debug_assert!((17..=128).contains(&len), "{len} bytes");
        let mut acc = (len as u64).wrapping_mul(PRIME64_1);
        if len > 32 {
            if len > 64 {
                if len > 96 {
                    acc = acc.wrapping_add(self.mix(input, 48, 6));
                    acc = acc.wrapping_add(self.mix(input, len - 64, 7));
                }
                acc = acc.wrapping_add(self.mix(input, 32, 4));
                acc = acc.wrapping_add(self.mix(input, len - 48, 5));
            }
            acc = acc.wrapping_add(self.mix(input, 16, 2));
            acc = acc.wrapping_add(self.mix(input, len - 32, 3));
        }
        acc = acc.wrapping_add(self.mix(input, 0, 0));
        acc = acc.wrapping_add(self.mix(input, len - 16, 1));
        avalanche(acc)
    }
}

impl KvBlockHasher {
    /// Hashing for blocks of `block_size` tokens, no LoRA adapter, no cache
    /// namespace. A `block_size` of 0 gives no blocks.
    ///
    /// The block size is the service's
    /// ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size)) and
    /// the KV index's: [`KvIndex::overlaps_for_tokens`](super::KvIndex::overlaps_for_tokens)
    /// refuses a hasher of another size than the index's, and
    /// [`check_request`](crate::WorkerSelectionService::check_request)
    /// refuses more block hashes than the prompt has blocks at the
    /// service's size (hashes cut at a smaller block size).
    pub const fn new(block_size: u32) -> Self {
        KvBlockHasher {
            block_size,
            lora: 0,
            namespace: 0,
            eagle: false,
            mid: MidKeys::new(KV_HASH_SEED),
        }
    }

    /// Folds a LoRA adapter's name into the seed (an empty name is no adapter).
    pub fn with_lora(mut self, name: &str) -> Self {
        self.lora = if name.is_empty() { 0 } else { xxh3_64(name.as_bytes()) };
        self.mid = MidKeys::new(self.seed());
        self
    }

    /// Folds a cache namespace (Dynamo's `cache_namespace`, a salt that keeps
    /// requests from sharing cache) into the seed (empty is none).
    pub fn with_cache_namespace(mut self, namespace: &str) -> Self {
        self.namespace = if namespace.is_empty() {
            0
        } else {
            xxh3_64_with_seed(namespace.as_bytes(), 1)
        };
        self.mid = MidKeys::new(self.seed());
        self
    }

    /// Eagle mode: each block is hashed over `block_size + 1` tokens.
    pub fn with_eagle(mut self, eagle: bool) -> Self {
        self.eagle = eagle;
        self
    }

    /// Tokens per block.
    pub const fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The XXH3 seed of the local block hashes.
    pub const fn seed(&self) -> u64 {
        KV_HASH_SEED.wrapping_add(self.lora).wrapping_add(self.namespace)
    }

    /// The number of whole blocks in `tokens` tokens.
    pub const fn block_count(&self, tokens: usize) -> usize {
        let size = self.block_size as usize;
        if size == 0 {
            0
        } else if self.eagle {
            tokens.saturating_sub(1) / size
        } else {
            tokens / size
        }
    }

    /// Appends the local block hashes of `tokens` to `out`.
    pub fn local_hashes(&self, tokens: &[u32], out: &mut Vec<u64>) {
        self.each_local_hash(tokens, &[], |h| out.push(h));
    }

    /// Appends the local block hashes of `tokens` to `out`, block `i` also
    /// covering the multimodal object hashes `block_mm[i]` (in any order;
    /// blocks past the end of `block_mm` and empty entries have none).
    pub fn local_hashes_with_mm(&self, tokens: &[u32], block_mm: &[&[u64]], out: &mut Vec<u64>) {
        self.each_local_hash(tokens, block_mm, |h| out.push(h));
    }

    /// Appends the sequence hashes of `tokens` to `out`.
    pub fn sequence_hashes(&self, tokens: &[u32], out: &mut Vec<u64>) {
        self.sequence_hashes_with_mm(tokens, &[], out);
    }

    /// Appends the sequence hashes of `tokens` to `out`, with multimodal
    /// objects as in [`local_hashes_with_mm`](Self::local_hashes_with_mm).
    pub fn sequence_hashes_with_mm(&self, tokens: &[u32], block_mm: &[&[u64]], out: &mut Vec<u64>) {
        out.reserve(self.block_count(tokens.len()));
        let mut parent = None;
        self.each_local_hash(tokens, block_mm, |h| {
            let seq = parent.map_or(h, |p| next_sequence_hash(p, h));
            out.push(seq);
            parent = Some(seq);
        });
    }

    /// The local hash of block `block` of `tokens` (no multimodal objects;
    /// `block < block_count(tokens.len())`).
    #[inline]
    pub(crate) fn block_local_hash(&self, tokens: &[u32], block: usize) -> u64 {
        let start = block * self.block_size as usize;
        let window = self.block_size as usize + usize::from(self.eagle);
        let window_tokens = &tokens[start..start + window];
        if cfg!(target_endian = "little") {
            return self.hash_bytes(bytemuck::cast_slice(window_tokens));
        }
        let bytes: Vec<u8> = window_tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.hash_bytes(&bytes)
    }

    /// XXH3-64 of `bytes` under the hasher's seed (17 to 128 bytes, blocks
    /// of 5 to 32 tokens, with the seeded keys derived once).
    #[inline(always)]
    fn hash_bytes(&self, bytes: &[u8]) -> u64 {
        if (17..=128).contains(&bytes.len()) {
            self.mid.hash(bytes)
        } else {
            xxh3_64_with_seed(bytes, self.seed())
        }
    }

    fn each_local_hash(&self, tokens: &[u32], block_mm: &[&[u64]], mut visit: impl FnMut(u64)) {
        let blocks = self.block_count(tokens.len());
        let stride = self.block_size as usize;
        let window = stride + usize::from(self.eagle);
        let mut bytes = Vec::new();
        let mut mm = Vec::new();
        for block in 0..blocks {
            let start = block * stride;
            let window_tokens = &tokens[start..start + window];
            let no_mm = block_mm.get(block).is_none_or(|o| o.is_empty());
            // The tokens' little-endian bytes are their memory on a
            // little-endian target: hashed in place, nothing copied or
            // allocated.
            if no_mm {
                visit(self.block_local_hash(tokens, block));
                continue;
            }
            bytes.clear();
            for &token in window_tokens {
                bytes.extend_from_slice(&token.to_le_bytes());
            }
            if let Some(objects) = block_mm.get(block).filter(|o| !o.is_empty()) {
                mm.clear();
                mm.extend_from_slice(objects);
                mm.sort_unstable();
                for hash in &mm {
                    bytes.extend_from_slice(&hash.to_le_bytes());
                }
            }
            visit(self.hash_bytes(&bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeded keys of 17 to 128 bytes give XXH3-64's answer at every
    /// length of that case and its bounds, under the seeds of a plain
    /// request, a LoRA adapter and a cache namespace.
    #[test]
    fn mid_size_blocks_hash_as_the_library_does() {
        let mut rng = selkie_kernel::Rng::new(0x2545_f491_4f6c_dd1d);
        let bytes: Vec<u8> = (0..160).map(|_| rng.next_u64() as u8).collect();
        let hashers = [
            KvBlockHasher::new(16),
            KvBlockHasher::new(16).with_lora("adapter"),
            KvBlockHasher::new(16).with_cache_namespace("tenant").with_lora("a"),
        ];
        for hasher in hashers {
            for len in 0..=bytes.len() {
                for at in [0, 7] {
                    let input = &bytes[at..(at + len).min(bytes.len())];
                    let want = xxh3_64_with_seed(input, hasher.seed());
                    assert_eq!(
                        hasher.hash_bytes(input),
                        want,
                        "{} bytes, seed {}",
                        input.len(),
                        hasher.seed()
                    );
                }
            }
        }
    }

    /// A block's local hash is XXH3-64 of its tokens' little-endian bytes,
    /// seeded; with Eagle, the window covers the next block's first token.
    #[test]
    fn local_hashes_are_xxh3_of_the_block_tokens() {
        let tokens: Vec<u32> = (0..25).map(|t| t * 7_919 + 3).collect();
        for eagle in [false, true] {
            let hasher = KvBlockHasher::new(5).with_lora("adapter").with_eagle(eagle);
            let mut local = Vec::new();
            hasher.local_hashes(&tokens, &mut local);
            let window = 5 + usize::from(eagle);
            let expected: Vec<u64> = (0..hasher.block_count(tokens.len()))
                .map(|b| {
                    let bytes: Vec<u8> = tokens[b * 5..b * 5 + window]
                        .iter()
                        .flat_map(|t| t.to_le_bytes())
                        .collect();
                    xxh3_64_with_seed(&bytes, hasher.seed())
                })
                .collect();
            assert_eq!(local, expected, "eagle {eagle}");
            assert_eq!(local.len(), if eagle { 4 } else { 5 }, "eagle {eagle}");
        }
    }

    /// The specialised sequence hash is XXH3-64 of the 16 bytes, seeded:
    /// edge values and a million pseudo-random pairs.
    #[test]
    fn the_sequence_hash_is_xxh3_of_parent_and_local() {
        let library = |parent: u64, local: u64| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&bytes, KV_HASH_SEED)
        };
        let edges = [0, 1, u64::MAX, 1 << 63, SEQUENCE_FLIP_LO, SEQUENCE_FLIP_HI];
        for &p in &edges {
            for &l in &edges {
                assert_eq!(next_sequence_hash(p, l), library(p, l), "parent {p:#x} local {l:#x}");
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1_000_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (p, l) = (x, x.rotate_left(29) ^ 0x5555);
            assert_eq!(next_sequence_hash(p, l), library(p, l), "parent {p:#x} local {l:#x}");
        }
    }
}
