//! Encoding batches in vLLM 0.33's shape (tagged maps, fields in declaration order).

use crate::model::{RawHash, WireBatch, WireEvent};
use rmpv::Value;

/// The three frames of one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frames {
    /// Topic (may be empty).
    pub topic: Vec<u8>,
    /// Sequence number, 8 bytes big-endian.
    pub seq: [u8; 8],
    /// msgpack payload.
    pub payload: Vec<u8>,
}

/// The frames of message `seq` on `topic`.
pub fn encode_frames(topic: &str, seq: u64, batch: &WireBatch) -> Frames {
    Frames {
        topic: topic.as_bytes().to_vec(),
        seq: seq.to_be_bytes(),
        payload: encode_payload(batch),
    }
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn opt_str(v: &Option<String>) -> Value {
    v.as_deref().map_or(Value::Nil, Value::from)
}

fn hash(h: &RawHash) -> Value {
    match h {
        RawHash::Uint(v) => Value::from(*v),
        RawHash::Int(v) => Value::from(*v),
        RawHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn event(e: &WireEvent) -> Value {
    let mut m: Vec<(Value, Value)> = Vec::new();
    match e {
        WireEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            cache_salt,
            extra_key_strings,
            group_idx,
            kv_cache_spec_kind,
        } => {
            m.push((s("type"), s("BlockStored")));
            m.push((
                s("block_hashes"),
                Value::Array(block_hashes.iter().map(hash).collect()),
            ));
            m.push((
                s("parent_block_hash"),
                parent_block_hash.as_ref().map_or(Value::Nil, hash),
            ));
            m.push((
                s("token_ids"),
                Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
            ));
            m.push((s("block_size"), Value::from(*block_size)));
            m.push((s("lora_id"), lora_id.map_or(Value::Nil, Value::from)));
            m.push((s("medium"), opt_str(medium)));
            m.push((s("lora_name"), opt_str(lora_name)));
            // vLLM carries the adapter name and the cache salt in the first block's extra keys.
            let mut keys = extra_key_strings.clone();
            if let Some(salt) = cache_salt {
                if keys.is_empty() {
                    keys.push(lora_name.iter().cloned().collect());
                }
                // Present already past the adapter's name (which a salt may equal)?
                let adapter = usize::from(lora_name.as_ref() == Some(salt));
                if keys[0].iter().filter(|k| *k == salt).count() <= adapter {
                    keys[0].push(salt.clone());
                }
            }
            let extra: Vec<Value> = (0..block_hashes.len())
                .map(|i| match keys.get(i) {
                    Some(keys) if !keys.is_empty() => {
                        Value::Array(keys.iter().map(|k| s(k)).collect())
                    }
                    _ => Value::Nil,
                })
                .collect();
            m.push((s("extra_keys"), Value::Array(extra)));
            m.push((s("group_idx"), Value::from(group_idx.unwrap_or(0))));
            m.push((
                s("kv_cache_spec_kind"),
                s(kv_cache_spec_kind.as_deref().unwrap_or("full_attention")),
            ));
        }
        WireEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => {
            m.push((s("type"), s("BlockRemoved")));
            m.push((
                s("block_hashes"),
                Value::Array(block_hashes.iter().map(hash).collect()),
            ));
            m.push((s("medium"), opt_str(medium)));
            m.push((s("group_idx"), Value::from(group_idx.unwrap_or(0))));
        }
        WireEvent::AllBlocksCleared => m.push((s("type"), s("AllBlocksCleared"))),
        WireEvent::Unknown(tag) => m.push((s("type"), s(tag))),
    }
    Value::Map(m)
}

/// The msgpack payload `[ts, events, dp_rank]`.
pub fn encode_payload(batch: &WireBatch) -> Vec<u8> {
    let value = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(event).collect()),
        batch.dp_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut out = Vec::with_capacity(64);
    rmpv::encode::write_value(&mut out, &value).expect("writing to a Vec cannot fail");
    out
}
