//! Worker health, the I/O part: carries out [`Transition`]s (a worker out of the eligible set and
//! its cache entries dropped after a grace period; back in with a cleared index) and runs the
//! active checks. With replica sync, this replica's own changes go out to the others (see
//! `replica`), and theirs are carried out here the same way ([`AppState::apply_peer_health`]).

use super::AppState;
use crate::health::{Reason, Source, Transition};
use kvrouter_core::ids::WorkerId;
use std::time::Duration;
use tokio::task::JoinHandle;

impl AppState {
    /// Records one observation of a worker and carries out its change of state.
    pub(crate) fn observe_health(&self, worker: WorkerId, ok: bool, source: Source) {
        let inner = &self.inner;
        match inner
            .health
            .record(worker, ok, source, &inner.config.health)
        {
            Some(Transition::Unhealthy(reason)) => {
                self.mark_unhealthy(worker, reason, None);
                inner.replica.verdict(worker, Some(reason));
            }
            Some(Transition::Healthy) => {
                self.mark_healthy(worker);
                inner.replica.verdict(worker, None);
            }
            None => {}
        }
    }

    /// Carries out changes of state that another replica's verdicts (`peer`) made here; they
    /// are not published again.
    pub(crate) fn apply_peer_health(&self, peer: u64, changes: Vec<(WorkerId, Transition)>) {
        for (worker, t) in changes {
            match t {
                Transition::Unhealthy(reason) => self.mark_unhealthy(worker, reason, Some(peer)),
                Transition::Healthy => self.mark_healthy(worker),
            }
        }
    }

    fn mark_unhealthy(&self, worker: WorkerId, reason: Reason, peer: Option<u64>) {
        match peer {
            None => tracing::warn!(
                "worker {worker} is unhealthy ({}): out of the eligible set",
                reason.as_str()
            ),
            Some(p) => tracing::warn!(
                "worker {worker} is unhealthy ({}, seen by replica {p}): out of the eligible set",
                reason.as_str()
            ),
        }
        self.inner.lock_core().set_available(worker, false);
        self.inner
            .metrics
            .health_transitions
            .inc(&[("to", "unhealthy")]);
        let st = self.clone();
        let grace = self.inner.config.health.index_grace;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if st.inner.health.is_unhealthy(worker) {
                st.inner.lock_core().clear_worker_cache(worker);
            }
        });
    }

    fn mark_healthy(&self, worker: WorkerId) {
        let draining = (self.inner.workers.lock().expect("workers lock"))
            .get(&worker)
            .is_some_and(|r| r.draining);
        if draining {
            // Removed by its discovery source: it stays out of rotation until purged.
            return;
        }
        tracing::info!("worker {worker} is healthy again: back in the eligible set, cache cleared");
        let mut core = self.inner.lock_core();
        core.clear_worker_cache(worker);
        core.set_available(worker, true);
        drop(core);
        self.inner
            .metrics
            .health_transitions
            .inc(&[("to", "healthy")]);
        self.inner.wake_queue();
    }

    /// Checks `url/health` on the configured interval.
    pub(crate) fn spawn_health_checks(
        &self,
        worker: WorkerId,
        url: String,
    ) -> Option<JoinHandle<()>> {
        let interval = self.inner.config.health.interval?;
        let st = self.clone();
        Some(tokio::spawn(async move {
            let url = format!("{}/health", url.trim_end_matches('/'));
            let timeout = interval.min(Duration::from_secs(2));
            loop {
                tokio::time::sleep(interval).await;
                let ok = matches!(
                    tokio::time::timeout(timeout, st.inner.http.get(&url).send()).await,
                    Ok(Ok(r)) if r.status().is_success()
                );
                st.observe_health(worker, ok, Source::Check);
            }
        }))
    }
}
