//! First-N-of-M endings: what a request ended because its RL group has enough samples answers.

use super::Migration;
use crate::routing::Kind;
use axum::body::Bytes;
use kvrouter_core::ids::WorkerId;
use kvrouter_openai::fingerprint::fingerprint;
use kvrouter_openai::first_n;

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
            first_n::events(kind, prompt_tokens, 0, None),
        )
            .into_response();
    }
    axum::Json(first_n::body(kind, "", prompt_tokens, 0, None)).into_response()
}

impl Migration {
    /// The last events of a stream ended because its group has enough samples.
    pub(super) fn stopped_events(&self) -> Bytes {
        first_n::events(
            self.kind,
            self.reported_prompt(),
            self.generated_tokens,
            Some(&fingerprint(self.version)),
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
        let body = first_n::body(
            self.kind,
            &self.generated_text,
            self.reported_prompt(),
            self.generated_tokens,
            Some(&fingerprint(self.version)),
        );
        (Bytes::from(body.to_string()), self.worker, self.version)
    }
}
