//! How an answer ends: a passed-through stream's `[DONE]` line and event breaks, finished
//! choices, tool calls, and the engine's text kept where the answer is stamped.

use super::tests::{follow, parse, text_event, usage_event, NEVER};
use super::*;
use serde_json::json;

#[test]
fn a_passed_through_openai_stream_is_whole_only_with_done_in_any_line_ending() {
    let sse = |openai| {
        Continuation::new(Kind::Chat, Follow::Chunks { stamp: true }, 2, 5, None)
            .with_sse(true, openai)
    };
    let crlf = format!(
        "{}data: [DONE]\r\n\r\n",
        text_event("a").replace('\n', "\r\n")
    );
    // Whole, in one chunk or byte by byte (the break and [DONE] seen across chunks).
    for size in [crlf.len(), 7, 1] {
        let mut m = sse(true);
        let mut out = Vec::new();
        for part in crlf.as_bytes().chunks(size) {
            out.extend_from_slice(&m.chunk(Bytes::copy_from_slice(part), NEVER));
        }
        assert_eq!(m.upstream_over(true), Next::Finish, "chunks of {size}");
        assert!(out.ends_with(b"data: [DONE]\r\n\r\n"), "chunks of {size}");
    }
    // Cut cleanly at an event break before [DONE]: not whole, and not silently so.
    let mut m = sse(true);
    let _ = m.chunk(Bytes::from(text_event("a")), NEVER);
    let Next::Fail {
        message,
        worker_failed: true,
    } = m.upstream_over(true)
    else {
        panic!("a stream without [DONE] is not whole")
    };
    assert!(message.contains("[DONE]"), "{message}");
    assert!(m.error_event(&message).starts_with(b"data: "));
    // Events that are not OpenAI's (the Responses API's) end without [DONE].
    let mut m = sse(false);
    let _ = m.chunk(
        Bytes::from_static(b"event: response.completed\ndata: {}\n\n"),
        NEVER,
    );
    assert_eq!(m.upstream_over(true), Next::Finish);
}

#[test]
fn an_answer_that_finished_is_not_continued_with_or_without_done() {
    let finishing = format!(
        "data: {}\n\n",
        json!({"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]})
    );
    for clean in [true, false] {
        let mut m = follow(2);
        let mut out = m.chunk(Bytes::from(text_event("a")), NEVER).to_vec();
        out.extend_from_slice(&m.chunk(Bytes::from(finishing.clone()), NEVER));
        out.extend_from_slice(&m.chunk(Bytes::from(usage_event(5, 2)), NEVER));
        assert_eq!(m.upstream_over(clean), Next::Finish, "clean: {clean}");
        let (events, done) = parse(&out);
        assert_eq!((events.len(), done), (3, 0));
    }
    // Not finished: a clean end without [DONE] is a failure, continued.
    let mut m = follow(2);
    let _ = m.chunk(Bytes::from(text_event("a")), NEVER);
    assert_eq!(m.upstream_over(true), Next::Continue { after_abort: false });
}

#[test]
fn a_stream_cut_in_a_tool_call_is_not_continued() {
    let call = json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"ci"}}
    ]}, "finish_reason": null}]});
    let mut m = Continuation::new(
        Kind::Chat,
        Follow::Events { migration_limit: 2 },
        0,
        5,
        None,
    );
    let _ = m.chunk(Bytes::from(format!("data: {call}\n\n")), NEVER);
    let Next::Fail { message, .. } = m.upstream_over(false) else {
        panic!("a tool call cannot be continued from text")
    };
    assert!(message.contains("tool call"), "{message}");
    // A whole answer aborted by an update in a tool call is not continued either.
    let mut m = Continuation::new(
        Kind::Chat,
        Follow::Events { migration_limit: 2 },
        0,
        5,
        None,
    );
    let aborted = json!({"choices": [{"message": {"content": null, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
    ]}, "finish_reason": "abort"}]});
    assert!(matches!(
        m.whole(Bytes::from(aborted.to_string()), || true),
        Whole::Fail(_)
    ));
}

