//! Continuing an answer elsewhere: the continuation request (the original body plus the tokens
//! already generated, with the remaining budget), what a chunk or body generated, and which
//! requests cannot be continued faithfully.

use crate::request::Kind;
use crate::Body;
use serde_json::{json, Value};

/// Why a request cannot be continued elsewhere, if it cannot: several prompts or choices,
/// structured output or logprobs would not survive a restart from the generated text.
pub fn unmigratable(body: &Body) -> Option<&'static str> {
    // A batch of several prompts (its token-id lists are read out of the fields).
    if body.prompt().is_ok_and(|p| p.count > 1) {
        return Some("a batch of several prompts");
    }
    let body = body.fields();
    let above_one = |k: &str| body.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    if above_one("n") || above_one("best_of") {
        return Some("n > 1");
    }
    let structured = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ]
    .iter()
    .any(|k| body.get(*k).is_some_and(|v| !v.is_null()))
        || body
            .get("response_format")
            .and_then(|f| f.get("type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t != "text");
    if structured {
        return Some("structured output");
    }
    let logprobs = body
        .get("logprobs")
        .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
        || body.get("top_logprobs").is_some_and(|v| !v.is_null());
    if logprobs {
        return Some("logprobs");
    }
    if body.get("echo").is_some_and(|v| v == &Value::Bool(true)) {
        // The continuation's prompt would be echoed again in the middle of the answer.
        return Some("echo");
    }
    None
}

/// Whether a body or chunk carries a tool call (or a legacy function call): a continuation
/// from the generated text would drop it.
pub fn tool_call(v: &Value) -> bool {
    let called = |m: &Value| {
        m["tool_calls"].as_array().is_some_and(|c| !c.is_empty()) || !m["function_call"].is_null()
    };
    v["choices"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| called(&c["delta"]) || called(&c["message"]))
    })
}

/// The field that holds the output budget, if the body sets one.
fn budget_key(body: &Value) -> Option<&'static str> {
    ["max_completion_tokens", "max_tokens"]
        .into_iter()
        .find(|k| body.get(*k).is_some_and(Value::is_u64))
}

/// The continuation of `original` after `generated_tokens` tokens of `generated_text`: the
/// prompt extended by the text (token-id prompts get it as `encode` tokenizes it; chats get a
/// partial assistant message with `continue_final_message`), and the budget reduced (at least 1).
pub fn body(
    kind: Kind,
    original: &Value,
    generated_text: &str,
    generated_tokens: u64,
    encode: impl FnOnce(&str) -> Vec<u32>,
) -> Value {
    let mut body = original.clone();
    if let Some(key) = budget_key(original) {
        let max = original[key].as_u64().unwrap_or(0);
        body[key] = json!(max.saturating_sub(generated_tokens).max(1));
    }
    match kind {
        Kind::Completion => {
            if let Some(prompt) = continued_prompt(&original["prompt"], generated_text, encode) {
                body["prompt"] = prompt;
            }
        }
        Kind::Chat => {
            if let Some(messages) = body["messages"].as_array_mut() {
                messages.push(json!({"role": "assistant", "content": generated_text}));
            }
            body["continue_final_message"] = json!(true);
            body["add_generation_prompt"] = json!(false);
        }
    }
    body
}

/// A completion's `prompt` extended by the generated text: a string, token ids (the text as
/// `encode` tokenizes it), or a batch of one of either (kept a batch of one). `None` for any
/// other prompt (a batch of several is refused by [`unmigratable`]).
fn continued_prompt(
    prompt: &Value,
    generated_text: &str,
    encode: impl FnOnce(&str) -> Vec<u32>,
) -> Option<Value> {
    match prompt.as_array().map(Vec::as_slice) {
        Some([one]) if one.is_string() || one.is_array() => {
            one_prompt(one, generated_text, encode).map(|p| Value::Array(vec![p]))
        }
        _ => one_prompt(prompt, generated_text, encode),
    }
}

/// One prompt (a string or token ids) extended by the generated text.
fn one_prompt(
    prompt: &Value,
    generated_text: &str,
    encode: impl FnOnce(&str) -> Vec<u32>,
) -> Option<Value> {
    match prompt {
        Value::String(p) => Some(json!(format!("{p}{generated_text}"))),
        Value::Array(ids) if ids.iter().all(Value::is_u64) => {
            let mut all: Vec<Value> = ids.clone();
            all.extend(encode(generated_text).into_iter().map(Value::from));
            Some(Value::Array(all))
        }
        _ => None,
    }
}

/// The text a streamed chunk adds (its first choice's), if any.
pub fn chunk_text(kind: Kind, v: &Value) -> Option<&str> {
    let choice = &v["choices"][0];
    match kind {
        Kind::Completion => choice["text"].as_str(),
        Kind::Chat => choice["delta"]["content"].as_str(),
    }
}

/// The text of a whole answer (its first choice's).
pub fn body_text(kind: Kind, v: &Value) -> &str {
    let choice = &v["choices"][0];
    match kind {
        Kind::Completion => choice["text"].as_str(),
        Kind::Chat => choice["message"]["content"].as_str(),
    }
    .unwrap_or("")
}

/// Replaces the text of a whole answer (its first choice's).
pub fn set_body_text(kind: Kind, v: &mut Value, text: &str) {
    let choice = &mut v["choices"][0];
    match kind {
        Kind::Completion => choice["text"] = json!(text),
        Kind::Chat => choice["message"]["content"] = json!(text),
    }
}

