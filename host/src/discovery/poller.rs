//! [`DiscoveryPoller`]: a background thread that polls a [`Discovery`]
//! source and applies each new snapshot to a service.
//!
//! It never blocks selection for longer than one registry update.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::source::Discovery;
use crate::service::WorkerSelectionService;

/// Polls a discovery source on its own thread until dropped or stopped.
///
/// Errors (an unreadable or malformed file, a full fleet) are logged with
/// `tracing` and counted in `selkie_discovery_errors_total`; the previous
/// workers stay in force and polling continues.
pub struct DiscoveryPoller {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DiscoveryPoller {
    /// Starts polling `source` every `interval`, applying changes to
    /// `service`. Fails only if the thread cannot be spawned.
    pub fn spawn(
        service: Arc<WorkerSelectionService>,
        mut source: Box<dyn Discovery>,
        interval: Duration,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("selkie-discovery".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    if let Err(e) = service.refresh(source.as_mut()) {
                        tracing::warn!(error = %e, "discovery poll failed");
                        metrics::counter!("selkie_discovery_errors_total").increment(1);
                    }
                    std::thread::park_timeout(interval);
                }
            })?;
        Ok(DiscoveryPoller {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops polling and waits for the thread to finish.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for DiscoveryPoller {
    fn drop(&mut self) {
        self.shutdown();
    }
}
