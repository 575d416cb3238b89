//! Turning a request body into what the core routes on: tokens (tokenized with the segment cache,
//! on the request's task for short prompts and on a bounded blocking pool for longer ones, or
//! taken as given for token-id prompts) and block hashes.

use crate::error::ServeError;
use crate::state::AppState;
use kvrouter_core::hashing::{BlockHasher, BlockHashes, HashNamespace};
use kvrouter_openai::passthrough::{self, Endpoint, Routed};
use kvrouter_openai::request::{self, Prompt};
use kvrouter_openai::Body;
use kvrouter_tokenizer::ChatMessage;
use serde_json::Value;

pub(crate) use kvrouter_openai::Kind;

/// What the router needs of a prompt.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RoutingInput {
    pub(crate) isl_tokens: u64,
    pub(crate) blocks: BlockHashes,
}

impl RoutingInput {
    /// A body without a prompt: no blocks, so the least loaded worker.
    fn nothing() -> Self {
        Self {
            isl_tokens: 0,
            blocks: BlockHashes::default(),
        }
    }
}

/// The prompt of a request body: token ids, or text (a chat rendered with `template`),
/// borrowed from the body where it can be. A batch of prompts is routed on its first one.
fn prompt_source<'a>(
    kind: Kind,
    body: &'a Body,
    template: &kvrouter_tokenizer::ChatTemplate,
) -> Result<Prompt<'a>, ServeError> {
    match kind {
        Kind::Completion => Ok(body.prompt()?.first),
        Kind::Chat => {
            let chat = request::chat(body.fields())?;
            let rendered = if chat.continue_final_message {
                template.render_continuation(&chat_messages(chat.messages))
            } else {
                template.render(&chat_messages(chat.messages), chat.add_generation_prompt)
            }
            .map_err(|e| ServeError::invalid(e.to_string(), Some("messages")))?;
            Ok(Prompt::Text(rendered.into()))
        }
    }
}

fn chat_messages(messages: Vec<request::Message>) -> Vec<ChatMessage> {
    messages
        .into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: m.content,
        })
        .collect()
}

/// The prompt of a pass-through body (`None`: it has none, and is load balanced). Messages
/// (a Responses `input`, a `/tokenize` chat) are rendered as a chat with the generation prompt,
/// `param` naming the field they came from.
fn passthrough_source<'a>(
    endpoint: Endpoint,
    body: &'a Value,
    template: &kvrouter_tokenizer::ChatTemplate,
) -> Result<Option<Prompt<'a>>, ServeError> {
    Ok(match passthrough::routed(endpoint, body)? {
        Routed::Prompt(prompt) => Some(prompt),
        Routed::Messages(messages) => {
            let param = match endpoint {
                Endpoint::Responses => "input",
                _ => "messages",
            };
            let add_generation_prompt = endpoint == Endpoint::Responses
                || request::chat(body).is_ok_and(|c| c.add_generation_prompt);
            let rendered = template
                .render(&chat_messages(messages), add_generation_prompt)
                .map_err(|e| ServeError::invalid(e.to_string(), Some(param)))?;
            Some(Prompt::Text(rendered.into()))
        }
        Routed::Nothing => None,
    })
}

/// Tokenizes (when needed) and hashes the prompt of a pass-through body; a body without one
/// routes on nothing (no blocks: the least loaded worker).
pub(crate) async fn passthrough_input(
    state: &AppState,
    endpoint: Endpoint,
    body: &Body,
) -> Result<RoutingInput, ServeError> {
    let body = body.to_value();
    match passthrough_source(endpoint, &body, &state.inner.config.chat_template)? {
        Some(src) => input_of(state, &body, src).await,
        None => Ok(RoutingInput::nothing()),
    }
}

/// The adapter and salt that namespace the request's blocks: vLLM's `cache_salt` body field, and
/// the model name when it names a LoRA adapter rather than a base model: as the workers list it
/// (`adapter`), else any name other than the first model served.
fn namespace(body: &Value, base_models: &[String], adapter: Option<bool>) -> HashNamespace {
    let cache_salt = request::cache_salt(body).map(str::to_owned);
    let lora_name = request::model(body)
        .filter(|m| adapter.unwrap_or_else(|| base_models.first().is_some_and(|base| base != m)))
        .map(str::to_owned);
    HashNamespace {
        lora_name,
        cache_salt,
    }
}

/// Tokenizes (when needed) and hashes the prompt of `body` (a token-id prompt is read without
/// a JSON value per token, see [`Body`]).
pub(crate) async fn routing_input(
    state: &AppState,
    kind: Kind,
    body: &Body,
) -> Result<RoutingInput, ServeError> {
    let src = prompt_source(kind, body, &state.inner.config.chat_template)?;
    input_of(state, body.fields(), src).await
}

/// Tokenizes (when needed) and hashes `src`, the prompt of `body`.
async fn input_of(
    state: &AppState,
    body: &Value,
    src: Prompt<'_>,
) -> Result<RoutingInput, ServeError> {
    match src {
        Prompt::Text(text) if text.len() > state.inner.config.tokenize_inline_max_bytes => {
            let text = text.into_owned();
            let ns = namespace_of(state, body);
            let st = state.clone();
            off_task(state, move || {
                input_now(&st, &ns, Prompt::Text(text.into()))
            })
            .await
        }
        // Token ids, and short prompts: tokenizing costs less than the hand-off to the pool.
        src => Ok(input_now(state, &namespace_of(state, body), src)),
    }
}

