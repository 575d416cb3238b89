//! End to end: `kvrouter serve --mock-workers 3` as a real process, driven over HTTP.

mod common;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::process::Command;

struct Server {
    _proc: common::Proc,
    base: String,
}

async fn serve(extra: &[&str]) -> Server {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "3",
        "--mock-speedup-ratio",
        "50",
    ];
    args.extend(extra);
    let proc = common::spawn(&args).await;
    Server {
        base: proc.http(),
        _proc: proc,
    }
}

/// A chat whose system prompt spans several 64-token blocks, with a distinct question.
fn chat(question: &str) -> Value {
    let system = "You are a careful assistant. ".repeat(40);
    json!({"model": "mock-model", "max_tokens": 3, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}
    ]})
}

async fn send(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Option<u64>, Value) {
    let (status, worker, _, body) = send_with(client, base, body, &[]).await;
    (status, worker, body)
}

/// Sends a chat with extra headers; returns status, worker and the served policy version.
async fn send_with(
    client: &reqwest::Client,
    base: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Option<u64>, Option<u64>, Value) {
    let mut req = client
        .post(format!("{base}/v1/chat/completions"))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let header = |name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok()?.parse().ok())
    };
    let (status, worker, version) = (
        r.status().as_u16(),
        header("x-kvrouter-worker"),
        header("x-kvrouter-policy-version"),
    );
    (status, worker, version, r.json().await.unwrap())
}

#[tokio::test]
async fn kv_mode_keeps_a_shared_prefix_on_one_worker() {
    let server = serve(&["--router-mode", "kv", "--router-predicted-ttl-secs", "30"]).await;
    let client = reqwest::Client::new();
    let mut workers = Vec::new();
    for i in 0..6 {
        let (status, worker, body) =
            send(&client, &server.base, &chat(&format!("question {i}"))).await;
        assert_eq!(status, 200, "{body}");
        workers.push(worker.unwrap());
    }
    assert!(
        workers.iter().all(|w| *w == workers[0]),
        "same prefix, same worker: {workers:?}"
    );
}

#[tokio::test]
async fn round_robin_spreads_the_same_prefix() {
    let server = serve(&["--router-mode", "round-robin"]).await;
    let client = reqwest::Client::new();
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for i in 0..6 {
        let (status, worker, _) =
            send(&client, &server.base, &chat(&format!("question {i}"))).await;
        assert_eq!(status, 200);
        *counts.entry(worker.unwrap()).or_default() += 1;
    }
    assert_eq!(
        counts.values().copied().collect::<Vec<_>>(),
        vec![2, 2, 2],
        "{counts:?}"
    );
}

