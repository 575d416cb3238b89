//! Payload generators for the decoder's property tests: batches shaped as engines publish them,
//! with every field's value drawn from any msgpack item (maps and arrays, duplicate and nil
//! fields, strings that are not UTF-8, integers in wide or signed encodings, nesting), written
//! with the encoding of each integer and length chosen.

#![allow(dead_code)]

use kvrouter_kv_wire::{WireBatch, WireEvent};
use proptest::prelude::*;

/// A batch to compare: `ts` by its bits, so that a NaN one (drawn now and then) equals itself.
pub(crate) fn comparable(batch: &WireBatch) -> (u64, &[WireEvent], Option<i64>) {
    (batch.ts.to_bits(), &batch.events, batch.dp_rank)
}

/// A msgpack value to write, with the encoding of its integers and lengths chosen.
#[derive(Clone, Debug)]
pub(crate) enum V {
    Nil,
    /// The reserved marker 0xc1 (rmpv reads it as nil).
    Reserved,
    Bool(bool),
    /// An integer written in its shortest form, or (`wide`) as 64 bits (`i64`'s marker for a
    /// non-negative value that fits, `u64`'s otherwise).
    Int(i128, bool),
    F32(f32),
    F64(f64),
    /// A string's bytes (maybe not UTF-8), with a 32-bit length when `wide`.
    Str(Vec<u8>, bool),
    Bin(Vec<u8>),
    Ext(i8, Vec<u8>),
    Array(Vec<V>, bool),
    Map(Vec<(V, V)>),
}

pub(crate) fn write(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::Reserved => out.push(0xc1),
        V::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        V::Int(i, wide) => {
            let i = *i;
            if *wide {
                if let Ok(s) = i64::try_from(i) {
                    out.push(0xd3);
                    out.extend(s.to_be_bytes());
                } else {
                    out.push(0xcf);
                    out.extend((i as u64).to_be_bytes());
                }
            } else if (0..128).contains(&i) {
                out.push(i as u8);
            } else if (-32..0).contains(&i) {
                out.push(i as i8 as u8);
            } else if let Ok(u) = u32::try_from(i) {
                out.push(0xce);
                out.extend(u.to_be_bytes());
            } else if let Ok(s) = i32::try_from(i) {
                out.push(0xd2);
                out.extend(s.to_be_bytes());
            } else if i > 0 {
                out.push(0xcf);
                out.extend((i as u64).to_be_bytes());
            } else {
                out.push(0xd3);
                out.extend((i as i64).to_be_bytes());
            }
        }
        V::F32(f) => {
            out.push(0xca);
            out.extend(f.to_be_bytes());
        }
        V::F64(f) => {
            out.push(0xcb);
            out.extend(f.to_be_bytes());
        }
        V::Str(b, wide) => {
            if *wide {
                out.push(0xdb);
                out.extend((b.len() as u32).to_be_bytes());
            } else if b.len() < 32 {
                out.push(0xa0 | b.len() as u8);
            } else {
                out.push(0xd9);
                out.push(b.len() as u8);
            }
            out.extend(b);
        }
        V::Bin(b) => {
            out.push(0xc4);
            out.push(b.len() as u8);
            out.extend(b);
        }
        V::Ext(t, b) => {
            out.push(0xc7);
            out.push(b.len() as u8);
            out.push(*t as u8);
            out.extend(b);
        }
        V::Array(items, wide) => {
            if *wide {
                out.push(0xdd);
                out.extend((items.len() as u32).to_be_bytes());
            } else if items.len() < 16 {
                out.push(0x90 | items.len() as u8);
            } else {
                out.push(0xdc);
                out.extend((items.len() as u16).to_be_bytes());
            }
            for i in items {
                write(i, out);
            }
        }
        V::Map(entries) => {
            out.push(0xde);
            out.extend((entries.len() as u16).to_be_bytes());
            for (k, v) in entries {
                write(k, out);
                write(v, out);
            }
        }
    }
}

/// Names a decoder looks for, and a few it does not.
pub(crate) const WORDS: [&str; 19] = [
    "type",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
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
    "cache_salt",
    "GPU",
    "salt",
    "Other",
    "",
];

