//! Model of the KV index's reader/writer protocol
//! (`selkie_kernel::two_copies`, behind `selkie::kv_index::shared`): one writer writes its copy, publishes,
//! and brings the other copy up to date, twice, while readers read. No
//! reader may ever access a copy the writer is writing (loom reports any
//! such access), every read sees a whole write (both halves equal), and a
//! reader's successive reads never go back in time.
//!
//! Broken variants, each caught by some interleaving in which the writer
//! writes a copy a reader is in: readers that read the current copy and
//! count themselves in two steps (`Fault::ReaderLoadsThenCounts`), readers
//! that report their departure before reading (`Fault::ReaderDepartsEarly`),
//! and a writer that does not wait for readers to leave the old copy
//! (`Fault::WriterSkipsWait`).
#![cfg(selkie_loom)]

use loom::sync::Arc;
use loom::thread;
use selkie_kernel::two_copies::{CopyWriter, Fault};
use selkie_loom_tests::{expect_violation, explore};

/// A value whose halves a torn or racing write would set apart.
#[derive(Clone, Copy, Debug, Default)]
struct Pair {
    a: u64,
    b: u64,
}

fn set(p: &mut Pair, v: u64) {
    p.a = v;
    p.b = v;
}

fn writer_and_readers(fault: Fault, readers: usize, rounds: u64) {
    let mut writer = CopyWriter::with_fault(Pair::default(), Pair::default(), fault);
    let copies = Arc::new(writer.readers());
    let threads: Vec<_> = (0..readers)
        .map(|_| {
            let copies = Arc::clone(&copies);
            thread::spawn(move || {
                let mut last = 0;
                for _ in 0..2 {
                    let seen = copies.read(|p| {
                        assert_eq!(p.a, p.b, "a read saw half a write");
                        p.a
                    });
                    assert!(seen >= last, "a read went back from {last} to {seen}");
                    last = seen;
                }
            })
        })
        .collect();
    for v in 1..=rounds {
        writer.write(|p| set(p, v));
        writer.publish();
        writer.write(|p| set(p, v));
    }
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(copies.read(|p| p.a), rounds);
}

#[test]
fn readers_never_meet_the_writer() {
    explore("kv index: one reader, two publishes", || {
        writer_and_readers(Fault::None, 1, 2)
    });
    explore("kv index: two readers, one publish", || {
        writer_and_readers(Fault::None, 2, 1)
    });
}

#[test]
fn a_reader_counted_in_two_steps_is_caught() {
    expect_violation("kv index: reader loads, then counts", "Causality violation", || {
        writer_and_readers(Fault::ReaderLoadsThenCounts, 1, 2)
    });
}

#[test]
fn a_reader_departing_early_is_caught() {
    expect_violation("kv index: reader departs before reading", "Causality violation", || {
        writer_and_readers(Fault::ReaderDepartsEarly, 1, 2)
    });
}

#[test]
fn a_writer_that_skips_the_wait_is_caught() {
    expect_violation("kv index: writer skips the wait", "Causality violation", || {
        writer_and_readers(Fault::WriterSkipsWait, 1, 2)
    });
}
