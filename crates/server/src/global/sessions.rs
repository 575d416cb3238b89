//! Session release at the global router: `DELETE /v1/sessions/{id}` and `POST /finish_session`
//! (the same routes and answers as a cluster's `kvrouter serve`). The global router forgets the
//! session's home, so it stops counting toward that cluster's resident sessions, and passes the
//! release on to every cluster: the session's own router holds a pin of its own, and a cluster
//! it used before a move may still hold one too.
//!
//! Without this the routes were unknown here (404) and a session was forgotten only after the
//! session TTL (`--global-session-ttl-secs`, an hour by default), counted meanwhile as a
//! returning session in its cluster's decode and batch-slot estimates.

use super::GlobalState;
use crate::error::ServeError;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;

type S = Arc<GlobalState>;

pub(super) async fn release(
    State(s): State<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Json<Value> {
    Json(release_everywhere(&s, &headers, &id).await)
}

pub(super) async fn finish(
    State(s): State<S>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ServeError> {
    let id = crate::headers::finish_session_id(&body)?;
    Ok(Json(release_everywhere(&s, &headers, &id).await))
}

/// Forgets the session here and asks every cluster's router to release it (concurrently, each
/// bounded by `--global-summary-timeout-ms`, so a hung cluster does not hold the answer).
/// `released`: whether this router or any cluster knew the session; `clusters`: each cluster's
/// own `released`, or null where it did not answer. The asks run on a task of their own: a
/// client that leaves before the answer does not take the clusters' releases with it.
async fn release_everywhere(s: &S, headers: &HeaderMap, id: &str) -> Value {
    let known = s.lock().end_session(crate::headers::session_key(id));
    let timeout = s.config.summary_timeout;
    let body = json!({ "session_id": id }).to_string();
    let asks: Vec<_> = s
        .clusters
        .iter()
        .map(|c| {
            let mut ask = s
                .http
                .post(format!("{}/finish_session", c.url))
                .header(header::CONTENT_TYPE, "application/json")
                .timeout(timeout)
                .body(body.clone());
            // A cluster that protects releases (`--session-release-auth admin`) checks the
            // client's own credentials.
            if let Some(auth) = headers.get(header::AUTHORIZATION) {
                ask = ask.header(header::AUTHORIZATION, auth);
            }
            async move {
                let answer = match ask.send().await {
                    Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
                    _ => None,
                };
                answer.and_then(|a| a.get("released").and_then(Value::as_bool))
            }
        })
        .collect();
    let fan_out = tokio::spawn(futures::future::join_all(asks));
    let answers = fan_out
        .await
        .unwrap_or_else(|_| vec![None; s.clusters.len()]);
    let mut clusters = Map::new();
    for (c, released) in s.clusters.iter().zip(&answers) {
        clusters.insert(c.name.clone(), released.map_or(Value::Null, Value::Bool));
    }
    let released = known || answers.contains(&Some(true));
    json!({ "session_id": id, "released": released, "clusters": clusters })
}
