//! The continuation machine, fed by hand and by a model engine. (What cannot be continued, and
//! the pure body and usage rules, are tested in kvrouter-openai.)

use super::*;
use proptest::prelude::*;
use serde_json::json;

pub(super) const NEVER: fn() -> bool = || false;

pub(super) fn follow(limit: u32) -> Continuation {
    Continuation::new(
        Kind::Completion,
        Follow::Events {
            migration_limit: limit,
        },
        3,
        5,
        None,
    )
}

pub(super) fn text_event(t: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"choices": [{"index": 0, "text": t, "finish_reason": null}]})
    )
}

pub(super) fn usage_event(prompt: u64, completion: u64) -> String {
    let u = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
    format!("data: {}\n\n", json!({"choices": [], "usage": u}))
}

/// The JSON events of a forwarded stream, and how many `[DONE]`s it had.
pub(super) fn parse(out: &[u8]) -> (Vec<Value>, usize) {
    let mut done = 0;
    let mut values = Vec::new();
    for e in sse::events(out) {
        match sse::data(e) {
            Some(d) if sse::is_done(d) => done += 1,
            _ => values.extend(sse::json(e)),
        }
    }
    (values, done)
}

#[test]
fn continuations_carry_the_streamed_tokens_and_the_remaining_budget() {
    let original = json!({"prompt": "Once", "max_tokens": 10, "stream": true});
    let mut m = follow(1);
    let out = m.chunk(
        Bytes::from_static(
            b"data: {\"choices\":[{\"text\":\" upon\"}]}\n\ndata: {\"choices\":[{\"te",
        ),
        NEVER,
    );
    assert!(out.starts_with(b"data: {"), "complete events pass through");
    m.chunk(Bytes::from_static(b"xt\":\" a\"}]}\n\n"), NEVER);
    assert_eq!(
        m.upstream_over(false),
        Next::Continue { after_abort: false }
    );
    m.continuing();
    let c = m.body(&original, |_| unreachable!("a text prompt"));
    assert_eq!(
        (&c["prompt"], &c["max_tokens"]),
        (&json!("Once upon a"), &json!(8))
    );
    assert_eq!(
        m.upstream_over(false),
        Next::Fail {
            message: "the worker failed mid-stream and the answer was continued 1 time(s) \
                      already (--migration-limit)"
                .into(),
            worker_failed: true
        },
        "the limit is spent"
    );

    let ids = json!({"prompt": [1, 2, 3], "max_tokens": 5});
    let mut m = follow(1);
    m.chunk(Bytes::from(text_event(" xy")), NEVER);
    let c = m.body(&ids, |t| {
        assert_eq!(t, " xy");
        vec![9]
    });
    assert_eq!(
        (&c["prompt"], &c["max_tokens"]),
        (&json!([1, 2, 3, 9]), &json!(4))
    );
}

