//! Placement without forwarding: the pick API (`POST /v1/pick`, its first-token and finish
//! reports) and ext_proc place a request exactly as a proxied one is placed (parse, the same
//! admission through the router queue, sessions, groups, policy versions, busy filters) and hand
//! back the chosen worker; the caller sends the request itself. The placement's load guard is
//! kept under a lease (`crate::picks`) or, for ext_proc, by its stream.

use super::attempt::{guard_for, Origin};
use super::parse::{count_error, parse_body, Request};
use super::pick_report;
use super::respond::{DecisionView, POLICY_VERSION, WORKER};
use crate::error::ServeError;
use crate::guard::LoadGuard;
use crate::picks::PickTable;
use crate::routing::Kind;
use crate::state::{stopped, AppState};
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use kvrouter_core::ids::RequestId;
use kvrouter_core::router::{Decision, RouteRequest};
use kvrouter_openai::Body;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// A placed request whose caller sends it itself.
pub(crate) struct Placed {
    pub(crate) id: RequestId,
    /// Releases its load: kept under a lease or by an ext_proc stream.
    pub(crate) guard: LoadGuard,
    pub(crate) decision: Decision,
    /// The chosen worker's base URL.
    pub(crate) url: String,
    pub(crate) prompt_tokens: u64,
}

/// The request kind a body is: a chat (it has `messages`), else a completion.
fn kind_of(body: &Body) -> Result<Kind, ServeError> {
    // A field set to null is a field left out (clients that write every field, unset ones as
    // null).
    let given = |key| body.contains_key(key) && !body.fields()[key].is_null();
    match (given("messages"), given("prompt")) {
        // Either would be dropped silently (found by probing).
        (true, true) => Err(ServeError::invalid(
            "a pick takes `messages` (a chat) or `prompt` (a completion), not both",
            Some("messages"),
        )),
        (true, false) => Ok(Kind::Chat),
        (false, _) => Ok(Kind::Completion),
    }
}

/// Places the request `body` (with its `headers`) as a proxied request would be placed, without
/// sending it, on one of the `allowed` workers when given (none: 503). `body` is the caller's
/// reading of the request (its error refuses the pick). Errors are counted as a proxied
/// request's are. `source` (`api`, `ext_proc`) marks its access line and trace, which the access
/// log and OTLP sample as they sample proxied requests: the line is written when the pick ends,
/// or here when it is refused.
pub(crate) async fn place(
    state: &AppState,
    source: &'static str,
    headers: &HeaderMap,
    body: Result<Body, ServeError>,
    arrival: Instant,
    allowed: Option<Vec<kvrouter_core::ids::WorkerId>>,
) -> Result<Placed, ServeError> {
    let config = &state.inner.config;
    let access = config.access_log.as_ref().is_some_and(|a| a.sampled());
    let trace = config.otel.as_ref().is_some_and(|o| o.sampled());
    // The model of a refused pick's access line (read only when the line is written).
    let model = access
        .then(|| {
            body.as_ref()
                .ok()?
                .fields()
                .get("model")?
                .as_str()
                .map(str::to_owned)
        })
        .flatten();
    let refused = |id: &axum::http::HeaderValue, e: ServeError| {
        if access {
            let ms = arrival.elapsed().as_secs_f64() * 1e3;
            crate::access::emit_error(id, (model.as_deref(), Some(source)), &e, ms);
        }
        e
    };
    let request_id = match state.inner.request_ids.take(headers) {
        Ok(id) => id,
        Err((id, e)) => return Err(refused(&id, count_error(state, e))),
    };
    let body = body.map_err(|e| refused(&request_id, count_error(state, e)))?;
    if allowed.as_ref().is_some_and(Vec::is_empty) {
        // None of the endpoints the caller allows is a worker.
        let e = ServeError::Route(kvrouter_core::router::RouteError::NoWorkers);
        return Err(refused(&request_id, count_error(state, e)));
    }
    let kind = kind_of(&body).map_err(|e| refused(&request_id, count_error(state, e)))?;
    let parsed = parse_body(
        state.clone(),
        (kind, None),
        headers,
        (Bytes::new(), body, None),
        arrival,
        request_id.clone(),
        (access, trace),
    )
    .await;
    let req = parsed.map_err(|e| refused(&request_id, count_error(state, e)))?;
    place_parsed(&req, allowed, source)
        .await
        .map_err(|e| refused(&request_id, req.count_error(e)))
}

