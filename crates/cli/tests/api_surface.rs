//! End to end, real processes: the pass-through endpoints (`/v1/responses`, `/v1/embeddings`,
//! `/v1/models/{id}`, `/tokenize`, `/detokenize`) through `kvrouter serve --mock-workers 2`, and
//! model pools with LoRA adapters across separate `kvrouter mock-engine` processes.

mod common;
#[path = "api_surface/keys.rs"]
mod keys;

use serde_json::{json, Value};
use std::collections::BTreeSet;

async fn serve(extra: &[&str]) -> common::Proc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--mock-speedup-ratio",
        "50",
    ];
    args.extend(extra);
    common::spawn(&args).await
}

/// POSTs `body` to `path`: status, serving worker, body (JSON, or the raw text as a string).
async fn post(base: &str, path: &str, body: &Value) -> (u16, Option<u64>, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let worker = r
        .headers()
        .get("x-kvrouter-worker")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, worker, value)
}

fn assert_openai_error(body: &Value, code: u16, param: Option<&str>) {
    let e = &body["error"];
    assert!(e["message"].is_string() && e["type"].is_string(), "{body}");
    assert_eq!(e["code"], code, "{body}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{body}");
    }
}

#[tokio::test]
async fn responses_are_passed_through_whole_and_streamed() {
    let p = serve(&[]).await;
    let base = p.http();
    let body = json!({"model": "mock-model", "input": "Say hi", "max_output_tokens": 4});
    let (status, worker, r) = post(&base, "/v1/responses", &body).await;
    assert_eq!(status, 200, "{r}");
    assert!(worker.is_some(), "placed by the router");
    assert_eq!(
        (r["object"].as_str(), r["status"].as_str()),
        (Some("response"), Some("completed")),
        "{r}"
    );
    assert_eq!(r["usage"]["output_tokens"], 4, "{r}");
    assert!(r["output"][0]["content"][0]["text"].is_string(), "{r}");

    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let (status, _, text) = post(&base, "/v1/responses", &stream).await;
    assert_eq!(status, 200);
    let text = text.as_str().expect("an event stream").to_owned();
    let kinds: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(kinds.first(), Some(&"response.created"), "{text}");
    assert_eq!(kinds.last(), Some(&"response.completed"), "{text}");
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "response.output_text.delta")
            .count(),
        4,
        "{text}"
    );
    let last: Value = serde_json::from_str(
        text.lines()
            .rev()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(last["response"]["usage"]["output_tokens"], 4, "{last}");
    assert_load_released(&base).await;

    let (status, _, e) = post(
        &base,
        "/v1/responses",
        &json!({"model": "nope", "input": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_openai_error(&e, 404, Some("model"));
    let bad = json!({"model": "mock-model", "input": [{"role": "user", "content": 3}]});
    let (status, _, e) = post(&base, "/v1/responses", &bad).await;
    assert_eq!(status, 400);
    assert_openai_error(&e, 400, Some("input[0].content"));
}

#[tokio::test]
async fn same_prefix_responses_land_on_one_worker() {
    let p = serve(&["--router-mode", "kv", "--router-predicted-ttl-secs", "30"]).await;
    let base = p.http();
    let instructions = "You are a careful assistant. ".repeat(40);
    let mut workers = BTreeSet::new();
    for i in 0..6 {
        let body = json!({"model": "mock-model", "instructions": instructions, "input": format!("question {i}"), "max_output_tokens": 2});
        let (status, worker, r) = post(&base, "/v1/responses", &body).await;
        assert_eq!(status, 200, "{r}");
        workers.insert(worker.unwrap());
    }
    assert_eq!(workers.len(), 1, "same prefix, same worker: {workers:?}");
}

#[tokio::test]
async fn embeddings_tokenize_detokenize_and_model_lookup() {
    let p = serve(&[]).await;
    let base = p.http();
    let body = json!({"model": "mock-model", "input": ["the same text", "other text"]});
    let (status, worker, a) = post(&base, "/v1/embeddings", &body).await;
    assert_eq!(status, 200, "{a}");
    assert!(worker.is_some());
    assert_eq!(a["data"].as_array().unwrap().len(), 2, "{a}");
    let dim = a["data"][0]["embedding"].as_array().unwrap().len();
    assert!(dim > 0);
    assert_eq!(a["data"][1]["embedding"].as_array().unwrap().len(), dim);
    // Deterministic from the tokens, whichever worker answers.
    for _ in 0..3 {
        let (_, _, b) = post(&base, "/v1/embeddings", &body).await;
        assert_eq!(a["data"], b["data"]);
    }
    assert_ne!(a["data"][0]["embedding"], a["data"][1]["embedding"]);
    let (status, _, e) = post(
        &base,
        "/v1/embeddings",
        &json!({"model": "mock-model", "input": 7}),
    )
    .await;
    assert_eq!(status, 400);
    assert_openai_error(&e, 400, Some("input"));

    let (status, _, t) = post(&base, "/tokenize", &json!({"prompt": "hello kv router"})).await;
    assert_eq!(status, 200, "{t}");
    let tokens = t["tokens"].clone();
    assert_eq!(
        t["count"].as_u64().unwrap() as usize,
        tokens.as_array().unwrap().len()
    );
    assert!(t["count"].as_u64().unwrap() > 0);
    let (status, _, d) = post(
        &base,
        "/detokenize",
        &json!({"model": "mock-model", "tokens": tokens}),
    )
    .await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["prompt"], "hello kv router");
    let (status, _, e) = post(&base, "/detokenize", &json!({"tokens": "x"})).await;
    assert_eq!(status, 400);
    assert_openai_error(&e, 400, Some("tokens"));

    let get = |path: String| async move {
        let r = reqwest::get(path).await.unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    let (status, m) = get(format!("{base}/v1/models/mock-model")).await;
    assert_eq!(status, 200, "{m}");
    assert_eq!(m["id"], "mock-model");
    let (status, e) = get(format!("{base}/v1/models/nope")).await;
    assert_eq!(status, 404);
    assert_openai_error(&e, 404, Some("model"));

    // Headers past the limit: a 431 in the OpenAI shape, on a pass-through endpoint too.
    let big = "x".repeat(70 * 1024);
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/embeddings"))
        .header("x-big", big)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 431);
    assert_openai_error(&r.json().await.unwrap(), 431, None);
    // A body announced past 64 MiB: a 413 in the OpenAI shape, before the body is read.
    for path in ["/v1/embeddings", "/v1/responses", "/tokenize"] {
        let (status, body) = oversized(&base, path).await;
        assert_eq!(status, 413, "{path}: {body}");
        assert_openai_error(&body, 413, None);
    }
    assert_load_released(&base).await;
    // Embeddings and token ids are no generated text: counted as requests, but no sample in
    // the latency and output histograms (a tokenize call is no 0-token completion).
    let text = common::metrics(&base).await;
    let ok = "kvrouter_requests_total{status=\"ok\",mode=\"cost\",model=\"mock-model\"} ";
    assert!(text.contains(ok), "{text}");
    for family in [
        "kvrouter_time_to_first_token_seconds_count",
        "kvrouter_request_duration_seconds_count",
        "kvrouter_output_sequence_tokens_count",
    ] {
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with(family) && !l.ends_with(" 0"))
            .collect();
        assert!(samples.is_empty(), "{family}: {samples:?}");
    }
}

/// Announces a 70 MB body to `path` over a raw connection, sends one byte of it, and reads the
/// answer (bounded: an answer that waits for the body fails the test).
async fn oversized(base: &str, path: &str) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 70000000\r\n\r\n{{"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    // Read the head and the body it announces (the connection may stay open).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let l = l.to_ascii_lowercase();
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= len {
                let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
                let value = serde_json::from_str(body).unwrap_or(Value::String(body.into()));
                return (status, value);
            }
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let n = tokio::time::timeout(left, conn.read(&mut buf))
            .await
            .expect("an answer before the body was sent")
            .unwrap();
        assert!(n > 0, "closed before a whole answer: {text}");
        out.extend_from_slice(&buf[..n]);
    }
}

/// Every pass-through answer released its load: no worker rank has active requests left
/// (polled: a guard is released when the body's last byte went out).
async fn assert_load_released(base: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let text = common::metrics(base).await;
        let active: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kvrouter_worker_active_requests{") && !l.ends_with(" 0"))
            .collect();
        if active.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "load not released: {active:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Three engines: `a` with the adapter `a-sql`, `a`, and `b`. Requests stay in their model's
/// pool (round robin would otherwise spread them over all three), adapter requests go only to
/// the engine that has it loaded, and an unknown model is a 404 naming `model`.
#[tokio::test]
async fn models_and_adapters_are_routed_to_their_pools() {
    let engine = |args: &'static [&'static str]| async move {
        let mut all = vec!["mock-engine", "--port", "0", "--speedup-ratio", "50"];
        all.extend(args);
        common::spawn(&all).await
    };
    let e0 = engine(&["--served-model-name", "a", "--lora", "a-sql"]).await;
    let e1 = engine(&["--model-name", "a"]).await;
    let e2 = engine(&["--served-model-name", "b", "--served-model-name", "b-alias"]).await;
    let (u0, u1, u2) = (e0.http(), e1.http(), e2.http());
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--router-mode",
        "round-robin",
        "--worker",
        &u0,
        "--worker",
        &u1,
        "--worker",
        &u2,
        "--admin-token",
        "t",
    ])
    .await;
    let base = router.http();
    // Which id each engine got.
    let list: Value = reqwest::Client::new()
        .get(format!("{base}/admin/workers"))
        .bearer_auth("t")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id_of = |url: &str| {
        list["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == url)
            .and_then(|w| w["id"].as_u64())
            .expect("registered")
    };
    let (w0, w1, w2) = (id_of(&u0), id_of(&u1), id_of(&u2));

    let models: Value = reqwest::get(format!("{base}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: BTreeSet<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(
        ids,
        BTreeSet::from(["a", "a-sql", "b", "b-alias"]),
        "{models}"
    );
    let sql = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "a-sql")
        .unwrap();
    assert_eq!(sql["parent"], "a", "{models}");

    let served_by = |model: &'static str| {
        let base = base.clone();
        async move {
            let mut seen = BTreeSet::new();
            for i in 0..6 {
                let body = json!({"model": model, "prompt": format!("p {i}"), "max_tokens": 1});
                let (status, worker, r) = post(&base, "/v1/completions", &body).await;
                assert_eq!(status, 200, "{model}: {r}");
                assert_eq!(r["model"], model);
                seen.insert(worker.unwrap());
            }
            seen
        }
    };
    assert_eq!(served_by("b").await, BTreeSet::from([w2]));
    assert_eq!(served_by("b-alias").await, BTreeSet::from([w2]));
    assert_eq!(served_by("a-sql").await, BTreeSet::from([w0]));
    assert_eq!(served_by("a").await, BTreeSet::from([w0, w1]));
    let (status, _, e) = post(
        &base,
        "/v1/completions",
        &json!({"model": "c", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_openai_error(&e, 404, Some("model"));
    // A worker registered with `models` serves those, whatever its /v1/models lists.
    let e3 = engine(&["--model-name", "c", "--lora", "c-extra"]).await;
    let r = reqwest::Client::new()
        .post(format!("{base}/admin/workers"))
        .bearer_auth("t")
        .json(&json!({"url": e3.http(), "models": ["c"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let w3 = r.json::<Value>().await.unwrap()["id"].as_u64().unwrap();
    let (status, worker, r) = post(
        &base,
        "/v1/completions",
        &json!({"model": "c", "prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!((status, worker), (200, Some(w3)), "{r}");
    let (status, worker, e) = post(
        &base,
        "/v1/completions",
        &json!({"model": "c-extra", "prompt": "x"}),
    )
    .await;
    assert_eq!(
        (status, worker),
        (404, None),
        "not in the configured list: {e}"
    );
    assert_eq!(
        served_by("b").await,
        BTreeSet::from([w2]),
        "b stays off the c worker"
    );
    // Pass-through endpoints stay in their pool too.
    for _ in 0..4 {
        let (status, worker, r) = post(
            &base,
            "/v1/embeddings",
            &json!({"model": "b", "input": "x"}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(worker, Some(w2));
    }
}
