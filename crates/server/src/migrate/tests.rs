//! Tests of continuations as a stream is followed: continuation bodies, usage. (What cannot be
//! continued, and the pure body and usage rules, are tested in kvrouter-openai.)

use super::*;
use crate::config::ServeConfig;
use serde_json::json;

fn migration(kind: Kind, body: Value) -> Migration {
    let state = AppState::new(ServeConfig::default()).unwrap();
    Migration::new(state, kind, body, WorkerId(0), Instant::now())
}

#[test]
fn continuations_carry_the_streamed_tokens_and_the_remaining_budget() {
    let mut m = migration(
        Kind::Completion,
        json!({"prompt": "Once", "max_tokens": 10, "stream": true}),
    );
    let out = m.process(b"data: {\"choices\":[{\"text\":\" upon\"}]}\n\ndata: {\"choices\":[{\"te");
    assert!(out.starts_with(b"data: {"), "complete events pass through");
    m.process(b"xt\":\" a\"}]}\n\n");
    let c = m.continuation();
    assert_eq!(c["prompt"], "Once upon a");
    assert_eq!(c["max_tokens"], 8);

    let mut ids = migration(
        Kind::Completion,
        json!({"prompt": [1, 2, 3], "max_tokens": 5}),
    );
    ids.process(b"data: {\"choices\":[{\"text\":\" xy\"}]}\n\n");
    let c = ids.continuation();
    let prompt: Vec<u64> = c["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(&prompt[..3], &[1, 2, 3]);
    assert_eq!(prompt.len(), 4, "the streamed text re-tokenized");
    assert_eq!(c["max_tokens"], 4);

    let mut chat = migration(
        Kind::Chat,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}),
    );
    chat.process(
        b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\" he\"}}]}\n\n",
    );
    let c = chat.continuation();
    assert_eq!(
        c["messages"][1],
        json!({"role": "assistant", "content": " he"})
    );
    assert_eq!(c["continue_final_message"], true);
    assert_eq!(c["max_completion_tokens"], 2);
}

#[test]
fn a_continued_stream_reports_one_usage_for_the_whole_answer() {
    let mut m = migration(Kind::Completion, json!({"prompt": "p", "max_tokens": 4}));
    m.process(b"data: {\"choices\":[{\"text\":\" a\"}]}\n\n");
    m.carried_tokens = m.generated_tokens;
    let out = m.process(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":6,\"completion_tokens\":3,\"total_tokens\":9}}\n\n");
    let text = String::from_utf8(out).unwrap();
    let v: Value = serde_json::from_str(text.trim().trim_start_matches("data:").trim()).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 9);
}
