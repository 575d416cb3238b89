//! The `/metrics` page: the server's metric families ([`crate::metrics`]), replica sync's, and
//! what is read from the routing core at scrape time (per-rank load, cached blocks, evictions,
//! the queue, the update cycle), the planner's and the tokenizer cache's.

use crate::metrics::{counter_header, gauge_header};
use crate::state::AppState;
use std::fmt::Write;

/// The whole page, with `--metrics-prefix` applied.
pub(crate) fn render(s: &AppState) -> String {
    let inner = &s.inner;
    let mut out = String::with_capacity(8192);
    inner.metrics.render(&mut out);
    crate::replica::render(s, &mut out);
    let core = inner.lock_core();
    let ranks = core.ranks().to_vec();
    for (name, help, pick) in [
        (
            "kvrouter_worker_active_requests",
            "Requests active on a worker rank.",
            0usize,
        ),
        (
            "kvrouter_worker_active_prefill_tokens",
            "Uncached prompt tokens not yet past their first token.",
            1,
        ),
        (
            "kvrouter_worker_active_decode_blocks",
            "Distinct KV blocks held by active requests.",
            2,
        ),
    ] {
        gauge_header(&mut out, name, help);
        for r in &ranks {
            let l = core.load(*r);
            let v = [
                u64::from(l.active_requests),
                l.active_prefill_tokens,
                l.active_decode_blocks,
            ][pick];
            let _ = writeln!(
                out,
                "{name}{{worker=\"{}\",dp_rank=\"{}\"}} {v}",
                r.worker, r.dp_rank
            );
        }
    }
    gauge_header(
        &mut out,
        "kvrouter_worker_cached_blocks",
        "Blocks the index believes a worker rank holds, by tier.",
    );
    for (rank, medium, n) in core.index().holder_counts() {
        let tier = medium.engine_name();
        let _ = writeln!(
            out,
            "kvrouter_worker_cached_blocks{{worker=\"{}\",dp_rank=\"{}\",medium=\"{tier}\"}} {n}",
            rank.worker, rank.dp_rank
        );
    }
    counter_header(
        &mut out,
        "kvrouter_index_evictions_total",
        "Blocks the index evicted to keep a worker within its capacity (kv_capacity_blocks or --router-index-max-blocks-per-worker).",
    );
    for (worker, n) in core.index().evictions() {
        let _ = writeln!(
            out,
            "kvrouter_index_evictions_total{{worker=\"{worker}\"}} {n}"
        );
    }
    let q = core.queue_stats();
    let update = core.update_status();
    let newest_version = core.newest_policy_version();
    drop(core);
    crate::update_metrics::render(&mut out, update.as_ref(), newest_version);
    gauge_header(
        &mut out,
        "kvrouter_router_queue_pending_requests",
        "Requests waiting in the router queue.",
    );
    let _ = writeln!(
        out,
        "kvrouter_router_queue_pending_requests {}",
        q.pending_requests
    );
    gauge_header(
        &mut out,
        "kvrouter_router_queue_pending_isl_tokens",
        "Prompt tokens of requests waiting in the router queue.",
    );
    let _ = writeln!(
        out,
        "kvrouter_router_queue_pending_isl_tokens {}",
        q.pending_isl_tokens
    );
    if let Some(planner) = &inner.planner {
        planner.render(&mut out, "kvrouter_");
    }
    if let Some(act) = &inner.planner_act {
        act.render(&mut out, "kvrouter_");
    }
    let t = inner.tokenizer.stats();
    let _ = writeln!(out, "# HELP kvrouter_tokenizer_cache_segments_total Prompt segments tokenized or served from the cache.\n# TYPE kvrouter_tokenizer_cache_segments_total counter");
    let _ = writeln!(out, "kvrouter_tokenizer_cache_segments_total{{result=\"hit\"}} {}\nkvrouter_tokenizer_cache_segments_total{{result=\"miss\"}} {}", t.hits, t.misses);
    let prefix = inner.config.metrics_prefix.as_str();
    if prefix != "kvrouter_" {
        out = crate::metrics::with_prefix(&out, prefix);
    }
    out
}
