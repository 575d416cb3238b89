//! `Router::route()` end to end with 64 workers and the trace-fed index.
//!
//! `cargo bench -p kvrouter-core --bench route`

#![allow(missing_docs)]

mod common;

/// jemalloc, as the `kvrouter` binary runs the router (glibc's malloc would weigh the request's
/// chain copies several times more than they cost there).
#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use common::*;
use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{RouteRequest, Router, RouterConfig, WorkerSpec};
use kvrouter_core::time::Time;
use std::hint::black_box;

fn router(mode: RouterMode, predicted: Option<f64>) -> Router {
    let config = RouterConfig {
        router_mode: mode,
        kv_cache_block_size: BLOCK_SIZE,
        router_predicted_ttl_secs: predicted,
        ..RouterConfig::default()
    };
    let mut router = Router::new(config).unwrap();
    for w in 0..64 {
        router.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let trace = load_trace();
    let (events, _) = engine_events(&trace, 64);
    for e in &events {
        let _ = router.apply_event(e);
    }
    router
}

fn route(c: &mut Criterion) {
    let trace = load_trace();
    // A 32k-token prompt: a trace prompt's blocks, extended with fresh blocks.
    let (tokens, hashed) = long_trace_prompt(&trace, 512);
    assert_eq!(tokens.len(), 32 * 1024);

    let mut group = c.benchmark_group("route_64_workers_32k_tokens");
    for (name, mode, predicted) in [
        ("kv", RouterMode::Kv, None),
        ("kv_predicted_5s", RouterMode::Kv, Some(5.0)),
        ("round_robin", RouterMode::RoundRobin, None),
    ] {
        let mut r = router(mode, predicted);
        let mut id = 0u64;
        group.bench_function(format!("{name}/prehashed"), |b| {
            b.iter(|| {
                id += 1;
                black_box(route_and_finish(&mut r, id, tokens.len() as u64, &hashed))
            })
        });
        group.bench_function(format!("{name}/hashing_included"), |b| {
            b.iter(|| {
                id += 1;
                let req = RouteRequest::new(
                    RequestId(id),
                    tokens.len() as u64,
                    hasher().hash_blocks(black_box(&tokens)),
                );
                let d = r.route(&req, Time::from_micros(id)).unwrap();
                let _ = r.finish(RequestId(id), Time::from_micros(id)).unwrap();
                black_box(d.rank)
            })
        });
    }
    group.finish();
}

/// Approximate mode (workers that publish no KV events): every decision inserts its prompt's
/// blocks into the predicted index and the ones older than the TTL expire, so a steady stream of
/// long prompts pays both on every route. 2,048-block prompts (64 shared, the rest new), ten a
/// second of simulated time against the default 120 s TTL: more than the default cap of 2^20
/// (block, rank) entries, so the index runs at its cap (~500 prompts), as a busy router with
/// long prompts does.
fn route_approx(c: &mut Criterion) {
    const BLOCKS: u64 = 2048;
    const PROMPTS: u64 = 1000;
    let prompts: Vec<_> = (0..PROMPTS)
        .map(|p| {
            let ids: Vec<u64> = (0..BLOCKS)
                .map(|b| if b < 64 { b } else { (p + 1) << 32 | b })
                .collect();
            hasher().hash_blocks(&prompt_tokens(&ids))
        })
        .collect();
    let config = RouterConfig {
        router_mode: RouterMode::Kv,
        kv_cache_block_size: BLOCK_SIZE,
        router_kv_events: false,
        ..RouterConfig::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..8 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let mut id = 0u64;
    let mut step = |r: &mut Router| {
        id += 1;
        let blocks = &prompts[(id % PROMPTS) as usize];
        let req = RouteRequest::new(RequestId(id), BLOCKS * BLOCK_SIZE as u64, blocks.clone());
        let now = Time::from_millis(id * 100);
        let d = r.route(&req, now).unwrap();
        let _ = r.finish(RequestId(id), now).unwrap();
        d.rank
    };
    // Fill the index to its steady state before timing.
    for _ in 0..2 * PROMPTS {
        step(&mut r);
    }
    c.bench_function("route_approx_8_workers_2048_blocks/steady", |b| {
        b.iter(|| black_box(step(&mut r)))
    });
}

criterion_group!(benches, route, route_approx);
criterion_main!(benches);
