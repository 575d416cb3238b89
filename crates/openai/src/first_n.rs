//! First-N-of-M: the answer of a request ended because its RL group has enough samples (finish
//! reason `abort`, the usage of what it produced), as a stream's last events or a whole body.

use crate::request::Kind;
use crate::{fingerprint, sse, usage};
use bytes::Bytes;
use serde_json::{json, Value};

const ID: &str = "kvrouter-group-satisfied";

/// The last events of a stream ended by its group, `fingerprint` stamped when given.
pub fn events(
    kind: Kind,
    prompt_tokens: u64,
    completion_tokens: u64,
    fingerprint: Option<&str>,
) -> Bytes {
    let choice = match kind {
        Kind::Completion => {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "abort"})
        }
        Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "abort"}),
    };
    let mut v = json!({"id": ID, "object": kind.chunk_object(), "choices": [choice],
        "usage": usage::value(prompt_tokens, completion_tokens, None)});
    if let Some(f) = fingerprint {
        fingerprint::stamp(&mut v, f);
    }
    sse::last_events(&v)
}

/// The whole answer of a request ended by its group, with the `text` it produced so far.
pub fn body(
    kind: Kind,
    text: &str,
    prompt_tokens: u64,
    completion_tokens: u64,
    fingerprint: Option<&str>,
) -> Value {
    let choice = match kind {
        Kind::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "abort"})
        }
        Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": null, "finish_reason": "abort"}),
    };
    let mut v = json!({"id": ID, "object": kind.object(), "choices": [choice],
        "usage": usage::value(prompt_tokens, completion_tokens, None)});
    if let Some(f) = fingerprint {
        fingerprint::stamp(&mut v, f);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_endings_abort_with_the_usage_produced() {
        let out = events(Kind::Chat, 4, 2, Some("policy-1"));
        let first = sse::json(sse::events(&out).next().unwrap()).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["finish_reason"], "abort");
        assert_eq!(first["usage"], usage::value(4, 2, None));
        assert_eq!(first["system_fingerprint"], "policy-1");
        assert!(out.ends_with(sse::DONE_EVENT));

        let b = body(Kind::Completion, "so far", 3, 0, None);
        assert_eq!(b["object"], "text_completion");
        assert_eq!(b["choices"][0]["text"], "so far");
        assert_eq!(b["usage"]["total_tokens"], 3);
        assert!(b.get("system_fingerprint").is_none());
    }
}
