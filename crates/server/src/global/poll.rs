//! Summary pollers: one task per cluster fetches `URL/admin/cluster-summary` every refresh
//! period, each fetch bounded by the summary timeout and `MAX_SUMMARY_BYTES`, and hands good
//! summaries to the core;
//! after a good summary, the cluster's model list (`URL/v1/models`; a failed fetch keeps the
//! last list).
//! A good summary also marks the cluster up again (after a failed request marked it down); a
//! connection failure marks it down at once rather than waiting for the age bound.

use super::metrics::FailKind;
use super::GlobalState;
use kvrouter_core::global::{ClusterId, ClusterSummary, GlobalError, MAX_SUMMARY_BYTES};
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
    let name = &state.clusters[id.0 as usize].name;
    // The last failure logged: the same one again every refresh is logged at debug, so a
    // misconfigured cluster says so once, not several times a second.
    let mut last: Option<String> = None;
    loop {
        tick.tick().await;
        let failure = match fetch(&state, id).await {
            Ok(summary) => match take(&state, id, summary) {
                Ok(()) => {
                    super::models::refresh(&state, id).await;
                    None
                }
                Err(why) => Some(why),
            },
            Err((kind, why)) => {
                state.metrics.fetch_failed(id, kind);
                if kind == FailKind::Connect {
                    let _ = state.lock().set_up(id, false);
                }
                Some(why)
            }
        };
        match failure {
            Some(why) if last.as_deref() == Some(why.as_str()) => {
                tracing::debug!(cluster = %name, "summary: {why} (again)");
            }
            Some(why) => {
                tracing::warn!(cluster = %name, "summary: {why}");
                last = Some(why);
            }
            None => {
                if last.take().is_some() {
                    tracing::info!(cluster = %name, "summary: taken again");
                }
            }
        }
    }
}

/// Hands a fetched summary to the core; a refusal says why, naming the setting at fault.
fn take(state: &GlobalState, id: ClusterId, summary: ClusterSummary) -> Result<(), String> {
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
        Ok(true) => {
            state.metrics.summary_taken(id);
            Ok(())
        }
        Ok(false) => Ok(()),
        Err(e) => {
            state.metrics.fetch_failed(id, FailKind::Invalid);
            let hint = match e {
                GlobalError::BlockSize { .. } => {
                    " (the cluster's router and this one must run the same --kv-cache-block-size)"
                }
                _ => "",
            };
            Err(format!("refused: {e}{hint}"))
        }
    }
}

async fn fetch(state: &GlobalState, id: ClusterId) -> Result<ClusterSummary, (FailKind, String)> {
    let cluster = &state.clusters[id.0 as usize];
    let mut request = state
        .http
        .get(format!("{}/admin/cluster-summary", cluster.url))
        .timeout(state.config.summary_timeout);
    if let Some(token) = &state.config.summary_token {
        request = request.bearer_auth(token);
    }
    let mut response = request
        .send()
        .await
        .map_err(|e| (FailKind::of(&e), e.to_string()))?;
    let status = response.status();
    if status != reqwest::StatusCode::OK {
        let hint = match status.as_u16() {
            401 | 403 => {
                " (KVROUTER_CLUSTER_TOKEN / --cluster-token must be the cluster router's \
                 --admin-token)"
            }
            404 => " (is it a kvrouter serve new enough to publish /admin/cluster-summary?)",
            _ => "",
        };
        return Err((FailKind::Status, format!("fetch answered {status}{hint}")));
    }
    // Bounded: a summary past the largest one a decoder takes is refused unread (by its stated
    // length) or as soon as it passes the bound, not held in memory whole.
    let too_big = || {
        (
            FailKind::Invalid,
            format!("over {MAX_SUMMARY_BYTES} bytes: refused"),
        )
    };
    if response
        .content_length()
        .is_some_and(|n| n > MAX_SUMMARY_BYTES as u64)
    {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| (FailKind::of(&e), e.to_string()))?
    {
        if bytes.len() + chunk.len() > MAX_SUMMARY_BYTES {
            return Err(too_big());
        }
        bytes.extend_from_slice(&chunk);
    }
    ClusterSummary::from_bytes(&bytes).map_err(|e| (FailKind::Invalid, format!("undecodable: {e}")))
}
