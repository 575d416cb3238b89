//! One attempt function for first attempts, their retries and continuations: allocate a request
//! id, place it (admitted through the router queue, or now on a worker not tried yet), build its
//! load guard, send it (`Inner::send_upstream`: connect, first-byte and response timeouts count as
//! failures; a first attempt's stream that fails before its first chunk, while its answer's head
//! is still held, too) and record the worker's health. A failed send is retried on another worker.

use super::admit::admit;
use super::parse::Request;
use crate::error::ServeError;
use crate::guard::LoadGuard;
use crate::health::Source;
use crate::provenance::Provenance;
use crate::registry;
use crate::request_line::log_line;
use crate::routing::RoutingInput;
use crate::state::stopped;
use axum::body::Bytes;
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::router::{Decision, RouteRequest};
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::sync::watch;

/// Which attempt of a request this is.
pub(crate) enum Origin {
    /// Its first: admitted through the router queue (pinned, if it is); a failed send is retried
    /// up to `--retries` times away from the workers tried.
    First,
    /// A continuation of an answer begun elsewhere: after a weight update's abort
    /// (`after_abort`: admitted again, to wait for a worker of an accepted version) or after a
    /// failure (placed now, away from the workers tried). It is retried on every worker not tried.
    Continuation {
        after_abort: bool,
        /// When the answer's first byte came back.
        first_at: Option<Instant>,
        /// Tokens produced by earlier attempts.
        carried: u64,
        /// The request's provenance line, moving from attempt to attempt.
        prov: Option<Box<Provenance>>,
    },
}

/// Counts and logs a request as cancelled if its handler goes away while the request waits for
/// a placement (its first, or a continuation admitted again after a weight update's abort):
/// until a placement makes its load guard, nothing else would, and a client giving up in the
/// queue (what overload looks like from outside) showed in neither `kvrouter_requests_total`
/// nor the access log.
struct Waiting<'a> {
    req: &'a Request,
    origin: &'a Origin,
    armed: bool,
}

impl Waiting<'_> {
    /// The wait ended with the handler still there: whatever follows counts the request.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let req = self.req;
        req.count("cancelled");
        let prov = match self.origin {
            Origin::First => req.provenance(),
            Origin::Continuation { prov, .. } => prov.clone(),
        };
        if let Some(p) = prov {
            log_line(&req.state, p, "cancelled", None, req.arrival, None, None);
        }
    }
}

/// An attempt on its way: the upstream's response, its guard and its placement.
pub(crate) struct Sent {
    pub(crate) response: crate::upstream::Response,
    pub(crate) guard: LoadGuard,
    pub(crate) decision: Decision,
}

/// What became of an attempt.
pub(crate) enum Outcome {
    Sent(Box<Sent>),
    /// Its first-N-of-M group got enough samples first; `logged`: the attempt's guard counted
    /// and logged it as aborted (else it was still waiting in the queue).
    Stopped {
        logged: bool,
    },
}

