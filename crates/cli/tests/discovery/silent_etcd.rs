//! `--discovery-call-timeout-ms` with a real socket: an "etcd" on loopback that answers the
//! list but never answers a watch. The router gives up on each watch after the call timeout and
//! sets it up again (counted in `kvrouter_discovery_reconnects_total`).

use super::{common, poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RANGE: &str = r#"{"header":{"revision":"2"},"kvs":[],"count":"0"}"#;

/// Reads one HTTP request's head and body; `None` when the peer closed.
async fn request(conn: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return Some(text[..end].to_owned());
            }
        }
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Serves ranges, and holds every watch without an answer (until the client goes).
async fn serve(conn: TcpStream) {
    let mut conn = conn;
    while let Some(head) = request(&mut conn).await {
        if head.starts_with("POST /v3/kv/range") {
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{RANGE}",
                RANGE.len()
            );
            if conn.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
        } else {
            // A watch: no answer; wait until the client closes.
            let mut sink = [0u8; 1024];
            while matches!(conn.read(&mut sink).await, Ok(n) if n > 0) {}
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_watch_is_given_up_after_the_call_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(serve(conn));
        }
    });
    let spec = format!("etcd://127.0.0.1:{port}");
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--discovery",
        &spec,
        "--discovery-call-timeout-ms",
        "200",
        "--discovery-backoff-max-secs",
        "0.2",
    ])
    .await;
    let base = router.http();
    // With the default (5 s) not one watch would have been given up within this limit.
    poll(
        "two watches given up after the call timeout",
        Duration::from_secs(4),
        || {
            let b = base.clone();
            async move {
                let reconnects = common::metric(&b, "kvrouter_discovery_reconnects_total").await;
                reconnects.unwrap_or(0.0) >= 2.0
            }
        },
    )
    .await;
}
