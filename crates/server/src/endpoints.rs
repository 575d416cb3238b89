//! The model endpoints and the pass-through endpoints (`/v1/responses`, `/v1/embeddings`,
//! `/tokenize`, `/detokenize`: routed on their prompt where they have one, answered by the engine).

use crate::error::ServeError;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvrouter_openai::passthrough::Endpoint;
use serde_json::{json, Value};

/// `GET /v1/models`: every model served (the union of the workers' pools; adapters with
/// `parent` and `root`, as vLLM lists them).
pub(crate) async fn models(State(s): State<AppState>) -> Json<Value> {
    let models = s.inner.models.read().expect("models lock").clone();
    let data: Vec<Value> = models.iter().map(|m| model_card(&s, m)).collect();
    Json(json!({"object": "list", "data": data}))
}

fn model_card(s: &AppState, id: &str) -> Value {
    let card = s
        .inner
        .pools
        .read()
        .expect("pools lock")
        .union()
        .into_iter()
        .find(|c| c.id == id);
    let parent = card.as_ref().and_then(|c| c.parent.clone());
    let mut v = json!({"id": id, "object": "model", "created": card.as_ref().and_then(|c| c.created).unwrap_or(0), "owned_by": "kvrouter", "root": parent.as_deref().unwrap_or(id), "parent": parent});
    // What clients size their prompts by, as the engines state it.
    if let Some(len) = card.and_then(|c| c.max_model_len) {
        v["max_model_len"] = len.into();
    }
    v
}

/// `GET /v1/models/{id}`: one model the workers serve; an unknown one is a 404 naming `model`.
pub(crate) async fn model(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ServeError> {
    let known = s.inner.models.read().expect("models lock").contains(&id);
    if !known {
        return Err(kvrouter_openai::RequestError::UnknownModel(id).into());
    }
    Ok(Json(model_card(&s, &id)))
}

async fn pass(s: AppState, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    crate::request::pass_through(s, endpoint, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn responses(State(s): State<AppState>, h: HeaderMap, b: Bytes) -> Response {
    pass(s, Endpoint::Responses, h, b).await
}

pub(crate) async fn embeddings(State(s): State<AppState>, h: HeaderMap, b: Bytes) -> Response {
    pass(s, Endpoint::Embeddings, h, b).await
}

pub(crate) async fn tokenize(State(s): State<AppState>, h: HeaderMap, b: Bytes) -> Response {
    pass(s, Endpoint::Tokenize, h, b).await
}

pub(crate) async fn detokenize(State(s): State<AppState>, h: HeaderMap, b: Bytes) -> Response {
    pass(s, Endpoint::Detokenize, h, b).await
}