/// Places and sends `body` (whose routing input is `input`) until a worker takes it; `tried`
/// collects the workers placed on. `stop` ends the attempt when its group has enough samples.
pub(crate) async fn attempt(
    req: &Request,
    body: &Bytes,
    input: &RoutingInput,
    origin: Origin,
    tried: &mut Vec<WorkerId>,
    stop: &mut Option<watch::Receiver<bool>>,
) -> Result<Outcome, ServeError> {
    let inner = &req.state.inner;
    let first = matches!(origin, Origin::First);
    let mut admit_next = match &origin {
        Origin::First => true,
        Origin::Continuation { after_abort, .. } => *after_abort,
    };
    // Continuations are bounded by the workers: each placement avoids one more.
    let sends = if first {
        inner.config.retries.saturating_add(1)
    } else {
        u32::MAX
    };
    let mut last_error = None;
    let mut queued = None;
    for n in 0..sends {
        let id = RequestId(inner.next_request.fetch_add(1, Ordering::Relaxed));
        let mut request = RouteRequest::new(id, input.isl_tokens, input.blocks.clone());
        if first {
            request.pin = req.pin;
        }
        request.allowed_workers = req.pool.clone();
        req.admission.apply(&mut request);
        let decision = if admit_next {
            // No load guard exists yet to count the request should its client leave while it
            // waits in the queue: this one does.
            let waiting = Waiting {
                req,
                origin: &origin,
                armed: true,
            };
            // A request waiting in the queue ends there if its group gets enough samples.
            let admitted = tokio::select! {
                d = admit(&req.state, request) => d,
                _ = stopped(stop) => {
                    waiting.disarm();
                    return Ok(Outcome::Stopped { logged: false });
                }
            };
            waiting.disarm();
            let (d, at) = admitted?;
            queued = queued.or(at);
            d
        } else {
            match inner.place_continuation(&request, tried) {
                Ok(d) => d,
                // Every worker was tried: the client hears why the last attempt failed (502),
                // not that none is left (503).
                Err(kvrouter_core::router::RouteError::NoWorkers) if last_error.is_some() => break,
                Err(e) => return Err(ServeError::Route(e)),
            }
        };
        admit_next = false;
        if first && n > 0 {
            // A re-send of a failed first attempt (counted when it is placed, so a failure with
            // nowhere left to go counts none).
            let mode = inner.config.router.router_mode;
            inner.metrics.retries.inc(&[("mode", mode.as_str())]);
        }
        let worker = decision.rank.worker;
        tried.push(worker);
        if first && n == 0 {
            req.placed(&decision);
        }
        let mut guard = guard_for(req, id, &decision, &origin, queued);
        let Some(base) = registry::url_of(&req.state, worker) else {
            guard.retire();
            continue;
        };
        let url = format!("{base}{}", req.upstream_path());
        // A first attempt's stream is answered once its first chunk came (up to
        // `--stream-head-hold-ms`): a stream that fails before it is retried like a failed send.
        let peek = (first && req.stream).then_some(inner.config.stream_head_hold);
        let send = async {
            let mut r = inner
                .send_upstream(&url, &req.request_id, body, req.stream)
                .await?;
            if let Some(wait) = peek.filter(|_| r.status().is_success()) {
                r.first_chunk(wait)
                    .await
                    .map_err(|e| format!("the stream failed before its first byte: {e}"))?;
                if r.ended_empty() {
                    // An SSE answer always says something (at least `[DONE]`).
                    return Err("the stream ended before its first byte".into());
                }
            }
            Ok::<_, String>(r)
        };
        let sent = tokio::select! {
            r = send => r,
            _ = stopped(stop) => {
                guard.end_aborted();
                return Ok(Outcome::Stopped { logged: true });
            }
        };
        // A first attempt forwards a client error (4xx) as it is; a continuation, whose body
        // the router wrote, takes only a success. A worker refusing the router's credentials
        // (401, 403) is the router's configuration, not the client's key (which never goes to
        // workers): tried elsewhere, else a 502 saying so. It says nothing of the worker's
        // health.
        let refused_key = matches!(&sent, Ok(r) if matches!(r.status().as_u16(), 401 | 403));
        let failure = match &sent {
            Ok(r) if refused_key => Some(format!(
                "worker {worker} answered {}: it wants an API key the router did not send or \
                 has wrong (--worker-api-key)",
                r.status()
            )),
            Ok(r) if r.status().is_server_error() || (!first && !r.status().is_success()) => {
                Some(format!("worker {worker} answered {}", r.status()))
            }
            Ok(_) => None,
            Err(e) => Some(format!("worker {worker}: {e}")),
        };
        if refused_key {
            // Counted and logged (first and every 1,000th, per worker): the worker stays in
            // rotation, so this is what shows it.
            let id = worker.0.to_string();
            let n = inner.metrics.key_refusals.inc_get(&[("worker", &id)]);
            if n % 1000 == 1 {
                tracing::warn!(worker = %worker, "{}", failure.as_deref().unwrap_or_default());
            }
        } else {
            req.state
                .observe_health(worker, failure.is_none(), Source::Request);
        }
        match (sent, failure) {
            (Ok(response), None) => {
                guard.answered(response.status().is_success());
                guard.answered_status(response.status().as_u16());
                let sent = Sent {
                    response,
                    guard,
                    decision,
                };
                return Ok(Outcome::Sent(Box::new(sent)));
            }
            (_, failure) => {
                // Nothing reached the client yet: release this attempt and try another worker.
                guard.retire();
                last_error = failure;
                if first && req.pin.is_some() {
                    break;
                }
            }
        }
    }
    Err(ServeError::Upstream(
        last_error.unwrap_or_else(|| "no worker could be reached".into()),
    ))
}

/// The load guard of one attempt.
pub(super) fn guard_for(
    req: &Request,
    id: RequestId,
    decision: &Decision,
    origin: &Origin,
    queued: Option<std::time::Instant>,
) -> LoadGuard {
    let worker = decision.rank.worker;
    let guard = LoadGuard::new(
        req.state.clone(),
        id,
        worker,
        req.arrival,
        req.stream,
        (req.model().unwrap_or(""), req.model_served),
    )
    // A pass-through answer is no completion or chat: embeddings and token ids generate
    // nothing, and a Responses stream's first event is no token, its usage another shape.
    .generating(req.endpoint.is_none())
    .in_group(req.admission.group);
    let placed = |mut p: Box<Provenance>| {
        p.dp_rank = decision.rank.dp_rank;
        p.policy_version = decision.policy_version;
        p
    };
    match origin {
        Origin::First => {
            guard
                .router_prompt(req.input.isl_tokens)
                .with_provenance(req.provenance().map(|mut p| {
                    p.request_id = id.0;
                    p.queue_ms = req.arrival.elapsed().as_secs_f64() * 1e3;
                    if p.trace {
                        p.timeline = crate::provenance::Timeline {
                            tokenized: Some(req.tokenized),
                            queued,
                            placed: Some(std::time::Instant::now()),
                            first_worker: worker.0,
                            score: decision
                                .candidates
                                .iter()
                                .find(|c| c.rank == decision.rank)
                                .map(|c| c.total),
                            predicted_cached_tokens: decision.cached_tokens,
                        };
                    }
                    placed(p)
                }))
        }
        Origin::Continuation {
            after_abort,
            first_at,
            carried,
            prov,
        } => guard
            .continuing(*first_at, *carried)
            .with_provenance(prov.clone().map(|mut p| {
                p.migrations += u32::from(!after_abort);
                placed(p)
            })),
    }
}