#[test]
fn a_usual_whole_answer_keeps_the_engines_text_and_gives_its_usage() {
    let body = r#"{"id":"c","choices":[{"text":"hi","finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7},"n":123456789012345678901234567890}"#;
    let mut m = follow(2);
    let Whole::Done { body: out, usage } = m.whole(Bytes::from(body), NEVER) else {
        panic!("whole")
    };
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        format!("{{\"system_fingerprint\":\"policy-3\",{}", &body[1..])
    );
    assert_eq!(usage.unwrap()["completion_tokens"], 2);
    // No usage, or a null one: none.
    let Whole::Done { usage, .. } = m.whole(Bytes::from(r#"{"usage":null}"#), NEVER) else {
        panic!("whole")
    };
    assert_eq!(usage, None);
    // Not JSON: passed on as it came.
    let Whole::Done { body: out, usage } = m.whole(Bytes::from("oops {"), NEVER) else {
        panic!("whole")
    };
    assert_eq!((&out[..], usage), (&b"oops {"[..], None));
}

/// Found by a re-probe: one finished choice of an `n = 2` answer made the whole answer count
/// as finished, so a stream cut in the other choice ended silently as a success.
#[test]
fn an_answer_is_finished_only_when_every_choice_is() {
    let choice = |i: u64, finish: Option<&str>| {
        format!(
            "data: {}\n\n",
            json!({"choices": [{"index": i, "text": "x", "finish_reason": finish}]})
        )
    };
    let mut m = Continuation::new(
        Kind::Completion,
        Follow::Events { migration_limit: 2 },
        0,
        5,
        Some("n > 1"),
    );
    for e in [choice(0, None), choice(1, None), choice(0, Some("stop"))] {
        let _ = m.chunk(Bytes::from(e), NEVER);
    }
    assert!(matches!(m.upstream_over(false), Next::Fail { .. }));
    let _ = m.chunk(Bytes::from(choice(1, Some("length"))), NEVER);
    assert_eq!(m.upstream_over(false), Next::Finish);
    // A choice that never showed has not finished (found by a third probe).
    let mut m = Continuation::new(
        Kind::Completion,
        Follow::Events { migration_limit: 2 },
        0,
        5,
        Some("n > 1"),
    )
    .expecting_choices(2);
    for e in [choice(0, None), choice(0, Some("stop"))] {
        let _ = m.chunk(Bytes::from(e), NEVER);
    }
    assert!(matches!(m.upstream_over(false), Next::Fail { .. }));
}

/// Found by the same re-probe: what followed `[DONE]` (a comment, a field, blank lines, a
/// reset) made a whole passed-through stream read as cut.
#[test]
fn a_passed_through_stream_is_whole_once_its_done_line_went_out() {
    for (tail, clean) in [
        ("data: [DONE]\n\n: ping\n\n", true),
        ("data: [DONE]\nid: 7\n\n", true),
        (&*format!("data: [DONE]{}\n\n", " ".repeat(40)), true),
        (&*format!("data: [DONE]\n\n{}", "\n".repeat(40)), true),
        ("data: [DONE]\n\n", false),
    ] {
        let mut m = Continuation::new(
            Kind::Completion,
            Follow::Chunks { stamp: false },
            2,
            5,
            None,
        )
        .with_sse(true, true);
        let _ = m.chunk(Bytes::from(text_event("a")), NEVER);
        let _ = m.chunk(Bytes::from(tail.to_owned()), NEVER);
        assert_eq!(
            m.upstream_over(clean),
            Next::Finish,
            "{tail:?} clean: {clean}"
        );
    }
}

/// Found by the same re-probe: a followed stream's stamped events (its first, finishing and
/// usage events) were written again from a `Value`: keys sorted, numbers respelled, CRLF lost.
#[test]
fn a_followed_streams_stamped_events_keep_the_engines_text() {
    let first = "data: {\"z\":1,\"choices\":[{\"index\":0,\"text\":\"a\",\"logprobs\":{\"top_logprobs\":[{\"zeta\":-2e-05,\"alpha\":-3.5}]},\"finish_reason\":null}]}\r\n\r\n";
    let mut m = follow(2);
    let out = m.chunk(Bytes::from(first), NEVER);
    let text = std::str::from_utf8(&out).unwrap();
    assert_eq!(
        text,
        first.replacen("data: {", "data: {\"system_fingerprint\":\"policy-3\",", 1)
    );
    // A whole answer that is not an object is passed on as it came.
    let Whole::Done { body, .. } = m.whole(Bytes::from("[{\"id\":\"x\"},1e-05]"), NEVER) else {
        panic!("whole")
    };
    assert_eq!(&body[..], b"[{\"id\":\"x\"},1e-05]");
}