pub(crate) fn word() -> impl Strategy<Value = V> {
    prop_oneof![
        8 => (prop::sample::select(WORDS.to_vec()), any::<bool>())
            .prop_map(|(w, wide)| V::Str(w.as_bytes().to_vec(), wide)),
        // Not UTF-8.
        1 => Just(V::Str(vec![0xff, b'a'], false)),
    ]
}

pub(crate) fn scalar() -> impl Strategy<Value = V> {
    prop_oneof![
        2 => Just(V::Nil),
        1 => Just(V::Reserved),
        1 => any::<bool>().prop_map(V::Bool),
        6 => (0i128..70_000, any::<bool>()).prop_map(|(i, w)| V::Int(i, w)),
        2 => (
            prop_oneof![
                Just(i128::from(u32::MAX) + 1),
                Just(i128::from(i64::MAX)),
                Just(i128::from(i64::MAX) + 1),
                Just(i128::from(u64::MAX)),
                Just(i128::from(i64::MIN)),
                -40i128..0,
            ],
            any::<bool>()
        )
            .prop_map(|(i, w)| V::Int(i, w)),
        1 => any::<f32>().prop_map(V::F32),
        1 => (0.0f64..2e9).prop_map(V::F64),
        3 => word(),
        2 => prop::collection::vec(any::<u8>(), 0..20).prop_map(V::Bin),
        1 => (any::<i8>(), prop::collection::vec(any::<u8>(), 0..4)).prop_map(|(t, b)| V::Ext(t, b)),
    ]
}

/// Any value: scalars, and lists and maps of them nested a few levels.
pub(crate) fn value() -> impl Strategy<Value = V> {
    scalar().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            (prop::collection::vec(inner.clone(), 0..6), any::<bool>())
                .prop_map(|(items, wide)| V::Array(items, wide)),
            prop::collection::vec((prop_oneof![word(), inner.clone()], inner), 0..4)
                .prop_map(V::Map),
        ]
    })
}

/// A field's value: mostly what the field holds (a list of hashes, of token ids, of key lists),
/// sometimes anything.
pub(crate) fn field_value() -> impl Strategy<Value = V> {
    prop_oneof![
        4 => (prop::collection::vec(scalar(), 0..6), any::<bool>())
            .prop_map(|(items, wide)| V::Array(items, wide)),
        2 => prop::collection::vec(
            prop::collection::vec(scalar(), 0..3).prop_map(|items| V::Array(items, false)),
            0..3
        )
        .prop_map(|items| V::Array(items, false)),
        4 => scalar(),
        1 => value(),
    ]
}

/// What a field of this name holds when it is well formed.
pub(crate) fn typed(name: &'static str) -> BoxedStrategy<V> {
    let int = |range: std::ops::Range<i128>| (range, any::<bool>()).prop_map(|(i, w)| V::Int(i, w));
    let hash = prop_oneof![
        3 => int(0..1_000_000),
        1 => Just(V::Int(i128::from(u64::MAX), false)),
        2 => int(-1_000_000..0),
        1 => prop::collection::vec(any::<u8>(), 16..=32).prop_map(V::Bin),
    ];
    let list = |items: BoxedStrategy<V>, n: std::ops::Range<usize>| {
        (prop::collection::vec(items, n), any::<bool>()).prop_map(|(v, w)| V::Array(v, w))
    };
    let words = prop::collection::vec(word(), 0..3).prop_map(|v| V::Array(v, false));
    match name {
        "block_hashes" => list(hash.boxed(), 0..4).boxed(),
        "parent_block_hash" => prop_oneof![Just(V::Nil), hash].boxed(),
        "token_ids" => list(int(0..100_000).boxed(), 0..8).boxed(),
        "block_size" => int(1..64).boxed(),
        "lora_id" | "group_idx" => prop_oneof![Just(V::Nil), int(-2..4)].boxed(),
        "extra_keys" => prop::collection::vec(prop_oneof![4 => words, 1 => scalar()], 0..3)
            .prop_map(|v| V::Array(v, false))
            .boxed(),
        _ => prop_oneof![Just(V::Nil), word()].boxed(),
    }
}

/// A field's value: mostly what the field holds, sometimes anything.
pub(crate) fn field(name: &'static str) -> BoxedStrategy<V> {
    prop_oneof![40 => typed(name), 1 => field_value()].boxed()
}

/// The fields of an event with this tag, in their array positions.
pub(crate) fn order(tag: &str) -> &'static [&'static str] {
    if tag == "BlockRemoved" {
        &["block_hashes", "medium", "group_idx"]
    } else {
        &WORDS[4..14]
    }
}