#[test]
fn a_continued_stream_reports_one_usage_for_the_whole_answer() {
    let mut m = follow(1);
    m.chunk(Bytes::from(text_event(" a")), NEVER);
    m.continuing();
    m.started(4);
    let out = m.chunk(Bytes::from(usage_event(6, 3)), NEVER);
    let (v, _) = parse(&out);
    assert_eq!(
        v[0]["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})
    );
    assert_eq!(v[0]["system_fingerprint"], "policy-4");
}

#[test]
fn a_weight_update_abort_continues_without_the_abort_reaching_the_client() {
    let mut m = follow(0);
    let abort = json!({"choices": [{"index": 0, "text": " b", "finish_reason": "abort"}]});
    let mut input = text_event(" a");
    input += &format!("data: {abort}\n\n");
    input += &usage_event(7, 2);
    input += "data: [DONE]\n\n";
    let out = m.chunk(Bytes::from(input), || true);
    let (v, done) = parse(&out);
    assert_eq!(done, 0, "the aborted attempt's [DONE] is not the client's");
    assert_eq!(v.len(), 2, "its usage neither: {v:?}");
    assert_eq!(
        (
            &v[1]["choices"][0]["text"],
            &v[1]["choices"][0]["finish_reason"]
        ),
        (&json!(" b"), &Value::Null)
    );
    assert_eq!(m.upstream_over(true), Next::Continue { after_abort: true });
    m.continuing();
    m.started(1);
    let out = m.chunk(
        Bytes::from(text_event(" c") + &usage_event(9, 1) + "data: [DONE]\n\n"),
        NEVER,
    );
    let (v, done) = parse(&out);
    assert_eq!(done, 1);
    assert_eq!(v[0]["system_fingerprint"], "policy-1");
    assert_eq!(
        v[1]["usage"]["prompt_tokens"], 7,
        "the original prompt's count"
    );
    assert_eq!(v[1]["usage"]["completion_tokens"], 3);
    assert_eq!(m.upstream_over(true), Next::Finish);
    // Not draining: an abort is the client's.
    let mut m = follow(0);
    let out = m.chunk(Bytes::from(format!("data: {abort}\n\n")), NEVER);
    assert_eq!(parse(&out).0[0]["choices"][0]["finish_reason"], "abort");
}

/// The continuation's prompt is the client's plus the 2 tokens carried: an engine that had all
/// of it cached reports 9 cached tokens, but the client's prompt is 7 (before, the client saw
/// cached 9 > prompt 7).
#[test]
fn a_continued_usage_never_counts_more_cached_tokens_than_prompt_tokens() {
    let cached_usage = |prompt: u64, completion: u64, cached: u64| {
        let u = json!({"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}});
        format!("data: {}\n\n", json!({"choices": [], "usage": u}))
    };
    let mut m = follow(0);
    let abort = json!({"choices": [{"index": 0, "text": " b", "finish_reason": "abort"}]});
    let input = text_event(" a") + &format!("data: {abort}\n\n") + &cached_usage(7, 2, 0);
    m.chunk(Bytes::from(input + "data: [DONE]\n\n"), || true);
    assert_eq!(m.upstream_over(true), Next::Continue { after_abort: true });
    m.continuing();
    m.started(1);
    let out = m.chunk(
        Bytes::from(text_event(" c") + &cached_usage(9, 1, 9) + "data: [DONE]\n\n"),
        NEVER,
    );
    let (v, _) = parse(&out);
    assert_eq!(
        v[1]["usage"],
        json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 7}})
    );
}

#[test]
fn plain_streams_pass_chunks_through_and_never_continue() {
    let mut m = Continuation::new(Kind::Completion, Follow::Chunks { stamp: true }, 2, 5, None);
    assert_eq!(
        &m.chunk(Bytes::from_static(b": hi\n\n"), NEVER)[..],
        b": hi\n\n"
    );
    let first = m.chunk(Bytes::from(text_event("a")), NEVER);
    assert_eq!(parse(&first).0[0]["system_fingerprint"], "policy-2");
    let second = Bytes::from(text_event("b"));
    assert_eq!(
        m.chunk(second.clone(), NEVER),
        second,
        "later chunks unchanged"
    );
    assert_eq!(m.upstream_over(true), Next::Finish, "no [DONE] needed");
    assert!(matches!(
        m.upstream_over(false),
        Next::Fail {
            worker_failed: true,
            ..
        }
    ));
    let mut raw = Continuation::new(
        Kind::Completion,
        Follow::Chunks { stamp: false },
        2,
        5,
        None,
    );
    let e = Bytes::from(text_event("a"));
    assert_eq!(raw.chunk(e.clone(), NEVER), e);
}

#[test]
fn requests_that_cannot_be_continued_end_with_an_error() {
    let mut m = Continuation::new(
        Kind::Chat,
        Follow::Events { migration_limit: 3 },
        0,
        1,
        Some("n > 1"),
    );
    let Next::Fail {
        message,
        worker_failed: true,
    } = m.upstream_over(false)
    else {
        panic!("a failure")
    };
    assert!(message.contains("n > 1"), "{message}");
    let aborted = Bytes::from_static(
        b"{\"choices\":[{\"message\":{\"content\":\"x\"},\"finish_reason\":\"abort\"}]}",
    );
    assert!(matches!(m.whole(aborted, || true), Whole::Fail(_)));
}

