//! One request, from parse to last byte. The handler is four steps:
//! 1. parse (`parse.rs`): the body as JSON, its model, its stream flag; the headers' pin and admission fields;
//! 2. route request: its prompt tokenized and hashed into blocks (`routing`);
//! 3. attempt (`attempt.rs`): placed (through the router queue), guarded, sent, retried;
//! 4. respond (`respond.rs`): headers, then the body through the one forwarder (`forward.rs`),
//!    which feeds the upstream's bytes to the pure continuation machine (`continuation.rs`) and
//!    continues the answer elsewhere when it says so (with `attempt` again).
//!
//! The load the core recorded for each attempt is released by its guard (`guard.rs`), which
//! lives in the response body, so a client disconnect or a dropped stream still releases it.

mod admit;
mod attempt;
mod coalesce;
mod continuation;
mod forward;
mod parse;
pub(crate) mod pick;
pub(crate) mod pick_report;
mod respond;

use crate::error::ServeError;
use crate::request_line::log_line;
use crate::routing::Kind;
use crate::state::AppState;
use attempt::{attempt, Origin, Outcome};
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use kvrouter_openai::passthrough::Endpoint;
use parse::Request;
use parse::{count_error, parse};
use std::time::Instant;

/// Handles `/v1/completions` and `/v1/chat/completions`: the answer, with the request's
/// `x-request-id`, and its access line when the router refused it before a worker answered
/// (lines of answered requests are written when they end, by `request_line::log_line`).
pub(crate) async fn handle(
    state: AppState,
    kind: Kind,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, ServeError> {
    serve(state, kind, None, headers, raw).await
}

/// Handles a pass-through endpoint (`/v1/responses`, `/v1/embeddings`, `/tokenize`,
/// `/detokenize`): parsed, admitted, placed and retried as completions are, its answer passed to
/// the client unchanged (never continued elsewhere).
pub(crate) async fn pass_through(
    state: AppState,
    endpoint: Endpoint,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, ServeError> {
    // `kind` shapes only the empty answer of a first-N-of-M sibling ended before it started.
    serve(state, Kind::Completion, Some(endpoint), headers, raw).await
}

async fn serve(
    state: AppState,
    kind: Kind,
    endpoint: Option<Endpoint>,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, ServeError> {
    let arrival = Instant::now();
    let access = state
        .inner
        .config
        .access_log
        .as_ref()
        .is_some_and(|a| a.sampled());
    let trace = state
        .inner
        .config
        .otel
        .as_ref()
        .is_some_and(|o| o.sampled());
    let mut model = None;
    let (id, answered) = match state.inner.request_ids.take(&headers) {
        Ok(id) => {
            let at = (arrival, id.clone(), (access, trace));
            (
                id,
                answer(
                    state.clone(),
                    (kind, endpoint),
                    &headers,
                    raw,
                    at,
                    &mut model,
                )
                .await,
            )
        }
        Err((id, e)) => (id, Err(count_error(&state, e))),
    };
    let mut response = answered.unwrap_or_else(|e| {
        if access {
            let ms = arrival.elapsed().as_secs_f64() * 1e3;
            crate::access::emit_error(&id, (model.as_deref(), None), &e, ms);
        }
        e.into_response()
    });
    response
        .headers_mut()
        .insert(crate::access::REQUEST_ID_HEADER, id);
    Ok(response)
}

/// Parses, places and answers one request; an error is one the router made before a worker
/// answered (its access line is the caller's to write), and `model` is the body's once parsed.
async fn answer(
    state: AppState,
    (kind, endpoint): (Kind, Option<Endpoint>),
    headers: &HeaderMap,
    raw: Bytes,
    (arrival, id, sampled): (Instant, HeaderValue, (bool, bool)),
    model: &mut Option<String>,
) -> Result<Response, ServeError> {
    let req = match parse(
        state.clone(),
        (kind, endpoint),
        headers,
        raw,
        arrival,
        id,
        sampled,
    )
    .await
    {
        Ok(req) => req,
        Err(e) => return Err(count_error(&state, e)),
    };
    *model = req.model().map(str::to_owned);
    // First-N-of-M: a sibling of a group that has its N samples is not started at all.
    // Subscribe before looking, so a group satisfied in between is seen either way.
    let mut stop = match (req.admission.group, req.admission.group_need) {
        (Some(g), Some(_)) => {
            let rx = req.state.inner.group_stop(g);
            if req.state.inner.lock_core().group_satisfied(g) {
                return Ok(refuse(&req));
            }
            Some(rx)
        }
        _ => None,
    };
    let mut tried = Vec::new();
    let sent = attempt(
        &req,
        &req.raw,
        &req.input,
        Origin::First,
        &mut tried,
        &mut stop,
    )
    .await;
    match sent {
        // The guard in the answer writes its line, also when answering fails.
        Ok(Outcome::Sent(sent)) => Ok(respond::respond(req, *sent, stop)
            .await
            .unwrap_or_else(IntoResponse::into_response)),
        Ok(Outcome::Stopped { logged: false }) => Ok(refuse(&req)),
        Ok(Outcome::Stopped { logged: true }) => Ok(ended_by_group(&req)),
        Err(e) => Err(req.count_error(e)),
    }
}

/// A sibling whose group had its N samples before it was placed: counted and logged as
/// aborted, answered with nothing.
fn refuse(req: &Request) -> Response {
    req.count("aborted");
    if let Some(mut p) = req.provenance() {
        p.abort_reason = Some("group-satisfied");
        log_line(&req.state, p, "aborted", None, req.arrival, None, None);
    }
    ended_by_group(req)
}

/// The whole answer of a request ended before it produced anything because its group has
/// enough samples: finish reason `abort`, no output.
fn ended_by_group(req: &Request) -> Response {
    respond::group_satisfied(req, req.stream)
}
