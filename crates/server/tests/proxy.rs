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

/// The router's `/metrics` text.
async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Sends `body` to `/v1/completions` four times; each is answered 200 by worker 1 (the live
/// one). The answers' bodies.
async fn four_answered_by_the_live_worker(
    client: &reqwest::Client,
    base: &str,
    body: &serde_json::Value,
) -> Vec<String> {
    let mut texts = Vec::new();
    for _ in 0..4 {
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(
            r.headers()["x-kvrouter-worker"],
            "1",
            "the live worker answered"
        );
        texts.push(r.text().await.unwrap());
    }
    texts
}

#[tokio::test]
async fn a_dead_worker_is_retried_around_before_the_first_byte() {
    let server = router(RouterMode::RoundRobin, true).await;
    let client = reqwest::Client::new();
    let base = format!("http://{}", server.addr);
    let body = json!({"model": "mock-model", "prompt": "hello", "max_tokens": 2});
    four_answered_by_the_live_worker(&client, &base, &body).await;
    retried_and_released(&client, &base).await;
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
    let busy = metrics(&client, &base).await;
    assert_eq!(
        metric(&busy, "kvrouter_worker_active_requests{worker=\"0\""),
        1.0
    );
    drop(body);
    let mut active = 1.0;
    for _ in 0..200 {
        let text = metrics(&client, &base).await;
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

/// A stream whose worker fails before its first chunk, while the answer's head is still held,
/// is sent again to another worker (`--retries`), like a worker that fails before its head:
/// the client gets the other worker's whole answer, and the failed attempt's load is released.
#[tokio::test]
async fn a_stream_failing_before_its_first_chunk_is_retried_elsewhere() {
    // Closed after the head; an empty body (a 200 stream that says nothing is no answer).
    for body in [&b""[..], &b"0\r\n\r\n"[..]] {
        retried_elsewhere(body).await;
    }
}

async fn retried_elsewhere(body: &'static [u8]) {
    let mut config = one_worker_at(dying_engine(body).await, "mock-model");
    config.router.router_mode = RouterMode::RoundRobin;
    let server = common::start(config, 1, 50.0).await;
    let client = reqwest::Client::new();
    let base = format!("http://{}", server.addr);
    let body = json!({"model": "mock-model", "prompt": "hello", "max_tokens": 3, "stream": true});
    for text in four_answered_by_the_live_worker(&client, &base, &body).await {
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(!text.contains("\"error\""), "{text}");
    }
    retried_and_released(&client, &base).await;
    server.stop().await;
}

/// Worker 0 failed at least two attempts (round-robin sent half of the four requests there
/// first), each retried elsewhere, and none of them holds load on it.
async fn retried_and_released(client: &reqwest::Client, base: &str) {
    let text = metrics(client, base).await;
    assert!(
        metric(&text, "kvrouter_upstream_retries_total{") >= 2.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "kvrouter_worker_active_requests{worker=\"0\""),
        0.0,
        "failed attempts released their load"
    );
}

/// A router over one worker at `url` whose details are given (no discovery, no KV events, no
/// health checks), serving `model`.
fn one_worker_at(url: String, model: &str) -> ServeConfig {
    ServeConfig {
        router: RouterConfig {
            router_kv_events: false,
            ..RouterConfig::default()
        },
        workers: vec![WorkerEntry {
            url,
            block_size: Some(64),
            max_num_batched_tokens: Some(8192),
            kv_capacity_blocks: Some(16384),
            ..WorkerEntry::default()
        }],
        model_names: vec![model.into()],
        health: kvrouter_server::config::HealthConfig {
            interval: None,
            ..Default::default()
        },
        ..ServeConfig::default()
    }
}

/// A fake engine that answers every request with a streamed 200 head, then `body` (raw chunked
/// bytes), then closes the connection without ending the body.
async fn dying_engine(body: &'static [u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let _ = conn.read(&mut buf).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            transfer-encoding: chunked\r\n\r\n";
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(body).await;
                let _ = conn.flush().await;
            });
        }
    });
    url
}