async fn place_parsed(
    req: &Request,
    allowed: Option<Vec<kvrouter_core::ids::WorkerId>>,
    source: &'static str,
) -> Result<Placed, ServeError> {
    let inner = &req.state.inner;
    let mut stop = match (req.admission.group, req.admission.group_need) {
        (Some(g), Some(_)) => {
            let rx = inner.group_stop(g);
            if inner.lock_core().group_satisfied(g) {
                return Err(group_satisfied());
            }
            Some(rx)
        }
        _ => None,
    };
    let id = RequestId(inner.next_request.fetch_add(1, Ordering::Relaxed));
    let mut request = RouteRequest::new(id, req.input.isl_tokens, req.input.blocks.clone());
    request.pin = req.pin;
    // Only workers of the request's model pool, and of the caller's subset when it gave one.
    request.allowed_workers = match (allowed, req.pool.clone()) {
        (Some(subset), Some(pool)) => {
            Some(subset.into_iter().filter(|w| pool.contains(w)).collect())
        }
        (subset, pool) => subset.or(pool),
    };
    req.admission.apply(&mut request);
    let (decision, queued) = tokio::select! {
        d = super::admit::admit(&req.state, request) => d?,
        _ = stopped(&mut stop) => return Err(group_satisfied()),
    };
    req.placed(&decision);
    let mut guard = guard_for(req, id, &decision, &Origin::First, queued);
    guard.picked_by(source);
    let Some(url) = crate::registry::url_of(&req.state, decision.rank.worker) else {
        guard.retire();
        return Err(ServeError::Upstream(
            "the chosen worker was removed while it was placed".into(),
        ));
    };
    guard.answered(true);
    Ok(Placed {
        id,
        guard,
        decision,
        url,
        prompt_tokens: req.input.isl_tokens,
    })
}

/// The pick of a sibling whose group has its samples. Named by its header, not by the group's
/// internal key (a hash of the client's id, which the client would not recognise).
fn group_satisfied() -> ServeError {
    ServeError::Conflict(
        "this request's group (x-kvrouter-group-id) has the samples it needs \
         (x-kvrouter-group-need): this one need not run"
            .into(),
    )
}

/// The header of a pick body with binary token ids: the length in bytes of its JSON part, after
/// which come the prompt's token ids as 4-byte little-endian unsigned integers (the framing of
/// KServe's binary data extension, with our own header name).
const JSON_LENGTH: &str = "x-kvrouter-json-length";

/// A pick body's JSON part, and the token ids after it when [`JSON_LENGTH`] is given.
fn split_binary<'a>(
    headers: &HeaderMap,
    raw: &'a [u8],
) -> Result<(&'a [u8], Option<Vec<u32>>), ServeError> {
    let Some(length) = crate::headers::one(headers, JSON_LENGTH)? else {
        return Ok((raw, None));
    };
    let n = length
        .to_str()
        .ok()
        .and_then(crate::upstream::decimal_length)
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n <= raw.len())
        .ok_or_else(|| {
            ServeError::invalid(
                format!(
                    "{JSON_LENGTH} must be the length in bytes of the body's JSON part, at most \
                     the body's {} bytes",
                    raw.len()
                ),
                Some(JSON_LENGTH),
            )
        })?;
    let (json, tail) = raw.split_at(n);
    let ids = kvrouter_openai::body::ids_from_le_bytes(tail).ok_or_else(|| {
        ServeError::invalid(
            format!(
                "the {} bytes after the JSON part ({JSON_LENGTH}: {n}) must be token ids as \
                 4-byte little-endian integers: that is no multiple of 4",
                tail.len()
            ),
            Some(JSON_LENGTH),
        )
    })?;
    Ok((json, Some(ids)))
}

/// A pick body as read: the JSON, the reports of earlier picks it carries (its `reports`
/// field, taken out), and the binary token ids after the JSON ([`JSON_LENGTH`]).
type PickBody = (Body, Option<Vec<Value>>, Option<Vec<u32>>);

/// The body of a pick request: an OpenAI chat or completion body, or `{"token_ids": [...]}`
/// (the prompt as token ids; `model` optional), the ids possibly after the JSON in binary.
fn pick_body(headers: &HeaderMap, raw: &[u8]) -> Result<PickBody, ServeError> {
    let (json, ids) = split_binary(headers, raw)?;
    let mut body = Body::from_slice(json).map_err(|e| match ids {
        // A length that cuts the JSON short (or long) is the likelier fault.
        Some(_) => ServeError::invalid(
            format!(
                "the body's first {} bytes ({JSON_LENGTH}) are not valid JSON: {e}; is the \
                 length the JSON part's in bytes?",
                json.len()
            ),
            Some(JSON_LENGTH),
        ),
        None => ServeError::invalid(format!("the body is not valid JSON: {e}"), None),
    })?;
    if !body.is_object() {
        return Err(ServeError::invalid("the body must be a JSON object", None));
    }
    let reports = body
        .remove(pick_report::REPORTS)
        .map(pick_report::report_list)
        .transpose()?;
    Ok((body, reports, ids))
}

/// The rest of a pick body's checks, after its reports are out (and applied): binary token
/// ids, token ids as the prompt, and the base model when it names none.
fn pick_request(
    state: &AppState,
    mut body: Body,
    ids: Option<Vec<u32>>,
) -> Result<Body, ServeError> {
    if let Some(ids) = ids {
        body.set_token_ids(ids)?;
    }
    body.token_ids_as_prompt()?;
    if body.fields().get("model").is_none_or(Value::is_null) {
        // A pick may leave the model out: the base model is meant.
        let models = state.inner.models.read().expect("models lock");
        let model = models.first().cloned().unwrap_or_default();
        body.insert("model", Value::String(model));
    }
    Ok(body)
}

