//! HTTP handlers.

use crate::config::MockEngineConfig;
use crate::driver::{Command, Delivery, Shared};
use crate::error::ApiError;
use crate::openai::{self, GenRequest, Kind, Usage};
use crate::submit::{async_stream, collect, submit};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvrouter_engine::Prompt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    config: MockEngineConfig,
    commands: mpsc::UnboundedSender<Command>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    kv_events: Option<String>,
    replay: Option<String>,
    created: u64,
    /// The checkpoint directory of the last `/update_weights` that named one (`model_path`).
    model_path: std::sync::Mutex<Option<String>>,
}

impl AppState {
    pub(crate) fn new(
        config: MockEngineConfig,
        commands: mpsc::UnboundedSender<Command>,
        shared: Arc<Shared>,
        kv_events: Option<String>,
        replay: Option<String>,
    ) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self {
            inner: Arc::new(Inner {
                config,
                commands,
                shared,
                next_id: AtomicU64::new(1),
                kv_events,
                replay,
                created,
                model_path: std::sync::Mutex::new(None),
            }),
        }
    }
}

impl AppState {
    /// The engine's settings.
    pub(crate) fn config(&self) -> &MockEngineConfig {
        &self.inner.config
    }

    /// A fresh request number (the engine request id, and the answer's id).
    pub(crate) fn next_request_number(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Where engine commands go.
    pub(crate) fn commands(&self) -> &mpsc::UnboundedSender<Command> {
        &self.inner.commands
    }

    /// When the server started (Unix seconds), the `created` of its answers.
    pub(crate) fn created(&self) -> u64 {
        self.inner.created
    }
}

/// The largest request body accepted.
const MAX_BODY_BYTES: usize = kvrouter_openai::MAX_REQUEST_BODY_BYTES;

/// The router of the mock engine's HTTP API.
pub fn app(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/responses", post(crate::responses::responses))
        .route("/v1/embeddings", post(crate::vectors::embeddings));
    let v1 = match state.inner.config.api_key.is_some() {
        true => v1.route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::auth::api_key,
        )),
        false => v1,
    };
    v1.route("/tokenize", post(crate::vectors::tokenize))
        .route("/detokenize", post(crate::vectors::detokenize))
        .route("/health", get(health))
        .route("/live", get(health))
        .route("/ready", get(health))
        .route("/metrics", get(metrics))
        .route("/server_info", get(server_info))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/update_weights", post(update_weights))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found(format!("no route for {}", uri.path()))
        })
        .method_not_allowed_fallback(|m: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::method_not_allowed(format!("{m} is not allowed on {}", uri.path()))
        })
        // Long RL and agentic prompts as token-id JSON run past axum's 2 MB default; past it,
        // axum's plain-text 413 is answered OpenAI-shaped, as every other error.
        .layer(axum::middleware::map_response(
            crate::error::shape_too_large,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// `/health`, `/live`, `/ready`: 200 while the engine runs; 503 once it has stopped (its task
/// ended: every request would get a 500), so probes and routers stop sending it traffic.
async fn health(State(s): State<AppState>) -> (StatusCode, Json<Value>) {
    if s.inner.commands.is_closed() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "engine stopped"})),
        );
    }
    (StatusCode::OK, Json(json!({"status": "ok"})))
}

