//! `Body` (token-id prompts read straight into `u32`s) against the naive model: the body read as
//! a `serde_json::Value`, and the views and the pick API's `token_ids` rule on that value. The
//! same whole body, the same prompt view, the same errors (message and field), the same parse
//! errors, on random bodies rich in token-id arrays, malformed ids and repeated keys.

use kvrouter_openai::request::prompt;
use kvrouter_openai::{Body, RequestError};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The naive model of `Body::token_ids_as_prompt`: the pick API's rule on a `Value` body, as it
/// was written before `Body` (the body already known to be an object).
fn token_ids_as_prompt_naive(body: &mut Value) -> Result<(), RequestError> {
    let obj = body.as_object_mut().expect("an object body");
    let Some(ids) = obj.remove("token_ids") else {
        return Ok(());
    };
    if obj.contains_key("prompt") || obj.contains_key("messages") {
        return Err(RequestError::invalid(
            "give `token_ids`, `prompt` or `messages`, not several",
            "token_ids",
        ));
    }
    let valid = ids.as_array().is_some_and(|a| {
        a.iter()
            .all(|t| t.as_u64().is_some_and(|t| t <= u64::from(u32::MAX)))
    });
    if !valid {
        return Err(RequestError::invalid(
            "`token_ids` must be a list of token ids (integers from 0 to 4294967295)",
            "token_ids",
        ));
    }
    if ids.as_array().is_some_and(Vec::is_empty) {
        return Err(RequestError::invalid(
            "`token_ids` is empty: give at least one token id",
            "token_ids",
        ));
    }
    obj.insert("prompt".into(), ids);
    Ok(())
}

/// A token id, or something near one that is not (negative, fractional, too large, text).
fn near_id() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => any::<u32>().prop_map(Value::from),
        1 => Just(json!(u64::from(u32::MAX) + 1)),
        1 => Just(json!(u64::MAX)),
        1 => (-5i64..0).prop_map(Value::from),
        1 => Just(json!(1.5)),
        1 => Just(json!(0.0)),
        1 => Just(json!("7")),
        1 => Just(Value::Null),
    ]
}

/// A value for `prompt` or `token_ids`: mostly arrays of ids or of id arrays, with a few
/// wrong items, and the other shapes a client sends.
fn prompt_like() -> impl Strategy<Value = Value> {
    let ids = || {
        prop::collection::vec(any::<u32>(), 0..12)
            .prop_map(|v| Value::Array(v.into_iter().map(Value::from).collect()))
    };
    let near = || prop::collection::vec(near_id(), 0..8).prop_map(Value::Array);
    let item = prop_oneof![4 => ids(), 1 => near(), 1 => near_id(), 1 => Just(json!("t"))];
    let batch = prop::collection::vec(item, 0..4).prop_map(Value::Array);
    prop_oneof![
        4 => ids(),
        2 => near(),
        3 => batch,
        1 => Just(json!("text")),
        1 => Just(json!([[[1]]])),
        1 => Just(json!({"a": [1]})),
        1 => Just(Value::Null),
        1 => any::<i64>().prop_map(Value::from),
    ]
}

/// Body text: an object of `prompt`, `token_ids`, `messages` and other fields, keys possibly
/// repeated (written by hand, as a `Value` cannot hold a repeated key), or now and then a
/// non-object.
fn body_text() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        3 => Just("prompt"),
        3 => Just("token_ids"),
        1 => Just("messages"),
        1 => Just("model"),
        1 => Just("n"),
    ];
    let field = (key, prompt_like()).prop_map(|(k, v)| format!("\"{k}\": {v}"));
    let object = prop::collection::vec(field, 0..4).prop_map(|f| format!("{{{}}}", f.join(", ")));
    prop_oneof![
        9 => object,
        1 => prompt_like().prop_map(|v| v.to_string()),
    ]
}

