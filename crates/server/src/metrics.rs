//! Prometheus metrics in text format, `kvrouter_` prefix (`--metrics-prefix` renames it at the
//! end, [`with_prefix`]). Labels are bounded: status, mode, model (a served model), event type,
//! worker id; never request, session or policy ids.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

mod by_model;

pub(crate) use by_model::{ByModel, ModelMetrics};
#[cfg(test)]
pub(crate) use by_model::{MAX_MODEL_LABELS, MAX_MODEL_LABEL_BYTES, OTHER_MODELS};

/// Buckets for durations: from 100 µs (router overhead) to a minute (long generations).
pub(crate) const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];
/// Buckets for token counts.
pub(crate) const TOKENS: &[f64] = &[
    16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
];
/// Buckets for ratios.
pub(crate) const RATIO: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// A fixed-bucket histogram.
#[derive(Debug)]
pub(crate) struct Histogram {
    buckets: &'static [f64],
    data: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    pub(crate) fn new(buckets: &'static [f64]) -> Self {
        Self {
            buckets,
            data: Mutex::new((vec![0; buckets.len()], 0.0, 0)),
        }
    }

    pub(crate) fn observe(&self, value: f64) {
        let mut d = self.data.lock().expect("histogram lock");
        if let Some(i) = self.buckets.iter().position(|b| value <= *b) {
            d.0[i] += 1;
        }
        d.1 += value;
        d.2 += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_series(out, name, "");
    }

    /// Bucket bounds, and per bucket the observations so far (not cumulative), their sum and
    /// count (the planner's windows are differences of these).
    pub(crate) fn snapshot(&self) -> (&'static [f64], Vec<u64>, f64, u64) {
        let d = self.data.lock().expect("histogram lock");
        (self.buckets, d.0.clone(), d.1, d.2)
    }

    /// The series' lines, with `labels` (`k="v",` each, or empty) before `le`.
    fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let d = self.data.lock().expect("histogram lock");
        let mut cumulative = 0;
        for (b, n) in self.buckets.iter().zip(&d.0) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {}", d.2);
        let plain = match labels.trim_end_matches(',') {
            "" => String::new(),
            l => format!("{{{l}}}"),
        };
        let _ = writeln!(
            out,
            "{name}_sum{plain} {}\n{name}_count{plain} {}",
            d.1, d.2
        );
    }
}

/// A label value escaped for the text format (`\`, `"`, line feed).
pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A counter family with string labels.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    values: Mutex<BTreeMap<Vec<(&'static str, String)>, u64>>,
}

impl Counters {
    /// A series' key. A label with an empty value is left out: Prometheus reads `model=""` as
    /// no `model` label, so keeping both would write one series twice.
    fn key(labels: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        let kept = labels.iter().filter(|(_, v)| !v.is_empty());
        kept.map(|(k, v)| (*k, (*v).to_owned())).collect()
    }

