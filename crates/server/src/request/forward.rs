//! The one forwarder: the upstream's bytes go to the client through the continuation machine
//! (`continuation.rs`), which says what to forward and when the answer is finished, fails, or
//! continues elsewhere; continuations are sent by the one attempt function. A silent upstream
//! (`--stream-idle-timeout-secs`) counts as broken; a first-N-of-M group with enough samples
//! ends the answer with what it produced.

use super::attempt::{attempt, Origin, Outcome};
use super::coalesce::{Batch, Coalesce, Hold};
use super::continuation::{Continuation, Next, Whole};
use super::parse::Request;
use crate::error::ServeError;
use crate::guard::LoadGuard;
use crate::health::Source;
use crate::provenance::Provenance;
use crate::request_line::log_line;
use crate::routing::routing_input;
use crate::state::stopped;
use crate::upstream::Response;
use axum::body::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use kvrouter_core::ids::WorkerId;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

/// An answer on its way to the client: the request, the machine, and what continuations need.
pub(crate) struct Flow {
    req: Request,
    machine: Continuation,
    /// The workers this answer was served by (continuations go elsewhere).
    tried: Vec<WorkerId>,
    /// Turns true when the request's first-N-of-M group has enough samples.
    stop: Option<watch::Receiver<bool>>,
    /// Whether any byte of the answer went on to the client.
    sent: bool,
    /// Where an answer that fails before any byte went on says why ([`stream`]).
    failed_early: Option<Arc<OnceLock<String>>>,
}

impl Flow {
    /// The answer begun on `worker`.
    pub(crate) fn new(
        req: Request,
        machine: Continuation,
        worker: WorkerId,
        stop: Option<watch::Receiver<bool>>,
    ) -> Self {
        Self {
            req,
            machine,
            tried: vec![worker],
            stop,
            sent: false,
            failed_early: None,
        }
    }

    /// Notes in `cell` why the answer failed, if it fails before any byte of it went on (see
    /// [`stream`]).
    pub(crate) fn noting_early_failure(mut self, cell: Arc<OnceLock<String>>) -> Self {
        self.failed_early = Some(cell);
        self
    }

    /// The last events of a stream its group ended (under the request's model when the
    /// answer showed none).
    fn stopped_events(&self) -> Bytes {
        self.machine
            .stopped_events(self.req.model().unwrap_or_default())
    }

    /// The whole answer of a request its group ended.
    fn stopped_body(&self) -> Bytes {
        self.machine
            .stopped_body(self.req.model().unwrap_or_default())
    }

    /// The answer failed for `why`: noted when nothing of it went on yet.
    fn failed(&self, why: &str) {
        if let (false, Some(cell)) = (self.sent, &self.failed_early) {
            let _ = cell.set(why.to_owned());
        }
    }
}

type Upstream = Coalesce<BoxStream<'static, Result<Bytes, String>>>;

fn upstream(response: Response, config: &crate::config::ServeConfig) -> Upstream {
    // A body read by this task has nothing to hand over on a turn of the scheduler: what is
    // read is decoded at once, so no turn is taken for it.
    let yields = match response.read_here() {
        true => 0,
        false => config.stream_coalesce_yields,
    };
    let chunks = response.into_stream();
    let hold = Hold {
        yields,
        max: config.stream_coalesce_max_hold,
    };
    Coalesce::new(chunks, config.stream_coalesce_max_bytes, hold)
}

/// A stream's idle timer (`--stream-idle-timeout-secs`): one `Sleep` for the whole stream. Each
/// wait moves its deadline (a clock read); the timer itself is pushed back only when it fires
/// before the deadline, not once per chunk.
struct Idle {
    limit: Duration,
    deadline: Instant,
    sleep: Pin<Box<Sleep>>,
}

