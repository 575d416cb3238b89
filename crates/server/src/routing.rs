//! Turning a request body into what the core routes on: tokens (tokenized on a bounded blocking
//! pool with the segment cache, or taken as given for token-id prompts) and block hashes.

use crate::error::ServeError;
use crate::state::AppState;
use kvrouter_core::hashing::{BlockHasher, BlockHashes, HashNamespace};
use kvrouter_tokenizer::ChatMessage;
use serde_json::Value;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }
}

/// What the router needs of a prompt.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RoutingInput {
    pub(crate) isl_tokens: u64,
    pub(crate) blocks: BlockHashes,
}

#[derive(Debug, PartialEq)]
enum Source {
    Ids(Vec<u32>),
    Text(String),
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// One chat message, checked field by field: a string `role`, and `content` that is a string or
/// a list of parts. `content` may be absent or null only on an assistant message that carries
/// `tool_calls` (or the legacy `function_call`), as OpenAI allows.
fn chat_message(i: usize, value: &Value) -> Result<ChatMessage, ServeError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Some(m) = value.as_object() else {
        return Err(ServeError::invalid_at(
            format!("messages[{i}] must be an object"),
            format!("messages[{i}]"),
        ));
    };
    let Some(role) = m.get("role").and_then(Value::as_str) else {
        return Err(ServeError::invalid_at(
            format!("{} must be a string", at("role")),
            at("role"),
        ));
    };
    match m.get("content") {
        Some(Value::String(_) | Value::Array(_)) => {}
        None | Some(Value::Null)
            if role == "assistant"
                && (m.get("tool_calls").is_some_and(|t| !t.is_null())
                    || m.get("function_call").is_some_and(|f| !f.is_null())) => {}
        None | Some(Value::Null) => {
            return Err(ServeError::invalid_at(
                format!(
                    "{} is required (it may be null only on an assistant message with tool_calls)",
                    at("content")
                ),
                at("content"),
            ))
        }
        Some(_) => {
            return Err(ServeError::invalid_at(
                format!(
                    "{} must be a string or a list of content parts",
                    at("content")
                ),
                at("content"),
            ))
        }
    }
    ChatMessage::from_openai(value).ok_or_else(|| {
        ServeError::invalid_at(
            format!("messages[{i}] is not a chat message"),
            format!("messages[{i}]"),
        )
    })
}

fn source(kind: Kind, body: &Value, state: &AppState) -> Result<Source, ServeError> {
    prompt_source(kind, body, &state.inner.config.chat_template)
}

/// The prompt of a request body: token ids, or text (a chat rendered with `template`).
fn prompt_source(
    kind: Kind,
    body: &Value,
    template: &kvrouter_tokenizer::ChatTemplate,
) -> Result<Source, ServeError> {
    match kind {
        Kind::Completion => match body.get("prompt") {
            Some(Value::String(s)) => Ok(Source::Text(s.clone())),
            Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
                token_ids(items).map(Source::Ids).ok_or_else(|| {
                    ServeError::invalid(
                        "token ids must be 32-bit unsigned integers",
                        Some("prompt"),
                    )
                })
            }
            // A batch of prompts: route on the first one.
            Some(Value::Array(items)) if !items.is_empty() => match &items[0] {
                Value::String(s) => Ok(Source::Text(s.clone())),
                Value::Array(ids) => token_ids(ids).map(Source::Ids).ok_or_else(|| {
                    ServeError::invalid(
                        "token ids must be 32-bit unsigned integers",
                        Some("prompt"),
                    )
                }),
                _ => Err(ServeError::invalid(
                    "`prompt` must be a string, a list of strings or token ids",
                    Some("prompt"),
                )),
            },
            None => Err(ServeError::invalid("`prompt` is required", Some("prompt"))),
            _ => Err(ServeError::invalid(
                "`prompt` must be a string, a list of strings or token ids",
                Some("prompt"),
            )),
        },
        Kind::Chat => {
            let Some(Value::Array(raw)) = body.get("messages") else {
                return Err(ServeError::invalid(
                    "`messages` must be a list of messages",
                    Some("messages"),
                ));
            };
            if raw.is_empty() {
                return Err(ServeError::invalid("`messages` is empty", Some("messages")));
            }
            let messages = raw
                .iter()
                .enumerate()
                .map(|(i, m)| chat_message(i, m))
                .collect::<Result<Vec<_>, _>>()?;
            let rendered =
                if body.get("continue_final_message").and_then(Value::as_bool) == Some(true) {
                    template.render_continuation(&messages)
                } else {
                    template.render(&messages, true)
                }
                .map_err(|e| ServeError::invalid(e.to_string(), Some("messages")))?;
            Ok(Source::Text(rendered))
        }
    }
}

/// The adapter and salt that namespace the request's blocks: vLLM's `cache_salt` body field, and
/// the model name when it names a LoRA adapter rather than the base model.
fn namespace(body: &Value, base_models: &[String]) -> HashNamespace {
    let cache_salt = body
        .get("cache_salt")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    let lora_name = body
        .get("model")
        .and_then(Value::as_str)
        .filter(|m| base_models.first().is_some_and(|base| base != m))
        .map(str::to_owned);
    HashNamespace {
        lora_name,
        cache_salt,
    }
}

/// Tokenizes (when needed) and hashes the prompt of `body`.
pub(crate) async fn routing_input(
    state: &AppState,
    kind: Kind,
    body: &Value,
) -> Result<RoutingInput, ServeError> {
    let src = source(kind, body, state)?;
    let models = state.inner.models.read().expect("models lock").clone();
    let ns = namespace(body, &models);
    let block_size = state.inner.config.router.kv_cache_block_size;
    match src {
        Source::Ids(ids) => {
            let blocks = BlockHasher::new(block_size, &ns).hash_blocks(&ids);
            Ok(RoutingInput {
                isl_tokens: ids.len() as u64,
                blocks,
            })
        }
        Source::Text(text) => {
            let _permit = state
                .inner
                .tokenize_slots
                .acquire()
                .await
                .map_err(|_| ServeError::Upstream("shutting down".into()))?;
            let st = state.clone();
            tokio::task::spawn_blocking(move || {
                let ids = st.inner.tokenizer.encode(&text);
                let blocks = BlockHasher::new(block_size, &ns).hash_blocks(&ids);
                RoutingInput {
                    isl_tokens: ids.len() as u64,
                    blocks,
                }
            })
            .await
            .map_err(|e| ServeError::Upstream(format!("tokenization failed: {e}")))
        }
    }
}

#[cfg(test)]
#[path = "routing_props.rs"]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_name_other_than_the_base_model_is_an_adapter_namespace() {
        let base = vec!["base".to_owned()];
        let body = serde_json::json!({"model": "math-lora", "cache_salt": "t1"});
        let ns = namespace(&body, &base);
        assert_eq!(ns.lora_name.as_deref(), Some("math-lora"));
        assert_eq!(ns.cache_salt.as_deref(), Some("t1"));
        assert_eq!(
            namespace(&serde_json::json!({"model": "base"}), &base),
            HashNamespace::none()
        );
    }
}