#[tokio::test]
async fn engine_events_reach_the_index_and_attract_the_repeated_prompt() {
    let server = serve(&[
        "--router-mode",
        "kv",
        "--expose-decisions",
        "--admin-token",
        "t0k",
    ])
    .await;
    let client = reqwest::Client::new();
    let (_, first, _) = send(&client, &server.base, &chat("what is a KV cache?")).await;
    let first = first.unwrap();
    // Wait (bounded) until the worker's KV events have reached the router's index.
    let mut cached = 0;
    for _ in 0..200 {
        let list: Value = client
            .get(format!("{}/admin/workers", server.base))
            .bearer_auth("t0k")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let w = list["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["id"] == first)
            .unwrap()
            .clone();
        cached = w["ranks"][0]["cached_gpu_blocks"].as_u64().unwrap();
        if cached > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        cached >= 4,
        "the index learned the prompt's blocks from the engine's events ({cached})"
    );
    let r = client
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&chat("a different question"))
        .send()
        .await
        .unwrap();
    let worker: u64 = r.headers()["x-kvrouter-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let decision: Value =
        serde_json::from_str(r.headers()["x-kvrouter-decision"].to_str().unwrap()).unwrap();
    assert_eq!(worker, first, "routed to the worker holding the prefix");
    let chosen = decision["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == first)
        .unwrap()
        .clone();
    assert!(chosen["overlap"].as_u64().unwrap() >= 4, "{decision}");
    let body: Value = r.json().await.unwrap();
    assert!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 256
    );
    // The ingest thread counts an event after applying it, so the count may trail the index.
    let series = "kvrouter_kv_events_applied_total{status=\"ok\",event_type=\"stored\"}";
    common::until(series, Duration::from_secs(10), || async {
        common::metrics(&server.base).await.contains(series)
    })
    .await;
    assert!(common::metrics(&server.base)
        .await
        .contains("kvrouter_time_to_first_token_seconds_count"));
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let server = serve(&["--admin-token", "t0k"]).await;
    let client = reqwest::Client::new();
    let base = &server.base;
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let (s, _, e) = send(
        &client,
        base,
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("model")));
    let (s, _, e) = send(
        &client,
        base,
        &json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (404, Some("model")));
    let (s, _, e) = send(
        &client,
        base,
        &json!({"model": "mock-model", "messages": "x"}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("messages")));
    let r = client
        .get(format!("{base}/admin/workers"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = client
        .delete(format!("{base}/admin/workers/99"))
        .bearer_auth("t0k")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = client
        .delete(format!("{base}/admin/workers/2"))
        .bearer_auth("t0k")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "mock-model");
    // The engines' context length and creation time come through (they were dropped).
    assert!(
        models["data"][0]["max_model_len"].as_u64().unwrap() > 0,
        "{models}"
    );
    assert!(
        models["data"][0]["created"].as_u64().unwrap() > 0,
        "{models}"
    );
    // Streaming passes through unchanged, ending with [DONE].
    let mut body = chat("stream please");
    body["stream"] = json!(true);
    let text = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The first event says which policy version serves the stream; so does a whole answer.
    let first: Value = serde_json::from_str(
        text.split("\n\n")
            .next()
            .unwrap()
            .strip_prefix("data: ")
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["system_fingerprint"], "policy-0", "{first}");
    let (_, _, whole) = send(&client, base, &chat("whole please")).await;
    assert_eq!(whole["system_fingerprint"], "policy-0");
}

#[tokio::test]
async fn direct_mode_needs_a_worker_header() {
    let server = serve(&["--router-mode", "direct"]).await;
    let client = reqwest::Client::new();
    let (s, _, body) = send(&client, &server.base, &chat("x")).await;
    assert_eq!(s, 400);
    assert_eq!(body["error"]["param"], "x-kvrouter-worker-id", "{body}");
    let r = client
        .post(format!("{}/v1/chat/completions", server.base))
        .header("x-kvrouter-worker-id", "2")
        .json(&chat("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-kvrouter-worker"], "2");
}

#[tokio::test]
async fn missing_workers_are_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--port", "0"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--mock-workers"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "serve",
            "--port",
            "0",
            "--mock-workers",
            "1",
            "--router-mode",
            "fastest",
        ])
        .output()
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--router-mode"));
}

/// The events of a 40-token stream through a router started with `extra`.
async fn stream_events(extra: &[&str]) -> Vec<Value> {
    let server = serve(extra).await;
    let mut body = json!({"model": "mock-model", "prompt": "coalesce me", "max_tokens": 40});
    body["stream"] = json!(true);
    let text = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}"));
            serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {e:?}"))
        })
        .collect()
}

