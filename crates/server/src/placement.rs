//! Placements for hosts that carry the request themselves (the ext_proc endpoint picker in
//! `kvrouter-ext-proc`): a request is placed exactly as a proxied one is (`request::pick`), and
//! the host feeds the [`Placement`] what it sees of the answer. Dropping a placement before its
//! end releases its load as cancelled, so a gateway stream that goes away releases it too.

use crate::error::ServeError;
use crate::guard::LoadGuard;
use crate::health::Source;
use crate::state::AppState;
use axum::http::HeaderMap;
use kvrouter_core::ids::WorkerId;
use std::time::Instant;

/// A request placed on a worker, whose answer does not pass through the router.
pub struct Placement {
    guard: Option<LoadGuard>,
    state: AppState,
    source: &'static str,
    worker: WorkerId,
    dp_rank: u32,
    url: String,
    fallbacks: Vec<String>,
    /// Placed from the request's body (else from its headers alone).
    body_known: bool,
}

/// Worker URLs whose endpoint a thread remembers ([`endpoint_of`]); past it, it starts over.
const ENDPOINTS_REMEMBERED: usize = 256;

/// `host:port` of a worker's base URL (the endpoint picker protocol's `IP:port`). Every
/// placement names its workers' endpoints, and parsing a URL (host normalisation, IDNA) cost
/// about 2 % of the picker's CPU, so each thread remembers the last few hundred.
pub fn endpoint_of(url: &str) -> Option<String> {
    use std::cell::RefCell;
    use std::collections::HashMap;
    thread_local! {
        static SEEN: RefCell<HashMap<String, Option<String>>> = RefCell::new(HashMap::new());
    }
    SEEN.with_borrow_mut(|seen| {
        if let Some(e) = seen.get(url) {
            return e.clone();
        }
        let e = parse_endpoint(url);
        if seen.len() >= ENDPOINTS_REMEMBERED {
            seen.clear();
        }
        seen.insert(url.to_owned(), e.clone());
        e
    })
}

fn parse_endpoint(url: &str) -> Option<String> {
    let parsed = reqwest::Url::parse(url).ok()?;
    let host = parsed.host_str()?;
    Some(format!("{host}:{}", parsed.port_or_known_default()?))
}

/// The registered workers whose endpoint (`host:port`) is in `endpoints`.
fn workers_at(state: &AppState, endpoints: &[String]) -> Vec<WorkerId> {
    let workers = state.inner.workers.lock().expect("workers lock");
    workers
        .iter()
        .filter(|(_, w)| endpoint_of(&w.entry.url).is_some_and(|e| endpoints.contains(&e)))
        .map(|(id, _)| *id)
        .collect()
}

/// Places the request `body` (an OpenAI chat or completion body) sent with `headers` as a
/// proxied request would be placed (the same queue, sessions, groups, policy versions), on one
/// of the workers at `subset` (`host:port`s) when given. `fallbacks`: how many next-best
/// workers to name too. `source` labels `kvrouter_picks_total`.
pub async fn place(
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    subset: Option<&[String]>,
    fallbacks: usize,
    source: &'static str,
) -> Result<Placement, ServeError> {
    let arrival = Instant::now();
    let value = kvrouter_openai::Body::from_slice(body)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None));
    place_value(state, headers, value, (subset, fallbacks, source), arrival).await
}

/// The header naming a request's model when a gateway takes it out of the body (the Gateway
/// API Inference Extension's body-based routing).
pub const MODEL_HEADER: &str = "x-gateway-model-name";

/// Places a request whose body is not known (a gateway that streams the body after the headers
/// were answered) from its `headers` alone: the session, pin and admission headers apply, the
/// model is the [`MODEL_HEADER`]'s (else the base model), and with no prompt to match, the
/// choice rests on load. Otherwise as [`place`].
pub async fn place_without_body(
    state: &AppState,
    headers: &HeaderMap,
    subset: Option<&[String]>,
    fallbacks: usize,
    source: &'static str,
) -> Result<Placement, ServeError> {
    let arrival = Instant::now();
    let value = match headers.get(MODEL_HEADER).map(|v| v.to_str()) {
        Some(Ok(m)) if !m.trim().is_empty() => Ok(m.trim().to_owned()),
        Some(_) => Err(ServeError::invalid(
            format!("{MODEL_HEADER} must be a model name"),
            Some(MODEL_HEADER),
        )),
        None => {
            let models = state.inner.models.read().expect("models lock");
            Ok(models.first().cloned().unwrap_or_default())
        }
    }
    .map(|model| serde_json::json!({"model": model, "prompt": ""}).into());
    let mut placed =
        place_value(state, headers, value, (subset, fallbacks, source), arrival).await?;
    placed.body_known = false;
    Ok(placed)
}

