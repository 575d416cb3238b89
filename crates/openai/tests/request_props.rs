//! Property tests of request-body views: any JSON is answered without a panic, errors name a
//! field, and valid bodies give what a naive reading of the body gives.

use kvrouter_openai::request::{chat, prompt, ChatView, Message, Prompt, PromptView};
use kvrouter_openai::{Kind, RequestError};
use proptest::prelude::*;
use serde_json::{json, Value};

/// Any JSON value, a few levels deep, with the field names the views look at.
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

/// The view of a body, for either endpoint.
#[derive(Debug, PartialEq)]
enum View<'a> {
    Prompt(PromptView<'a>),
    Chat(ChatView),
}

fn view(kind: Kind, body: &Value) -> Result<View<'_>, RequestError> {
    match kind {
        Kind::Completion => prompt(body).map(View::Prompt),
        Kind::Chat => chat(body).map(View::Chat),
    }
}

fn kinds() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::Completion), Just(Kind::Chat)]
}

fn text(first: &str, count: usize) -> Result<View<'static>, RequestError> {
    Ok(View::Prompt(PromptView {
        first: Prompt::Text(first.to_owned().into()),
        count,
    }))
}

fn messages(pairs: &[(&str, &str)]) -> Vec<Message> {
    pairs
        .iter()
        .map(|(role, content)| Message {
            role: (*role).to_owned(),
            content: (*content).to_owned(),
        })
        .collect()
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
        match view(kind, &body) {
            Ok(_) => {}
            Err(e) => prop_assert!(e.param().is_some(), "{e:?}"),
        }
    }

    #[test]
    fn any_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64), kind in kinds()) {
        if let Ok(body) = serde_json::from_slice::<Value>(&bytes) {
            let _ = view(kind, &body);
        }
    }

    #[test]
    fn token_id_prompts_are_taken_as_given(ids in prop::collection::vec(any::<u32>(), 1..64)) {
        let single = json!({"prompt": ids});
        prop_assert_eq!(
            prompt(&single),
            Ok(PromptView { first: Prompt::Ids(ids.clone().into()), count: 1 })
        );
        let batch = json!({"prompt": [ids.clone(), [1, 2]]});
        prop_assert_eq!(prompt(&batch), Ok(PromptView { first: Prompt::Ids(ids.into()), count: 2 }));
    }

    #[test]
    fn text_prompts_are_taken_as_given(t in ".{0,40}", other in ".{0,8}") {
        let (one, batch) = (json!({"prompt": t}), json!({"prompt": [t, other]}));
        prop_assert_eq!(view(Kind::Completion, &one), text(&t, 1));
        prop_assert_eq!(view(Kind::Completion, &batch), text(&t, 2));
    }

    #[test]
    fn chats_read_as_the_naive_reading(
        turns in prop::collection::vec(
            (prop_oneof![Just("system"), Just("user"), Just("assistant"), Just("tool")], "[a-zA-Z0-9 ]{0,20}", any::<bool>()),
            1..6,
        )
    ) {
        let raw: Vec<Value> = turns
            .iter()
            .map(|(role, content, parts)| {
                if *parts {
                    json!({"role": role, "content": [{"type": "text", "text": content}]})
                } else {
                    json!({"role": role, "content": content})
                }
            })
            .collect();
        let expected: Vec<(&str, &str)> = turns.iter().map(|(r, c, _)| (*r, c.as_str())).collect();
        prop_assert_eq!(
            chat(&json!({"messages": raw})),
            Ok(ChatView {
                messages: messages(&expected),
                continue_final_message: false,
                add_generation_prompt: true,
            })
        );
    }
}

#[test]
fn message_content_is_required_except_on_assistant_tool_calls() {
    let param = |messages: Value| match chat(&json!({ "messages": messages })) {
        Err(e) => e.param().map(str::to_owned),
        other => panic!("expected a 400, got {other:?}"),
    };
    assert_eq!(
        param(json!([{"role": "user"}])).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(
        param(json!([{"role": "user", "content": "a"}, {"role": "user", "content": null}]))
            .as_deref(),
        Some("messages[1].content")
    );
    assert_eq!(
        param(json!([{"role": "assistant", "content": null}])).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(
        param(json!([{"content": "x"}])).as_deref(),
        Some("messages[0].role")
    );
    assert_eq!(
        param(json!([{"role": "user", "content": 3}])).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(param(json!(["hi"])).as_deref(), Some("messages[0]"));
    let tool_call = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]);
    assert_eq!(
        chat(&json!({ "messages": tool_call })).unwrap().messages,
        messages(&[("user", "weather?"), ("assistant", ""), ("tool", "sunny")])
    );
}
