//! Parse: the body as a JSON object, its model and stream flag; the headers' pin and admission
//! fields; the prompt turned into what the core routes on. What every attempt at the request
//! needs is one [`Request`].

use crate::error::ServeError;
use crate::headers::{
    admission_fields, header_str, pin_from, AdmissionFields, GROUP_HEADER, SESSION_HEADERS,
};
use crate::provenance::Provenance;
use crate::routing::{passthrough_input, routing_input, Kind, RoutingInput};
use crate::state::AppState;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::{Decision, Pin};
use kvrouter_openai::passthrough::Endpoint;
use kvrouter_openai::Body;
use std::time::Instant;

/// A parsed request: what every attempt at it needs.
pub(crate) struct Request {
    pub(crate) state: AppState,
    pub(crate) kind: Kind,
    /// A pass-through endpoint (`None`: a completion or chat, followed event by event).
    pub(crate) endpoint: Option<Endpoint>,
    /// Its `model` was checked against the models the workers serve (they listed some).
    pub(crate) model_served: bool,
    /// The body as the client sent it (first attempts send it unchanged).
    pub(crate) raw: Bytes,
    /// The body as JSON (continuations extend it).
    pub(crate) body: Body,
    pub(crate) stream: bool,
    pub(crate) arrival: Instant,
    pub(crate) input: RoutingInput,
    pub(crate) pin: Option<Pin>,
    /// The workers that serve its model (`None`: any).
    pub(crate) pool: Option<Vec<WorkerId>>,
    pub(crate) admission: AdmissionFields,
    session: Option<String>,
    group: Option<String>,
    /// The request's `x-request-id` (sent to the engine, returned to the client).
    pub(crate) request_id: HeaderValue,
    /// Whether the access log samples it.
    access: bool,
    /// Whether OTLP tracing samples it.
    trace: bool,
    /// When its prompt was tokenized and hashed.
    pub(crate) tokenized: Instant,
}

/// Bodies longer than this (256 KiB) are parsed, templated, tokenized and hashed on the
/// blocking pool rather than on the request's task: an 8 MB chat body's JSON and template alone
/// took 130–260 ms, during which a runtime worker served nothing else. Shorter ones parse in
/// well under a millisecond, less than the hand-off costs at that size.
pub(crate) const BIG_BODY_BYTES: usize = 256 << 10;

/// Parses the body and headers, and turns the prompt into what the core routes on.
pub(super) async fn parse(
    state: AppState,
    kind: (Kind, Option<Endpoint>),
    headers: &HeaderMap,
    raw: Bytes,
    arrival: Instant,
    request_id: HeaderValue,
    sampled: (bool, bool),
) -> Result<Request, ServeError> {
    let (body, input) = if raw.len() > BIG_BODY_BYTES {
        let (st, bytes) = (state.clone(), raw.clone());
        let (body, input) = crate::routing::off_task(&state, move || {
            let body = read_json(&bytes)?;
            // A body `parse_body` refuses before its prompt (not an object, an unknown model, a
            // bad stream flag) is not templated or tokenized here either.
            let input = (body.is_object() && passes_cheap_checks(&st, kind.1, &body))
                .then(|| crate::routing::routing_input_now(&st, kind, &body));
            Ok::<_, ServeError>((body, input))
        })
        .await??;
        (body, input)
    } else {
        (read_json(&raw)?, None)
    };
    parse_body(
        state,
        kind,
        headers,
        (raw, body, input),
        arrival,
        request_id,
        sampled,
    )
    .await
}

/// Whether `body` passes the checks [`parse_body`] makes before it reads the prompt: its model
/// and its stream flags.
fn passes_cheap_checks(state: &AppState, endpoint: Option<Endpoint>, body: &Body) -> bool {
    check_model(state, endpoint, body).is_ok()
        && kvrouter_openai::request::stream_flags(body.fields()).is_ok()
}

/// The body's `model`, which must be one the workers serve (any, before they report theirs),
/// and whether it was checked against theirs.
fn check_model(
    state: &AppState,
    endpoint: Option<Endpoint>,
    body: &Body,
) -> Result<(Option<String>, bool), ServeError> {
    let models = state.inner.models.read().expect("models lock");
    // vLLM's `/tokenize` and `/detokenize` take the model as optional.
    let required = !matches!(endpoint, Some(Endpoint::Tokenize | Endpoint::Detokenize));
    let model = kvrouter_openai::request::check_model(body.fields(), &models, required)?;
    Ok((model, !models.is_empty()))
}

