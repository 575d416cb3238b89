//! First-N-of-M endings: what a request ended because its RL group has enough samples answers.

use super::{fingerprint, Migration};
use crate::routing::Kind;
use axum::body::Bytes;
use kvrouter_core::ids::WorkerId;
use serde_json::{json, Value};

/// The last event of a stream ended because its group has enough samples: finish reason
/// `abort`, and the usage of what it produced.
pub(super) fn group_satisfied_events(
    kind: Kind,
    prompt_tokens: u64,
    completion_tokens: u64,
    version: Option<u64>,
) -> Bytes {
    let choice = match kind {
        Kind::Completion => {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "abort"})
        }
        Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "abort"}),
    };
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    };
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
    let mut v = json!({"id": "kvrouter-group-satisfied", "object": object, "choices": [choice], "usage": usage});
    if let Some(version) = version {
        v["system_fingerprint"] = json!(fingerprint(version));
    }
    Bytes::from(format!("data: {v}\n\ndata: [DONE]\n\n"))
}

/// A non-streamed answer ended by first-N-of-M: `text` so far, finish reason `abort`.
fn group_satisfied_body(
    kind: Kind,
    text: &str,
    prompt_tokens: u64,
    completion_tokens: u64,
    version: Option<u64>,
) -> Value {
    let (choice, object) = match kind {
        Kind::Completion => (
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "abort"}),
            "text_completion",
        ),
        Kind::Chat => (
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "abort"}),
            "chat.completion",
        ),
    };
    let total = prompt_tokens + completion_tokens;
    let mut v = json!({
        "id": "kvrouter-group-satisfied", "object": object, "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total},
    });
    if let Some(version) = version {
        v["system_fingerprint"] = json!(fingerprint(version));
    }
    v
}

/// The whole answer of a request ended before it produced anything because its group has
/// enough samples (first-N-of-M): finish reason `abort`, no output.
pub(crate) fn group_satisfied_response(
    kind: Kind,
    stream: bool,
    prompt_tokens: u64,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if stream {
        return (
            [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
            group_satisfied_events(kind, prompt_tokens, 0, None),
        )
            .into_response();
    }
    axum::Json(group_satisfied_body(kind, "", prompt_tokens, 0, None)).into_response()
}

impl Migration {
    /// The last events of a stream ended because its group has enough samples.
    pub(super) fn stopped_events(&self) -> Bytes {
        group_satisfied_events(
            self.kind,
            self.reported_prompt(),
            self.generated_tokens,
            Some(self.version),
        )
    }

    /// Counts the request as aborted (when no attempt's guard did).
    pub(super) fn count_aborted(&self) {
        self.state.inner.metrics.requests.inc(&[
            ("status", "aborted"),
            ("mode", self.state.inner.config.router.router_mode.as_str()),
        ]);
    }

    /// The prompt count a continued answer reports: the original prompt's, from the first
    /// attempt's usage, else the router's own count.
    pub(super) fn reported_prompt(&self) -> u64 {
        self.first_prompt_tokens.unwrap_or(self.prompt_tokens)
    }

    /// A non-streamed answer ended because its group has enough samples: what it produced so
    /// far, with finish reason `abort`.
    pub(super) fn ended_by_group(&self) -> (Bytes, WorkerId, u64) {
        let body = group_satisfied_body(
            self.kind,
            &self.generated_text,
            self.reported_prompt(),
            self.generated_tokens,
            Some(self.version),
        );
        (Bytes::from(body.to_string()), self.worker, self.version)
    }
}
