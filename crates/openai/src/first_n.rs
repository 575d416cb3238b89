//! First-N-of-M: the answer of a request ended because its RL group has enough samples (finish
//! reason `abort`, the usage of what it produced), as a stream's last events or a whole body,
//! under the `id`, `model` and `created` of the answer it ends ([`Identity`]).

use crate::request::Kind;
use crate::{fingerprint, sse, usage};
use bytes::Bytes;
use serde_json::{json, Value};

const ID: &str = "kvrouter-group-satisfied";

/// What an answer says it is: its `id`, `model` and `created` (Unix seconds), which OpenAI's
/// schema requires of every chunk and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The answer's `id`.
    pub id: String,
    /// The model that answered.
    pub model: String,
    /// When the answer began, Unix seconds.
    pub created: u64,
}

impl Identity {
    /// An engine's event or body's own, if it states all three.
    pub fn of(v: &Value) -> Option<Self> {
        Some(Identity {
            id: v.get("id")?.as_str()?.to_owned(),
            model: v.get("model")?.as_str()?.to_owned(),
            created: v.get("created")?.as_u64()?,
        })
    }

    /// For an answer the engine said nothing of: the router's id, the request's `model`, and
    /// `created` (now).
    pub fn fresh(model: &str, created: u64) -> Self {
        Identity {
            id: ID.to_owned(),
            model: model.to_owned(),
            created,
        }
    }

    fn fields(&self, object: &str, choice: Value, usage: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage})
    }
}

/// The last events of a stream ended by its group, `fingerprint` stamped when given.
pub fn events(
    kind: Kind,
    identity: &Identity,
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
    let usage = usage::value(prompt_tokens, completion_tokens, None);
    let mut v = identity.fields(kind.chunk_object(), choice, usage);
    if let Some(f) = fingerprint {
        fingerprint::stamp(&mut v, f);
    }
    sse::last_events(&v)
}

/// The whole answer of a request ended by its group, with the `text` it produced so far.
pub fn body(
    kind: Kind,
    identity: &Identity,
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
    let usage = usage::value(prompt_tokens, completion_tokens, None);
    let mut v = identity.fields(kind.object(), choice, usage);
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
        let engine = json!({"id": "cmpl-7", "object": "chat.completion.chunk", "created": 5,
            "model": "m", "choices": []});
        let identity = Identity::of(&engine).unwrap();
        let out = events(Kind::Chat, &identity, 4, 2, Some("policy-1"));
        let first = sse::json(sse::events(&out).next().unwrap()).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        // The answer it ends keeps its id, model and creation time.
        assert_eq!(
            (&first["id"], &first["model"], &first["created"]),
            (&json!("cmpl-7"), &json!("m"), &json!(5))
        );
        assert_eq!(first["choices"][0]["finish_reason"], "abort");
        assert_eq!(first["usage"], usage::value(4, 2, None));
        assert_eq!(first["system_fingerprint"], "policy-1");
        assert!(out.ends_with(sse::DONE_EVENT));

        let b = body(
            Kind::Completion,
            &Identity::fresh("m", 9),
            "so far",
            3,
            0,
            None,
        );
        assert_eq!(b["object"], "text_completion");
        assert_eq!((&b["model"], &b["created"]), (&json!("m"), &json!(9)));
        assert_eq!(b["id"], ID);
        // An engine's answer lacking a field gives no identity of its own.
        assert_eq!(Identity::of(&json!({"id": "a", "model": "m"})), None);
        assert_eq!(b["choices"][0]["text"], "so far");
        assert_eq!(b["usage"]["total_tokens"], 3);
        assert!(b.get("system_fingerprint").is_none());
    }
}
