//! Two copies of a value, one for readers and one for the single writer,
//! so that readers never wait for the writer (the "left-right" technique,
//! with the readers counted per publish period). The host's KV index
//! serves its queries from it.
//!
//! ```text
//! state = the copy readers enter (top bit) | readers entered since the last publish
//!
//! reader:  s = state.fetch_add(1)            (Acquire)  -> copy c = top bit of s
//!          read copy c
//!          departed[c].fetch_add(1)          (Release)
//! writer:  write copy w (the one readers do not enter)
//!          publish: s = state.swap(w | 0)    (AcqRel)   -> n = readers of the old copy
//!                   wait until departed[old] == n       (Acquire)
//!                   departed[old] = 0; copy old is the writer's
//! ```
//!
//! Why a reader never reads the copy being written: every reader's entry is
//! one read-modify-write of `state`, so it falls either before the
//! writer's swap (then the swap counts it in `n`, it reads the old copy, and
//! the writer waits for its departure before writing that copy) or after it
//! (then it reads the new copy, which the writer does not write until the
//! next swap has counted it out). The acquire of the entry makes the
//! writer's writes before the swap visible to the reader; the release of
//! the departure makes the reader's reads happen before the writer's next
//! writes. A reader runs two atomic read-modify-writes and never loops: it
//! does not wait for anything. The writer waits only for readers already
//! inside the old copy. The count has 63 bits: it cannot reach the copy
//! bit between two publishes.
//!
//! The writer is a [`CopyWriter`], of which there is one per pair of copies
//! (it is not `Clone`); its `&mut self` methods keep its writes apart, so
//! the whole interface is safe. Under `cfg(selkie_loom)` the atomics and the
//! cells are loom's and the protocol is model-checked as written
//! (`loom-tests/tests/kv_index.rs`), with deliberately broken variants
//! (`Fault`, under that cfg). It must not know what the copies hold.
//!
//! ```
//! use selkie_kernel::two_copies::CopyWriter;
//! let mut writer = CopyWriter::new(0u64, 0u64);
//! let readers = writer.readers();
//! writer.write(|v| *v = 7);
//! assert_eq!(readers.read(|v| *v), 0); // not published yet
//! writer.publish();
//! assert_eq!(readers.read(|v| *v), 7);
//! writer.write(|v| *v = 7); // bring the other copy up to date
//! assert_eq!(writer.read_own(|v| *v), 7);
//! ```

use alloc::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::sync::{yield_now, AtomicU64, Ordering, UnsafeCell};

/// A deliberately broken protocol, for the loom models only.
#[cfg(selkie_loom)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The real protocol.
    None,
    /// Readers read `state` and count themselves in two steps, so a publish
    /// in between counts them in the wrong period.
    ReaderLoadsThenCounts,
    /// Readers report their departure before they read.
    ReaderDepartsEarly,
    /// The writer does not wait for readers to leave the old copy.
    WriterSkipsWait,
}

/// The top bit of `state`: readers enter copy 1.
const COPY_BIT: u64 = 1 << 63;

/// Two copies of a `T`: readers share one ([`read`](Self::read)), the
/// [`CopyWriter`] owns the other.
pub struct TwoCopies<T> {
    copies: [UnsafeCell<T>; 2],
    /// The copy readers enter (top bit) and how many readers entered since
    /// the last publish.
    state: CachePadded<AtomicU64>,
    /// Readers that left each copy since it was last published.
    departed: [CachePadded<AtomicU64>; 2],
    #[cfg(selkie_loom)]
    fault: Fault,
}

// SAFETY: readers get `&T` from any thread (hence `T: Sync`), the writer
// gets `&mut T` on its own thread and the copies move with the value (hence
// `T: Send`); the protocol in the module docs keeps a copy from being read
// and written at once.
unsafe impl<T: Send + Sync> Sync for TwoCopies<T> {}
// SAFETY: as above; sending the whole value sends both copies.
unsafe impl<T: Send> Send for TwoCopies<T> {}

impl<T> TwoCopies<T> {
    fn new(a: T, b: T) -> Self {
        TwoCopies {
            copies: [UnsafeCell::new(a), UnsafeCell::new(b)],
            state: CachePadded::new(AtomicU64::new(0)),
            departed: [CachePadded::new(AtomicU64::new(0)), CachePadded::new(AtomicU64::new(0))],
            #[cfg(selkie_loom)]
            fault: Fault::None,
        }
    }

