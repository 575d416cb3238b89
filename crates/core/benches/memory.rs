//! Memory of the prefix index per million (block, worker) entries, measured with a counting
//! allocator while the whole Mooncake conversation trace is applied over 8 and 64 workers.
//!
//! `cargo bench -p kvrouter-core --bench memory`

#![allow(missing_docs)]

mod common;

use cap::Cap;
use common::*;
use kvrouter_core::index::PrefixIndex;
use std::alloc::System;

#[global_allocator]
static ALLOC: Cap<System> = Cap::new(System, usize::MAX);

fn main() {
    let trace = load_trace();
    for workers in [8u64, 64] {
        let (events, _) = engine_events(&trace, workers);
        let before = ALLOC.allocated();
        let mut index = PrefixIndex::new(BLOCK_SIZE);
        for e in &events {
            let _ = index.apply(e);
        }
        let bytes = ALLOC.allocated() - before;
        let stats = index.stats();
        let per_million = bytes as f64 / stats.entries as f64 * 1e6 / (1 << 20) as f64;
        println!(
            "workers={workers} blocks={} entries={} nodes={} live={:.1} MiB \
             => {per_million:.1} MiB per million (block, worker) entries \
             (index's own estimate {:.1} MiB)",
            stats.blocks,
            stats.entries,
            stats.nodes,
            bytes as f64 / (1 << 20) as f64,
            index.heap_bytes() as f64 / (1 << 20) as f64,
        );
        drop(index);
    }
}
