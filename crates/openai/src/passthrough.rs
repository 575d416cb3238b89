//! The endpoints the router passes through without following their answers: the Responses API,
//! embeddings and vLLM's `/tokenize` and `/detokenize`. Here: what of their bodies the router
//! routes on (a prompt to hash into blocks, or nothing: plain load balancing), each error naming
//! its field; and the Responses API's answer shapes, which the mock engine writes.

use crate::error::RequestError;
use crate::request::{self, Message, Prompt};
use serde_json::{json, Value};

/// A pass-through endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `/v1/responses`.
    Responses,
    /// `/v1/embeddings`.
    Embeddings,
    /// `/tokenize` (vLLM).
    Tokenize,
    /// `/detokenize` (vLLM).
    Detokenize,
}

impl Endpoint {
    /// The endpoint's path, on the router and on the engine.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Responses => "/v1/responses",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
        }
    }
}

/// What a pass-through body is routed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Routed<'a> {
    /// A prompt: token ids or text (borrowed from the body where it can be).
    Prompt(Prompt<'a>),
    /// Chat messages (rendered with the chat template).
    Messages(Vec<Message>),
    /// No prompt: plain load balancing.
    Nothing,
}

/// What `body`, sent to `endpoint`, is routed on.
pub fn routed(endpoint: Endpoint, body: &Value) -> Result<Routed<'_>, RequestError> {
    match endpoint {
        Endpoint::Responses => responses_input(body),
        Endpoint::Embeddings => embeddings_input(body).map(|p| Routed::Prompt(p.first)),
        Endpoint::Tokenize if body.get("messages").is_some_and(|m| !m.is_null()) => {
            Ok(Routed::Messages(request::chat(body)?.messages))
        }
        Endpoint::Tokenize => match body.get("prompt") {
            Some(Value::String(s)) => Ok(Routed::Prompt(Prompt::Text(s.into()))),
            None | Some(Value::Null) => Err(RequestError::invalid(
                "`prompt` (or `messages`) is required",
                "prompt",
            )),
            Some(_) => Err(RequestError::invalid("`prompt` must be a string", "prompt")),
        },
        Endpoint::Detokenize => {
            detokenize_tokens(body)?;
            Ok(Routed::Nothing)
        }
    }
}

/// The `input` of `/v1/embeddings`: a string, token ids, or a batch of either (the batch is
/// routed on its first item).
pub fn embeddings_input(body: &Value) -> Result<request::PromptView<'_>, RequestError> {
    let Some(input) = body.get("input") else {
        return Err(RequestError::invalid("`input` is required", "input"));
    };
    // The same shapes as a completion's `prompt`: read with the one reader, errors renamed.
    request::prompt_of(input).map_err(|e| match e {
        RequestError::Invalid { message, .. } => {
            RequestError::invalid_at(message.replace("`prompt`", "`input`"), "input".to_owned())
        }
        other => other,
    })
}

/// The `tokens` of a `/detokenize` body.
pub fn detokenize_tokens(body: &Value) -> Result<Vec<u32>, RequestError> {
    let bad = || RequestError::invalid("`tokens` must be a list of token ids", "tokens");
    match body.get("tokens") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(bad),
        None => Err(RequestError::invalid("`tokens` is required", "tokens")),
        Some(_) => Err(bad()),
    }
}

/// The `input` of `/v1/responses` (with its `instructions` as a system message first): a string
/// is one user message; a list holds messages (`role` and `content`, a string or a list of
/// `input_text`/`output_text` parts). Items of other types (function call outputs, ...) carry no
/// text the router routes on.
pub fn responses_input(body: &Value) -> Result<Routed<'static>, RequestError> {
    let mut messages = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(message("system", s.clone())),
        Some(_) => {
            return Err(RequestError::invalid(
                "`instructions` must be a string",
                "instructions",
            ))
        }
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(message("user", s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                if let Some(m) = response_item(i, item)? {
                    messages.push(m);
                }
            }
        }
        None => return Err(RequestError::invalid("`input` is required", "input")),
        Some(_) => {
            return Err(RequestError::invalid(
                "`input` must be a string or a list of input items",
                "input",
            ))
        }
    }
    Ok(Routed::Messages(messages))
}

fn message(role: &str, content: String) -> Message {
    Message {
        role: role.to_owned(),
        content,
    }
}

/// One item of a Responses `input` list; `None` for items that are not messages.
fn response_item(i: usize, item: &Value) -> Result<Option<Message>, RequestError> {
    let at = |f: &str| format!("input[{i}]{f}");
    let Some(obj) = item.as_object() else {
        return Err(RequestError::invalid_at(
            format!("{} must be an object", at("")),
            at(""),
        ));
    };
    let is_message = obj.get("type").is_none_or(|t| t == "message");
    if !is_message {
        return Ok(None);
    }
    let Some(role) = obj.get("role").and_then(Value::as_str) else {
        return Err(RequestError::invalid_at(
            format!("{} must be a string", at(".role")),
            at(".role"),
        ));
    };
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                if matches!(kind, Some("input_text" | "output_text" | "text")) {
                    let Some(t) = part.get("text").and_then(Value::as_str) else {
                        let at = at(&format!(".content[{j}].text"));
                        return Err(RequestError::invalid_at(
                            format!("{at} must be a string"),
                            at,
                        ));
                    };
                    text.push_str(t);
                }
            }
            text
        }
        _ => {
            return Err(RequestError::invalid_at(
                format!(
                    "{} must be a string or a list of content parts",
                    at(".content")
                ),
                at(".content"),
            ))
        }
    };
    Ok(Some(message(role, content)))
}

