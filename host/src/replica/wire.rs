//! The messages replicas exchange on their NATS subject, and their
//! encoding.
//!
//! Every message is one [`Envelope`]: who sent it (replica id and
//! incarnation), the sender's sequence number, when it was sent, and a
//! [`Body`]; in a partition with a signing key, its signature rides in a
//! NATS header (see `auth`). The sequence
//! number counts the sender's delta batches: a batch carries its own number
//! (1, 2, ...), every other message the number of the last batch sent
//! before it, so a receiver can tell from any message whether it missed a
//! batch, and a snapshot says which batch it reflects.
//!
//! Every message of a partition goes on its one subject, snapshots and
//! snapshot requests included: NATS delivers one sender's messages on one
//! subject in order, so a snapshot never overtakes the batches before it.
//! Every replica sees every snapshot, which is harmless (it replaces that
//! peer's table with what the table should hold), and refreshes them all.
//!
//! A replica says what it holds in one of two ways, and a peer sums both:
//! per booking (`Book` / `PrefillComplete` / `Release`, what
//! [`ReplicaSync::record_book`](super::ReplicaSync::record_book) and its
//! siblings send) or per worker rank (`Load`: "my load on this worker
//! rank is now ...", what
//! [`ReplicaSync::report_load`](super::ReplicaSync::report_load) sends,
//! and what a service's sync thread reports from its fleet's counters).
//!
//! The encoding is JSON with one-letter keys and tuples for the bookings
//! and loads
//! (`{"r":7,"i":9,"s":3,"t":1700000000000,"m":{"d":[{"B":[41,[12,0,900,3]]},{"R":40},{"L":[12,0,[2,0,6]]}]}}`):
//! serde_json is already a dependency, a batch of 256 deltas is about
//! 10 KiB, and `nats sub` shows it readably. This module only encodes and
//! decodes; it keeps no state.

use serde::{Deserialize, Serialize};

use super::RemoteLoad;
use crate::types::WorkerWithDpRank;

/// One outstanding booking's load: the worker rank it holds and what it
/// costs there. After prefill completes `prefill_tokens` is 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Booked {
    pub(crate) worker: WorkerWithDpRank,
    pub(crate) prefill_tokens: u32,
    pub(crate) decode_blocks: u32,
}

/// The wire form of [`Booked`]: `[worker_id, dp_rank, prefill, decode]`.
#[derive(Serialize, Deserialize)]
struct BookedTuple(u64, u32, u32, u32);

impl Serialize for Booked {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        BookedTuple(
            self.worker.worker_id,
            self.worker.dp_rank,
            self.prefill_tokens,
            self.decode_blocks,
        )
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Booked {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let BookedTuple(worker_id, dp_rank, prefill_tokens, decode_blocks) = BookedTuple::deserialize(d)?;
        Ok(Booked {
            worker: WorkerWithDpRank::new(worker_id, dp_rank),
            prefill_tokens,
            decode_blocks,
        })
    }
}

/// A replica's whole load on one worker rank, as it reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Loaded {
    pub(crate) worker: WorkerWithDpRank,
    pub(crate) load: RemoteLoad,
}

/// The wire form of [`Loaded`]: `[worker_id, dp_rank, [requests, prefill, decode]]`.
#[derive(Serialize, Deserialize)]
struct LoadedTuple(u64, u32, (u64, u64, u64));

impl Serialize for Loaded {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let l = self.load;
        LoadedTuple(
            self.worker.worker_id,
            self.worker.dp_rank,
            (l.requests, l.prefill_tokens, l.decode_blocks),
        )
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Loaded {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let LoadedTuple(worker_id, dp_rank, (requests, prefill_tokens, decode_blocks)) = LoadedTuple::deserialize(d)?;
        Ok(Loaded {
            worker: WorkerWithDpRank::new(worker_id, dp_rank),
            load: RemoteLoad {
                requests,
                prefill_tokens,
                decode_blocks,
            },
        })
    }
}

/// One change to a replica's bookings. A booking carries its decode blocks
/// as booked (output-block growth is not synced per booking, as in
/// Dynamo); a `Load` states whatever the replica reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Delta {
    /// A booking was made: `[booking_id, [worker_id, dp_rank, prefill, decode]]`.
    #[serde(rename = "B")]
    Book(u64, Booked),
    /// The booking's prefill completed: its prefill tokens no longer count.
    #[serde(rename = "P")]
    PrefillComplete(u64),
    /// The booking was released.
    #[serde(rename = "R")]
    Release(u64),
    /// The replica's load on a worker rank is now this (all of it, not a
    /// change: zero removes it): `[worker_id, dp_rank, [requests, prefill, decode]]`.
    #[serde(rename = "L")]
    Load(Loaded),
}