impl Idle {
    fn new(limit: Duration) -> Self {
        let deadline = Instant::now() + limit;
        Self {
            limit,
            deadline,
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }

    /// A wait for the upstream begins: it may last `limit`.
    fn start(&mut self) {
        self.deadline = Instant::now() + self.limit;
    }

    /// Completes when the current wait has lasted `limit`.
    async fn expired(&mut self) {
        loop {
            self.sleep.as_mut().await;
            if Instant::now() >= self.deadline {
                return;
            }
            self.sleep.as_mut().reset(self.deadline);
        }
    }
}

/// The next batch of chunks; an error when the upstream sends nothing for the idle limit
/// (counted in `kvrouter_upstream_timeouts_total{kind="stream_idle"}`).
async fn next_chunk(
    up: &mut Upstream,
    idle: Option<&mut Idle>,
    metrics: &crate::metrics::Metrics,
) -> Option<Result<Batch, String>> {
    let Some(idle) = idle else {
        return up.next().await;
    };
    idle.start();
    let limit = idle.limit;
    tokio::select! {
        biased;
        next = up.next() => next,
        _ = idle.expired() => {
            metrics.upstream_timeouts.inc(&[("kind", "stream_idle")]);
            Some(Err(format!(
                "the worker sent nothing for {:.3}s (--stream-idle-timeout-secs)",
                limit.as_secs_f64()
            )))
        }
    }
}

/// The client's body: the upstream's bytes as the machine forwards them, continued elsewhere
/// when it says so. An answer that fails before any of its bytes went on notes why in its
/// flow's early-failure cell ([`Flow::noting_early_failure`]) before its last item (the
/// in-band error), so a caller still holding the status can answer with an error status.
pub(crate) fn stream(
    flow: Flow,
    response: Response,
    guard: LoadGuard,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let config = &flow.req.state.inner.config;
    let idle = config.stream_idle_timeout.map(Idle::new);
    let start = (upstream(response, config), guard, flow, idle);
    futures::stream::unfold(Some(start), move |state| async move {
        let (mut up, mut guard, mut f, mut idle) = state?;
        loop {
            // Once [DONE] went out the answer is whole: a stop no longer applies.
            let armed = !f.machine.done();
            let mut stop = if armed { f.stop.take() } else { None };
            let next = tokio::select! {
                n = next_chunk(&mut up, idle.as_mut(), &f.req.state.inner.metrics) => n,
                _ = stopped(&mut stop) => {
                    // The group has enough samples: end here with what was produced.
                    guard.produced(f.machine.generated_tokens());
                    guard.end_aborted();
                    return Some((Ok(f.stopped_events()), None));
                }
            };
            if armed {
                f.stop = stop;
            }
            let mut cause = None;
            let clean = match next {
                Some(Ok(Batch {
                    bytes: chunk,
                    chunks,
                })) => {
                    guard.on_chunks(&chunk, chunks);
                    let worker = guard.worker();
                    let inner = &f.req.state.inner;
                    let out = f.machine.chunk(chunk, || inner.draining_for_update(worker));
                    if out.is_empty() {
                        continue;
                    }
                    f.sent = true;
                    return Some((Ok(out), Some((up, guard, f, idle))));
                }
                Some(Err(e)) => {
                    cause = Some(e);
                    false
                }
                None => true,
            };
            let after_abort = match f.machine.upstream_over(clean) {
                Next::Finish => {
                    guard.finish();
                    return None;
                }
                Next::Fail {
                    message,
                    worker_failed,
                } => {
                    // What the upstream did, after what it means for the answer.
                    let message = match cause {
                        Some(cause) => format!("{message}: {cause}"),
                        None => message,
                    };
                    if worker_failed {
                        let worker = guard.worker();
                        f.req.state.observe_health(worker, false, Source::Request);
                    }
                    guard.fail();
                    f.failed(&message);
                    let end = match guard.is_stream() {
                        true => Ok(f.machine.error_event(&message)),
                        false => Err(std::io::Error::other(message)),
                    };
                    return Some((end, None));
                }
                Next::Continue { after_abort } => after_abort,
            };
            if !after_abort {
                let worker = guard.worker();
                f.req.state.observe_health(worker, false, Source::Request);
            }
            match f.continue_elsewhere(guard, after_abort).await {
                Ok(Some((response, g))) => {
                    (up, guard) = (upstream(response, &f.req.state.inner.config), g)
                }
                Ok(None) => return Some((Ok(f.stopped_events()), None)),
                Err(e) => {
                    let what = match after_abort {
                        true => "continuation after a weight update failed",
                        false => "migration failed",
                    };
                    let why = match e {
                        ServeError::Route(kvrouter_core::router::RouteError::NoWorkers) => {
                            format!("every worker it could go to was tried ({})", f.tried.len())
                        }
                        e => e.to_string(),
                    };
                    let message = format!("{what}: {why}");
                    // No attempt's guard is left to count it (the last one was retired).
                    f.req.count("failed");
                    f.failed(&message);
                    return Some((Ok(f.machine.error_event(&message)), None));
                }
            }
        }
    })
}

/// What reading a whole answer gave.
pub(crate) enum Read {
    Body(Bytes),
    /// Its group got enough samples first: the guard ended it as aborted.
    Stopped,
    Failed(String),
}

/// Reads a whole (non-streamed) answer, unless its group gets enough samples first. Its body
/// gets `--upstream-response-timeout-secs` too (engines send it with the headers; a worker
/// that sends part of it and stalls fails the attempt instead of holding it).
pub(crate) async fn read(
    state: &crate::state::AppState,
    response: Response,
    guard: &mut LoadGuard,
    stop: &mut Option<watch::Receiver<bool>>,
) -> Read {
    let limit = state.inner.config.upstream_response_timeout;
    let read = tokio::select! {
        r = tokio::time::timeout(limit, response.bytes()) => r,
        _ = stopped(stop) => {
            guard.end_aborted();
            return Read::Stopped;
        }
    };
    match read {
        Ok(Ok(b)) => {
            guard.on_chunk(&b);
            Read::Body(b)
        }
        Ok(Err(e)) => Read::Failed(e),
        Err(_) => {
            state
                .inner
                .metrics
                .upstream_timeouts
                .inc(&[("kind", "unary")]);
            Read::Failed(format!(
                "the answer's body did not finish within {:.3}s (--upstream-response-timeout-secs)",
                limit.as_secs_f64()
            ))
        }
    }
}

/// A whole answer: stamped with its policy version and, if a weight update aborted it,
/// continued on an updated worker and joined into one answer. Returns the body and the worker
/// and policy version that ended it; errors are counted.
pub(crate) async fn whole(
    mut f: Flow,
    mut bytes: Bytes,
    mut guard: LoadGuard,
) -> Result<(Bytes, WorkerId, u64), ServeError> {
    loop {
        let worker = guard.worker();
        let inner = &f.req.state.inner;
        match f.machine.whole(bytes, || inner.draining_for_update(worker)) {
            Whole::Done { body, usage } => {
                guard.finish_read(usage);
                return Ok((body, worker, f.machine.version()));
            }
            Whole::Fail(message) => {
                guard.end_failed();
                return Err(f.req.count_error(ServeError::Upstream(message)));
            }
            Whole::Continue => {}
        }
        // Its group may get enough samples while it waits or runs again.
        let (response, g) = match f.continue_elsewhere(guard, true).await {
            Ok(Some(sent)) => sent,
            Ok(None) => return Ok((f.stopped_body(), worker, f.machine.version())),
            Err(e) => {
                let e = format!("continuation after a weight update failed: {e}");
                return Err(f.req.count_error(ServeError::Upstream(e)));
            }
        };
        guard = g;
        let worker = guard.worker();
        bytes = match read(&f.req.state, response, &mut guard, &mut f.stop).await {
            Read::Body(b) => b,
            Read::Stopped => {
                return Ok((f.stopped_body(), worker, f.machine.version()));
            }
            Read::Failed(e) => {
                guard.end_failed();
                let e = ServeError::Upstream(format!("worker {worker}: {e}"));
                return Err(f.req.count_error(e));
            }
        };
    }
}

impl Flow {
    /// Ends the current attempt and starts its continuation (after a weight update's abort, or
    /// a failure). The request's provenance line moves to the continuation, or is logged (as
    /// aborted or failed) if none could start. `None`: its group got enough samples first.
    async fn continue_elsewhere(
        &mut self,
        mut guard: LoadGuard,
        after_abort: bool,
    ) -> Result<Option<(Response, LoadGuard)>, ServeError> {
        let prov = guard.take_provenance().map(|mut p| {
            p.update_aborts += u32::from(after_abort);
            p
        });
        let (first_at, worker) = (guard.first_at(), guard.worker());
        guard.retire();
        self.machine.continuing();
        let kind = match after_abort {
            true => "weight_update",
            false => "ongoing_request",
        };
        let state = self.req.state.clone();
        let inner = &state.inner;
        inner.metrics.migrations.inc(&[("migration_type", kind)]);
        let origin = Origin::Continuation {
            after_abort,
            first_at,
            carried: self.machine.generated_tokens(),
            prov: prov.clone(),
        };
        let result = self.reissue(origin).await;
        let log = |status: &'static str, p: Option<Box<Provenance>>| {
            let Some(mut p) = p else { return };
            p.output_tokens = self.machine.generated_tokens();
            if status == "aborted" {
                p.abort_reason = Some("group-satisfied");
            }
            let arrival = self.req.arrival;
            log_line(
                &self.req.state,
                p,
                status,
                Some(worker),
                arrival,
                first_at,
                None,
            );
        };
        match result {
            Ok(Outcome::Sent(sent)) => {
                self.machine.started(sent.decision.policy_version);
                Ok(Some((sent.response, sent.guard)))
            }
            Ok(Outcome::Stopped { logged }) => {
                if !logged {
                    self.req.count("aborted");
                    log("aborted", prov);
                }
                Ok(None)
            }
            Err(e) => {
                log("failed", prov);
                Err(e)
            }
        }
    }

