//! The response: status and headers (the serving worker, its policy version, the decision with
//! `--expose-decisions`), then the body through the one forwarder.

use super::attempt::Sent;
use super::continuation::{Continuation, Follow};
use super::forward::{self, Flow, Read};
use super::parse::Request;
use crate::error::ServeError;
use crate::health::Source;
use axum::body::Body;
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::Decision;
use kvrouter_openai::first_n;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::watch;

/// Answers with the first attempt's response, continued where the machine says so.
pub(crate) async fn respond(
    req: Request,
    sent: Sent,
    mut stop: Option<watch::Receiver<bool>>,
) -> Result<Response, ServeError> {
    let Sent {
        response,
        mut guard,
        decision,
    } = sent;
    let worker = decision.rank.worker;
    let status = response.status();
    let config = &req.state.inner.config;
    let (expose, limit) = (config.expose_decisions, config.migration_limit);
    // Streams are followed event by event when they may have to be continued elsewhere:
    // migration on failure, or a weight update's abort (the admin API is on), or a first-N-of-M
    // sample's end. Others pass through; their first event carries the version serving it all.
    let continuable = limit > 0 || config.admin_token.is_some() || stop.is_some();
    let unmigratable = kvrouter_openai::continuation::unmigratable(&req.body);
    let (kind, isl, version) = (req.kind, req.input.isl_tokens, decision.policy_version);
    let passed_through = req.endpoint.is_some();
    if !req.stream && status.is_success() && !passed_through {
        let passed = response.passed_headers().to_vec();
        // Read whole (it is one JSON object): stamped with the policy version, and continued
        // if a weight update aborted it.
        let first = match forward::read(&req.state, response, &mut guard, &mut stop).await {
            Read::Body(b) => b,
            Read::Stopped => return Ok(group_satisfied(&req, false)),
            Read::Failed(e) => {
                req.state.observe_health(worker, false, Source::Request);
                guard.end_failed();
                let e = ServeError::Upstream(format!("worker {worker}: {e}"));
                return Err(req.count_error(e));
            }
        };
        let follow = Follow::Events {
            migration_limit: limit,
        };
        let machine = Continuation::new(kind, follow, version, isl, unmigratable);
        let flow = Flow::new(req, machine, worker, stop);
        let (out, worker, version) = forward::whole(flow, first, guard).await?;
        let builder = Response::builder()
            .status(status)
            .header("content-type", "application/json");
        let builder = headers(builder, &passed, worker, version, &decision, expose);
        return Ok(builder.body(Body::from(out)).expect("valid response"));
    }
    let mut builder = Response::builder().status(status);
    if let Some(ct) = response.content_type() {
        builder = builder.header("content-type", ct.clone());
    }
    let passed = response.passed_headers();
    let builder = headers(builder, passed, worker, version, &decision, expose);
    // A streamed answer is SSE unless the worker said otherwise (a JSON body answering a
    // streamed request goes out as it came, not checked for events).
    let json = response.content_type().is_some_and(|ct| {
        // Media types are case-insensitive; `application/problem+json` and the like count.
        let ct = ct.to_str().unwrap_or_default().to_ascii_lowercase();
        let essence = ct.split(';').next().unwrap_or_default().trim();
        essence == "application/json"
            || (essence.starts_with("application/") && essence.ends_with("+json"))
    });
    let event_stream = req.stream && status.is_success() && !json;
    // Pass-through answers (Responses events, embeddings, token lists) go out unchanged.
    let follow = match (event_stream, continuable) {
        _ if passed_through => Follow::Chunks { stamp: false },
        (true, true) => Follow::Events {
            migration_limit: limit,
        },
        (stamp, _) => Follow::Chunks { stamp },
    };
    let machine = Continuation::new(kind, follow, version, isl, unmigratable)
        .with_sse(event_stream, !passed_through)
        .expecting_choices(choices(&req.body));
    // The attempt waited for the first chunk already: the head is held for what is left of
    // the hold (a first chunk with no whole event in it may still leave nothing to send).
    let hold = config.stream_head_hold.saturating_sub(response.waited());
    let failed_early = Arc::new(OnceLock::new());
    let flow = Flow::new(req, machine, worker, stop).noting_early_failure(failed_early.clone());
    let body = forward::stream(flow, response, guard);
    let body = with_first_chunk(body, hold).await;
    if let Some(message) = failed_early.get() {
        // It failed before any byte of it went on, and its status is still held: an error
        // status, not a 200 whose body is one error event. (Counted and logged as failed
        // already, where it failed.)
        return Err(ServeError::Upstream(message.clone()));
    }
    Ok(builder
        .body(Body::from_stream(body))
        .expect("valid response"))
}

