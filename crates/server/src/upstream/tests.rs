use super::*;
use futures::StreamExt;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// What a scripted worker does with one request on a connection.
#[derive(Clone, Copy)]
enum Act {
    /// Answers with these bytes and keeps the connection.
    Answer(&'static str),
    /// Answers, then closes.
    AnswerClose(&'static str),
    /// Reads the request and closes without answering.
    Drop,
    /// Closes with a reset once the request arrives, without reading it (as a worker closing
    /// an idle connection just as the request came).
    Reset,
}

/// A worker on 127.0.0.1:0 that plays `script[i]` on its i-th connection (one act per
/// request); it reports each connection it accepts and each request it reads.
async fn worker(script: Vec<Vec<Act>>) -> (String, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        for (n, acts) in script.into_iter().enumerate() {
            let (mut s, _) = listener.accept().await.unwrap();
            tx.send(format!("conn {n}")).unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                for act in acts {
                    if let Act::Reset = act {
                        let _ = s.readable().await;
                        let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                        return;
                    }
                    let Some(req) = read_request(&mut s).await else {
                        return;
                    };
                    tx.send(req).unwrap();
                    match act {
                        Act::Answer(a) => s.write_all(a.as_bytes()).await.unwrap(),
                        Act::AnswerClose(a) => {
                            s.write_all(a.as_bytes()).await.unwrap();
                            return;
                        }
                        Act::Drop | Act::Reset => return,
                    }
                }
                // Keeps the connection open until the client closes it.
                let _ = s.read(&mut [0u8; 1]).await;
            });
        }
    });
    (base, rx)
}

/// One request (head and its content-length body) as text.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = req.parse(&buf) {
            let cl: usize = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                .unwrap_or(0);
            if buf.len() >= len + cl {
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

const OK: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";

async fn send(client: &Arc<Client>, base: &str, body: &'static str) -> Result<Response, String> {
    let target = Target::of(&format!("{base}/v1/completions")).unwrap();
    client
        .send(
            &target,
            &HeaderValue::from_static("rid-1"),
            &Bytes::from(body),
        )
        .await
}

/// One whole exchange: the answer's body.
async fn exchange(client: &Arc<Client>, base: &str) -> Result<Bytes, String> {
    send(client, base, "{}").await?.bytes().await
}

#[tokio::test]
async fn a_kept_connection_carries_the_next_request() {
    let (base, mut seen) = worker(vec![vec![Act::Answer(OK), Act::Answer(OK)]]).await;
    let client = Client::new(Duration::from_secs(5), false);
    for _ in 0..2 {
        let r = send(&client, &base, "{\"a\":1}").await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.content_type().unwrap(), "application/json");
        assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
    }
    assert_eq!(seen.recv().await.unwrap(), "conn 0");
    let req = seen.recv().await.unwrap();
    assert!(
        req.starts_with("POST /v1/completions HTTP/1.1\r\n"),
        "{req}"
    );
    assert!(req.ends_with("\r\n\r\n{\"a\":1}"), "{req}");
    assert!(req.contains("rid-1"));
    // The second request came on the same connection.
    assert!(seen.recv().await.unwrap().starts_with("POST"));
}

#[tokio::test]
async fn a_connection_the_worker_closed_is_not_reused() {
    let (base, mut seen) = worker(vec![vec![Act::AnswerClose(OK)], vec![Act::Answer(OK)]]).await;
    let client = Client::new(Duration::from_secs(5), false);
    let r = send(&client, &base, "{}").await.unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
    assert_eq!(seen.recv().await.unwrap(), "conn 0");
    seen.recv().await.unwrap();
    let r = send(&client, &base, "{}").await.unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
    assert_eq!(seen.recv().await.unwrap(), "conn 1");
}

#[tokio::test]
async fn a_request_written_to_a_kept_connection_is_not_sent_twice() {
    // The kept connection reads the second request and closes without answering: the worker
    // may have run it, so it fails (the attempt retries elsewhere, counting the failure).
    let (base, mut seen) = worker(vec![
        vec![Act::Answer(OK), Act::Drop],
        vec![Act::Answer(OK)],
    ])
    .await;
    let client = Client::new(Duration::from_secs(5), false);
    exchange(&client, &base).await.unwrap();
    let err = send(&client, &base, "{}").await.err().unwrap();
    assert!(err.contains("closed before an answer"), "{err}");
    let events: Vec<String> = std::iter::from_fn(|| seen.try_recv().ok()).collect();
    let conns = events.iter().filter(|e| e.starts_with("conn")).count();
    let requests = events.iter().filter(|e| e.starts_with("POST")).count();
    assert_eq!((conns, requests), (1, 2), "{events:?}");
}

