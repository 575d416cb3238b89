//! Routes the cost bench's prompts through its states a fixed number of times and prints a
//! hash of the placements: a deterministic workload for counting instructions per decision
//! (timing on a shared host is too noisy for before/after figures; see docs/routing.md):
//!
//! ```text
//! cargo build --release -p kvrouter-core --example decisions
//! valgrind --tool=callgrind --toggle-collect='decisions::common::route_and_finish' \
//!     target/release/examples/decisions cost 3000
//! ```
//!
//! Modes: `cost`, `kv` (the bench's 64 workers, trace-fed index, 256 requests in flight) and
//! `deep-cost`, `deep-kv` (16k requests in flight behind one system prompt). Instructions per
//! decision = the inclusive count of `route_and_finish` / calls.

#[path = "../benches/common/mod.rs"]
mod common;

use common::*;
use kvrouter_core::hashing::BlockHashes;
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{RouteRequest, Router, RouterConfig, WorkerSpec};
use kvrouter_core::time::Time;
use std::process::ExitCode;

/// The benchmark's prompt length in blocks.
const BLOCKS: usize = 2048;

/// The cost bench's router: 64 workers, the trace's events, 256 trace requests in flight.
fn router(mode: RouterMode, trace: &[TraceRequest]) -> Router {
    let config = RouterConfig {
        router_mode: mode,
        kv_cache_block_size: BLOCK_SIZE,
        ..RouterConfig::default()
    };
    let mut router = Router::new(config).expect("a valid config");
    for w in 0..64 {
        let mut spec = WorkerSpec::new(WorkerId(w));
        spec.kv_capacity_blocks = Some(16_384);
        spec.max_num_batched_tokens = Some(8_192);
        router.add_worker(spec).expect("a new worker");
    }
    let (events, _) = engine_events(trace, 64);
    for e in &events {
        let _ = router.apply_event(e);
    }
    for (i, r) in trace.iter().take(256).enumerate() {
        let tokens = prompt_tokens(&r.blocks);
        let req = RouteRequest::new(
            RequestId(1 << 40 | i as u64),
            tokens.len() as u64,
            hasher().hash_blocks(&tokens),
        );
        router.route(&req, Time::ZERO).expect("a placement");
    }
    router
}

/// The cost bench's standard case: its longest trace prompt, cut or padded to 2,048 blocks.
fn standard(mode: RouterMode) -> (Router, u64, BlockHashes) {
    let trace = load_trace();
    let mut blocks = trace
        .iter()
        .max_by_key(|r| r.blocks.len())
        .expect("a trace request")
        .blocks
        .clone();
    blocks.truncate(BLOCKS);
    blocks.extend((blocks.len() as u64..BLOCKS as u64).map(|i| 1 << 42 | i));
    let tokens = prompt_tokens(&blocks);
    (
        router(mode, &trace),
        tokens.len() as u64,
        hasher().hash_blocks(&tokens),
    )
}

/// The cost bench's deep-queue case: 16k requests in flight behind one 16-block system prompt.
fn deep(mode: RouterMode) -> (Router, u64, BlockHashes) {
    let system: Vec<u64> = (0..16).map(|i| 1 << 43 | i).collect();
    let prompt = |n: u64, len: u64| -> Vec<u64> {
        let mut b = system.clone();
        b.extend((0..len).map(|j| 1 << 44 | n << 16 | j));
        b
    };
    let mut r = router(mode, &[]);
    for n in 0..64 * 256u64 {
        let t = prompt_tokens(&prompt(n, 112));
        let req = RouteRequest::new(
            RequestId(1 << 41 | n),
            t.len() as u64,
            hasher().hash_blocks(&t),
        );
        r.route(&req, Time::ZERO).expect("a placement");
    }
    let tokens = prompt_tokens(&prompt(1 << 20, BLOCKS as u64 - 16));
    (r, tokens.len() as u64, hasher().hash_blocks(&tokens))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let calls: u64 = match args.get(1).map(|s| s.parse()) {
        None => 3000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("CALLS must be a positive integer");
            return ExitCode::from(2);
        }
    };
    let (mut r, isl, hashes) = match args.first().map(String::as_str) {
        Some("cost") => standard(RouterMode::Cost),
        Some("kv") => standard(RouterMode::Kv),
        Some("deep-cost") => deep(RouterMode::Cost),
        Some("deep-kv") => deep(RouterMode::Kv),
        _ => {
            eprintln!("usage: decisions cost|kv|deep-cost|deep-kv [CALLS]");
            return ExitCode::from(2);
        }
    };
    let mut placements = 0u64;
    for id in 1..=calls {
        let rank = route_and_finish(&mut r, id, isl, &hashes);
        placements = placements
            .wrapping_mul(1_000_003)
            .wrapping_add(rank.worker.0 * 64 + u64::from(rank.dp_rank));
    }
    println!("{calls} decisions, placements hash {placements:016x}");
    ExitCode::SUCCESS
}
