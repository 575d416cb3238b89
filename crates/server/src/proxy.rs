//! The request path: parse, tokenize and hash, route, forward, stream back.
//!
//! The body goes upstream unchanged and the upstream's bytes come back unchanged (chunks are
//! forwarded as they arrive). The load the core recorded for the request is released by a guard
//! that lives in the response body, so a client disconnect or a dropped stream still releases it.
//! An upstream failure before the first byte is retried on another worker (`--retries`).

use crate::error::ServeError;
use crate::guard::{log_line, LoadGuard};
use crate::headers::{admission_fields, header_str, pin_from, GROUP_HEADER, SESSION_HEADERS};
use crate::health;
use crate::migrate::{self, Migration};
use crate::provenance::Provenance;
use crate::registry;
use crate::routing::{routing_input, Kind, RoutingInput};
use crate::state::{AppState, Release};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use futures::StreamExt;
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::router::{Admission, Decision, RouteError, RouteRequest};
use kvrouter_openai::fingerprint::fingerprint;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::time::Instant;

type Chunks = futures::stream::BoxStream<'static, Result<Bytes, String>>;

/// `up`, ended with an error when it sends nothing for `limit`.
fn idle_limited(up: Chunks, limit: std::time::Duration) -> Chunks {
    futures::stream::unfold(Some(up), move |up| async move {
        let mut up = up?;
        match tokio::time::timeout(limit, up.next()).await {
            Ok(Some(item)) => Some((item, Some(up))),
            Ok(None) => None,
            Err(_) => Some((
                Err(format!(
                    "the worker sent nothing for {:.3}s (--stream-idle-timeout-secs)",
                    limit.as_secs_f64()
                )),
                None,
            )),
        }
    })
    .boxed()
}

/// The body's `model`, which must be one the workers serve (any, before they report theirs).
fn check_model(state: &AppState, body: &Value) -> Result<(), ServeError> {
    let models = state.inner.models.read().expect("models lock");
    kvrouter_openai::request::check_model(body, &models, true)?;
    Ok(())
}

fn decision_header(d: &Decision) -> Option<HeaderValue> {
    let compact: Vec<Value> = d
        .candidates
        .iter()
        .map(|c| {
            serde_json::json!({
                "worker": c.rank.worker.0, "dp_rank": c.rank.dp_rank,
                "overlap": c.overlap.gpu_blocks, "credit": c.credit_blocks,
                "prefill": c.prefill_blocks, "decode": c.decode_blocks, "total": c.total,
            })
        })
        .collect();
    let v = serde_json::json!({"mode": d.mode.as_str(), "worker": d.rank.worker.0, "dp_rank": d.rank.dp_rank, "candidates": compact});
    HeaderValue::from_str(&v.to_string()).ok()
}

/// Takes a request out of the queue if its handler goes away while it waits.
struct QueuedGuard<'a> {
    inner: &'a crate::state::Inner,
    id: RequestId,
    armed: bool,
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.forget_placement(self.id);
            if !self.inner.lock_core().cancel_queued(self.id) {
                // Placed between our last look and now: release it.
                self.inner.release(self.id, Release::Cancelled);
            }
        }
    }
}

