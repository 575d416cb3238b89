//! The request path against real engines in this process: a dead worker is retried around before
//! the first byte, and a client that walks away mid-stream releases the worker's load.

use futures::StreamExt;
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::RouterConfig;
use kvrouter_server::{ServeConfig, WorkerEntry};
use serde_json::json;
use std::time::Duration;

mod common;

async fn router(mode: RouterMode, dead_worker: bool) -> common::WithEngines {
    let mut workers = Vec::new();
    if dead_worker {
        // Nothing listens on this port; its details are given so no discovery is needed.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        workers.push(WorkerEntry {
            url: format!("http://{closed}"),
            block_size: Some(64),
            max_num_batched_tokens: Some(8192),
            kv_capacity_blocks: Some(16384),
            ..WorkerEntry::default()
        });
    }
    let config = ServeConfig {
        router: RouterConfig {
            router_mode: mode,
            router_kv_events: false,
            ..RouterConfig::default()
        },
        workers,
        model_names: vec!["mock-model".into()],
        ..ServeConfig::default()
    };
    common::start(config, 1, 50.0).await
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_dead_worker_is_retried_around_before_the_first_byte() {
    let server = router(RouterMode::RoundRobin, true).await;
    let client = reqwest::Client::new();
    let base = format!("http://{}", server.addr);
    for _ in 0..4 {
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "mock-model", "prompt": "hello", "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(
            r.headers()["x-kvrouter-worker"],
            "1",
            "the live worker answered"
        );
    }
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metric(&text, "kvrouter_upstream_retries_total{") >= 2.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "kvrouter_worker_active_requests{worker=\"0\""),
        0.0,
        "failed attempts released their load"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_releases_the_load() {
    let server = router(RouterMode::Kv, false).await;
    let client = reqwest::Client::new();
    let base = format!("http://{}", server.addr);
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": "a long answer please", "max_tokens": 2000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    assert!(body.next().await.is_some());
    let busy = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&busy, "kvrouter_worker_active_requests{worker=\"0\""),
        1.0
    );
    drop(body);
    let mut active = 1.0;
    for _ in 0..200 {
        let text = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        active = metric(&text, "kvrouter_worker_active_requests{worker=\"0\"");
        if active == 0.0 {
            assert!(metric(&text, "kvrouter_requests_total{status=\"cancelled\"") >= 1.0);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(active, 0.0, "the dropped stream released its load");
    server.stop().await;
}