async fn place_value(
    state: &AppState,
    headers: &HeaderMap,
    value: Result<kvrouter_openai::Body, ServeError>,
    (subset, fallbacks, source): (Option<&[String]>, usize, &'static str),
    arrival: Instant,
) -> Result<Placement, ServeError> {
    // None of the endpoints the gateway allows being a worker answers 503 (the protocol's).
    let allowed = subset.map(|s| workers_at(state, s));
    let placed =
        crate::request::pick::place(state, source, headers, value, arrival, allowed).await?;
    let rank = placed.decision.rank;
    let mut others: Vec<_> = placed
        .decision
        .candidates
        .iter()
        .filter(|c| c.rank.worker != rank.worker)
        .collect();
    others.sort_by(|a, b| a.total.total_cmp(&b.total));
    let mut fallback_urls = Vec::new();
    for c in others {
        if fallback_urls.len() >= fallbacks {
            break;
        }
        if let Some(url) = crate::registry::url_of(state, c.rank.worker) {
            if url != placed.url && !fallback_urls.contains(&url) {
                fallback_urls.push(url);
            }
        }
    }
    Ok(Placement {
        guard: Some(placed.guard),
        state: state.clone(),
        source,
        worker: rank.worker,
        dp_rank: rank.dp_rank,
        url: placed.url,
        fallbacks: fallback_urls,
        body_known: true,
    })
}

impl Placement {
    /// The chosen worker's id.
    pub fn worker(&self) -> u64 {
        self.worker.0
    }

    /// The data-parallel rank the request was counted on.
    pub fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    /// The chosen worker's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The next-best workers' base URLs, best first.
    pub fn fallback_urls(&self) -> &[String] {
        &self.fallbacks
    }

    /// Whether it was placed from the request's body (else from its headers alone, with
    /// [`place_without_body`]).
    pub fn body_known(&self) -> bool {
        self.body_known
    }

    /// The worker answered with HTTP `status`; `stream`: as an event stream (which tells a
    /// placement made without the body how to read the answer's usage).
    pub fn answered(&mut self, status: u16, stream: bool) {
        if let Some(g) = self.guard.as_mut() {
            g.answered_status(status);
            if !self.body_known {
                g.set_stream(stream);
            }
        }
    }

    /// A chunk of the answer came back (the first one ends the prefill).
    pub fn on_chunk(&mut self, chunk: &[u8]) {
        if let Some(g) = self.guard.as_mut() {
            g.on_chunk(chunk);
        }
    }

    /// The answer began without its body being seen (the gateway sends only its headers): its
    /// prefill is taken as over now, as a first chunk would mark it.
    pub fn first_token(&mut self) {
        if let Some(g) = self.guard.as_mut() {
            g.first_token();
        }
    }

    /// The answer ended: `ok` (the worker answered with success) releases the load as
    /// finished, else as failed (counted toward the worker's health).
    pub fn end(self, ok: bool) {
        self.end_with(ok, true);
    }

    /// As [`Placement::end`] for an answer whose body was not seen: its output length is not
    /// known, so neither the cost policy nor the output length histogram learns one.
    pub fn end_unmeasured(self, ok: bool) {
        self.end_with(ok, false);
    }

    fn end_with(mut self, ok: bool, measured: bool) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        let metrics = &self.state.inner.metrics;
        if ok {
            guard.answered(true);
            if measured {
                guard.finish();
            } else {
                guard.finish_unmeasured();
            }
            metrics
                .picks
                .inc(&[("source", self.source), ("end", "finished")]);
        } else {
            guard.answered(false);
            self.state
                .observe_health(self.worker, false, Source::Request);
            metrics
                .picks
                .inc(&[("source", self.source), ("end", "failed")]);
            guard.fail();
        }
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        if self.guard.take().is_some() {
            self.state
                .inner
                .metrics
                .picks
                .inc(&[("source", self.source), ("end", "cancelled")]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_endpoints_are_the_parsed_ones_past_the_bound_too() {
        let urls = [
            "http://127.0.0.1:8000",
            "http://Worker-A.local:9000/v1",
            "https://engine.example",
            "http://127.1:80/",
            "not a url",
        ];
        for round in 0..3 {
            for u in urls {
                assert_eq!(endpoint_of(u), parse_endpoint(u), "{u} (round {round})");
            }
            // More distinct URLs than a thread remembers: it starts over, still right.
            for port in 0..ENDPOINTS_REMEMBERED as u16 + 10 {
                let u = format!("http://10.0.0.1:{}", 20_000 + port);
                assert_eq!(endpoint_of(&u), Some(format!("10.0.0.1:{}", 20_000 + port)));
            }
        }
        assert_eq!(
            endpoint_of("http://127.1:80/").as_deref(),
            Some("127.0.0.1:80")
        );
        assert_eq!(
            endpoint_of("https://engine.example").as_deref(),
            Some("engine.example:443")
        );
        assert_eq!(endpoint_of("not a url"), None);
    }
}
