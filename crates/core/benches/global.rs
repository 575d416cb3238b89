//! Global routing: cluster summary size, build time, measured false-positive rate and
//! estimated-hit error for 1 M and 10 M cached blocks; the global decision for a 2,048-block
//! prompt over 4 clusters.
//!
//! `cargo bench -p kvrouter-core --bench global`

#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::global::{
    ClusterLoad, ClusterSpec, ClusterSummary, GlobalConfig, GlobalRequest, GlobalRouter,
    PrefixSketch, SketchConfig, SummaryOptions,
};
use kvrouter_core::hashing::{BlockHashes, HashNamespace};
use kvrouter_core::ids::{ContentHash, EngineHash, SequenceHash, WorkerId};
use kvrouter_core::rng::{mix64, SeededRng};
use kvrouter_core::router::{Router, RouterConfig, WorkerSpec};
use kvrouter_core::time::Time;
use std::hint::black_box;

const BLOCK: usize = 16;
/// Blocks per cached chain (a session's context) and per shared group prefix.
const CHAIN: usize = 500;
const GROUP_PREFIX: usize = 128;
const PER_GROUP: usize = 16;

/// Content hashes of chain `c`: a prefix shared by its group of 16, then its own blocks.
fn chain_content(c: usize, len: usize) -> Vec<ContentHash> {
    let group = (c / PER_GROUP) as u64;
    (0..len)
        .map(|d| {
            let owner = if d < GROUP_PREFIX {
                group | 1 << 40
            } else {
                c as u64
            };
            ContentHash(mix64(owner ^ mix64(d as u64)))
        })
        .collect()
}

fn chain_seq(c: usize, len: usize) -> Vec<SequenceHash> {
    BlockHashes::from_content(chain_content(c, len)).sequence
}

/// Checkpoint and run-end keys of `blocks` cached blocks (as `PrefixIndex::checkpoint_keys`
/// gives them), computed straight from the chains.
fn keys_for(blocks: usize, k: usize) -> Vec<SequenceHash> {
    let chains = blocks / (CHAIN - GROUP_PREFIX + GROUP_PREFIX / PER_GROUP);
    let mut keys = Vec::new();
    for c in 0..chains {
        let seq = chain_seq(c, CHAIN);
        let start = if c % PER_GROUP == 0 { 0 } else { GROUP_PREFIX };
        for (d, h) in seq.iter().enumerate().skip(start) {
            if (d + 1) % k == 0 || d + 1 == CHAIN || d + 1 == GROUP_PREFIX {
                keys.push(*h);
            }
        }
    }
    keys
}

fn sketch(keys: &[SequenceHash]) -> PrefixSketch {
    let mut s = PrefixSketch::with_capacity(SketchConfig::default(), keys.len()).unwrap();
    keys.iter().for_each(|k| s.insert(*k));
    s
}

fn report(label: &str, blocks: usize) -> PrefixSketch {
    let keys = keys_for(blocks, 16);
    let s = sketch(&keys);
    let probes = 1_000_000u64;
    let fp = (0..probes)
        .filter(|i| s.contains(SequenceHash(mix64(i ^ 0xabcdef))))
        .count();
    // Estimated-hit error: prompts that share a random prefix of a cached chain.
    let chains = blocks / (CHAIN - GROUP_PREFIX + GROUP_PREFIX / PER_GROUP);
    let mut rng = SeededRng::new(1);
    let (mut err, mut over, n) = (0u64, 0u64, 2000u64);
    for _ in 0..n {
        let c = (rng.next_u64() % chains as u64) as usize;
        let shared = (rng.next_u64() % CHAIN as u64) as usize;
        let mut content = chain_content(c, shared);
        content.extend((0..64).map(|j| ContentHash(mix64(rng.next_u64() ^ j))));
        let p = BlockHashes::from_content(content).sequence;
        let est = s.cached_prefix_blocks(&p);
        err += shared.abs_diff(est) as u64;
        over += u64::from(est > shared);
    }
    eprintln!(
        "{label}: {} keys, filter {} KiB ({:.1} bits/key), measured FP rate {:.4} %, \
         hit estimate: mean |error| {:.2} blocks, over-estimates {:.2} %",
        keys.len(),
        s.filter_bytes() / 1024,
        s.filter_bytes() as f64 * 8.0 / keys.len() as f64,
        fp as f64 / probes as f64 * 100.0,
        err as f64 / n as f64,
        over as f64 / n as f64 * 100.0,
    );
    s
}