fn namespace_of(state: &AppState, body: &Value) -> HashNamespace {
    let adapter = request::model(body)
        .and_then(|m| state.inner.pools.read().expect("pools lock").is_adapter(m));
    // Read under the lock, not copied: nothing here awaits.
    namespace(
        body,
        &state.inner.models.read().expect("models lock"),
        adapter,
    )
}

/// Tokenizes (when needed) and hashes `src` on the calling thread.
fn input_now(state: &AppState, ns: &HashNamespace, src: Prompt<'_>) -> RoutingInput {
    let block_size = state.inner.config.router.kv_cache_block_size;
    let hasher = BlockHasher::new(block_size, ns);
    match src {
        Prompt::Ids(ids) => RoutingInput {
            isl_tokens: ids.len() as u64,
            blocks: hasher.hash_blocks(&ids),
        },
        Prompt::Text(text) => {
            let ids = state.inner.tokenizer.encode(&text);
            RoutingInput {
                isl_tokens: ids.len() as u64,
                blocks: hasher.hash_blocks(&ids),
            }
        }
    }
}

/// [`routing_input`] (or [`passthrough_input`] for `endpoint`) on the calling thread, for a body
/// already on the blocking pool (a big body: see `parse::BIG_BODY_BYTES`).
pub(crate) fn routing_input_now(
    state: &AppState,
    (kind, endpoint): (Kind, Option<Endpoint>),
    body: &Body,
) -> Result<RoutingInput, ServeError> {
    let template = &state.inner.config.chat_template;
    match endpoint {
        None => {
            let src = prompt_source(kind, body, template)?;
            Ok(input_now(state, &namespace_of(state, body.fields()), src))
        }
        Some(endpoint) => {
            let body = body.to_value();
            Ok(match passthrough_source(endpoint, &body, template)? {
                Some(src) => input_now(state, &namespace_of(state, &body), src),
                None => RoutingInput::nothing(),
            })
        }
    }
}

/// Runs `work` on the blocking pool, holding one of its bounded slots (tokenization of long
/// prompts, and all the parsing of big bodies), so that it holds up no other request's task.
pub(crate) async fn off_task<T: Send + 'static>(
    state: &AppState,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ServeError> {
    // The slot goes with the work: a request dropped while it runs (its client gone) does not
    // free the slot before the work ends, so abandoned work stays within the bound.
    let permit = state
        .inner
        .tokenize_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ServeError::Upstream("shutting down".into()))?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work()
    })
    .await
    .map_err(|e| ServeError::Upstream(format!("tokenization failed: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_name_other_than_the_base_model_is_an_adapter_namespace() {
        let base = vec!["base".to_owned()];
        let body = serde_json::json!({"model": "math-lora", "cache_salt": "t1"});
        let ns = namespace(&body, &base, None);
        assert_eq!(ns.lora_name.as_deref(), Some("math-lora"));
        assert_eq!(ns.cache_salt.as_deref(), Some("t1"));
        assert_eq!(
            namespace(&serde_json::json!({"model": "base"}), &base, None),
            HashNamespace::none()
        );
        // Two base models (pools): the second is no adapter.
        let second = serde_json::json!({"model": "other-base"});
        assert_eq!(namespace(&second, &base, Some(false)).lora_name, None);
    }

    /// Short text prompts are tokenized on the request's task: they route even when the
    /// blocking pool is unavailable (its slots closed); longer ones, or any with the inline
    /// limit at 0, go through the pool.
    #[tokio::test]
    async fn short_prompts_are_tokenized_without_the_blocking_pool() {
        let with_limit = |max| {
            let state = AppState::new(crate::config::ServeConfig {
                tokenize_inline_max_bytes: max,
                ..crate::config::ServeConfig::default()
            })
            .unwrap();
            state.inner.tokenize_slots.close();
            state
        };
        let short = Body::from(serde_json::json!({"prompt": "hello world ".repeat(10)}));
        let long = Body::from(serde_json::json!({"prompt": "hello world ".repeat(1000)}));
        let state = with_limit(2048);
        let input = routing_input(&state, Kind::Completion, &short)
            .await
            .unwrap();
        assert!(input.isl_tokens > 0);
        assert!(routing_input(&state, Kind::Completion, &long)
            .await
            .is_err());
        let pool_only = with_limit(0);
        assert!(routing_input(&pool_only, Kind::Completion, &short)
            .await
            .is_err());
    }

    /// Request parsing itself is tested in kvrouter-openai (`tests/request_props.rs`); here,
    /// that the view is rendered as the engine renders it.
    #[test]
    fn chats_render_with_the_request_flags() {
        use kvrouter_tokenizer::ChatTemplate;
        let hi = serde_json::json!([{"role": "user", "content": "hi"}]);
        let render = |body: Value| {
            prompt_source(Kind::Chat, &body.into(), &ChatTemplate::ChatMl).map(Prompt::into_owned)
        };
        assert_eq!(
            render(serde_json::json!({"messages": hi})),
            Ok(Prompt::Text(
                "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".into()
            ))
        );
        assert_eq!(
            render(serde_json::json!({"messages": hi, "add_generation_prompt": false})),
            Ok(Prompt::Text("<|im_start|>user\nhi<|im_end|>\n".into())),
            "the engine renders no assistant opener: neither does the router"
        );
        assert_eq!(
            render(serde_json::json!({"prompt": [[1, 2]], "messages": 3})),
            Err(ServeError::invalid(
                "`messages` must be a list of messages",
                Some("messages")
            ))
        );
        assert_eq!(
            prompt_source(
                Kind::Completion,
                &Body::from_slice(br#"{"prompt": [[1, 2], "b"]}"#).unwrap(),
                &ChatTemplate::ChatMl
            ),
            Ok(Prompt::Ids(vec![1, 2].into()))
        );
    }
}
