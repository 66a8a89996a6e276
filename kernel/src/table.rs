//! A 64-bit key -> small value hash table, for keys that are hashes or
//! ids (the host's KV index keys its block table by sequence hashes and
//! its per-rank tables by engine block hashes): open addressing with
//! linear probing, built for lookups that hit.
//!
//! A lookup is one multiply for the home slot (the top bits of the product,
//! so sequential keys spread too) and, usually, one or two key comparisons
//! along the entries; a miss stops at the first empty slot. A key and its
//! value share an entry (one cache line holds both). Against `hashbrown`'s
//! `HashTable` (a control group read and matched before any entry), the
//! KV index's queries took 1.2 to 1.8 times as long: a query is a chain of
//! lookups that hit, where this table reads one entry per lookup.
//!
//! Beside the entries, one control byte per slot says whether it is empty
//! and, if not, carries seven more bits of its key's product (SwissTable's
//! idea). An insertion reads the control bytes eight at a time for its
//! key's byte or an empty slot, and reads an entry only where the byte
//! matches: a new key's entry is written without being read, so inserting
//! many new keys into a table larger than the caches does not wait on each
//! entry's cache line, and a long probe run costs a few group reads
//! instead of a branch per entry. Lookups compare the entries themselves:
//! fewer instructions where the entries are in cache (a query's prefix
//! that many requests share). The table grows past 4/5 full, or past 7/8
//! full for a dense table (`DENSE`: fewer bytes and fewer growths, for
//! longer probes near the limit; for tables no query reads). Removal shifts
//! the entries after the hole back, with their control bytes (no
//! tombstones), so probe runs never outlive their entries. A table that
//! holds less than an eighth of its room shrinks on request
//! ([`HashIndex::shrink`]).
//!
//! The multiplier is fixed: keys must not be chosen by an adversary who
//! can make them collide (hashes of content, ids handed out by the
//! system).
//!
//! The one module of the kernel that allocates besides
//! [`Fleet::boxed`](crate::Fleet::boxed) and [`two_copies`](crate::two_copies)
//! (feature `alloc`). Its unchecked accesses are exercised under Miri by
//! its tests.

use alloc::vec;
use alloc::vec::Vec;

/// Key 0 marks an empty slot; key 0 itself is kept in the entry after the
/// probed ones.
const EMPTY: u64 = 0;

/// Control bytes read at once (one `u64`).
const GROUP: usize = 8;
/// The bit every occupied slot's control byte has (an empty slot's is 0).
const TAG: u8 = 0x80;
/// `0x01` and `0x80` in every byte of a group.
const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// The multiplier of a key's product (the home slot is its top bits, the
/// control byte its low seven).
const MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// A table this small is never shrunk (a few cache lines).
const MIN_SHRINK_ROOM: usize = 64;

/// `u64` keys to `Copy` values (see the module documentation); `DENSE`
/// tables grow past 7/8 full instead of 4/5.
///
/// ```
/// use selkie_kernel::table::HashIndex;
/// let mut t = HashIndex::<u32>::default();
/// assert_eq!(t.insert(7, 70), None);
/// *t.get_or_insert(8, 0).0 += 80;
/// assert_eq!((t.get(7), t.get(8), t.len()), (Some(70), Some(80), 2));
/// assert_eq!(t.remove(7), Some(70));
/// assert_eq!(t.get(7), None);
/// ```
#[derive(Clone, Debug, Default)]
pub struct HashIndex<V, const DENSE: bool = false> {
    /// A power of two of probed entries, then key 0's entry (no entries
    /// before the first insertion).
    entries: Vec<(u64, V)>,
    /// One byte per probed entry (0: empty; else [`TAG`] and seven bits of
    /// the key's product), then a copy of the first [`GROUP`] bytes, so
    /// that a group read at any slot wraps around the table (empty before
    /// the first insertion).
    ctrl: Vec<u8>,
    /// Keys in the probed entries (not counting key 0).
    len: usize,
    /// `64 - log2(probed entries)`: the home slot is the top bits of the
    /// product.
    shift: u32,
    /// Keys the probed entries take before the table grows (4/5 of them,
    /// 7/8 if `DENSE`; 0 before the first insertion), kept so that an
    /// insertion's check is one comparison.
    room: usize,
    /// Whether key 0 is present (its value in the last entry).
    has_zero: bool,
}

