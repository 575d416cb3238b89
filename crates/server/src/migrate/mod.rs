//! Request migration: a stream whose worker fails (connection reset, error mid-stream, or silence
//! past `--stream-idle-timeout`) is continued on another healthy worker as a continuation: the
//! prompt plus the tokens already streamed (token-id prompts get the generated text re-tokenized,
//! as the engine tokenized it; chats get the partial assistant message with
//! `continue_final_message`), with the remaining token budget. The client's stream carries on
//! with no duplicated and no missing tokens and one final usage.
//!
//! Engines stream one token per content chunk (vLLM, SGLang and the mock engine do), which is how
//! tokens already sent are counted. Requests that cannot be continued faithfully (`n` > 1,
//! structured output, logprobs) end with an in-band error instead of a corrupted stream.
//!
//! The same continuation carries a request the engine aborted for a weight update (it waits for
//! an updated worker). `unary.rs` continues non-streamed answers; `first_n.rs` answers requests
//! ended because their RL group has enough samples.

use crate::guard::LoadGuard;
use crate::health::{self, Source};
use crate::registry;
use crate::routing::{routing_input, Kind, RoutingInput};
use crate::state::AppState;
use axum::body::Bytes;
use futures::StreamExt;
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::router::{Decision, RouteError, RouteRequest};
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::time::Instant;

mod first_n;
mod unary;

pub(crate) use first_n::group_satisfied_response;
pub(crate) use kvrouter_openai::continuation::unmigratable;
use kvrouter_openai::continuation::{chunk_text, finished_by_abort, finishing};
use kvrouter_openai::fingerprint::{fingerprint, stamp};
pub(crate) use kvrouter_openai::sse::error_event;
use kvrouter_openai::sse::{self, EventSplitter};
pub(crate) use unary::unary;

/// The state of one streamed request across its attempts.
pub(crate) struct Migration {
    pub(crate) state: AppState,
    pub(crate) kind: Kind,
    pub(crate) original: Value,
    pub(crate) worker: WorkerId,
    pub(crate) arrival: Instant,
    pub(crate) left: u32,
    generated_text: String,
    generated_tokens: u64,
    /// Tokens streamed before the current attempt (added to its usage).
    carried_tokens: u64,
    tried: Vec<WorkerId>,
    /// The upstream's SSE events, split whatever its chunk boundaries.
    events: EventSplitter,
    done: bool,
    /// The policy version serving the current attempt (the body's `system_fingerprint`).
    version: u64,
    /// The next event is the first of an attempt: it carries the fingerprint.
    stamp: bool,
    /// The engine aborted the attempt for a weight update: the rest of its stream is dropped
    /// and the request continues on an updated worker.
    aborted: bool,
    /// Turns true when the request's first-N-of-M group has enough samples.
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    /// The original request's admission fields, which continuations keep (its deadline, so a
    /// continuation waiting for a version still ends in time; its accepted versions; its
    /// session and group, for placement).
    carry: crate::headers::AdmissionFields,
    /// Prompt tokens as the router counted them (the usage of an early end).
    prompt_tokens: u64,
    /// The client asked for a stream.
    stream: bool,
    /// The original prompt's `prompt_tokens`, from the usage of an attempt that was aborted (the
    /// continued answer reports it, not the continuation's prompt).
    first_prompt_tokens: Option<u64>,
}

/// What became of a continuation's placement and send.
enum Reissued {
    /// On its way: the upstream's response and the attempt's guard.
    Sent(Box<(reqwest::Response, LoadGuard)>),
    /// Its group got enough samples first; `logged`: the attempt already counted and logged
    /// itself as aborted.
    Stopped { logged: bool },
}

/// What became of a continuation.
enum Continued {
    /// It runs: its upstream and guard.
    Going(Upstream, LoadGuard),
    /// Its group got enough samples while it waited: it ends here.
    Stopped,
}

/// Places a request that continues after a failure (a retry, a migration): now, outside the
/// router queue, on a worker it has not tried. The core's rule, which the simulator's
/// continuations follow too.
pub(crate) fn place_after_failure(
    state: &AppState,
    request: &RouteRequest,
    tried: &[WorkerId],
) -> Result<Decision, RouteError> {
    let inner = &state.inner;
    inner
        .lock_core()
        .route_continuation(request, tried, inner.now())
}

