//! Engine steps in virtual time: request-steps per second with a full batch decoding.
//!
//! `cargo bench -p kvrouter-engine`

#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::{RequestId, WorkerId, WorkerRank};
use kvrouter_core::time::Time;
use kvrouter_engine::{DynamoPoly, Engine, EngineConfig, EngineRequest, Prompt};
use std::hint::black_box;

const SEQS: u64 = 256;
const STEPS: u64 = 200;

fn loaded_engine(tokens_mode: bool) -> (Engine, Time) {
    let config = EngineConfig::default();
    let mut e = Engine::new(
        config,
        WorkerRank::new(WorkerId(0), 0),
        Box::new(DynamoPoly),
    );
    let hasher = BlockHasher::new(64, &HashNamespace::none());
    for i in 0..SEQS {
        // A shared 256-token system prompt and 256 tokens of its own.
        let tokens: Vec<u32> = (0..256)
            .chain((0..256).map(|t| 10_000 + i as u32 * 512 + t))
            .collect();
        let prompt = if tokens_mode {
            Prompt::tokens(tokens)
        } else {
            Prompt::Blocks {
                blocks: hasher.hash_blocks(&tokens),
                len_tokens: 512,
            }
        };
        e.add_request(EngineRequest {
            id: RequestId(i),
            prompt,
            max_output_tokens: 100_000,
        })
        .unwrap();
    }
    // Run the prefills so that every request decodes.
    let mut now = Time::ZERO;
    while e.stats().running < SEQS as usize {
        now = e.step(now).unwrap().unwrap().end;
    }
    for _ in 0..8 {
        now = e.step(now).unwrap().unwrap().end;
    }
    (e, now)
}

fn steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine_decode_steps");
    group.throughput(Throughput::Elements(SEQS * STEPS));
    for (name, tokens_mode) in [("trace_hashes", false), ("token_ids", true)] {
        group.bench_function(format!("{name}/256_seqs_x_200_steps"), |b| {
            b.iter_batched(
                || loaded_engine(tokens_mode),
                |(mut e, mut now)| {
                    for _ in 0..STEPS {
                        let out = e.step(now).unwrap().unwrap();
                        now = out.end;
                        black_box(&out.tokens);
                    }
                    e
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, steps);
criterion_main!(benches);
