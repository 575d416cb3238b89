//! Prometheus text for the mock engine.

use crate::config::MockEngineConfig;
use crate::driver::{Shared, LATENESS_BUCKETS_MS};
use std::fmt::Write;

pub(crate) fn render(shared: &Shared, config: &MockEngineConfig) -> String {
    let snap = shared.snapshot.lock().expect("snapshot lock");
    let s = &snap.stats;
    let mut out = String::with_capacity(2048);
    let model = &config.model_name;
    let mut gauge = |name: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model=\"{model}\"}} {value}"
        );
    };
    gauge(
        "kvrouter_mock_running_requests",
        "Requests running in the engine.",
        s.running as f64,
    );
    gauge(
        "kvrouter_mock_waiting_requests",
        "Requests waiting (new or preempted).",
        s.waiting as f64,
    );
    let usage = if s.capacity_blocks == 0 {
        0.0
    } else {
        s.used_blocks as f64 / s.capacity_blocks as f64
    };
    gauge(
        "kvrouter_mock_kv_usage_ratio",
        "Fraction of KV blocks in use by requests.",
        usage,
    );
    gauge(
        "kvrouter_mock_kv_cached_blocks",
        "Blocks holding cached prefixes.",
        s.cached_blocks as f64,
    );
    let hit = if s.prompt_tokens_total == 0 {
        0.0
    } else {
        s.cached_tokens_total as f64 / s.prompt_tokens_total as f64
    };
    gauge(
        "kvrouter_mock_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache, over all prompt tokens.",
        hit,
    );
    let mut counter = |name: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{model=\"{model}\"}} {value}"
        );
    };
    counter(
        "kvrouter_mock_prompt_tokens_total",
        "Prompt tokens admitted.",
        s.prompt_tokens_total,
    );
    counter(
        "kvrouter_mock_cached_tokens_total",
        "Prompt tokens served from the prefix cache.",
        s.cached_tokens_total,
    );
    counter(
        "kvrouter_mock_preemptions_total",
        "Requests preempted for lack of KV blocks.",
        s.preemptions_total,
    );
    counter(
        "kvrouter_mock_requests_finished_total",
        "Requests finished.",
        s.finished_total,
    );
    counter("kvrouter_mock_steps_total", "Engine steps run.", snap.steps);
    counter(
        "kvrouter_mock_kv_event_batches_total",
        "KV event batches queued for publishing.",
        snap.kv_batches_published,
    );
    counter(
        "kvrouter_mock_kv_event_batches_dropped_total",
        "KV event batches dropped because the publisher's queue was full (their sequence numbers are skipped).",
        snap.kv_batches_dropped,
    );
    let name = "kvrouter_mock_step_lateness_seconds";
    let _ = writeln!(out, "# HELP {name} How late each step's outputs were delivered against the timing model.\n# TYPE {name} histogram");
    let mut cumulative = 0;
    for (i, le) in LATENESS_BUCKETS_MS.iter().enumerate() {
        cumulative += snap.lateness_counts[i];
        let _ = writeln!(
            out,
            "{name}_bucket{{model=\"{model}\",le=\"{}\"}} {cumulative}",
            le / 1e3
        );
    }
    cumulative += snap.lateness_counts[LATENESS_BUCKETS_MS.len()];
    let _ = writeln!(
        out,
        "{name}_bucket{{model=\"{model}\",le=\"+Inf\"}} {cumulative}"
    );
    let _ = writeln!(
        out,
        "{name}_sum{{model=\"{model}\"}} {}",
        snap.lateness_sum_ms / 1e3
    );
    let _ = writeln!(out, "{name}_count{{model=\"{model}\"}} {cumulative}");
    out
}
