//! End to end: weight-update cycles run by `kvrouter serve` over embedded mock engines while a
//! GRPO-shaped load is in flight. Every request is answered once, with exactly its token budget;
//! none is served by a version it does not accept; aborted ones are continued.

mod common;

use serde_json::{json, Value};
use std::time::Duration;

const TOKEN: &str = "rl-t0k";
const MAX_TOKENS: u64 = 100;
const GROUPS: u64 = 4;
const SAMPLES: u64 = 3;

struct Server {
    _proc: common::Proc,
    base: String,
    client: reqwest::Client,
}

async fn serve() -> Server {
    serve_with(&[]).await
}

async fn serve_with(extra: &[&str]) -> Server {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "3",
        "--mock-speedup-ratio",
        "2",
        "--mock-weight-load-ms",
        "100",
        "--admin-token",
        TOKEN,
        "--trace-capture",
        "1000",
    ];
    args.extend(extra);
    let proc = common::spawn(&args).await;
    Server {
        base: proc.http(),
        _proc: proc,
        client: reqwest::Client::new(),
    }
}

/// A GRPO prompt: token ids shared by the group's samples (three 64-token blocks and a tail).
fn prompt(group: u64) -> Vec<u64> {
    (0..200).map(|i| 1000 + group * 1000 + i).collect()
}

/// What one request came back with.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// `x-kvrouter-policy-version` (the version that started serving it).
    header_version: Option<u64>,
    /// Every `system_fingerprint` seen, in order.
    fingerprints: Vec<String>,
    /// Content pieces (streams: one per token).
    pieces: u64,
    done_events: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    finish_reason: Option<String>,
}

/// Sends `body` to `/v1/completions` as a sample of `group` with extra headers.
async fn post(s: &Server, group: &str, body: Value, headers: &[(&str, &str)]) -> Answer {
    let stream = body["stream"] == true;
    let mut req = s
        .client
        .post(format!("{}/v1/completions", s.base))
        .header("x-kvrouter-group-id", group)
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let header_version = r
        .headers()
        .get("x-kvrouter-policy-version")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let text = r.text().await.unwrap();
    let mut a = Answer {
        status,
        header_version,
        fingerprints: Vec::new(),
        pieces: 0,
        done_events: 0,
        prompt_tokens: 0,
        completion_tokens: 0,
        finish_reason: None,
    };
    let mut events = Vec::new();
    if stream {
        for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
            let data = event.trim().strip_prefix("data:").unwrap().trim();
            if data == "[DONE]" {
                a.done_events += 1;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "in-band error: {v}");
            events.push(v);
        }
    } else if let Ok(v) = serde_json::from_str::<Value>(&text) {
        events.push(v);
    }
    for v in events {
        if let Some(f) = v["system_fingerprint"].as_str() {
            a.fingerprints.push(f.to_owned());
        }
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            if c["text"].as_str().is_some_and(|t| !t.is_empty()) {
                a.pieces += 1;
            }
            if let Some(f) = c["finish_reason"].as_str() {
                a.finish_reason = Some(f.to_owned());
            }
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            a.prompt_tokens = u["prompt_tokens"].as_u64().unwrap();
            a.completion_tokens = u["completion_tokens"].as_u64().unwrap();
        }
    }
    a
}

