//! The `cost` policy's decision: `Router::route()` for a 2,048-block (131k-token) prompt over 64
//! workers with the trace-fed index and 256 requests in flight (target ≤ 25 µs, issue 16), beside
//! `kv` on the same state.
//!
//! `cargo bench -p kvrouter-core --bench cost`

#![allow(missing_docs)]

mod common;

use common::*;
use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{RouteRequest, Router, RouterConfig, WorkerSpec};
use kvrouter_core::time::Time;
use std::hint::black_box;

const BLOCKS: usize = 2048;

fn router(mode: RouterMode, trace: &[TraceRequest]) -> Router {
    let config = RouterConfig {
        router_mode: mode,
        kv_cache_block_size: BLOCK_SIZE,
        ..RouterConfig::default()
    };
    let mut router = Router::new(config).unwrap();
    for w in 0..64 {
        let mut spec = WorkerSpec::new(WorkerId(w));
        spec.kv_capacity_blocks = Some(16_384);
        spec.max_num_batched_tokens = Some(8_192);
        router.add_worker(spec).unwrap();
    }
    let (events, _) = engine_events(trace, 64);
    for e in &events {
        let _ = router.apply_event(e);
    }
    // Load: 256 trace requests in flight (ids far above the benchmark's).
    for (i, r) in trace.iter().take(256).enumerate() {
        let tokens = prompt_tokens(&r.blocks);
        let req = RouteRequest::new(
            RequestId(1 << 40 | i as u64),
            tokens.len() as u64,
            hasher().hash_blocks(&tokens),
        );
        router.route(&req, Time::ZERO).unwrap();
    }
    router
}

fn cost(c: &mut Criterion) {
    let trace = load_trace();
    let mut blocks = trace
        .iter()
        .max_by_key(|r| r.blocks.len())
        .unwrap()
        .blocks
        .clone();
    blocks.truncate(BLOCKS);
    blocks.extend((blocks.len() as u64..BLOCKS as u64).map(|i| 1 << 42 | i));
    let tokens = prompt_tokens(&blocks);
    let hashed = hasher().hash_blocks(&tokens);
    assert_eq!(hashed.len(), BLOCKS);

    let mut group = c.benchmark_group("route_64_workers_2048_blocks");
    for (name, mode) in [("cost", RouterMode::Cost), ("kv", RouterMode::Kv)] {
        let mut r = router(mode, &trace);
        let mut id = 0u64;
        group.bench_function(format!("{name}/prehashed"), |b| {
            b.iter(|| {
                id += 1;
                black_box(route_and_finish(&mut r, id, tokens.len() as u64, &hashed))
            })
        });
    }
    group.finish();
}

/// The deep-queue case: 64 workers with 256 requests each in flight, every request behind one
/// 16-block system prompt (then 112 blocks of its own); the routed prompt shares only the system
/// prompt. Load structures that compare a prompt with each request on a worker pay here.
fn deep_queues(c: &mut Criterion) {
    let system: Vec<u64> = (0..16).map(|i| 1 << 43 | i).collect();
    let prompt = |n: u64, len: u64| -> Vec<u64> {
        let mut b = system.clone();
        b.extend((0..len).map(|j| 1 << 44 | n << 16 | j));
        b
    };
    let tokens = prompt_tokens(&prompt(1 << 20, BLOCKS as u64 - 16));
    let hashed = hasher().hash_blocks(&tokens);
    let mut group = c.benchmark_group("route_64_workers_16k_in_flight_shared_system_prompt");
    for (name, mode) in [("cost", RouterMode::Cost), ("kv", RouterMode::Kv)] {
        let mut r = router(mode, &[]);
        for n in 0..64 * 256u64 {
            let t = prompt_tokens(&prompt(n, 112));
            let req = RouteRequest::new(
                RequestId(1 << 41 | n),
                t.len() as u64,
                hasher().hash_blocks(&t),
            );
            r.route(&req, Time::ZERO).unwrap();
        }
        let mut id = 0u64;
        group.bench_function(name, |b| {
            b.iter(|| {
                id += 1;
                black_box(route_and_finish(&mut r, id, tokens.len() as u64, &hashed))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, cost, deep_queues);
criterion_main!(benches);