#[tokio::test]
async fn only_whole_answers_on_open_connections_are_kept() {
    let client = Client::new(Duration::from_secs(5), false);
    let cases: [(&'static str, usize); 5] = [
        (OK, 1),
        (
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}",
            0,
        ),
        ("HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}", 0),
        (
            "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\n{}",
            1,
        ),
        // Bytes past the answer: the connection is out of step.
        ("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}extra", 0),
    ];
    for (answer, kept) in cases {
        let (base, _seen) = worker(vec![vec![Act::Answer(answer)]]).await;
        let r = send(&client, &base, "{}").await.unwrap();
        assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
        let addr = base.trim_start_matches("http://");
        assert_eq!(client.pool.idle(addr), kept, "{answer:?}");
    }
    // A 100 Continue before the answer changes nothing.
    let (base, _seen) = worker(vec![vec![Act::Answer(
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
    )]])
    .await;
    let r = send(&client, &base, "{}").await.unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
    assert_eq!(client.pool.idle(base.trim_start_matches("http://")), 1);
    // A redirect is not followed: it fails the attempt.
    let moved = "HTTP/1.1 307 Temporary Redirect\r\nlocation: /x\r\ncontent-length: 0\r\n\r\n";
    let (base, _seen) = worker(vec![vec![Act::Answer(moved)]]).await;
    let err = send(&client, &base, "{}").await.err().unwrap();
    assert!(err.contains("307"), "{err}");
}

#[tokio::test]
async fn a_chunked_stream_comes_out_whole_and_its_connection_is_kept() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (go_tx, mut go_rx) = mpsc::unbounded_channel::<&'static str>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        read_request(&mut s).await.unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            .await
            .unwrap();
        // Each piece is written when the test says so (split anywhere, even in a size line).
        while let Some(piece) = go_rx.recv().await {
            s.write_all(piece.as_bytes()).await.unwrap();
        }
        // Then a second request on the same connection.
        read_request(&mut s).await.unwrap();
        s.write_all(OK.as_bytes()).await.unwrap();
        let _ = s.read(&mut [0u8; 1]).await;
    });
    let client = Client::new(Duration::from_secs(5), false);
    let r = send(&client, &base, "{}").await.unwrap();
    assert_eq!(r.content_type().unwrap(), "text/event-stream");
    let mut body = r.into_stream();
    // Each piece, and the body bytes it completes (split anywhere, even in a size line).
    let pieces = [
        ("6\r\ndata: ", "data: "),
        ("\r\n", ""),
        ("3\r\na\n\n\r\n", "a\n\n"),
        ("e", ""),
        ("\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", "data: [DONE]\n\n"),
    ];
    for (piece, out) in pieces {
        go_tx.send(piece).unwrap();
        let mut got = Vec::new();
        while got.len() < out.len() {
            let next = tokio::time::timeout(Duration::from_secs(10), body.next());
            got.extend_from_slice(&next.await.expect("the piece's bytes").unwrap().unwrap());
        }
        assert_eq!(String::from_utf8(got).unwrap(), out);
    }
    assert!(body.next().await.is_none());
    drop(go_tx);
    // The stream ended: the connection is back and answers the next request.
    assert_eq!(client.pool.idle(base.trim_start_matches("http://")), 1);
    let next = tokio::time::timeout(Duration::from_secs(10), send(&client, &base, "{}"));
    let r = next
        .await
        .expect("answered on the kept connection")
        .unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
}

#[tokio::test]
async fn a_broken_body_is_an_error_and_its_connection_is_not_kept() {
    // Cut short by a close.
    let short = "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc";
    let (base, _seen) = worker(vec![vec![Act::AnswerClose(short)]]).await;
    let client = Client::new(Duration::from_secs(5), false);
    let err = exchange(&client, &base).await.err().unwrap();
    assert!(err.contains("before the end of the body"), "{err}");
    // Malformed framing on a connection the worker keeps open: not kept here, and the next
    // request goes on a new connection.
    let broken = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n";
    let (base, mut seen) = worker(vec![vec![Act::Answer(broken)], vec![Act::Answer(OK)]]).await;
    let err = exchange(&client, &base).await.err().unwrap();
    assert!(err.contains("chunk"), "{err}");
    assert_eq!(client.pool.idle(base.trim_start_matches("http://")), 0);
    assert_eq!(&exchange(&client, &base).await.unwrap()[..], b"{}");
    let conns = std::iter::from_fn(|| seen.try_recv().ok())
        .filter(|e| e.starts_with("conn"))
        .count();
    assert_eq!(conns, 2);
    // A body framed by the close is whole when the connection closes.
    let (base, _seen) = worker(vec![vec![Act::AnswerClose(
        "HTTP/1.1 200 OK\r\n\r\nall of it",
    )]])
    .await;
    let body = send(&client, &base, "{}")
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(&body[..], b"all of it");
}