/// The model's names, then each LoRA adapter with `parent` and `root` naming the base (vLLM's shape).
async fn models(State(s): State<AppState>) -> Json<Value> {
    let (c, created) = (&s.inner.config, s.inner.created);
    let base = &c.model_name;
    let max_model_len = c.engine.num_gpu_blocks * c.engine.block_size; // as `/tokenize` says
    let card = |id: &str, parent: Option<&str>| json!({"id": id, "object": "model", "created": created, "owned_by": "kvrouter-mock-engine", "root": parent.unwrap_or(id), "parent": parent, "max_model_len": max_model_len});
    let data: Vec<Value> = std::iter::once(card(base, None))
        .chain(c.model_aliases.iter().map(|a| card(a, None)))
        .chain(c.lora_adapters.iter().map(|a| card(a, Some(base))))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

struct PolicyState {
    policy_version: u64,
    paused: bool,
}

/// Where the KV events are, in the shape SGLang's `/server_info` uses, so routers discover both
/// the same way.
async fn server_info(State(s): State<AppState>) -> Json<Value> {
    let c = &s.inner.config;
    let split = |e: &Option<String>| -> (Value, Value) {
        match e
            .as_deref()
            .and_then(|e| e.strip_prefix("tcp://"))
            .and_then(|hp| hp.rsplit_once(':'))
        {
            Some((host, port)) => (json!(host), json!(port.parse::<u16>().ok())),
            None => (Value::Null, Value::Null),
        }
    };
    let (host, port) = split(&s.inner.kv_events);
    let (_, replay_port) = split(&s.inner.replay);
    let (policy_version, paused) = {
        let g = s.inner.shared.snapshot.lock().expect("snapshot lock");
        (g.policy_version, g.paused)
    };
    let snap = PolicyState {
        policy_version,
        paused,
    };
    Json(json!({
        "model": c.model_name,
        "engine": "kvrouter-mock-engine",
        "max_num_batched_tokens": c.engine.max_num_batched_tokens,
        "num_gpu_blocks": c.engine.num_gpu_blocks,
        "kv_events": {
            "publisher": if s.inner.kv_events.is_some() { "zmq" } else { "null" },
            "endpoint": s.inner.kv_events,
            "endpoint_host": host,
            "endpoint_port_base": port,
            "replay_endpoint": s.inner.replay,
            "replay_endpoint_port_base": replay_port,
            "topic": c.topic,
            "block_size": c.engine.block_size,
            "dp_size": 1,
            "dp_rank": c.dp_rank,
        },
        "policy_version": snap.policy_version,
        "paused": snap.paused,
        "model_path": *s.inner.model_path.lock().expect("model_path lock"),
    }))
}

/// `mode` of `/pause`, as vLLM spells it.
#[derive(serde::Deserialize)]
struct PauseQuery {
    mode: Option<String>,
}

/// Stops stepping: requests in flight and new ones wait until `/resume` (`?mode=keep`, the
/// default), or requests in flight end now with their partial output and finish reason `abort`
/// (`?mode=abort`).
async fn pause(
    State(s): State<AppState>,
    axum::extract::Query(q): axum::extract::Query<PauseQuery>,
) -> Result<Json<Value>, ApiError> {
    let abort = match q.mode.as_deref() {
        None | Some("keep") => false,
        Some("abort") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("unknown pause mode `{other}` (expected keep or abort)"),
                Some("mode"),
            ))
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    s.inner
        .commands
        .send(crate::driver::Command::Pause { abort, done: tx })
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    let aborted = rx
        .await
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    Ok(Json(json!({"paused": true, "aborted": aborted})))
}

async fn resume(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    control(&s, crate::driver::Command::Resume).await?;
    Ok(Json(json!({"paused": false})))
}

async fn control(
    s: &AppState,
    command: fn(tokio::sync::oneshot::Sender<()>) -> crate::driver::Command,
) -> Result<(), ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    s.inner
        .commands
        .send(command(tx))
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    rx.await
        .map_err(|_| ApiError::internal("the engine has stopped"))
}

/// Loads the weights of a policy version: takes the weight-load time, clears the prefix cache
/// (published as `AllBlocksCleared`) and serves `version` from then on.
async fn update_weights(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let v: Value = serde_json::from_slice(&body).map_err(ApiError::not_json)?;
    let version = v.get("version").and_then(Value::as_u64).ok_or_else(|| {
        ApiError::invalid("`version` must be a non-negative integer", Some("version"))
    })?;
    let clear_cache = match v.get("clear_cache") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "`clear_cache` must be a boolean",
                Some("clear_cache"),
            ))
        }
    };
    let model_path = match v.get("model_path") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(check_checkpoint(p, version).await?),
        Some(_) => {
            return Err(ApiError::invalid(
                "`model_path` must be a string",
                Some("model_path"),
            ))
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    s.inner
        .commands
        .send(crate::driver::Command::LoadWeights {
            version,
            clear_cache,
            done: tx,
        })
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    let version = rx
        .await
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    if let Some(p) = model_path {
        *s.inner.model_path.lock().expect("model_path lock") = Some(p);
    }
    Ok(Json(json!({"success": true, "policy_version": version})))
}

/// A `model_path` must be a checkpoint directory stamped with `version` (its `weights.json`,
/// as `kvrouter weights` writes it) whose every tensor matches the digest its marker records.
async fn check_checkpoint(path: &str, version: u64) -> Result<String, ApiError> {
    let dir = std::path::PathBuf::from(path);
    let bad = |m: String| ApiError::invalid(m, Some("model_path"));
    if !dir.is_dir() {
        return Err(bad(format!("`model_path` {path} is not a directory")));
    }
    let checked = tokio::task::spawn_blocking(move || {
        let marker = kvrouter_weights::checkpoint::read_marker(&dir)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("`model_path` {} has no weights.json", dir.display()))?;
        if marker.version != version {
            return Err(format!(
                "`model_path` {} holds version {}, not {version}",
                dir.display(),
                marker.version
            ));
        }
        kvrouter_weights::checkpoint::verify(&dir, &marker, 2).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| ApiError::internal(format!("checking the checkpoint: {e}")))?;
    checked.map_err(bad)?;
    Ok(path.to_string())
}

