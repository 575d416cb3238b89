//! Property tests of request-body parsing: any JSON (and any bytes) is answered without a panic,
//! errors name a field, and valid bodies give the prompt a naive reading of the body gives.

use super::{prompt_source, Kind, Source};
use crate::error::ServeError;
use kvrouter_tokenizer::ChatTemplate;
use proptest::prelude::*;
use serde_json::{json, Value};

/// Any JSON value, a few levels deep, with the field names the parser looks at.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[a-z ]{0,8}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        let key = prop_oneof![
            Just("prompt".to_owned()),
            Just("messages".to_owned()),
            Just("role".to_owned()),
            Just("content".to_owned()),
            Just("text".to_owned()),
            Just("tool_calls".to_owned()),
            Just("continue_final_message".to_owned()),
            "[a-z]{1,4}",
        ];
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key, inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn kinds() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::Completion), Just(Kind::Chat)]
}

/// A naive ChatML rendering, independent of the template code.
fn chatml(messages: &[(String, String)]) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        out += &format!("<|im_start|>{role}\n{content}<|im_end|>\n");
    }
    out + "<|im_start|>assistant\n"
}

fn config() -> ProptestConfig {
    // Bounded and deterministic: a fixed seed (a failure prints the minimal input).
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        rng_algorithm: prop::test_runner::RngAlgorithm::ChaCha,
        rng_seed: prop::test_runner::RngSeed::Fixed(0x6b76_726f_7574_6572),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_json_body_is_answered_and_errors_name_a_field(body in any_json(), kind in kinds()) {
        match prompt_source(kind, &body, &ChatTemplate::ChatMl) {
            Ok(_) => {}
            Err(ServeError::Invalid { param, .. }) => prop_assert!(param.is_some()),
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    #[test]
    fn any_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64), kind in kinds()) {
        if let Ok(body) = serde_json::from_slice::<Value>(&bytes) {
            let _ = prompt_source(kind, &body, &ChatTemplate::ChatMl);
        }
    }

    #[test]
    fn token_id_prompts_are_taken_as_given(ids in prop::collection::vec(any::<u32>(), 1..64)) {
        let single = json!({"prompt": ids});
        prop_assert_eq!(
            prompt_source(Kind::Completion, &single, &ChatTemplate::ChatMl),
            Ok(Source::Ids(ids.clone()))
        );
        let batch = json!({"prompt": [ids.clone(), [1, 2]]});
        prop_assert_eq!(
            prompt_source(Kind::Completion, &batch, &ChatTemplate::ChatMl),
            Ok(Source::Ids(ids))
        );
    }

    #[test]
    fn text_prompts_are_taken_as_given(text in ".{0,40}", other in ".{0,8}") {
        prop_assert_eq!(
            prompt_source(Kind::Completion, &json!({"prompt": text}), &ChatTemplate::ChatMl),
            Ok(Source::Text(text.clone()))
        );
        prop_assert_eq!(
            prompt_source(Kind::Completion, &json!({"prompt": [text, other]}), &ChatTemplate::ChatMl),
            Ok(Source::Text(text))
        );
    }

    #[test]
    fn chats_render_as_the_naive_reading(
        turns in prop::collection::vec(
            (prop_oneof![Just("system"), Just("user"), Just("assistant"), Just("tool")], "[a-zA-Z0-9 ]{0,20}", any::<bool>()),
            1..6,
        )
    ) {
        let messages: Vec<Value> = turns
            .iter()
            .map(|(role, content, parts)| {
                if *parts {
                    json!({"role": role, "content": [{"type": "text", "text": content}]})
                } else {
                    json!({"role": role, "content": content})
                }
            })
            .collect();
        let expected: Vec<(String, String)> =
            turns.iter().map(|(r, c, _)| (r.to_string(), c.clone())).collect();
        prop_assert_eq!(
            prompt_source(Kind::Chat, &json!({"messages": messages}), &ChatTemplate::ChatMl),
            Ok(Source::Text(chatml(&expected)))
        );
    }
}

#[test]
fn message_content_is_required_except_on_assistant_tool_calls() {
    let parse = |messages: Value| {
        prompt_source(
            Kind::Chat,
            &json!({ "messages": messages }),
            &ChatTemplate::ChatMl,
        )
    };
    let param = |r: Result<Source, ServeError>| match r {
        Err(ServeError::Invalid { param, .. }) => param.map(|p| p.into_owned()),
        other => panic!("expected a 400, got {other:?}"),
    };
    assert_eq!(
        param(parse(json!([{"role": "user"}]))).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(
        param(parse(
            json!([{"role": "user", "content": "a"}, {"role": "user", "content": null}])
        ))
        .as_deref(),
        Some("messages[1].content")
    );
    assert_eq!(
        param(parse(json!([{"role": "assistant", "content": null}]))).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(
        param(parse(json!([{"content": "x"}]))).as_deref(),
        Some("messages[0].role")
    );
    assert_eq!(
        param(parse(json!([{"role": "user", "content": 3}]))).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(param(parse(json!(["hi"]))).as_deref(), Some("messages[0]"));
    let tool_call = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]);
    assert_eq!(
        parse(tool_call),
        Ok(Source::Text(chatml(&[
            ("user".into(), "weather?".into()),
            ("assistant".into(), String::new()),
            ("tool".into(), "sunny".into()),
        ])))
    );
}
