//! Continuation of non-streamed answers a weight update aborted.

use super::{draining_for_update, finished_by_abort, unmigratable, Migration};
use crate::guard::LoadGuard;
use axum::body::Bytes;
use kvrouter_core::ids::WorkerId;
use kvrouter_openai::continuation::{body_text, set_body_text};
use kvrouter_openai::fingerprint::{fingerprint, stamp};
use serde_json::Value;

/// A non-streamed answer: stamps `system_fingerprint` and, if a weight update aborted it,
/// continues it on an updated worker and joins the parts into one answer (the text of every
/// part, the original prompt's usage, the completion tokens of all parts). Returns the body and
/// the worker and policy version that ended it.
pub(crate) async fn unary(
    mut m: Migration,
    first: Bytes,
    mut guard: LoadGuard,
) -> Result<(Bytes, WorkerId, u64), crate::error::ServeError> {
    use crate::error::ServeError;
    m.stream = false;
    let mut bytes = first;
    let mut original_usage: Option<Value> = None;
    let mut continued = false;
    loop {
        let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) else {
            guard.finish();
            return Ok((bytes, m.worker, m.version));
        };
        if finished_by_abort(&v) && draining_for_update(&m.state, m.worker) {
            if let Some(reason) = unmigratable(&m.original) {
                guard.log_failed();
                drop(guard);
                return Err(ServeError::Upstream(format!(
                    "the request was aborted by a weight update and cannot be continued faithfully ({reason})"
                )));
            }
            continued = true;
            m.generated_text.push_str(body_text(m.kind, &v));
            m.generated_tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            if original_usage.is_none() {
                original_usage = v.get("usage").cloned();
            }
            // Its group may get enough samples while it waits or runs again.
            let (response, g) = match m.continue_attempt(guard, true).await {
                Ok(Some(sent)) => sent,
                Ok(None) => return Ok(m.ended_by_group()),
                Err(e) => {
                    return Err(ServeError::Upstream(format!(
                        "continuation after a weight update failed: {e}"
                    )))
                }
            };
            guard = g;
            let mut stop = m.stop.take();
            let read = tokio::select! {
                r = response.bytes() => r,
                _ = crate::state::stopped(&mut stop) => {
                    if let Some(p) = guard.prov.as_mut() {
                        p.output_tokens = m.generated_tokens;
                    }
                    guard.end_aborted();
                    return Ok(m.ended_by_group());
                }
            };
            m.stop = stop;
            bytes = match read {
                Ok(b) => b,
                Err(e) => {
                    guard.log_failed();
                    return Err(ServeError::Upstream(format!("worker {}: {e}", m.worker)));
                }
            };
            guard.on_chunk(&bytes);
            continue;
        }
        if continued {
            let joined = format!("{}{}", m.generated_text, body_text(m.kind, &v));
            set_body_text(m.kind, &mut v, &joined);
            let completion =
                v["usage"]["completion_tokens"].as_u64().unwrap_or(0) + m.generated_tokens;
            if let Some(u) = original_usage.take().filter(Value::is_object) {
                v["usage"] = kvrouter_openai::usage::joined(u, completion);
            }
        }
        stamp(&mut v, &fingerprint(m.version));
        guard.finish();
        let out = serde_json::to_vec(&v).map(Bytes::from).unwrap_or(bytes);
        return Ok((out, m.worker, m.version));
    }
}