async fn metrics(State(s): State<AppState>) -> Response {
    let text = crate::metrics::render(&s.inner.shared, &s.inner.config);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    with_request_id(&headers, generate(s, body, Kind::Completion).await)
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    with_request_id(&headers, generate(s, body, Kind::Chat).await)
}

/// The request id header, logged (at debug, target `kvrouter_mock_engine::request`) and
/// echoed in the answer as engines do.
const REQUEST_ID: &str = "x-request-id";

/// The answer, with the caller's `x-request-id` echoed and logged.
fn with_request_id(headers: &HeaderMap, answer: Result<Response, ApiError>) -> Response {
    let mut response = answer.unwrap_or_else(IntoResponse::into_response);
    if let Some(id) = headers.get(REQUEST_ID) {
        tracing::debug!(
            target: "kvrouter_mock_engine::request",
            request_id = id.to_str().unwrap_or(""),
            status = response.status().as_u16(),
            "request"
        );
        response.headers_mut().insert(REQUEST_ID, id.clone());
    }
    response
}

/// A request body: a JSON object.
pub(crate) fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(ApiError::not_json)?;
    if !value.is_object() {
        return Err(ApiError::not_an_object());
    }
    Ok(value)
}

/// Bodies above this are parsed and tokenized on a blocking thread: the async threads serve
/// every stream (and, embedded in `serve --mock-workers`, the router too).
const OFF_TASK_BODY_BYTES: usize = 64 * 1024;

/// The request a body asks for: JSON, fields, prompt tokens.
fn gen_request(c: &MockEngineConfig, body: &[u8], kind: Kind) -> Result<GenRequest, ApiError> {
    let tokenizer = c.tokenizer.as_ref();
    Ok(match kind {
        Kind::Completion => openai::parse_completion(
            &openai::completion_body(body)?,
            &c.served_names(),
            tokenizer,
            c.default_max_tokens,
        )?,
        Kind::Chat => openai::parse_chat(
            &parse_object(body)?,
            &c.served_names(),
            tokenizer,
            &c.chat_template,
            c.default_max_tokens.max(128),
        )?,
    })
}

async fn generate(s: AppState, body: Bytes, kind: Kind) -> Result<Response, ApiError> {
    let req = if body.len() > OFF_TASK_BODY_BYTES {
        let inner = s.inner.clone();
        tokio::task::spawn_blocking(move || gen_request(&inner.config, &body, kind))
            .await
            .map_err(|e| ApiError::internal(format!("reading the request failed: {e}")))??
    } else {
        gen_request(&s.inner.config, &body, kind)?
    };
    let c = &s.inner.config;
    let tokenizer = c.tokenizer.as_ref();
    let param = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    let prompt = Prompt::Tokens {
        tokens: req.prompt_tokens.clone(),
        namespace: c.namespace_of(&req.model, req.cache_salt.as_deref()),
    };
    let (n, rx, guard) = submit(&s, prompt, req.max_tokens, param).await?;
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let rid = format!("{prefix}-mock-{n}");
    let model = req.model.clone();
    let created = s.inner.created;
    if !req.stream {
        let whole = collect(rx, guard, req.max_tokens as usize).await?;
        let text = tokenizer.decode(&whole.ids);
        let finish = if whole.aborted { "abort" } else { "length" };
        return Ok(Json(openai::full_body(
            kind,
            &rid,
            &model,
            created,
            &text,
            whole.usage,
            finish,
        ))
        .into_response());
    }
    let tokenizer = c.tokenizer.clone();
    let include_usage = req.include_usage;
    let stream = async_stream(rx, guard, move |event, first| match event {
        Delivery::Token { id } => {
            let text = tokenizer.decode(&[id]);
            vec![sse(&openai::chunk(
                kind, &rid, &model, created, &text, first, None,
            ))]
        }
        Delivery::Done {
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            aborted,
        } => {
            let usage = Usage {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            };
            let mut out = vec![sse(&openai::chunk(
                kind,
                &rid,
                &model,
                created,
                "",
                false,
                Some(if aborted { "abort" } else { "length" }),
            ))];
            if include_usage {
                out.push(sse(&openai::usage_chunk(
                    kind, &rid, &model, created, usage,
                )));
            }
            out.push(Bytes::from_static(kvrouter_openai::sse::DONE_EVENT));
            out
        }
        Delivery::Failed(e) => {
            let err = ApiError::internal(e);
            vec![
                sse(&err.body()),
                Bytes::from_static(kvrouter_openai::sse::DONE_EVENT),
            ]
        }
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("valid response"))
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(kvrouter_openai::sse::data_event(value))
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
