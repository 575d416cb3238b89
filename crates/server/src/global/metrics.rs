//! Per-cluster counters of the global router and their Prometheus text.

use super::GlobalState;
use kvrouter_core::global::{ClusterId, DecisionReason};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Why a cluster's router failed a request or a summary fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum FailKind {
    /// No connection (refused, reset, DNS).
    Connect,
    /// No answer within the bound.
    Timeout,
    /// A 5xx answer (requests) or any non-200 (summaries).
    Status,
    /// Bytes that are not a usable summary.
    Invalid,
    /// A response body broken off after it began (the client saw the in-band error).
    Broken,
}

impl FailKind {
    fn label(self) -> &'static str {
        match self {
            FailKind::Connect => "connect",
            FailKind::Timeout => "timeout",
            FailKind::Status => "status",
            FailKind::Invalid => "invalid",
            FailKind::Broken => "broken",
        }
    }

    pub(crate) fn of(e: &reqwest::Error) -> Self {
        if e.is_timeout() {
            FailKind::Timeout
        } else {
            FailKind::Connect
        }
    }
}

fn reason_label(r: DecisionReason) -> &'static str {
    match r {
        DecisionReason::StaticShare => "static_share",
        DecisionReason::LeastLoaded => "least_loaded",
        DecisionReason::LowestCost => "lowest_cost",
        DecisionReason::SessionHome => "session_home",
        DecisionReason::SessionMoved => "session_moved",
    }
}

#[derive(Default)]
struct Counters {
    /// (cluster, reason) → requests sent.
    requests: BTreeMap<(u32, &'static str), u64>,
    /// (cluster, kind) → failed requests.
    errors: BTreeMap<(u32, FailKind), u64>,
    /// (cluster, kind) → failed summary fetches.
    fetch_errors: BTreeMap<(u32, FailKind), u64>,
    /// Per cluster: summaries taken.
    summaries: Vec<u64>,
    /// (from, to) → sessions moved.
    moves: BTreeMap<(u32, u32), u64>,
    /// Requests no cluster could take.
    no_cluster: u64,
}

/// The global router's counters.
pub(crate) struct GlobalMetrics(Mutex<Counters>);

impl GlobalMetrics {
    pub(crate) fn new(clusters: usize) -> Self {
        Self(Mutex::new(Counters {
            summaries: vec![0; clusters],
            ..Counters::default()
        }))
    }

    fn with(&self, f: impl FnOnce(&mut Counters)) {
        f(&mut self.0.lock().expect("global metrics lock"));
    }

    pub(crate) fn sent(&self, c: ClusterId, reason: DecisionReason, moved_from: Option<ClusterId>) {
        self.with(|m| {
            *m.requests.entry((c.0, reason_label(reason))).or_default() += 1;
            if let Some(from) = moved_from {
                *m.moves.entry((from.0, c.0)).or_default() += 1;
            }
        });
    }

    pub(crate) fn failed(&self, c: ClusterId, kind: FailKind) {
        self.with(|m| *m.errors.entry((c.0, kind)).or_default() += 1);
    }

    pub(crate) fn fetch_failed(&self, c: ClusterId, kind: FailKind) {
        self.with(|m| *m.fetch_errors.entry((c.0, kind)).or_default() += 1);
    }

    pub(crate) fn summary_taken(&self, c: ClusterId) {
        self.with(|m| m.summaries[c.0 as usize] += 1);
    }

