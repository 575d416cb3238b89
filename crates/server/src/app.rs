//! The HTTP surface: OpenAI endpoints, health, metrics and the token-protected admin API.

use crate::auth;
use crate::config::{SessionReleaseAuth, WorkerEntry};
use crate::edge::Edge;
use crate::endpoints;
use crate::error::ServeError;
use crate::picks::PickTable;
use crate::registry;
use crate::routing::Kind;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use kvrouter_core::event::Medium;
use kvrouter_core::ids::WorkerId;
use serde_json::{json, Value};
use std::sync::Arc;

/// The router of `kvrouter serve`'s HTTP API behind its [`Edge`]. Every error it produces
/// itself, including axum's rejections, unknown routes and wrong methods, is OpenAI-shaped JSON.
pub fn app(state: AppState) -> Edge {
    // The token is checked before the path or body is parsed, and for unknown admin paths too.
    let admin = Router::new()
        .route("/workers", get(list_workers).post(add_worker))
        .route("/workers/{id}", delete(remove_worker))
        .route("/workers/{id}/pause", post(pause_worker))
        .route("/workers/{id}/resume", post(resume_worker))
        .route("/workers/{id}/policy-version", post(set_policy_version))
        .route("/policy", get(policy_status))
        .route("/trace", get(trace))
        .route("/policy/update", post(policy_update))
        .route(
            "/cluster-summary",
            get(crate::cluster_summary::get)
                .with_state(crate::cluster_summary::Publisher::new(state.clone())),
        )
        .route("/planner", get(planner_status))
        .fallback(crate::error::unknown_route)
        .method_not_allowed_fallback(crate::error::wrong_method)
        .layer(from_fn_with_state(state.clone(), auth::admin));
    // Outstanding picks live with the pick routes: dropping the router ends them.
    let picks = Arc::new(PickTable::new(state.clone()));
    let sessions = Router::new()
        .route("/v1/sessions/{id}", delete(release_session))
        .route("/finish_session", post(finish_session))
        .route_layer(from_fn_with_state(state.clone(), auth::session_release));
    let picking = Router::new()
        .route("/v1/pick", post(pick).with_state(picks.clone()))
        .route(
            "/v1/pick/{id}/first-token",
            post(pick_first_token).with_state(picks.clone()),
        )
        .route(
            "/v1/pick/reports",
            post(pick_reports).with_state(picks.clone()),
        )
        .route("/v1/pick/{id}/finish", post(pick_finish).with_state(picks));
    // The check is a layer only where it can refuse (a layer costs every call).
    let picking = match state.inner.config.picks.auth {
        SessionReleaseAuth::Open => picking,
        SessionReleaseAuth::Admin => {
            picking.route_layer(from_fn_with_state(state.clone(), auth::pick))
        }
    };
    let data = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(endpoints::models))
        .route("/v1/models/{id}", get(endpoints::model))
        .route("/v1/responses", post(endpoints::responses))
        .route("/v1/embeddings", post(endpoints::embeddings))
        .route("/tokenize", post(endpoints::tokenize))
        .route("/detokenize", post(endpoints::detokenize))
        .merge(sessions)
        .merge(picking);
    // Only with API keys: a layer costs every call.
    let data = match state.inner.config.api_keys.is_empty() {
        true => data,
        false => data.route_layer(from_fn_with_state(state.clone(), auth::api_key)),
    };
    // Probes and metrics stay open: load balancers and scrapers carry no key.
    let routes = data
        .route("/health", get(health))
        .route("/live", get(live))
        .route("/ready", get(health))
        .route("/metrics", get(metrics))
        .nest("/admin", admin)
        .fallback(crate::error::unknown_route)
        .method_not_allowed_fallback(crate::error::wrong_method)
        .with_state(state);
    // Long RL and agentic prompts as token-id JSON run past axum's 2 MB default body limit:
    // the edge sets the router's own.
    Edge::new(routes)
}

