//! The decoder as it was written over `rmpv::Value` trees (until the slice reader replaced it),
//! kept as the naive model the decoder is checked against (`tests/decode_model.rs`): the same
//! answers on every input, and the same errors (the kind; a shape error's words too).

use kvrouter_kv_wire::{RawHash, WireBatch, WireError, WireEvent};
use rmpv::Value;

fn shape(msg: impl Into<String>) -> WireError {
    WireError::Shape(msg.into())
}

/// Decodes a msgpack payload `[ts, events, dp_rank?]`.
pub(crate) fn decode_payload_model(payload: &[u8]) -> Result<WireBatch, WireError> {
    let mut cursor = payload;
    let value =
        rmpv::decode::read_value_with_max_depth(&mut cursor, kvrouter_kv_wire::decode::MAX_DEPTH)
            .map_err(|e| WireError::Msgpack(e.to_string()))?;
    let Value::Array(items) = value else {
        return Err(shape("batch is not an array"));
    };
    if items.len() < 2 {
        return Err(shape(format!(
            "batch has {} elements, expected 2 or 3",
            items.len()
        )));
    }
    let ts = match &items[0] {
        Value::F64(v) => *v,
        Value::F32(v) => f64::from(*v),
        v => v
            .as_i64()
            .map(|i| i as f64)
            .ok_or_else(|| shape("ts is not a number"))?,
    };
    let Value::Array(raw_events) = &items[1] else {
        return Err(shape("events is not an array"));
    };
    let events = raw_events
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    let dp_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| shape("dp rank is not an integer"))?,
        ),
    };
    Ok(WireBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Field access over either event form.
enum Fields<'a> {
    Map(&'a [(Value, Value)]),
    Array(&'a [Value]),
}

impl<'a> Fields<'a> {
    /// A field by name (map form) or by position after the tag (array form). Nil is `None`.
    fn get(&self, name: &str, position: usize) -> Option<&'a Value> {
        let v = match self {
            Fields::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            Fields::Array(items) => items.get(position + 1),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(value: &Value) -> Result<WireEvent, WireError> {
    let (tag, fields) = match value {
        Value::Map(entries) => {
            let tag = entries
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str())
                .ok_or_else(|| shape("event map has no string \"type\""))?;
            (tag, Fields::Map(entries))
        }
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| shape("event array has no tag"))?;
            (tag, Fields::Array(items))
        }
        _ => return Err(shape("event is neither a map nor an array")),
    };
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(fields.get("block_hashes", 0), "block_hashes")?;
            let parent_block_hash = fields.get("parent_block_hash", 1).map(hash).transpose()?;
            let token_ids = tokens(fields.get("token_ids", 2))?;
            let block_size = fields
                .get("block_size", 3)
                .and_then(Value::as_u64)
                .ok_or_else(|| shape("BlockStored without an integer block_size"))?;
            let lora_id = fields.get("lora_id", 4).and_then(Value::as_i64);
            let medium = string(fields.get("medium", 5));
            let lora_name = string(fields.get("lora_name", 6));
            let extra_key_strings = extra_keys(fields.get("extra_keys", 7));
            let group_idx = fields.get("group_idx", 8).and_then(Value::as_i64);
            let kv_cache_spec_kind = string(fields.get("kv_cache_spec_kind", 9));
            // SGLang sends the salt as a field (map form only); vLLM puts it in the first block's
            // extra keys next to the adapter name.
            let cache_salt = match &fields {
                Fields::Map(_) => string(fields.get("cache_salt", usize::MAX)),
                Fields::Array(_) => None,
            }
            .or_else(|| {
                // The first string past the adapter's name (skipped once: a salt may equal it).
                extra_key_strings.first().and_then(|keys| {
                    let skip =
                        usize::from(lora_name.is_some() && keys.first() == lora_name.as_ref());
                    keys.get(skip).cloned()
                })
            });
            Ok(WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size: u32::try_from(block_size).map_err(|_| shape("block_size too large"))?,
                lora_id,
                medium,
                lora_name,
                cache_salt,
                extra_key_strings,
                group_idx,
                kv_cache_spec_kind,
            })
        }
        "BlockRemoved" => Ok(WireEvent::BlockRemoved {
            block_hashes: hashes(fields.get("block_hashes", 0), "block_hashes")?,
            medium: string(fields.get("medium", 1)),
            group_idx: fields.get("group_idx", 2).and_then(Value::as_i64),
        }),
        "AllBlocksCleared" => Ok(WireEvent::AllBlocksCleared),
        other => Ok(WireEvent::Unknown(other.to_owned())),
    }
}

fn hash(value: &Value) -> Result<RawHash, WireError> {
    match value {
        Value::Integer(i) => {
            if let Some(u) = i.as_u64() {
                Ok(RawHash::Uint(u))
            } else {
                i.as_i64()
                    .map(RawHash::Int)
                    .ok_or_else(|| shape("hash integer out of range"))
            }
        }
        Value::Binary(b) => Ok(RawHash::Bytes(b.clone())),
        _ => Err(shape("a block hash is neither an integer nor bytes")),
    }
}

fn hashes(value: Option<&Value>, field: &str) -> Result<Vec<RawHash>, WireError> {
    match value {
        Some(Value::Array(items)) => items.iter().map(hash).collect(),
        _ => Err(shape(format!("{field} is not an array"))),
    }
}

fn tokens(value: Option<&Value>) -> Result<Vec<u32>, WireError> {
    let Some(Value::Array(items)) = value else {
        return Err(shape("token_ids is not an array"));
    };
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| shape("a token id is not a 32-bit unsigned integer"))
        })
        .collect()
}

fn string(value: Option<&Value>) -> Option<String> {
    value.and_then(Value::as_str).map(str::to_owned)
}

fn extra_keys(value: Option<&Value>) -> Vec<Vec<String>> {
    let Some(Value::Array(blocks)) = value else {
        return Vec::new();
    };
    let mut keys: Vec<Vec<String>> = blocks
        .iter()
        .map(|keys| match keys {
            Value::Array(items) => items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        })
        .collect();
    // Blocks without keys at the end carry nothing: keep the list canonical.
    while keys.last().is_some_and(Vec::is_empty) {
        keys.pop();
    }
    keys
}
