//! [`DiscoveryPoller`]: a background thread that polls a [`Discovery`]
//! source and applies each new snapshot to a service, and
//! [`DiscoveryHealth`], how that is going.
//!
//! It never blocks selection for longer than one registry update, and it
//! survives its source: an error or a panic in a poll is counted, reported
//! in the health, and followed by the next poll.
//!
//! It lives with the service because it drives a source into one: it is the
//! only code that names both a [`Discovery`] source and a
//! [`WorkerSelectionService`]. It must not touch the worker table itself;
//! every change goes through [`WorkerSelectionService::refresh`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use super::WorkerSelectionService;
use crate::discovery::Discovery;

/// How a [`DiscoveryPoller`] is doing (see [`DiscoveryPoller::health`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiscoveryHealth {
    /// Polls made so far.
    pub polls: u64,
    /// When a poll last succeeded (a snapshot applied, or nothing changed).
    pub last_success: Option<SystemTime>,
    /// Polls that failed since the last success (errors and panics).
    pub consecutive_failures: u64,
    /// The last failure: the error's message, or the panic's.
    pub last_error: Option<String>,
    /// Polls that panicked (in the source or while applying its snapshot).
    pub panics: u64,
    /// Records the source refused so far ([`Discovery::take_refused`]);
    /// the polls that reported them succeeded, without them.
    pub records_refused: u64,
    /// The last refused record's error (it names the record's key or file).
    pub last_refused: Option<String>,
    /// Whether the polling thread is still running (false once stopped).
    pub polling: bool,
}

impl DiscoveryHealth {
    /// Whether the poller is running and its last poll succeeded (and at
    /// least one was made).
    pub fn is_healthy(&self) -> bool {
        self.polling && self.last_success.is_some() && self.consecutive_failures == 0
    }
}

/// Polls a discovery source on its own thread until dropped or stopped.
///
/// Errors (an unreadable or malformed file, a full fleet) are logged with
/// `tracing` and counted in `selkie_discovery_errors_total{reason}`; a
/// panicking source is caught, logged and counted with `reason="panic"`. In
/// every case the previous workers stay in force, polling continues, and
/// [`health`](Self::health) says what happened.
///
/// A record the source refuses on its own (a bad etcd key, a bad record in
/// a file) is not a failed poll: the rest of the snapshot applies, and each
/// refusal is logged (a warning naming the key or file and worker),
/// counted in `selkie_discovery_records_refused_total{reason}` and in
/// [`DiscoveryHealth::records_refused`].
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use selkie::*;
/// let service = Arc::new(WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default()));
/// let source = InMemoryDiscovery::with_workers(vec![WorkerRecord::new(1)]);
/// let poller = DiscoveryPoller::spawn(service.clone(), Box::new(source), Duration::from_millis(5))?;
/// while !poller.health().is_healthy() {
///     std::thread::sleep(Duration::from_millis(1));
/// }
/// assert_eq!(service.workers().len(), 1);
/// poller.stop();
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct DiscoveryPoller {
    stop: Arc<AtomicBool>,
    health: Arc<Mutex<DiscoveryHealth>>,
    thread: Option<JoinHandle<()>>,
}

/// One poll and apply, with its panic caught; records the outcome. The
/// health lock is held only to update the numbers; logging and metrics run
/// after it is released, under their own panic guard (a subscriber may read
/// the health, and a recorder may panic).
fn poll_once(service: &WorkerSelectionService, source: &mut dyn Discovery, health: &Mutex<DiscoveryHealth>) {
    let outcome = crate::contain::contain_message(|| service.refresh(source));
    let (failure, refused) = match outcome {
        Ok(Ok(report)) => (None, report.refused),
        Ok(Err(e)) => (Some((e.reason(), e.to_string(), false)), Vec::new()),
        Err(message) => (
            Some(("panic", format!("discovery source panicked: {message}"), true)),
            Vec::new(),
        ),
    };
    {
        let mut h = health.lock().unwrap_or_else(PoisonError::into_inner);
        h.polls += 1;
        if let Some(last) = refused.last() {
            h.records_refused += refused.len() as u64;
            h.last_refused = Some(last.to_string());
        }
        match &failure {
            None => {
                h.last_success = Some(SystemTime::now());
                h.consecutive_failures = 0;
            }
            Some((_, message, panicked)) => {
                h.consecutive_failures += 1;
                h.panics += u64::from(*panicked);
                h.last_error = Some(message.clone());
            }
        }
    }
    if !refused.is_empty() {
        let _ = crate::contain::contain(|| {
            for e in &refused {
                tracing::warn!(error = %e, "discovery record refused; its worker keeps its last good record");
                metrics::counter!("selkie_discovery_records_refused_total", "reason" => e.reason()).increment(1);
            }
        });
    }
    if let Some((reason, message, panicked)) = failure {
        let _ = crate::contain::contain(|| {
            if panicked {
                tracing::error!(%message, "discovery poll panicked; polling continues");
            } else {
                tracing::warn!(error = %message, "discovery poll failed");
            }
            metrics::counter!("selkie_discovery_errors_total", "reason" => reason).increment(1);
        });
    }
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
        let health = Arc::new(Mutex::new(DiscoveryHealth::default()));
        let (flag, report) = (stop.clone(), health.clone());
        let thread = std::thread::Builder::new()
            .name("selkie-discovery".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    poll_once(&service, source.as_mut(), &report);
                    std::thread::park_timeout(interval);
                }
            })?;
        Ok(DiscoveryPoller {
            stop,
            health,
            thread: Some(thread),
        })
    }

    /// How polling is going: polls made, the last success, failures since,
    /// the last error, panics caught.
    pub fn health(&self) -> DiscoveryHealth {
        let mut h = self.health.lock().unwrap_or_else(PoisonError::into_inner).clone();
        h.polling = self.thread.as_ref().is_some_and(|t| !t.is_finished());
        h
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