impl<V: Copy + Default, const DENSE: bool> HashIndex<V, DENSE> {
    /// The keys a table of `slots` probed entries takes before it grows.
    const fn room_of(slots: usize) -> usize {
        if DENSE {
            slots - slots / 8
        } else {
            slots * 4 / 5
        }
    }

    /// Keys in the table.
    #[inline]
    pub fn len(&self) -> usize {
        self.len + usize::from(self.has_zero)
    }

    /// Whether the table holds no key.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys the table holds before it grows.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.room
    }

    /// Heap bytes, as allocated.
    pub fn heap_bytes(&self) -> usize {
        self.entries.capacity() * core::mem::size_of::<(u64, V)>() + self.ctrl.capacity()
    }

    /// Probed entries (a power of two, or 0).
    #[inline]
    fn slots(&self) -> usize {
        self.entries.len().saturating_sub(1)
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(MULTIPLIER) >> self.shift) as usize
    }

    /// `key`'s control byte.
    #[inline]
    fn tag(key: u64) -> u8 {
        key.wrapping_mul(MULTIPLIER) as u8 | TAG
    }

    /// Sets slot `i`'s control byte (and its copy after the table).
    #[inline]
    fn set_ctrl(&mut self, i: usize, byte: u8) {
        self.ctrl[i] = byte;
        if i < GROUP {
            let slots = self.slots();
            self.ctrl[slots + i] = byte;
        }
    }

    /// The control bytes of slots `i..i + GROUP` (wrapping), the first in
    /// the lowest byte, read without a bounds check.
    ///
    /// # Safety
    ///
    /// `i + GROUP` is at most the control bytes' length (`i` below
    /// `slots`).
    #[inline(always)]
    unsafe fn group_unchecked(&self, i: usize) -> u64 {
        debug_assert!(i + GROUP <= self.ctrl.len());
        // SAFETY: the caller's bound: the `GROUP` bytes at `i` are in the
        // control bytes; an unaligned read of plain bytes.
        u64::from_le(unsafe { self.ctrl.as_ptr().add(i).cast::<u64>().read_unaligned() })
    }

    /// [`set_ctrl`](Self::set_ctrl) without its bounds checks.
    ///
    /// # Safety
    ///
    /// `i` is below `slots` and the control bytes are `slots + GROUP` long.
    #[inline(always)]
    unsafe fn set_ctrl_unchecked(&mut self, i: usize, byte: u8) {
        let slots = self.slots();
        debug_assert!(i < slots && self.ctrl.len() == slots + GROUP);
        // SAFETY: the caller's bounds: `i < slots` and, for `i < GROUP`,
        // `slots + i < slots + GROUP`.
        unsafe {
            *self.ctrl.get_unchecked_mut(i) = byte;
            if i < GROUP {
                *self.ctrl.get_unchecked_mut(slots + i) = byte;
            }
        }
    }

    /// `key`'s value.
    #[inline]
    pub fn get(&self, key: u64) -> Option<V> {
        let i = self.index_of(key)?;
        // SAFETY: `index_of` returns a probed entry (below `slots`) or key
        // 0's entry (`slots`, present once there is a key), and `entries`
        // holds `slots + 1`.
        Some(unsafe { self.entries.get_unchecked(i) }.1)
    }

    /// `key`'s value, to change.
    #[inline]
    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        self.index_of(key).map(|i| &mut self.entries[i].1)
    }

    /// Asks the CPU to start loading `key`'s home slot, so that a lookup or
    /// insertion of `key` soon after finds it in cache (a hint: the table
    /// is not read or changed, and nothing happens where the target has no
    /// prefetch instruction, or under Miri).
    #[inline]
    pub fn prefetch(&self, key: u64) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if self.slots() != 0 {
            use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // The home slot is below `slots`: the address of an entry
            // (computed without a bounds check, as a prefetch needs none).
            let slot = self.entries.as_ptr().wrapping_add(self.home(key));
            // SAFETY: a prefetch is a hint that never faults or changes
            // memory.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(slot.cast()) };
        }
        #[cfg(not(all(target_arch = "x86_64", not(miri))))]
        let _ = key;
    }

    /// The entry holding `key`.
    #[inline]
    fn index_of(&self, key: u64) -> Option<usize> {
        if key == EMPTY {
            return self.has_zero.then_some(self.slots());
        }
        if self.slots() == 0 {
            return None;
        }
        self.probe(key).ok()
    }

    /// Where the probe for `key` (not 0) stops, in a table with entries:
    /// `Ok` at the entry holding it, `Err` at the empty slot it would take.
    #[inline]
    fn probe(&self, key: u64) -> Result<usize, usize> {
        let mask = self.slots() - 1;
        let mut i = self.home(key);
        debug_assert!(i <= mask && mask < self.entries.len());
        loop {
            // SAFETY: `i` is a home slot (the product's top `log2(slots)`
            // bits, below `slots`) or masked by `slots - 1`, and `entries`
            // holds `slots + 1` entries. Without the bounds check the loop
            // is two instructions shorter per probed entry.
            let k = unsafe { self.entries.get_unchecked(i) }.0;
            if k == key {
                return Ok(i);
            }
            if k == EMPTY {
                return Err(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The entry holding `key`, inserted with `value` first if the key is
    /// absent (and whether it was): one probe either way.
    #[inline(always)]
    fn index_or_insert(&mut self, key: u64, value: V) -> (usize, bool) {
        if self.len >= self.room {
            self.grow();
        }
        let slots = self.slots();
        if key == EMPTY {
            let inserted = !self.has_zero;
            if inserted {
                self.has_zero = true;
                self.entries[slots].1 = value;
            }
            return (slots, inserted);
        }
        let mask = slots - 1;
        let tag = Self::tag(key);
        let tags = LO * u64::from(tag);
        let mut i = self.home(key);
        debug_assert!(i <= mask && self.entries.len() == slots + 1 && self.ctrl.len() == slots + GROUP);
        loop {
            // SAFETY: `i` is a home slot (below `slots`) or masked by
            // `slots - 1`, and the control bytes are `slots + GROUP` long.
            let group = unsafe { self.group_unchecked(i) };
            let empty = !group & HI;
            // Bytes equal to `tag` (the zero-byte test of `group ^ tags`;
            // a byte past a true match may show as one too, which the key
            // comparison rules out), before the first empty slot.
            let x = group ^ tags;
            let first_empty = empty & empty.wrapping_neg();
            let mut matches = x.wrapping_sub(LO) & !x & HI & first_empty.wrapping_sub(1);
            while matches != 0 {
                let j = (i + matches.trailing_zeros() as usize / 8) & mask;
                // SAFETY: `j` is masked by `slots - 1`; `entries` holds
                // `slots + 1`.
                if unsafe { self.entries.get_unchecked(j) }.0 == key {
                    return (j, false);
                }
                matches &= matches - 1;
            }
            if empty != 0 {
                let j = (i + empty.trailing_zeros() as usize / 8) & mask;
                // SAFETY: as above: `j` is below `slots`, `entries` holds
                // `slots + 1` and the control bytes `slots + GROUP`.
                unsafe {
                    *self.entries.get_unchecked_mut(j) = (key, value);
                    self.set_ctrl_unchecked(j, tag);
                }
                self.len += 1;
                return (j, true);
            }
            i = (i + GROUP) & mask;
        }
    }

    /// Makes room for `additional` more keys at once, so that inserting
    /// them grows the table at most once, straight to its final size.
    ///
    /// # Panics
    /// "capacity overflow" if no table could hold that many keys.
    pub fn reserve(&mut self, additional: usize) {
        let target = self.len.checked_add(additional).expect("capacity overflow");
        if target > self.room {
            // The smallest power of two of slots (16 at least) with room
            // for `target`; `room_of` multiplies by 4, so slots stay below
            // a quarter of the address space (the entries could not be
            // allocated long before).
            let mut slots: usize = 16;
            while Self::room_of(slots) < target {
                slots = slots
                    .checked_mul(2)
                    .filter(|&s| s <= usize::MAX / 4)
                    .expect("capacity overflow");
            }
            self.grow_to(slots);
        }
    }

    /// `key`'s value, inserting `value` first if the key is absent, and
    /// whether it was inserted: one probe either way.
    #[inline]
    pub fn get_or_insert(&mut self, key: u64, value: V) -> (&mut V, bool) {
        let (i, inserted) = self.index_or_insert(key, value);
        debug_assert!(i < self.entries.len());
        // SAFETY: `index_or_insert` returns a probed entry (below `slots`)
        // or key 0's (`slots`), and `entries` holds `slots + 1`.
        (unsafe { &mut self.entries.get_unchecked_mut(i).1 }, inserted)
    }

    /// Keeps the entries `keep` returns `true` for (it may change them).
    pub fn retain(&mut self, mut keep: impl FnMut(u64, &mut V) -> bool) {
        let slots = self.slots();
        let mut gone = Vec::new();
        for (k, v) in &mut self.entries[..slots] {
            if *k != EMPTY && !keep(*k, v) {
                gone.push(*k);
            }
        }
        for k in gone {
            self.remove(k);
        }
        if self.has_zero && !keep(EMPTY, &mut self.entries[slots].1) {
            self.has_zero = false;
        }
    }

    /// Sets `key`'s value; returns the value it had.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let (slot, inserted) = self.get_or_insert(key, value);
        (!inserted).then(|| core::mem::replace(slot, value))
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: u64) -> Option<V> {
        let mut hole = self.index_of(key)?;
        let value = self.entries[hole].1;
        if key == EMPTY {
            self.has_zero = false;
            return Some(value);
        }
        let mask = self.slots() - 1;
        self.entries[hole].0 = EMPTY;
        self.set_ctrl(hole, 0);
        self.len -= 1;
        // Every entry of the run after the hole that the hole lies on the
        // probe path of (between its home and its slot) moves into it.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = self.entries[j].0;
            if k == EMPTY {
                return Some(value);
            }
            let home = self.home(k);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.entries[hole] = self.entries[j];
                self.entries[j].0 = EMPTY;
                let byte = self.ctrl[j];
                self.set_ctrl(hole, byte);
                self.set_ctrl(j, 0);
                hole = j;
            }
        }
    }

    /// Every `(key, value)`, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let slots = self.slots();
        let probed = Occupied::new(&self.ctrl, slots).map(|i| self.entries[i]);
        probed.chain(self.has_zero.then(|| (EMPTY, self.entries[slots].1)))
    }

    /// Drops every key and the table's memory.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Gives memory back: a table with room for more than twice `keep`
    /// keys (and more than a few cache lines) that holds less than an
    /// eighth of its room is moved to the smallest table with room for
    /// twice its keys (and for `keep`), or freed when that is none.
    /// Returns whether it was.
    pub fn shrink(&mut self, keep: usize) -> bool {
        let len = self.len();
        if self.room <= 2 * keep.max(MIN_SHRINK_ROOM) || len >= self.room / 8 {
            return false;
        }
        let target = (2 * len).max(keep);
        if target == 0 {
            self.clear();
            return true;
        }
        let mut slots: usize = 16;
        while Self::room_of(slots) < target {
            slots *= 2;
        }
        self.grow_to(slots);
        true
    }

    /// Panics unless every slot's control byte is its entry's (0 where it
    /// is empty) and the bytes after the table copy the first group.
    #[cfg(test)]
    fn check_ctrl(&self) {
        let slots = self.slots();
        if slots == 0 {
            assert!(self.ctrl.is_empty(), "control bytes before the first insertion");
            return;
        }
        assert_eq!(self.ctrl.len(), slots + GROUP);
        for (i, &(k, _)) in self.entries[..slots].iter().enumerate() {
            let expected = if k == EMPTY { 0 } else { Self::tag(k) };
            assert_eq!(self.ctrl[i], expected, "slot {i} (key {k}): control byte");
        }
        assert_eq!(self.ctrl[slots..], self.ctrl[..GROUP], "the control bytes' copy");
    }

    /// Out of line: an insertion's fast path stays short enough to inline.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        self.grow_to((self.slots() * 2).max(16));
    }

    /// Moves the entries to a table of `slots` probed entries (a power of
    /// two, 16 at least, with room for every key).
    fn grow_to(&mut self, slots: usize) {
        debug_assert!(slots.is_power_of_two() && slots >= 16 && Self::room_of(slots) >= self.len);
        let old = core::mem::replace(&mut self.entries, vec![(EMPTY, V::default()); slots + 1]);
        self.ctrl = vec![0; slots + GROUP];
        self.shift = 64 - slots.trailing_zeros();
        self.room = Self::room_of(slots);
        let mask = slots - 1;
        let Some((&(_, zero), probed)) = old.split_last() else {
            return;
        };
        self.entries[slots].1 = zero;
        // The new table's empty slots are found by its control bytes (read,
        // where its entries are only written).
        for &(k, v) in probed.iter().filter(|(k, _)| *k != EMPTY) {
            let mut i = self.home(k);
            // SAFETY: `i` is a home slot (below `slots`) or masked by
            // `slots - 1`; `entries` holds `slots + 1` and the control
            // bytes are `slots + GROUP` long (both made just above).
            unsafe {
                while *self.ctrl.get_unchecked(i) != 0 {
                    i = (i + 1) & mask;
                }
                *self.entries.get_unchecked_mut(i) = (k, v);
                self.set_ctrl_unchecked(i, Self::tag(k));
            }
        }
    }
}

