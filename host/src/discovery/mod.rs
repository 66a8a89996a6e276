//! Discovery: which workers exist, and what they are.
//!
//! * [`record`](self): [`WorkerRecord`], the serialisable description of one
//!   worker (ranks, capacity weight, taints, labels, LoRA adapters, busy
//!   thresholds, device kind, state).
//! * [`Discovery`], with [`InMemoryDiscovery`] and [`FileDiscovery`], and
//!   with the `etcd` feature `EtcdDiscovery` (and `EtcdRegistration`, the
//!   worker's side).
//! * The registry that turns records into kernel fleet rows (crate-private;
//!   reached through [`crate::WorkerSelectionService`]).
//!
//! Nothing here books or releases load (the registry only reads a given-up
//! row's counters to decide whether bookings still hold it), and nothing
//! here names the service, the policies or the filters: discovery sits
//! below them. Driving a source into a service on a thread is the service's
//! job ([`DiscoveryPoller`](crate::DiscoveryPoller)).

#[cfg(feature = "etcd")]
mod etcd;
mod record;
pub(crate) mod registry;
mod source;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdDiscovery, EtcdOptions, EtcdRegistration, EtcdWatchStatus};

pub use record::{BusyThresholds, DeviceKind, WorkerRecord, WorkerState};
pub use registry::{RefreshReport, SyncReport};
pub use source::{Discovery, FileDiscovery, InMemoryDiscovery};
