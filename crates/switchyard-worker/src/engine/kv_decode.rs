//! Decoding vLLM's and SGLang's KV event batches (MessagePack) into [`EngineBatch`].
//!
//! Engines have changed their encoding several times (tested against their own publisher code,
//! see `docs/engines.md`): batches are arrays `[ts, events, rank]` or maps; events are tagged
//! positional arrays `["BlockStored", hashes, parent, tokens, block_size, …]` (vLLM up to 0.23)
//! or maps with a `type` key (vLLM 0.24 and later, SGLang); hashes are u64, i64 or raw digest
//! bytes. Everything is decoded to an [`rmpv::Value`] first and then interpreted, so one decoder
//! accepts every variant and ignores fields it does not use. A batch that is not a batch is a
//! [`DecodeError`]; an event the decoder cannot use is [`Skipped`] with its type and the reason,
//! and the rest of its batch is kept.

use rmpv::Value;

/// One decoded engine batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    pub events: Vec<EngineEvent>,
    /// Events that could not be used, with why.
    pub skipped: Vec<Skipped>,
    /// The data-parallel rank the batch names, when it names one.
    pub dp_rank: Option<u32>,
}

/// An event left out of its batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The event's type tag (`"?"` when it had none).
    pub kind: String,
    pub why: String,
}

/// One engine KV event, with engine hashes folded to u64.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    BlockStored(StoredEvent),
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        /// The KV-cache group (vLLM's hybrid models); 0 when the engine names none.
        group: u32,
    },
    AllBlocksCleared,
}

/// An engine `BlockStored`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredEvent {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    /// The blocks' tokens, flat.
    pub token_ids: Vec<u32>,
    pub block_size: Option<u32>,
    pub medium: Option<String>,
    /// The KV-cache group; 0 when the engine names none.
    pub group: u32,
    /// vLLM's kind of that group's cache (`full_attention`, `sliding_window`, …), when sent.
    pub spec_kind: Option<String>,
    /// Per block, what besides its tokens names it ([`switchyard_core::block_key`] of the
    /// adapter, the cache salt and the block's extra keys); empty when nothing does.
    pub block_keys: Vec<Option<u64>>,
}

/// Why a payload is not a KV event batch, or an event not a usable event.
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

/// Nesting deeper than any real batch (batch → events → event → extra keys) is refused early.
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
    let mut batch = EngineBatch {
        events: Vec::with_capacity(events.len()),
        skipped: Vec::new(),
        dp_rank,
    };
    for event in events {
        match decode_event(event) {
            Ok(decoded) => batch.events.push(decoded),
            Err(err) => batch.skipped.push(Skipped {
                kind: tag_of(event).unwrap_or("?").chars().take(64).collect(),
                why: err.to_string(),
            }),
        }
    }
    Ok(batch)
}

/// Positional field names of each event kind, after the tag (vLLM's declaration order; 0.23
/// sends every one, nil when unset).
const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

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

fn tag_of(value: &Value) -> Option<&str> {
    match value {
        Value::Array(items) => items.first().and_then(Value::as_str),
        Value::Map(_) => map_get(value, "type").and_then(Value::as_str),
        _ => None,
    }
}

fn decode_event(value: &Value) -> Result<EngineEvent, DecodeError> {
    let fields = match value {
        Value::Array(items) => Fields::Positional(items),
        Value::Map(_) => Fields::Keyed(value),
        _ => return Err(DecodeError::Batch("event is neither an array nor a map")),
    };
    let tag = tag_of(value).ok_or(DecodeError::Batch("event without a type tag"))?;
    match tag {
        "BlockStored" => decode_stored(&fields).map(EngineEvent::BlockStored),
        "BlockRemoved" => Ok(EngineEvent::BlockRemoved {
            block_hashes: hash_list(fields.get(&REMOVED_FIELDS, "block_hashes"), "BlockRemoved")?,
            medium: string(fields.get(&REMOVED_FIELDS, "medium")),
            group: small_uint(
                fields.get(&REMOVED_FIELDS, "group_idx"),
                "BlockRemoved",
                "group_idx",
            )?
            .unwrap_or(0),
        }),
        "AllBlocksCleared" => Ok(EngineEvent::AllBlocksCleared),
        other => Err(DecodeError::UnknownEvent(other.chars().take(64).collect())),
    }
}

