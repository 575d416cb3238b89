//! Every golden frame produced by vLLM's and SGLang's own code (`../shared/conformance/golden/`)
//! decodes with the router's decoder, field by field as the producers' JSON dumps say; our encoder
//! round-trips what it decodes; and the converted events apply cleanly to the router's index.

use kvrouter_core::index::PrefixIndex;
use kvrouter_core::WorkerId;
use kvrouter_kv_wire::{
    decode_payload, decode_seq, encode_payload, to_kv_events, ConvertOptions, RawHash, WireBatch,
    WireEvent,
};
use serde_json::Value;
use std::path::PathBuf;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/conformance/golden")
}

struct Message {
    title: String,
    frames: Vec<Vec<u8>>,
    json: Option<Value>,
}

fn parse(text: &str) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::new();
    for line in text.lines() {
        if let Some(title) = line.strip_prefix("--- ") {
            out.push(Message {
                title: title.to_owned(),
                frames: Vec::new(),
                json: None,
            });
        } else if let Some(rest) = line.strip_prefix("frame[") {
            let hex = rest.split("hex=").nth(1).unwrap_or("");
            let bytes = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            out.last_mut().unwrap().frames.push(bytes);
        } else if let Some(json) = line.strip_prefix("payload(json)=") {
            out.last_mut().unwrap().json = Some(serde_json::from_str(json).unwrap());
        }
    }
    out
}

fn check_hash(ours: &RawHash, golden: &Value, ctx: &str) {
    match (ours, golden) {
        (RawHash::Uint(v), Value::Number(n)) => assert_eq!(Some(*v), n.as_u64(), "{ctx}"),
        (RawHash::Int(v), Value::Number(n)) => assert_eq!(Some(*v), n.as_i64(), "{ctx}"),
        (RawHash::Bytes(b), Value::Object(o)) => {
            let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
            assert_eq!(Some(hex.as_str()), o["hex"].as_str(), "{ctx}");
        }
        _ => panic!("{ctx}: hash {ours:?} vs golden {golden}"),
    }
}

fn opt_str(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

/// Field `name` of a golden event, given its position in the legacy array form.
fn field<'a>(event: &'a Value, name: &str, position: usize) -> Option<&'a Value> {
    match event {
        Value::Object(m) => m.get(name),
        Value::Array(a) => a.get(position + 1),
        _ => None,
    }
    .filter(|v| !v.is_null())
}

fn check_event(ours: &WireEvent, golden: &Value, ctx: &str) {
    let tag = match golden {
        Value::Object(m) => m["type"].as_str().unwrap(),
        Value::Array(a) => a[0].as_str().unwrap(),
        _ => panic!("{ctx}: golden event {golden}"),
    };
    match ours {
        WireEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            cache_salt,
            ..
        } => {
            assert_eq!(tag, "BlockStored", "{ctx}");
            let gh = field(golden, "block_hashes", 0)
                .unwrap()
                .as_array()
                .unwrap();
            assert_eq!(block_hashes.len(), gh.len(), "{ctx}");
            for (o, g) in block_hashes.iter().zip(gh) {
                check_hash(o, g, ctx);
            }
            match (parent_block_hash, field(golden, "parent_block_hash", 1)) {
                (None, None) => {}
                (Some(o), Some(g)) => check_hash(o, g, ctx),
                other => panic!("{ctx}: parent {other:?}"),
            }
            let gt: Vec<u32> = field(golden, "token_ids", 2)
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(token_ids, &gt, "{ctx}");
            assert_eq!(
                Some(u64::from(*block_size)),
                field(golden, "block_size", 3).and_then(Value::as_u64),
                "{ctx}"
            );
            assert_eq!(
                *lora_id,
                field(golden, "lora_id", 4).and_then(Value::as_i64),
                "{ctx}"
            );
            assert_eq!(*medium, opt_str(field(golden, "medium", 5)), "{ctx}");
            assert_eq!(*lora_name, opt_str(field(golden, "lora_name", 6)), "{ctx}");
            if let Some(salt) = golden.get("cache_salt") {
                assert_eq!(cache_salt.as_deref(), salt.as_str(), "{ctx}");
            }
        }
        WireEvent::BlockRemoved {
            block_hashes,
            medium,
            ..
        } => {
            assert_eq!(tag, "BlockRemoved", "{ctx}");
            let gh = field(golden, "block_hashes", 0)
                .unwrap()
                .as_array()
                .unwrap();
            assert_eq!(block_hashes.len(), gh.len(), "{ctx}");
            for (o, g) in block_hashes.iter().zip(gh) {
                check_hash(o, g, ctx);
            }
            assert_eq!(*medium, opt_str(field(golden, "medium", 1)), "{ctx}");
        }
        WireEvent::AllBlocksCleared => assert_eq!(tag, "AllBlocksCleared", "{ctx}"),
        WireEvent::Unknown(t) => panic!("{ctx}: unknown event type {t}"),
    }
}

