//! A whole (non-streamed) answer through the continuation machine: stamped, its usage read,
//! and joined with the parts before it when a weight update's abort continued it.

use super::{Continuation, Whole, IN_A_TOOL_CALL};
use axum::body::Bytes;
use kvrouter_openai::continuation::{body_text, finished_by_abort, set_body_text, tool_call};
use kvrouter_openai::fingerprint::{fingerprint, stamp, stamp_body, stamp_raw};
use kvrouter_openai::first_n;
use serde_json::Value;

impl Continuation {
    /// A whole (non-streamed) answer of the current attempt. A weight update's abort continues
    /// it; the parts are joined into one answer (the text of every part, the original prompt's
    /// usage, the completion tokens of all parts), stamped with the version that ended it.
    pub(crate) fn whole(&mut self, bytes: Bytes, draining: impl Fn() -> bool) -> Whole {
        if let Some(done) = self.whole_in_text(&bytes) {
            return done;
        }
        // Not JSON, or not an object (no field to stamp): passed on as it came.
        let Ok(mut v @ Value::Object(_)) = serde_json::from_slice::<Value>(&bytes) else {
            return Whole::Done {
                body: bytes,
                usage: None,
            };
        };
        if self.identity.is_none() {
            self.identity = first_n::Identity::of(&v);
        }
        if finished_by_abort(&v) && draining() {
            if let Some(reason) = self
                .unmigratable
                .or(tool_call(&v).then_some(IN_A_TOOL_CALL))
            {
                return Whole::Fail(format!(
                    "the request was aborted by a weight update and cannot be continued faithfully ({reason})"
                ));
            }
            self.generated_text.push_str(body_text(self.kind, &v));
            self.generated_tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            if self.original_usage.as_ref().is_none_or(Value::is_null) {
                self.original_usage = Some(v.get("usage").cloned().unwrap_or(Value::Null));
            }
            return Whole::Continue;
        }
        let usage = kvrouter_openai::usage::of(&v).cloned();
        let fp = fingerprint(self.version);
        let Some(first_usage) = self.original_usage.take() else {
            // One part: the engine's body as it wrote it, stamped in its text.
            let body = stamp_body(bytes, &fp);
            return Whole::Done { body, usage };
        };
        let joined = format!("{}{}", self.generated_text, body_text(self.kind, &v));
        set_body_text(self.kind, &mut v, &joined);
        let completion =
            v["usage"]["completion_tokens"].as_u64().unwrap_or(0) + self.generated_tokens;
        if first_usage.is_object() {
            v["usage"] = kvrouter_openai::usage::joined(first_usage, completion);
        }
        stamp(&mut v, &fp);
        let body = serde_json::to_vec(&v).map(Bytes::from).unwrap_or(bytes);
        Whole::Done { body, usage }
    }

    /// The usual whole answer, read in its text: one part (nothing continued before it), no
    /// `"abort"` anywhere in it (so no weight update's abort to continue), valid JSON. Its
    /// usage is parsed alone and the fingerprint set in the text; the body is never read into
    /// a `Value`. `None`: the answer is read whole ([`Continuation::whole`]).
    fn whole_in_text(&self, bytes: &Bytes) -> Option<Whole> {
        if self.original_usage.is_some() || memchr::memmem::find(bytes, b"\"abort\"").is_some() {
            return None;
        }
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).ok()?;
        let usage = kvrouter_openai::usage::in_text(bytes)?;
        let body = stamp_raw(bytes, &fingerprint(self.version))?;
        Some(Whole::Done {
            body: Bytes::from(body),
            usage,
        })
    }
}