/// How many choices a request asks for: `n` for each of its prompts.
fn choices(body: &kvrouter_openai::Body) -> u64 {
    let n = body.fields().get("n").and_then(serde_json::Value::as_u64);
    let prompts = body.prompt().map_or(1, |p| p.count as u64);
    n.unwrap_or(1).saturating_mul(prompts)
}

/// Waits up to `hold` for the body's first chunk before the status and headers go out, so
/// that hyper writes them together (one write, one wake-up of the client, instead of two).
/// The first chunk goes out when it comes either way: only the headers may come later. A
/// body that ends first is an empty body; after `hold` the rest follows as it comes. A first
/// item that is an error comes one scheduler turn after the headers (hyper ends a body that
/// fails at once without writing the headers it holds; so the client still gets the status).
async fn with_first_chunk<S, T, E>(
    body: S,
    hold: Duration,
) -> impl Stream<Item = Result<T, E>> + Send + 'static
where
    S: Stream<Item = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    let mut body = Box::pin(body);
    let (first, failed, rest) = match tokio::time::timeout(hold, body.next()).await {
        Ok(None) => (None, None, None),
        Ok(Some(Ok(chunk))) => (Some(Ok(chunk)), None, Some(body)),
        Ok(Some(Err(e))) => (None, Some(e), Some(body)),
        Err(_) => (None, None, Some(body)),
    };
    let failed = failed.map(|e| {
        futures::stream::once(async move {
            tokio::task::yield_now().await;
            Err(e)
        })
    });
    futures::stream::iter(first)
        .chain(futures::stream::iter(failed).flatten())
        .chain(futures::stream::iter(rest).flatten())
}

/// The worker that served (or was picked for) a request, on every answer.
pub(crate) const WORKER: HeaderName = HeaderName::from_static("x-kvrouter-worker");
/// The policy version of that worker, on every answer.
pub(crate) const POLICY_VERSION: HeaderName = HeaderName::from_static("x-kvrouter-policy-version");

/// The answer's headers: the worker's that go on (`passed`), then the router's own.
fn headers(
    mut builder: axum::http::response::Builder,
    passed: &[(HeaderName, HeaderValue)],
    worker: WorkerId,
    version: u64,
    decision: &Decision,
    expose: bool,
) -> axum::http::response::Builder {
    for (name, value) in passed {
        builder = builder.header(name, value);
    }
    let builder = builder
        .header(WORKER, HeaderValue::from(worker.0))
        .header(POLICY_VERSION, HeaderValue::from(version));
    match expose.then(|| decision_header(decision)).flatten() {
        Some(h) => builder.header("x-kvrouter-decision", h),
        None => builder,
    }
}

fn decision_header(d: &Decision) -> Option<HeaderValue> {
    HeaderValue::from_str(&serde_json::to_string(&DecisionView(d)).ok()?).ok()
}

/// The decision and every candidate's score breakdown, written as JSON straight from the
/// decision: `{"mode", "worker", "dp_rank", "candidates": [{"worker", "dp_rank", "overlap",
/// "credit", "prefill", "decode", "total"}]}`.
pub(crate) struct DecisionView<'a>(pub(crate) &'a Decision);

/// One candidate's score breakdown in a [`DecisionView`].
#[derive(serde::Serialize)]
struct CandidateView {
    worker: u64,
    dp_rank: u32,
    overlap: u32,
    credit: f64,
    prefill: f64,
    decode: f64,
    total: f64,
}

/// The candidates of a [`DecisionView`].
struct Candidates<'a>(&'a [kvrouter_core::policy::CandidateScore]);

impl serde::Serialize for Candidates<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|c| CandidateView {
            worker: c.rank.worker.0,
            dp_rank: c.rank.dp_rank,
            overlap: c.overlap.gpu_blocks,
            credit: c.credit_blocks,
            prefill: c.prefill_blocks,
            decode: c.decode_blocks,
            total: c.total,
        }))
    }
}

