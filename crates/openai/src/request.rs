//! Typed views of an OpenAI request body: the endpoint, the model, the prompt (text, token ids
//! or chat messages) and the sampling fields kvrouter reads. Every error names its field.

use crate::error::RequestError;
use serde_json::Value;
use std::borrow::Cow;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

impl Kind {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }

    /// The `object` of a whole answer.
    pub fn object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        }
    }

    /// The `object` of a streamed chunk.
    pub fn chunk_object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }
}

/// The `model` field, checked against the `served` names (any name when `served` is empty).
/// `Ok(None)`: absent or null, allowed only when not `required`.
pub fn check_model(
    body: &Value,
    served: &[String],
    required: bool,
) -> Result<Option<String>, RequestError> {
    match body.get("model") {
        None | Some(Value::Null) if required => {
            Err(RequestError::invalid("`model` is required", "model"))
        }
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(m)) if served.is_empty() || served.iter().any(|s| s == m) => {
            Ok(Some(m.clone()))
        }
        Some(Value::String(m)) => Err(RequestError::UnknownModel(m.clone())),
        Some(_) => Err(RequestError::invalid("`model` must be a string", "model")),
    }
}

/// One prompt: token ids (taken as given) or text (to be tokenized), borrowed from the body
/// where it can be (a token-id prompt read by [`crate::Body`], any text), owned where it had
/// to be converted (token ids read from JSON values).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// Token ids.
    Ids(Cow<'a, [u32]>),
    /// Text.
    Text(Cow<'a, str>),
}

impl Prompt<'_> {
    /// The prompt, owning its ids or text.
    pub fn into_owned(self) -> Prompt<'static> {
        match self {
            Prompt::Ids(ids) => Prompt::Ids(Cow::Owned(ids.into_owned())),
            Prompt::Text(text) => Prompt::Text(Cow::Owned(text.into_owned())),
        }
    }
}

/// The `prompt` of a completion: its first prompt, and how many prompts the body carries (a
/// batch is a list of strings or of token-id lists).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptView<'a> {
    /// The first (often only) prompt.
    pub first: Prompt<'a>,
    /// How many prompts the body carries.
    pub count: usize,
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| {
            RequestError::invalid("token ids must be 32-bit unsigned integers", "prompt")
        })
}

/// The error of a `prompt` of no shape a completion takes.
pub(crate) fn prompt_shape() -> RequestError {
    RequestError::invalid(
        "`prompt` must be a string, a list of strings or token ids",
        "prompt",
    )
}

/// The error of an empty list as `prompt`.
pub(crate) fn prompt_empty() -> RequestError {
    RequestError::invalid(
        "`prompt` is empty: give text or at least one token id",
        "prompt",
    )
}

/// The `prompt` of a `/v1/completions` body: a string, a list of token ids, or a batch.
pub fn prompt(body: &Value) -> Result<PromptView<'_>, RequestError> {
    match body.get("prompt") {
        Some(value) => prompt_of(value),
        None => Err(RequestError::invalid("`prompt` is required", "prompt")),
    }
}

/// A prompt's value read as [`prompt`] reads a body's `prompt` (errors name `prompt`).
pub(crate) fn prompt_of(value: &Value) -> Result<PromptView<'_>, RequestError> {
    let one = |first| PromptView { first, count: 1 };
    match value {
        Value::String(s) => Ok(one(Prompt::Text(Cow::Borrowed(s)))),
        Value::Array(items) if items.is_empty() => Err(prompt_empty()),
        Value::Array(items) if items.iter().all(Value::is_u64) => {
            token_ids(items).map(|ids| one(Prompt::Ids(Cow::Owned(ids))))
        }
        Value::Array(items) => {
            let first = match &items[0] {
                Value::String(s) => Prompt::Text(Cow::Borrowed(s)),
                Value::Array(ids) => Prompt::Ids(Cow::Owned(token_ids(ids)?)),
                _ => return Err(prompt_shape()),
            };
            Ok(PromptView {
                first,
                count: items.len(),
            })
        }
        _ => Err(prompt_shape()),
    }
}

/// One chat message, as a template renders it: parts of a multi-part `content` joined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text (empty for an assistant message that only carries tool calls).
    pub content: String,
}

/// The `messages` of a `/v1/chat/completions` body and how to render them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatView {
    /// The messages, checked field by field.
    pub messages: Vec<Message>,
    /// `continue_final_message`: the last (assistant) message is continued, not closed.
    pub continue_final_message: bool,
    /// `add_generation_prompt` (default true): the assistant turn is opened after the messages.
    pub add_generation_prompt: bool,
}

/// One chat message, checked field by field: a string `role`, and `content` that is a string or
/// a list of parts. `content` may be absent or null only on an assistant message that carries
/// `tool_calls` (or the legacy `function_call`), as OpenAI allows.
fn message(i: usize, value: &Value) -> Result<Message, RequestError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Some(m) = value.as_object() else {
        return Err(RequestError::invalid_at(
            format!("messages[{i}] must be an object"),
            format!("messages[{i}]"),
        ));
    };
    let Some(role) = m.get("role").and_then(Value::as_str) else {
        return Err(RequestError::invalid_at(
            format!("{} must be a string", at("role")),
            at("role"),
        ));
    };
    let present = |k: &str| m.get(k).is_some_and(|v| !v.is_null());
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_of_parts(i, parts)?,
        None | Some(Value::Null)
            if role == "assistant" && (present("tool_calls") || present("function_call")) =>
        {
            String::new()
        }
        None | Some(Value::Null) => {
            return Err(RequestError::invalid_at(
                format!(
                    "{} is required (it may be null only on an assistant message with tool_calls)",
                    at("content")
                ),
                at("content"),
            ))
        }
        Some(_) => {
            return Err(RequestError::invalid_at(
                format!(
                    "{} must be a string or a list of content parts",
                    at("content")
                ),
                at("content"),
            ))
        }
    };
    Ok(Message {
        role: role.to_owned(),
        content,
    })
}

