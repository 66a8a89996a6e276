//! A simulated worker's KV cache: a fixed number of blocks, prefix blocks
//! known by their hash, reference-counted while a request uses them, and
//! least-recently-used eviction among the blocks nobody uses (the model of
//! vLLM's and SGLang's prefix caches).
//!
//! Blocks a running request holds are pinned and never evicted; a request is
//! admitted only when its new blocks fit (see [`KvCache::acquire`]). This
//! module knows nothing of time or routing.

const NIL: u32 = u32::MAX;

/// A map keyed by block hash, with rustc's Fx hash: one multiply per key,
/// which still spreads the small sequential integers some traces use as
/// block hashes (SipHash would be ten times slower here).
pub type BlockMap<V> = rustc_hash::FxHashMap<u64, V>;

#[derive(Clone, Copy, Debug)]
struct Block {
    hash: u64,
    refs: u32,
    prev: u32,
    next: u32,
}

/// One change of a cache's contents, as the worker's KV event reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheChange {
    /// A block was cached.
    Stored {
        /// The block.
        hash: u64,
        /// The block before it in the request (`None`: the request's first).
        parent: Option<u64>,
    },
    /// Block `hash` was evicted.
    Evicted(u64),
}

/// A KV cache of `capacity` blocks with prefix hashing and LRU eviction.
#[derive(Clone, Debug)]
pub struct KvCache {
    capacity: u32,
    /// Blocks in use or cached: hashed blocks plus anonymous (unhashed) ones.
    used: u32,
    anonymous: u32,
    index: BlockMap<u32>,
    blocks: Vec<Block>,
    free_slots: Vec<u32>,
    /// Oldest unreferenced hashed block (evicted first).
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
    /// Blocks added (`true`) and evicted (`false`) since the last drain: the
    /// KV events a worker would publish.
    changes: Vec<CacheChange>,
}

/// What [`KvCache::acquire`] granted a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquired {
    /// Leading prompt blocks that were already cached (the prefix hit).
    pub hit_blocks: u32,
}

impl KvCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: u32) -> Self {
        KvCache {
            capacity,
            used: 0,
            anonymous: 0,
            index: BlockMap::default(),
            blocks: Vec::new(),
            free_slots: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            changes: Vec::new(),
        }
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Blocks occupied (pinned or cached).
    pub fn used(&self) -> u32 {
        self.used
    }

    /// Blocks pinned by running requests.
    pub fn pinned(&self) -> u32 {
        self.used - self.lru_len
    }

