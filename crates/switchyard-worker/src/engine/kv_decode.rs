//! Decoding vLLM's and SGLang's KV event batches (MessagePack) into [`EngineBatch`].
//!
//! Engines have changed their encoding several times (see `WIRE_FORMATS.md` in the shared
//! notes): batches are arrays `[ts, events(, dp_rank)]` or maps; events are tagged positional
//! arrays `["BlockStored", hashes, parent, tokens, block_size, …]` or maps with a `type` key;
//! hashes are u64, i64 or raw digest bytes. Everything is decoded to an [`rmpv::Value`] first
//! and then interpreted, so one decoder accepts every variant, ignores unknown fields and trailing
//! positional fields, and turns anything else into a [`DecodeError`] instead of a panic.

use rmpv::Value;

/// One decoded engine batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank the batch names, when it names one.
    pub dp_rank: Option<u32>,
}

/// One engine KV event, with engine hashes folded to u64.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: Option<u32>,
        medium: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// Why a payload is not a KV event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is not valid msgpack: {0}")]
    Msgpack(String),
    #[error("{0} bytes of trailing data after the batch")]
    Trailing(usize),
    #[error("malformed batch: {0}")]
    Batch(&'static str),
    #[error("malformed {event} event: {what}")]
    Event {
        event: &'static str,
        what: &'static str,
    },
    #[error("unknown event type {0:?}")]
    UnknownEvent(String),
}

/// Nesting deeper than any real batch (batch → events → event → token list) is refused early.
const MAX_DEPTH: usize = 16;

/// Decodes one payload frame.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    let mut cursor = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut cursor, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !cursor.is_empty() {
        return Err(DecodeError::Trailing(cursor.len()));
    }
    let (events, rank) = match &value {
        Value::Array(items) => (items.get(1), items.get(2)),
        Value::Map(_) => (
            map_get(&value, "events"),
            map_get(&value, "data_parallel_rank")
                .or_else(|| map_get(&value, "attn_dp_rank"))
                .or_else(|| map_get(&value, "dp_rank")),
        ),
        _ => return Err(DecodeError::Batch("neither an array nor a map")),
    };
    let events = match events {
        Some(Value::Array(events)) => events,
        Some(Value::Nil) | None => return Err(DecodeError::Batch("no event list")),
        Some(_) => return Err(DecodeError::Batch("events is not an array")),
    };
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or(DecodeError::Batch("data_parallel_rank is not a small uint"))?,
        ),
    };
    let events = events
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EngineBatch { events, dp_rank })
}

/// Positional field names of each event kind, after the tag (vLLM's declaration order).
const STORED_FIELDS: [&str; 6] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
];
const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

/// A view over one event's fields, whichever shape it came in.
enum Fields<'a> {
    Positional(&'a [Value]),
    Keyed(&'a Value),
}

impl<'a> Fields<'a> {
    fn get(&self, names: &[&str], name: &str) -> Option<&'a Value> {
        match self {
            Fields::Positional(items) => {
                let index = names.iter().position(|n| *n == name)?;
                items.get(index + 1).filter(|v| !v.is_nil())
            }
            Fields::Keyed(map) => map_get(map, name).filter(|v| !v.is_nil()),
        }
    }
}

fn decode_event(value: &Value) -> Result<EngineEvent, DecodeError> {
    let (tag, fields) = match value {
        Value::Array(items) => (items.first(), Fields::Positional(items)),
        Value::Map(_) => (map_get(value, "type"), Fields::Keyed(value)),
        _ => return Err(DecodeError::Batch("event is neither an array nor a map")),
    };
    let tag = tag
        .and_then(Value::as_str)
        .ok_or(DecodeError::Batch("event without a type tag"))?;
    match tag {
        "BlockStored" => {
            const E: &str = "BlockStored";
            let block_hashes = hash_list(fields.get(&STORED_FIELDS, "block_hashes"), E)?;
            let parent = match fields.get(&STORED_FIELDS, "parent_block_hash") {
                None => None,
                Some(v) => Some(hash(v).ok_or(DecodeError::Event {
                    event: E,
                    what: "parent_block_hash is not a hash",
                })?),
            };
            let token_ids = token_list(fields.get(&STORED_FIELDS, "token_ids"))?;
            let block_size = match fields.get(&STORED_FIELDS, "block_size") {
                None => None,
                Some(v) => Some(v.as_u64().and_then(|b| u32::try_from(b).ok()).ok_or(
                    DecodeError::Event {
                        event: E,
                        what: "block_size is not a small uint",
                    },
                )?),
            };
            let medium = fields
                .get(&STORED_FIELDS, "medium")
                .and_then(Value::as_str)
                .map(str::to_owned);
            Ok(EngineEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                medium,
            })
        }
        "BlockRemoved" => Ok(EngineEvent::BlockRemoved {
            block_hashes: hash_list(fields.get(&REMOVED_FIELDS, "block_hashes"), "BlockRemoved")?,
            medium: fields
                .get(&REMOVED_FIELDS, "medium")
                .and_then(Value::as_str)
                .map(str::to_owned),
        }),
        "AllBlocksCleared" => Ok(EngineEvent::AllBlocksCleared),
        other => Err(DecodeError::UnknownEvent(other.chars().take(64).collect())),
    }
}

