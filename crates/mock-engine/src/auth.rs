//! The engine's API key (`--api-key`), as vLLM's: its `/v1` routes need
//! `Authorization: Bearer <key>`; probes, metrics and the control calls stay open.

use crate::error::ApiError;
use crate::http::AppState;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Layer of the `/v1` routes with an API key: the key, or a 401.
pub(crate) async fn api_key(State(s): State<AppState>, request: Request, next: Next) -> Response {
    let expected = s.config().api_key.as_deref().unwrap_or_default();
    let given = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| kvrouter_openai::bearer_token(v.as_bytes()));
    match given == Some(expected.as_bytes()) {
        true => next.run(request).await,
        false => ApiError::unauthorized().into_response(),
    }
}