/// Whether `worker` is draining for a weight update (its engine aborts requests on purpose).
fn draining_for_update(state: &AppState, worker: WorkerId) -> bool {
    state.inner.lock_core().update_phase(worker)
        == Some(kvrouter_core::router::UpdatePhase::Draining)
}

impl Migration {
    pub(crate) fn new(
        state: AppState,
        kind: Kind,
        original: Value,
        worker: WorkerId,
        arrival: Instant,
    ) -> Self {
        let left = state.inner.config.migration_limit;
        Self {
            state,
            kind,
            original,
            worker,
            arrival,
            left,
            generated_text: String::new(),
            generated_tokens: 0,
            carried_tokens: 0,
            tried: vec![worker],
            events: EventSplitter::new(),
            done: false,
            version: 0,
            stamp: true,
            aborted: false,
            stop: None,
            carry: Default::default(),
            prompt_tokens: 0,
            stream: true,
            first_prompt_tokens: None,
        }
    }

    /// The request this follows: the version serving its first attempt, its admission fields,
    /// its first-N-of-M stop signal and the router's count of its prompt tokens.
    pub(crate) fn following(
        mut self,
        version: u64,
        carry: crate::headers::AdmissionFields,
        stop: Option<tokio::sync::watch::Receiver<bool>>,
        prompt_tokens: u64,
    ) -> Self {
        (self.version, self.carry, self.stop) = (version, carry, stop);
        self.prompt_tokens = prompt_tokens;
        self
    }

    /// The continuation request body.
    fn continuation(&self) -> Value {
        let tokenizer = &self.state.inner.tokenizer;
        kvrouter_openai::continuation::body(
            self.kind,
            &self.original,
            &self.generated_text,
            self.generated_tokens,
            |text| tokenizer.inner().encode(text),
        )
    }

    /// Splits complete SSE events out of `chunk`, tracking what was generated; rewrites the
    /// usage of a continued stream so the client sees one usage for the whole answer.
    fn process(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.events.push(chunk);
        let mut out = Vec::with_capacity(chunk.len());
        while let Some(event) = self.events.next_event() {
            let data = sse::data(&event).unwrap_or_default();
            if sse::is_done(data) {
                if self.aborted {
                    continue;
                }
                self.done = true;
                out.extend_from_slice(&event);
                continue;
            }
            let Ok(mut v) = serde_json::from_slice::<Value>(data) else {
                out.extend_from_slice(&event);
                continue;
            };
            let prompt_in_usage =
                kvrouter_openai::usage::of(&v).and_then(|u| u["prompt_tokens"].as_u64());
            if self.aborted {
                // What the aborted attempt still sends (its usage) is not the client's; its
                // prompt count is the original prompt's.
                if let (Some(p), 0) = (prompt_in_usage, self.carried_tokens) {
                    self.first_prompt_tokens.get_or_insert(p);
                }
                continue;
            }
            let content = chunk_text(self.kind, &v).filter(|c| !c.is_empty());
            if let Some(c) = content {
                self.generated_text.push_str(c);
                self.generated_tokens += 1;
            }
            let fp = fingerprint(self.version);
            if finished_by_abort(&v) && draining_for_update(&self.state, self.worker) {
                self.aborted = true;
                if let (Some(p), 0) = (prompt_in_usage, self.carried_tokens) {
                    self.first_prompt_tokens.get_or_insert(p);
                }
                if content.is_some() {
                    // Its text reaches the client; the abort does not.
                    v["choices"][0]["finish_reason"] = Value::Null;
                    stamp(&mut v, &fp);
                    out.extend_from_slice(&sse::data_event(&v));
                }
                continue;
            }
            let has_usage = kvrouter_openai::usage::of(&v).is_some();
            let mut rewrite = false;
            if self.stamp || has_usage || finishing(&v) {
                self.stamp = false;
                stamp(&mut v, &fp);
                rewrite = true;
            }
            if self.carried_tokens > 0 && has_usage {
                kvrouter_openai::usage::fold_continued(
                    &mut v["usage"],
                    self.carried_tokens,
                    self.first_prompt_tokens,
                );
                rewrite = true;
            }
            if rewrite {
                out.extend_from_slice(&sse::data_event(&v));
            } else {
                out.extend_from_slice(&event);
            }
        }
        out
    }