/// Whether any choice of a body or chunk finished with reason `abort`.
pub fn finished_by_abort(v: &Value) -> bool {
    v["choices"]
        .as_array()
        .is_some_and(|cs| cs.iter().any(|c| c["finish_reason"] == "abort"))
}

/// Whether any choice of a body or chunk carries a finish reason.
pub fn finishing(v: &Value) -> bool {
    v["choices"]
        .as_array()
        .is_some_and(|cs| cs.iter().any(|c| !c["finish_reason"].is_null()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`unmigratable`] of `v` read as the router reads a body (token ids read out of it).
    fn un(v: Value) -> Option<&'static str> {
        unmigratable(&Body::from_slice(v.to_string().as_bytes()).unwrap())
    }

    #[test]
    fn requests_that_cannot_be_continued_faithfully_are_named() {
        assert_eq!(un(json!({"n": 2})), Some("n > 1"));
        assert_eq!(
            un(json!({"response_format": {"type": "json_schema"}})),
            Some("structured output")
        );
        assert_eq!(un(json!({"guided_regex": "a+"})), Some("structured output"));
        assert_eq!(un(json!({"logprobs": 2})), Some("logprobs"));
        let several = Some("a batch of several prompts");
        assert_eq!(un(json!({"prompt": ["a", "b"]})), several);
        assert_eq!(un(json!({"prompt": [[1], [2]]})), several);
        for one in [json!([1, 2, 3]), json!([[1, 2]]), json!(["a"]), json!("a")] {
            assert_eq!(un(json!({ "prompt": one })), None, "{one}");
        }
        assert_eq!(un(json!({"echo": true})), Some("echo"));
        assert_eq!(
            un(
                json!({"logprobs": false, "n": 1, "echo": false, "response_format": {"type": "text"}})
            ),
            None
        );
    }

    #[test]
    fn tool_calls_in_chunks_and_bodies_are_seen() {
        let call = json!([{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{\"a"}}]);
        assert!(tool_call(
            &json!({"choices": [{"delta": {"tool_calls": call}}]})
        ));
        assert!(tool_call(
            &json!({"choices": [{"message": {"tool_calls": call}}]})
        ));
        assert!(tool_call(
            &json!({"choices": [{"delta": {"function_call": {"name": "f"}}}]})
        ));
        for plain in [
            json!({"choices": [{"delta": {"content": "hi", "tool_calls": []}}]}),
            json!({"choices": [{"message": {"content": "hi", "tool_calls": null}}]}),
            json!({"choices": []}),
            json!("x"),
        ] {
            assert!(!tool_call(&plain), "{plain}");
        }
    }

    #[test]
    fn continuations_carry_the_generated_tokens_and_the_remaining_budget() {
        let none = |_: &str| -> Vec<u32> { unreachable!("text prompts are not tokenized") };
        let c = body(
            Kind::Completion,
            &json!({"prompt": "Once", "max_tokens": 10, "stream": true}),
            " upon a",
            2,
            none,
        );
        assert_eq!(
            c,
            json!({"prompt": "Once upon a", "max_tokens": 8, "stream": true})
        );

        let c = body(
            Kind::Completion,
            &json!({"prompt": [1, 2, 3], "max_tokens": 5}),
            " xy",
            1,
            |t| {
                assert_eq!(t, " xy");
                vec![9]
            },
        );
        assert_eq!(c, json!({"prompt": [1, 2, 3, 9], "max_tokens": 4}));

        // A batch of one prompt stays a batch of one, extended.
        let ids = |_: &str| vec![9, 10];
        let c = body(
            Kind::Completion,
            &json!({"prompt": [[1, 2]]}),
            " xy",
            2,
            ids,
        );
        assert_eq!(c, json!({"prompt": [[1, 2, 9, 10]]}));
        let c = body(
            Kind::Completion,
            &json!({"prompt": ["Once"]}),
            " upon",
            1,
            none,
        );
        assert_eq!(c, json!({"prompt": ["Once upon"]}));
        // Anything else is left as it is (and batches of several are refused first).
        for prompt in [
            json!([[[1]]]),
            json!([{"a": 1}]),
            json!(["a", "b"]),
            json!(7),
        ] {
            let original = json!({ "prompt": prompt });
            let ids = |_: &str| vec![9];
            assert_eq!(body(Kind::Completion, &original, " xy", 1, ids), original);
        }

        let c = body(
            Kind::Chat,
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}),
            " he",
            5,
            none,
        );
        assert_eq!(
            c,
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " he"}],
                "max_completion_tokens": 1, "continue_final_message": true, "add_generation_prompt": false})
        );
    }

    #[test]
    fn generated_text_is_read_and_replaced() {
        let chunk = json!({"choices": [{"delta": {"content": "a"}, "finish_reason": "abort"}]});
        assert_eq!(chunk_text(Kind::Chat, &chunk), Some("a"));
        assert!(finished_by_abort(&chunk) && finishing(&chunk));
        let mut whole = json!({"choices": [{"text": "x", "finish_reason": null}]});
        assert!(!finishing(&whole));
        set_body_text(Kind::Completion, &mut whole, "xy");
        assert_eq!(body_text(Kind::Completion, &whole), "xy");
    }
}
