//! OpenAI request parsing and response bodies for the mock engine.

use crate::error::ApiError;
use kvrouter_openai::request::{self, Prompt, StreamFlags};
use kvrouter_openai::Body;
pub(crate) use kvrouter_openai::Kind;
use kvrouter_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::{json, Value};

/// A parsed generation request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GenRequest {
    pub(crate) model: String,
    /// vLLM's `cache_salt` (not empty): part of the namespace its blocks are hashed in.
    pub(crate) cache_salt: Option<String>,
    pub(crate) prompt_tokens: Vec<u32>,
    pub(crate) max_tokens: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
}

/// The model a request names, one of the `served` names (base models and LoRA adapters; the
/// first when it names none).
pub(crate) fn check_model(body: &Value, served: &[String]) -> Result<String, ApiError> {
    let model = request::check_model(body, served, false)?;
    Ok(model.unwrap_or_else(|| served.first().cloned().unwrap_or_default()))
}

/// The budget and stream flags every generation request carries; only `n` = 1 is served.
fn sampling(kind: Kind, body: &Value, default_max: u32) -> Result<(u32, StreamFlags), ApiError> {
    let max_tokens = request::max_tokens(kind, body)?.unwrap_or(default_max);
    let flags = request::stream_flags(body)?;
    if request::choices(body)?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only `n` = 1 is supported", Some("n")));
    }
    Ok((max_tokens, flags))
}

/// A `/v1/completions` body: a JSON object, a token-id `prompt` read straight into ids (a
/// 400,000-token prompt read as a `Value` per id took the engine 24 ms to its first token,
/// 12 ms as text). The same errors as `http::parse_object`.
pub(crate) fn completion_body(raw: &[u8]) -> Result<Body, ApiError> {
    let body = Body::from_slice(raw).map_err(ApiError::not_json)?;
    if !body.is_object() {
        return Err(ApiError::not_an_object());
    }
    Ok(body)
}

/// `/v1/completions`: `prompt` is a string or a list of token ids (one prompt only).
pub(crate) fn parse_completion(
    body: &Body,
    served: &[String],
    tokenizer: &dyn Tokenizer,
    default_max: u32,
) -> Result<GenRequest, ApiError> {
    let model = check_model(body.fields(), served)?;
    let view = body.prompt()?;
    let body = body.fields();
    if view.count > 1 {
        return Err(ApiError::invalid(
            "batched prompts are not supported; send one prompt per request",
            Some("prompt"),
        ));
    }
    let prompt_tokens = match view.first {
        Prompt::Ids(ids) => ids.into_owned(),
        Prompt::Text(text) => tokenizer.encode(&text),
    };
    if prompt_tokens.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let (max_tokens, flags) = sampling(Kind::Completion, body, default_max)?;
    Ok(GenRequest {
        model,
        cache_salt: request::cache_salt(body).map(str::to_owned),
        prompt_tokens,
        max_tokens,
        stream: flags.stream,
        include_usage: flags.include_usage,
    })
}

/// `/v1/chat/completions`: `messages` rendered with `template` and tokenized.
pub(crate) fn parse_chat(
    body: &Value,
    served: &[String],
    tokenizer: &dyn Tokenizer,
    template: &ChatTemplate,
    default_max: u32,
) -> Result<GenRequest, ApiError> {
    let model = check_model(body, served)?;
    let chat = request::chat(body)?;
    let messages: Vec<ChatMessage> = chat
        .messages
        .into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: m.content,
        })
        .collect();
    let rendered = if chat.continue_final_message {
        template.render_continuation(&messages)
    } else {
        template.render(&messages, chat.add_generation_prompt)
    };
    let prompt = rendered.map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let prompt_tokens = tokenizer.encode(&prompt);
    let (max_tokens, flags) = sampling(Kind::Chat, body, default_max)?;
    Ok(GenRequest {
        model,
        cache_salt: request::cache_salt(body).map(str::to_owned),
        prompt_tokens,
        max_tokens,
        stream: flags.stream,
        include_usage: flags.include_usage,
    })
}