/// One sample of GRPO group `group` with the step's token budget.
async fn complete(s: &Server, group: u64, stream: bool, headers: &[(&str, &str)]) -> Answer {
    let mut body = json!({"model": "mock-model", "prompt": prompt(group), "max_tokens": MAX_TOKENS, "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    post(s, &format!("g{group}"), body, headers).await
}

async fn admin(s: &Server, path: &str, body: Option<Value>) -> (u16, Value) {
    let url = format!("{}{path}", s.base);
    let req = match body {
        Some(b) => s.client.post(url).json(&b),
        None => s.client.get(url),
    };
    let r = req.bearer_auth(TOKEN).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// How long a poll waits for the router (3000 polls of 5 ms before the common poll).
const WAIT: Duration = Duration::from_secs(15);

/// Starts the GRPO step (every sample of every group, streams and non-streamed answers), waits
/// until all of it is in flight, runs the update, and checks every answer.
async fn update_under_load(mode: &str) -> (Server, Vec<Answer>) {
    let s = std::sync::Arc::new(serve().await);
    let mut step = Vec::new();
    for g in 0..GROUPS {
        for k in 0..SAMPLES {
            let s = s.clone();
            step.push(tokio::spawn(
                async move { complete(&s, g, k != 0, &[]).await },
            ));
        }
    }
    let total = (GROUPS * SAMPLES) as f64;
    common::until("the step in flight", WAIT, || async {
        common::metric(&s.base, "kvrouter_worker_active_requests{")
            .await
            .unwrap_or(0.0)
            >= total
    })
    .await;
    let (status, body) = admin(
        &s,
        "/admin/policy/update",
        Some(json!({"version": 1, "mode": mode, "batch": 1})),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    // A second cycle is refused while this one runs.
    let (status, _) = admin(
        &s,
        "/admin/policy/update",
        Some(json!({"version": 2, "mode": "drain"})),
    )
    .await;
    assert_eq!(status, 409);
    // A request that needs the new policy waits for it, whatever the mode.
    let fresh = {
        let s = s.clone();
        tokio::spawn(async move {
            complete(&s, GROUPS, true, &[("x-kvrouter-min-policy-version", "1")]).await
        })
    };
    common::until("the update to finish", WAIT, || async {
        let (_, p) = admin(&s, "/admin/policy", None).await;
        p["update"]["running"] == false
    })
    .await;
    let (_, p) = admin(&s, "/admin/policy", None).await;
    assert_eq!(p["update"]["done"], 3, "{p}");
    assert_eq!(p["newest_policy_version"], 1);
    for w in p["workers"].as_array().unwrap() {
        assert_eq!(
            (w["policy_version"].as_u64(), w["state"].as_str()),
            (Some(1), Some("serving")),
            "{p}"
        );
    }
    let mut answers = Vec::new();
    for t in step {
        answers.push(
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let fresh = tokio::time::timeout(Duration::from_secs(60), fresh)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(fresh.status, 200);
    assert_eq!(
        fresh.header_version,
        Some(1),
        "served by the version it needs"
    );
    assert_eq!(
        fresh.fingerprints.first().map(String::as_str),
        Some("policy-1")
    );
    for a in &answers {
        check_complete(a);
    }
    let s = std::sync::Arc::try_unwrap(s).ok().expect("no other owner");
    (s, answers)
}

/// Answered once, with its whole budget, over its original prompt.
fn check_complete(a: &Answer) {
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.completion_tokens, MAX_TOKENS, "{a:?}");
    assert_eq!(a.prompt_tokens, 200, "the original prompt's usage: {a:?}");
    assert_eq!(a.finish_reason.as_deref(), Some("length"), "{a:?}");
    assert!(!a.fingerprints.is_empty(), "system_fingerprint: {a:?}");
    if a.done_events > 0 {
        assert_eq!(a.done_events, 1, "{a:?}");
        assert_eq!(
            a.pieces, MAX_TOKENS,
            "one piece per token, none twice: {a:?}"
        );
    }
}

#[tokio::test]
async fn drain_lets_the_step_finish_on_the_old_policy_then_updates() {
    let (s, answers) = update_under_load("drain").await;
    for a in &answers {
        assert_eq!(a.header_version, Some(0));
        assert!(a.fingerprints.iter().all(|f| f == "policy-0"), "{a:?}");
    }
    assert_eq!(
        common::metric(
            &s.base,
            "kvrouter_migrations_total{migration_type=\"weight_update\""
        )
        .await
        .unwrap_or(0.0),
        0.0
    );
}

#[tokio::test]
async fn abort_continues_the_step_on_the_new_policy_with_exact_token_counts() {
    let (s, answers) = update_under_load("abort").await;
    let continued = answers
        .iter()
        .filter(|a| a.fingerprints.iter().any(|f| f == "policy-1"))
        .count();
    assert_eq!(
        continued,
        answers.len(),
        "every in-flight answer ends on the new policy"
    );
    for a in &answers {
        // Streams say in their headers where they started; whole answers, where they ended.
        let started = if a.done_events > 0 { 0 } else { 1 };
        assert_eq!(a.header_version, Some(started), "{a:?}");
        assert_eq!(
            a.fingerprints.last().map(String::as_str),
            Some("policy-1"),
            "{a:?}"
        );
    }
    assert!(
        common::metric(
            &s.base,
            "kvrouter_migrations_total{migration_type=\"weight_update\""
        )
        .await
        .unwrap_or(0.0)
            >= answers.len() as f64
    );
    // The captured timeline shows each worker's weight load and both attempts of the step.
    let (status, trace) = admin(&s, "/admin/trace", None).await;
    assert_eq!(status, 200);
    let events = trace["traceEvents"].as_array().unwrap();
    let named = |n: &str| events.iter().filter(|e| e["name"] == n).count();
    assert_eq!(named("weight update"), 3, "{trace}");
    let aborted_attempts = events
        .iter()
        .filter(|e| e["name"] == "prefill" && e["args"]["status"] == "continued")
        .count();
    assert!(aborted_attempts >= answers.len(), "{aborted_attempts}");
}

#[tokio::test]
async fn rolling_keeps_serving_while_one_worker_at_a_time_updates() {
    let (_s, answers) = update_under_load("rolling").await;
    // Drained workers finish on policy 0; the step never waits for a whole-fleet pause.
    for a in &answers {
        assert!(a.fingerprints.iter().all(|f| f == "policy-0"), "{a:?}");
    }
}

#[tokio::test]
async fn bad_update_requests_name_the_field() {
    let s = serve().await;
    let (status, e) = admin(
        &s,
        "/admin/policy/update",
        Some(json!({"version": 1, "mode": "yolo"})),
    )
    .await;
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("mode")));
    let (status, e) = admin(
        &s,
        "/admin/policy/update",
        Some(json!({"version": 1, "mode": "rolling", "batch": 0})),
    )
    .await;
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("batch")));
    let (status, e) = admin(
        &s,
        "/admin/policy/update",
        Some(json!({"version": 1, "workers": [7]})),
    )
    .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("workers"))
    );
    let (status, _) = admin(&s, "/admin/policy/update", Some(json!({"mode": "drain"}))).await;
    assert_eq!(status, 400);
    let r = s
        .client
        .get(format!("{}/admin/policy", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let (status, p) = admin(&s, "/admin/policy", None).await;
    assert_eq!((status, &p["update"]), (200, &Value::Null));
    assert_eq!(p["kv_retention"], "flush");
}

/// A sample of group `group` (prompt 9) with `max_tokens`.
async fn sample(
    s: &Server,
    group: &str,
    max_tokens: u64,
    stream: bool,
    extra: &[(&str, &str)],
) -> Answer {
    let mut body = json!({"model": "mock-model", "prompt": prompt(9), "max_tokens": max_tokens, "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    post(s, group, body, extra).await
}

#[tokio::test]
async fn first_n_of_m_ends_the_rest_of_the_group_with_what_they_produced() {
    let log = std::env::temp_dir().join(format!("kvrouter-rl-prov-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let s = std::sync::Arc::new(serve_with(&["--provenance-log", log.to_str().unwrap()]).await);
    let long = 5_000;
    let need = [
        ("x-kvrouter-group-size", "6"),
        ("x-kvrouter-group-need", "2"),
    ];
    let mut rest = Vec::new();
    for k in 0..4 {
        let s = s.clone();
        rest.push(tokio::spawn(async move {
            sample(&s, "grpo-1", long, k % 2 == 0, &need).await
        }));
    }
    // The long ones are running before the short ones finish.
    common::until("the long samples in flight", WAIT, || async {
        common::metric(&s.base, "kvrouter_worker_active_requests{")
            .await
            .unwrap_or(0.0)
            >= 4.0
    })
    .await;
    for _ in 0..2 {
        let a = sample(&s, "grpo-1", 5, true, &need).await;
        assert_eq!(
            (a.finish_reason.as_deref(), a.completion_tokens),
            (Some("length"), 5)
        );
    }
    for t in rest {
        let a = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.status, 200);
        assert_eq!(a.finish_reason.as_deref(), Some("abort"), "{a:?}");
        assert!(a.completion_tokens < long, "ended early: {a:?}");
        if a.done_events > 0 {
            assert_eq!(a.done_events, 1);
            assert_eq!(
                a.pieces, a.completion_tokens,
                "the usage counts what was sent: {a:?}"
            );
        }
    }
    // A sibling arriving later is not started.
    let late = sample(&s, "grpo-1", long, false, &need).await;
    assert_eq!(
        (late.finish_reason.as_deref(), late.completion_tokens),
        (Some("abort"), 0)
    );
    // Their capacity is free.
    common::until("the aborted samples released", WAIT, || async {
        common::metric(&s.base, "kvrouter_worker_active_requests{")
            .await
            .unwrap_or(0.0)
            == 0.0
    })
    .await;
    // Bad group headers name the header.
    let r = s
        .client
        .post(format!("{}/v1/completions", s.base))
        .header("x-kvrouter-group-id", "g")
        .header("x-kvrouter-group-size", "2")
        .header("x-kvrouter-group-need", "3")
        .json(&json!({"model": "mock-model", "prompt": "hi", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "x-kvrouter-group-need");
    // The provenance log says which samples were ended and why.
    let mut lines: Vec<Value> = Vec::new();
    common::until("seven provenance lines", WAIT, || {
        lines = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let n = lines.len();
        async move { n >= 7 }
    })
    .await;
    let aborted: Vec<&Value> = lines.iter().filter(|l| l["status"] == "aborted").collect();
    assert_eq!(aborted.len(), 5, "four ended, one never started: {lines:?}");
    assert_eq!(aborted.iter().filter(|l| l["worker"].is_null()).count(), 1);
    let streamed: u64 = aborted
        .iter()
        .map(|l| l["output_tokens"].as_u64().unwrap())
        .sum();
    assert!(streamed > 0, "ended streams report what they produced");
    assert!(aborted
        .iter()
        .all(|l| l["abort_reason"] == "group-satisfied"));
    assert_eq!(lines.iter().filter(|l| l["status"] == "ok").count(), 2);
    let _ = std::fs::remove_file(&log);
}

#[tokio::test]
async fn a_sized_group_is_spread_over_the_workers_its_fair_share_needs() {
    let s = serve().await;
    // An idle fleet of 3 and a group of 6: a fair share is 2 requests, so 2 siblings per
    // worker, placed in runs while the earlier ones still decode.
    let mut open = Vec::new();
    let mut workers = Vec::new();
    for _ in 0..6 {
        let r = s
            .client
            .post(format!("{}/v1/completions", s.base))
            .header("x-kvrouter-group-id", "spread")
            .header("x-kvrouter-group-size", "6")
            .json(&json!({"model": "mock-model", "prompt": prompt(11), "max_tokens": 5000, "stream": true}))
            .send()
            .await
            .unwrap();
        workers.push(
            r.headers()["x-kvrouter-worker"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
        open.push(r);
    }
    let mut counts = std::collections::BTreeMap::new();
    for w in &workers {
        *counts.entry(w.clone()).or_insert(0) += 1;
    }
    assert_eq!(
        counts.values().copied().collect::<Vec<u32>>(),
        vec![2, 2, 2],
        "{workers:?}"
    );
    assert!(
        workers.chunks(2).all(|run| run[0] == run[1]),
        "siblings in runs: {workers:?}"
    );
    drop(open);
}

#[tokio::test]
async fn an_update_over_engine_processes_reaches_the_engines_and_continues_their_streams() {
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(
            common::spawn(&[
                "mock-engine",
                "--port",
                "0",
                "--speedup-ratio",
                "2",
                "--weight-load-ms",
                "100",
            ])
            .await,
        );
    }
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    let mut args = vec!["serve", "--port", "0", "--admin-token", TOKEN];
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    let proc = common::spawn(&args).await;
    let s = std::sync::Arc::new(Server {
        base: proc.http(),
        _proc: proc,
        client: reqwest::Client::new(),
    });
    let mut step = Vec::new();
    for g in 0..3 {
        for _ in 0..2 {
            let s = s.clone();
            step.push(tokio::spawn(
                async move { complete(&s, g, true, &[]).await },
            ));
        }
    }
    common::until("the step in flight", WAIT, || async {
        common::metric(&s.base, "kvrouter_worker_active_requests{")
            .await
            .unwrap_or(0.0)
            >= 6.0
    })
    .await;
    let (status, _) = admin(
        &s,
        "/admin/policy/update",
        Some(json!({"version": 4, "mode": "abort"})),
    )
    .await;
    assert_eq!(status, 202);
    common::until("the update to finish", WAIT, || async {
        let (_, p) = admin(&s, "/admin/policy", None).await;
        p["update"]["running"] == false
    })
    .await;
    for t in step {
        let a = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .unwrap()
            .unwrap();
        check_complete(&a);
        assert_eq!(
            a.fingerprints.last().map(String::as_str),
            Some("policy-4"),
            "{a:?}"
        );
    }
    // The engines themselves loaded the new weights (the kind was read from /server_info).
    for u in &urls {
        let info: Value = s
            .client
            .get(format!("{u}/server_info"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            (info["policy_version"].as_u64(), info["paused"].as_bool()),
            (Some(4), Some(false))
        );
    }
}

/// Found by a probe: a worker removed while it loaded new weights left the cycle running for
/// good (the worker loaded beside it waited for it, out of rotation) and its engine paused
/// (its resume looked the worker up and found it gone). It leaves the cycle now, and its
/// engine is resumed at the address it had.
#[tokio::test]
async fn a_worker_removed_mid_load_leaves_the_cycle_and_its_engine_serving() {
    // Engine 1's load outlasts the router's stop below (it exits in about 2 s).
    let mut engines = Vec::new();
    for load_ms in ["1500", "4000"] {
        let args = ["mock-engine", "--port", "0", "--weight-load-ms", load_ms];
        engines.push(common::spawn(&args).await);
    }
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    let mut args = vec!["serve", "--port", "0", "--admin-token", TOKEN];
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    let proc = common::spawn(&args).await;
    let s = Server {
        base: proc.http(),
        _proc: proc,
        client: reqwest::Client::new(),
    };
    let info = |u: String| server_info(&s.client, u);
    remove_mid_load(&s, 2, 0, &urls[0]).await;
    common::until("the cycle to end without worker 0", WAIT, || async {
        let (_, p) = admin(&s, "/admin/policy", None).await;
        p["update"]["running"] == false
    })
    .await;
    common::until("engine 0 resumed", WAIT, || async {
        info(urls[0].clone()).await["paused"] == false
    })
    .await;
    // Worker 1 serves the new version.
    let a = complete(&s, 0, false, &[]).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.fingerprints, ["policy-2"], "{a:?}");
    // A router stopped mid-load resumes the engine it paused before it exits (found by the
    // same probe: it exited and left the engine paused, and the next router's requests hung),
    // even when that worker was removed first (found by a re-probe: it was no longer in the
    // cycle, so the stop did not resume it).
    remove_mid_load(&s, 3, 1, &urls[1]).await;
    s._proc.signal("-TERM");
    common::until("engine 1 resumed by the stopping router", WAIT, || async {
        info(urls[1].clone()).await["paused"] == false
    })
    .await;
}

/// An engine's `/server_info`.
async fn server_info(client: &reqwest::Client, url: String) -> Value {
    let r = client.get(format!("{url}/server_info")).send().await;
    r.unwrap().json::<Value>().await.unwrap()
}

/// Starts an update to `version`, waits until the engine of `worker` (at `url`) is paused for
/// its load, and removes that worker.
async fn remove_mid_load(s: &Server, version: u64, worker: u64, url: &str) {
    let (status, _) = admin(
        s,
        "/admin/policy/update",
        Some(json!({ "version": version })),
    )
    .await;
    assert_eq!(status, 202);
    common::until("the engine paused for its load", WAIT, || async {
        server_info(&s.client, url.to_owned()).await["paused"] == true
    })
    .await;
    let removed = s
        .client
        .delete(format!("{}/admin/workers/{worker}", s.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status().as_u16(), 200);
}
