//! Encoding then decoding any batch our encoder can write gives the same batch back, and the
//! decoder (and the conversion to the core's events) never panics on arbitrary bytes or on valid
//! encodings with bytes flipped, cut, inserted or replaced by msgpack length headers.

use kvrouter_core::ids::WorkerId;
use kvrouter_kv_wire::{
    decode_payload, decode_seq, encode_payload, to_kv_events, ConvertOptions, RawHash, WireBatch,
    WireEvent,
};
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

/// One change to a valid encoding.
#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Cut(usize),
    Insert(usize, u8),
    /// A length-prefixed msgpack header (str32, bin32, array32, map32, ext32) declaring `len`.
    Header(usize, u8, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, x)| Mutation::Flip(at, x)),
        any::<usize>().prop_map(Mutation::Cut),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (
            any::<usize>(),
            prop::sample::select(vec![0xdbu8, 0xc6, 0xdd, 0xdf, 0xc9]),
            any::<u32>()
        )
            .prop_map(|(at, h, len)| Mutation::Header(at, h, len)),
    ]
}

fn mutate(mut bytes: Vec<u8>, m: &Mutation) -> Vec<u8> {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match *m {
        Mutation::Flip(i, x) => {
            let i = at(i, bytes.len());
            if let Some(b) = bytes.get_mut(i) {
                *b ^= x;
            }
        }
        Mutation::Cut(i) => bytes.truncate(at(i, bytes.len())),
        Mutation::Insert(i, b) => {
            let i = at(i, bytes.len() + 1);
            bytes.insert(i, b);
        }
        Mutation::Header(i, h, len) => {
            let i = at(i, bytes.len());
            let mut header = vec![h];
            header.extend(len.to_be_bytes());
            bytes.splice(i..i, header);
        }
    }
    bytes
}

/// Decodes and converts; only a panic fails.
fn decode_and_convert(bytes: &[u8]) {
    if let Ok(batch) = decode_payload(bytes) {
        let opts = ConvertOptions {
            worker: WorkerId(1),
            default_dp_rank: 0,
        };
        let _ = to_kv_events(&batch, opts);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutated_encodings_never_panic(
        events in prop::collection::vec(event(), 1..4),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let batch = WireBatch { ts: 1.0, events, dp_rank: Some(0) };
        let mut bytes = encode_payload(&batch);
        for m in &mutations {
            bytes = mutate(bytes, m);
        }
        decode_and_convert(&bytes);
    }

    #[test]
    fn sequence_frames_of_any_length_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..16)) {
        prop_assert_eq!(decode_seq(&bytes).is_ok(), bytes.len() == 8);
    }

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
        decode_and_convert(&bytes);
    }
}
