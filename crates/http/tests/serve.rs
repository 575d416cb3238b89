//! The serve loop on real sockets (127.0.0.1:0, raw HTTP/1.1): a drain lets the request in flight
//! finish while it refuses new work and reports not-ready, then `serve` returns; a silent client
//! connection is closed after the idle timeout; a body the handler leaves unread is drained to
//! keep the connection, or the answer says `Connection: close`.

use axum::routing::{get, post};
use futures::StreamExt;
use kvrouter_http::{serve, HttpLimits, Lifecycle, Phase};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(10);

/// `app` served on a new loopback port with `limits` and `lifecycle`: its address, the sender
/// that stops it (send `true`), and the serve task.
async fn serving(
    app: axum::Router,
    limits: HttpLimits,
    lifecycle: Lifecycle,
) -> (
    std::net::SocketAddr,
    watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let server = tokio::spawn(serve(listener, app, limits, lifecycle, async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    (addr, stop, server)
}

/// Sends one request on a new connection.
async fn send(addr: std::net::SocketAddr, method: &str, path: &str) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!("{method} {path} HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n");
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp
}

/// Reads the response until the server closes the connection.
async fn read_all(mut tcp: TcpStream) -> String {
    let mut out = Vec::new();
    timeout(LIMIT, tcp.read_to_end(&mut out))
        .await
        .expect("the server closes the connection in time")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_drain_finishes_the_request_in_flight_and_refuses_new_work() {
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let app = axum::Router::new()
        .route("/ready", get(|| async { "ready" }))
        .route(
            "/slow",
            post({
                let (started, release) = (started.clone(), release.clone());
                move || async move {
                    started.notify_one();
                    release.notified().await;
                    "done"
                }
            }),
        );
    let lifecycle = Lifecycle::default();
    let (addr, stop, server) = serving(app, HttpLimits::default(), lifecycle.clone()).await;
    let in_flight = send(addr, "POST", "/slow").await;
    timeout(LIMIT, started.notified())
        .await
        .expect("the request started");
    stop.send(true).unwrap();
    for _ in 0..1000 {
        if lifecycle.phase() == Phase::Draining {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(lifecycle.phase(), Phase::Draining);
    let refused = read_all(send(addr, "POST", "/slow").await).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        refused.contains("\"type\":\"service_unavailable\""),
        "{refused}"
    );
    let ready = read_all(send(addr, "GET", "/ready").await).await;
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(ready.contains("draining"), "{ready}");
    release.notify_one();
    let done = read_all(in_flight).await;
    assert!(done.starts_with("HTTP/1.1 200"), "{done}");
    assert!(done.ends_with("done"), "{done}");
    timeout(LIMIT, server)
        .await
        .expect("serve returns once nothing is in flight")
        .unwrap();
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_the_idle_timeout() {
    let limits = HttpLimits {
        idle_timeout: Duration::from_millis(200),
        ..HttpLimits::default()
    };
    let (addr, _stop, _server) = serving(axum::Router::new(), limits, Lifecycle::default()).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    assert_eq!(read_all(tcp).await, "", "closed without a response");
}

#[tokio::test]
async fn a_request_unanswered_at_the_end_of_the_grace_period_gets_an_openai_503() {
    // The answer has not started when the grace period runs out: the client gets a whole 503
    // in the OpenAI shape, not a connection closed without a reply.
    let started = Arc::new(Notify::new());
    let app = axum::Router::new().route(
        "/never",
        post({
            let started = started.clone();
            move || async move {
                started.notify_one();
                std::future::pending::<&'static str>().await
            }
        }),
    );
    let limits = HttpLimits {
        shutdown_grace: Duration::from_millis(200),
        ..HttpLimits::default()
    };
    let (addr, stop, server) = serving(app, limits, Lifecycle::default()).await;
    let in_flight = send(addr, "POST", "/never").await;
    timeout(LIMIT, started.notified())
        .await
        .expect("the request started");
    stop.send(true).unwrap();
    let answer = read_all(in_flight).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    assert_eq!(json["error"]["type"], "service_unavailable", "{json}");
    assert_eq!(json["error"]["code"], 503, "{json}");
    timeout(LIMIT, server)
        .await
        .expect("serve returns after the grace period")
        .unwrap();
}

#[tokio::test]
async fn a_body_that_stalls_is_answered_and_its_connection_closed_after_the_body_timeout() {
    let app = axum::Router::new().route(
        "/echo",
        post(|body: axum::body::Bytes| async move { format!("{} bytes", body.len()) }),
    );
    let limits = HttpLimits {
        body_read_timeout: Duration::from_millis(300),
        ..HttpLimits::default()
    };
    let (addr, _stop, _server) = serving(app, limits, Lifecycle::default()).await;
    // A whole body in time is served.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        b"POST /echo HTTP/1.1\r\nhost: t\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    let whole = read_all(tcp).await;
    assert!(
        whole.starts_with("HTTP/1.1 200") && whole.ends_with("2 bytes"),
        "{whole}"
    );
    // One that stops after its first byte is answered with the reason, and closed.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{")
        .await
        .unwrap();
    let stalled = read_all(tcp).await;
    assert!(stalled.starts_with("HTTP/1.1 400"), "{stalled}");
    assert!(
        stalled.contains("--http-body-read-timeout-secs"),
        "{stalled}"
    );
}

/// Reads one response (head and a `content-length` body) from a kept connection.
async fn read_one(tcp: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut byte = [0u8; 1];
    while !out.ends_with(b"\r\n\r\n") {
        let n = timeout(LIMIT, tcp.read(&mut byte)).await.unwrap().unwrap();
        assert_eq!(n, 1, "the connection ended inside a head: {out:?}");
        out.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&out).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0; length];
    timeout(LIMIT, tcp.read_exact(&mut body))
        .await
        .unwrap()
        .unwrap();
    out.extend_from_slice(&body);
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_body_left_unread_is_drained_to_keep_the_connection_or_the_answer_says_close() {
    let app = axum::Router::new()
        .route(
            "/echo",
            post(|body: axum::body::Bytes| async move { format!("{} bytes", body.len()) }),
        )
        .route("/ignore", post(|| async { "not read" }));
    let (addr, _stop, _server) = serving(app, HttpLimits::default(), Lifecycle::default()).await;
    let post = |path: &str, n: usize| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {n}\r\n\r\n{}",
            "x".repeat(n)
        )
    };
    let kept = |answer: &str| !answer.to_lowercase().contains("connection: close");
    // Bodies read whole, and small ones left unread (drained by the serve loop), keep the
    // connection; the head and the body may come in two writes, as Python's http.client sends
    // them.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    for path in ["/echo", "/ignore", "/ignore", "/echo"] {
        let request = post(path, 100);
        let (head, body) = request.split_at(request.len() - 100);
        tcp.write_all(head.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        tcp.write_all(body.as_bytes()).await.unwrap();
        let answer = read_one(&mut tcp).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && kept(&answer),
            "{path}: {answer}"
        );
    }
    // Bodiless requests keep it too.
    tcp.write_all(b"POST /ignore HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    assert!(kept(&read_one(&mut tcp).await));
    // A body past the drain's bound, or one that stops arriving, is not waited for: the answer
    // says the connection closes, and it does.
    let mut big = TcpStream::connect(addr).await.unwrap();
    big.write_all(post("/ignore", 100_000).as_bytes())
        .await
        .unwrap();
    let answer = read_one(&mut big).await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && !kept(&answer),
        "{answer}"
    );
    assert_eq!(
        read_all(big).await,
        "",
        "nothing after the answer, then the close"
    );
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(b"POST /ignore HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\nxx")
        .await
        .unwrap();
    let answer = read_one(&mut stalled).await;
    assert!(!kept(&answer), "{answer}");
    assert_eq!(read_all(stalled).await, "");
    // A client waiting for `100 Continue` is not asked for the body: the answer comes at once,
    // closing.
    let mut expects = TcpStream::connect(addr).await.unwrap();
    expects
        .write_all(b"POST /ignore HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 10\r\n\r\n")
        .await
        .unwrap();
    let answer = read_one(&mut expects).await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && !kept(&answer),
        "{answer}"
    );
    // A body whose framing is broken: the handler's error answer says the connection closes.
    let mut broken = TcpStream::connect(addr).await.unwrap();
    broken
        .write_all(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
        .await
        .unwrap();
    let answer = read_one(&mut broken).await;
    assert!(
        !answer.starts_with("HTTP/1.1 200") && !kept(&answer),
        "{answer}"
    );
}

/// A client that stops reading a long answer: once the socket's buffers are full the server's
/// writes wait, and after the write timeout the connection is closed and the answer dropped
/// (ending its request). Without the timeout it would wait for TCP to give up, for minutes.
#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_write_timeout() {
    /// Notifies when the answer's body is dropped.
    struct Dropped(Arc<Notify>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.notify_one();
        }
    }
    let dropped = Arc::new(Notify::new());
    let app = axum::Router::new().route(
        "/endless",
        get({
            let dropped = dropped.clone();
            move || async move {
                let guard = Dropped(dropped);
                let chunk = axum::body::Bytes::from(vec![b'x'; 64 * 1024]);
                // Bounded: 1 GiB, far more than the socket buffers hold.
                let chunks = futures::stream::iter(0..16_384).map(move |_| {
                    let _held = &guard;
                    Ok::<_, std::convert::Infallible>(chunk.clone())
                });
                axum::body::Body::from_stream(chunks)
            }
        }),
    );
    let limits = HttpLimits {
        write_timeout: Duration::from_millis(300),
        header_read_timeout: Duration::from_millis(200),
        ..HttpLimits::default()
    };
    let (addr, _stop, _server) = serving(app, limits, Lifecycle::default()).await;
    // Sends the request and never reads.
    let _silent = send(addr, "GET", "/endless").await;
    timeout(LIMIT, dropped.notified())
        .await
        .expect("the answer is dropped after the write timeout");
}
