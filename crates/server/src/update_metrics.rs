//! The weight-update cycle on `/metrics`, read from the core's cycle status at scrape time.

use crate::metrics::gauge_header;
use kvrouter_core::router::{UpdatePhase, UpdateStatus};
use std::fmt::Write;

/// Every phase, in the order a worker goes through them.
const PHASES: [(UpdatePhase, &str); 6] = [
    (UpdatePhase::Pending, "pending"),
    (UpdatePhase::Draining, "draining"),
    (UpdatePhase::Updating, "updating"),
    (UpdatePhase::Loaded, "loaded"),
    (UpdatePhase::Done, "done"),
    (UpdatePhase::Failed, "failed"),
];

/// Appends the update gauges: whether a cycle runs, its workers by phase, the newest policy
/// version, and the last cycle's duration.
pub(crate) fn render(out: &mut String, status: Option<&UpdateStatus>, newest_version: u64) {
    gauge_header(
        out,
        "kvrouter_weight_update_running",
        "1 while a weight-update cycle runs, else 0.",
    );
    let running = status.is_some_and(|s| s.finished.is_none());
    let _ = writeln!(out, "kvrouter_weight_update_running {}", u8::from(running));
    gauge_header(
        out,
        "kvrouter_weight_update_workers",
        "Workers of the running (or last) weight-update cycle, by phase.",
    );
    for (phase, name) in PHASES {
        let n = status.map_or(0, |s| s.phases.values().filter(|p| **p == phase).count());
        let _ = writeln!(
            out,
            "kvrouter_weight_update_workers{{phase=\"{name}\"}} {n}"
        );
    }
    gauge_header(
        out,
        "kvrouter_policy_version_newest",
        "The newest policy version any worker serves.",
    );
    let _ = writeln!(out, "kvrouter_policy_version_newest {newest_version}");
    gauge_header(
        out,
        "kvrouter_weight_update_last_cycle_seconds",
        "Duration of the last finished weight-update cycle (0 before one finished).",
    );
    let secs = status
        .and_then(|s| {
            Some(
                s.finished?
                    .as_micros()
                    .saturating_sub(s.started.as_micros()),
            )
        })
        .map_or(0.0, |us| us as f64 / 1e6);
    let _ = writeln!(out, "kvrouter_weight_update_last_cycle_seconds {secs}");
}
