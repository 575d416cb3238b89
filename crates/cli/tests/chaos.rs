//! Chaos: `kvrouter serve` in front of four `kvrouter mock-engine` processes, a bounded load of
//! streaming requests, and `kill -9` of one engine mid-run. With `--migration-limit 3` every
//! request completes with exactly the tokens it asked for; with 0 the broken ones end with a clean
//! in-band error (or, when not a byte of them had been sent, a 502 with an OpenAI error) and
//! nothing hangs.

mod common;

use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

const REQUESTS: usize = 160;
const CONCURRENCY: usize = 32;
const MAX_TOKENS: u64 = 60;

struct Outcome {
    tokens: u64,
    usage_tokens: Option<u64>,
    error: bool,
    /// How the stream ended, for a failure's message: `[DONE]` seen, and the transport error
    /// that cut it, if one did.
    done: bool,
    cut: Option<String>,
}

async fn one(
    client: reqwest::Client,
    base: String,
    i: usize,
    started: Arc<AtomicUsize>,
    chat: bool,
) -> Outcome {
    let (path, body) = if chat {
        (
            "/v1/chat/completions",
            json!({
                "model": "mock-model", "messages": [{"role": "user", "content": format!("request {i}: tell me something")}],
                "max_completion_tokens": MAX_TOKENS, "stream": true, "stream_options": {"include_usage": true}
            }),
        )
    } else {
        (
            "/v1/completions",
            json!({
                "model": "mock-model", "prompt": format!("request {i}: tell me something"), "max_tokens": MAX_TOKENS,
                "stream": true, "stream_options": {"include_usage": true}
            }),
        )
    };
    let r = client
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    if status == 502 {
        // Its worker failed before any byte of the answer went on: an error status.
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].is_string(), "request {i}: {v}");
        return Outcome {
            tokens: 0,
            usage_tokens: None,
            error: true,
            done: false,
            cut: None,
        };
    }
    assert_eq!(status, 200, "request {i}");
    let mut s = r.bytes_stream();
    let mut buf = String::new();
    let mut out = Outcome {
        tokens: 0,
        usage_tokens: None,
        error: false,
        done: false,
        cut: None,
    };
    let mut first = true;
    while let Some(chunk) = s.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                out.cut = Some(format!("{e:?}"));
                break;
            }
        };
        if first {
            first = false;
            started.fetch_add(1, Ordering::SeqCst);
        }
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let data = event.trim().trim_start_matches("data:").trim();
            if data == "[DONE]" {
                out.done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if v.get("error").is_some() {
                out.error = true;
            }
            let choice = &v["choices"][0];
            let content = if chat {
                choice["delta"]["content"].as_str()
            } else {
                choice["text"].as_str()
            };
            if content.is_some_and(|t| !t.is_empty()) {
                out.tokens += 1;
            }
            if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
                out.usage_tokens = Some(u);
            }
        }
    }
    out
}

/// How each stream that did not end with exactly `MAX_TOKENS` tokens (and, with `usage`, one
/// final usage saying so) ended: its tokens, usage, in-band error, `[DONE]`, transport error.
fn broken(outcomes: &[Outcome], usage: bool) -> Vec<String> {
    outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| {
            o.error || o.tokens != MAX_TOKENS || (usage && o.usage_tokens != Some(MAX_TOKENS))
        })
        .map(|(i, o)| {
            format!(
                "#{i}: {} tokens, usage {:?}, in-band error {}, [DONE] {}, cut by {:?}",
                o.tokens, o.usage_tokens, o.error, o.done, o.cut
            )
        })
        .collect()
}

/// Prints the run's figures (shown with `--nocapture`).
fn report(name: &str, outcomes: &[Outcome]) {
    let complete = outcomes
        .iter()
        .filter(|o| !o.error && o.tokens == MAX_TOKENS)
        .count();
    let failed = outcomes.iter().filter(|o| o.error).count();
    eprintln!(
        "chaos {name}: sent {}, completed {complete}, failed with an in-band error {failed}",
        outcomes.len()
    );
}

