//! Encoding then decoding any batch our encoder can write gives the same batch back, and the
//! decoder never panics on arbitrary bytes.

use kvrouter_kv_wire::{decode_payload, encode_payload, RawHash, WireBatch, WireEvent};
use proptest::prelude::*;

fn hash() -> impl Strategy<Value = RawHash> {
    prop_oneof![
        any::<u64>().prop_map(RawHash::Uint),
        (i64::MIN..0).prop_map(RawHash::Int),
        prop::collection::vec(any::<u8>(), 16..=32).prop_map(RawHash::Bytes),
    ]
}

fn name() -> impl Strategy<Value = Option<String>> {
    prop::option::of("[a-z]{1,8}")
}

fn event() -> impl Strategy<Value = WireEvent> {
    let stored = (
        prop::collection::vec(hash(), 1..4),
        prop::option::of(hash()),
        1u32..5,
        name(),
        name(),
        prop::option::of(0i64..3),
    )
        .prop_flat_map(|(hashes, parent, bs, medium, lora, lora_id)| {
            let n = hashes.len() * bs as usize;
            (
                Just((hashes, parent, bs, medium, lora, lora_id)),
                prop::collection::vec(any::<u32>(), n),
            )
        })
        .prop_map(
            |(
                (block_hashes, parent_block_hash, block_size, medium, lora_name, lora_id),
                token_ids,
            )| {
                WireEvent::BlockStored {
                    extra_key_strings: lora_name.iter().map(|l| vec![l.clone()]).collect(),
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    cache_salt: None,
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                }
            },
        );
    prop_oneof![
        stored,
        (prop::collection::vec(hash(), 1..4), name()).prop_map(|(block_hashes, medium)| {
            WireEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx: Some(0),
            }
        }),
        Just(WireEvent::AllBlocksCleared),
    ]
}

proptest! {
    #[test]
    fn encode_then_decode_is_identity(
        ts in 0.0f64..2e9,
        events in prop::collection::vec(event(), 0..6),
        dp_rank in prop::option::of(0i64..8),
    ) {
        let batch = WireBatch { ts, events, dp_rank };
        prop_assert_eq!(decode_payload(&encode_payload(&batch)).unwrap(), batch);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_payload(&bytes);
    }
}
