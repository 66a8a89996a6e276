//! The engines' KV event messages, decoded: ZMQ multipart frames
//! `[topic, sequence number (u64 big-endian), msgpack payload]`, the payload
//! `[timestamp, [events...], data_parallel_rank]`.
//!
//! Each event is either a map whose `"type"` names it (vLLM 0.32 and later;
//! fields at their default are left out) or a positional array whose first
//! item names it (older vLLM releases and SGLang: `["BlockStored",
//! block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//! lora_name, extra_keys, ...]`). A block hash is a u64 or a byte string (a
//! raw digest: its low 64 bits, big-endian, as vLLM turns digests into
//! ints). Decoding uses `rmpv`, with the bounds below; a message that breaks
//! one is refused whole with a [`FrameError`], whose
//! [`reason`](FrameError::reason) labels
//! `selkie_kv_events_refused_total`.

use rmpv::Value;
use thiserror::Error;

use crate::kv_index::StorageTier;

/// The largest payload frame decoded (bytes); larger messages are refused
/// (`too_large`).
pub const MAX_PAYLOAD_BYTES: usize = 16 << 20;
/// The most events one message may carry; more is refused (`too_many_events`).
pub const MAX_EVENTS_PER_MESSAGE: usize = 1 << 16;
/// The most blocks one event may store or remove; more is refused
/// (`too_many_blocks`).
pub const MAX_BLOCKS_PER_EVENT: usize = 1 << 16;
/// The deepest msgpack nesting decoded (`msgpack` past it).
pub const MAX_MSGPACK_DEPTH: usize = 16;

/// One decoded message: a batch of one engine rank's events.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The publisher's sequence number (consecutive per engine process,
    /// from 0).
    pub seq: u64,
    /// The data-parallel rank the payload names (0 when absent).
    pub dp_rank: u32,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
}

/// One engine event.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Blocks stored.
    Stored(StoredBlocks),
    /// Blocks removed from a tier.
    Removed {
        /// The engine's block hashes (a hash may repeat: one removal each).
        hashes: Vec<u64>,
        /// The tier.
        tier: StorageTier,
    },
    /// Every block dropped.
    Cleared,
}

/// A `BlockStored` event.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredBlocks {
    /// The engine's hashes of the stored blocks, in chain order.
    pub hashes: Vec<u64>,
    /// The engine hash of the first block's parent (none: a chain's first).
    pub parent: Option<u64>,
    /// Every stored block's tokens, `hashes.len() * block_size` of them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's id, if any.
    pub lora_id: Option<u64>,
    /// The LoRA adapter's name, if any.
    pub lora_name: Option<String>,
    /// The tier.
    pub tier: StorageTier,
    /// Per block, the msgpack bytes of its extra keys when they are not
    /// nil (multimodal inputs, cache salt, adapter); empty when the event
    /// has none.
    pub extra_keys: Vec<Option<Vec<u8>>>,
}

/// Why a message was refused.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    /// Not three frames.
    #[error("{frames} frames, expected 3 (topic, sequence number, payload)")]
    FrameCount {
        /// Frames received.
        frames: usize,
    },
    /// The sequence frame is not 8 bytes.
    #[error("sequence number frame of {bytes} bytes, expected 8")]
    SeqFrame {
        /// Its length.
        bytes: usize,
    },
    /// The payload is larger than [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {bytes} bytes, more than {MAX_PAYLOAD_BYTES}")]
    TooLarge {
        /// Its length.
        bytes: usize,
    },
    /// The payload is not msgpack (or nests too deep, or has bytes left over).
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// The payload or an event has another shape than expected.
    #[error("malformed {what}")]
    Shape {
        /// What was malformed.
        what: &'static str,
    },
    /// An event type this decoder does not know.
    #[error("unknown event type {0:?}")]
    UnknownEvent(String),
    /// More events than [`MAX_EVENTS_PER_MESSAGE`].
    #[error("{events} events in one message, more than {MAX_EVENTS_PER_MESSAGE}")]
    TooManyEvents {
        /// Events carried.
        events: usize,
    },
    /// More blocks than [`MAX_BLOCKS_PER_EVENT`].
    #[error("{blocks} blocks in one event, more than {MAX_BLOCKS_PER_EVENT}")]
    TooManyBlocks {
        /// Blocks carried.
        blocks: usize,
    },
    /// `token_ids` is not `block_hashes.len() * block_size` long.
    #[error("{tokens} token ids for {blocks} blocks of {block_size} tokens")]
    TokenCount {
        /// Token ids carried.
        tokens: usize,
        /// Blocks carried.
        blocks: usize,
        /// The event's block size.
        block_size: u32,
    },
    /// A `medium` other than `"GPU"`, `"CPU"` or `"DISK"`.
    #[error("unknown medium {0:?}")]
    Medium(String),
}