/// Admission: placed now, or queued until the driver places it (or its deadline passes).
pub(crate) async fn admit(state: &AppState, request: RouteRequest) -> Result<Decision, ServeError> {
    let inner = &state.inner;
    let id = request.id;
    let queued_at = Instant::now();
    // Register the waiter first, so a placement by the driver always finds it.
    let rx = inner.await_placement(id);
    let submitted = inner.lock_core().submit(request, inner.now());
    let reject = |reason: &'static str, e| {
        inner.metrics.rejections.inc(&[("reason", reason)]);
        ServeError::Rejected(e)
    };
    match submitted {
        Ok(Admission::Dispatched(d)) => {
            inner.forget_placement(id);
            Ok(d)
        }
        Ok(Admission::Queued) => {
            inner.wake_queue();
            let mut guard = QueuedGuard {
                inner,
                id,
                armed: true,
            };
            let placed = rx.await;
            guard.armed = false;
            inner
                .metrics
                .queue_wait
                .observe(queued_at.elapsed().as_secs_f64());
            match placed {
                Ok(Ok(d)) => Ok(d),
                Ok(Err(RouteError::DeadlineExceeded)) => {
                    inner.metrics.rejections.inc(&[("reason", "deadline")]);
                    Err(ServeError::Route(RouteError::DeadlineExceeded))
                }
                Ok(Err(e @ RouteError::QueueWaitExceeded { .. })) => {
                    inner.metrics.rejections.inc(&[("reason", "max_wait")]);
                    Err(ServeError::Route(e))
                }
                Ok(Err(e)) => Err(ServeError::Route(e)),
                Err(_) => Err(ServeError::Upstream("the router queue stopped".into())),
            }
        }
        Err(e) => {
            inner.forget_placement(id);
            match e {
                RouteError::QueueFull { .. } => Err(reject("queue_full", e)),
                RouteError::AllEligibleWorkersOverloaded
                    if inner.config.router.reject_when_overloaded =>
                {
                    Err(reject("overloaded", e))
                }
                e => Err(ServeError::Route(e)),
            }
        }
    }
}