/// A stream whose worker fails before any byte of its body is answered with an error status
/// (the head is still held: `--stream-head-hold-ms`), not a 200 whose body is one error event;
/// one that fails after a chunk keeps its 200 and ends with the in-band error, as before.
#[tokio::test]
async fn a_stream_failing_before_its_first_byte_is_an_error_status() {
    for (body, early) in [
        (&b""[..], true),
        (
            &b"2a\r\ndata: {\"choices\":[{\"text\":\"a\",\"index\":0}]}\n\n\r\n"[..],
            false,
        ),
        // Cut inside an event: the error event still reads as one (after a blank line).
        (&b"e\r\ndata: {\"choice\r\n"[..], false),
    ] {
        let url = dying_engine(body).await;
        let config = one_worker_at(url, "m");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = kvrouter_server::start(config, listener).await.unwrap();
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", server.addr))
            .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": true}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        if early {
            assert_eq!(status, 502, "{text}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert!(v["error"]["message"].as_str().is_some(), "{v}");
            let m = metrics(&reqwest::Client::new(), &format!("http://{}", server.addr)).await;
            assert_eq!(
                metric(&m, "kvrouter_upstream_retries_total{"),
                0.0,
                "one worker: nothing was re-sent, so no retry is counted: {m}"
            );
        } else {
            assert_eq!(status, 200, "{text}");
            assert!(text.starts_with("data: {\"choice"), "{text}");
            assert!(
                text.contains("\n\ndata: {\"error\""),
                "the in-band error ends it, as an event of its own: {text}"
            );
        }
        // Counted once, as what the client got (the error status, or a stream that failed);
        // never as cancelled: the client did not leave.
        let m = metrics(&reqwest::Client::new(), &format!("http://{}", server.addr)).await;
        let counted = match early {
            true => "upstream_error",
            false => "failed",
        };
        for status in ["upstream_error", "failed", "cancelled"] {
            let key = format!("kvrouter_requests_total{{status=\"{status}\"");
            let n = f64::from(u8::from(status == counted));
            assert_eq!(metric(&m, &key), n, "{status}: {m}");
        }
        server.stop().await;
    }
}

/// A whole answer whose body breaks off is a 502, counted once as `upstream_error` (not also
/// as cancelled by its load guard).
#[tokio::test]
async fn a_whole_answer_that_breaks_off_is_counted_once() {
    let url = dying_engine(b"20\r\n{\"choices\":[{\"text\":\"a\",\"in\r\n").await;
    let config = one_worker_at(url, "m");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = kvrouter_server::start(config, listener).await.unwrap();
    let client = reqwest::Client::new();
    let r = client
        .post(format!("http://{}/v1/completions", server.addr))
        .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let m = metrics(&client, &format!("http://{}", server.addr)).await;
    for (status, n) in [("upstream_error", 1.0), ("cancelled", 0.0), ("failed", 0.0)] {
        let key = format!("kvrouter_requests_total{{status=\"{status}\"");
        assert_eq!(metric(&m, &key), n, "{status}: {m}");
    }
    server.stop().await;
}

/// A stream that breaks off after a chunk and cannot be continued elsewhere (its one worker was
/// tried) ends with the in-band error and is counted once, as failed.
#[tokio::test]
async fn a_stream_whose_migration_fails_is_counted_as_failed() {
    let url =
        dying_engine(b"2a\r\ndata: {\"choices\":[{\"text\":\"a\",\"index\":0}]}\n\n\r\n").await;
    let config = ServeConfig {
        migration_limit: 1,
        ..one_worker_at(url, "m")
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = kvrouter_server::start(config, listener).await.unwrap();
    let client = reqwest::Client::new();
    let text = client
        .post(format!("http://{}/v1/completions", server.addr))
        .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("migration failed"), "{text}");
    let m = metrics(&client, &format!("http://{}", server.addr)).await;
    for (status, n) in [("failed", 1.0), ("cancelled", 0.0), ("upstream_error", 0.0)] {
        let key = format!("kvrouter_requests_total{{status=\"{status}\"");
        assert_eq!(metric(&m, &key), n, "{status}: {m}");
    }
    assert_eq!(metric(&m, "kvrouter_migrations_total"), 1.0, "{m}");
    server.stop().await;
}