fn decode_stored(fields: &Fields<'_>) -> Result<StoredEvent, DecodeError> {
    const E: &str = "BlockStored";
    let get = |name| fields.get(&STORED_FIELDS, name);
    let block_hashes = hash_list(get("block_hashes"), E)?;
    let parent = match get("parent_block_hash") {
        None => None,
        Some(v) => Some(hash(v).ok_or(DecodeError::Event {
            event: E,
            what: "parent_block_hash is not a hash",
        })?),
    };
    let token_ids = token_list(get("token_ids"))?;
    let block_size = small_uint(get("block_size"), E, "block_size")?;
    let group = small_uint(get("group_idx"), E, "group_idx")?.unwrap_or(0);
    // What names a block besides its tokens (`switchyard_core::identity`): the adapter (vLLM's
    // and SGLang's lora_name, else the deprecated lora_id), the cache salt on a prompt's first
    // block, and any other per-block extra key (multimodal inputs, prompt embeddings).
    let lora = string(get("lora_name")).or_else(|| {
        get("lora_id")
            .and_then(Value::as_u64)
            .map(|id| format!("lora_id:{id}"))
    });
    let event_salt = string(get("cache_salt"));
    let extra: Vec<ExtraKeys> = match get("extra_keys") {
        Some(Value::Array(per_block)) => per_block
            .iter()
            .map(|k| ExtraKeys::read(k, lora.as_deref()))
            .collect(),
        _ => Vec::new(),
    };
    let keyed = lora.is_some() || event_salt.is_some() || extra.iter().any(ExtraKeys::is_some);
    let block_keys = if keyed {
        (0..block_hashes.len())
            .map(|i| {
                let extra = extra.get(i);
                // SGLang names the salt once per event; it keys the prompt's first block, from
                // which every later hash chains. vLLM puts it in that block's extra keys.
                let first = i == 0 && parent.is_none();
                let salt = extra
                    .and_then(|e| e.salt.as_deref())
                    .or(event_salt.as_deref().filter(|_| first));
                switchyard_core::identity_block_key(
                    lora.as_deref(),
                    salt,
                    extra.and_then(|e| e.other.as_deref()),
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(StoredEvent {
        block_hashes,
        parent,
        token_ids,
        block_size,
        medium: string(get("medium")),
        group,
        spec_kind: string(get("kv_cache_spec_kind")),
        block_keys,
    })
}

/// One block's entry of vLLM's `extra_keys`, published untagged: the adapter's name first
/// when the block is an adapter's, `(mm_identifier, offset)` pairs, the cache salt (a string,
/// on a prompt's first block) and prompt-embedding digests (bytes), in that order. The name
/// and the salt become their own parts of the block's key, so a request that names the same
/// adapter and salt hashes to the same block; the rest is kept msgpack-encoded.
#[derive(Debug, Default)]
struct ExtraKeys {
    salt: Option<String>,
    other: Option<Vec<u8>>,
}

impl ExtraKeys {
    fn read(entry: &Value, lora: Option<&str>) -> Self {
        let Value::Array(items) = entry else {
            if entry.is_nil() {
                return Self::default();
            }
            return Self {
                salt: None,
                other: Some(msgpack(entry)),
            };
        };
        let mut items: &[Value] = items;
        if let (Some(name), Some(first)) = (lora, items.first())
            && first.as_str() == Some(name)
        {
            items = &items[1..];
        }
        let salt = items.iter().find_map(Value::as_str).map(str::to_owned);
        let rest: Vec<Value> = items.iter().filter(|v| !v.is_str()).cloned().collect();
        Self {
            salt,
            other: (!rest.is_empty()).then(|| msgpack(&Value::Array(rest))),
        }
    }

    fn is_some(&self) -> bool {
        self.salt.is_some() || self.other.is_some()
    }
}

fn msgpack(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, value);
    out
}

fn string(value: Option<&Value>) -> Option<String> {
    value.and_then(Value::as_str).map(str::to_owned)
}

fn small_uint(
    value: Option<&Value>,
    event: &'static str,
    what: &'static str,
) -> Result<Option<u32>, DecodeError> {
    match value {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .map(Some)
            .ok_or(DecodeError::Event {
                event,
                what: match what {
                    "block_size" => "block_size is not a small uint",
                    "group_idx" => "group_idx is not a small uint",
                    _ => "a field is not a small uint",
                },
            }),
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
    if items.iter().any(|v| matches!(v, Value::Array(_))) {
        // SGLang's EAGLE pages hash token pairs (each token with the next one), so the engine's
        // block also depends on the token after the page: no prefix of plain tokens names it,
        // and indexing it by its first tokens would promise hits the engine cannot give.
        return Err(DecodeError::Event {
            event: "BlockStored",
            what: "token_ids are token pairs (an EAGLE bigram page), which name no plain prefix",
        });
    }
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
                EngineEvent::BlockStored(StoredEvent {
                    block_hashes: vec![2164874634404590027, 17270480062156288726],
                    parent: None,
                    token_ids: (1..=8).collect(),
                    block_size: Some(4),
                    medium: Some("GPU".into()),
                    ..StoredEvent::default()
                }),
                EngineEvent::BlockRemoved {
                    block_hashes: vec![17270480062156288726],
                    medium: Some("GPU".into()),
                    group: 0,
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
            vec![EngineEvent::BlockStored(StoredEvent {
                block_hashes: vec![(-5i64) as u64],
                parent: Some(7),
                token_ids: vec![1, 2],
                block_size: Some(2),
                ..StoredEvent::default()
            })]
        );
        // SGLang's old two-element batch, no rank.
        let old = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec!["AllBlocksCleared".into()])]),
        ]);
        assert_eq!(decode_batch(&encode(&old)).unwrap().dp_rank, None);
    }

    #[test]
    fn malformed_payloads_are_errors_and_unusable_events_are_skipped_alone() {
        assert!(decode_batch(&[]).is_err());
        assert!(decode_batch(&[0xc1]).is_err());
        assert!(decode_batch(&encode(&Value::from(3))).is_err());
        let cleared = || Value::Array(vec!["AllBlocksCleared".into()]);
        let unknown = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec!["Teleported".into()]), cleared()]),
        ]);
        let batch = decode_batch(&encode(&unknown)).unwrap();
        assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);
        assert_eq!(batch.skipped.len(), 1);
        assert_eq!(batch.skipped[0].kind, "Teleported");
        assert!(
            batch.skipped[0].why.contains("unknown event type"),
            "{:?}",
            batch.skipped
        );
        let bad_tokens = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![1.into()]),
                    Value::Nil,
                    Value::Array(vec![Value::from(-1)]),
                ]),
                cleared(),
            ]),
        ]);
        let batch = decode_batch(&encode(&bad_tokens)).unwrap();
        assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);
        assert_eq!(batch.skipped[0].kind, "BlockStored");
        let mut trailing = encode(&unknown);
        trailing.push(0);
        assert!(matches!(
            decode_batch(&trailing),
            Err(DecodeError::Trailing(1))
        ));
    }

    /// vLLM 0.23's positional BlockStored as its publisher writes it: all twelve elements,
    /// `group_idx` at index 9.
    #[test]
    fn decodes_vllm_0_23_positional_events_with_their_group() {
        let stored = Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![11.into(), 12.into()]),
            Value::Nil,
            Value::Array((1..=8).map(Value::from).collect()),
            4.into(),
            Value::Nil,
            "GPU".into(),
            Value::Nil,
            Value::Nil,
            2.into(),
            Value::Nil,
            Value::Nil,
        ]);
        let removed = Value::Array(vec![
            "BlockRemoved".into(),
            Value::Array(vec![12.into()]),
            "GPU".into(),
            2.into(),
        ]);
        let batch = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![stored, removed]),
            0.into(),
        ]);
        let decoded = decode_batch(&encode(&batch)).unwrap();
        match &decoded.events[0] {
            EngineEvent::BlockStored(e) => {
                assert_eq!(e.group, 2);
                assert_eq!(e.block_size, Some(4));
                assert!(e.block_keys.is_empty());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decoded.events[1],
            EngineEvent::BlockRemoved {
                block_hashes: vec![12],
                medium: Some("GPU".into()),
                group: 2,
            }
        );
    }

    #[test]
    fn sglang_bigram_pages_are_skipped_alone() {
        let stored = map(vec![
            ("type", "BlockStored".into()),
            ("block_hashes", Value::Array(vec![5.into()])),
            (
                "token_ids",
                Value::Array(
                    [(30, 31), (31, 32)]
                        .iter()
                        .map(|(a, b)| Value::Array(vec![(*a).into(), (*b).into()]))
                        .collect(),
                ),
            ),
            ("block_size", 2.into()),
        ]);
        let cleared = Value::Array(vec!["AllBlocksCleared".into()]);
        let batch = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![stored, cleared]),
            0.into(),
        ]);
        let batch = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);
        assert!(
            batch.skipped[0].why.contains("bigram"),
            "{:?}",
            batch.skipped
        );
    }

    #[test]
    fn adapters_salts_and_extra_keys_name_blocks() {
        let event = |extra: Vec<(&str, Value)>| {
            let mut fields = vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![5.into(), 6.into()])),
                (
                    "token_ids",
                    Value::Array((1..=4).map(Value::from).collect()),
                ),
                ("block_size", 2.into()),
            ];
            fields.extend(extra);
            let batch = Value::Array(vec![
                Value::F64(1.0),
                Value::Array(vec![map(fields)]),
                0.into(),
            ]);
            match decode_batch(&encode(&batch)).unwrap().events.remove(0) {
                EngineEvent::BlockStored(e) => e.block_keys,
                other => panic!("{other:?}"),
            }
        };
        assert!(event(vec![]).is_empty());
        let lora = event(vec![("lora_name", "sql-adapter".into())]);
        let salt = event(vec![("cache_salt", "tenant-a".into())]);
        assert_eq!(lora.len(), 2);
        assert!(lora.iter().all(Option::is_some));
        assert_ne!(lora, salt);
        // The keys a request naming the same adapter and salt hashes with, whichever way the
        // engine published them: SGLang's event-wide fields, vLLM's untagged extra keys (the
        // adapter's name on every block, the salt on the prompt's first).
        let identity = |adapter: Option<&str>, salt: Option<&str>| {
            let id =
                switchyard_core::KvIdentity::new(adapter.map(Into::into), salt.map(Into::into))
                    .unwrap();
            vec![id.block_key(true), id.block_key(false)]
        };
        assert_eq!(lora, identity(Some("sql-adapter"), None));
        assert_eq!(salt, identity(None, Some("tenant-a")));
        let vllm = event(vec![
            ("lora_name", "sql-adapter".into()),
            (
                "extra_keys",
                Value::Array(vec![
                    Value::Array(vec!["sql-adapter".into(), "tenant-a".into()]),
                    Value::Array(vec!["sql-adapter".into()]),
                ]),
            ),
        ]);
        assert_eq!(vllm, identity(Some("sql-adapter"), Some("tenant-a")));
        let vllm_salt = event(vec![(
            "extra_keys",
            Value::Array(vec![Value::Array(vec!["tenant-a".into()]), Value::Nil]),
        )]);
        assert_eq!(vllm_salt, identity(None, Some("tenant-a")));
        let continued = event(vec![
            ("cache_salt", "tenant-a".into()),
            ("parent_block_hash", 4.into()),
        ]);
        assert_eq!(
            continued,
            vec![None, None],
            "only a prompt's first block is salted"
        );
        let image = event(vec![(
            "extra_keys",
            Value::Array(vec![
                Value::Nil,
                Value::Array(vec![Value::Array(vec!["img-1".into(), 0.into()])]),
            ]),
        )]);
        assert_eq!(
            image[0], None,
            "a block without extra keys keeps its plain name"
        );
        assert!(image[1].is_some());
    }
}
