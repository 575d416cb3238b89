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
                if let Some(cards) = fetch_models(&state, id).await {
                    let ids = cards
                        .iter()
                        .filter_map(|c| c["id"].as_str().map(str::to_owned))
                        .collect();
                    let _ = state.lock().set_models(id, Some(ids));
                    state.models.lock().expect("models lock")[id.0 as usize] = Some(cards);
                }
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

/// The cluster's model cards (`GET URL/v1/models`, `data`), if it answers with a list.
async fn fetch_models(state: &GlobalState, id: ClusterId) -> Option<Vec<serde_json::Value>> {
    let cluster = &state.clusters[id.0 as usize];
    let mut response = state
        .http
        .get(format!("{}/v1/models", cluster.url))
        .timeout(state.config.summary_timeout)
        .send()
        .await
        .ok()?;
    if response.status() != reqwest::StatusCode::OK {
        return None;
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.ok()? {
        if body.len() + chunk.len() > MAX_MODELS_BYTES {
            tracing::warn!(cluster = %cluster.name, "model list over {MAX_MODELS_BYTES} bytes: ignored");
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    let mut list: serde_json::Value = serde_json::from_slice(&body).ok()?;
    let cards = list.get_mut("data")?.as_array_mut()?;
    Some(std::mem::take(cards))
}

/// The largest model list taken from a cluster (its `GET /v1/models` body), bytes.
const MAX_MODELS_BYTES: usize = 1 << 20;