/// Handles `/v1/completions` and `/v1/chat/completions`.
pub(crate) async fn handle(
    state: AppState,
    kind: Kind,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ServeError> {
    let arrival = Instant::now();
    let inner = &state.inner;
    let mode = inner.config.router.router_mode;
    let fail = |e: ServeError| {
        inner
            .metrics
            .requests
            .inc(&[("status", e.status_label()), ("mode", mode.as_str())]);
        e
    };
    let value: Value = serde_json::from_slice(&body).map_err(|e| {
        fail(ServeError::invalid(
            format!("the body is not valid JSON: {e}"),
            None,
        ))
    })?;
    if !value.is_object() {
        return Err(fail(ServeError::invalid(
            "the body must be a JSON object",
            None,
        )));
    }
    check_model(&state, &value).map_err(fail)?;
    let stream = kvrouter_openai::request::stream_flags(&value)
        .map_err(|e| fail(e.into()))?
        .stream;
    let RoutingInput { isl_tokens, blocks } =
        routing_input(&state, kind, &value).await.map_err(fail)?;
    let pin = pin_from(&headers).map_err(fail)?;
    let admission = admission_fields(&headers, &value, arrival, inner).map_err(fail)?;
    // First-N-of-M: a sibling of a group that has its N samples is not started at all.
    // Subscribe before looking, so a group satisfied in between is seen either way.
    let refuse = || {
        inner
            .metrics
            .requests
            .inc(&[("status", "aborted"), ("mode", mode.as_str())]);
        if inner.config.provenance.is_some() {
            let p = Box::new(Provenance {
                session: header_str(&headers, &SESSION_HEADERS).map(str::to_owned),
                group: header_str(&headers, &GROUP_HEADER).map(str::to_owned),
                prompt_tokens: isl_tokens,
                abort_reason: Some("group-satisfied"),
                ..Default::default()
            });
            log_line(&state, p, "aborted", None, arrival, None, None);
        }
        Ok(migrate::group_satisfied_response(kind, stream, isl_tokens))
    };
    let mut stop = match (admission.group, admission.group_need) {
        (Some(g), Some(_)) => {
            let rx = inner.group_stop(g);
            if inner.lock_core().group_satisfied(g) {
                return refuse();
            }
            Some(rx)
        }
        _ => None,
    };
    let mut tried: Vec<WorkerId> = Vec::new();
    let attempts = inner.config.retries + 1;
    let mut last_error = None;
    for attempt in 0..attempts {
        let id = RequestId(inner.next_request.fetch_add(1, Ordering::Relaxed));
        let mut request = RouteRequest::new(id, isl_tokens, blocks.clone());
        request.pin = pin;
        admission.apply(&mut request);
        let decision = if tried.is_empty() {
            // A sibling waiting in the queue ends there if its group gets enough samples.
            tokio::select! {
                d = admit(&state, request) => d.map_err(fail)?,
                _ = crate::state::stopped(&mut stop) => return refuse(),
            }
        } else {
            // A retry was admitted already: place it now, away from the failed workers.
            migrate::place_after_failure(&state, &request, &tried)
                .map_err(|e| fail(ServeError::Route(e)))?
        };
        let worker = decision.rank.worker;
        let queued_ms = arrival.elapsed().as_secs_f64() * 1e3;
        if attempt == 0 {
            let m = &inner.metrics;
            m.overhead.observe(arrival.elapsed().as_secs_f64());
            m.isl.observe(isl_tokens as f64);
            if isl_tokens > 0 {
                m.kv_hit_rate
                    .observe(decision.cached_tokens as f64 / isl_tokens as f64);
            }
        }
        let Some(base) = registry::url_of(&state, worker) else {
            inner.release(id, Release::Cancelled);
            tried.push(worker);
            continue;
        };
        let mut guard = LoadGuard::new(state.clone(), id, worker, mode, arrival, stream);
        guard.group = admission.group;
        guard.router_prompt_tokens = std::num::NonZeroU64::new(isl_tokens);
        if inner.config.provenance.is_some() {
            guard.prov = Some(Box::new(Provenance {
                request_id: id.0,
                session: header_str(&headers, &SESSION_HEADERS).map(str::to_owned),
                group: header_str(&headers, &GROUP_HEADER).map(str::to_owned),
                dp_rank: decision.rank.dp_rank,
                policy_version: decision.policy_version,
                prompt_tokens: isl_tokens,
                queue_ms: queued_ms,
                migrations: 0,
                ..Default::default()
            }));
        }
        let send = inner.send_upstream(
            inner
                .http
                .post(format!("{base}{}", kind.path()))
                .header("content-type", "application/json")
                .body(body.clone()),
            stream,
        );
        let upstream = tokio::select! {
            r = send => r,
            _ = crate::state::stopped(&mut stop) => {
                guard.end_aborted();
                return Ok(migrate::group_satisfied_response(kind, stream, isl_tokens));
            }
        };
        let response = match upstream {
            Ok(r) if r.status().is_server_error() => {
                last_error = Some(format!("worker {worker} answered {}", r.status()));
                None
            }
            Ok(r) => Some(r),
            Err(e) => {
                last_error = Some(format!("worker {worker}: {e}"));
                None
            }
        };
        health::observe(&state, worker, response.is_some(), health::Source::Request);
        let Some(response) = response else {
            // Nothing reached the client yet: release this attempt and try another worker.
            guard.done = true;
            inner.release(id, Release::Cancelled);
            inner.metrics.retries.inc(&[("mode", mode.as_str())]);
            tried.push(worker);
            if pin.is_some() {
                break;
            }
            continue;
        };
        let status =
            StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        guard.counts_as_sample = status.is_success();
        let mut builder = Response::builder().status(status);
        if let Some(ct) = response
            .headers()
            .get("content-type")
            .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok())
        {
            builder = builder.header("content-type", ct);
        }
        builder = builder
            .header("x-kvrouter-worker", worker.0.to_string())
            .header(
                "x-kvrouter-policy-version",
                decision.policy_version.to_string(),
            );
        if inner.config.expose_decisions {
            if let Some(h) = decision_header(&decision) {
                builder = builder.header("x-kvrouter-decision", h);
            }
        }
        if !stream && status.is_success() {
            // Read whole (it is one JSON object): stamped with the policy version, and
            // continued if a weight update aborted it.
            let read = tokio::select! {
                r = response.bytes() => r,
                _ = crate::state::stopped(&mut stop) => {
                    guard.end_aborted();
                    return Ok(migrate::group_satisfied_response(kind, false, isl_tokens));
                }
            };
            let first = match read {
                Ok(b) => b,
                Err(e) => {
                    health::observe(&state, worker, false, health::Source::Request);
                    drop(guard);
                    return Err(fail(ServeError::Upstream(format!("worker {worker}: {e}"))));
                }
            };
            guard.on_chunk(&first);
            let migration = Migration::new(state.clone(), kind, value, worker, arrival).following(
                decision.policy_version,
                admission,
                stop,
                isl_tokens,
            );
            let (out, worker, version) = migrate::unary(migration, first, guard)
                .await
                .map_err(fail)?;
            let mut builder = Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .header("x-kvrouter-worker", worker.0.to_string())
                .header("x-kvrouter-policy-version", version.to_string());
            if inner.config.expose_decisions {
                if let Some(h) = decision_header(&decision) {
                    builder = builder.header("x-kvrouter-decision", h);
                }
            }
            return Ok(builder.body(Body::from(out)).expect("valid response"));
        }
        // Streams are followed event by event when they may have to be continued elsewhere:
        // migration on failure, or a weight update's abort (the admin API is on).
        let continuable = inner.config.migration_limit > 0
            || inner.config.admin_token.is_some()
            || stop.is_some();
        if stream && continuable && status.is_success() {
            let migration = Migration::new(state.clone(), kind, value, worker, arrival).following(
                decision.policy_version,
                admission,
                stop,
                isl_tokens,
            );
            let body = migrate::stream(response, guard, migration);
            return Ok(builder
                .body(Body::from_stream(body))
                .expect("valid response"));
        }
        let idle = inner.config.stream_idle_timeout;
        let upstream_body = response
            .bytes_stream()
            .map(|r| r.map_err(|e| e.to_string()))
            .boxed();
        // A silent upstream counts as broken (a frozen engine mid-stream).
        let upstream_body = match idle {
            None => upstream_body,
            Some(limit) => idle_limited(upstream_body, limit),
        };
        // A stream that is not followed event by event cannot change workers: its first event
        // carries the version that serves it all.
        let stamp = (stream && status.is_success()).then(|| fingerprint(decision.policy_version));
        let body = futures::stream::unfold(
            (upstream_body, guard, stamp),
            |(mut up, mut guard, mut stamp)| async move {
                if guard.broken {
                    return None;
                }
                match up.next().await {
                    Some(Ok(chunk)) => {
                        guard.on_chunk(&chunk);
                        // The first chunk that starts an event gets the fingerprint.
                        let chunk = match stamp.take() {
                            Some(fingerprint) if chunk.starts_with(b"data:") => {
                                kvrouter_openai::fingerprint::stamp_first_event(chunk, &fingerprint)
                            }
                            kept => {
                                stamp = kept;
                                chunk
                            }
                        };
                        Some((Ok::<Bytes, std::io::Error>(chunk), (up, guard, stamp)))
                    }
                    Some(Err(e)) => {
                        // The upstream broke mid-stream: the guard cancels the request's load.
                        health::observe(&guard.state, guard.worker, false, health::Source::Request);
                        if guard.stream {
                            // End the stream cleanly with an in-band error.
                            let event = migrate::error_event(
                                "the worker failed mid-stream and migration is off (--migration-limit)",
                            );
                            guard.broken = true;
                            return Some((Ok(event), (up, guard, stamp)));
                        }
                        Some((Err(std::io::Error::other(e)), (up, guard, stamp)))
                    }
                    None => {
                        guard.finish();
                        None
                    }
                }
            },
        );
        return Ok(builder
            .body(Body::from_stream(body))
            .expect("valid response"));
    }
    Err(fail(ServeError::Upstream(
        last_error.unwrap_or_else(|| "no worker could be reached".into()),
    )))
}