pub(crate) fn tag() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "Other",
    ])
}

pub(crate) fn event() -> impl Strategy<Value = V> {
    // Map form: a type (sometimes not, or twice), the fields in any order, some left out, some
    // given twice, some other keys.
    let map = (
        tag(),
        any::<u64>(),
        prop::collection::vec((word(), field_value()), 0..3),
    )
        .prop_flat_map(|(tag, seed, extra)| {
            let mut names: Vec<&'static str> = WORDS[4..15].to_vec();
            // A deterministic shuffle and cut from the seed.
            let mut x = seed | 1;
            for i in (1..names.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                names.swap(i, (x % (i as u64 + 1)) as usize);
            }
            names.truncate(names.len() - (seed % 4) as usize);
            if seed % 5 == 0 {
                names.push(names[0]);
            }
            let values: Vec<BoxedStrategy<V>> = names.iter().map(|n| field(n)).collect();
            let type_value = prop_oneof![
                10 => Just(V::Str(tag.as_bytes().to_vec(), false)),
                1 => scalar(),
            ];
            (
                Just((names, extra, seed)),
                values,
                prop::option::weighted(0.9, type_value),
            )
        })
        .prop_map(|((names, extra, seed), values, type_value)| {
            let mut entries: Vec<(V, V)> = names
                .iter()
                .map(|n| V::Str(n.as_bytes().to_vec(), false))
                .zip(values)
                .collect();
            entries.extend(extra);
            if let Some(t) = type_value {
                let at = (seed as usize / 7) % (entries.len() + 1);
                entries.insert(at, (V::Str(b"type".to_vec(), false), t.clone()));
                if seed % 3 == 0 {
                    entries.push((V::Str(b"type".to_vec(), false), t));
                }
            }
            V::Map(entries)
        });
    // Array form: the tag, then the fields by position (some cut off).
    let array = (tag(), 0usize..4).prop_flat_map(|(tag, cut)| {
        let names = order(tag);
        let values: Vec<BoxedStrategy<V>> = names[..names.len().saturating_sub(cut)]
            .iter()
            .map(|n| field(n))
            .collect();
        (Just(tag), values).prop_map(|(tag, mut values)| {
            values.insert(0, V::Str(tag.as_bytes().to_vec(), false));
            V::Array(values, false)
        })
    });
    prop_oneof![5 => map, 5 => array, 1 => value()]
}

/// A batch `[ts, events, dp_rank?, ...]`, or sometimes any value.
pub(crate) fn payload() -> impl Strategy<Value = Vec<u8>> {
    let batch = (
        prop_oneof![16 => (0.0f64..2e9).prop_map(V::F64), 1 => scalar()],
        prop_oneof![
            12 => (prop::collection::vec(event(), 0..5), any::<bool>())
                .prop_map(|(events, wide)| V::Array(events, wide)),
            1 => value(),
        ],
        // dp_rank (mostly a rank or nil), then anything.
        prop::collection::vec(
            prop_oneof![
                6 => (0i128..8, any::<bool>()).prop_map(|(i, w)| V::Int(i, w)),
                2 => Just(V::Nil),
                1 => scalar(),
            ],
            0..3,
        ),
    )
        .prop_map(|(ts, events, rest)| {
            let mut items = vec![ts, events];
            items.extend(rest);
            V::Array(items, false)
        });
    prop_oneof![16 => batch, 1 => value()].prop_map(|v| {
        let mut out = Vec::new();
        write(&v, &mut out);
        out
    })
}

/// A drawn payload changed once: cut short, a byte inserted or flipped, or two bytes appended
/// after it.
pub(crate) fn changed_payload() -> impl Strategy<Value = Vec<u8>> {
    (payload(), any::<prop::sample::Index>(), 0u8..4, any::<u8>()).prop_map(
        |(mut bytes, at, change, byte)| {
            let i = at.index(bytes.len().max(1));
            match change {
                0 => bytes.truncate(i),
                1 => bytes.insert(i.min(bytes.len()), byte),
                // Trailing bytes after a whole payload.
                2 => bytes.extend([byte, byte]),
                _ => {
                    if let Some(b) = bytes.get_mut(i) {
                        *b ^= byte | 1;
                    }
                }
            }
            bytes
        },
    )
}
