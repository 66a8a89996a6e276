//! The default selection path allocates nothing once a thread is warm
//! (SPEC §6): a counting global allocator watches this test's thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use selkie::*;

struct Counting;

thread_local! {
    static WATCH: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCH.with(Cell::get) {
            COUNT.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(0));
    WATCH.with(|w| w.set(true));
    f();
    WATCH.with(|w| w.set(false));
    COUNT.with(Cell::get)
}

#[test]
fn default_selection_path_does_not_allocate() {
    let policies = [
        WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
        WorkerSelectionPolicy::kv(
            KvRouterConfig {
                router_temperature: 0.5,
                ..KvRouterConfig::default()
            },
            WorkerType::Prefill,
        ),
        WorkerSelectionPolicy::least_loaded(),
        WorkerSelectionPolicy::power_of_two(),
        WorkerSelectionPolicy::random(),
        WorkerSelectionPolicy::round_robin(),
    ];
    for policy in policies {
        let name = policy.name();
        let s = WorkerSelectionService::new(policy, ServiceConfig::default());
        for id in 0..100 {
            s.add_worker(WorkerRecord::new(id).with_dp(0, 1 + (id % 3) as u32))
                .unwrap();
        }
        let ov: Vec<WorkerOverlap> = (0..50)
            .map(|i| WorkerOverlap::device(WorkerWithDpRank::new(i * 2, 0), i as u32 % 7, 16))
            .collect();
        let prefs = [("rack-a", 0.5f32)];
        let req = SelectionRequest::new(2048)
            .with_overlaps(&ov)
            .with_preferred_taints(&prefs);
        for _ in 0..3 {
            drop(s.select(&req).unwrap()); // warm the thread's scratch
        }
        let n = allocations(|| {
            for _ in 0..1000 {
                let mut sel = s.select(&req).unwrap();
                sel.prefill_complete();
                sel.add_output_block().unwrap();
                drop(sel);
                let _ = s.peek(&req).unwrap();
            }
        });
        assert_eq!(n, 0, "{name}: {n} allocations in 1000 selections");
    }
}

/// Requests with a session, new sessions and returning ones, hard and soft,
/// allocate nothing once the session table exists: it is keyed by a hash of
/// the session id and never stores the id.
#[test]
fn session_requests_do_not_allocate() {
    let s = WorkerSelectionService::new(WorkerSelectionPolicy::least_loaded(), ServiceConfig::default());
    for id in 0..16 {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    let ids: Vec<String> = (0..2_000).map(|i| format!("session-{i}")).collect();
    // The first bind allocates the table; the first selections the scratch.
    for mode in [AffinityMode::Hard, AffinityMode::Soft] {
        for _ in 0..3 {
            drop(s.select(&SelectionRequest::new(64).with_session("warm", mode)).unwrap());
        }
    }
    let n = allocations(|| {
        for (i, id) in ids.iter().enumerate() {
            let mode = if i % 2 == 0 {
                AffinityMode::Hard
            } else {
                AffinityMode::Soft
            };
            let req = SelectionRequest::new(64).with_session(id, mode);
            let first = s.select(&req).unwrap().worker();
            let again = s.select(&req).unwrap().worker();
            assert_eq!(first, again, "{id} returns to its worker");
        }
    });
    assert_eq!(n, 0, "{n} allocations in 4000 session requests");
}
