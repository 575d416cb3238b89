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

/// jemalloc, as the `kvrouter` binary runs the router (glibc's malloc would weigh the request's
/// chain copies several times more than they cost there).
#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use common::*;
use kvrouter_core::policy::RouterMode;
use std::process::ExitCode;

/// The benchmark's prompt length in blocks.
const BLOCKS: usize = 2048;

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
    let standard = |mode| {
        let trace = load_trace();
        let (tokens, hashed) = long_trace_prompt(&trace, BLOCKS);
        (cost_bench_router(mode, &trace), tokens.len() as u64, hashed)
    };
    let (mut r, isl, hashes) = match args.first().map(String::as_str) {
        Some("cost") => standard(RouterMode::Cost),
        Some("kv") => standard(RouterMode::Kv),
        Some("deep-cost") => deep_queue_state(RouterMode::Cost, BLOCKS),
        Some("deep-kv") => deep_queue_state(RouterMode::Kv, BLOCKS),
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
