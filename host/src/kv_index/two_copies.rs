//! Two copies of a value, one for readers and one for the writer, so that
//! readers never wait for a writer (the "left-right" technique, with the
//! readers counted per publish period).
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
//! inside the old copy.
//!
//! This is the only module of the index that names atomics or `UnsafeCell`:
//! under `cfg(selkie_loom)` they are loom's, and the protocol is
//! model-checked as written (`loom-tests/tests/kv_index.rs`). It must not
//! know what the copies hold.

#[cfg(selkie_loom)]
use loom::{
    cell::UnsafeCell,
    sync::atomic::{
        AtomicUsize,
        Ordering::{AcqRel, Acquire, Relaxed, Release},
    },
    thread::yield_now,
};
#[cfg(not(selkie_loom))]
use std::{
    sync::atomic::{
        AtomicUsize,
        Ordering::{AcqRel, Acquire, Relaxed, Release},
    },
    thread::yield_now,
};

use crossbeam_utils::CachePadded;

/// `std`'s `UnsafeCell` with loom's access API (`with`, `with_mut`).
#[cfg(not(selkie_loom))]
#[derive(Debug)]
struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(selkie_loom))]
impl<T> UnsafeCell<T> {
    fn new(value: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

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
const COPY_BIT: usize = 1 << (usize::BITS - 1);

/// Two copies of a `T`: readers share one, the single writer owns the other.
pub struct TwoCopies<T> {
    copies: [UnsafeCell<T>; 2],
    /// The copy readers enter (top bit) and how many readers entered since
    /// the last publish.
    state: CachePadded<AtomicUsize>,
    /// Readers that left each copy since it was last published.
    departed: [CachePadded<AtomicUsize>; 2],
    #[cfg(selkie_loom)]
    fault: Fault,
}

// SAFETY: readers get `&T` from any thread (hence `T: Sync`), the writer
// gets `&mut T` on its own thread and the copies move with the value (hence
// `T: Send`); the protocol above keeps a copy from being read and written
// at once.
unsafe impl<T: Send + Sync> Sync for TwoCopies<T> {}
// SAFETY: as above; sending the whole value sends both copies.
unsafe impl<T: Send> Send for TwoCopies<T> {}

impl<T> TwoCopies<T> {
    /// Two copies, equal as far as the caller is concerned; readers start
    /// in `a`.
    pub fn new(a: T, b: T) -> Self {
        TwoCopies {
            copies: [UnsafeCell::new(a), UnsafeCell::new(b)],
            state: CachePadded::new(AtomicUsize::new(0)),
            departed: [
                CachePadded::new(AtomicUsize::new(0)),
                CachePadded::new(AtomicUsize::new(0)),
            ],
            #[cfg(selkie_loom)]
            fault: Fault::None,
        }
    }

    /// The same, with a broken protocol.
    #[cfg(selkie_loom)]
    pub fn with_fault(a: T, b: T, fault: Fault) -> Self {
        TwoCopies {
            fault,
            ..Self::new(a, b)
        }
    }

    /// Runs `f` on the readers' copy. Never waits.
    pub fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        #[cfg(selkie_loom)]
        let s = if self.fault == Fault::ReaderLoadsThenCounts {
            let s = self.state.load(Acquire);
            self.state.fetch_add(1, Acquire);
            s
        } else {
            self.state.fetch_add(1, Acquire)
        };
        #[cfg(not(selkie_loom))]
        let s = self.state.fetch_add(1, Acquire);
        let c = usize::from(s & COPY_BIT != 0);
        /// Reports the departure even if `f` panics.
        struct Depart<'a>(&'a AtomicUsize);
        impl Drop for Depart<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Release);
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
        usize::from(self.state.load(Relaxed) & COPY_BIT == 0)
    }

    /// Runs `f` on the writer's copy.
    ///
    /// # Safety
    ///
    /// Only one thread may call `write` and [`publish`](Self::publish), and
    /// never at once (the single writer): the writer handle owning the
    /// value guarantees it by taking `&mut self`.
    pub unsafe fn write<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let w = self.writers_copy();
        self.copies[w].with_mut(|copy| {
            // SAFETY: readers enter only the other copy, and the last
            // publish waited until every reader counted in this one had
            // left; the caller is the only writer.
            f(unsafe { &mut *copy })
        })
    }

    /// Makes the writer's copy the readers' copy and waits until every
    /// reader of the other one has left; that one becomes the writer's.
    ///
    /// # Safety
    ///
    /// As for [`write`](Self::write).
    pub unsafe fn publish(&self) {
        let w = self.writers_copy();
        let entered = self.state.swap(if w == 1 { COPY_BIT } else { 0 }, AcqRel) & !COPY_BIT;
        let old = 1 - w;
        #[cfg(selkie_loom)]
        if self.fault == Fault::WriterSkipsWait {
            self.departed[old].store(0, Relaxed);
            return;
        }
        while self.departed[old].load(Acquire) != entered {
            yield_now();
        }
        // No reader enters `old` before the next publish, which follows.
        self.departed[old].store(0, Relaxed);
    }
}

impl<T> std::fmt::Debug for TwoCopies<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwoCopies")
            .field("readers_copy", &usize::from(self.state.load(Relaxed) & COPY_BIT != 0))
            .finish_non_exhaustive()
    }
}