/// A Responses API answer: `status` (`in_progress`, `completed`, `incomplete`) and the output
/// text so far, with `usage` once it is known.
pub fn response_object(
    id: &str,
    model: &str,
    created: u64,
    status: &str,
    text: &str,
    usage: Option<(u64, u64, u64)>,
) -> Value {
    let output = if text.is_empty() && status == "in_progress" {
        json!([])
    } else {
        json!([output_message(id, text, status)])
    };
    json!({
        "id": id, "object": "response", "created_at": created, "model": model,
        "status": status, "output": output,
        "usage": usage.map(|(input, cached, output)| json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input + output,
        })),
    })
}

fn output_message(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message", "id": format!("msg_{id}"), "role": "assistant",
        "status": if status == "in_progress" { "in_progress" } else { "completed" },
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// One streamed Responses event (`event:` line and `data:` JSON, as OpenAI sends them), with
/// its `type` and `sequence_number` set.
pub fn response_event(kind: &str, sequence: u64, mut data: Value) -> String {
    if let Some(obj) = data.as_object_mut() {
        obj.insert("type".into(), json!(kind));
        obj.insert("sequence_number".into(), json!(sequence));
    }
    format!("event: {kind}\ndata: {data}\n\n")
}

/// The `output_text.delta` event's body.
pub fn text_delta(id: &str, delta: &str) -> Value {
    json!({"item_id": format!("msg_{id}"), "output_index": 0, "content_index": 0, "delta": delta})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_input_becomes_messages_with_instructions_first() {
        let body = json!({"instructions": "be brief", "input": "hi"});
        assert_eq!(
            routed(Endpoint::Responses, &body),
            Ok(Routed::Messages(vec![
                message("system", "be brief".into()),
                message("user", "hi".into())
            ]))
        );
        let body = json!({"input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "x"}]},
            {"type": "function_call_output", "call_id": "c", "output": "{}"},
        ]});
        assert_eq!(
            routed(Endpoint::Responses, &body),
            Ok(Routed::Messages(vec![message("user", "a".into())]))
        );
        let bad = json!({"input": [{"role": "user", "content": 3}]});
        assert_eq!(
            routed(Endpoint::Responses, &bad).unwrap_err().param(),
            Some("input[0].content")
        );
        assert_eq!(
            routed(Endpoint::Responses, &json!({})).unwrap_err().param(),
            Some("input")
        );
    }

    #[test]
    fn embeddings_tokenize_and_detokenize_name_their_fields() {
        assert_eq!(
            routed(Endpoint::Embeddings, &json!({"input": ["a", "b"]})),
            Ok(Routed::Prompt(Prompt::Text("a".into())))
        );
        assert_eq!(
            routed(Endpoint::Embeddings, &json!({"input": [1, 2]})),
            Ok(Routed::Prompt(Prompt::Ids(vec![1, 2].into())))
        );
        let e = routed(Endpoint::Embeddings, &json!({"input": 7})).unwrap_err();
        assert_eq!(e.param(), Some("input"));
        assert!(e.to_string().contains("`input`"), "{e}");
        assert_eq!(
            routed(Endpoint::Tokenize, &json!({"prompt": "x"})),
            Ok(Routed::Prompt(Prompt::Text("x".into())))
        );
        assert_eq!(
            routed(Endpoint::Tokenize, &json!({"prompt": 1}))
                .unwrap_err()
                .param(),
            Some("prompt")
        );
        assert_eq!(
            routed(Endpoint::Detokenize, &json!({"tokens": [1, 2]})),
            Ok(Routed::Nothing)
        );
        assert_eq!(
            routed(Endpoint::Detokenize, &json!({"tokens": [-1]}))
                .unwrap_err()
                .param(),
            Some("tokens")
        );
    }

    #[test]
    fn response_events_carry_their_type_and_sequence() {
        let e = response_event("response.output_text.delta", 3, text_delta("r1", "hi"));
        assert!(e.starts_with("event: response.output_text.delta\ndata: {"));
        let data: Value =
            serde_json::from_str(e.lines().nth(1).unwrap().trim_start_matches("data: ")).unwrap();
        assert_eq!(data["sequence_number"], 3);
        assert_eq!(data["delta"], "hi");
        let done = response_object("r1", "m", 0, "completed", "hi", Some((5, 2, 1)));
        assert_eq!(done["output"][0]["content"][0]["text"], "hi");
        assert_eq!(done["usage"]["total_tokens"], 6);
    }
}