fn config() -> ProptestConfig {
    // Bounded and deterministic: a fixed seed (a failure prints the minimal input).
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        rng_algorithm: prop::test_runner::RngAlgorithm::ChaCha,
        rng_seed: prop::test_runner::RngSeed::Fixed(0x626f_6479_7072_6f70),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_body_reads_as_its_value_reads(text in body_text()) {
        let naive: Value = serde_json::from_str(&text).unwrap();
        let body = Body::from_slice(text.as_bytes()).unwrap();
        prop_assert_eq!(&body.to_value().into_owned(), &naive, "{}", text);
        prop_assert_eq!(body.is_object(), naive.is_object());
        prop_assert_eq!(body.prompt(), prompt(&naive), "{}", text);
        for key in ["prompt", "token_ids", "messages", "model"] {
            prop_assert_eq!(body.contains_key(key), naive.get(key).is_some(), "{} {}", key, text);
        }
        if naive.is_object() {
            let (mut body, mut naive) = (body, naive);
            let taken = body.token_ids_as_prompt();
            prop_assert_eq!(&taken, &token_ids_as_prompt_naive(&mut naive), "{}", text);
            if taken.is_ok() {
                prop_assert_eq!(&body.to_value().into_owned(), &naive, "{}", text);
                prop_assert_eq!(body.prompt(), prompt(&naive), "{}", text);
            }
        }
    }

    #[test]
    fn a_broken_body_fails_as_its_value_fails(text in body_text(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
        // Cut short, or one byte replaced: the parse error (message and position) is the same.
        let mut bytes = text.into_bytes();
        let at = cut.index(bytes.len().max(1));
        let mut broken = bytes.clone();
        broken.truncate(at);
        if at < bytes.len() {
            bytes[at] = byte;
        }
        for b in [broken, bytes] {
            let naive = serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string());
            let ours = Body::from_slice(&b).map_err(|e| e.to_string());
            prop_assert_eq!(ours.map(|b| b.to_value().into_owned()), naive);
        }
    }

    #[test]
    fn long_token_id_prompts_are_read_whole(ids in prop::collection::vec(any::<u32>(), 1..3000)) {
        let text = json!({"model": "m", "token_ids": ids}).to_string();
        let mut body = Body::from_slice(text.as_bytes()).unwrap();
        body.token_ids_as_prompt().unwrap();
        let view = body.prompt().unwrap();
        prop_assert_eq!(view.count, 1);
        prop_assert_eq!(view.first, kvrouter_openai::request::Prompt::Ids(ids.into()));
    }
}

