//! Decoding KV event payloads as the router's subscriber does for each message: the payload the
//! mock engine publishes for one 128-token prompt (one `BlockStored` of 8 blocks of 16 tokens,
//! in vLLM's map form, what every request of issue 15's realistic case costs the router), and
//! a 1,024-block batch (stored, then removed) as a busy engine publishes; decoded alone and
//! decoded then converted to the core's events.
//!
//! `cargo bench -p kvrouter-kv-wire --bench decode`

#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, WorkerId};
use kvrouter_kv_wire::{
    decode_payload, encode_payload, from_kv_events, to_kv_events, ConvertOptions,
};
use std::hint::black_box;

const BLOCK: u32 = 16;

/// A payload storing `blocks` blocks (a chain after a parent), and removing them when `remove`.
fn payload(blocks: u64, remove: bool) -> Vec<u8> {
    let stored = KvEvent::Stored {
        worker: WorkerId(0),
        dp_rank: 0,
        parent: Some(EngineHash(7)),
        blocks: (0..blocks)
            .map(|b| StoredBlock {
                engine_hash: EngineHash(0x9e37_79b9_7f4a_7c15 ^ b.wrapping_mul(0xff51_afd7)),
                content: BlockContent::Tokens(
                    (0..BLOCK)
                        .map(|t| (b as u32 * BLOCK + t) % 32_000)
                        .collect(),
                ),
            })
            .collect(),
        block_size: BLOCK as usize,
        medium: Medium::Gpu,
        namespace: HashNamespace::default(),
    };
    let mut events = vec![stored];
    if remove {
        events.push(KvEvent::Removed {
            worker: WorkerId(0),
            dp_rank: 0,
            engine_hashes: (0..blocks)
                .map(|b| EngineHash(0x9e37_79b9_7f4a_7c15 ^ b.wrapping_mul(0xff51_afd7)))
                .collect(),
            medium: Medium::Gpu,
        });
    }
    encode_payload(&from_kv_events(1.7e9, 0, &events).expect("encodable"))
}

fn bench(c: &mut Criterion) {
    let opts = ConvertOptions {
        worker: WorkerId(0),
        default_dp_rank: 0,
    };
    let mut g = c.benchmark_group("kv_payload");
    for (name, bytes) in [
        ("prompt_128_tokens", payload(8, false)),
        ("busy_1024_blocks", payload(1024, true)),
    ] {
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function(format!("decode/{name}"), |b| {
            b.iter(|| decode_payload(black_box(&bytes)).expect("decodes"))
        });
        g.bench_function(format!("decode_convert/{name}"), |b| {
            b.iter(|| {
                let batch = decode_payload(black_box(&bytes)).expect("decodes");
                to_kv_events(&batch, opts)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
