//! Worker health, the pure part: consecutive failed active checks (`GET /health`) and failed
//! requests (connection errors, 5xx, broken streams) make a worker unhealthy; consecutive passes
//! make it healthy again. [`Health::record`] says when a worker changes state; the server carries
//! the change out (`state/health.rs`: out of the eligible set, the index cleared after a grace
//! period). Health never touches load accounting.

use crate::config::HealthConfig;
use kvrouter_core::ids::WorkerId;
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Debug, Default)]
struct WorkerHealth {
    unhealthy: bool,
    failed_checks: u32,
    failed_requests: u32,
    passes: u32,
}

/// Health of every worker.
#[derive(Debug, Default)]
pub(crate) struct Health {
    workers: Mutex<HashMap<WorkerId, WorkerHealth>>,
}

/// Where an observation comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Check,
    Request,
}

/// A worker's change of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    /// It left the eligible set.
    Unhealthy,
    /// It came back.
    Healthy,
}

impl Health {
    /// Records one observation of `worker`; returns its change of state, if any.
    pub(crate) fn record(
        &self,
        worker: WorkerId,
        ok: bool,
        source: Source,
        config: &HealthConfig,
    ) -> Option<Transition> {
        let mut all = self.workers.lock().expect("health lock");
        let h = all.entry(worker).or_default();
        if ok {
            h.failed_checks = 0;
            h.failed_requests = 0;
            h.passes += 1;
            (h.unhealthy && h.passes >= config.recovery_threshold).then(|| {
                h.unhealthy = false;
                Transition::Healthy
            })
        } else {
            h.passes = 0;
            match source {
                Source::Check => h.failed_checks += 1,
                Source::Request => h.failed_requests += 1,
            }
            let failing = h.failed_checks >= config.failure_threshold
                || h.failed_requests >= config.outlier_failures;
            (!h.unhealthy && failing).then(|| {
                h.unhealthy = true;
                Transition::Unhealthy
            })
        }
    }

    /// Whether `worker` is marked unhealthy.
    pub(crate) fn is_unhealthy(&self, worker: WorkerId) -> bool {
        let all = self.workers.lock().expect("health lock");
        all.get(&worker).is_some_and(|h| h.unhealthy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_mark_unhealthy_and_passes_in_a_row_bring_back() {
        let config = HealthConfig::default();
        let h = Health::default();
        let w = WorkerId(1);
        let fail = |s| h.record(w, false, s, &config);
        assert_eq!(fail(Source::Request), None);
        assert_eq!(
            h.record(w, true, Source::Request, &config),
            None,
            "a pass resets"
        );
        assert_eq!((fail(Source::Request), fail(Source::Request)), (None, None));
        assert_eq!(fail(Source::Request), Some(Transition::Unhealthy));
        assert!(h.is_unhealthy(w) && !h.is_unhealthy(WorkerId(2)));
        assert_eq!(fail(Source::Check), None, "already unhealthy");
        assert_eq!(h.record(w, true, Source::Check, &config), None);
        assert_eq!(
            h.record(w, true, Source::Check, &config),
            Some(Transition::Healthy)
        );
    }
}
