//! Prefix index benchmarks fed by the Mooncake conversation trace.
//!
//! `cargo bench -p kvrouter-core --bench index`

#![allow(missing_docs)]

mod common;

use common::*;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, WorkerId};
use kvrouter_core::index::PrefixIndex;
use std::hint::black_box;
use std::time::Duration;

fn apply(c: &mut Criterion) {
    let trace = load_trace();
    // The whole apply of engines' events (token ids), on one thread.
    apply_group(c, &trace, "index_apply", false);
    // What `serve` does under the core lock: the same events with their contents hashed ahead
    // by the ingest threads (`KvEvent::hash_contents`).
    apply_group(c, &trace, "index_apply_hashed", true);

    // What one ingest thread does before it takes the lock.
    let mut group = c.benchmark_group("event_hash_contents");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    let (events, blocks) = engine_events(&trace[..3000], 8);
    group.throughput(Throughput::Elements(blocks as u64));
    group.bench_function("blocks", |b| {
        b.iter_batched(
            || events.clone(),
            |mut events| {
                for e in &mut events {
                    e.hash_contents(BLOCK_SIZE);
                }
                events
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
}

/// Applying the first 3,000 requests' engine events to a fresh index, for 8 and 64 workers;
/// `hashed`: with their contents hashed ahead.
fn apply_group(c: &mut Criterion, trace: &[TraceRequest], name: &str, hashed: bool) {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    for workers in [8u64, 64] {
        let (mut events, blocks) = engine_events(&trace[..3000], workers);
        if hashed {
            for e in &mut events {
                e.hash_contents(BLOCK_SIZE);
            }
        }
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_with_input(
            BenchmarkId::new("workers", workers),
            &events,
            |b, events| b.iter(|| black_box(apply_all(events))),
        );
    }
    group.finish();
}

/// A fresh index with every event applied: its entry count.
fn apply_all(events: &[KvEvent]) -> usize {
    let mut index = PrefixIndex::new(BLOCK_SIZE);
    for e in events {
        let _ = index.apply(e);
    }
    index.stats().entries
}

/// The whole trace over 64 workers, plus a 2,048-block chain that workers hold to 64 different
/// depths, so a query of it crosses 64 branch points.
pub fn big_index() -> (PrefixIndex, Vec<u64>) {
    let trace = load_trace();
    let mut index = PrefixIndex::new(BLOCK_SIZE);
    let (events, _) = engine_events(&trace, 64);
    for e in &events {
        let _ = index.apply(e);
    }
    let query: Vec<u64> = (0..2048u64).map(|i| 1 << 40 | i).collect();
    for w in 0..64u64 {
        let len = (2048 * (w as usize + 1)) / 64;
        let blocks = (0..len)
            .map(|j| StoredBlock {
                engine_hash: EngineHash(chain_id(&query[..=j])),
                content: BlockContent::Tokens(block_tokens(query[j])),
            })
            .collect();
        let event = KvEvent::Stored {
            worker: WorkerId(w),
            dp_rank: 0,
            parent: None,
            blocks,
            block_size: BLOCK_SIZE,
            medium: Medium::Gpu,
            namespace: HashNamespace::none(),
        };
        index.apply(&event).unwrap();
    }
    (index, query)
}

fn find_matches(c: &mut Criterion) {
    let (index, query) = big_index();
    let stats = index.stats();
    eprintln!("index for find_matches: {stats:?}");
    let seqs = hasher().sequence_hashes(&prompt_tokens(&query));
    assert_eq!(seqs.len(), 2048);
    assert_eq!(index.find_matches(&seqs).ranks.len(), 64);
    // A long prompt from the trace itself: the longest one, padded with unseen blocks.
    let trace = load_trace();
    let longest = trace.iter().max_by_key(|r| r.blocks.len()).unwrap();
    let mut trace_query = longest.blocks.clone();
    trace_query.extend((trace_query.len() as u64..2048).map(|i| 1 << 41 | i));
    let trace_seqs = hasher().sequence_hashes(&prompt_tokens(&trace_query[..2048]));

    let mut group = c.benchmark_group("find_matches");
    group.bench_function("2048_blocks_64_branch_points", |b| {
        b.iter(|| black_box(index.find_matches(black_box(&seqs))))
    });
    group.bench_function("2048_blocks_longest_trace_prompt", |b| {
        b.iter(|| black_box(index.find_matches(black_box(&trace_seqs))))
    });
    group.finish();
}

criterion_group!(benches, apply, find_matches);
criterion_main!(benches);
