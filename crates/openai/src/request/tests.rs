use super::*;
use serde_json::json;

#[test]
fn the_model_is_checked_against_the_served_names() {
    let served = vec!["m".to_owned()];
    assert_eq!(check_model(&json!({}), &served, false), Ok(None));
    assert_eq!(
        check_model(&json!({}), &served, true).unwrap_err().param(),
        Some("model")
    );
    assert_eq!(
        check_model(&json!({"model": "x"}), &served, false),
        Err(RequestError::UnknownModel("x".into()))
    );
    assert_eq!(
        check_model(&json!({"model": "x"}), &[], true),
        Ok(Some("x".into()))
    );
    assert_eq!(
        check_model(&json!({"model": 3}), &served, false)
            .unwrap_err()
            .param(),
        Some("model")
    );
}

#[test]
fn sampling_fields_are_read_and_bad_ones_named() {
    let body = json!({"max_tokens": 4, "max_completion_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    assert_eq!(max_tokens(Kind::Chat, &body), Ok(Some(2)));
    assert_eq!(max_tokens(Kind::Completion, &body), Ok(Some(4)));
    assert_eq!(max_tokens(Kind::Completion, &json!({})), Ok(None));
    let flags = stream_flags(&body).unwrap();
    assert!(flags.stream && flags.include_usage);
    for bad in [
        json!({"max_tokens": 0}),
        json!({"max_tokens": "3"}),
        json!({"max_tokens": 1u64 << 40}),
    ] {
        assert_eq!(
            max_tokens(Kind::Completion, &bad).unwrap_err().param(),
            Some("max_tokens")
        );
    }
    assert_eq!(
        stream_flags(&json!({"stream": "yes"})).unwrap_err().param(),
        Some("stream")
    );
    let too_large = max_tokens(Kind::Completion, &json!({"max_tokens": u64::MAX})).unwrap_err();
    assert!(too_large.to_string().contains("too large"), "{too_large}");
    // `n`: absent or null is one choice; a string, a float, a bool or a list is an error naming
    // it (they were read as absent, and the engine answered one choice).
    assert_eq!(choices(&json!({})), Ok(None));
    assert_eq!(choices(&json!({"n": null})), Ok(None));
    assert_eq!(choices(&json!({"n": 2})), Ok(Some(2)));
    for bad in [
        json!("2"),
        json!(2.0),
        json!(true),
        json!([2]),
        json!(u64::MAX),
    ] {
        let e = choices(&json!({ "n": bad })).unwrap_err();
        assert_eq!(e.param(), Some("n"), "{bad}");
    }
}

#[test]
fn chat_render_flags_are_read() {
    let body = json!({"messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": false});
    let view = chat(&body).unwrap();
    assert!(!view.add_generation_prompt && !view.continue_final_message);
    assert!(
        chat(&json!({"messages": [{"role": "user", "content": "hi"}]}))
            .unwrap()
            .add_generation_prompt
    );
    // Continuing the final message leaves the generation prompt out unless asked for, and
    // asking for both is an error (as vLLM answers).
    let hi = json!([{"role": "user", "content": "hi"}]);
    let view = chat(&json!({"messages": hi, "continue_final_message": true})).unwrap();
    assert!(view.continue_final_message && !view.add_generation_prompt);
    for (body, field) in [
        (
            json!({"messages": hi, "continue_final_message": true, "add_generation_prompt": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": hi, "continue_final_message": "yes"}),
            "continue_final_message",
        ),
        (
            json!({"messages": hi, "add_generation_prompt": 0}),
            "add_generation_prompt",
        ),
    ] {
        assert_eq!(chat(&body).unwrap_err().param(), Some(field), "{body}");
    }
}

#[test]
fn stream_options_of_the_wrong_type_are_named() {
    for (body, field) in [
        (json!({"stream_options": "x"}), "stream_options"),
        (
            json!({"stream_options": {"include_usage": "yes"}}),
            "stream_options.include_usage",
        ),
    ] {
        assert_eq!(stream_flags(&body).unwrap_err().param(), Some(field));
    }
    assert!(
        !stream_flags(&json!({"stream_options": null}))
            .unwrap()
            .include_usage
    );
}

#[test]
fn content_parts_are_checked_and_non_text_parts_ignored() {
    let param = |content: Value| {
        chat(&json!({"messages": [{"role": "system", "content": "s"},
            {"role": "user", "content": content}]}))
        .map_err(|e| e.param().map(str::to_owned))
    };
    for (content, field) in [
        (json!([{"type": "text"}]), "messages[1].content[0].text"),
        (
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": 5}]),
            "messages[1].content[1].text",
        ),
        (json!(["plain"]), "messages[1].content[0]"),
        (json!([{"text": "no type"}]), "messages[1].content[0].type"),
        (
            json!([{"type": 3, "text": "a"}]),
            "messages[1].content[0].type",
        ),
    ] {
        assert_eq!(
            param(content.clone()),
            Err(Some(field.to_owned())),
            "{content}"
        );
    }
    let view = chat(&json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look: "},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "what?"}]}]}))
    .unwrap();
    assert_eq!(view.messages[0].content, "look: what?");
}

#[test]
fn batches_report_their_size() {
    let body = json!({"prompt": ["a", "b"]});
    let v = prompt(&body).unwrap();
    assert_eq!((v.first, v.count), (Prompt::Text("a".into()), 2));
    assert_eq!(
        prompt(&json!({"prompt": [[1, -1]]})).unwrap_err().param(),
        Some("prompt")
    );
    assert_eq!(
        prompt(&json!({"prompt": []})).unwrap_err().param(),
        Some("prompt")
    );
}