/// The text of a list of content parts, each checked: an object with a string `type`; a `text`
/// part has a string `text`. Parts of other types (`image_url`, `input_audio`, ...) are passed
/// to the engine as they are and play no part in routing.
fn text_of_parts(i: usize, parts: &[Value]) -> Result<String, RequestError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        let Some(p) = part.as_object() else {
            return Err(RequestError::invalid_at(
                format!("{at} must be a content part (an object with a `type`)"),
                at,
            ));
        };
        match p.get("type").map(|t| t.as_str()) {
            Some(Some("text")) => match p.get("text").and_then(Value::as_str) {
                Some(t) => text.push_str(t),
                None => {
                    return Err(RequestError::invalid_at(
                        format!("{at}.text must be a string (a part of type `text`)"),
                        format!("{at}.text"),
                    ))
                }
            },
            Some(Some(_)) => {}
            _ => {
                return Err(RequestError::invalid_at(
                    format!("{at}.type must be a string such as \"text\""),
                    format!("{at}.type"),
                ))
            }
        }
    }
    Ok(text)
}

/// The chat of a `/v1/chat/completions` body.
pub fn chat(body: &Value) -> Result<ChatView, RequestError> {
    let Some(Value::Array(raw)) = body.get("messages") else {
        return Err(RequestError::invalid(
            "`messages` must be a list of messages",
            "messages",
        ));
    };
    if raw.is_empty() {
        return Err(RequestError::invalid("`messages` is empty", "messages"));
    }
    let messages = raw
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let continue_final_message = flag(body, "continue_final_message", false)?;
    let add_generation_prompt = flag(body, "add_generation_prompt", !continue_final_message)?;
    if continue_final_message && add_generation_prompt {
        return Err(RequestError::invalid(
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
            "continue_final_message",
        ));
    }
    Ok(ChatView {
        messages,
        continue_final_message,
        add_generation_prompt,
    })
}

/// A boolean field (absent or null: `default`); any other type is an error naming it.
fn flag(body: &Value, key: &'static str, default: bool) -> Result<bool, RequestError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RequestError::invalid(
            format!("`{key}` must be a boolean"),
            key,
        )),
    }
}

/// Whether the answer is streamed, and whether the stream ends with a usage chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamFlags {
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

/// `stream` (a boolean, default false) and `stream_options.include_usage`.
pub fn stream_flags(body: &Value) -> Result<StreamFlags, RequestError> {
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(RequestError::invalid(
                "`stream` must be a boolean",
                "stream",
            ))
        }
    };
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(options @ Value::Object(_)) => match options.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(RequestError::invalid(
                    "`stream_options.include_usage` must be a boolean",
                    "stream_options.include_usage",
                ))
            }
        },
        Some(_) => {
            return Err(RequestError::invalid(
                "`stream_options` must be an object",
                "stream_options",
            ))
        }
    };
    Ok(StreamFlags {
        stream,
        include_usage,
    })
}

/// The output-token budget: `max_completion_tokens` then `max_tokens` for chats, `max_tokens`
/// for completions; `None` when absent. At least 1 and at most `u32::MAX`.
pub fn max_tokens(kind: Kind, body: &Value) -> Result<Option<u32>, RequestError> {
    let keys: &[&'static str] = match kind {
        Kind::Chat => &["max_completion_tokens", "max_tokens"],
        Kind::Completion => &["max_tokens"],
    };
    for &key in keys {
        match body.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = integer(key, v)?;
                if n <= 0 {
                    return Err(RequestError::invalid(
                        format!("`{key}` must be at least 1, got {n}"),
                        key,
                    ));
                }
                return u32::try_from(n)
                    .map(Some)
                    .map_err(|_| RequestError::invalid(format!("`{key}` is too large"), key));
            }
        }
    }
    Ok(None)
}

/// `n`, the number of choices asked for (`None` when absent or null: 1). Anything but an
/// integer is an error naming `n`, not "absent".
pub fn choices(body: &Value) -> Result<Option<i64>, RequestError> {
    match body.get("n") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => integer("n", v).map(Some),
    }
}

/// `v` as an integer field `key`: one past `i64` is "too large", anything else not an integer
/// "must be an integer".
fn integer(key: &'static str, v: &Value) -> Result<i64, RequestError> {
    v.as_i64().ok_or_else(|| {
        let why = if v.is_u64() {
            "is too large"
        } else {
            "must be an integer"
        };
        RequestError::invalid(format!("`{key}` {why}"), key)
    })
}

/// vLLM's `cache_salt`, when set and not empty.
pub fn cache_salt(body: &Value) -> Option<&str> {
    body.get("cache_salt")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// The `model` field as a string, unchecked.
pub fn model(body: &Value) -> Option<&str> {
    body.get("model").and_then(Value::as_str)
}

#[cfg(test)]
mod tests;