    pub(crate) fn no_cluster(&self) {
        self.with(|m| m.no_cluster += 1);
    }
}

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The Prometheus text of `GET /metrics` on the global router.
pub(crate) fn render(g: &GlobalState) -> String {
    let p = &g.app.inner.config.metrics_prefix;
    let name = |id: u32| g.clusters[id as usize].name.as_str();
    let now = g.now();
    let mut out = String::new();
    // Router state first (its lock), then the counters (theirs): never both at once.
    let (views, sessions) = {
        let r = g.lock();
        let views: Vec<(bool, Option<f64>, u64)> = (0..g.clusters.len())
            .map(|i| {
                let id = ClusterId(i as u32);
                let summary = r.summary(id);
                let age = summary.map(|(_, at)| now.since(at).as_secs_f64());
                let keys = summary.map_or(0, |(s, _)| s.sketch.keys());
                (r.is_eligible(id, now), age, keys)
            })
            .collect();
        (views, r.session_count())
    };
    head(&mut out, &format!("{p}global_cluster_eligible"), "gauge",
        "1 when the cluster is routed to: up, with a summary younger than --global-max-summary-age-secs.");
    for (i, (eligible, _, _)) in views.iter().enumerate() {
        let _ = writeln!(
            out,
            "{p}global_cluster_eligible{{cluster=\"{}\"}} {}",
            name(i as u32),
            u8::from(*eligible)
        );
    }
    head(
        &mut out,
        &format!("{p}global_summary_age_seconds"),
        "gauge",
        "Seconds since the cluster's last summary arrived (absent before the first).",
    );
    for (i, (_, age, _)) in views.iter().enumerate() {
        if let Some(age) = age {
            let _ = writeln!(
                out,
                "{p}global_summary_age_seconds{{cluster=\"{}\"}} {age:.3}",
                name(i as u32)
            );
        }
    }
    head(
        &mut out,
        &format!("{p}global_summary_keys"),
        "gauge",
        "Prefix checkpoints in the cluster's last summary sketch.",
    );
    for (i, (_, _, keys)) in views.iter().enumerate() {
        let _ = writeln!(
            out,
            "{p}global_summary_keys{{cluster=\"{}\"}} {keys}",
            name(i as u32)
        );
    }
    head(
        &mut out,
        &format!("{p}global_sessions"),
        "gauge",
        "Sessions with a home cluster.",
    );
    let _ = writeln!(out, "{p}global_sessions {sessions}");
    let m = g.metrics.0.lock().expect("global metrics lock");
    head(
        &mut out,
        &format!("{p}global_requests_total"),
        "counter",
        "Requests sent to a cluster, by why it was chosen.",
    );
    for ((c, reason), n) in &m.requests {
        let _ = writeln!(
            out,
            "{p}global_requests_total{{cluster=\"{}\",reason=\"{reason}\"}} {n}",
            name(*c)
        );
    }
    head(&mut out, &format!("{p}global_errors_total"), "counter",
        "Requests a cluster's router failed (connect, timeout, status = 5xx: the request is tried on the next cluster; broken = a body cut off after it began: a stream ends with an in-band error); the cluster is marked down.");
    for ((c, kind), n) in &m.errors {
        let _ = writeln!(
            out,
            "{p}global_errors_total{{cluster=\"{}\",kind=\"{}\"}} {n}",
            name(*c),
            kind.label()
        );
    }
    head(
        &mut out,
        &format!("{p}global_summary_fetch_errors_total"),
        "counter",
        "Summary fetches that failed (connect, timeout, status, invalid).",
    );
    for ((c, kind), n) in &m.fetch_errors {
        let _ = writeln!(
            out,
            "{p}global_summary_fetch_errors_total{{cluster=\"{}\",kind=\"{}\"}} {n}",
            name(*c),
            kind.label()
        );
    }
    head(
        &mut out,
        &format!("{p}global_summaries_total"),
        "counter",
        "Summaries taken per cluster.",
    );
    for (i, n) in m.summaries.iter().enumerate() {
        let _ = writeln!(
            out,
            "{p}global_summaries_total{{cluster=\"{}\"}} {n}",
            name(i as u32)
        );
    }
    head(
        &mut out,
        &format!("{p}global_session_moves_total"),
        "counter",
        "Sessions moved from one cluster to another (their KV stays behind: re-prefill).",
    );
    for ((from, to), n) in &m.moves {
        let _ = writeln!(
            out,
            "{p}global_session_moves_total{{from=\"{}\",to=\"{}\"}} {n}",
            name(*from),
            name(*to)
        );
    }
    head(
        &mut out,
        &format!("{p}global_no_cluster_total"),
        "counter",
        "Requests refused with 503: no cluster was available.",
    );
    let _ = writeln!(out, "{p}global_no_cluster_total {}", m.no_cluster);
    out
}