/// The occupied slots of a table with `slots` probed entries (a power of
/// two, 16 at least, or 0), in order, from its control bytes: a group's
/// occupied bytes at once, then one set bit after another.
struct Occupied<'a> {
    ctrl: &'a [u8],
    /// The next group's first slot (the current group's is `GROUP` before).
    next: usize,
    /// `0x80` in each byte of the current group not yet returned whose
    /// slot is occupied.
    full: u64,
}

impl<'a> Occupied<'a> {
    fn new(ctrl: &'a [u8], slots: usize) -> Self {
        Occupied {
            ctrl: &ctrl[..slots],
            next: 0,
            full: 0,
        }
    }
}

impl Iterator for Occupied<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        while self.full == 0 {
            let bytes = self.ctrl.get(self.next..self.next + GROUP)?;
            self.full = u64::from_le_bytes(bytes.try_into().expect("a group's bytes")) & HI;
            self.next += GROUP;
        }
        let i = self.next - GROUP + self.full.trailing_zeros() as usize / 8;
        self.full &= self.full - 1;
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::vec::Vec;

    /// Random inserts, overwrites and removals against a `HashMap`, with
    /// keys drawn from a small pool (long probe runs, many removals inside
    /// them) and key 0 among them; every key of the pool is looked up
    /// after every step.
    fn random_operations<const DENSE: bool>() {
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
            let mut table = HashIndex::<u32, DENSE>::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            // Fewer steps and checks under Miri (every probe is checked
            // there, and a step with its checks costs about 0.1 s): 150
            // steps still grow the largest pool's table four times. The
            // whole-table check of the largest pool (2 s there) runs every
            // 64 steps instead of 16.
            let steps = if cfg!(miri) { 150 } else { 20_000 };
            let check_every = if cfg!(miri) && pool_size > 50 { 64 } else { 16 };
            for step in 0..steps {
                let key = pool[(next() % pool_size as u64) as usize];
                let op = next() % 12;
                if op < 4 {
                    assert_eq!(table.remove(key), model.remove(&key), "step {step}: remove {key}");
                } else if op == 4 {
                    *table.get_or_insert(key, step).0 += 1;
                    *model.entry(key).or_insert(step) += 1;
                } else if op == 6 && step % 97 == 0 {
                    // Room made ahead changes no entry.
                    table.reserve((next() % 64) as usize);
                } else if op == 7 && step % 31 == 0 {
                    // Nor does giving memory back.
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
                if step % check_every == 0 || (pool_size < 50 && (!cfg!(miri) || step % 4 == 0)) {
                    table.check_ctrl();
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

    #[test]
    fn random_operations_match_a_hash_map() {
        random_operations::<false>();
    }

    #[test]
    fn random_operations_on_a_dense_table_match_a_hash_map() {
        random_operations::<true>();
    }

    /// `reserve(n)` grows the table once, so that inserting `n` new keys
    /// grows it no more, and keeps every entry.
    #[test]
    fn reserve_grows_once_to_fit_the_keys_to_come() {
        let mut table = HashIndex::<u32>::default();
        for k in 0..10u64 {
            table.insert(k, k as u32);
        }
        table.reserve(1_000);
        let slots = table.slots();
        assert!(slots * 4 >= 1_010 * 5, "{slots} slots hold 1,010 keys at 4/5");
        for k in 10..1_010u64 {
            table.insert(k, k as u32);
        }
        assert_eq!(table.slots(), slots, "no growth after the reserve");
        assert!((0..1_010u64).all(|k| table.get(k) == Some(k as u32)));
        table.reserve(0);
        assert_eq!(table.slots(), slots, "nothing to make room for");
    }

    /// A table of `n` slots takes `room(n)` keys and grows on the next one,
    /// at every size; `reserve` sizes it by the same rule.
    fn grows_past<const DENSE: bool>(room: impl Fn(usize) -> usize) {
        let mut table = HashIndex::<u32, DENSE>::default();
        let mut key = 1u64;
        // Up to 4,096 slots (1,024 under Miri, where every access is
        // checked).
        let largest = if cfg!(miri) { 11 } else { 13 };
        for slots in (4..largest).map(|p| 1usize << p) {
            while table.len() < room(slots) {
                table.insert(key, 0);
                key += 1;
            }
            assert_eq!(table.slots(), slots, "{} keys", table.len());
            table.insert(key, 0);
            key += 1;
            assert_eq!(table.slots(), slots * 2, "{} keys", table.len());
            let mut reserved = HashIndex::<u32, DENSE>::default();
            reserved.reserve(room(slots));
            assert_eq!(reserved.slots(), slots, "room for {} keys", room(slots));
            reserved.reserve(room(slots) + 1);
            assert_eq!(reserved.slots(), slots * 2, "room for {} keys", room(slots) + 1);
        }
    }

    #[test]
    fn grows_past_four_fifths_full() {
        grows_past::<false>(|slots| slots * 4 / 5);
    }

    #[test]
    fn a_dense_table_grows_past_seven_eighths_full() {
        grows_past::<true>(|slots| slots * 7 / 8);
    }

    /// A table that held many keys and lost most of them shrinks on
    /// request, keeping the rest (key 0 among them) and the room asked
    /// for; an empty one frees its memory.
    #[test]
    fn a_mostly_empty_table_shrinks() {
        let keys: u64 = if cfg!(miri) { 600 } else { 10_000 };
        let mut table = HashIndex::<u32, true>::default();
        for k in 0..keys {
            table.insert(k << 20, k as u32);
        }
        let full = table.heap_bytes();
        table.retain(|k, _| k < 10 << 20);
        assert!(table.shrink(0), "10 keys in room for {}", table.capacity());
        table.check_ctrl();
        assert!(table.heap_bytes() * 16 < full, "{} of {full} bytes", table.heap_bytes());
        assert!(
            (0..10u64).all(|k| table.get(k << 20) == Some(k as u32)),
            "key 0 among them"
        );
        assert!(!table.shrink(0), "shrunk twice");
        table.retain(|_, _| false);
        assert!(table.shrink(0) || table.capacity() <= 2 * MIN_SHRINK_ROOM);
        table.clear();
        assert_eq!((table.heap_bytes(), table.len()), (0, 0));
        // Room kept: a table reserved for 1,000 keys (200 under Miri)
        // keeps it, until it grew past it and lost its keys again.
        let kept: u64 = if cfg!(miri) { 200 } else { 1_000 };
        let mut reserved = HashIndex::<u32>::default();
        reserved.reserve(kept as usize);
        let room = reserved.capacity();
        reserved.insert(1, 1);
        assert!(!reserved.shrink(kept as usize));
        assert_eq!(reserved.capacity(), room);
        for k in 0..3 * kept {
            reserved.insert(k, 0);
        }
        reserved.retain(|k, _| k < 10);
        assert!(reserved.shrink(kept as usize));
        assert!(reserved.capacity() >= kept as usize && reserved.capacity() < room * 4);
        assert!((0..10u64).all(|k| reserved.get(k).is_some()));
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
        assert_eq!(table.slots(), 16, "no growth yet");
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