fn check_batch(ours: &WireBatch, golden: &Value, ctx: &str) {
    let g = golden.as_array().unwrap();
    assert_eq!(Some(ours.ts), g[0].as_f64(), "{ctx}");
    assert_eq!(ours.dp_rank, g.get(2).and_then(Value::as_i64), "{ctx}");
    let ge = g[1].as_array().unwrap();
    assert_eq!(ours.events.len(), ge.len(), "{ctx}");
    for (i, (o, e)) in ours.events.iter().zip(ge).enumerate() {
        check_event(o, e, &format!("{ctx} event {i}"));
    }
}

#[test]
fn every_golden_frame_decodes_and_round_trips() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("shared/conformance/golden beside the repository")
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.ends_with(".txt") && !name.contains("hash_vectors")
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 6,
        "expected the vLLM and SGLang dumps, found {files:?}"
    );
    let mut payloads = 0;
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let messages = parse(&std::fs::read_to_string(file).unwrap());
        let mut index: Option<PrefixIndex> = None;
        for m in messages
            .iter()
            .filter(|m| m.title.starts_with("live message"))
        {
            let ctx = format!("{name} {}", m.title);
            let [topic, seq, payload] = m.frames.as_slice() else {
                panic!("{ctx}: {} frames", m.frames.len())
            };
            assert!(topic.is_empty() || std::str::from_utf8(topic).is_ok());
            decode_seq(seq).unwrap();
            let batch = decode_payload(payload).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            check_batch(&batch, m.json.as_ref().unwrap(), &ctx);
            // Our encoder writes what we decoded; decoding it again gives the same core events.
            let again = decode_payload(&encode_payload(&batch)).unwrap();
            let opts = ConvertOptions {
                worker: WorkerId(1),
                default_dp_rank: 0,
            };
            assert_eq!(
                to_kv_events(&again, opts),
                to_kv_events(&batch, opts),
                "{ctx}: round trip"
            );
            // The events apply to the router's index without error.
            for event in to_kv_events(&batch, opts) {
                let Some(event) = event.unwrap_or_else(|e| panic!("{ctx}: {e}")) else {
                    continue;
                };
                // The index takes its block size from the first store; earlier events (a
                // clear at start-up) have nothing to act on.
                if let kvrouter_core::KvEvent::Stored { block_size, .. } = &event {
                    index.get_or_insert_with(|| PrefixIndex::new(*block_size));
                }
                let Some(index) = index.as_mut() else {
                    continue;
                };
                index.apply(&event).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            }
            payloads += 1;
        }
        // Replay replies carry the same batches (with or without the topic frame) and end with
        // an empty payload under sequence -1.
        for m in messages
            .iter()
            .filter(|m| m.title.starts_with("replay reply"))
        {
            let ctx = format!("{name} {}", m.title);
            let payload = m.frames.last().unwrap();
            let seq = &m.frames[m.frames.len() - 2];
            if payload.is_empty() {
                assert_eq!(decode_seq(seq).unwrap(), u64::MAX, "{ctx}: end marker");
                continue;
            }
            let batch = decode_payload(payload).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            check_batch(&batch, m.json.as_ref().unwrap(), &ctx);
            payloads += 1;
        }
    }
    assert!(payloads >= 40, "only {payloads} payloads checked");
}