impl FrameError {
    /// The label of `selkie_kv_events_refused_total{reason}`.
    pub const fn reason(&self) -> &'static str {
        match self {
            FrameError::FrameCount { .. } => "frame_count",
            FrameError::SeqFrame { .. } => "sequence_frame",
            FrameError::TooLarge { .. } => "too_large",
            FrameError::Msgpack(_) => "msgpack",
            FrameError::Shape { .. } => "shape",
            FrameError::UnknownEvent(_) => "unknown_event",
            FrameError::TooManyEvents { .. } => "too_many_events",
            FrameError::TooManyBlocks { .. } => "too_many_blocks",
            FrameError::TokenCount { .. } => "token_count",
            FrameError::Medium(_) => "medium",
        }
    }

    /// Every reason label, for counters registered up front.
    pub const REASONS: [&'static str; 10] = [
        "frame_count",
        "sequence_frame",
        "too_large",
        "msgpack",
        "shape",
        "unknown_event",
        "too_many_events",
        "too_many_blocks",
        "token_count",
        "medium",
    ];
}

const fn shape(what: &'static str) -> FrameError {
    FrameError::Shape { what }
}

/// Decodes one message's frames.
pub fn decode_frames<F: AsRef<[u8]>>(frames: &[F]) -> Result<EventBatch, FrameError> {
    let [_topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount { frames: frames.len() });
    };
    let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| FrameError::SeqFrame {
        bytes: seq.as_ref().len(),
    })?;
    let (dp_rank, events) = decode_payload(payload.as_ref())?;
    Ok(EventBatch {
        seq: u64::from_be_bytes(seq),
        dp_rank,
        events,
    })
}

/// Decodes a payload `[timestamp, [events...], data_parallel_rank]`: the
/// rank (0 when absent or nil) and the events.
pub fn decode_payload(payload: &[u8]) -> Result<(u32, Vec<EngineEvent>), FrameError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(FrameError::TooLarge { bytes: payload.len() });
    }
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_MSGPACK_DEPTH)
        .map_err(|e| FrameError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(FrameError::Msgpack(format!("{} bytes after the payload", rd.len())));
    }
    let Value::Array(items) = value else {
        return Err(shape("payload (not an array)"));
    };
    let events = match items.get(1) {
        Some(Value::Array(events)) => events,
        _ => return Err(shape("payload (no event array)")),
    };
    if events.len() > MAX_EVENTS_PER_MESSAGE {
        return Err(FrameError::TooManyEvents { events: events.len() });
    }
    let dp_rank = match items.get(2) {
        None | Some(Value::Nil) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|r| u32::try_from(r).ok())
            .ok_or(shape("data_parallel_rank"))?,
    };
    let events = events.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?;
    Ok((dp_rank, events))
}

/// An event's fields by name, from a map or a positional array.
struct Fields<'v> {
    kind: &'v str,
    map: Option<&'v [(Value, Value)]>,
    array: &'v [Value],
}

impl<'v> Fields<'v> {
    fn of(event: &'v Value) -> Result<Self, FrameError> {
        match event {
            Value::Map(map) => {
                let kind = map
                    .iter()
                    .find(|(k, _)| k.as_str() == Some("type"))
                    .and_then(|(_, v)| v.as_str())
                    .ok_or(shape("event (map without a type)"))?;
                Ok(Fields {
                    kind,
                    map: Some(map),
                    array: &[],
                })
            }
            Value::Array(items) => {
                let kind = items
                    .first()
                    .and_then(Value::as_str)
                    .ok_or(shape("event (array without a type)"))?;
                Ok(Fields {
                    kind,
                    map: None,
                    array: &items[1..],
                })
            }
            _ => Err(shape("event (neither map nor array)")),
        }
    }