impl serde::Serialize for DecisionView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let d = self.0;
        let mut m = s.serialize_struct("Decision", 4)?;
        m.serialize_field("mode", d.mode.as_str())?;
        m.serialize_field("worker", &d.rank.worker.0)?;
        m.serialize_field("dp_rank", &d.rank.dp_rank)?;
        m.serialize_field("candidates", &Candidates(&d.candidates))?;
        m.end()
    }
}

/// The whole answer of `req` ended before it produced anything because its group has enough
/// samples (first-N-of-M): finish reason `abort`, no output; `stream`: as SSE events.
pub(crate) fn group_satisfied(req: &Request, stream: bool) -> Response {
    let (kind, prompt_tokens) = (req.kind, req.input.isl_tokens);
    let model = req.model().unwrap_or_default();
    let identity = first_n::Identity::fresh(model, super::continuation::unix_now());
    if stream {
        return (
            [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
            first_n::events(kind, &identity, prompt_tokens, 0, None),
        )
            .into_response();
    }
    axum::Json(first_n::body(kind, &identity, "", prompt_tokens, 0, None)).into_response()
}

#[cfg(test)]
mod tests {
    use super::with_first_chunk;
    use futures::channel::mpsc;
    use futures::StreamExt;
    use std::time::Duration;

    const HOLD: Duration = Duration::from_millis(100);

    fn body() -> (mpsc::UnboundedSender<Item>, mpsc::UnboundedReceiver<Item>) {
        mpsc::unbounded()
    }

    type Item = Result<u32, String>;

    #[tokio::test(start_paused = true)]
    async fn the_head_waits_for_a_first_chunk_that_comes_within_the_hold() {
        let (tx, rx) = body();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(HOLD / 2).await;
            tx.unbounded_send(Ok(1)).unwrap();
            tx.unbounded_send(Ok(2)).unwrap();
        });
        let start = tokio::time::Instant::now();
        let mut out = Box::pin(with_first_chunk(rx, HOLD).await);
        assert_eq!(
            start.elapsed(),
            HOLD / 2,
            "the head went when the chunk came"
        );
        // The chunk is there when the head goes (hyper writes them together).
        assert_eq!(
            futures::poll!(out.next()),
            std::task::Poll::Ready(Some(Ok(1)))
        );
        sender.await.unwrap();
        assert_eq!(out.collect::<Vec<_>>().await, vec![Ok(2)]);
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_hold_the_head_goes_alone_and_the_chunks_follow() {
        let (tx, rx) = body();
        let start = tokio::time::Instant::now();
        let mut out = Box::pin(with_first_chunk(rx, HOLD).await);
        assert_eq!(start.elapsed(), HOLD);
        assert!(futures::poll!(out.next()).is_pending());
        tx.unbounded_send(Ok(7)).unwrap();
        drop(tx);
        assert_eq!(out.collect::<Vec<_>>().await, vec![Ok(7)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_ends_first_is_empty_and_a_zero_hold_takes_only_what_is_there() {
        let (tx, rx) = body();
        drop(tx);
        let out = with_first_chunk(rx, HOLD).await;
        assert_eq!(out.collect::<Vec<Item>>().await, Vec::<Item>::new());
        let (tx, rx) = body();
        tx.unbounded_send(Ok(3)).unwrap();
        let start = tokio::time::Instant::now();
        let mut out = Box::pin(with_first_chunk(rx, Duration::ZERO).await);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(
            futures::poll!(out.next()),
            std::task::Poll::Ready(Some(Ok(3)))
        );
        assert!(futures::poll!(out.next()).is_pending());
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_item_that_is_an_error_comes_after_a_turn_so_the_head_goes_first() {
        let (tx, rx) = body();
        tx.unbounded_send(Err("broke".into())).unwrap();
        drop(tx);
        let mut out = Box::pin(with_first_chunk(rx, HOLD).await);
        assert!(
            futures::poll!(out.next()).is_pending(),
            "hyper flushes the head while the body is pending"
        );
        assert_eq!(out.next().await, Some(Err("broke".into())));
        assert_eq!(out.next().await, None);
    }
}