async fn chat(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    crate::request::handle(s, Kind::Chat, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    crate::request::handle(s, Kind::Completion, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn pick(State(t): State<Arc<PickTable>>, headers: HeaderMap, body: Bytes) -> Response {
    crate::request::pick::pick(&t, headers, body).await
}

async fn pick_first_token(State(t): State<Arc<PickTable>>, Path(id): Path<String>) -> Response {
    match crate::request::pick_report::first_token(&t, &id) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn pick_finish(
    State(t): State<Arc<PickTable>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    match crate::request::pick_report::finish(&t, &id, &body) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn pick_reports(State(t): State<Arc<PickTable>>, body: Bytes) -> Response {
    match crate::request::pick_report::batch(&t, &body) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn live() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn health(State(s): State<AppState>) -> Response {
    let workers = s.inner.workers.lock().expect("workers lock").len();
    let status = if workers > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"status": if workers > 0 { "ok" } else { "no workers" }, "workers": workers})),
    )
        .into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    let out = crate::metrics_page::render(&s);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn release_session(State(s): State<AppState>, Path(id): Path<String>) -> Json<Value> {
    let released = s
        .inner
        .lock_core()
        .release_session(crate::headers::session_key(&id));
    Json(json!({"session_id": id, "released": released}))
}

async fn finish_session(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ServeError> {
    let id = crate::headers::finish_session_id(&body)?;
    let released = s
        .inner
        .lock_core()
        .release_session(crate::headers::session_key(&id));
    Ok(Json(json!({"session_id": id, "released": released})))
}

async fn list_workers(State(s): State<AppState>) -> Result<Json<Value>, ServeError> {
    let entries: Vec<(WorkerEntry, bool)> = s
        .inner
        .workers
        .lock()
        .expect("workers lock")
        .values()
        .map(|r| (r.entry.clone(), r.draining))
        .collect();
    let core = s.inner.lock_core();
    let cached = core.index().holder_counts();
    let predicted = core.predicted_blocks();
    let list: Vec<Value> = entries
        .into_iter()
        .map(|(e, leaving)| {
            let id = WorkerId(e.id.unwrap_or_default());
            let ranks: Vec<Value> = core
                .ranks()
                .iter()
                .filter(|r| r.worker == id)
                .map(|r| {
                    let l = core.load(*r);
                    let gpu = cached.iter().find(|(cr, m, _)| cr == r && *m == Medium::Gpu).map_or(0, |c| c.2);
                    let mut rank = json!({"dp_rank": r.dp_rank, "active_requests": l.active_requests, "active_prefill_tokens": l.active_prefill_tokens, "active_decode_blocks": l.active_decode_blocks, "cached_gpu_blocks": gpu});
                    // Only for workers whose cache the router predicts from its own routing.
                    if core.predicts(r.worker) {
                        let p = predicted.iter().find(|(pr, _)| pr == r).map_or(0, |c| c.1);
                        rank["predicted_gpu_blocks"] = json!(p);
                    }
                    rank
                })
                .collect();
            // `leaving`: removed by its discovery source, draining until purged.
            let state = if leaving { "leaving" } else { worker_state(&core, id) };
            json!({"id": id.0, "state": state, "policy_version": core.workers().find(|w| w.id == id).map_or(0, |w| w.policy_version), "url": e.url, "kv_events_endpoint": e.kv_events_endpoint, "replay_endpoint": e.replay_endpoint, "dp_size": e.dp_size, "block_size": e.block_size, "max_num_batched_tokens": e.max_num_batched_tokens, "kv_capacity_blocks": e.kv_capacity_blocks, "labels": e.labels, "profile": e.profile, "ranks": ranks})
        })
        .collect();
    Ok(Json(json!({"workers": list})))
}

async fn add_worker(State(s): State<AppState>, body: Bytes) -> Result<Response, ServeError> {
    let entry: WorkerEntry = crate::error::parse_json(&body, "worker")?;
    let id = registry::add_worker(&s, entry).await?;
    Ok((StatusCode::CREATED, Json(json!({"id": id.0}))).into_response())
}

async fn pause_worker(
    State(s): State<AppState>,
    Path(id): Path<u64>,
) -> Result<Json<Value>, ServeError> {
    set_paused(s, id, true)
}

async fn resume_worker(
    State(s): State<AppState>,
    Path(id): Path<u64>,
) -> Result<Json<Value>, ServeError> {
    set_paused(s, id, false)
}

/// Elastic membership: takes a worker out of rotation or puts it back, without marking it failed
/// and keeping its load accounting (requests in flight on it finish normally).
fn set_paused(s: AppState, id: u64, paused: bool) -> Result<Json<Value>, ServeError> {
    if !s.inner.lock_core().set_paused(WorkerId(id), paused) {
        return Err(ServeError::NotFound(format!("no worker {id}")));
    }
    if !paused {
        // Queued requests may fit on it now.
        s.inner.wake_queue();
    }
    tracing::info!("worker {id} {}", if paused { "paused" } else { "resumed" });
    Ok(Json(
        json!({"id": id, "state": if paused { "paused" } else { "serving" }}),
    ))
}

/// Records that a worker now serves another policy version (it loaded new weights). Its cache
/// picture is cleared: blocks computed under the old weights must not attract new requests.
/// Requests waiting for that version are placed.
async fn set_policy_version(
    State(s): State<AppState>,
    Path(id): Path<u64>,
    body: Bytes,
) -> Result<Json<Value>, ServeError> {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    let version = v.get("version").and_then(Value::as_u64).ok_or_else(|| {
        ServeError::invalid("`version` must be a non-negative integer", Some("version"))
    })?;
    let mut core = s.inner.lock_core();
    if !core.set_policy_version(WorkerId(id), version) {
        return Err(ServeError::NotFound(format!("no worker {id}")));
    }
    if core.config().kv_retention == kvrouter_core::router::KvRetention::Flush {
        core.clear_worker_cache(WorkerId(id));
    }
    drop(core);
    s.inner.wake_queue();
    tracing::info!("worker {id} serves policy version {version}");
    Ok(Json(json!({"id": id, "policy_version": version})))
}

async fn remove_worker(
    State(s): State<AppState>,
    Path(id): Path<u64>,
) -> Result<Json<Value>, ServeError> {
    let (worker, entry) = (WorkerId(id), registry::remove_worker(&s, WorkerId(id))?);
    crate::update::worker_removed(&s, worker, &entry); // a weight update goes on without it
    Ok(Json(json!({"removed": id, "url": entry.url})))
}

/// A worker's state: serving, draining, updating, paused (operator, failed update), unhealthy.
fn worker_state(core: &kvrouter_core::router::Router, id: WorkerId) -> &'static str {
    use kvrouter_core::router::UpdatePhase;
    match core.update_phase(id) {
        Some(UpdatePhase::Draining) => return "draining",
        Some(UpdatePhase::Updating | UpdatePhase::Loaded) => return "updating",
        _ => {}
    }
    if core.held_elsewhere(id) {
        // Another replica drives the update (`--replica-sync`).
        return "updating";
    }
    if core.is_paused(id) {
        "paused"
    } else if core.is_available(id) {
        "serving"
    } else {
        "unhealthy"
    }
}

/// `GET /admin/policy`: each worker's version and state, and the running (or last) update cycle.
async fn policy_status(State(s): State<AppState>) -> Result<Json<Value>, ServeError> {
    // With replica sync: the replica driving an update, and its progress.
    let lease = crate::replica::lease::holder(&s).await;
    let cycle = update_progress(&s);
    let core = s.inner.lock_core();
    let workers: Vec<Value> = core
        .workers()
        .map(|w| json!({"id": w.id.0, "policy_version": w.policy_version, "state": worker_state(&core, w.id)}))
        .collect();
    Ok(Json(json!({
        "newest_policy_version": core.newest_policy_version(),
        "kv_retention": core.config().kv_retention.as_str(),
        "workers": workers,
        "update": cycle,
        "update_lease": lease,
    })))
}

/// This replica's running (or last) update cycle, as `GET /admin/policy` shows it.
fn update_progress(s: &AppState) -> Option<Value> {
    let core = s.inner.lock_core();
    core.update_status().map(|u| {
        let phases: serde_json::Map<String, Value> = u
            .phases
            .iter()
            .map(|(w, p)| (w.0.to_string(), json!(p)))
            .collect();
        json!({
            "version": u.plan.version,
            "mode": u.plan.mode.as_str(),
            "batch": u.plan.batch,
            "running": u.finished.is_none(),
            "done": u.done,
            "total": u.total,
            "phases": phases,
            "elapsed_ms": u.finished.unwrap_or(s.inner.now()).since(u.started).as_secs_f64() * 1e3,
        })
    })
}

/// `POST /admin/policy/update`: starts a weight-update cycle; answers 202 at once. Progress is
/// at `GET /admin/policy`.
async fn policy_update(State(s): State<AppState>, body: Bytes) -> Result<Response, ServeError> {
    let update: crate::update::UpdateBody = crate::error::parse_json(&body, "update")?;
    let version = update.version;
    // Checked first (the source may take a minute to answer): nothing is held meanwhile.
    let prepared = crate::update::prepare(&s, update).await?;
    // With replica sync, one replica drives an update at a time. Nothing awaits between the
    // lease and its renewal task.
    let lease = crate::replica::lease::acquire(&s).await?;
    let started = prepared.begin(&s);
    if let Some(taken) = &lease {
        // Renewed while the cycle runs; given up at once if it did not start.
        crate::replica::lease::hold(s.clone(), taken.revision, update_progress);
    }
    started?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"version": version, "status": "started"})),
    )
        .into_response())
}

/// `GET /admin/planner`: each model pool's recommended workers with their reasons and the
/// signals they came from (`--planner-advise`; 404 without it).
async fn planner_status(State(s): State<AppState>) -> Result<Json<Value>, ServeError> {
    match &s.inner.planner {
        Some(p) => {
            let mut status = p.status();
            if let Some(act) = &s.inner.planner_act {
                status["actuation"] = act.status();
            }
            Ok(Json(status))
        }
        None => Err(ServeError::NotFound(
            "the planner's advisory mode is off: start serve with --planner-advise".into(),
        )),
    }
}

/// `GET /admin/trace`: the recent request timelines as Chrome trace JSON (open in Perfetto).
async fn trace(State(s): State<AppState>) -> Result<Json<Value>, ServeError> {
    let capture = s.inner.capture.as_ref().ok_or_else(|| {
        ServeError::NotFound("trace capture is off (start with --trace-capture N)".into())
    })?;
    Ok(Json(capture.document(s.inner.epoch)))
}