fn read_json(raw: &[u8]) -> Result<Body, ServeError> {
    Body::from_slice(raw)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None))
}

/// [`parse`] of a body already read as JSON (`raw`: the bytes a first attempt sends);
/// `input`: its routing input when already computed (a big body's, on the blocking pool).
pub(super) async fn parse_body(
    state: AppState,
    (kind, endpoint): (Kind, Option<Endpoint>),
    headers: &HeaderMap,
    (raw, body, input): (Bytes, Body, Option<Result<RoutingInput, ServeError>>),
    arrival: Instant,
    request_id: HeaderValue,
    (access, trace): (bool, bool),
) -> Result<Request, ServeError> {
    if !body.is_object() {
        return Err(ServeError::invalid("the body must be a JSON object", None));
    }
    let (model, model_served) = check_model(&state, endpoint, &body)?;
    // Only the workers that serve the model (or adapter) may take it.
    let pool = model
        .as_deref()
        .and_then(|m| state.inner.pools.read().expect("pools lock").workers_for(m));
    let stream = kvrouter_openai::request::stream_flags(body.fields())?.stream;
    let input = match (input, endpoint) {
        (Some(input), _) => input?,
        (None, None) => routing_input(&state, kind, &body).await?,
        (None, Some(endpoint)) => passthrough_input(&state, endpoint, &body).await?,
    };
    let tokenized = Instant::now();
    let headers = crate::headers::routing_view(headers);
    let pin = pin_from(headers)?;
    let admission = admission_fields(headers, kind, body.fields(), arrival, &state.inner)?;
    let text = |names: &[&str]| header_str(headers, names).map(str::to_owned);
    Ok(Request {
        kind,
        endpoint,
        model_served,
        raw,
        body,
        stream,
        arrival,
        input,
        pin,
        pool,
        admission,
        session: text(&SESSION_HEADERS),
        group: text(&GROUP_HEADER),
        request_id,
        access,
        trace,
        tokenized,
        state,
    })
}

/// Counts a request that failed before its answer began.
pub(super) fn count_error(state: &AppState, e: ServeError) -> ServeError {
    let mode = state.inner.config.router.router_mode;
    state
        .inner
        .metrics
        .requests
        .inc(&[("status", e.status_label()), ("mode", mode.as_str())]);
    e
}

impl Request {
    /// The engine's path for this request.
    pub(crate) fn upstream_path(&self) -> &'static str {
        self.endpoint.map_or(self.kind.path(), Endpoint::path)
    }

    /// Counts a request that failed after it was parsed (with its `model` label).
    pub(crate) fn count_error(&self, e: ServeError) -> ServeError {
        self.count(e.status_label());
        e
    }

    /// Counts the request in `kvrouter_requests_total` as ending with `status`, where no load
    /// guard does (it had none, or its guard was retired for a continuation).
    pub(crate) fn count(&self, status: &str) {
        let mode = self.state.inner.config.router.router_mode;
        let metrics = &self.state.inner.metrics;
        // The label is the one the model's histograms carry (bounded: `ByModel::get`).
        let model = self
            .model()
            .map(|m| metrics.by_model.get(m, self.model_served));
        metrics.requests.inc(&[
            ("status", status),
            ("mode", mode.as_str()),
            ("model", model.as_ref().map_or("", |m| m.model())),
        ]);
    }

    /// Records the first placement: the router's overhead, the prompt length and cache hits.
    pub(super) fn placed(&self, decision: &Decision) {
        let m = &self.state.inner.metrics;
        let isl = self.input.isl_tokens;
        m.overhead.observe(self.arrival.elapsed().as_secs_f64());
        m.isl.observe(isl as f64);
        if isl > 0 {
            m.kv_hit_rate
                .observe(decision.cached_tokens as f64 / isl as f64);
        }
    }

    /// The body's `model`, if it names one.
    pub(crate) fn model(&self) -> Option<&str> {
        kvrouter_openai::request::model(self.body.fields())
    }

    /// The request's provenance line as far as the request itself says (with
    /// `--provenance-log`, or when the access log samples it).
    pub(super) fn provenance(&self) -> Option<Box<Provenance>> {
        if self.state.inner.config.provenance.is_none() && !self.access && !self.trace {
            return None;
        }
        Some(Box::new(Provenance {
            session: self.session.clone(),
            group: self.group.clone(),
            x_request_id: self.request_id.to_str().ok().map(str::to_owned),
            model: self.model().map(str::to_owned),
            access: self.access,
            trace: self.trace,
            prompt_tokens: self.input.isl_tokens,
            ..Default::default()
        }))
    }
}
