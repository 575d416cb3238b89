//! End to end: the `kvrouter mock-engine` binary on a free loopback port, driven by a real HTTP
//! client (streaming included) and a real ZeroMQ subscriber and replay client.

use bytes::Bytes;
use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::{WorkerId, WorkerRank};
use kvrouter_core::index::PrefixIndex;
use kvrouter_kv_wire::{decode_payload, decode_seq, to_kv_events, ConvertOptions};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::process::Command;
use tokio::time::timeout;
mod common;

use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const BS: usize = 4;

struct Engine {
    _proc: common::Proc,
    http: String,
    kv: String,
    replay: String,
}

async fn start_engine(extra: &[&str]) -> Engine {
    let mut args = vec![
        "mock-engine",
        "--port",
        "0",
        "--block-size",
        "4",
        "--num-gpu-blocks",
        "64",
    ];
    args.extend([
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
    ]);
    args.extend(["--kv-events-topic", "kv-events", "--speedup-ratio", "100"]);
    args.extend(extra);
    let proc = common::spawn(&args).await;
    Engine {
        http: proc.http(),
        kv: proc.field("kv_events"),
        replay: proc.field("replay"),
        _proc: proc,
    }
}

async fn post(client: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = client.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn serves_openai_requests_and_publishes_kv_events() {
    let engine = start_engine(&[]).await;
    let client = reqwest::Client::new();
    let base = engine.http.clone();

    // Live subscriber; a PUB drops messages until the subscription reaches it, so keep sending
    // small requests (bounded) until one batch arrives.
    let mut sub = SubSocket::new();
    sub.connect(&engine.kv).await.unwrap();
    sub.subscribe("kv-events").await.unwrap();
    let mut live = None;
    for i in 0..50 {
        let prompt = format!("warm up {i} with a prompt long enough for blocks");
        post(
            &client,
            format!("{base}/v1/completions"),
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        if let Ok(Ok(msg)) = timeout(Duration::from_millis(200), sub.recv()).await {
            live = Some(msg);
            break;
        }
    }
    let live = live.expect("a live KV event message");
    let frames = live.into_vec();
    assert_eq!(frames.len(), 3);
    assert_eq!(frames[0].as_ref(), b"kv-events");
    decode_seq(&frames[1]).unwrap();
    let batch = decode_payload(&frames[2]).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    assert!(!batch.events.is_empty());

    // A completion, then the same prompt again: the second is served from the cache.
    let prompt = "The quick brown fox jumps over the lazy dog again and again and again.";
    let (status, first) = post(
        &client,
        format!("{base}/v1/completions"),
        json!({"model": "mock-model", "prompt": prompt, "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty());
    let (_, second) = post(
        &client,
        format!("{base}/v1/completions"),
        json!({"prompt": prompt, "max_tokens": 5}),
    )
    .await;
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(
        cached,
        (prompt_tokens - 1) / BS as u64 * BS as u64,
        "all full blocks but the last token are cached"
    );
    assert_eq!(
        second["choices"][0]["text"], first["choices"][0]["text"],
        "deterministic filler"
    );

    // Token-id prompts as vLLM accepts them.
    let ids: Vec<u32> = (1000..1040).collect();
    let (status, by_ids) = post(
        &client,
        format!("{base}/v1/completions"),
        json!({"prompt": ids, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(by_ids["usage"]["prompt_tokens"], 40);

    // Streaming chat with a usage chunk.
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"].get(0)?["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(
        content.split_whitespace().count(),
        4,
        "four filler words: {content:?}"
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 4);

    // Replay from the start over a DEALER socket: every batch comes back, then the end marker;
    // replayed into the router's index, the prompt above is found.
    let mut dealer = DealerSocket::new();
    dealer.connect(&engine.replay).await.unwrap();
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(request).await.unwrap();
    let mut index = PrefixIndex::new(BS);
    let mut last_seq = None;
    for _ in 0..10_000 {
        let reply = timeout(Duration::from_secs(10), dealer.recv())
            .await
            .expect("replay reply in time")
            .unwrap()
            .into_vec();
        assert_eq!(reply.len(), 4, "[empty, topic, seq, payload]");
        assert!(reply[0].is_empty());
        let seq = decode_seq(&reply[2]).unwrap();
        if seq == u64::MAX {
            assert!(reply[3].is_empty() && reply[1].is_empty());
            break;
        }
        assert_eq!(reply[1].as_ref(), b"kv-events");
        if let Some(prev) = last_seq {
            assert_eq!(seq, prev + 1, "replay is gap-free");
        }
        last_seq = Some(seq);
        let batch = decode_payload(&reply[3]).unwrap();
        for e in to_kv_events(
            &batch,
            ConvertOptions {
                worker: WorkerId(0),
                default_dp_rank: 0,
            },
        ) {
            index.apply(&e.unwrap().unwrap()).unwrap();
        }
    }
    assert_eq!(last_seq.map(|_| ()), Some(()), "replay returned batches");
    let tokens = kvrouter_tokenizer::load(None).unwrap().encode(prompt);
    let seqs = BlockHasher::new(BS, &HashNamespace::none()).sequence_hashes(&tokens);
    let overlap = index
        .find_matches(&seqs)
        .get(WorkerRank::new(WorkerId(0), 0));
    assert_eq!(
        overlap.gpu_blocks as usize,
        seqs.len(),
        "the router sees every full block of the prompt"
    );
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_disconnects_free_the_engine() {
    let engine = start_engine(&[]).await;
    let client = reqwest::Client::new();
    let base = engine.http.clone();
    let (s, e) = post(
        &client,
        format!("{base}/v1/completions"),
        json!({"prompt": "x", "max_tokens": 0}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("max_tokens")));
    let (s, e) = post(
        &client,
        format!("{base}/v1/completions"),
        json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (404, Some("model")));
    let too_long: Vec<u32> = (0..300).collect();
    let (s, e) = post(
        &client,
        format!("{base}/v1/completions"),
        json!({"prompt": too_long}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("prompt")));
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("JSON"));
    // A body past the bound (64 MiB): an OpenAI error too, not axum's plain text.
    let r = client
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(vec![b' '; (64 << 20) + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too large"),
        "{body}"
    );
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "mock-model");

    // A long stream dropped after its first chunk is cancelled in the engine.
    let mut r = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "stream then leave", "max_tokens": 150, "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    drop(r);
    let mut running = f64::NAN;
    for _ in 0..200 {
        let text = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        running = text
            .lines()
            .find(|l| l.starts_with("kvrouter_mock_running_requests{"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap();
        if running == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(running, 0.0, "the abandoned stream was cancelled");
}

#[tokio::test]
async fn invalid_flags_name_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["mock-engine", "--port", "0", "--speedup-ratio", "0"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--speedup-ratio"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["mock-engine", "--port", "0", "--profile", "no-such-profile"])
        .output()
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--profile"));
    // A speed-up that overflowed a step's duration (a panic, then a dead engine that still
    // answered /ready), and a pool that asked for terabytes (an abort).
    for (flag, value) in [
        ("--speedup-ratio", "1e-300"),
        ("--num-gpu-blocks", "100000000000"),
        // 2^32 truncated to 0 in the engine's block arithmetic: its step panicked.
        ("--block-size", "4294967296"),
        ("--weight-load-ms", "1e30"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["mock-engine", "--port", "0", flag, value])
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(flag) && !err.contains("panicked"),
            "{err}"
        );
    }
    for bad in [
        ["--lora", "mock-model"],
        ["--lora", ""],
        ["--served-model-name", ""],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["mock-engine", "--port", "0"])
            .args(bad)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&bad[0].replace("served-model-name", "model-name")),
            "{bad:?}: {err}"
        );
    }
}

#[tokio::test]
async fn pause_resume_and_weight_updates() {
    let engine = start_engine(&["--weight-load-ms", "100"]).await;
    let client = reqwest::Client::new();
    let url = |p: &str| format!("{}{p}", engine.http);
    let prompt: Vec<u32> = (1..=32).collect();
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2});
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let (s, _) = post(&client, url("/v1/completions"), body.clone()).await;
    assert_eq!(s, 200);
    let (_, v) = post(&client, url("/v1/completions"), body.clone()).await;
    assert_eq!(cached(&v), Some(28), "the repeat hits the prefix cache");

    // Paused: a request is accepted but does not run until resumed.
    let (s, v) = post(&client, url("/pause"), json!({})).await;
    assert_eq!((s, v["paused"].as_bool()), (200, Some(true)));
    let info: Value = client
        .get(url("/server_info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["paused"], true);
    let waiting = tokio::spawn({
        let (client, u, body) = (client.clone(), url("/v1/completions"), body.clone());
        async move { post(&client, u, body).await }
    });
    let mut waiting = std::pin::pin!(waiting);
    // At speed-up 100 it would take well under a millisecond.
    assert!(
        timeout(Duration::from_millis(300), &mut waiting)
            .await
            .is_err(),
        "a paused engine does not step"
    );
    let (s, _) = post(&client, url("/resume"), json!({})).await;
    assert_eq!(s, 200);
    let (s, _) = timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(s, 200);

    // New weights: version taken, prefix cache dropped.
    let (s, v) = post(&client, url("/update_weights"), json!({"version": 3})).await;
    assert_eq!((s, v["policy_version"].as_u64()), (200, Some(3)));
    let info: Value = client
        .get(url("/server_info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["policy_version"], 3);
    let (_, v) = post(&client, url("/v1/completions"), body.clone()).await;
    assert_eq!(cached(&v), Some(0), "blocks of the old weights are gone");
    let (s, v) = post(&client, url("/update_weights"), json!({"version": -1})).await;
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("version")));
}
