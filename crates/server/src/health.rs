//! Worker health: active checks (`GET /health` on an interval) and passive outlier detection
//! (consecutive connection failures or 5xx answers). An unhealthy worker leaves the eligible set
//! at once; its cache entries are dropped after a grace period; when it recovers it starts from a
//! cleared index. Health never touches load accounting.

use crate::state::AppState;
use kvrouter_core::ids::WorkerId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Health-check settings.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthConfig {
    /// Interval of active checks (`None` = no active checks).
    pub interval: Option<Duration>,
    /// Consecutive failed active checks that make a worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive passed checks (or successful requests) that make it healthy again.
    pub recovery_threshold: u32,
    /// Consecutive failed requests (connection errors, 5xx, broken streams) that make it
    /// unhealthy.
    pub outlier_failures: u32,
    /// How long an unhealthy worker keeps its cache entries before they are dropped.
    pub index_grace: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Some(Duration::from_secs(5)),
            failure_threshold: 3,
            recovery_threshold: 2,
            outlier_failures: 3,
            index_grace: Duration::from_secs(30),
        }
    }
}

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

/// Records one observation of a worker.
pub(crate) fn observe(state: &AppState, worker: WorkerId, ok: bool, source: Source) {
    let config = &state.inner.config.health;
    let change = {
        let mut all = state.inner.health.workers.lock().expect("health lock");
        let h = all.entry(worker).or_default();
        if ok {
            h.failed_checks = 0;
            h.failed_requests = 0;
            h.passes += 1;
            (h.unhealthy && h.passes >= config.recovery_threshold).then(|| {
                h.unhealthy = false;
                true
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
                false
            })
        }
    };
    match change {
        Some(false) => mark_unhealthy(state, worker),
        Some(true) => mark_healthy(state, worker),
        None => {}
    }
}

/// Whether a worker is currently marked unhealthy.
pub(crate) fn is_unhealthy(state: &AppState, worker: WorkerId) -> bool {
    state
        .inner
        .health
        .workers
        .lock()
        .expect("health lock")
        .get(&worker)
        .is_some_and(|h| h.unhealthy)
}

fn mark_unhealthy(state: &AppState, worker: WorkerId) {
    tracing::warn!("worker {worker} is unhealthy: out of the eligible set");
    state.inner.lock_core().set_available(worker, false);
    state
        .inner
        .metrics
        .health_transitions
        .inc(&[("to", "unhealthy")]);
    let st = state.clone();
    let grace = state.inner.config.health.index_grace;
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        if is_unhealthy(&st, worker) {
            st.inner.lock_core().clear_worker_cache(worker);
        }
    });
}

fn mark_healthy(state: &AppState, worker: WorkerId) {
    tracing::info!("worker {worker} is healthy again: back in the eligible set, cache cleared");
    let mut core = state.inner.lock_core();
    core.clear_worker_cache(worker);
    core.set_available(worker, true);
    drop(core);
    state
        .inner
        .metrics
        .health_transitions
        .inc(&[("to", "healthy")]);
    state.inner.wake_queue();
}

/// Checks `url/health` on the configured interval.
pub(crate) fn spawn_checks(
    state: &AppState,
    worker: WorkerId,
    url: String,
) -> Option<JoinHandle<()>> {
    let interval = state.inner.config.health.interval?;
    let st = state.clone();
    Some(tokio::spawn(async move {
        let url = format!("{}/health", url.trim_end_matches('/'));
        let timeout = interval.min(Duration::from_secs(2));
        loop {
            tokio::time::sleep(interval).await;
            let ok = matches!(
                tokio::time::timeout(timeout, st.inner.http.get(&url).send()).await,
                Ok(Ok(r)) if r.status().is_success()
            );
            observe(&st, worker, ok, Source::Check);
        }
    }))
}
