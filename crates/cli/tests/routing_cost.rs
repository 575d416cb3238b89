//! End to end: `kvrouter serve --router-mode cost` with mock workers drives the same core policy
//! as `kvrouter sim`: a prompt whose prefix a worker holds goes there, and the decision reports
//! the cost mode with its expected seconds. Also (default mode) a `cache_salt` namespaces the
//! prefix a request can find.

mod common;

use serde_json::{json, Value};
use std::time::Duration;

fn chat(question: &str) -> Value {
    let system = "You are a careful assistant. ".repeat(40);
    json!({"model": "mock-model", "max_tokens": 3, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}
    ]})
}

async fn admin_workers(client: &reqwest::Client, base: &str) -> Value {
    client
        .get(format!("{base}/admin/workers"))
        .bearer_auth("t0k")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The event-fed blocks of `worker`'s first rank (a worker with KV events, which has no
/// predicted count).
async fn cached_blocks(client: &reqwest::Client, base: &str, worker: u64) -> u64 {
    let list = admin_workers(client, base).await;
    let rank = &list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == worker)
        .unwrap()["ranks"][0];
    assert!(rank.get("predicted_gpu_blocks").is_none(), "{rank}");
    rank["cached_gpu_blocks"].as_u64().unwrap()
}

async fn send(client: &reqwest::Client, base: &str, body: &Value) -> (u64, Value, Value) {
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let worker: u64 = r.headers()["x-kvrouter-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let decision: Value =
        serde_json::from_str(r.headers()["x-kvrouter-decision"].to_str().unwrap()).unwrap();
    (worker, decision, r.json().await.unwrap())
}

#[tokio::test]
async fn cost_mode_serves_and_follows_the_cached_prefix() {
    let proc = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "3",
        "--mock-speedup-ratio",
        "50",
        "--router-mode",
        "cost",
        "--expose-decisions",
        "--admin-token",
        "t0k",
    ])
    .await;
    let base = proc.http();
    let client = reqwest::Client::new();
    let (first, decision, _) = send(&client, &base, &chat("what is a KV cache?")).await;
    assert_eq!(decision["mode"], "cost", "{decision}");
    // Wait (bounded) for the worker's KV events to reach the index.
    let mut cached = 0;
    for _ in 0..200 {
        cached = cached_blocks(&client, &base, first).await;
        if cached >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(cached >= 4, "the index learned the prompt ({cached})");
    // Every worker is idle: the one holding the prefix has the shortest expected TTFT.
    for i in 0..3 {
        let (worker, decision, body) =
            send(&client, &base, &chat(&format!("another question {i}"))).await;
        assert_eq!(worker, first, "{decision}");
        assert!(
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                >= 256,
            "{body}"
        );
    }
}

/// The largest overlap (blocks) any candidate of `decision` had.
fn best_overlap(decision: &Value) -> u64 {
    decision["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["overlap"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0)
}

/// A request's `cache_salt` namespaces its blocks end to end: the embedded mock engines cache
/// and announce them under the salt, as vLLM does, so a salted repeat finds its prefix and an
/// unsalted one does not.
#[tokio::test]
async fn a_salted_prompt_finds_only_its_salted_prefix() {
    let proc = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--mock-speedup-ratio",
        "50",
        "--expose-decisions",
        "--admin-token",
        "t0k",
    ])
    .await;
    let base = proc.http();
    let client = reqwest::Client::new();
    let mut salted = chat("what is a KV cache?");
    salted["cache_salt"] = json!("tenant-1");
    let (first, _, _) = send(&client, &base, &salted).await;
    // The worker's KV events reach the index (bounded wait).
    let learned = common::poll(Duration::from_secs(5), || async {
        cached_blocks(&client, &base, first).await >= 4
    })
    .await;
    assert!(learned.is_some(), "the index learned the salted prompt");
    let (again, decision, body) = send(&client, &base, &salted).await;
    assert_eq!(again, first, "{decision}");
    assert!(best_overlap(&decision) >= 4, "{decision}");
    assert!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{body}"
    );
    let (_, decision, _) = send(&client, &base, &chat("what is a KV cache?")).await;
    assert_eq!(best_overlap(&decision), 0, "unsalted: {decision}");
}

