//! 64-bit key -> small value: an open-addressing table with linear probing,
//! for the index's keys (sequence hashes, engine block hashes).
//!
//! A lookup is one multiply for the home slot (the top bits of the product,
//! so sequential keys spread too) and, usually, one or two key comparisons
//! in a row of the `keys` array; a miss stops at the first empty slot. Keys
//! and values are separate arrays (a sequence hash's slot is 12 bytes) and
//! the table grows past 4/5 full. Removal shifts the entries after the hole
//! back (no tombstones), so probe runs never outlive their entries.

/// Key 0 marks an empty slot; a block whose sequence hash is 0 is kept
/// apart, in `zero`.
const EMPTY: u64 = 0;

#[derive(Clone, Debug, Default)]
pub(crate) struct HashIndex<V> {
    keys: Vec<u64>,
    ids: Vec<V>,
    /// Keys in the slots (not counting `zero`).
    len: usize,
    /// `64 - log2(slots)`: the home slot is the top bits of the product.
    shift: u32,
    zero: Option<V>,
}

impl<V: Copy + Default> HashIndex<V> {
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Heap bytes, as allocated.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.keys.capacity() * 8 + self.ids.capacity() * std::mem::size_of::<V>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<V> {
        if key == EMPTY {
            return self.zero;
        }
        self.slot(key).map(|i| self.ids[i])
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == EMPTY {
            return self.zero.as_mut();
        }
        self.slot(key).map(|i| &mut self.ids[i])
    }

    /// The slot holding `key` (not 0).
    #[inline]
    fn slot(&self, key: u64) -> Option<usize> {
        if self.keys.is_empty() {
            return None;
        }
        let mask = self.keys.len() - 1;
        let mut i = self.home(key);
        loop {
            let k = self.keys[i];
            if k == key {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// `key`'s value, inserting `value` first if the key is absent.
    pub(crate) fn get_or_insert(&mut self, key: u64, value: V) -> &mut V {
        if key == EMPTY {
            return self.zero.get_or_insert(value);
        }
        let i = match self.slot(key) {
            Some(i) => i,
            None => self.place(key, value).0,
        };
        &mut self.ids[i]
    }

    /// Keeps the entries `keep` returns `true` for (it may change them).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, &mut V) -> bool) {
        let mut gone = Vec::new();
        for (k, v) in self.keys.iter().zip(self.ids.iter_mut()) {
            if *k != EMPTY && !keep(*k, v) {
                gone.push(*k);
            }
        }
        for k in gone {
            self.remove(k);
        }
        if let Some(v) = self.zero.as_mut() {
            if !keep(EMPTY, v) {
                self.zero = None;
            }
        }
    }

    /// Sets `key`'s id; returns the id it had.
    pub(crate) fn insert(&mut self, key: u64, id: V) -> Option<V> {
        if key == EMPTY {
            return self.zero.replace(id);
        }
        self.place(key, id).1
    }

    /// Sets `key`'s (not 0) value; returns its slot and the value it had.
    fn place(&mut self, key: u64, id: V) -> (usize, Option<V>) {
        if (self.len + 1) * 5 > self.keys.len() * 4 {
            self.grow();
        }
        let mask = self.keys.len() - 1;
        let mut i = self.home(key);
        loop {
            let k = self.keys[i];
            if k == key {
                return (i, Some(std::mem::replace(&mut self.ids[i], id)));
            }
            if k == EMPTY {
                self.keys[i] = key;
                self.ids[i] = id;
                self.len += 1;
                return (i, None);
            }
            i = (i + 1) & mask;
        }
    }

    /// Removes `key`; returns its id.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        if key == EMPTY {
            return self.zero.take();
        }
        let mut hole = self.slot(key)?;
        let mask = self.keys.len() - 1;
        let id = self.ids[hole];
        self.keys[hole] = EMPTY;
        self.len -= 1;
        // Every entry of the run after the hole that the hole lies on the
        // probe path of (between its home and its slot) moves into it.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = self.keys[j];
            if k == EMPTY {
                return Some(id);
            }
            let home = self.home(k);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.keys[hole] = k;
                self.ids[hole] = self.ids[j];
                self.keys[j] = EMPTY;
                hole = j;
            }
        }
    }

    /// Every `(key, id)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let slots = self.keys.iter().zip(&self.ids).filter(|(&k, _)| k != EMPTY);
        slots.map(|(&k, &id)| (k, id)).chain(self.zero.map(|id| (EMPTY, id)))
    }

    fn grow(&mut self) {
        let slots = (self.keys.len() * 2).max(16);
        let keys = std::mem::replace(&mut self.keys, vec![EMPTY; slots]);
        let ids = std::mem::replace(&mut self.ids, vec![V::default(); slots]);
        self.shift = 64 - slots.trailing_zeros();
        let mask = slots - 1;
        for (k, id) in keys.into_iter().zip(ids).filter(|&(k, _)| k != EMPTY) {
            let mut i = self.home(k);
            while self.keys[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.keys[i] = k;
            self.ids[i] = id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, overwrites and removals against a `HashMap`, with
    /// keys drawn from a small pool (long probe runs, many removals inside
    /// them) and key 0 among them; every key of the pool is looked up
    /// after every step.
    #[test]
    fn random_operations_match_a_hash_map() {
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for pool_size in [3usize, 40, 700] {
            // Keys sharing home slots: a pool of few distinct top bits after
            // the multiply is hard to build directly, so some pool keys are
            // multiples of a large power of two (their products agree in
            // the low bits only, spreading them anyway), plus 0.
            let pool: Vec<u64> = (0..pool_size as u64)
                .map(|i| match i % 3 {
                    0 => i,
                    1 => i << 40,
                    _ => next(),
                })
                .collect();
            let mut table = HashIndex::<u32>::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            for step in 0..20_000u32 {
                let key = pool[(next() % pool_size as u64) as usize];
                let op = next() % 12;
                if op < 4 {
                    assert_eq!(table.remove(key), model.remove(&key), "step {step}: remove {key}");
                } else if op == 4 {
                    *table.get_or_insert(key, step) += 1;
                    *model.entry(key).or_insert(step) += 1;
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

    /// A full run: keys that all start at one slot, removed from the
    /// middle and the front, the rest still found.
    #[test]
    fn removal_inside_a_run_keeps_the_rest_reachable() {
        let mut table = HashIndex::<u32>::default();
        table.insert(1, 1);
        // Keys with the same home slot as key 1 in a 16-slot table.
        let home = table.home(1);
        let same: Vec<u64> = (2..u64::MAX).filter(|&k| table.home(k) == home).take(6).collect();
        for (i, &k) in same.iter().enumerate() {
            table.insert(k, i as u32 + 10);
        }
        assert_eq!(table.keys.len(), 16, "no growth yet");
        table.remove(same[2]);
        table.remove(1);
        for (i, &k) in same.iter().enumerate().filter(|&(i, _)| i != 2) {
            assert_eq!(table.get(k), Some(i as u32 + 10), "key {k}");
        }
        assert_eq!(table.get(1), None);
        assert_eq!(table.get(same[2]), None);
        assert_eq!(table.len(), 5);
    }
}