#[tokio::test]
async fn nothing_listening_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let client = Client::new(Duration::from_secs(5), false);
    let err = send(&client, &base, "{}").await.err().unwrap();
    assert!(err.starts_with("connect to 127.0.0.1:"), "{err}");
}

#[test]
fn targets_are_plain_http_urls() {
    let t = Target::of("http://h.example:8000/v1/completions?a=b").unwrap();
    assert_eq!(&*t.addr, "h.example:8000");
    assert_eq!(t.host, "h.example:8000");
    assert_eq!(t.path, "/v1/completions?a=b");
    let t = Target::of("http://[::1]/x").unwrap();
    assert_eq!((&*t.addr, t.host.as_str()), ("[::1]:80", "[::1]"));
    assert!(Target::of("https://h/x").is_none());
    assert!(Target::of("http://user:pw@h/x").is_none());
    assert!(Target::of("not a url").is_none());
}

#[test]
fn a_url_is_read_once_and_the_cache_is_bounded() {
    let targets = Targets::default();
    let a = targets.of("http://h:1/v1/completions").unwrap();
    let again = targets.of("http://h:1/v1/completions").unwrap();
    assert!(
        Arc::ptr_eq(&a, &again),
        "the second request reuses the first reading"
    );
    assert_eq!(*a, Target::of("http://h:1/v1/completions").unwrap());
    assert!(
        targets.of("https://h/x").is_none(),
        "refusals are remembered as refusals"
    );
    assert!(targets.of("https://h/x").is_none());
    for i in 0..MAX_TARGETS + 10 {
        targets.of(&format!("http://h:1/{i}"));
    }
    assert!(targets.0.read().unwrap().len() <= MAX_TARGETS);
    let fresh = targets.of("http://h:1/v1/completions").unwrap();
    assert_eq!(*fresh, *a);
}

#[tokio::test]
async fn sweeps_close_expired_connections_and_ones_the_worker_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let pool = Arc::new(pool::Pool::default());
    let mut served = Vec::new();
    for key in ["a:1", "b:1", "c:1"] {
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        pool.checkin(&Arc::from(key), client.unwrap());
        served.push(server.unwrap().0);
    }
    // The worker closes c's connection; the close is seen once the runtime reports it.
    drop(served.pop());
    let now = Instant::now();
    for _ in 0..10_000 {
        pool.sweep(now);
        if pool.idle("c:1") == 0 {
            break;
        }
        // A turn of the runtime, whose driver reports the close.
        tokio::task::yield_now().await;
    }
    assert_eq!(
        (pool.idle("a:1"), pool.idle("b:1"), pool.idle("c:1")),
        (1, 1, 0)
    );
    // Unused for the timeout: all closed.
    pool.sweep(now + pool::IDLE_TIMEOUT + Duration::from_secs(1));
    assert_eq!((pool.idle("a:1"), pool.idle("b:1")), (0, 0));
}

#[tokio::test]
async fn a_408_on_a_kept_connection_is_sent_again_on_a_new_one() {
    let timed_out =
        "HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
    let (base, mut seen) = worker(vec![
        vec![Act::Answer(OK), Act::AnswerClose(timed_out)],
        vec![Act::Answer(OK)],
    ])
    .await;
    let client = Client::new(Duration::from_secs(5), false);
    assert_eq!(&exchange(&client, &base).await.unwrap()[..], b"{}");
    assert_eq!(&exchange(&client, &base).await.unwrap()[..], b"{}");
    let conns = std::iter::from_fn(|| seen.try_recv().ok())
        .filter(|e| e.starts_with("conn"))
        .count();
    assert_eq!(conns, 2);
    // On a new connection a 408 is the worker's answer.
    let (base, _seen) = worker(vec![vec![Act::AnswerClose(timed_out)]]).await;
    let r = send(&client, &base, "{}").await.unwrap();
    assert_eq!(r.status(), StatusCode::REQUEST_TIMEOUT);
}

