//! A router stopped during a weight update leaves no engine paused, against a fake engine whose
//! pause is slow (found by a probe: the stop's resume was bounded together with its wait for a
//! pause in flight, so a 3 s pause outlasted it and landed after the router had gone).

mod common;

use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const TOKEN: &str = "stop-t0k";

/// What the fake engine was asked (each call as it arrives), and whether it is paused.
#[derive(Default)]
struct Engine {
    calls: Vec<String>,
    paused: bool,
}

/// A mock-compatible engine on 127.0.0.1:0 (one request per connection) whose `/pause` takes
/// `pause_for` and applies even if its caller has gone.
async fn slow_pausing_engine(pause_for: Duration) -> (String, Arc<Mutex<Engine>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let engine = Arc::new(Mutex::new(Engine::default()));
    let state = engine.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let state = state.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 << 10];
                let n = conn.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                let target = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                let path = target.split('?').next().unwrap_or("").to_owned();
                if head.starts_with("POST") {
                    state.lock().unwrap().calls.push(path.clone());
                }
                if path == "/pause" {
                    tokio::time::sleep(pause_for).await;
                }
                let body = {
                    let mut e = state.lock().unwrap();
                    match path.as_str() {
                        "/pause" => e.paused = true,
                        "/resume" => e.paused = false,
                        _ => {}
                    }
                    match path.as_str() {
                        "/v1/models" => json!({"object": "list", "data": [{"id": "m"}]}),
                        "/server_info" => {
                            json!({"engine": "kvrouter-mock-engine", "paused": e.paused})
                        }
                        _ => json!({}),
                    }
                };
                let body = body.to_string();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, engine)
}

#[tokio::test]
async fn a_router_stopped_during_a_slow_pause_resumes_the_engine_after_it() {
    let (url, engine) = slow_pausing_engine(Duration::from_secs(3)).await;
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--worker",
        &url,
        "--model-name",
        "m",
        "--no-router-kv-events",
        "--health-check-interval-secs",
        "0",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let client = reqwest::Client::new();
    let started = client
        .post(format!("{}/admin/policy/update", router.http()))
        .bearer_auth(TOKEN)
        .json(&json!({"version": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status().as_u16(), 202);
    // The idle worker's load begins with its (slow) pause; the router is stopped meanwhile.
    common::until("the pause sent", Duration::from_secs(10), || async {
        engine.lock().unwrap().calls.iter().any(|c| c == "/pause")
    })
    .await;
    router.signal("-TERM");
    common::until(
        "the engine resumed after its pause",
        Duration::from_secs(20),
        || async {
            let e = engine.lock().unwrap();
            let paused_then_resumed = e
                .calls
                .iter()
                .position(|c| c == "/pause")
                .is_some_and(|p| e.calls[p..].iter().any(|c| c == "/resume"));
            paused_then_resumed && !e.paused
        },
    )
    .await;
}
