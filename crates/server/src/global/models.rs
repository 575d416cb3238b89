//! The clusters' model lists: fetched with each good summary (`GET URL/v1/models`, bounded by
//! the summary timeout and [`MAX_MODELS_BYTES`]; a failed fetch keeps the last list), their ids
//! handed to the core (a request naming a model goes only to clusters that serve it), and
//! `GET /v1/models[/{id}]` answered here from the available clusters' lists once every one of
//! them is known (forwarded to an available cluster until then).

use super::GlobalState;
use crate::error::ServeError;
use axum::extract::{OriginalUri, Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kvrouter_core::global::ClusterId;
use serde_json::Value;
use std::sync::Arc;

/// The largest model list taken from a cluster (its `GET /v1/models` body), bytes.
const MAX_MODELS_BYTES: usize = 1 << 20;

/// Fetches cluster `id`'s model list; a good one replaces what the core and the state hold.
pub(super) async fn refresh(state: &GlobalState, id: ClusterId) {
    let Some(cards) = fetch(state, id).await else {
        return;
    };
    let ids = cards
        .iter()
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect();
    let _ = state.lock().set_models(id, Some(ids));
    state.models.lock().expect("models lock")[id.0 as usize] = Some(cards);
}

/// The cluster's model cards (`GET URL/v1/models`, `data`), if it answers with a list. Sent
/// with the summary token (the cluster's admin token), which a cluster started with
/// `--api-key` takes on its data plane too.
async fn fetch(state: &GlobalState, id: ClusterId) -> Option<Vec<Value>> {
    let cluster = &state.clusters[id.0 as usize];
    let mut request = state
        .http
        .get(format!("{}/v1/models", cluster.url))
        .timeout(state.config.summary_timeout);
    if let Some(token) = &state.config.summary_token {
        request = request.bearer_auth(token);
    }
    let mut response = request.send().await.ok()?;
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
    let mut list: Value = serde_json::from_slice(&body).ok()?;
    let cards = list.get_mut("data")?.as_array_mut()?;
    Some(std::mem::take(cards))
}

/// The models of the clusters available now (each card once, by id), or `None` while an
/// available cluster's list is not known (or none is available).
fn available(state: &GlobalState) -> Option<Vec<Value>> {
    let now = state.now();
    let available: Vec<usize> = {
        let r = state.lock();
        (0..state.clusters.len())
            .filter(|&i| r.is_eligible(ClusterId(i as u32), now))
            .collect()
    };
    let lists = state.models.lock().expect("models lock");
    let mut cards: Vec<Value> = Vec::new();
    for i in &available {
        for card in lists[*i].as_ref()? {
            if !cards.iter().any(|c| c["id"] == card["id"]) {
                cards.push(card.clone());
            }
        }
    }
    (!available.is_empty()).then_some(cards)
}

/// `GET /v1/models`: the available clusters' models together.
pub(super) async fn list(
    State(s): State<Arc<GlobalState>>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
) -> Response {
    match available(&s) {
        Some(cards) => {
            axum::Json(serde_json::json!({"object": "list", "data": cards})).into_response()
        }
        None => super::proxy::forward_model_list(&s, &uri, headers).await,
    }
}

/// `GET /v1/models/{id}`: one of the available clusters' models (404 naming `model` for one
/// none serves).
pub(super) async fn one(
    State(s): State<Arc<GlobalState>>,
    Path(id): Path<String>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
) -> Response {
    let Some(cards) = available(&s) else {
        return super::proxy::forward_model_list(&s, &uri, headers).await;
    };
    match cards.into_iter().find(|c| c["id"] == id.as_str()) {
        Some(card) => axum::Json(card).into_response(),
        None => ServeError::from(kvrouter_openai::RequestError::UnknownModel(id)).into_response(),
    }
}