    /// Routes and sends the continuation; returns its response and load guard. After a weight
    /// update's abort (`after_abort`) it waits in the router queue for a worker of an accepted
    /// version, the updated one included; after a failure it goes to a worker not tried yet.
    async fn reissue(
        &mut self,
        prov: Option<Box<crate::provenance::Provenance>>,
        after_abort: bool,
        first_at: Option<Instant>,
        stop: &mut Option<tokio::sync::watch::Receiver<bool>>,
    ) -> Result<Reissued, String> {
        let inner = &self.state.inner;
        let body = self.continuation();
        let RoutingInput { isl_tokens, blocks } = routing_input(&self.state, self.kind, &body)
            .await
            .map_err(|e| e.to_string())?;
        let mut wait = after_abort;
        loop {
            let id = RequestId(inner.next_request.fetch_add(1, Ordering::Relaxed));
            let mut request = RouteRequest::new(id, isl_tokens, blocks.clone());
            self.carry.apply(&mut request);
            let decision = if wait {
                // Its group may get enough samples while it waits in the queue.
                tokio::select! {
                    d = crate::proxy::admit(&self.state, request) => d.map_err(|e| e.to_string())?,
                    _ = crate::state::stopped(stop) => return Ok(Reissued::Stopped { logged: false }),
                }
            } else {
                place_after_failure(&self.state, &request, &self.tried)
                    .map_err(|e| e.to_string())?
            };
            let worker = decision.rank.worker;
            self.tried.push(worker);
            let mut guard = LoadGuard::new(
                self.state.clone(),
                id,
                worker,
                inner.config.router.router_mode,
                self.arrival,
                self.stream,
            )
            .continuing(first_at, self.generated_tokens);
            guard.group = self.carry.group;
            guard.counts_as_sample = true;
            guard.prov = prov.clone().map(|mut p| {
                p.migrations += u32::from(!after_abort);
                p.dp_rank = decision.rank.dp_rank;
                p.policy_version = decision.policy_version;
                p
            });
            let Some(base) = registry::url_of(&self.state, worker) else {
                guard.retire();
                continue;
            };
            let send = inner.send_upstream(
                inner
                    .http
                    .post(format!("{base}{}", self.kind.path()))
                    .json(&body),
                self.stream,
            );
            let sent = tokio::select! {
                r = send => r,
                _ = crate::state::stopped(stop) => {
                    if let Some(p) = guard.prov.as_mut() {
                        p.output_tokens = self.generated_tokens;
                    }
                    guard.end_aborted();
                    return Ok(Reissued::Stopped { logged: true });
                }
            };
            match sent {
                Ok(r) if r.status().is_success() => {
                    health::observe(&self.state, worker, true, Source::Request);
                    self.worker = worker;
                    self.version = decision.policy_version;
                    self.stamp = true;
                    return Ok(Reissued::Sent(Box::new((r, guard))));
                }
                _ => {
                    health::observe(&self.state, worker, false, Source::Request);
                    guard.retire();
                    // A worker that fails goes the way of any failure: somewhere not tried.
                    wait = false;
                }
            }
        }
    }
}