#[test]
fn whole_answers_aborted_by_an_update_are_joined() {
    let mut m = Continuation::new(
        Kind::Completion,
        Follow::Events { migration_limit: 0 },
        0,
        4,
        None,
    );
    let part = json!({"choices": [{"text": "ab", "finish_reason": "abort"}], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}});
    assert_eq!(
        m.whole(Bytes::from(part.to_string()), || true),
        Whole::Continue
    );
    m.continuing();
    m.started(1);
    let stopped: Value = serde_json::from_slice(&m.stopped_body("m")).unwrap();
    assert_eq!(
        (
            &stopped["choices"][0]["text"],
            &stopped["usage"]["completion_tokens"]
        ),
        (&json!("ab"), &json!(2))
    );
    let rest = json!({"choices": [{"text": "c", "finish_reason": "stop"}], "usage": {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7}});
    let Whole::Done { body: out, usage } = m.whole(Bytes::from(rest.to_string()), NEVER) else {
        panic!()
    };
    assert_eq!(
        usage,
        Some(rest["usage"].clone()),
        "the engine's own usage, for the guard"
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["choices"][0]["text"], "abc");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7})
    );
    assert_eq!(v["system_fingerprint"], "policy-1");
    assert_eq!(
        m.whole(Bytes::from_static(b"oops"), NEVER),
        Whole::Done {
            body: Bytes::from_static(b"oops"),
            usage: None
        }
    );
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        rng_algorithm: prop::test_runner::RngAlgorithm::ChaCha,
        rng_seed: prop::test_runner::RngSeed::Fixed(0x636f_6e74_696e_7565),
        ..ProptestConfig::default()
    }
}

/// Cuts `bytes` at the given points (as many chunks as the points make).
fn chunks(bytes: &[u8], cuts: &[prop::sample::Index]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
    at.sort_unstable();
    let mut prev = 0;
    let mut out = Vec::new();
    for cut in at.into_iter().chain([bytes.len()]) {
        out.push(Bytes::copy_from_slice(&bytes[prev..cut]));
        prev = cut;
    }
    out
}