/// Token usage of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: u32,
    pub(crate) cached_tokens: u32,
    pub(crate) completion_tokens: u32,
}

impl Usage {
    pub(crate) fn json(&self) -> Value {
        kvrouter_openai::usage::value(
            self.prompt_tokens.into(),
            self.completion_tokens.into(),
            Some(self.cached_tokens.into()),
        )
    }
}

pub(crate) fn full_body(
    kind: Kind,
    id: &str,
    model: &str,
    created: u64,
    text: &str,
    usage: Usage,
    finish: &str,
) -> Value {
    match kind {
        Kind::Completion => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            "usage": usage.json(),
        }),
        Kind::Chat => json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}],
            "usage": usage.json(),
        }),
    }
}

/// One streamed chunk carrying `text` (and a finish reason on the last one).
pub(crate) fn chunk(
    kind: Kind,
    id: &str,
    model: &str,
    created: u64,
    text: &str,
    first: bool,
    finish: Option<&str>,
) -> Value {
    match kind {
        Kind::Completion => json!({
            "id": id, "object": kind.chunk_object(), "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        }),
        Kind::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        }
    }
}

/// The usage-only chunk sent last when `stream_options.include_usage` is set.
pub(crate) fn usage_chunk(kind: Kind, id: &str, model: &str, created: u64, usage: Usage) -> Value {
    json!({"id": id, "object": kind.chunk_object(), "created": created, "model": model, "choices": [], "usage": usage.json()})
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_tokenizer::BuiltinTokenizer;

    /// A completion body as the engine reads one (token-id prompts straight into ids).
    fn body(v: Value) -> Body {
        completion_body(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn bad_fields_are_named() {
        let t = BuiltinTokenizer::new();
        let m = ["m".to_owned()];
        let e = parse_completion(&body(json!({"prompt": "hi", "max_tokens": 0})), &m, &t, 16)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse_completion(&body(json!({"model": "other", "prompt": "hi"})), &m, &t, 16)
            .unwrap_err();
        assert_eq!(e.status.as_u16(), 404);
        let e = parse_chat(
            &json!({"messages": "hi"}),
            &m,
            &t,
            &ChatTemplate::ChatMl,
            16,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = parse_completion(&body(json!({"prompt": 5})), &m, &t, 16).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // A negative or fractional id, an empty list and a batch are refused as before.
        for bad in [
            json!([1, -2]),
            json!([1, 2.5]),
            json!([]),
            json!([[1], [2]]),
        ] {
            let e = parse_completion(&body(json!({"prompt": bad})), &m, &t, 16).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
        }
        // The model is checked before the prompt, as before.
        let e = parse_completion(&body(json!({"model": "x", "prompt": []})), &m, &t, 16);
        assert_eq!(e.unwrap_err().status.as_u16(), 404);
    }

    #[test]
    fn token_id_prompts_are_taken_as_given() {
        let t = BuiltinTokenizer::new();
        let m = ["m".to_owned()];
        let r = parse_completion(
            &body(json!({"prompt": [1, 2, 3], "max_tokens": 4, "stream": true})),
            &m,
            &t,
            16,
        )
        .unwrap();
        assert_eq!(
            (r.prompt_tokens, r.max_tokens, r.stream),
            (vec![1, 2, 3], 4, true)
        );
        // A long list (read in two streams by the id scan) comes out whole and in order.
        let ids: Vec<u32> = (0..5_000).map(|i| i * 7_919 % 1_000_003).collect();
        let r = parse_completion(&body(json!({"prompt": ids})), &m, &t, 16).unwrap();
        assert_eq!(r.prompt_tokens, ids);
        let r = parse_chat(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}),
            &m,
            &t,
            &ChatTemplate::ChatMl,
            16,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 3);
        assert_eq!(
            r.prompt_tokens,
            t.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        );
    }
}