/// `POST /v1/pick`: applies the reports of earlier picks it carries (`reports`), then places
/// the request and answers the chosen worker, the pick's id, its lease, the score breakdown and
/// each report's outcome. Reports are applied once the body is read as a JSON object with a
/// valid `reports` list, also when the pick is then refused; a refusal then carries their
/// outcomes too (`reports` beside `error`).
pub(crate) async fn pick(table: &Arc<PickTable>, headers: HeaderMap, raw: Bytes) -> Response {
    let (outcomes, answer) = pick_reporting(table, headers, raw).await;
    match (answer, outcomes) {
        (Ok(r), _) => r,
        (Err(e), None) => e.into_response(),
        (Err(e), Some(outcomes)) => {
            let mut body = e.body();
            body[pick_report::REPORTS] = Value::Array(outcomes);
            let mut response = e.into_response();
            response
                .headers_mut()
                .remove(axum::http::header::CONTENT_LENGTH);
            *response.body_mut() = axum::body::Body::from(body.to_string());
            response
        }
    }
}

/// [`pick`]: the outcomes of the reports applied (when a refusal must carry them), and the
/// answer.
async fn pick_reporting(
    table: &Arc<PickTable>,
    headers: HeaderMap,
    raw: Bytes,
) -> (Option<Vec<Value>>, Result<Response, ServeError>) {
    let arrival = Instant::now();
    let state = table.state().clone();
    let (body, mut outcomes) = match pick_body(&headers, &raw) {
        Ok((body, reports, ids)) => (
            pick_request(&state, body, ids),
            reports.map(|r| pick_report::apply(table, r)),
        ),
        Err(e) => (Err(e), None),
    };
    let answer = placed_answer(table, &state, &headers, body, arrival, &mut outcomes).await;
    (outcomes, answer)
}

/// Places `body` (unless the pick table is full) and answers it, taking the reports' outcomes
/// into the answer; on a refusal they stay in `outcomes` for the error to carry.
async fn placed_answer(
    table: &Arc<PickTable>,
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Body, ServeError>,
    arrival: Instant,
    outcomes: &mut Option<Vec<Value>>,
) -> Result<Response, ServeError> {
    let config = &state.inner.config.picks;
    let body = if table.len() >= config.max_outstanding {
        Err(too_many(config.max_outstanding))
    } else {
        body
    };
    let placed = place(state, "api", headers, body, arrival, None).await?;
    let Placed {
        id,
        guard,
        decision,
        url,
        prompt_tokens,
        ..
    } = placed;
    let lease_ms = config.lease.as_millis() as u64;
    if let Err(full) = table.insert(
        id.0,
        guard,
        Instant::now() + config.lease,
        config.max_outstanding,
    ) {
        drop(full.0);
        return Err(too_many(config.max_outstanding));
    }
    let rank = decision.rank;
    let answer = Answer {
        id: table.id(id.0),
        object: "kvrouter.pick",
        worker: Chosen {
            id: rank.worker.0,
            url: &url,
            dp_rank: rank.dp_rank,
        },
        policy_version: decision.policy_version,
        prompt_tokens,
        cached_tokens: decision.cached_tokens,
        lease_ms,
        decision: DecisionView(&decision),
        reports: outcomes.take(),
    };
    // Written into a buffer sized for the candidates (`axum::Json` grows one from 128 bytes).
    let mut json = Vec::with_capacity(320 + 128 * decision.candidates.len());
    serde_json::to_writer(&mut json, &answer).map_err(|e| ServeError::Http {
        status: axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("the pick's answer could not be written: {e}"),
    })?;
    Ok((
        [
            (
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (WORKER, HeaderValue::from(rank.worker.0)),
            (POLICY_VERSION, HeaderValue::from(decision.policy_version)),
        ],
        json,
    )
        .into_response())
}

/// The answer of a pick, written straight to JSON.
#[derive(serde::Serialize)]
struct Answer<'a> {
    id: crate::picks::PickId,
    object: &'static str,
    worker: Chosen<'a>,
    policy_version: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    lease_ms: u64,
    decision: DecisionView<'a>,
    /// The outcome of each report the pick carried (absent when it carried none).
    #[serde(skip_serializing_if = "Option::is_none")]
    reports: Option<Vec<Value>>,
}

/// The chosen worker in a pick's answer.
#[derive(serde::Serialize)]
struct Chosen<'a> {
    id: u64,
    url: &'a str,
    dp_rank: u32,
}

fn too_many(max: usize) -> ServeError {
    ServeError::Http {
        status: crate::error::overloaded(),
        message: format!("{max} picks are outstanding (--pick-max-outstanding); retry later"),
    }
}