/// Every error of a token-id `prompt` or `token_ids`, by message and field, and the same as
/// the naive model's.
#[test]
fn each_token_id_error_names_its_field() {
    let shape = "`prompt` must be a string, a list of strings or token ids";
    let too_large = "token ids must be 32-bit unsigned integers";
    for (text, message) in [
        (r#"{"prompt": [1, -1]}"#, shape),
        (r#"{"prompt": [1, 1.5]}"#, shape),
        (r#"{"prompt": [1, "2"]}"#, shape),
        (r#"{"prompt": [1, 4294967296]}"#, too_large),
        (r#"{"prompt": [[1, -1], [2]]}"#, too_large),
        (r#"{"prompt": [[4294967296]]}"#, too_large),
        (r#"{"prompt": [[[1]]]}"#, too_large),
        (
            r#"{"prompt": []}"#,
            "`prompt` is empty: give text or at least one token id",
        ),
        (r#"{"prompt": 5}"#, shape),
        (r#"{"prompt": null}"#, shape),
        (r#"{"prompt": [1], "prompt": 5}"#, shape),
        (r#"{}"#, "`prompt` is required"),
    ] {
        let (naive, ours) = (
            serde_json::from_str(text).unwrap(),
            Body::from_slice(text.as_bytes()).unwrap(),
        );
        let (naive, ours) = (prompt(&naive), ours.prompt());
        assert_eq!(ours, naive, "{text}");
        let e = ours.unwrap_err();
        assert_eq!(
            (e.to_string().as_str(), e.param()),
            (message, Some("prompt")),
            "{text}"
        );
    }
    let conflict = "give `token_ids`, `prompt` or `messages`, not several";
    let invalid = "`token_ids` must be a list of token ids (integers from 0 to 4294967295)";
    for (text, message) in [
        (r#"{"token_ids": [1, -1]}"#, invalid),
        (r#"{"token_ids": [1, 0.5]}"#, invalid),
        (r#"{"token_ids": [4294967296]}"#, invalid),
        (r#"{"token_ids": [[1, 2]]}"#, invalid),
        (r#"{"token_ids": "1 2"}"#, invalid),
        (r#"{"token_ids": null}"#, invalid),
        (r#"{"token_ids": [1], "prompt": "a"}"#, conflict),
        (r#"{"token_ids": [1], "prompt": [2]}"#, conflict),
        (r#"{"messages": [], "token_ids": [1, -1]}"#, conflict),
        (
            r#"{"token_ids": []}"#,
            "`token_ids` is empty: give at least one token id",
        ),
    ] {
        let mut naive: Value = serde_json::from_str(text).unwrap();
        let naive = token_ids_as_prompt_naive(&mut naive);
        let ours = Body::from_slice(text.as_bytes())
            .unwrap()
            .token_ids_as_prompt();
        assert_eq!(ours, naive, "{text}");
        let e = ours.unwrap_err();
        assert_eq!(
            (e.to_string().as_str(), e.param()),
            (message, Some("token_ids")),
            "{text}"
        );
    }
}

#[test]
fn token_id_prompts_are_read_into_ids_and_others_kept_as_json() {
    let body = Body::from_slice(br#"{"prompt": [5, 6], "model": "m"}"#).unwrap();
    assert_eq!(
        body.fields(),
        &json!({"model": "m"}),
        "the ids are out of the JSON"
    );
    assert_eq!(
        body.to_value().as_ref(),
        &json!({"prompt": [5, 6], "model": "m"})
    );
    let text = Body::from_slice(br#"{"prompt": "hi"}"#).unwrap();
    assert_eq!(text.fields(), &json!({"prompt": "hi"}));
    assert!(matches!(text.to_value(), std::borrow::Cow::Borrowed(_)));
    let mut picked = Body::from_slice(br#"{"token_ids": [1]}"#).unwrap();
    picked.insert("model", json!("m"));
    picked.token_ids_as_prompt().unwrap();
    assert_eq!(
        picked.to_value().as_ref(),
        &json!({"prompt": [1], "model": "m"})
    );
    picked.insert("prompt", json!("x"));
    assert_eq!(
        picked.to_value().as_ref(),
        &json!({"prompt": "x", "model": "m"})
    );
}

/// Any JSON value: scalars, strings full of the characters a skip must not stop at
/// (quotes, escapes, brackets, commas, braces, non-ASCII), and nested arrays and objects.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[\"\\\\,\\[\\]{}: a-zé\\n\\t]{0,8}".prop_map(Value::from),
        prop::collection::vec(any::<u32>(), 0..6).prop_map(|v| json!(v)),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z\"\\\\}]{0,3}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Object bodies of any values under keys that matter (`prompt`, `token_ids`) and keys a walk
/// may not take (escaped, non-ASCII), written compact or pretty, with ids written with odd
/// spacing and leading zeros now and then.
fn any_body_text() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        3 => Just("prompt".to_owned()),
        3 => Just("token_ids".to_owned()),
        1 => Just("model".to_owned()),
        1 => Just("a\\\"b".to_owned()),
        1 => Just("ü".to_owned()),
    ];
    let ids = prop::collection::vec((any::<u16>(), 0..4usize), 0..6).prop_map(|ids| {
        let sep = [",", " , ", ",\n", ", 0"];
        let inner: Vec<String> = ids
            .iter()
            .map(|(id, s)| format!("{id}{}", sep[*s]))
            .collect();
        format!(
            "[{}]",
            inner.concat().trim_end_matches([',', ' ', '\n', '0'])
        )
    });
    let value = prop_oneof![3 => any_json().prop_map(|v| v.to_string()), 2 => ids];
    let field = (key, value).prop_map(|(k, v)| format!("\"{k}\": {v}"));
    (prop::collection::vec(field, 0..4), any::<bool>()).prop_map(|(f, pretty)| {
        let text = format!("{{{}}}", f.join(", "));
        match (pretty, serde_json::from_str::<Value>(&text)) {
            (true, Ok(v)) => serde_json::to_string_pretty(&v).unwrap(),
            _ => text,
        }
    })
}

proptest! {
    #![proptest_config(config())]

    /// The one-pass walk of an object body reads what `serde_json` reads, and fails where it
    /// fails, with its error, on bodies with any nested values.
    #[test]
    fn any_object_body_reads_as_its_value_reads(text in any_body_text(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let naive = serde_json::from_str::<Value>(&text).map_err(|e| e.to_string());
        let ours = Body::from_slice(text.as_bytes()).map_err(|e| e.to_string());
        prop_assert_eq!(ours.as_ref().map(|b| b.to_value().into_owned()).map_err(Clone::clone), naive.clone(), "{}", text);
        if let (Ok(body), Ok(naive)) = (&ours, &naive) {
            prop_assert_eq!(body.prompt(), prompt(naive), "{}", text);
        }
        let mut bytes = text.into_bytes();
        let at = cut.index(bytes.len().max(1));
        if at < bytes.len() {
            bytes[at] = byte;
        }
        let naive = serde_json::from_slice::<Value>(&bytes).map_err(|e| e.to_string());
        let ours = Body::from_slice(&bytes).map_err(|e| e.to_string());
        prop_assert_eq!(ours.map(|b| b.to_value().into_owned()), naive);
    }
}