    /// Takes the blocks added (`true`) and evicted (`false`) since the last
    /// call, in order: the KV events a worker publishes to a router's indexer.
    pub fn drain_changes(&mut self) -> std::vec::Drain<'_, CacheChange> {
        self.changes.drain(..)
    }

    /// How many leading `hashes` are resident: the prefix overlap a router's
    /// indexer would report for this worker.
    pub fn prefix_match(&self, hashes: &[u64]) -> u32 {
        hashes.iter().take_while(|h| self.index.contains_key(h)).count() as u32
    }

    /// Pins the prompt blocks `hashes` and `extra` anonymous blocks (the
    /// output) for one request, evicting unreferenced blocks as needed.
    ///
    /// Returns `None`, changing nothing, when the new blocks do not fit and
    /// `force` is false; with `force` the cache may go over capacity (a lone
    /// request larger than the cache must still run).
    pub fn acquire(&mut self, hashes: &[u64], extra: u32, force: bool) -> Option<Acquired> {
        let hit_blocks = self.prefix_match(hashes);
        let new_blocks = hashes.iter().filter(|h| !self.index.contains_key(h)).count() as u32 + extra;
        let reusable_unpinned = hashes
            .iter()
            .filter_map(|h| self.index.get(h))
            .filter(|&&b| self.blocks[b as usize].refs == 0)
            .count() as u32;
        let free = self.capacity.saturating_sub(self.used);
        let evictable = self.lru_len - reusable_unpinned;
        if !force && new_blocks > free + evictable {
            return None;
        }
        // Pin what is resident first, so that making room for the new
        // blocks cannot evict a block this request is about to reuse.
        let mut missing = 0;
        for &h in hashes {
            match self.index.get(&h) {
                Some(&b) => self.pin(b),
                None => missing += 1,
            }
        }
        if missing > 0 {
            for (j, &h) in hashes.iter().enumerate() {
                if self.index.contains_key(&h) {
                    continue;
                }
                self.make_room();
                let b = self.alloc(h, j.checked_sub(1).map(|p| hashes[p]));
                self.index.insert(h, b);
                self.used += 1;
            }
        }
        for _ in 0..extra {
            self.make_room();
            self.used += 1;
            self.anonymous += 1;
        }
        Some(Acquired { hit_blocks })
    }

    /// Unpins what [`acquire`](Self::acquire) pinned, then caches
    /// `output_hashes` (generated blocks a later prompt will reuse) in place
    /// of anonymous blocks.
    ///
    /// `output_parent` is the block the output blocks continue (the
    /// prompt's last full block: a partial last prompt block is not their
    /// parent).
    pub fn release(&mut self, hashes: &[u64], extra: u32, output_hashes: &[u64], output_parent: Option<u64>) {
        // Last block first: the LRU then evicts a prompt's tail before its
        // prefix, so what stays cached is always a prefix (as vLLM does).
        for &h in hashes.iter().rev() {
            if let Some(&b) = self.index.get(&h) {
                self.unpin(b);
            }
        }
        let extra = extra.min(self.anonymous);
        self.anonymous -= extra;
        self.used -= extra;
        let mut parent = output_parent;
        for &h in output_hashes {
            let block_parent = parent.replace(h);
            if self.index.contains_key(&h) {
                continue;
            }
            if self.used >= self.capacity && !self.evict_one() {
                break;
            }
            let b = self.alloc(h, block_parent);
            self.index.insert(h, b);
            self.used += 1;
            self.blocks[b as usize].refs = 1;
            self.unpin(b);
        }
    }

    fn make_room(&mut self) {
        if self.used >= self.capacity {
            self.evict_one();
        }
    }

    fn evict_one(&mut self) -> bool {
        let b = self.lru_head;
        if b == NIL {
            return false;
        }
        self.lru_unlink(b);
        let hash = self.blocks[b as usize].hash;
        self.index.remove(&hash);
        self.changes.push(CacheChange::Evicted(hash));
        self.free_slots.push(b);
        self.used -= 1;
        true
    }

    fn alloc(&mut self, hash: u64, parent: Option<u64>) -> u32 {
        self.changes.push(CacheChange::Stored { hash, parent });
        let block = Block {
            hash,
            refs: 1,
            prev: NIL,
            next: NIL,
        };
        match self.free_slots.pop() {
            Some(b) => {
                self.blocks[b as usize] = block;
                b
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    fn pin(&mut self, b: u32) {
        if self.blocks[b as usize].refs == 0 {
            self.lru_unlink(b);
        }
        self.blocks[b as usize].refs += 1;
    }

    fn unpin(&mut self, b: u32) {
        let block = &mut self.blocks[b as usize];
        if block.refs == 0 {
            return; // a hash listed twice in one request: already unpinned
        }
        block.refs -= 1;
        if block.refs == 0 {
            self.lru_push_back(b);
        }
    }

    fn lru_unlink(&mut self, b: u32) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.blocks[b as usize].prev = NIL;
        self.blocks[b as usize].next = NIL;
        self.lru_len -= 1;
    }

    fn lru_push_back(&mut self, b: u32) {
        self.blocks[b as usize].prev = self.lru_tail;
        self.blocks[b as usize].next = NIL;
        if self.lru_tail == NIL {
            self.lru_head = b;
        } else {
            self.blocks[self.lru_tail as usize].next = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_hit_counts_only_leading_blocks() {
        let mut c = KvCache::new(100);
        c.acquire(&[1, 2, 3], 0, false).unwrap();
        c.release(&[1, 2, 3], 0, &[], None);
        assert_eq!(c.prefix_match(&[1, 2, 9, 3]), 2);
        assert_eq!(c.prefix_match(&[9, 1, 2]), 0);
        assert_eq!(c.acquire(&[1, 2, 3, 4], 2, false), Some(Acquired { hit_blocks: 3 }));
        assert_eq!(c.used(), 6);
        assert_eq!(c.pinned(), 6);
    }

    #[test]
    fn least_recently_used_block_goes_first_and_a_tail_before_its_prefix() {
        let mut c = KvCache::new(4);
        c.acquire(&[1, 2], 0, false).unwrap();
        c.release(&[1, 2], 0, &[], None);
        c.acquire(&[3, 4], 0, false).unwrap();
        c.release(&[3, 4], 0, &[], None);
        // Touch 1 and 2 again: 3 and 4 become the oldest.
        c.acquire(&[1, 2], 0, false).unwrap();
        c.release(&[1, 2], 0, &[], None);
        c.acquire(&[5], 0, false).unwrap();
        assert_eq!(c.prefix_match(&[3, 4]), 1, "4, the tail of 3-4, went first");
        assert_eq!(c.prefix_match(&[4]), 0);
        assert_eq!(c.prefix_match(&[1, 2]), 2);
        assert_eq!(c.used(), 4);
        c.acquire(&[6], 0, false).unwrap();
        assert_eq!(c.prefix_match(&[3]), 0, "then 3");
        assert_eq!(c.prefix_match(&[1, 2]), 2);
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_admission_waits() {
        let mut c = KvCache::new(4);
        c.acquire(&[1, 2, 3], 0, false).unwrap();
        assert_eq!(c.acquire(&[7, 8], 0, false), None, "only one free block");
        assert_eq!(c.used(), 3, "a refused acquire changes nothing");
        assert!(c.acquire(&[7], 0, false).is_some());
        assert_eq!(c.prefix_match(&[1, 2, 3]), 3);
        // Forcing goes over capacity rather than evicting pinned blocks.
        assert!(c.acquire(&[9], 1, true).is_some());
        assert_eq!(c.used(), 6);
        assert_eq!(c.prefix_match(&[1, 2, 3]), 3);
    }

    #[test]
    fn output_hashes_are_cached_on_release() {
        let mut c = KvCache::new(8);
        c.acquire(&[1, 2], 3, false).unwrap();
        assert_eq!(c.used(), 5);
        c.release(&[1, 2], 3, &[10, 11], Some(2));
        assert_eq!(c.used(), 4);
        assert_eq!(c.pinned(), 0);
        assert_eq!(c.prefix_match(&[1, 2, 10, 11]), 4);
    }
}
