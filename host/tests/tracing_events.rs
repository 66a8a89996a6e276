//! The service's `tracing` spans and events.
//!
//! Alone in its own test binary: `tracing`'s global level filter is rebuilt
//! whenever any thread registers a callsite, and a test running beside
//! this one could leave it stale for a moment, so that the first selection
//! here would see debug spans disabled.

use std::sync::{Arc, Mutex};

use selkie::*;

fn svc(policy: WorkerSelectionPolicy) -> WorkerSelectionService {
    WorkerSelectionService::new(
        policy,
        ServiceConfig {
            seed: Some(2),
            ..ServiceConfig::default()
        },
    )
}

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Events {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        self.0.lock().unwrap().push(format!("span {}", span.metadata().name()));
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Msg(String);
        impl tracing::field::Visit for Msg {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0 = format!("{v:?}");
                }
            }
        }
        let mut m = Msg(String::new());
        event.record(&mut m);
        self.0.lock().unwrap().push(format!("event {}", m.0));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn tracing_spans_and_events() {
    let ev = Events::default();
    tracing::subscriber::with_default(ev.clone(), || {
        let s = svc(WorkerSelectionPolicy::random());
        s.add_worker(WorkerRecord::new(1)).unwrap();
        drop(s.select(&SelectionRequest::new(1)).unwrap());
        let _ = s.select(&SelectionRequest::new(1).pinned_to_worker(5));
    });
    let log = ev.0.lock().unwrap().clone();
    for want in [
        "event worker added",
        "span selkie.select",
        "event selected",
        "event selection failed",
    ] {
        assert!(log.iter().any(|l| l == want), "{want:?} not in {log:?}");
    }
}
