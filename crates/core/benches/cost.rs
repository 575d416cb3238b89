//! The `cost` policy's decision: `Router::route()` for a 2,048-block (131k-token) prompt over 64
//! workers with the trace-fed index and 256 requests in flight (target ≤ 25 µs, issue 16), beside
//! `kv` on the same state.
//!
//! `cargo bench -p kvrouter-core --bench cost`

#![allow(missing_docs)]

mod common;

/// jemalloc, as the `kvrouter` binary runs the router (glibc's malloc would weigh the request's
/// chain copies several times more than they cost there).
#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use common::*;
use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter_core::policy::RouterMode;
use std::hint::black_box;

const BLOCKS: usize = 2048;

fn cost(c: &mut Criterion) {
    let trace = load_trace();
    let (tokens, hashed) = long_trace_prompt(&trace, BLOCKS);
    let isl = tokens.len() as u64;
    let mut group = c.benchmark_group("route_64_workers_2048_blocks");
    for (name, mode) in [("cost", RouterMode::Cost), ("kv", RouterMode::Kv)] {
        let mut r = cost_bench_router(mode, &trace);
        let mut id = 0u64;
        group.bench_function(format!("{name}/prehashed"), |b| {
            b.iter(|| {
                id += 1;
                black_box(route_and_finish(&mut r, id, isl, &hashed))
            })
        });
    }
    // Every request a turn of one of 4,096 sessions, each then resident on its worker for the
    // window (20 s; the bench's clock moves 1 µs a request): the resident bookkeeping's cost.
    let mut r = cost_bench_router(RouterMode::Cost, &trace);
    let mut id = 0u64;
    group.bench_function("cost/prehashed_sessions", |b| {
        b.iter(|| {
            id += 1;
            black_box(route_and_finish_in(
                &mut r,
                id,
                Some(id % 4096),
                isl,
                &hashed,
            ))
        })
    });
    group.finish();
}

/// The deep-queue case: 64 workers with 256 requests each in flight, every request behind one
/// 16-block system prompt (then 112 blocks of its own); the routed prompt shares only the system
/// prompt. Load structures that compare a prompt with each request on a worker pay here.
fn deep_queues(c: &mut Criterion) {
    let mut group = c.benchmark_group("route_64_workers_16k_in_flight_shared_system_prompt");
    for (name, mode) in [("cost", RouterMode::Cost), ("kv", RouterMode::Kv)] {
        let (mut r, isl, hashed) = deep_queue_state(mode, BLOCKS);
        let mut id = 0u64;
        group.bench_function(name, |b| {
            b.iter(|| {
                id += 1;
                black_box(route_and_finish(&mut r, id, isl, &hashed))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, cost, deep_queues);
criterion_main!(benches);