    /// Routes and sends the continuation request.
    async fn reissue(&mut self, origin: Origin) -> Result<Outcome, ServeError> {
        let req = &self.req;
        let tokenizer = &req.state.inner.tokenizer;
        let body = self
            .machine
            .body(&req.body.to_value(), |text| tokenizer.inner().encode(text));
        let bytes = Bytes::from(serde_json::to_vec(&body).expect("a JSON value serializes"));
        let input = routing_input(&req.state, req.kind, &body.into()).await?;
        attempt(req, &bytes, &input, origin, &mut self.tried, &mut self.stop).await
    }
}

#[cfg(test)]
mod tests {
    use super::Idle;
    use std::time::Duration;
    use tokio::time::Instant;

    #[tokio::test(start_paused = true)]
    async fn the_idle_timer_counts_each_wait_not_the_whole_stream() {
        let mut idle = Idle::new(Duration::from_secs(1));
        let begun = Instant::now();
        // A chunk every 0.6 s for 3 s: no wait lasts the limit, the stream lasts three.
        for _ in 0..5 {
            idle.start();
            tokio::select! {
                biased;
                _ = tokio::time::sleep(Duration::from_millis(600)) => {}
                _ = idle.expired() => panic!("expired after {:?}", begun.elapsed()),
            }
        }
        // Then silence: it expires one limit after the last wait began.
        idle.start();
        let from = Instant::now();
        idle.expired().await;
        let waited = from.elapsed();
        assert!(waited >= Duration::from_secs(1), "{waited:?}");
        assert!(waited < Duration::from_millis(1100), "{waited:?}");
    }
}
