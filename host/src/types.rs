//! Identities shared by every part of the host: worker ids, data-parallel
//! ranks, a rank's row, worker roles and routing partitions.
//!
//! The names are Dynamo's (`WorkerWithDpRank`, `WorkerType`,
//! `RoutingPartitionRef`) so a router that used Dynamo's custom worker
//! selection finds the same concepts here. This module holds plain data only.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A worker's identity as discovery reports it (Dynamo's instance id).
pub type WorkerId = u64;

/// A data-parallel rank inside one worker.
pub type DpRank = u32;

/// One routable row: a worker and one of its data-parallel ranks (the
/// kernel's type, with its `Display` as `id/dpRANK`).
pub use selkie_kernel::worker::WorkerWithDpRank;

/// A worker rank's row in the selection service's current layout and its
/// tenure there (what
/// [`WorkerSelectionService::rank_row`](crate::WorkerSelectionService::rank_row)
/// answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankRow {
    /// The row: the index of the rank's value in a per-row column.
    pub row: usize,
    /// The layout epoch from which the rank holds its row: a rank removed
    /// from the fleet and added again gets a new one, even on the same row.
    pub tenure: u64,
}

/// The role of the worker pool a policy selects from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WorkerType {
    /// Workers that run a whole request (prefill and decode).
    #[default]
    Aggregated,
    /// Prefill workers of a disaggregated deployment.
    Prefill,
    /// Decode workers of a disaggregated deployment.
    Decode,
}

impl WorkerType {
    /// The lowercase name used in configuration files, logs and metric labels.
    pub const fn as_str(&self) -> &'static str {
        match self {
            WorkerType::Aggregated => "aggregated",
            WorkerType::Prefill => "prefill",
            WorkerType::Decode => "decode",
        }
    }
}

impl fmt::Display for WorkerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The routing partition a policy instance serves: one model, optionally
/// one routing group of it. A policy factory is called once per partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RoutingPartitionRef<'a> {
    /// Model name.
    pub model: &'a str,
    /// Routing group inside the model, if the deployment has several.
    pub routing_group: Option<&'a str>,
}

impl<'a> RoutingPartitionRef<'a> {
    /// A partition for `model` without a routing group.
    pub const fn model(model: &'a str) -> Self {
        RoutingPartitionRef {
            model,
            routing_group: None,
        }
    }
}