/// Waiting for a body's first chunk keeps it (it comes first, once); a wait that ends before
/// the chunk loses nothing; a body that breaks first is an error; an empty body ends.
#[tokio::test]
async fn the_first_chunk_waited_for_is_kept_and_a_broken_one_is_an_error() {
    // Each answer closes its connection, so each request comes on a new one.
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (go_tx, mut go_rx) = mpsc::unbounded_channel::<&'static str>();
    tokio::spawn(async move {
        // 1: a chunk, later a second one and the end; 2: the head only, then a close;
        // 3: an empty body.
        let (mut s, _) = listener.accept().await.unwrap();
        read_request(&mut s).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        while let Some(piece) = go_rx.recv().await {
            s.write_all(piece.as_bytes()).await.unwrap();
        }
        let (mut s, _) = listener.accept().await.unwrap();
        read_request(&mut s).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        drop(s);
        let (mut s, _) = listener.accept().await.unwrap();
        read_request(&mut s).await.unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
    });
    let client = Client::new(Duration::from_secs(5), false);
    let mut r = send(&client, &base, "{}").await.unwrap();
    // Nothing yet: the wait ends, nothing is lost.
    r.first_chunk(Duration::from_millis(20)).await.unwrap();
    assert!(matches!(r.first(), response::First::NotYet));
    assert!(r.waited() >= Duration::from_millis(20));
    go_tx.send("2\r\nab\r\n").unwrap();
    r.first_chunk(Duration::from_secs(5)).await.unwrap();
    assert!(matches!(r.first(), response::First::Chunk(c) if &c[..] == b"ab"));
    go_tx.send("2\r\ncd\r\n0\r\n\r\n").unwrap();
    drop(go_tx);
    let body: Vec<Bytes> = r.into_stream().map(Result::unwrap).collect().await;
    assert_eq!(body.concat(), b"abcd", "the kept chunk first, once");
    // The head, then a close before any chunk: an error.
    let mut r = send(&client, &base, "{}").await.unwrap();
    assert!(r.first_chunk(Duration::from_secs(5)).await.is_err());
    // An empty body ends: whole, it is empty.
    let mut r = send(&client, &base, "{}").await.unwrap();
    r.first_chunk(Duration::from_secs(5)).await.unwrap();
    assert!(matches!(r.first(), response::First::Ended));
    assert!(r.bytes().await.unwrap().is_empty());
}

/// Found by a probe: a whole answer was read however large the worker made it (a 250 MB body
/// took the router to 1.3 GB). Past its bound the read fails, whatever the framing.
#[tokio::test]
async fn a_whole_answer_past_its_bound_fails_the_read() {
    const LONG: &str =
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 41\r\n\r\n\
                        {\"choices\":[{\"text\":\"0123456789abcdef\"}]}";
    const CHUNKED: &str = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                           13\r\n{\"choices\":[{\"text\"\r\n13\r\n:\"0123456789abcdef\"\r\n3\r\n}]}\r\n0\r\n\r\n";
    for answer in [LONG, CHUNKED] {
        let script = vec![vec![Act::Answer(answer)], vec![Act::Answer(answer)]];
        let (base, _seen) = worker(script).await;
        let client = Client::new(Duration::from_secs(5), false);
        let r = send(&client, &base, "{}").await.unwrap();
        let e = r.bytes_within(40).await.unwrap_err();
        assert!(e.contains("larger than 40 bytes"), "{e}");
        let r = send(&client, &base, "{}").await.unwrap();
        assert_eq!(r.bytes_within(41).await.unwrap().len(), 41, "{answer}");
    }
}

/// Found by a probe: a worker that closed a kept connection just as the next request came got
/// that request a 502 (on a one-worker fleet). A reset before any byte of an answer means the
/// worker closed with the request unread: it is sent again on a new connection.
#[tokio::test]
async fn a_kept_connection_reset_before_its_answer_is_sent_again_on_a_new_one() {
    let (base, mut seen) = worker(vec![
        vec![Act::Answer(OK), Act::Reset],
        vec![Act::Answer(OK)],
    ])
    .await;
    let client = Client::new(Duration::from_secs(5), false);
    exchange(&client, &base).await.unwrap();
    assert_eq!(&exchange(&client, &base).await.unwrap()[..], b"{}");
    let events: Vec<String> = std::iter::from_fn(|| seen.try_recv().ok()).collect();
    let conns = events.iter().filter(|e| e.starts_with("conn")).count();
    let requests = events.iter().filter(|e| e.starts_with("POST")).count();
    assert_eq!((conns, requests), (2, 2), "{events:?}");
}