    pub(crate) fn inc(&self, labels: &[(&'static str, &str)]) {
        self.inc_get(labels);
    }

    /// Shows the series `labels` at 0 until its first increment (`rate()` and `increase()`
    /// need a sample before it to count that one).
    pub(crate) fn zero(&self, labels: &[(&'static str, &str)]) {
        let mut values = self.values.lock().expect("counter lock");
        values.entry(Self::key(labels)).or_default();
    }

    /// Increments and returns the new value.
    pub(crate) fn inc_get(&self, labels: &[(&'static str, &str)]) -> u64 {
        let mut values = self.values.lock().expect("counter lock");
        let v = values.entry(Self::key(labels)).or_default();
        *v += 1;
        *v
    }

    /// Drops every series whose `label` is `value` (a worker that left: its series would
    /// otherwise stay in every scrape for good).
    pub(crate) fn forget(&self, label: &str, value: &str) {
        let mut values = self.values.lock().expect("counter lock");
        values.retain(|key, _| !key.iter().any(|(k, v)| *k == label && v == value));
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (labels, v) in self.values.lock().expect("counter lock").iter() {
            let l: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {v}", l.join(","));
        }
    }
}

/// Every metric of the server.
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) requests: Counters,
    /// TTFT, ITL and duration, by model.
    pub(crate) by_model: ByModel,
    pub(crate) isl: Histogram,
    pub(crate) osl: Histogram,
    pub(crate) cached_tokens: Histogram,
    /// Prompt tokens of the answers `cached_tokens` observed (the served hit rate's denominator).
    pub(crate) usage_prompt_tokens: Histogram,
    pub(crate) kv_hit_rate: Histogram,
    pub(crate) overhead: Histogram,
    pub(crate) queue_wait: Histogram,
    pub(crate) rejections: Counters,
    pub(crate) kv_events: Counters,
    pub(crate) kv_messages_dropped: Counters,
    pub(crate) kv_stream_breaks: Counters,
    pub(crate) kv_stream_resyncs: Counters,
    pub(crate) retries: Counters,
    pub(crate) health_transitions: Counters,
    pub(crate) migrations: Counters,
    pub(crate) upstream_timeouts: Counters,
    /// Worker answers of 401 or 403 (the router's key to them missing or wrong), by worker.
    pub(crate) key_refusals: Counters,
    /// Answers whose `usage.prompt_tokens` differs from the router's own count, by worker.
    pub(crate) prompt_token_mismatches: Counters,
    /// Discovered workers added, drained, revived and purged, by source and action.
    pub(crate) discovery_changes: Counters,
    /// Reconnects to a discovery source, by source.
    pub(crate) discovery_reconnects: Counters,
    /// Picks of the pick API and ext_proc by how they ended (finished, cancelled, expired).
    pub(crate) picks: Counters,
    /// Picks of the pick API not yet finished or expired.
    pub(crate) picks_outstanding: std::sync::atomic::AtomicU64,
}

impl Metrics {
    /// Every metric, the series of counters whose labels are a fixed set shown at 0 from the
    /// start (`mode`: the router's mode, the one value their `mode` label takes).
    pub(crate) fn new(mode: &str) -> Self {
        let m = Self::empty();
        for reason in ["queue_full", "overloaded", "deadline", "max_wait"] {
            m.rejections.zero(&[("reason", reason)]);
        }
        for kind in ["ongoing_request", "weight_update"] {
            m.migrations.zero(&[("migration_type", kind)]);
        }
        for kind in ["stream", "unary", "stream_idle"] {
            m.upstream_timeouts.zero(&[("kind", kind)]);
        }
        m.retries.zero(&[("mode", mode)]);
        m
    }

    fn empty() -> Self {
        Self {
            requests: Counters::default(),
            by_model: ByModel::default(),
            isl: Histogram::new(TOKENS),
            osl: Histogram::new(TOKENS),
            cached_tokens: Histogram::new(TOKENS),
            usage_prompt_tokens: Histogram::new(TOKENS),
            kv_hit_rate: Histogram::new(RATIO),
            overhead: Histogram::new(SECONDS),
            queue_wait: Histogram::new(SECONDS),
            rejections: Counters::default(),
            kv_events: Counters::default(),
            kv_messages_dropped: Counters::default(),
            kv_stream_breaks: Counters::default(),
            kv_stream_resyncs: Counters::default(),
            retries: Counters::default(),
            health_transitions: Counters::default(),
            migrations: Counters::default(),
            upstream_timeouts: Counters::default(),
            key_refusals: Counters::default(),
            prompt_token_mismatches: Counters::default(),
            discovery_changes: Counters::default(),
            discovery_reconnects: Counters::default(),
            picks: Counters::default(),
            picks_outstanding: Default::default(),
        }
    }

    /// Drops the series of a worker that left: the counter families labelled by worker (the
    /// gauges are rendered from the workers there are).
    pub(crate) fn forget_worker(&self, worker: &str) {
        for family in [
            &self.kv_stream_breaks,
            &self.kv_stream_resyncs,
            &self.key_refusals,
            &self.prompt_token_mismatches,
        ] {
            family.forget("worker", worker);
        }
    }

    /// Drops the series of a model no worker serves any more: its histograms and its
    /// `kvrouter_requests_total` series.
    pub(crate) fn forget_model(&self, model: &str) {
        self.by_model.forget(model);
        self.requests.forget("model", model);
    }

    /// Everything but the per-worker gauges, which the caller appends.
    pub(crate) fn render(&self, out: &mut String) {
        self.requests.render(
            out,
            "kvrouter_requests_total",
            "Requests by outcome and routing mode.",
        );
        self.by_model.render(
            out,
            "kvrouter_time_to_first_token_seconds",
            "Time from arrival to the first streamed byte of content, by model.",
            |m| &m.ttft,
        );
        self.by_model.render(
            out,
            "kvrouter_inter_token_latency_seconds",
            "Time between streamed content chunks, by model.",
            |m| &m.itl,
        );
        self.by_model.render(
            out,
            "kvrouter_request_duration_seconds",
            "Time from arrival to the end of the response, by model.",
            |m| &m.duration,
        );
        self.isl.render(
            out,
            "kvrouter_input_sequence_tokens",
            "Prompt tokens per request (as the router tokenized them).",
        );
        self.osl.render(
            out,
            "kvrouter_output_sequence_tokens",
            "Generated tokens per request (from usage, else counted chunks).",
        );
        self.cached_tokens.render(out, "kvrouter_cached_tokens", "Prompt tokens the engine served from its cache (usage.prompt_tokens_details.cached_tokens).");
        self.usage_prompt_tokens.render(out, "kvrouter_usage_prompt_tokens", "Prompt tokens the engine counted (usage.prompt_tokens) in the answers whose cached tokens were observed: the served hit rate is the cached tokens' sum over this sum.");
        self.kv_hit_rate.render(
            out,
            "kvrouter_router_kv_hit_rate",
            "Predicted share of the prompt cached on the chosen worker.",
        );
        self.overhead.render(
            out,
            "kvrouter_routing_overhead_seconds",
            "Router time before forwarding: parsing, tokenization, hashing, index lookup, scoring.",
        );
        self.queue_wait.render(
            out,
            "kvrouter_router_queue_wait_seconds",
            "Time requests waited in the router queue before placement.",
        );
        self.rejections.render(
            out,
            "kvrouter_rejections_total",
            "Requests refused by admission, by reason (queue_full, overloaded, deadline, max_wait).",
        );
        self.kv_events.render(
            out,
            "kvrouter_kv_events_applied_total",
            "KV events applied to the index, by outcome and type.",
        );
        self.kv_messages_dropped.render(
            out,
            "kvrouter_kv_event_messages_dropped_total",
            "KV event messages dropped or recovered, by reason.",
        );
        self.kv_stream_breaks.render(
            out,
            "kvrouter_kv_stream_breaks_total",
            "KV event streams that broke (publisher disconnected, subscriber failed), by worker and reason.",
        );
        self.kv_stream_resyncs.render(
            out,
            "kvrouter_kv_stream_resyncs_total",
            "Ranks cleared and re-learned (stream came back, sequence went backwards, oversize message), by worker and reason.",
        );
        self.health_transitions.render(
            out,
            "kvrouter_worker_health_transitions_total",
            "Workers marked unhealthy or healthy again.",
        );
        self.migrations.render(
            out,
            "kvrouter_migrations_total",
            "Streams continued on another worker after their worker failed.",
        );
        self.prompt_token_mismatches.render(
            out,
            "kvrouter_prompt_token_mismatch_total",
            "Answers whose usage.prompt_tokens differs from the router's own count of the prompt (its tokenizer or chat template disagrees with the engine's, so KV overlap predictions are wrong).",
        );
        self.retries.render(
            out,
            "kvrouter_upstream_retries_total",
            "Requests re-sent to another worker after an upstream failure before the first byte.",
        );
        self.upstream_timeouts.render(
            out,
            "kvrouter_upstream_timeouts_total",
            "Worker requests that got no response headers in time, by request kind (stream, unary).",
        );
        self.key_refusals.render(
            out,
            "kvrouter_upstream_key_refusals_total",
            "Worker answers of 401 or 403: the router's key to the worker (--worker-api-key) is missing or wrong; by worker.",
        );
        self.discovery_changes.render(
            out,
            "kvrouter_discovery_changes_total",
            "Discovered workers added, drained, revived, purged or refused, by source and action.",
        );
        self.discovery_reconnects.render(
            out,
            "kvrouter_discovery_reconnects_total",
            "Times a discovery source's watch was lost and set up again, by source.",
        );
        self.picks.render(
            out,
            "kvrouter_picks_total",
            "Placements handed out without forwarding (pick API, ext_proc), by source and how they ended (finished, cancelled, expired).",
        );
        gauge_header(
            out,
            "kvrouter_picks_outstanding",
            "Picks handed out by the pick API and not yet finished or expired.",
        );
        let outstanding = self
            .picks_outstanding
            .load(std::sync::atomic::Ordering::Relaxed);
        let _ = writeln!(out, "kvrouter_picks_outstanding {outstanding}");
    }
}

pub(crate) fn gauge_header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
}

pub(crate) fn counter_header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
}

/// The exposition `text` with the `kvrouter_` prefix of every metric name replaced by `prefix`
/// (on sample lines and on `# HELP`/`# TYPE` lines).
pub(crate) fn with_prefix(text: &str, prefix: &str) -> String {
    const OURS: &str = "kvrouter_";
    if prefix == OURS {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for line in text.lines() {
        let (head, rest) = match line.strip_prefix("# HELP ") {
            Some(rest) => ("# HELP ", rest),
            None => match line.strip_prefix("# TYPE ") {
                Some(rest) => ("# TYPE ", rest),
                None => ("", line),
            },
        };
        out.push_str(head);
        match rest.strip_prefix(OURS) {
            Some(name) => {
                out.push_str(prefix);
                out.push_str(name);
            }
            None => out.push_str(rest),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests;