/// `parts` as a whole chunked body (its last chunk included), for [`dying_engine`].
fn chunked(parts: &[&str]) -> &'static [u8] {
    let mut body = String::new();
    for part in parts {
        body.push_str(&format!("{:x}\r\n{part}\r\n", part.len()));
    }
    body.push_str("0\r\n\r\n");
    Box::leak(body.into_bytes().into_boxed_slice())
}

/// A passed-through stream framed in CRLF that ends with `[DONE]` is whole: nothing is added
/// and it counts as ok. One that ends cleanly at an event break without `[DONE]` (an engine
/// that stopped early) ends with the in-band error and counts as failed, never silently.
#[tokio::test]
async fn a_passed_through_stream_is_whole_only_with_its_done_in_any_line_ending() {
    let event = "data: {\"choices\":[{\"text\":\"a\",\"index\":0,\"finish_reason\":null}]}";
    let crlf = format!("{event}\r\n\r\n");
    let cases = [
        (chunked(&[&crlf, "data: [DONE]\r\n\r\n"]), "ok"),
        (chunked(&[&crlf, "data: [DO", "NE]\r\n", "\r\n"]), "ok"),
        (chunked(&[&format!("{event}\n\n")]), "failed"),
    ];
    for (body, counted) in cases {
        let url = dying_engine(body).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = kvrouter_server::start(one_worker_at(url, "m"), listener)
            .await
            .unwrap();
        let client = reqwest::Client::new();
        let base = format!("http://{}", server.addr);
        let text = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": true}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let errored = text.contains("{\"error\"");
        assert_eq!(errored, counted == "failed", "{text}");
        if errored {
            assert!(text.contains("without [DONE]"), "{text}");
        } else {
            assert!(text.ends_with("data: [DONE]\r\n\r\n"), "{text}");
        }
        let m = metrics(&client, &base).await;
        let key = format!("kvrouter_requests_total{{status=\"{counted}\"");
        assert_eq!(metric(&m, &key), 1.0, "{counted}: {m}");
        server.stop().await;
    }
}

/// Found by a probe: a worker's 429 reached the client without its `Retry-After` (and its
/// `x-ratelimit-*`), which OpenAI clients read to back off. They are passed on, streamed or not;
/// and the answers counted as `ok`, with a TTFT. They count as the worker's refusal now.
#[tokio::test]
async fn a_workers_retry_after_reaches_the_client() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let _ = conn.read(&mut buf).await;
                let body = "{\"error\":{\"message\":\"slow down\"}}";
                let answer = format!(
                    "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
                     retry-after: 7\r\nx-ratelimit-remaining-requests: 0\r\nserver: x\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = kvrouter_server::start(one_worker_at(url, "m"), listener)
        .await
        .unwrap();
    for stream in [false, true] {
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", server.addr))
            .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 429);
        assert_eq!(r.headers()["retry-after"], "7", "stream: {stream}");
        assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
        assert!(r.headers().get("server").is_none());
        assert!(r.text().await.unwrap().contains("slow down"));
    }
    // Counted as the worker's refusal, not as answers: no TTFT from its error bodies.
    let m = metrics(&reqwest::Client::new(), &format!("http://{}", server.addr)).await;
    for (status, n) in [("rejected", 2.0), ("ok", 0.0)] {
        let key = format!("kvrouter_requests_total{{status=\"{status}\"");
        assert_eq!(metric(&m, &key), n, "{status}: {m}");
    }
    assert_eq!(
        metric(&m, "kvrouter_time_to_first_token_seconds_count"),
        0.0,
        "{m}"
    );
    server.stop().await;
}