#[tokio::test]
async fn coalesced_streams_keep_every_event_whole() {
    // Each chunk alone, against merged batches (small cap, with yields) of the same stream.
    let alone = stream_events(&["--stream-coalesce-max-bytes", "0"]).await;
    let merged = stream_events(&[
        "--stream-coalesce-max-bytes",
        "400",
        "--stream-coalesce-yields",
        "8",
    ])
    .await;
    assert!(alone.len() >= 40, "{}", alone.len());
    assert_eq!(merged.len(), alone.len());
    let text = |evs: &[Value]| -> String {
        evs.iter()
            .map(|e| e["choices"][0]["text"].as_str().unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(text(&merged), text(&alone));
    assert_eq!(merged[0]["system_fingerprint"], "policy-0");
}

/// The names of a process's threads (Linux `/proc`).
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

#[tokio::test]
async fn worker_threads_sets_the_runtimes_worker_count() {
    for n in ["1", "3"] {
        let server = serve(&["--worker-threads", n]).await;
        let pid = server._proc.child.id().expect("running");
        // The runtime starts its workers before serving: all are there once it answers.
        let workers = thread_names(pid)
            .iter()
            .filter(|c| c.as_str() == "tokio-rt-worker")
            .count();
        assert_eq!(workers.to_string(), n, "{:?}", thread_names(pid));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--port", "0", "--mock-workers", "1"])
        .args(["--worker-threads", "1025"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--worker-threads: 1025 is above 1024"),
        "{err}"
    );
    // A bad variable is refused by name (tokio itself panicked on it, and took any count).
    for bad in ["x", "0", "2000"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--port", "0", "--mock-workers", "1"])
            .env("TOKIO_WORKER_THREADS", bad)
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {err}");
        assert!(err.contains("TOKIO_WORKER_THREADS: `"), "{bad}: {err}");
        assert!(!err.contains("panicked"), "{bad}: {err}");
    }
}

#[tokio::test]
async fn a_stream_coalesce_cap_above_its_bound_is_a_clear_error() {
    for (flag, value, message) in [
        (
            "--stream-coalesce-max-bytes",
            "16777217",
            "--stream-coalesce-max-bytes: 16777217 is above 16777216",
        ),
        (
            "--stream-coalesce-yields",
            "65",
            "--stream-coalesce-yields: 65 is above 64",
        ),
        (
            "--stream-coalesce-max-hold-us",
            "1000001",
            "--stream-coalesce-max-hold-us: 1000001 is above 1000000",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--port", "0", "--mock-workers", "1"])
            .args([flag, value])
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(message), "{err}");
    }
}

#[tokio::test]
async fn a_burst_beyond_capacity_gets_a_bounded_queue_and_529s() {
    let server = serve(&[
        "--router-mode",
        "least-loaded",
        "--router-queue-threshold",
        "0",
        "--router-queue-max-requests",
        "6",
    ])
    .await;
    let client = reqwest::Client::new();
    let long = "tell me a long story ".repeat(150);
    let burst: Vec<_> = (0..40)
        .map(|i| {
            let (client, base, body) = (
                client.clone(),
                server.base.clone(),
                json!({
                    "model": "mock-model", "max_tokens": 4,
                    "messages": [{"role": "user", "content": format!("{i}: {long}")}]
                }),
            );
            tokio::spawn(async move {
                let r = client
                    .post(format!("{base}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let retry = r
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                let body: Value = r.json().await.unwrap();
                (status, retry, body)
            })
        })
        .collect();
    let mut ok = 0;
    let mut rejected = 0;
    for t in burst {
        let (status, retry, body) = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("answered in time")
            .unwrap();
        match status {
            200 => {
                assert_eq!(body["usage"]["completion_tokens"], 4);
                ok += 1;
            }
            529 => {
                assert_eq!(retry.as_deref(), Some("1"), "529 carries Retry-After");
                assert_eq!(body["error"]["type"], "overloaded");
                rejected += 1;
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    eprintln!("overload: sent 40, completed {ok}, rejected with 529 {rejected}");
    assert_eq!(ok + rejected, 40, "every request answered exactly once");
    assert!(rejected > 0 && ok > 6, "ok {ok}, rejected {rejected}");
    let metrics = reqwest::get(format!("{}/metrics", server.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvrouter_router_queue_pending_requests 0"),
        "the queue drained"
    );
    let counted: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvrouter_rejections_total{reason=\"queue_full\"} "))
        .and_then(|v| v.parse().ok())
        .expect("the queue_full series");
    assert_eq!(counted, rejected as u64, "each rejection counted");
}

#[tokio::test]
async fn sessions_stay_on_their_worker_until_released() {
    let server = serve(&[
        "--router-mode",
        "round-robin",
        "--router-session-affinity-ttl-secs",
        "60",
    ])
    .await;
    let client = reqwest::Client::new();
    let turn = |i: usize| {
        client
            .post(format!("{}/v1/chat/completions", server.base))
            .header("x-session-id", "trajectory-17")
            .json(&chat(&format!("turn {i}")))
    };
    let mut workers = Vec::new();
    for i in 0..5 {
        let r = turn(i).send().await.unwrap();
        workers.push(
            r.headers()["x-kvrouter-worker"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert!(workers.iter().all(|w| *w == workers[0]), "{workers:?}");
    let released: Value = client
        .delete(format!("{}/v1/sessions/trajectory-17", server.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(released["released"], true);
    let r = client
        .post(format!("{}/finish_session", server.base))
        .json(&json!({"session_id": "trajectory-17"}))
        .send()
        .await
        .unwrap();
    let again: Value = r.json().await.unwrap();
    assert_eq!(again["released"], false, "already released");
}

#[tokio::test]
async fn paused_workers_leave_rotation_until_resumed() {
    let server = serve(&["--admin-token", "t0k", "--router-mode", "round-robin"]).await;
    let client = reqwest::Client::new();
    let base = &server.base;
    let admin = |path: String| client.post(format!("{base}{path}")).bearer_auth("t0k");
    for w in [0, 1] {
        let r = admin(format!("/admin/workers/{w}/pause"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    let r = admin("/admin/workers/7/pause".into()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = client
        .post(format!("{base}/admin/workers/0/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "pausing is an admin call");
    for i in 0..6 {
        let (s, worker, _) = send(&client, base, &chat(&format!("paused {i}"))).await;
        assert_eq!((s, worker), (200, Some(2)));
    }
    let list: Value = client
        .get(format!("{base}/admin/workers"))
        .bearer_auth("t0k")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let states: BTreeMap<u64, String> = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["id"].as_u64().unwrap(),
                w["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(states[&0], "paused");
    assert_eq!(states[&2], "serving");
    let r = admin("/admin/workers/0/resume".into())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..4 {
        let (s, worker, _) = send(&client, base, &chat(&format!("resumed {i}"))).await;
        assert_eq!(s, 200);
        seen.insert(worker.unwrap());
    }
    assert_eq!(
        seen,
        [0, 2].into_iter().collect(),
        "worker 0 is back, 1 still paused"
    );
}

#[tokio::test]
async fn requests_go_to_workers_of_the_policy_version_they_accept() {
    let server = serve(&["--admin-token", "t0k"]).await;
    let client = reqwest::Client::new();
    let base = server.base.clone();
    let set_version = |w: u64, v: Value| {
        client
            .post(format!("{base}/admin/workers/{w}/policy-version"))
            .bearer_auth("t0k")
            .json(&json!({ "version": v }))
            .send()
    };
    assert_eq!(
        set_version(1, json!(5)).await.unwrap().status().as_u16(),
        200
    );
    assert_eq!(
        set_version(9, json!(5)).await.unwrap().status().as_u16(),
        404
    );
    assert_eq!(
        set_version(1, json!("x")).await.unwrap().status().as_u16(),
        400
    );
    for i in 0..3 {
        let (s, w, v, _) = send_with(
            &client,
            &base,
            &chat(&format!("v5 {i}")),
            &[("x-kvrouter-policy-version", "5")],
        )
        .await;
        assert_eq!((s, w, v), (200, Some(1), Some(5)));
        let (s, w, v, _) = send_with(
            &client,
            &base,
            &chat(&format!("stale {i}")),
            &[("x-kvrouter-max-policy-staleness", "0")],
        )
        .await;
        assert_eq!(
            (s, w, v),
            (200, Some(1), Some(5)),
            "only the newest version is fresh enough"
        );
    }
    let (s, _, _, e) = send_with(
        &client,
        &base,
        &chat("bad"),
        &[("x-kvrouter-min-policy-version", "new")],
    )
    .await;
    assert_eq!(
        (s, e["error"]["param"].as_str()),
        (400, Some("x-kvrouter-min-policy-version"))
    );
    // Nobody serves version 7 yet: with a deadline, the request times out in the queue.
    let (s, _, _, e) = send_with(
        &client,
        &base,
        &chat("late"),
        &[
            ("x-kvrouter-policy-version", "7"),
            ("x-kvrouter-deadline-ms", "50"),
        ],
    )
    .await;
    assert_eq!(
        (s, e["error"]["type"].as_str()),
        (504, Some("deadline_exceeded"))
    );
    // Without one it waits until a worker loads version 7, then goes there.
    let waiting = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            send_with(
                &client,
                &base,
                &chat("waits for v7"),
                &[("x-kvrouter-policy-version", "7")],
            )
            .await
        })
    };
    let mut queued = false;
    for _ in 0..200 {
        let m = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("kvrouter_router_queue_pending_requests 1") {
            queued = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(queued, "the v7 request waits in the router queue");
    assert_eq!(
        set_version(2, json!(7)).await.unwrap().status().as_u16(),
        200
    );
    let (s, w, v, _) = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((s, w, v), (200, Some(2), Some(7)));
}

#[tokio::test]
async fn the_provenance_log_has_one_line_per_request() {
    let path = std::env::temp_dir().join(format!("kvrouter-prov-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let server = serve(&[
        "--admin-token",
        "t0k",
        "--provenance-log",
        path.to_str().unwrap(),
    ])
    .await;
    let client = reqwest::Client::new();
    let base = server.base.clone();
    for w in 0..3 {
        client
            .post(format!("{base}/admin/workers/{w}/policy-version"))
            .bearer_auth("t0k")
            .json(&json!({"version": 4}))
            .send()
            .await
            .unwrap();
    }
    let (s, w, _, _) = send_with(
        &client,
        &base,
        &chat("provenance"),
        &[("x-session-id", "traj-7"), ("x-kvrouter-group-id", "g-1")],
    )
    .await;
    assert_eq!(s, 200);
    let mut body = chat("streamed");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let text = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("[DONE]"));
    // The log is written off the request path by another process: poll it (bounded).
    let mut lines: Vec<Value> = Vec::new();
    for _ in 0..300 {
        lines = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if lines.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(lines.len(), 2, "{lines:?}");
    let first = lines
        .iter()
        .find(|l| l["session"] == "traj-7")
        .expect("the session line");
    assert_eq!(first["group"], "g-1");
    assert_eq!(first["worker"].as_u64(), w);
    assert_eq!(first["policy_version"], 4);
    assert_eq!(first["status"], "ok");
    assert_eq!(first["output_tokens"], 3);
    assert!(first["prompt_tokens"].as_u64().unwrap() > 64);
    assert!(first["e2e_ms"].as_f64().unwrap() >= first["ttft_ms"].as_f64().unwrap());
    let streamed = lines.iter().find(|l| l["session"].is_null()).unwrap();
    assert_eq!(
        (streamed["status"].as_str(), streamed["migrations"].as_u64()),
        (Some("ok"), Some(0))
    );
    assert!(streamed["decode_ms"].as_f64().is_some());
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn request_bodies_past_axums_2_mb_default_are_accepted() {
    let server = serve(&[]).await;
    // 3 MB of JSON whitespace: the router reads it and forwards it unchanged to the engine.
    let body = format!(
        "{{\"model\": \"mock-model\", \"max_tokens\": 2,{}\"prompt\": [1, 2, 3, 4, 5, 6, 7, 8]}}",
        " ".repeat(3 << 20)
    );
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{:?}", r.text().await);
}

/// A worker on `listener`: each request's head goes to `answer`, whose bytes are written back;
/// then the connection closes, or (`hold`) stays open with nothing more sent.
fn fake_worker(listener: tokio::net::TcpListener, answer: fn(&[u8]) -> (String, bool)) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let (bytes, hold) = answer(&buf);
                let _ = s.write_all(bytes.as_bytes()).await;
                if hold {
                    let _ = s.read(&mut chunk).await;
                }
            });
        }
    });
}

/// A JSON answer that closes its connection.
fn json_answer(status: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// A worker still loading when the router starts (its `/v1/models` does not answer) has its
/// models learned once it answers: the router lists them (it listed none) and places requests
/// for them.
#[tokio::test]
async fn a_worker_that_answers_late_has_its_models_learned() {
    // Bound, so connections wait in its backlog unanswered, until it serves below.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (proc, dir) = common::serve_one_worker(&url, "late-models", &[]).await;
    let base = proc.http();
    let client = reqwest::Client::new();
    let listed = |client: reqwest::Client, base: String| async move {
        let v: Value = client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        Some(
            v["data"]
                .as_array()?
                .iter()
                .filter_map(|m| m["id"].as_str().map(str::to_owned))
                .collect::<Vec<_>>(),
        )
    };
    assert_eq!(
        listed(client.clone(), base.clone()).await.unwrap(),
        Vec::<String>::new()
    );
    // Now it serves: its model list, and 404 for anything else.
    fake_worker(listener, |head| match head.starts_with(b"GET /v1/models") {
        true => (
            json_answer(
                "200 OK",
                r#"{"object":"list","data":[{"id":"late-model"}]}"#,
            ),
            false,
        ),
        false => (
            json_answer("404 Not Found", r#"{"error":"not here"}"#),
            false,
        ),
    });
    let models = common::until("the late worker's models", Duration::from_secs(30), || {
        let (client, base) = (client.clone(), base.clone());
        async move { listed(client, base).await.filter(|m| !m.is_empty()) }
    })
    .await;
    assert_eq!(models, ["late-model"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A non-streamed answer whose body stalls partway fails within `--upstream-response-timeout-secs`
/// (it held the request until the client gave up); and a worker whose `/server_info` stalls
/// mid-body does not hold the router's start (it waited for ever).
#[tokio::test]
async fn a_stalled_answer_body_fails_within_the_response_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    fake_worker(listener, |head| {
        match head.starts_with(b"GET /v1/models") {
        true => (
            json_answer("200 OK", r#"{"object":"list","data":[{"id":"stall-model"}]}"#),
            false,
        ),
        // Headers and part of the body, then nothing (the connection stays open).
        false => (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial".into(),
            true,
        ),
    }
    });
    let extra = ["--retries", "0", "--upstream-response-timeout-secs", "1"];
    let (proc, dir) = common::serve_one_worker(&url, "stall", &extra).await;
    let started = std::time::Instant::now();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", proc.http()))
        .json(&json!({"model": "stall-model", "prompt": "hello", "max_tokens": 2}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("the router answers");
    assert!(r.status().is_server_error(), "{}", r.status());
    let body = r.text().await.unwrap();
    assert!(body.contains("did not finish within"), "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The embedded engines serve the names the router lists (`--model-name`), so a request for
/// any of them is answered (it got 503 "no workers available": the engines served only their
/// default `mock-model`).
#[tokio::test]
async fn embedded_engines_serve_the_model_names_given() {
    let s = serve(&["--model-name", "m1", "--model-name", "m2"]).await;
    let client = reqwest::Client::new();
    for model in ["m1", "m2"] {
        let mut body = chat("which model?");
        body["model"] = json!(model);
        let (status, _, answer) = send(&client, &s.base, &body).await;
        assert_eq!(status, 200, "{model}: {answer}");
        assert_eq!(answer["model"], model, "{answer}");
    }
    let mut other = chat("and this?");
    other["model"] = json!("mock-model");
    assert_eq!(send(&client, &s.base, &other).await.0, 404, "not listed");
}