fn summary_build(c: &mut Criterion) {
    let mut g = c.benchmark_group("summary_build");
    g.sample_size(10);
    for (label, blocks) in [("1M", 1_000_000), ("10M", 10_000_000)] {
        report(label, blocks);
        let keys = keys_for(blocks, 16);
        g.bench_function(format!("sketch_from_keys/{label}"), |b| {
            b.iter(|| black_box(sketch(&keys)))
        });
    }
    // The real path at 1 M: a router's index with 8 workers, Router::cluster_summary.
    let mut router = Router::new(RouterConfig {
        kv_cache_block_size: BLOCK,
        ..RouterConfig::default()
    })
    .unwrap();
    for w in 0..8 {
        router.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let chains = 1_000_000 / (CHAIN - GROUP_PREFIX + GROUP_PREFIX / PER_GROUP);
    for c in 0..chains {
        let w = (c % 8) as u64;
        let event = KvEvent::Stored {
            worker: WorkerId(w),
            dp_rank: 0,
            parent: None,
            blocks: chain_content(c, CHAIN)
                .into_iter()
                .enumerate()
                .map(|(d, h)| StoredBlock {
                    engine_hash: EngineHash(mix64(c as u64) ^ d as u64),
                    content: BlockContent::Hash(h),
                })
                .collect(),
            block_size: BLOCK,
            medium: Medium::Gpu,
            namespace: HashNamespace::none(),
        };
        router.apply_event(&event).unwrap();
    }
    let options = SummaryOptions {
        name: "dc".into(),
        sequence: 1,
        sketch: SketchConfig::default(),
        prefill_tokens_per_s: 10_000.0,
        decode_ms_per_token: 10.0,
        decode_ms_per_token_per_seq: 0.0,
        max_running_requests: 0,
    };
    let s = router.cluster_summary(&options, Time::ZERO).unwrap();
    eprintln!(
        "router 1M: index {} blocks, summary {} bytes encoded",
        router.index().stats().blocks,
        s.encoded_len()
    );
    g.bench_function("router_cluster_summary/1M", |b| {
        b.iter(|| black_box(router.cluster_summary(&options, Time::ZERO).unwrap()))
    });
    g.bench_function("encode/1M", |b| b.iter(|| black_box(s.to_bytes())));
    let bytes = s.to_bytes();
    g.bench_function("decode/1M", |b| {
        b.iter(|| black_box(ClusterSummary::from_bytes(&bytes).unwrap()))
    });
    g.finish();
}

fn global_route(c: &mut Criterion) {
    let base = report("decision sketch 1M", 1_000_000);
    let mut router = GlobalRouter::new(GlobalConfig::default(), BLOCK as u32).unwrap();
    // The prompt: chain 0's 500 blocks then fresh ones to 2,048. Cluster 0 holds it (in its
    // 1 M-block sketch); the others hold other chains.
    let mut content = chain_content(0, CHAIN);
    content.extend((0..2048 - CHAIN as u64).map(|j| ContentHash(mix64(j ^ 77))));
    let prompt = BlockHashes::from_content(content).sequence;
    for dc in 0..4 {
        let id = router
            .add_cluster(ClusterSpec {
                name: format!("dc{dc}"),
                rtt_ms: 20.0 * dc as f64,
                weight: 1.0,
            })
            .unwrap();
        let mut sketch = base.clone();
        if dc > 0 {
            sketch = self::sketch(&keys_for(1_000_000 / 4, 16)[1000..]);
        }
        let summary = ClusterSummary {
            name: format!("dc{dc}"),
            built_at: Time::ZERO,
            sequence: 1,
            block_size: BLOCK as u32,
            sketch,
            load: ClusterLoad {
                workers: 8,
                active_prefill_tokens: 10_000 * dc,
                prefill_tokens_per_s: 10_000.0,
                decode_ms_per_token: 10.0,
                ..ClusterLoad::default()
            },
        };
        router.update_summary(id, summary, Time::ZERO).unwrap();
    }
    c.bench_function("global_route/sketch_prefix_2048_one_cluster", |b| {
        b.iter(|| black_box(base.cached_prefix_blocks(black_box(&prompt))))
    });
    let req = GlobalRequest {
        session: None,
        blocks: &prompt,
        input_tokens: 2048 * BLOCK as u64,
        output_tokens_hint: None,
        model: None,
    };
    c.bench_function("global_route/estimates_2048_blocks_4_clusters", |b| {
        b.iter(|| black_box(router.estimates(&req, Time::from_millis(1))))
    });
    let mut session = 0u64;
    c.bench_function("global_route/2048_blocks_4_clusters", |b| {
        b.iter(|| {
            session += 1;
            let req = GlobalRequest {
                session: Some(session % 1000),
                blocks: &prompt,
                input_tokens: 2048 * BLOCK as u64,
                output_tokens_hint: None,
                model: None,
            };
            black_box(router.route(&req, Time::from_millis(1)).unwrap())
        })
    });
}

criterion_group!(benches, summary_build, global_route);
criterion_main!(benches);
