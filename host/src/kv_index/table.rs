//! 64-bit key -> small value: the index's tables (block table, per-rank
//! tables), `hashbrown`'s [`HashTable`].
//!
//! `hashbrown` takes a key's bucket from the low bits of its hash and its
//! control byte from the top seven. The block table's keys are sequence
//! hashes, XXH3 outputs already spread over all 64 bits, so they are
//! their own hash ([`Spread`]: no work on a query's lookups). The ranks'
//! tables are keyed by engine block hashes, whatever the engines use
//! (often hashes, sometimes small counters or values with many trailing
//! zeros): a folded multiply ([`Folded`]: the 128-bit product of the key
//! and an odd constant, its halves XORed) spreads those over every bit in
//! one multiply. Keys come from the fleet's engines and from the router's
//! own hashing, not chosen by clients one by one, so nothing is seeded.
//!
//! Every table gives memory back: [`U64Table::shrink`] resizes a table
//! that holds less than an eighth of its capacity, so a table that once
//! held a burst of keys does not keep its size.
//!
//! This module holds plain tables: no index semantics.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

/// The multiplier of the folded multiply (the golden ratio's 64 bits).
const MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// A table this small is never shrunk (a few cache lines).
const MIN_SHRINK_CAPACITY: usize = 64;

/// How a table hashes its keys.
pub(crate) trait KeyHash {
    /// The hash of `key`.
    fn hash(key: u64) -> u64;
}

/// Keys that are uniform 64-bit hashes already: their own hash.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Spread;

impl KeyHash for Spread {
    #[inline(always)]
    fn hash(key: u64) -> u64 {
        key
    }
}

/// Keys of any pattern: a folded multiply.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Folded;

impl KeyHash for Folded {
    #[inline(always)]
    fn hash(key: u64) -> u64 {
        let product = u128::from(key) * u128::from(MULTIPLIER);
        product as u64 ^ (product >> 64) as u64
    }
}

/// A table of `u64` keys and `Copy` values, its keys hashed by `H`.
#[derive(Clone, Debug)]
pub(crate) struct U64Table<V, H = Folded> {
    table: HashTable<(u64, V)>,
    hash: std::marker::PhantomData<H>,
}

impl<V, H> Default for U64Table<V, H> {
    fn default() -> Self {
        U64Table {
            table: HashTable::new(),
            hash: std::marker::PhantomData,
        }
    }
}

