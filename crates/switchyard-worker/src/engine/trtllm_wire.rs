//! The JSON `trtllm-serve` answers `POST /kv_cache_events` with, read into [`Parsed`] events;
//! what they mean for the worker's view is [`trtllm_events`](super::trtllm_events).
//!
//! Read from TensorRT-LLM's serializer (`tensorrt_llm/_utils.py`, `KVCacheEventSerializer`) and
//! its C++ event manager (`kvCacheEventManager`): a JSON list of
//! `{"event_id", "data", "window_size"}` plus `attention_dp_rank` with attention data parallelism
//! and, in newer releases, `layer_group_id`. An event whose envelope cannot be read (no
//! `event_id`) is reported apart; an event whose `data` cannot be used keeps its id and place in
//! the sequence and is skipped alone with the reason.

use serde_json::Value;

use super::kv_decode::Skipped;

/// One event of a poll, its envelope read; `data` is `Err` when the event itself is unusable.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub event_id: u64,
    pub rank: u32,
    pub window: Option<u64>,
    /// The KV cache manager's layer group (`layer_group_id`, newer releases; 0 when absent): its
    /// own engine-hash namespace, as vLLM's KV-cache groups.
    pub group: u32,
    pub data: Result<TrtData, Skipped>,
}

/// What an event says.
#[derive(Debug, Clone, PartialEq)]
pub enum TrtData {
    /// The engine (re)created its cache: blocks per cache level.
    Created,
    Stored {
        parent: Option<u64>,
        blocks: Vec<TrtBlock>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    /// A block changed cache level (`Some((old, new))`) or only priority (`None`).
    Updated {
        hash: u64,
        cache_level: Option<(u64, u64)>,
    },
}

/// One stored block.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrtBlock {
    pub hash: u64,
    pub tokens: Vec<u32>,
    pub cache_level: u64,
    pub lora: Option<String>,
    pub salt: Option<String>,
    /// What besides its tokens names the block (multimodal keys, extra token ids), encoded.
    pub other: Option<Vec<u8>>,
}

/// Why a poll's body is not a list of events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PollError {
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    #[error("the body is not a JSON list of events")]
    NotAList,
}

/// A poll's events, and the reasons for those without a readable envelope (no `event_id`).
pub fn parse_poll(body: &str) -> Result<(Vec<Parsed>, Vec<String>), PollError> {
    let value: Value = serde_json::from_str(body).map_err(|e| PollError::NotJson(e.to_string()))?;
    let Value::Array(items) = value else {
        return Err(PollError::NotAList);
    };
    let mut events = Vec::with_capacity(items.len());
    let mut unreadable = Vec::new();
    for item in &items {
        match parse_event(item) {
            Ok(event) => events.push(event),
            Err(why) => unreadable.push(why),
        }
    }
    Ok((events, unreadable))
}

/// One event; `Err` when even its envelope cannot be read.
pub fn parse_event(item: &Value) -> Result<Parsed, String> {
    let event_id = item
        .get("event_id")
        .and_then(Value::as_u64)
        .ok_or("an event without an unsigned event_id")?;
    let rank = match item.get("attention_dp_rank") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|r| u32::try_from(r).ok())
            .ok_or("attention_dp_rank is not a small unsigned integer")?,
    };
    let window = item.get("window_size").and_then(Value::as_u64);
    let group = item
        .get("layer_group_id")
        .and_then(Value::as_u64)
        .and_then(|g| u32::try_from(g).ok())
        .unwrap_or(0);
    let data = item.get("data").unwrap_or(&Value::Null);
    let kind = data.get("type").and_then(Value::as_str).unwrap_or("?");
    let data = parse_data(data, kind).map_err(|why| Skipped {
        kind: kind.chars().take(64).collect(),
        why,
    });
    Ok(Parsed {
        event_id,
        rank,
        window,
        group,
        data,
    })
}

