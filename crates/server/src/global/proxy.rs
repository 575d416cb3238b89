//! The global router's HTTP surface: OpenAI requests placed on a cluster and forwarded
//! unchanged to its `kvrouter serve` (streamed back as they come, with `x-kvrouter-cluster`),
//! plus `/health`, `/live`, `/metrics` and session release (`sessions.rs`).
//!
//! `serve`'s own forwarder is bound to worker attempts and the core's load ledger; a cluster's
//! router does that work itself, so forwarding here is a plain pass-through: body bytes out,
//! status, headers and body stream back. A request whose cluster fails before answering
//! (connection error, timeout, 5xx) marks the cluster down and goes to the next one, at most
//! once per cluster; nothing has been sent to the client by then. A cluster that breaks off a
//! body it began is marked down too (one gone silent is not); a stream (`text/event-stream`)
//! then ends with the in-band OpenAI error event and `[DONE]`, as `serve` ends a stream whose
//! worker fails, instead of stopping mid-chunk (the body's forwarding: `forward.rs`).

use super::forward::{hop_by_hop, respond, UsageTap};
use super::metrics::FailKind;
use super::GlobalState;
use crate::error::ServeError;
use crate::routing::{self, Kind, RoutingInput};
use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use kvrouter_core::global::{ClusterId, GlobalError, GlobalRequest};
use kvrouter_core::hashing::BlockHashes;
use kvrouter_openai::passthrough::Endpoint;
use std::sync::Arc;

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
    let data = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(super::models::list))
        .route("/v1/models/{id}", get(super::models::one));
    let sessions = Router::new()
        .route("/v1/sessions/{id}", delete(super::sessions::release))
        .route("/finish_session", post(super::sessions::finish));
    // `--api-key` as in a cluster's `serve`, without the admin token: the client's
    // `authorization` goes on to the cluster with the rest of its headers. Session release
    // keeps its own rule when it needs the admin token.
    let config = &state.app.inner.config;
    let keyed = |r: Router<S>| match config.api_keys.is_empty() {
        true => r,
        false => r.route_layer(axum::middleware::from_fn_with_state(
            state.app.clone(),
            crate::auth::api_key_only,
        )),
    };
    let sessions = match config.session_release_auth {
        crate::config::SessionReleaseAuth::Open => keyed(sessions),
        crate::config::SessionReleaseAuth::Admin => sessions.route_layer(
            axum::middleware::from_fn_with_state(state.app.clone(), crate::auth::session_release),
        ),
    };
    keyed(data)
        .merge(sessions)
        .route("/health", get(health))
        .route("/ready", get(health))
        .route("/live", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .fallback(crate::error::unknown_route)
        .method_not_allowed_fallback(crate::error::wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(
            kvrouter_openai::MAX_REQUEST_BODY_BYTES,
        ))
        // The head checks of `serve`'s edge (URI and header sizes, a body announced past the
        // limit, a coded body), before anything is read or forwarded.
        .layer(axum::middleware::from_fn(crate::error::head_checked))
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
/// A model-list request forwarded to an available cluster, as before the clusters' lists are
/// known (`models.rs`).
pub(super) async fn forward_model_list(
    s: &S,
    uri: &axum::http::Uri,
    headers: HeaderMap,
) -> Response {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    handle(s, Prompt::None, Method::GET, path, headers, Bytes::new())
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

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

/// What the global router routes on, read from a request's body.
struct Routed {
    input: RoutingInput,
    output_tokens_hint: Option<u64>,
    stream: bool,
    /// The body's `model`, if it names one.
    model: Option<String>,
}

/// The request's routing input: the prompt's blocks at the clusters' block size.
async fn routing_input(
    s: &GlobalState,
    prompt: Prompt,
    body: &Bytes,
) -> Result<Routed, ServeError> {
    let parse = || -> Result<(kvrouter_openai::Body, bool, Option<String>), ServeError> {
        let body = kvrouter_openai::Body::from_slice(body)
            .map_err(|e| ServeError::invalid(format!("the body is not JSON: {e}"), None))?;
        let fields = body.fields();
        let stream = fields.get("stream").and_then(|v| v.as_bool()) == Some(true);
        let model = kvrouter_openai::request::model(fields).map(str::to_owned);
        Ok((body, stream, model))
    };
    Ok(match prompt {
        Prompt::None => Routed {
            input: RoutingInput {
                isl_tokens: 0,
                blocks: BlockHashes::default(),
            },
            output_tokens_hint: None,
            stream: false,
            model: None,
        },
        Prompt::Openai(kind) => {
            let (body, stream, model) = parse()?;
            let hint = kvrouter_openai::request::max_tokens(kind, body.fields())?.map(u64::from);
            Routed {
                input: routing::routing_input(&s.app, kind, &body).await?,
                output_tokens_hint: hint,
                stream,
                model,
            }
        }
        Prompt::Passthrough(ep) => {
            let (body, stream, model) = parse()?;
            Routed {
                input: routing::passthrough_input(&s.app, ep, &body).await?,
                output_tokens_hint: None,
                stream,
                model,
            }
        }
    })
}

async fn handle(
    s: &S,
    prompt: Prompt,
    method: Method,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ServeError> {
    let session = crate::headers::session(&headers)?;
    let routed = routing_input(s, prompt, &body).await?;
    let input = &routed.input;
    let request = GlobalRequest {
        session,
        blocks: &input.blocks.sequence,
        input_tokens: input.isl_tokens,
        output_tokens_hint: routed.output_tokens_hint,
        model: routed.model.as_deref(),
    };
    // Twice the local tier's bound: a cluster run with the same setting ends or moves a stalled
    // stream (`--migration-limit`) first, and a stream it is moving must not be cut here.
    let idle = s.app.inner.config.stream_idle_timeout.map(|d| d * 2);
    let wait = if routed.stream {
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
            // Available clusters list their models, and none of them serves this one.
            Err(GlobalError::ModelNotServed(model)) if last_failure.is_none() => {
                return Err(kvrouter_openai::RequestError::UnknownModel(model).into())
            }
            Err(GlobalError::ModelNotServed(_)) => break,
            Err(e) => return Err(ServeError::Upstream(e.to_string())),
        };
        let id = decision.cluster;
        s.metrics.sent(id, decision.reason, decision.moved_from);
        let cluster = &s.clusters[id.0 as usize];
        if tracing::enabled!(target: "kvrouter::global", tracing::Level::DEBUG) {
            // Every cluster's estimate, ms: the decision as data, for `--log-level`.
            let estimates: Vec<String> = decision
                .estimates
                .iter()
                .map(|e| {
                    format!(
                        "{}: cost {:.1} = rtt {:.1} + queue {:.1} + prefill {:.1} + decode {:.1}, cached {} blocks, load {:.3}",
                        s.clusters[e.cluster.0 as usize].name,
                        e.cost_ms(),
                        e.rtt_ms,
                        e.queue_ms,
                        e.prefill_ms,
                        e.decode_ms,
                        e.cached_blocks,
                        e.load_ratio
                    )
                })
                .collect();
            tracing::debug!(target: "kvrouter::global", cluster = %cluster.name, reason = ?decision.reason,
                estimates = %estimates.join("; "), "global decision");
        }
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
            Ok(Ok(r)) if !r.status().is_server_error() => {
                let tap = UsageTap::new(s.clone(), id);
                return Ok(respond(r, &cluster.name, Some(tap), idle));
            }
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
        Some((Some(r), name)) => Ok(respond(r, &name, None, idle)),
        Some((None, name)) => Err(ServeError::Upstream(format!(
            "cluster {name} (the last one tried) did not answer"
        ))),
        None => {
            s.metrics.no_cluster();
            Err(ServeError::Unavailable(GlobalError::NoCluster.to_string()))
        }
    }
}
