//! One request, from parse to last byte. The handler is four steps:
//! 1. parse: the body as JSON, its model, its stream flag; the headers' pin and admission fields;
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
mod continuation;
mod forward;
mod respond;

use crate::error::ServeError;
use crate::guard::log_line;
use crate::headers::{
    admission_fields, header_str, pin_from, AdmissionFields, GROUP_HEADER, SESSION_HEADERS,
};
use crate::provenance::Provenance;
use crate::routing::{routing_input, Kind, RoutingInput};
use crate::state::AppState;
use attempt::{attempt, Origin, Outcome};
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::Response;
use kvrouter_core::router::{Decision, Pin};
use serde_json::Value;
use std::time::Instant;

/// A parsed request: what every attempt at it needs.
pub(crate) struct Request {
    pub(crate) state: AppState,
    pub(crate) kind: Kind,
    /// The body as the client sent it (first attempts send it unchanged).
    pub(crate) raw: Bytes,
    /// The body as JSON (continuations extend it).
    pub(crate) body: Value,
    pub(crate) stream: bool,
    pub(crate) arrival: Instant,
    pub(crate) input: RoutingInput,
    pub(crate) pin: Option<Pin>,
    pub(crate) admission: AdmissionFields,
    session: Option<String>,
    group: Option<String>,
}

/// Handles `/v1/completions` and `/v1/chat/completions`.
pub(crate) async fn handle(
    state: AppState,
    kind: Kind,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, ServeError> {
    let arrival = Instant::now();
    let req = match parse(state.clone(), kind, &headers, raw, arrival).await {
        Ok(req) => req,
        Err(e) => return Err(count_error(&state, e)),
    };
    // First-N-of-M: a sibling of a group that has its N samples is not started at all.
    // Subscribe before looking, so a group satisfied in between is seen either way.
    let mut stop = match (req.admission.group, req.admission.group_need) {
        (Some(g), Some(_)) => {
            let rx = req.state.inner.group_stop(g);
            if req.state.inner.lock_core().group_satisfied(g) {
                return Ok(req.refuse());
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
        Ok(Outcome::Sent(sent)) => respond::respond(req, *sent, stop).await,
        Ok(Outcome::Stopped { logged: false }) => Ok(req.refuse()),
        Ok(Outcome::Stopped { logged: true }) => Ok(req.ended_by_group()),
        Err(e) => Err(count_error(&req.state, e)),
    }
}

/// Parses the body and headers, and turns the prompt into what the core routes on.
async fn parse(
    state: AppState,
    kind: Kind,
    headers: &HeaderMap,
    raw: Bytes,
    arrival: Instant,
) -> Result<Request, ServeError> {
    let body: Value = serde_json::from_slice(&raw)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !body.is_object() {
        return Err(ServeError::invalid("the body must be a JSON object", None));
    }
    {
        // The body's `model` must be one the workers serve (any, before they report theirs).
        let models = state.inner.models.read().expect("models lock");
        kvrouter_openai::request::check_model(&body, &models, true)?;
    }
    let stream = kvrouter_openai::request::stream_flags(&body)?.stream;
    let input = routing_input(&state, kind, &body).await?;
    let pin = pin_from(headers)?;
    let admission = admission_fields(headers, &body, arrival, &state.inner)?;
    let text = |names: &[&str]| header_str(headers, names).map(str::to_owned);
    Ok(Request {
        kind,
        raw,
        body,
        stream,
        arrival,
        input,
        pin,
        admission,
        session: text(&SESSION_HEADERS),
        group: text(&GROUP_HEADER),
        state,
    })
}

/// Counts a request that failed before its answer began.
fn count_error(state: &AppState, e: ServeError) -> ServeError {
    let mode = state.inner.config.router.router_mode;
    state
        .inner
        .metrics
        .requests
        .inc(&[("status", e.status_label()), ("mode", mode.as_str())]);
    e
}

impl Request {
    /// Counts a request that failed after its first attempt was placed.
    pub(crate) fn count_error(&self, e: ServeError) -> ServeError {
        count_error(&self.state, e)
    }

    /// Records the first placement: the router's overhead, the prompt length and cache hits.
    fn placed(&self, decision: &Decision) {
        let m = &self.state.inner.metrics;
        let isl = self.input.isl_tokens;
        m.overhead.observe(self.arrival.elapsed().as_secs_f64());
        m.isl.observe(isl as f64);
        if isl > 0 {
            m.kv_hit_rate
                .observe(decision.cached_tokens as f64 / isl as f64);
        }
    }

    /// The request's provenance line as far as the request itself says (with
    /// `--provenance-log`).
    fn provenance(&self) -> Option<Box<Provenance>> {
        self.state.inner.config.provenance.as_ref()?;
        Some(Box::new(Provenance {
            session: self.session.clone(),
            group: self.group.clone(),
            prompt_tokens: self.input.isl_tokens,
            ..Default::default()
        }))
    }

    /// A sibling whose group had its N samples before it was placed: counted and logged as
    /// aborted, answered with nothing.
    fn refuse(&self) -> Response {
        let mode = self.state.inner.config.router.router_mode;
        self.state
            .inner
            .metrics
            .requests
            .inc(&[("status", "aborted"), ("mode", mode.as_str())]);
        if let Some(mut p) = self.provenance() {
            p.abort_reason = Some("group-satisfied");
            log_line(&self.state, p, "aborted", None, self.arrival, None, None);
        }
        self.ended_by_group()
    }

    /// The whole answer of a request ended before it produced anything because its group has
    /// enough samples: finish reason `abort`, no output.
    fn ended_by_group(&self) -> Response {
        respond::group_satisfied(self.kind, self.stream, self.input.isl_tokens)
    }
}