impl Migration {
    /// Ends the current attempt and starts its continuation (after a weight update's abort, or
    /// a failure). The request's provenance line moves to the continuation, or is logged (as
    /// aborted or failed) if none could start. `None`: its group got enough samples first.
    async fn continue_attempt(
        &mut self,
        mut guard: LoadGuard,
        after_abort: bool,
    ) -> Result<Option<(reqwest::Response, LoadGuard)>, String> {
        let prov = guard.prov.take().map(|mut p| {
            p.update_aborts += u32::from(after_abort);
            p
        });
        let (first_at, worker) = (guard.first_at(), guard.worker);
        guard.retire();
        self.carried_tokens = self.generated_tokens;
        self.events.clear();
        let kind = if after_abort {
            "weight_update"
        } else {
            "ongoing_request"
        };
        self.state
            .inner
            .metrics
            .migrations
            .inc(&[("migration_type", kind)]);
        let mut stop = self.stop.take();
        let result = self
            .reissue(prov.clone(), after_abort, first_at, &mut stop)
            .await;
        self.stop = stop;
        let log = |status: &'static str, p: Option<Box<crate::provenance::Provenance>>| {
            if let Some(mut p) = p {
                p.output_tokens = self.generated_tokens;
                if status == "aborted" {
                    p.abort_reason = Some("group-satisfied");
                }
                let arrival = self.arrival;
                crate::guard::log_line(
                    &self.state,
                    p,
                    status,
                    Some(worker),
                    arrival,
                    first_at,
                    None,
                );
            }
        };
        match result {
            Ok(Reissued::Sent(sent)) => Ok(Some(*sent)),
            Ok(Reissued::Stopped { logged }) => {
                if !logged {
                    self.count_aborted();
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

    /// [`Migration::continue_attempt`] for a stream.
    async fn continue_after(
        &mut self,
        guard: LoadGuard,
        after_abort: bool,
    ) -> Result<Continued, String> {
        Ok(match self.continue_attempt(guard, after_abort).await? {
            Some((r, g)) => Continued::Going(r.bytes_stream().boxed(), g),
            None => Continued::Stopped,
        })
    }
}

type Upstream = futures::stream::BoxStream<'static, reqwest::Result<Bytes>>;

/// The client's stream: forwards the upstream's events and continues elsewhere on failure.
pub(crate) fn stream(
    first: reqwest::Response,
    guard: LoadGuard,
    migration: Migration,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let up: Upstream = first.bytes_stream().boxed();
    let idle = migration.state.inner.config.stream_idle_timeout;
    futures::stream::unfold(Some((up, guard, migration)), move |state| async move {
        let (mut up, mut guard, mut m) = state?;
        loop {
            let fetch = async {
                match idle {
                    Some(t) => match tokio::time::timeout(t, up.next()).await {
                        Ok(v) => v.map(|r| r.map_err(|_| ())),
                        Err(_) => Some(Err(())),
                    },
                    None => up.next().await.map(|r| r.map_err(|_| ())),
                }
            };
            // Once [DONE] went out the answer is whole: a stop no longer applies.
            let armed = !m.done;
            let mut stop = if armed { m.stop.take() } else { None };
            let next: Option<Result<Bytes, ()>> = tokio::select! {
                n = fetch => n,
                _ = crate::state::stopped(&mut stop) => {
                    // The group has enough samples: end here with what was produced.
                    if let Some(p) = guard.prov.as_mut() {
                        p.output_tokens = m.generated_tokens;
                    }
                    guard.end_aborted();
                    let last = m.stopped_events();
                    return Some((Ok(last), None));
                }
            };
            if armed {
                m.stop = stop;
            }
            match next {
                Some(Ok(chunk)) => {
                    guard.on_chunk(&chunk);
                    let out = m.process(&chunk);
                    if out.is_empty() {
                        continue;
                    }
                    return Some((Ok(Bytes::from(out)), Some((up, guard, m))));
                }
                None if m.done => {
                    guard.finish();
                    return None;
                }
                // The engine aborted it for a weight update: continue on an updated worker.
                _ if m.aborted => {
                    if let Some(reason) = unmigratable(&m.original) {
                        guard.log_failed();
                        let msg = format!("the request was aborted by a weight update and cannot be continued faithfully ({reason})");
                        return Some((Ok(error_event(&msg)), None));
                    }
                    m.aborted = false;
                    match m.continue_after(guard, true).await {
                        Ok(Continued::Going(next, g)) => (up, guard) = (next, g),
                        Ok(Continued::Stopped) => return Some((Ok(m.stopped_events()), None)),
                        Err(e) => {
                            let msg = format!("continuation after a weight update failed: {e}");
                            return Some((Ok(error_event(&msg)), None));
                        }
                    }
                }
                // The upstream failed (error, idle, or ended without [DONE]).
                _ => {
                    health::observe(&m.state, m.worker, false, Source::Request);
                    if m.left == 0 {
                        guard.log_failed();
                        return Some((Ok(error_event("the worker failed mid-stream and migration is off (--migration-limit)")), None));
                    }
                    if let Some(reason) = unmigratable(&m.original) {
                        guard.log_failed();
                        let msg = format!("the worker failed mid-stream and the request cannot be continued faithfully ({reason})");
                        return Some((Ok(error_event(&msg)), None));
                    }
                    m.left -= 1;
                    match m.continue_after(guard, false).await {
                        Ok(Continued::Going(next, g)) => (up, guard) = (next, g),
                        Ok(Continued::Stopped) => return Some((Ok(m.stopped_events()), None)),
                        Err(e) => {
                            return Some((Ok(error_event(&format!("migration failed: {e}"))), None))
                        }
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests;
