//! Summary pollers: one task per cluster fetches `URL/admin/cluster-summary` every refresh
//! period, each fetch bounded by the summary timeout, and hands good summaries to the core;
//! after a good summary, the cluster's model list (`URL/v1/models`; a failed fetch keeps the
//! last list).
//! A good summary also marks the cluster up again (after a failed request marked it down); a
//! connection failure marks it down at once rather than waiting for the age bound.

use super::metrics::FailKind;
use super::GlobalState;
use kvrouter_core::global::{ClusterId, ClusterSummary};
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

/// Starts a poller per cluster.
pub(super) fn spawn(state: &Arc<GlobalState>) -> Vec<JoinHandle<()>> {
    (0..state.clusters.len())
        .map(|i| {
            let state = state.clone();
            tokio::spawn(async move { run(state, ClusterId(i as u32)).await })
        })
        .collect()
}

async fn run(state: Arc<GlobalState>, id: ClusterId) {
    let mut tick = tokio::time::interval(state.config.refresh);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match fetch(&state, id).await {
            Ok(summary) => {
                take(&state, id, summary);
                super::models::refresh(&state, id).await;
            }
            Err(kind) => {
                state.metrics.fetch_failed(id, kind);
                if kind == FailKind::Connect {
                    let _ = state.lock().set_up(id, false);
                }
            }
        }
    }
}

fn take(state: &GlobalState, id: ClusterId, summary: ClusterSummary) {
    let now = state.now();
    let taken = {
        let mut r = state.lock();
        let taken = r.update_summary(id, summary, now);
        if taken.is_ok() {
            let _ = r.set_up(id, true);
            r.expire_sessions(now);
        }
        taken
    };
    match taken {
        Ok(true) => state.metrics.summary_taken(id),
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(cluster = %state.clusters[id.0 as usize].name, "summary refused: {e}");
            state.metrics.fetch_failed(id, FailKind::Invalid);
        }
    }
}

async fn fetch(state: &GlobalState, id: ClusterId) -> Result<ClusterSummary, FailKind> {
    let cluster = &state.clusters[id.0 as usize];
    let mut request = state
        .http
        .get(format!("{}/admin/cluster-summary", cluster.url))
        .timeout(state.config.summary_timeout);
    if let Some(token) = &state.config.summary_token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.map_err(|e| FailKind::of(&e))?;
    if response.status() != reqwest::StatusCode::OK {
        tracing::warn!(cluster = %cluster.name, status = %response.status(), "summary fetch");
        return Err(FailKind::Status);
    }
    let bytes = response.bytes().await.map_err(|e| FailKind::of(&e))?;
    ClusterSummary::from_bytes(&bytes).map_err(|e| {
        tracing::warn!(cluster = %cluster.name, "summary: {e}");
        FailKind::Invalid
    })
}