    /// The field `name`, or the positional field `index`; `None` when
    /// absent or nil.
    fn get(&self, name: &str, index: usize) -> Option<&'v Value> {
        let v = match self.map {
            Some(map) => map.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v),
            None => self.array.get(index),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(event: &Value) -> Result<EngineEvent, FrameError> {
    let f = Fields::of(event)?;
    match f.kind {
        "BlockStored" => {
            let hashes = block_hashes(f.get("block_hashes", 0))?;
            let parent = f.get("parent_block_hash", 1).map(block_hash).transpose()?;
            let tokens = match f.get("token_ids", 2) {
                Some(Value::Array(t)) => t,
                None => &Vec::new(),
                Some(_) => return Err(shape("token_ids")),
            };
            let block_size = f
                .get("block_size", 3)
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or(shape("block_size"))?;
            if tokens.len() as u64 != hashes.len() as u64 * u64::from(block_size) {
                return Err(FrameError::TokenCount {
                    tokens: tokens.len(),
                    blocks: hashes.len(),
                    block_size,
                });
            }
            let token_ids = tokens
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or(shape("token_ids"))?;
            let lora_id = match f.get("lora_id", 4) {
                None => None,
                Some(v) => Some(v.as_u64().ok_or(shape("lora_id"))?),
            };
            let tier = medium(f.get("medium", 5))?;
            let lora_name = match f.get("lora_name", 6) {
                None => None,
                Some(v) => Some(v.as_str().ok_or(shape("lora_name"))?.to_owned()),
            };
            let extra_keys = match f.get("extra_keys", 7) {
                None => Vec::new(),
                Some(Value::Array(keys)) if keys.len() == hashes.len() => keys
                    .iter()
                    .map(|k| {
                        (!k.is_nil()).then(|| {
                            let mut bytes = Vec::new();
                            // Writing to a Vec cannot fail.
                            let _ = rmpv::encode::write_value(&mut bytes, k);
                            bytes
                        })
                    })
                    .collect(),
                Some(_) => return Err(shape("extra_keys")),
            };
            Ok(EngineEvent::Stored(StoredBlocks {
                hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                tier,
                extra_keys,
            }))
        }
        "BlockRemoved" => Ok(EngineEvent::Removed {
            hashes: block_hashes(f.get("block_hashes", 0))?,
            tier: medium(f.get("medium", 1))?,
        }),
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Err(FrameError::UnknownEvent(other.chars().take(64).collect())),
    }
}

fn block_hashes(v: Option<&Value>) -> Result<Vec<u64>, FrameError> {
    match v {
        Some(Value::Array(hashes)) => {
            if hashes.len() > MAX_BLOCKS_PER_EVENT {
                return Err(FrameError::TooManyBlocks { blocks: hashes.len() });
            }
            hashes.iter().map(block_hash).collect()
        }
        None => Ok(Vec::new()),
        Some(_) => Err(shape("block_hashes")),
    }
}

/// A block hash: a u64, or a digest's low 64 bits (big-endian).
fn block_hash(v: &Value) -> Result<u64, FrameError> {
    match v {
        Value::Binary(b) if b.len() >= 8 => {
            let low: [u8; 8] = b[b.len() - 8..].try_into().map_err(|_| shape("block hash"))?;
            Ok(u64::from_be_bytes(low))
        }
        v => v.as_u64().ok_or(shape("block hash")),
    }
}

/// `medium` to tier: `"GPU"` (or absent) device, `"CPU"` host, `"DISK"` disk.
fn medium(v: Option<&Value>) -> Result<StorageTier, FrameError> {
    match v {
        None => Ok(StorageTier::Device),
        Some(v) => match v.as_str() {
            Some("GPU") => Ok(StorageTier::Device),
            Some("CPU") => Ok(StorageTier::Host),
            Some("DISK") => Ok(StorageTier::Disk),
            Some(other) => Err(FrameError::Medium(other.chars().take(64).collect())),
            None => Err(shape("medium")),
        },
    }
}