    /// Runs `f` on the readers' copy. Never waits.
    pub fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        #[cfg(selkie_loom)]
        let s = if self.fault == Fault::ReaderLoadsThenCounts {
            let s = self.state.load(Ordering::Acquire);
            self.state.fetch_add(1, Ordering::Acquire);
            s
        } else {
            self.state.fetch_add(1, Ordering::Acquire)
        };
        #[cfg(not(selkie_loom))]
        let s = self.state.fetch_add(1, Ordering::Acquire);
        let c = usize::from(s & COPY_BIT != 0);
        /// Reports the departure even if `f` panics.
        struct Depart<'a>(&'a AtomicU64);
        impl Drop for Depart<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Release);
            }
        }
        #[cfg(selkie_loom)]
        if self.fault == Fault::ReaderDepartsEarly {
            drop(Depart(&self.departed[c]));
            // SAFETY: none: this is the broken variant the model must catch.
            return self.copies[c].with(|copy| f(unsafe { &*copy }));
        }
        let _depart = Depart(&self.departed[c]);
        self.copies[c].with(|copy| {
            // SAFETY: this reader's entry is counted in the period of copy
            // `c`; the writer writes `c` again only after the next publish
            // has seen this reader's departure (module docs).
            f(unsafe { &*copy })
        })
    }

    /// The copy readers do not enter.
    fn writers_copy(&self) -> usize {
        // Only the writer changes the copy bit, so its own last swap is
        // what this load sees.
        usize::from(self.state.load(Ordering::Relaxed) & COPY_BIT == 0)
    }
}

impl<T> core::fmt::Debug for TwoCopies<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TwoCopies")
            .field("readers_copy", &(self.state.load(Ordering::Relaxed) & COPY_BIT != 0))
            .finish_non_exhaustive()
    }
}

/// The single writer of a [`TwoCopies`]: owns the copy readers do not
/// enter, and publishes it.
#[derive(Debug)]
pub struct CopyWriter<T> {
    copies: Arc<TwoCopies<T>>,
}

impl<T> CopyWriter<T> {
    /// Two copies, equal as far as the caller is concerned; readers start
    /// in `a`, the writer owns `b`.
    pub fn new(a: T, b: T) -> Self {
        CopyWriter {
            copies: Arc::new(TwoCopies::new(a, b)),
        }
    }

    /// The same, with a broken protocol.
    #[cfg(selkie_loom)]
    pub fn with_fault(a: T, b: T, fault: Fault) -> Self {
        CopyWriter {
            copies: Arc::new(TwoCopies {
                fault,
                ..TwoCopies::new(a, b)
            }),
        }
    }

    /// A handle for readers (any number, on any thread).
    pub fn readers(&self) -> Arc<TwoCopies<T>> {
        Arc::clone(&self.copies)
    }

    /// Runs `f` on the writer's copy, to read it.
    pub fn read_own<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        let w = self.copies.writers_copy();
        self.copies.copies[w].with(|copy| {
            // SAFETY: readers enter only the other copy, and the last
            // publish waited until every reader counted in this one had
            // left; writes need `&mut self`, which this borrow excludes,
            // and `self` is the only writer (`CopyWriter` is not `Clone`).
            f(unsafe { &*copy })
        })
    }

    /// Runs `f` on the writer's copy, to change it.
    pub fn write<R>(&mut self, f: impl FnOnce(&mut T) -> R) -> R {
        let w = self.copies.writers_copy();
        self.copies.copies[w].with_mut(|copy| {
            // SAFETY: as for `read_own`; `&mut self` makes this the only
            // access through the writer.
            f(unsafe { &mut *copy })
        })
    }

    /// Makes the writer's copy the readers' copy and waits until every
    /// reader of the other one has left; that one becomes the writer's
    /// (still holding what readers saw before).
    pub fn publish(&mut self) {
        let c = &*self.copies;
        let w = c.writers_copy();
        let entered = c.state.swap(if w == 1 { COPY_BIT } else { 0 }, Ordering::AcqRel) & !COPY_BIT;
        let old = 1 - w;
        #[cfg(selkie_loom)]
        if c.fault == Fault::WriterSkipsWait {
            c.departed[old].store(0, Ordering::Relaxed);
            return;
        }
        while c.departed[old].load(Ordering::Acquire) != entered {
            yield_now();
        }
        // No reader enters `old` before the next publish, which follows.
        c.departed[old].store(0, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(selkie_loom)))]
mod tests {
    use super::CopyWriter;

    /// Readers on other threads see only whole, published writes, never
    /// going back, while the writer publishes 500 times (a write fills
    /// 512 values one by one, so a reader inside a copy being written
    /// would see two rounds).
    #[test]
    fn readers_see_whole_published_writes_in_order() {
        const N: usize = 512;
        let fill = |v: &mut [u64; N], round: u64| {
            for x in v.iter_mut() {
                *x = core::hint::black_box(round);
            }
        };
        let mut writer = CopyWriter::new([0u64; N], [0u64; N]);
        let readers = writer.readers();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let mut last = 0;
                    while !stop.load(core::sync::atomic::Ordering::Relaxed) {
                        let seen = readers.read(|v| {
                            let first = core::hint::black_box(v[0]);
                            let torn = v.iter().position(|&x| x != first);
                            assert!(torn.is_none(), "a torn read: {first} and {}", v[torn.unwrap_or(0)]);
                            first
                        });
                        assert!(seen >= last, "went back from {last} to {seen}");
                        last = seen;
                    }
                });
            }
            for round in 1..=500u64 {
                writer.write(|v| fill(v, round));
                writer.publish();
                writer.write(|v| fill(v, round));
            }
            stop.store(true, core::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(readers.read(|v| v[N - 1]), 500);
        assert_eq!(writer.read_own(|v| v[N - 1]), 500);
    }
}