async fn run(migration_limit: &str, chat: bool) -> Vec<Outcome> {
    let mut engines = Vec::new();
    // Engine 1, the one killed, runs 6× slower, so its streams last long enough (about a
    // second in a debug build) to be seen running: a fast engine's 60 tokens took ~0.15 s, and
    // on a loaded machine every stream could end before the kill (nothing left to break).
    for speed in ["3", "0.5", "3", "3"] {
        engines
            .push(common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", speed]).await);
    }
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--router-mode",
        "round-robin",
        "--no-router-kv-events",
    ];
    args.extend([
        "--migration-limit",
        migration_limit,
        "--health-check-interval-secs",
        "0.2",
    ]);
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    let router = common::spawn(&args).await;
    let base = router.http();
    let client = reqwest::Client::new();
    let started = Arc::new(AtomicUsize::new(0));
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tasks = Vec::new();
    for i in 0..REQUESTS {
        let permit = slots.clone().acquire_owned().await.unwrap();
        let (task_client, task_base, task_started) =
            (client.clone(), base.clone(), started.clone());
        tasks.push(tokio::spawn(async move {
            let o = one(task_client, task_base, i, task_started, chat).await;
            drop(permit);
            o
        }));
        // Kill one engine once a good number of streams are under way, some of them on it.
        // The wait is bounded by time, not by polls (a loaded machine starts streams late and
        // answers each poll late); killing before that would test nothing, so it fails instead.
        if i == CONCURRENCY + 8 {
            let engine_metrics = format!("{}/metrics", urls[1]);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
            loop {
                let running = client
                    .get(&engine_metrics)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap()
                    .lines()
                    .filter(|l| l.starts_with("kvrouter_mock_running_requests{"))
                    .find_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .unwrap_or(0.0);
                if running >= 2.0 && started.load(Ordering::SeqCst) >= CONCURRENCY / 2 {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "engine 1 never had 2 streams running with {} started in 90 s",
                    started.load(Ordering::SeqCst)
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            engines[1].child.start_kill().unwrap();
        }
    }
    let mut outcomes = Vec::new();
    let metrics_url = format!("{base}/metrics");
    for t in tasks {
        outcomes.push(
            tokio::time::timeout(Duration::from_secs(120), t)
                .await
                .expect("no request hangs")
                .unwrap(),
        );
    }
    let metrics = client
        .get(metrics_url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let migrated: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvrouter_migrations_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b);
    eprintln!("chaos migration-limit {migration_limit} (chat {chat}): migrated {migrated}");
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_every_stream_completes_exactly() {
    let outcomes = run("3", false).await;
    report("migration-limit 3", &outcomes);
    let broken = broken(&outcomes, false);
    assert!(
        broken.is_empty(),
        "requests without exactly {MAX_TOKENS} tokens: {broken:?}"
    );
    for o in &outcomes {
        assert_eq!(
            o.usage_tokens,
            Some(MAX_TOKENS),
            "one final usage for the whole answer"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_migration_broken_streams_end_cleanly() {
    let outcomes = run("0", false).await;
    report("migration-limit 0", &outcomes);
    let failed = outcomes.iter().filter(|o| o.error).count();
    let complete = outcomes
        .iter()
        .filter(|o| !o.error && o.tokens == MAX_TOKENS)
        .count();
    assert_eq!(
        failed + complete,
        REQUESTS,
        "each request either completes or ends with an error (in-band, or a 502 before any byte)"
    );
    assert!(failed > 0, "the killed engine had streams in flight");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_are_continued_with_the_partial_assistant_message() {
    let outcomes = run("3", true).await;
    report("chat migration-limit 3", &outcomes);
    let broken = broken(&outcomes, true);
    assert!(
        broken.is_empty(),
        "every chat stream completes exactly; these did not: {broken:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_worker_dies_is_re_placed_and_continues() {
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "50"]).await);
    }
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--router-mode",
        "round-robin",
        "--no-router-kv-events",
    ];
    args.extend([
        "--router-session-affinity-ttl-secs",
        "60",
        "--health-check-interval-secs",
        "0.1",
    ]);
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    let router = common::spawn(&args).await;
    let client = reqwest::Client::new();
    let turn = |i: usize| {
        client
            .post(format!("{}/v1/chat/completions", router.http()))
            .header("x-session-id", "agent-7")
            .json(&json!({"model": "mock-model", "max_tokens": 3, "messages": [{"role": "user", "content": format!("turn {i}")}]}))
    };
    let worker = |r: &reqwest::Response| {
        r.headers()["x-kvrouter-worker"]
            .to_str()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    let first = turn(0).send().await.unwrap();
    let bound = worker(&first);
    assert_eq!(worker(&turn(1).send().await.unwrap()), bound);
    engines[bound].child.start_kill().unwrap();
    let moved = turn(2).send().await.unwrap();
    assert_eq!(
        moved.status().as_u16(),
        200,
        "the turn is re-placed on a live worker"
    );
    let new_worker = worker(&moved);
    assert_ne!(new_worker, bound);
    assert_eq!(
        worker(&turn(3).send().await.unwrap()),
        new_worker,
        "and the session sticks there"
    );
}