fn map_get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    match map {
        Value::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// Folds an engine hash to u64: unsigned as is, signed by its bits, bytes by their last 8
/// (big-endian, vLLM's folding of its 32-byte digests). Any consistent folding works because
/// engine hashes are only ever compared with each other.
fn hash(value: &Value) -> Option<u64> {
    match value {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|v| v as u64)),
        Value::Binary(bytes) if !bytes.is_empty() => {
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
        }
        _ => None,
    }
}

fn hash_list(value: Option<&Value>, event: &'static str) -> Result<Vec<u64>, DecodeError> {
    let Some(Value::Array(items)) = value else {
        return Err(DecodeError::Event {
            event,
            what: "block_hashes is not an array",
        });
    };
    items
        .iter()
        .map(|v| {
            hash(v).ok_or(DecodeError::Event {
                event,
                what: "a block hash is neither an integer nor bytes",
            })
        })
        .collect()
}

fn token_list(value: Option<&Value>) -> Result<Vec<u32>, DecodeError> {
    let bad = DecodeError::Event {
        event: "BlockStored",
        what: "token_ids is not an array of uint32",
    };
    let Some(Value::Array(items)) = value else {
        return Err(bad);
    };
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<_>>>()
        .ok_or(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The positional example of WIRE_FORMATS.md §6.2, byte for byte.
    #[test]
    fn decodes_the_documented_positional_batch() {
        let mut bytes = hex("93 cb41d954fc40200000 93 98 ab");
        bytes.extend(b"BlockStored");
        bytes.extend(hex(
            "92 cf1e0b2e028ef071cb cfefad121d154ab2d6 c0 98 0102030405060708 04 c0 a3",
        ));
        bytes.extend(b"GPU");
        bytes.extend(hex("c0 93 ac"));
        bytes.extend(b"BlockRemoved");
        bytes.extend(hex("91 cfefad121d154ab2d6 a3"));
        bytes.extend(b"GPU");
        bytes.extend(hex("91 b0"));
        bytes.extend(b"AllBlocksCleared");
        bytes.extend(hex("00"));
        assert_eq!(bytes.len(), 107);
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.dp_rank, Some(0));
        assert_eq!(
            batch.events,
            vec![
                EngineEvent::BlockStored {
                    block_hashes: vec![2164874634404590027, 17270480062156288726],
                    parent: None,
                    token_ids: (1..=8).collect(),
                    block_size: Some(4),
                    medium: Some("GPU".into()),
                },
                EngineEvent::BlockRemoved {
                    block_hashes: vec![17270480062156288726],
                    medium: Some("GPU".into()),
                },
                EngineEvent::AllBlocksCleared,
            ]
        );
    }

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn decodes_map_events_map_batches_signed_and_byte_hashes() {
        let stored = map(vec![
            ("type", "BlockStored".into()),
            ("block_hashes", Value::Array(vec![Value::from(-5i64)])),
            (
                "parent_block_hash",
                Value::Binary(vec![9, 9, 0, 0, 0, 0, 0, 0, 0, 7]),
            ),
            ("token_ids", Value::Array(vec![1.into(), 2.into()])),
            ("block_size", 2.into()),
            ("locality", "whatever".into()),
        ]);
        let batch = map(vec![
            ("ts", Value::F64(1.0)),
            ("events", Value::Array(vec![stored])),
            ("data_parallel_rank", 3.into()),
        ]);
        let decoded = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(decoded.dp_rank, Some(3));
        assert_eq!(
            decoded.events,
            vec![EngineEvent::BlockStored {
                block_hashes: vec![(-5i64) as u64],
                parent: Some(7),
                token_ids: vec![1, 2],
                block_size: Some(2),
                medium: None,
            }]
        );
        // SGLang's old two-element batch, no rank.
        let old = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec!["AllBlocksCleared".into()])]),
        ]);
        assert_eq!(decode_batch(&encode(&old)).unwrap().dp_rank, None);
    }

    #[test]
    fn malformed_payloads_are_errors() {
        assert!(decode_batch(&[]).is_err());
        assert!(decode_batch(&[0xc1]).is_err());
        assert!(decode_batch(&encode(&Value::from(3))).is_err());
        let unknown = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec!["Teleported".into()])]),
        ]);
        assert!(matches!(
            decode_batch(&encode(&unknown)),
            Err(DecodeError::UnknownEvent(_))
        ));
        let bad_tokens = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![
                "BlockStored".into(),
                Value::Array(vec![1.into()]),
                Value::Nil,
                Value::Array(vec![Value::from(-1)]),
            ])]),
        ]);
        assert!(decode_batch(&encode(&bad_tokens)).is_err());
        let mut trailing = encode(&unknown);
        trailing.push(0);
        assert!(matches!(
            decode_batch(&trailing),
            Err(DecodeError::Trailing(1))
        ));
    }
}
