//! The global router's HTTP surface: OpenAI requests placed on a cluster and forwarded
//! unchanged to its `kvrouter serve` (streamed back as they come, with `x-kvrouter-cluster`),
//! plus `/health`, `/live` and `/metrics`.
//!
//! `serve`'s own forwarder is bound to worker attempts and the core's load ledger; a cluster's
//! router does that work itself, so forwarding here is a plain pass-through: body bytes out,
//! status, headers and body stream back. A request whose cluster fails before answering
//! (connection error, timeout, 5xx) marks the cluster down and goes to the next one, at most
//! once per cluster; nothing has been sent to the client by then.

use super::metrics::FailKind;
use super::GlobalState;
use crate::error::ServeError;
use crate::routing::{self, Kind, RoutingInput};
use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvrouter_core::global::{ClusterId, GlobalError, GlobalRequest};
use kvrouter_core::hashing::BlockHashes;
use kvrouter_openai::passthrough::Endpoint;
use std::sync::Arc;

/// Response header naming the cluster that answered.
pub(crate) const CLUSTER_HEADER: &str = "x-kvrouter-cluster";

type S = Arc<GlobalState>;

/// How a request's prompt is found.
#[derive(Clone, Copy)]
enum Prompt {
    Openai(Kind),
    Passthrough(Endpoint),
    /// No prompt (model list): any available cluster.
    None,
}

pub(super) fn app(state: S) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(models))
        .route("/health", get(health))
        .route("/ready", get(health))
        .route("/live", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .fallback(crate::error::unknown_route)
        .method_not_allowed_fallback(crate::error::wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(
            kvrouter_openai::MAX_REQUEST_BODY_BYTES,
        ))
        .layer(axum::middleware::map_response(
            crate::error::shape_rejections,
        ))
        .with_state(state)
}

macro_rules! handler {
    ($name:ident, $prompt:expr) => {
        async fn $name(
            State(s): State<S>,
            method: Method,
            OriginalUri(uri): OriginalUri,
            headers: HeaderMap,
            body: Bytes,
        ) -> Response {
            let path = uri.path_and_query().map_or("/", |p| p.as_str());
            handle(&s, $prompt, method, path, headers, body)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        }
    };
}

handler!(chat, Prompt::Openai(Kind::Chat));
handler!(completions, Prompt::Openai(Kind::Completion));
handler!(responses, Prompt::Passthrough(Endpoint::Responses));
handler!(embeddings, Prompt::Passthrough(Endpoint::Embeddings));
handler!(tokenize, Prompt::Passthrough(Endpoint::Tokenize));
handler!(detokenize, Prompt::Passthrough(Endpoint::Detokenize));
handler!(models, Prompt::None);

async fn health(State(s): State<S>) -> Response {
    let now = s.now();
    let up = {
        let r = s.lock();
        (0..s.clusters.len())
            .filter(|&i| r.is_eligible(ClusterId(i as u32), now))
            .count()
    };
    let status = if up > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({"status": if up > 0 {"ok"} else {"unavailable"},
        "clusters": s.clusters.len(), "available_clusters": up});
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(s): State<S>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        super::metrics::render(&s),
    )
        .into_response()
}

/// What the global router routes on: the prompt's blocks at the clusters' block size.
async fn routing_input(
    s: &GlobalState,
    prompt: Prompt,
    body: &Bytes,
) -> Result<(RoutingInput, Option<u64>, bool), ServeError> {
    let parse = || -> Result<(serde_json::Value, bool), ServeError> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| ServeError::invalid(format!("the body is not JSON: {e}"), None))?;
        let stream = value.get("stream").and_then(|v| v.as_bool()) == Some(true);
        Ok((value, stream))
    };
    let (input, hint, stream) = match prompt {
        Prompt::None => {
            let none = RoutingInput {
                isl_tokens: 0,
                blocks: BlockHashes::default(),
            };
            (none, None, false)
        }
        Prompt::Openai(kind) => {
            let (value, stream) = parse()?;
            let hint = kvrouter_openai::request::max_tokens(kind, &value)?.map(u64::from);
            (
                routing::routing_input(&s.app, kind, &value).await?,
                hint,
                stream,
            )
        }
        Prompt::Passthrough(ep) => {
            let (value, stream) = parse()?;
            (
                routing::passthrough_input(&s.app, ep, &value).await?,
                None,
                stream,
            )
        }
    };
    Ok((input, hint, stream))
}

async fn handle(
    s: &GlobalState,
    prompt: Prompt,
    method: Method,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ServeError> {
    let session = crate::headers::session(&headers)?;
    let (input, output_tokens_hint, stream) = routing_input(s, prompt, &body).await?;
    let request = GlobalRequest {
        session,
        blocks: &input.blocks.sequence,
        input_tokens: input.isl_tokens,
        output_tokens_hint,
    };
    let wait = if stream {
        s.app.inner.config.upstream_first_byte_timeout
    } else {
        s.app.inner.config.upstream_response_timeout
    };
    // One try per cluster at most: each failure marks its cluster down before the next pick.
    let mut last_failure = None;
    for _ in 0..s.clusters.len() {
        let decision = match s.lock().route(&request, s.now()) {
            Ok(d) => d,
            Err(GlobalError::NoCluster) => break,
            Err(e) => return Err(ServeError::Upstream(e.to_string())),
        };
        let id = decision.cluster;
        s.metrics.sent(id, decision.reason, decision.moved_from);
        let cluster = &s.clusters[id.0 as usize];
        let mut out = s
            .http
            .request(method.clone(), format!("{}{path}", cluster.url))
            .body(body.clone());
        for (name, value) in &headers {
            if !hop_by_hop(name) && name != header::HOST && name != header::CONTENT_LENGTH {
                out = out.header(name, value);
            }
        }
        let failure = match tokio::time::timeout(wait, out.send()).await {
            Ok(Ok(r)) if !r.status().is_server_error() => return Ok(respond(r, &cluster.name)),
            Ok(Ok(r)) => (FailKind::Status, Some(r)),
            Ok(Err(e)) => (FailKind::of(&e), None),
            Err(_) => (FailKind::Timeout, None),
        };
        tracing::warn!(cluster = %cluster.name, kind = ?failure.0, "cluster failed a request; marked down");
        s.metrics.failed(id, failure.0);
        let _ = s.lock().set_up(id, false);
        last_failure = Some((failure.1, cluster.name.clone()));
    }
    match last_failure {
        // Every cluster failed: the last one's 5xx goes back as it was.
        Some((Some(r), name)) => Ok(respond(r, &name)),
        Some((None, name)) => Err(ServeError::Upstream(format!(
            "cluster {name} (the last one tried) did not answer"
        ))),
        None => {
            s.metrics.no_cluster();
            Err(ServeError::Unavailable(GlobalError::NoCluster.to_string()))
        }
    }
}

fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "transfer-encoding" | "upgrade" | "te" | "trailer"
    )
}

/// The cluster's answer as it came (status, headers, streamed body) plus the cluster header.
fn respond(r: reqwest::Response, cluster: &str) -> Response {
    let status = r.status();
    let mut headers = HeaderMap::new();
    for (name, value) in r.headers() {
        if !hop_by_hop(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(cluster) {
        headers.insert(HeaderName::from_static(CLUSTER_HEADER), v);
    }
    let mut response = Response::new(Body::from_stream(r.bytes_stream()));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}