/// What a message says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Body {
    /// A batch of deltas, in the order they were recorded.
    #[serde(rename = "d")]
    Deltas(Vec<Delta>),
    /// "I am alive, and my last batch is `seq`."
    #[serde(rename = "h")]
    Heartbeat,
    /// "Send me your outstanding bookings": from every peer (`None`), or
    /// from one.
    #[serde(rename = "q")]
    SnapshotRequest(Option<u64>),
    /// One part of the sender's outstanding bookings and reported loads as
    /// of batch `seq`.
    /// Parts are numbered from 0 and sent back to back; the receiver
    /// replaces its table for the sender when the part marked `last`
    /// arrives after all the others.
    #[serde(rename = "s")]
    Snapshot {
        #[serde(rename = "n")]
        part: u32,
        #[serde(rename = "l")]
        last: bool,
        #[serde(rename = "b")]
        bookings: Vec<(u64, Booked)>,
        #[serde(rename = "w", default, skip_serializing_if = "Vec::is_empty")]
        loads: Vec<Loaded>,
    },
}

/// One message on the subject.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Envelope {
    /// The sender's replica id.
    #[serde(rename = "r")]
    pub(crate) replica: u64,
    /// Random per [`ReplicaSync`](super::ReplicaSync) instance: a replica
    /// that restarts with the same id starts a new sequence.
    #[serde(rename = "i")]
    pub(crate) incarnation: u64,
    /// See the module docs.
    #[serde(rename = "s")]
    pub(crate) seq: u64,
    /// When the sender sent it: milliseconds since the Unix epoch on the
    /// sender's clock, never decreasing within an incarnation (0 from a
    /// sender that does not say). Checked only in a signed partition.
    #[serde(rename = "t", default)]
    pub(crate) sent: u64,
    #[serde(rename = "m")]
    pub(crate) body: Body,
}

impl Envelope {
    pub(crate) fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an envelope serialises to JSON")
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// The most bytes one booking (`[id,[w,r,p,d]],`) or one load
/// (`[w,r,[n,p,d]],`) takes in a snapshot part, with every number at its
/// longest, so a part of `(max_payload - ENVELOPE_BYTES) /
/// SNAPSHOT_ROW_BYTES` rows fits the server's payload limit.
pub(crate) const SNAPSHOT_ROW_BYTES: usize = 1 + 20 + 1 + 10 + 2 + 20 + 1 + 20 + 1 + 20 + 3;
/// An upper bound on a snapshot part's bytes besides its rows: the
/// envelope's fields and the signature header.
pub(crate) const ENVELOPE_BYTES: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_in_the_documented_form() {
        let booked = Booked {
            worker: WorkerWithDpRank::new(12, 0),
            prefill_tokens: 900,
            decode_blocks: 3,
        };
        let loaded = Loaded {
            worker: WorkerWithDpRank::new(12, 0),
            load: RemoteLoad {
                requests: 2,
                prefill_tokens: 0,
                decode_blocks: 6,
            },
        };
        let e = Envelope {
            replica: 7,
            incarnation: 9,
            seq: 3,
            sent: 1_700_000_000_000,
            body: Body::Deltas(vec![Delta::Book(41, booked), Delta::Release(40), Delta::Load(loaded)]),
        };
        let bytes = e.encode();
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"{"r":7,"i":9,"s":3,"t":1700000000000,"m":{"d":[{"B":[41,[12,0,900,3]]},{"R":40},{"L":[12,0,[2,0,6]]}]}}"#
        );
        assert_eq!(Envelope::decode(&bytes).unwrap(), e);
        // A sender that does not say when it sent (an older replica).
        let unstamped = br#"{"r":7,"i":9,"s":3,"m":"h"}"#;
        assert_eq!(Envelope::decode(unstamped).unwrap().sent, 0);
        for body in [
            Body::Heartbeat,
            Body::SnapshotRequest(None),
            Body::SnapshotRequest(Some(u64::MAX)),
            Body::Snapshot {
                part: 1,
                last: true,
                bookings: vec![(1, booked)],
                loads: vec![],
            },
            Body::Snapshot {
                part: 0,
                last: false,
                bookings: vec![],
                loads: vec![loaded],
            },
        ] {
            let e = Envelope { body, ..e.clone() };
            assert_eq!(Envelope::decode(&e.encode()).unwrap(), e);
        }
    }

    #[test]
    fn a_snapshot_row_at_its_longest_fits_its_bound() {
        let row = (
            u64::MAX,
            Booked {
                worker: WorkerWithDpRank::new(u64::MAX, u32::MAX),
                prefill_tokens: u32::MAX,
                decode_blocks: u32::MAX,
            },
        );
        let one = serde_json::to_vec(&[row]).unwrap().len();
        let two = serde_json::to_vec(&[row, row]).unwrap().len();
        assert!(two - one <= SNAPSHOT_ROW_BYTES, "{} > {SNAPSHOT_ROW_BYTES}", two - one);
        let load = Loaded {
            worker: WorkerWithDpRank::new(u64::MAX, u32::MAX),
            load: RemoteLoad {
                requests: u64::MAX,
                prefill_tokens: u64::MAX,
                decode_blocks: u64::MAX,
            },
        };
        let one = serde_json::to_vec(&[load]).unwrap().len();
        let two = serde_json::to_vec(&[load, load]).unwrap().len();
        assert!(two - one <= SNAPSHOT_ROW_BYTES, "{} > {SNAPSHOT_ROW_BYTES}", two - one);
    }
}