proptest! {
    #![proptest_config(config())]

    /// A model engine streams one token per event; it fails after some tokens (mid-event), and
    /// the answer continues on the next worker, whose prompt holds what was streamed. Whatever
    /// the failures and chunk boundaries, the client gets exactly the tokens, in order, one
    /// `[DONE]` and one usage for the whole answer.
    #[test]
    fn any_split_of_a_stream_across_failures_yields_the_whole_answer(
        tokens in prop::collection::vec("[a-z ]{1,3}", 1..24),
        fails in prop::collection::vec((any::<prop::sample::Index>(), 0usize..40), 0..4),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
        prompt in 1u64..50,
    ) {
        let mut ends: Vec<usize> = fails.iter().map(|(i, _)| i.index(tokens.len() + 1)).collect();
        ends.sort_unstable();
        let limit = ends.len() as u32;
        let original = json!({"prompt": "p", "max_tokens": 100, "stream": true});
        let mut m = Continuation::new(Kind::Completion, Follow::Events { migration_limit: limit }, 0, prompt, None);
        let mut out = Vec::new();
        let mut start = 0;
        for (attempt, end) in ends.iter().copied().chain([tokens.len()]).enumerate() {
            let last = attempt == ends.len();
            let mut stream: String = tokens[start..end].iter().map(|t| text_event(t)).collect();
            if last {
                stream += &usage_event(prompt + start as u64, (end - start) as u64);
                stream += "data: [DONE]\n\n";
            } else {
                // It fails partway into its next event.
                let next = text_event("zz");
                stream += &next[..fails[attempt].1.min(next.len() - 1)];
            }
            for c in chunks(stream.as_bytes(), &cuts) {
                out.extend_from_slice(&m.chunk(c, NEVER));
            }
            if last {
                prop_assert_eq!(m.upstream_over(true), Next::Finish);
            } else {
                prop_assert_eq!(m.upstream_over(attempt % 2 == 0), Next::Continue { after_abort: false });
                m.continuing();
                let body = m.body(&original, |_| unreachable!());
                let sent: String = tokens[..end].concat();
                prop_assert_eq!(&body["prompt"], &json!(format!("p{sent}")));
                prop_assert_eq!(&body["max_tokens"], &json!(100 - end as u64));
                m.started(attempt as u64 + 1);
            }
            start = end;
        }
        let (values, done) = parse(&out);
        prop_assert_eq!(done, 1);
        let text: String = values.iter().filter_map(|v| v["choices"][0]["text"].as_str()).collect();
        prop_assert_eq!(text, tokens.concat());
        let usages: Vec<&Value> = values.iter().filter_map(|v| kvrouter_openai::usage::of(v)).collect();
        prop_assert_eq!(usages.len(), 1);
        let n = tokens.len() as u64;
        prop_assert_eq!(usages[0], &json!({"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}));
        prop_assert_eq!(m.generated_tokens(), n);
    }
}

#[test]
fn a_passed_through_stream_cut_inside_an_event_fails_and_its_error_event_is_readable() {
    let sse = |stamp| {
        Continuation::new(Kind::Chat, Follow::Chunks { stamp }, 2, 5, None).with_sse(true, true)
    };
    // Cut inside an event, then a clean end (a close-delimited body): a failure.
    let mut m = sse(false);
    let _ = m.chunk(Bytes::from_static(b"data: {\"id\":\"x\",\"obj"), NEVER);
    let Next::Fail { message, .. } = m.upstream_over(true) else {
        panic!("a stream ended mid-event is not whole");
    };
    // The error event ends the cut one first, so the client can read it.
    let end = m.error_event(&message);
    assert!(end.starts_with(b"\n\ndata: {\"error\""), "{end:?}");
    // Whole events, then a break: an error event needs no blank line before it.
    let mut m = sse(true);
    let _ = m.chunk(Bytes::from(text_event("a")), NEVER);
    assert!(m.error_event("x").starts_with(b"data: "));
    let _ = m.chunk(Bytes::from_static(sse::DONE_EVENT), NEVER);
    assert_eq!(m.upstream_over(true), Next::Finish);
    // A body that is not SSE (an error status's JSON) is not checked.
    let mut json = Continuation::new(Kind::Chat, Follow::Chunks { stamp: false }, 2, 5, None);
    let _ = json.chunk(Bytes::from_static(b"{\"error\":{}}"), NEVER);
    assert_eq!(json.upstream_over(true), Next::Finish);
}

#[test]
fn a_stream_past_its_migration_limit_says_so() {
    let mut m = Continuation::new(
        Kind::Chat,
        Follow::Events { migration_limit: 1 },
        0,
        5,
        None,
    );
    assert_eq!(
        m.upstream_over(false),
        Next::Continue { after_abort: false }
    );
    let Next::Fail { message, .. } = m.upstream_over(false) else {
        panic!("the limit is reached");
    };
    assert!(message.contains("continued 1 time(s)"), "{message}");
    assert!(!message.contains("migration is off"), "{message}");
}

/// An answer its group ended keeps the `id`, `model` and `created` of what the client already
/// got; one that got nothing is named by the request's model, created now. (OpenAI's schema
/// requires all three of every chunk and body.)
#[test]
fn an_answer_ended_by_its_group_keeps_its_identity() {
    let mut m = follow(0);
    let first = json!({"id": "cmpl-1", "object": "text_completion", "created": 7,
        "model": "served", "choices": [{"index": 0, "text": "a", "finish_reason": null}]});
    m.chunk(Bytes::from(format!("data: {first}\n\n")), NEVER);
    let later = json!({"id": "cmpl-2", "object": "text_completion", "created": 8,
        "model": "other", "choices": [{"index": 0, "text": "b", "finish_reason": null}]});
    m.chunk(Bytes::from(format!("data: {later}\n\n")), NEVER);
    let (events, done) = parse(&m.stopped_events("asked"));
    assert_eq!(done, 1);
    let end = &events[0];
    assert_eq!(
        (&end["id"], &end["model"], &end["created"]),
        (&json!("cmpl-1"), &json!("served"), &json!(7)),
        "{end}"
    );
    assert_eq!(end["choices"][0]["finish_reason"], "abort");

    let fresh = follow(0);
    let body: Value = serde_json::from_slice(&fresh.stopped_body("asked")).unwrap();
    assert_eq!(body["model"], "asked", "{body}");
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000, "{body}");
    assert!(body["id"].as_str().is_some(), "{body}");
}