/// A slow step-time profile (every step a tenth of a second or more), as a JSON file.
fn slow_profile(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("slow.json");
    let table = json!({
        "name": "slow", "source": "test", "extrapolate": true,
        "prefill": [[1.0, 100.0], [100000.0, 100000.0]],
        "decode_batch_sizes": [1.0, 256.0], "decode_contexts": [1.0, 100000.0],
        "decode_ms": [[100.0, 100.0], [100.0, 100.0]]
    });
    std::fs::write(&path, table.to_string()).unwrap();
    path
}

/// Each worker's own step-time profile prices it: of two idle workers, the one whose profile is
/// slower gets none of the requests (without profiles, ties go round the fleet), and its
/// candidate costs more in the decision. A profile the router cannot read is refused naming the
/// field (admin API) or the flag (`--router-cost-profile`).
#[tokio::test]
async fn a_workers_own_profile_prices_it() {
    let dir = std::env::temp_dir().join(format!("kvr-profiles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let slow = slow_profile(&dir);
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "50"]).await);
    }
    let workers = dir.join("workers.toml");
    let text = format!(
        "[[workers]]\nurl = \"{}\"\nprofile = \"{}\"\n\n[[workers]]\nurl = \"{}\"\nprofile = \"dynamo-poly\"\n",
        engines[0].http(),
        slow.display(),
        engines[1].http()
    );
    std::fs::write(&workers, text).unwrap();
    let proc = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--workers-file",
        workers.to_str().unwrap(),
        "--router-mode",
        "cost",
        "--no-router-kv-events",
        "--health-check-interval-secs",
        "0",
        "--expose-decisions",
        "--admin-token",
        "t0k",
    ])
    .await;
    let base = proc.http();
    let client = reqwest::Client::new();
    for i in 0..4 {
        // Prompts that share no block: every candidate is idle and holds nothing of it.
        let content = format!("{i} {}", "unrelated words ".repeat(30 + 7 * i));
        let body = json!({"model": "mock-model", "max_tokens": 3,
            "messages": [{"role": "user", "content": content}]});
        let (worker, decision, _) = send(&client, &base, &body).await;
        assert_eq!(worker, 1, "request {i} went to the slow worker: {decision}");
        let totals: Vec<f64> = (0..2)
            .map(|w| {
                decision["candidates"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["worker"] == w)
                    .unwrap()["total"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        assert!(totals[0] > 10.0 * totals[1], "{decision}");
    }
    let refused = client
        .post(format!("{base}/admin/workers"))
        .bearer_auth("t0k")
        .json(&json!({"url": "http://127.0.0.1:9", "profile": "no-such-profile.json"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["param"], "profile", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-profile.json"),
        "{body}"
    );
    // Times that would make every estimate infinite are refused, naming the file.
    let huge = dir.join("huge.json");
    let mut table: Value = serde_json::from_slice(&std::fs::read(&slow).unwrap()).unwrap();
    table["prefill"] = json!([[1.0, 1e300], [2.0, 1e308]]);
    std::fs::write(&huge, table.to_string()).unwrap();
    let refused = client
        .post(format!("{base}/admin/workers"))
        .bearer_auth("t0k")
        .json(&json!({"url": "http://127.0.0.1:9", "profile": huge}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    let body: Value = refused.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("huge.json") && message.contains("every time must be"),
        "{body}"
    );
    // At start: the flag, or the workers-file entry, is named.
    let bad_file = dir.join("bad-workers.toml");
    std::fs::write(
        &bad_file,
        "[[workers]]\nurl = \"http://127.0.0.1:9\"\nprofile = \"bogus\"\n",
    )
    .unwrap();
    for (args, named) in [
        (
            vec!["--router-cost-profile", "no-such-profile.json"],
            "--router-cost-profile",
        ),
        (vec!["--router-cost-profile", ""], "--router-cost-profile"),
        (
            vec!["--workers-file", bad_file.to_str().unwrap()],
            "workers[0].profile",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--mock-workers", "1", "--port", "0"])
            .args(&args)
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(named) && err.contains("not dynamo-poly"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker whose KV events do not reach the router (a mock engine publishing none, so it
/// advertises no endpoint) has its cache predicted from what is routed to it, with the other
/// workers' events on: a repeated prompt finds its prefix there.
#[tokio::test]
async fn a_worker_without_kv_events_has_its_cache_predicted() {
    let engine = common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "50"]).await;
    let (proc, dir) = common::serve_one_worker(
        &engine.http(),
        "predicted",
        &["--expose-decisions", "--admin-token", "t0k"],
    )
    .await;
    let base = proc.http();
    let client = reqwest::Client::new();
    let predicted = |list: Value| list["workers"][0]["ranks"][0]["predicted_gpu_blocks"].as_u64();
    assert_eq!(predicted(admin_workers(&client, &base).await), Some(0));
    let (_, first, _) = send(&client, &base, &chat("what is a KV cache?")).await;
    assert_eq!(best_overlap(&first), 0, "{first}");
    let (_, again, _) = send(&client, &base, &chat("what is a KV cache?")).await;
    assert!(
        best_overlap(&again) > 0,
        "the prompt's prefix is predicted: {again}"
    );
    // The admin view shows what is predicted (the event-fed count stays 0).
    let list = admin_workers(&client, &base).await;
    assert!(
        predicted(list.clone()).unwrap() >= best_overlap(&again),
        "{list}"
    );
    assert_eq!(
        list["workers"][0]["ranks"][0]["cached_gpu_blocks"], 0,
        "{list}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker without KV events is priced with what its `/server_info` says (step budget, KV
/// capacity), as its peers are: before, it was priced with the router's defaults (a capacity
/// 16 times the mock's), looked cheaper than an identical peer with events, and took every new
/// prompt of a light load.
#[tokio::test]
async fn a_worker_without_kv_events_is_priced_like_its_peers() {
    let with_events = common::spawn(&[
        "mock-engine",
        "--port",
        "0",
        "--speedup-ratio",
        "50",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
    ])
    .await;
    let without = common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "50"]).await;
    // Without events its block size need not be the router's: its capacity is converted.
    let small_blocks = common::spawn(&[
        "mock-engine",
        "--port",
        "0",
        "--speedup-ratio",
        "50",
        "--block-size",
        "16",
    ])
    .await;
    let (proc, dir) = common::serve_workers(
        &[&with_events.http(), &without.http()],
        "mixed",
        &["--expose-decisions", "--admin-token", "t0k"],
    )
    .await;
    let base = proc.http();
    let client = reqwest::Client::new();
    let list = admin_workers(&client, &base).await;
    let ws = list["workers"].as_array().unwrap();
    assert!(
        ws[0]["kv_events_endpoint"].is_string() && ws[1]["kv_events_endpoint"].is_null(),
        "{list}"
    );
    for field in ["kv_capacity_blocks", "max_num_batched_tokens"] {
        assert_eq!(ws[0][field], ws[1][field], "{field}: {list}");
        assert!(ws[1][field].is_u64(), "{field}: {list}");
    }
    let added = client
        .post(format!("{base}/admin/workers"))
        .bearer_auth("t0k")
        .json(&json!({"url": small_blocks.http()}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        added.status().as_u16(),
        201,
        "{}",
        added.text().await.unwrap()
    );
    let list = admin_workers(&client, &base).await;
    let third = &list["workers"][2];
    assert_eq!(
        (
            third["kv_capacity_blocks"].as_u64(),
            third["block_size"].is_null()
        ),
        (
            Some(ws[0]["kv_capacity_blocks"].as_u64().unwrap() / 4),
            true
        ),
        "16-token blocks counted in the router's 64-token ones: {list}"
    );
    let removed = client
        .delete(format!("{base}/admin/workers/{}", third["id"]))
        .bearer_auth("t0k")
        .send()
        .await
        .unwrap();
    assert!(removed.status().is_success());
    let mut went = [0; 2];
    for i in 0..4 {
        // Prompts that share no block: every candidate is idle and holds nothing of it.
        let content = format!("{i} {}", "unrelated words ".repeat(30 + 7 * i));
        let body = json!({"model": "mock-model", "max_tokens": 3,
            "messages": [{"role": "user", "content": content}]});
        let (worker, decision, _) = send(&client, &base, &body).await;
        let totals: Vec<f64> = decision["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["total"].as_f64().unwrap())
            .collect();
        assert!(
            (totals[0] - totals[1]).abs() < 1e-9 * totals[0],
            "{decision}"
        );
        went[worker as usize] += 1;
    }
    assert_eq!(went, [2, 2], "ties go round the fleet");
    let _ = std::fs::remove_dir_all(&dir);
}