impl<V: Copy, H: KeyHash> U64Table<V, H> {
    /// Keys in the table.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Keys the table holds before it grows.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.table.capacity()
    }

    /// Heap bytes, as allocated.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<V> {
        self.table.find(H::hash(key), |e| e.0 == key).map(|e| e.1)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        self.table.find_mut(H::hash(key), |e| e.0 == key).map(|e| &mut e.1)
    }

    /// `key`'s value, inserting `value` first if the key is absent; and
    /// whether it was inserted.
    #[inline]
    pub(crate) fn get_or_insert(&mut self, key: u64, value: V) -> (&mut V, bool) {
        match self.table.entry(H::hash(key), |e| e.0 == key, |e| H::hash(e.0)) {
            Entry::Occupied(e) => (&mut e.into_mut().1, false),
            Entry::Vacant(e) => (&mut e.insert((key, value)).into_mut().1, true),
        }
    }

    /// Sets `key`'s value; returns the value it had.
    #[cfg(test)]
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let (slot, inserted) = self.get_or_insert(key, value);
        (!inserted).then(|| std::mem::replace(slot, value))
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        match self.table.find_entry(H::hash(key), |e| e.0 == key) {
            Ok(e) => Some(e.remove().0 .1),
            Err(_) => None,
        }
    }

    /// Makes room for `additional` more keys at once, so that inserting
    /// them grows the table at most once.
    ///
    /// Panics ("capacity overflow") if no table could hold that many keys.
    pub(crate) fn reserve(&mut self, additional: usize) {
        self.table.reserve(additional, |e| H::hash(e.0));
    }

    /// Keeps the entries `keep` returns `true` for (it may change them).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, &mut V) -> bool) {
        self.table.retain(|e| keep(e.0, &mut e.1));
    }

    /// Every `(key, value)`, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.table.iter().copied()
    }

    /// Drops every key and the table's memory.
    pub(crate) fn clear(&mut self) {
        self.table = HashTable::new();
    }

    /// Gives memory back: a table with room for more than twice `keep`
    /// keys (and more than a few cache lines) that holds less than an
    /// eighth of what it has room for is resized to twice its keys (room
    /// for `keep` at least), or freed when that is none. Returns whether
    /// it was.
    pub(crate) fn shrink(&mut self, keep: usize) -> bool {
        let (len, capacity) = (self.table.len(), self.table.capacity());
        if capacity <= 2 * keep.max(MIN_SHRINK_CAPACITY) || len >= capacity / 8 {
            return false;
        }
        let target = (2 * len).max(keep);
        if target == 0 {
            self.clear();
        } else {
            self.table.shrink_to(target, |e| H::hash(e.0));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, overwrites, removals, reserves, retains and shrinks
    /// against a `HashMap`, with keys drawn from small pools (sequential
    /// keys, keys with 40 trailing zeros, random keys, and 0), under both
    /// hashes (keys that are not hashes already only cost probes under
    /// [`Spread`]).
    #[test]
    fn random_operations_match_a_hash_map() {
        random_operations::<Folded>();
        random_operations::<Spread>();
    }

    fn random_operations<H: KeyHash>() {
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for pool_size in [3usize, 40, 700] {
            let pool: Vec<u64> = (0..pool_size as u64)
                .map(|i| match i % 3 {
                    0 => i,
                    1 => i << 40,
                    _ => next(),
                })
                .collect();
            let mut table = U64Table::<u32, H>::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            for step in 0..20_000u32 {
                let key = pool[(next() % pool_size as u64) as usize];
                let op = next() % 12;
                if op < 4 {
                    assert_eq!(table.remove(key), model.remove(&key), "step {step}: remove {key}");
                } else if op == 4 {
                    *table.get_or_insert(key, step).0 += 1;
                    *model.entry(key).or_insert(step) += 1;
                } else if op == 6 && step % 97 == 0 {
                    table.reserve((next() % 64) as usize);
                } else if op == 7 && step % 31 == 0 {
                    table.shrink((next() % 3) as usize * 20);
                } else if op == 5 && step % 50 == 0 {
                    let cut = next() as u32 % 20_000;
                    table.retain(|k, v| {
                        *v ^= 1;
                        k % 2 == 0 || *v > cut
                    });
                    model.retain(|k, v| {
                        *v ^= 1;
                        k % 2 == 0 || *v > cut
                    });
                } else {
                    assert_eq!(
                        table.insert(key, step),
                        model.insert(key, step),
                        "step {step}: insert {key}"
                    );
                }
                assert_eq!(table.len(), model.len(), "step {step}");
                if step % 16 == 0 || pool_size < 50 {
                    for &k in &pool {
                        assert_eq!(table.get(k), model.get(&k).copied(), "step {step}: get {k}");
                    }
                }
            }
            let mut listed: Vec<(u64, u32)> = table.iter().collect();
            let mut expected: Vec<(u64, u32)> = model.into_iter().collect();
            listed.sort_unstable();
            expected.sort_unstable();
            assert_eq!(listed, expected, "pool {pool_size}");
        }
    }

    /// A table that held many keys and lost most of them shrinks, keeping
    /// the rest; an empty one frees its memory.
    #[test]
    fn a_mostly_empty_table_shrinks() {
        let mut table = U64Table::<u32>::default();
        for k in 0..10_000u64 {
            table.insert(k << 20, k as u32);
        }
        let full = table.heap_bytes();
        table.retain(|k, _| k < 100 << 20);
        assert!(table.shrink(0), "100 keys in room for {}", table.capacity());
        assert!(table.heap_bytes() * 16 < full, "{} of {full} bytes", table.heap_bytes());
        assert!((0..100u64).all(|k| table.get(k << 20) == Some(k as u32)));
        assert!(!table.shrink(0), "shrunk twice");
        table.retain(|_, _| false);
        table.shrink(0);
        assert_eq!(table.heap_bytes(), 0);
        // Room kept: a table reserved for 1,000 keys keeps it.
        let mut reserved = U64Table::<u32>::default();
        reserved.reserve(1_000);
        let room = reserved.capacity();
        reserved.insert(1, 1);
        assert!(!reserved.shrink(1_000));
        assert_eq!(reserved.capacity(), room);
        for k in 0..10_000u64 {
            reserved.insert(k, 0);
        }
        reserved.retain(|k, _| k < 10);
        assert!(reserved.shrink(1_000));
        assert!(reserved.capacity() >= 1_000 && reserved.capacity() < room * 4);
    }

    /// Keys that differ only in their high bits, or only in their low
    /// bits, spread over the buckets: the longest run of one hash's bucket
    /// bits among 4,096 keys is short.
    #[test]
    fn patterned_keys_spread() {
        for shift in [0u32, 20, 40, 52] {
            let mut buckets = HashMap::new();
            for k in 0..4_096u64 {
                *buckets.entry(Folded::hash(k << shift) & 8_191).or_insert(0u32) += 1;
            }
            let worst = buckets.values().copied().max().unwrap();
            assert!(worst <= 6, "keys << {shift}: {worst} keys in one bucket");
        }
    }
}