fn parse_data(data: &Value, kind: &str) -> Result<TrtData, String> {
    match kind {
        "created" => Ok(TrtData::Created),
        "stored" => {
            let parent = match data.get("parent_hash") {
                None | Some(Value::Null) => None,
                Some(v) => Some(hash(v).ok_or("parent_hash is not a hash")?),
            };
            let lora = data.get("lora_name").and_then(Value::as_str);
            let blocks = data
                .get("blocks")
                .and_then(Value::as_array)
                .ok_or("blocks is not a list")?
                .iter()
                .map(|b| parse_block(b, lora))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(TrtData::Stored { parent, blocks })
        }
        "removed" => Ok(TrtData::Removed {
            hashes: data
                .get("block_hashes")
                .and_then(Value::as_array)
                .ok_or("block_hashes is not a list")?
                .iter()
                .map(|h| hash(h).ok_or_else(|| "a block hash is not a hash".to_owned()))
                .collect::<Result<_, _>>()?,
        }),
        "updated" => {
            let hash = data
                .get("block_hash")
                .and_then(hash)
                .ok_or("block_hash is not a hash")?;
            let diff = |name: &str| -> Result<Option<(u64, u64)>, String> {
                match data.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(d) => {
                        let side = |k: &str| d.get(k).and_then(Value::as_u64);
                        match (side("old_value"), side("new_value")) {
                            (Some(old), Some(new)) => Ok(Some((old, new))),
                            _ => Err(format!("{name} is not an event_diff of levels")),
                        }
                    }
                }
            };
            Ok(TrtData::Updated {
                hash,
                cache_level: diff("cache_level")?,
            })
        }
        "?" => Err("an event without data.type".into()),
        other => Err(format!(
            "unknown event type {:?}",
            other.chars().take(64).collect::<String>()
        )),
    }
}

fn parse_block(block: &Value, event_lora: Option<&str>) -> Result<TrtBlock, String> {
    let hash = block
        .get("block_hash")
        .and_then(hash)
        .ok_or("block_hash is not a hash")?;
    let mut tokens = Vec::new();
    let mut extra = Vec::new();
    for token in block
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or("tokens is not a list")?
    {
        let id = token
            .get("token_id")
            .and_then(Value::as_u64)
            .and_then(|t| u32::try_from(t).ok())
            .ok_or("a token without a uint32 token_id")?;
        let extra_id = token
            .get("token_extra_id")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        tokens.push(id);
        extra.push(extra_id);
    }
    let lora = match block.get("lora_id").and_then(Value::as_u64) {
        // TensorRT-LLM's ids are its own; 0 and absent mean the base model.
        Some(id) if id != 0 => Some(format!("lora_id:{id}")),
        _ => event_lora.map(str::to_owned),
    };
    // Extra token ids (prompt-tuning / multimodal tokens) and multimodal keys name what the token
    // ids alone do not: folded into the block's key, so such a block never matches plain text.
    let mut other = Vec::new();
    if extra.iter().any(|e| *e != 0) {
        other.extend(b"extra:");
        for e in &extra {
            other.extend(e.to_le_bytes());
        }
    }
    if let Some(keys) = block.get("mm_keys").and_then(Value::as_array) {
        for key in keys {
            other.extend(b"mm:");
            other.extend(
                key.get("hash")
                    .map(Value::to_string)
                    .unwrap_or_default()
                    .bytes(),
            );
            other.extend(
                key.get("start_offset")
                    .map(Value::to_string)
                    .unwrap_or_default()
                    .bytes(),
            );
        }
    }
    Ok(TrtBlock {
        hash,
        tokens,
        cache_level: block
            .get("cache_level")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        lora,
        salt: block
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_owned),
        other: (!other.is_empty()).then_some(other),
    })
}

/// An engine hash folded to u64: unsigned as is, signed by its bits, a hex digest (TensorRT-LLM's
/// `v2_sha256`) by its last 8 bytes. Engine hashes are only compared with each other.
fn hash(value: &Value) -> Option<u64> {
    if let Some(h) = value.as_u64() {
        return Some(h);
    }
    if let Some(h) = value.as_i64() {
        return Some(h as u64);
    }
    let hex = value.as_str()?;
    if hex.is_empty() || hex.len() > 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(&hex[hex.len().saturating_sub(16)..], 16).ok()
}
