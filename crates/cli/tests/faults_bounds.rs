//! Bounds under faults, over real processes and sockets: the index stays within a worker's
//! declared capacity however many blocks its engine claims to store.

mod common;

use bytes::Bytes;
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, WorkerId};
use kvrouter_kv_wire::{encode_payload, from_kv_events};
use std::time::Duration;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BS: usize = 4;

/// One batch (sequence number `seq`) of `chains` fresh chains of `len` blocks each.
fn batch(seq: u64, chains: u32, len: u32) -> ZmqMessage {
    let events: Vec<KvEvent> = (0..chains)
        .map(|c| {
            let chain = seq as u32 * chains + c;
            KvEvent::Stored {
                worker: WorkerId(0),
                dp_rank: 0,
                parent: None,
                blocks: (0..len)
                    .map(|b| StoredBlock {
                        engine_hash: EngineHash(u64::from(chain) << 16 | u64::from(b)),
                        content: BlockContent::Tokens(
                            (0..BS as u32).map(|t| chain * 1000 + b * 10 + t).collect(),
                        ),
                    })
                    .collect(),
                block_size: BS,
                medium: Medium::Gpu,
                namespace: HashNamespace::none(),
            }
        })
        .collect();
    let payload = encode_payload(&from_kv_events(0.0, 0, &events).unwrap());
    let frames = vec![
        Bytes::new(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ];
    ZmqMessage::try_from(frames).unwrap()
}

/// How long a metric may take to reach its value (1000 polls of 10 ms before the common poll).
const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn the_index_stays_at_the_declared_capacity_and_counts_evictions() {
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let dir = std::env::temp_dir().join(format!("kvrouter-bounds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("workers.toml");
    std::fs::write(
        &file,
        format!(
            "[[workers]]\nurl = \"http://127.0.0.1:9\"\nkv_events_endpoint = \"{endpoint}\"\n\
             block_size = {BS}\nkv_capacity_blocks = 64\n"
        ),
    )
    .unwrap();
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--workers-file",
        file.to_str().unwrap(),
        "--model-name",
        "m",
        "--kv-cache-block-size",
        "4",
        "--health-check-interval-secs",
        "0",
    ])
    .await;
    let base = router.http();
    let cached = "kvrouter_worker_cached_blocks{worker=\"0\"";
    // A PUB drops messages until the subscription arrives: re-send batch 0 until it lands.
    let mut landed = false;
    for _ in 0..500 {
        publisher.send(batch(0, 4, 8)).await.unwrap();
        if common::metric(&base, cached).await.unwrap_or(0.0) > 0.0 {
            landed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(landed, "the router never subscribed");
    common::until_metric(&base, cached, 32.0, WAIT).await;
    // 50 more batches of 32 blocks: 1,632 blocks stored, far beyond the 64 declared.
    for seq in 1..=50 {
        publisher.send(batch(seq, 4, 8)).await.unwrap();
    }
    let evictions = "kvrouter_index_evictions_total{worker=\"0\"}";
    common::until_metric(&base, evictions, (51 * 32 - 64) as f64, WAIT).await;
    assert_eq!(common::metric(&base, cached).await.unwrap_or(0.0), 64.0);
    let _ = std::fs::remove_dir_all(&dir);
}

async fn chat(client: &reqwest::Client, base: &str, min_version: u64) -> (u16, serde_json::Value) {
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .header("x-kvrouter-min-policy-version", min_version.to_string())
        .json(&serde_json::json!({
            "model": "mock-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2,
        }))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

#[tokio::test]
async fn an_unsatisfiable_request_fails_within_the_queue_bound_and_a_flood_is_shed() {
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "1",
        "--mock-speedup-ratio",
        "50",
        "--model-name",
        "mock-model",
        "--router-queue-max-wait-secs",
        "3",
        "--router-queue-max-requests",
        "2",
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();
    // No worker will ever serve policy version 99: the request fails once the bound passes.
    let started = std::time::Instant::now();
    let (status, body) = tokio::time::timeout(Duration::from_secs(30), chat(&client, &base, 99))
        .await
        .expect("the request ends instead of hanging");
    assert_eq!(status, 503, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("--router-queue-max-wait-secs"), "{body}");
    assert!(message.contains("policy version"), "{body}");
    assert!(started.elapsed() >= Duration::from_secs(3));
    let shed = "kvrouter_rejections_total{reason=\"max_wait\"}";
    assert_eq!(common::metric(&base, shed).await.unwrap_or(0.0), 1.0);
    // Two wait; a third is beyond --router-queue-max-requests and is shed at once.
    let a = tokio::spawn({
        let (c, b) = (client.clone(), base.clone());
        async move { chat(&c, &b, 99).await }
    });
    let b = tokio::spawn({
        let (c, b) = (client.clone(), base.clone());
        async move { chat(&c, &b, 99).await }
    });
    let pending = "kvrouter_router_queue_pending_requests";
    common::until_metric(&base, pending, 2.0, WAIT).await;
    let (status, body) = chat(&client, &base, 99).await;
    assert_eq!(status, 529, "{body}");
    assert_eq!(a.await.unwrap().0, 503);
    assert_eq!(b.await.unwrap().0, 503);
    // A satisfiable request still goes through.
    assert_eq!(chat(&client, &base, 0).await.0, 200);
}

/// A chat template unlike ChatML.
const TEMPLATE: &str = "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}\
{% if add_generation_prompt %}### assistant:{% endif %}";

#[tokio::test]
async fn embedded_engines_render_with_the_routers_chat_template() {
    let dir = std::env::temp_dir().join(format!("kvrouter-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("template.jinja");
    std::fs::write(&file, TEMPLATE).unwrap();
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--mock-speedup-ratio",
        "50",
        "--model-name",
        "mock-model",
        "--kv-cache-block-size",
        "16",
        "--chat-template",
        file.to_str().unwrap(),
        "--expose-decisions",
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();
    let question: String = (0..200).map(|i| format!("word{i} ")).collect();
    let turn = |messages: serde_json::Value| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let r = client
                .post(format!("{base}/v1/chat/completions"))
                .json(&serde_json::json!({"model": "mock-model", "messages": messages, "max_tokens": 4}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
            let worker: u64 = r.headers()["x-kvrouter-worker"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let decision: serde_json::Value =
                serde_json::from_str(r.headers()["x-kvrouter-decision"].to_str().unwrap()).unwrap();
            (worker, decision)
        }
    };
    let first = vec![serde_json::json!({"role": "user", "content": question})];
    let (w1, _) = turn(serde_json::json!(first)).await;
    let cached = "kvrouter_worker_cached_blocks{";
    // Waits (bounded) for the first turn's KV events; the checks below tell if they never came.
    let _ = common::poll(WAIT, || async {
        common::metric(&base, cached).await.unwrap_or(0.0) > 0.0
    })
    .await;
    let second = serde_json::json!([
        {"role": "user", "content": question},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and then?"},
    ]);
    let (w2, decision) = turn(second).await;
    let chosen = decision["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == w1)
        .unwrap()
        .clone();
    assert!(chosen["overlap"].as_u64().unwrap() > 0, "{decision}");
    assert_eq!(
        w2, w1,
        "the session's second turn follows its cached prefix"
    );
    let mismatches = common::metric(&base, "kvrouter_prompt_token_mismatch_total")
        .await
        .unwrap_or(0.0);
    assert_eq!(mismatches, 0.0, "router and engines count the same prompt");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_engine_rendering_another_template_is_counted_as_a_mismatch() {
    let dir = std::env::temp_dir().join(format!("kvrouter-mismatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("template.jinja");
    std::fs::write(&file, TEMPLATE).unwrap();
    // A separate engine process renders with ChatML; the router with the custom template.
    let engine = common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "50"]).await;
    let url = engine.http();
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--worker",
        &url,
        "--model-name",
        "mock-model",
        "--chat-template",
        file.to_str().unwrap(),
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let r = client
            .post(format!("{base}/v1/chat/completions"))
            .json(&serde_json::json!({
                "model": "mock-model",
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 2,
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let _ = r.bytes().await;
    }
    let name = "kvrouter_prompt_token_mismatch_total{worker=\"0\"}";
    common::until_metric(&base, name, 2.0, WAIT).await;
    let _ = std::fs::remove_dir_all(&dir);
}
