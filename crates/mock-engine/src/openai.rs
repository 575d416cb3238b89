//! OpenAI request parsing and response bodies for the mock engine.

use crate::error::ApiError;
use kvrouter_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::{json, Value};

/// A parsed generation request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GenRequest {
    pub(crate) model: String,
    pub(crate) prompt_tokens: Vec<u32>,
    pub(crate) max_tokens: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
}

fn check_model(body: &Value, served: &str) -> Result<String, ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Ok(served.to_owned()),
        Some(Value::String(m)) if m == served => Ok(m.clone()),
        Some(Value::String(m)) => Err(ApiError::unknown_model(m)),
        Some(_) => Err(ApiError::invalid("`model` must be a string", Some("model"))),
    }
}

fn max_tokens(body: &Value, keys: &[&'static str], default: u32) -> Result<u32, ApiError> {
    for key in keys {
        match body.get(*key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = v.as_i64().ok_or_else(|| {
                    ApiError::invalid(format!("`{key}` must be an integer"), Some(key))
                })?;
                if n <= 0 {
                    return Err(ApiError::invalid(
                        format!("`{key}` must be at least 1, got {n}"),
                        Some(key),
                    ));
                }
                return u32::try_from(n)
                    .map_err(|_| ApiError::invalid(format!("`{key}` is too large"), Some(key)));
            }
        }
    }
    Ok(default)
}

fn stream_flags(body: &Value) -> Result<(bool, bool), ApiError> {
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "`stream` must be a boolean",
                Some("stream"),
            ))
        }
    };
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Some(n) = body.get("n").and_then(Value::as_i64) {
        if n != 1 {
            return Err(ApiError::invalid("only `n` = 1 is supported", Some("n")));
        }
    }
    Ok((stream, include_usage))
}

/// `/v1/completions`: `prompt` is a string or a list of token ids (one prompt only).
pub(crate) fn parse_completion(
    body: &Value,
    served: &str,
    tokenizer: &dyn Tokenizer,
    default_max: u32,
) -> Result<GenRequest, ApiError> {
    let model = check_model(body, served)?;
    let prompt_tokens = match body.get("prompt") {
        Some(Value::String(s)) => tokenizer.encode(s),
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| ApiError::invalid("token ids must fit in 32 bits", Some("prompt")))?,
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            Value::String(s) => tokenizer.encode(s),
            Value::Array(ids) => ids
                .iter()
                .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "token ids must be non-negative 32-bit integers",
                        Some("prompt"),
                    )
                })?,
            _ => {
                return Err(ApiError::invalid(
                    "`prompt` must be a string or a list of token ids",
                    Some("prompt"),
                ))
            }
        },
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "batched prompts are not supported; send one prompt per request",
                Some("prompt"),
            ))
        }
        None => return Err(ApiError::invalid("`prompt` is required", Some("prompt"))),
        Some(_) => {
            return Err(ApiError::invalid(
                "`prompt` must be a string or a list of token ids",
                Some("prompt"),
            ))
        }
    };
    if prompt_tokens.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let max_tokens = max_tokens(body, &["max_tokens"], default_max)?;
    let (stream, include_usage) = stream_flags(body)?;
    Ok(GenRequest {
        model,
        prompt_tokens,
        max_tokens,
        stream,
        include_usage,
    })
}

/// `/v1/chat/completions`: `messages` rendered with `template` and tokenized.
pub(crate) fn parse_chat(
    body: &Value,
    served: &str,
    tokenizer: &dyn Tokenizer,
    template: &ChatTemplate,
    default_max: u32,
) -> Result<GenRequest, ApiError> {
    let model = check_model(body, served)?;
    let Some(Value::Array(raw)) = body.get("messages") else {
        return Err(ApiError::invalid(
            "`messages` must be a list of messages",
            Some("messages"),
        ));
    };
    if raw.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    let messages = raw
        .iter()
        .map(ChatMessage::from_openai)
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| {
            ApiError::invalid(
                "each message needs a string `role` and text `content`",
                Some("messages"),
            )
        })?;
    let continue_final = body
        .get("continue_final_message")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let rendered = if continue_final {
        template.render_continuation(&messages)
    } else {
        let add_generation_prompt = body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        template.render(&messages, add_generation_prompt)
    };
    let prompt = rendered.map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let prompt_tokens = tokenizer.encode(&prompt);
    let max_tokens = max_tokens(body, &["max_completion_tokens", "max_tokens"], default_max)?;
    let (stream, include_usage) = stream_flags(body)?;
    Ok(GenRequest {
        model,
        prompt_tokens,
        max_tokens,
        stream,
        include_usage,
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
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// Which endpoint shapes the bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
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
            "id": id, "object": "text_completion", "created": created, "model": model,
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
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    };
    json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage.json()})
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_tokenizer::BuiltinTokenizer;

    #[test]
    fn bad_fields_are_named() {
        let t = BuiltinTokenizer::new();
        let e =
            parse_completion(&json!({"prompt": "hi", "max_tokens": 0}), "m", &t, 16).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        let e =
            parse_completion(&json!({"model": "other", "prompt": "hi"}), "m", &t, 16).unwrap_err();
        assert_eq!(e.status.as_u16(), 404);
        let e = parse_chat(
            &json!({"messages": "hi"}),
            "m",
            &t,
            &ChatTemplate::ChatMl,
            16,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("messages"));
        let e = parse_completion(&json!({"prompt": 5}), "m", &t, 16).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
    }

    #[test]
    fn token_id_prompts_are_taken_as_given() {
        let t = BuiltinTokenizer::new();
        let r = parse_completion(
            &json!({"prompt": [1, 2, 3], "max_tokens": 4, "stream": true}),
            "m",
            &t,
            16,
        )
        .unwrap();
        assert_eq!(
            (r.prompt_tokens, r.max_tokens, r.stream),
            (vec![1, 2, 3], 4, true)
        );
        let r = parse_chat(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}),
            "m",
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
