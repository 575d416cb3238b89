//! The client for requests to workers over plain HTTP/1.1: the answer's body is read from the
//! socket by the task that forwards it.
//!
//! With a general client (reqwest over hyper) each connection runs as its own task and hands
//! the body to the forwarding task through a channel, one chunk at a time, each only after the
//! previous one was taken: every chunk of a stream wakes two tasks, often on two threads. Here
//! the forwarding task reads the socket itself (`Direct`), so the chunks already read come out
//! together and a streamed answer costs one wake-up per read of the socket. Idle connections
//! are kept per worker address (at most [`MAX_IDLE_PER_HOST`] each, closed after
//! [`IDLE_TIMEOUT`] unused); one that the worker closed meanwhile is noticed before use, and a
//! request whose reused connection closes before any answer byte is sent once more on a new
//! one. Bounds on what a worker sends: `wire.rs` (64 KiB of response head, 4 KiB chunk-size
//! lines, 64 KiB of trailers; a body is as long as its framing says, as with any client).
//! Workers reached over `https` use reqwest ([`Body::Reqwest`]).

mod wire;

use axum::http::{HeaderValue, StatusCode};
use bytes::{Bytes, BytesMut};
use futures::stream::{BoxStream, Stream, StreamExt};
use std::collections::HashMap;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use wire::{Decoder, Step};

/// Idle connections kept per worker address, at most.
pub(crate) const MAX_IDLE_PER_HOST: usize = 4096;
/// An idle connection unused this long is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Read buffer of an answer, grown by this much when full.
const READ_CHUNK: usize = 16 * 1024;

/// Connections to workers, kept between requests.
#[derive(Debug)]
pub(crate) struct Client {
    idle: Mutex<Idle>,
    connect_timeout: Duration,
}

/// Idle connections by worker address, and when they were last swept for expired ones.
#[derive(Debug)]
struct Idle {
    by_addr: HashMap<Arc<str>, Vec<(TcpStream, Instant)>>,
    swept: Instant,
}

impl Idle {
    /// Every [`IDLE_TIMEOUT`], closes the expired connections of every address (a worker that
    /// left gets no more requests that would find its connections expired).
    fn sweep(&mut self) {
        if self.swept.elapsed() < IDLE_TIMEOUT {
            return;
        }
        self.swept = Instant::now();
        self.by_addr.retain(|_, conns| {
            conns.retain(|(_, since)| since.elapsed() < IDLE_TIMEOUT);
            !conns.is_empty()
        });
    }
}

/// A worker's answer: status, content type, body.
pub(crate) struct Response {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Body,
}

/// An answer's body.
pub(crate) enum Body {
    /// Read from the socket by whoever polls it.
    Direct(Direct),
    /// From reqwest (`https` workers).
    Reqwest(reqwest::Response),
}

impl Response {
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    pub(crate) fn content_type(&self) -> Option<&HeaderValue> {
        self.content_type.as_ref()
    }

    /// Whether the body is read by the task that polls it (no connection task between).
    pub(crate) fn read_here(&self) -> bool {
        matches!(self.body, Body::Direct(_))
    }

    /// The body as chunks.
    pub(crate) fn into_stream(self) -> BoxStream<'static, Result<Bytes, String>> {
        match self.body {
            Body::Direct(d) => d.boxed(),
            Body::Reqwest(r) => r
                .bytes_stream()
                .map(|r| r.map_err(|e| e.to_string()))
                .boxed(),
        }
    }

    /// The whole body.
    pub(crate) async fn bytes(self) -> Result<Bytes, String> {
        match self.body {
            Body::Reqwest(r) => r.bytes().await.map_err(|e| e.to_string()),
            Body::Direct(mut d) => {
                let mut chunks = Vec::new();
                while let Some(chunk) = d.next().await {
                    chunks.push(chunk?);
                }
                Ok(match chunks.len() {
                    1 => chunks.pop().unwrap_or_default(),
                    _ => Bytes::from(chunks.concat()),
                })
            }
        }
    }

    pub(crate) fn from_reqwest(r: reqwest::Response) -> Self {
        Self {
            status: StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
            content_type: r
                .headers()
                .get("content-type")
                .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()),
            body: Body::Reqwest(r),
        }
    }
}

/// Where a request goes: the address to connect to, the `host` header, the request target.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Target {
    addr: Arc<str>,
    host: String,
    path: String,
}

impl Target {
    /// `url` when it is plain `http`; `None` for anything this client does not speak.
    pub(crate) fn of(url: &str) -> Option<Self> {
        let url = reqwest::Url::parse(url).ok()?;
        if url.scheme() != "http" || !url.username().is_empty() || url.password().is_some() {
            return None;
        }
        let host = url.host_str()?;
        let port = url.port_or_known_default()?;
        let host_header = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        };
        let path = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        };
        Some(Self {
            addr: format!("{host}:{port}").into(),
            host: host_header,
            path,
        })
    }
}

impl Client {
    pub(crate) fn new(connect_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            idle: Mutex::new(Idle {
                by_addr: HashMap::new(),
                swept: Instant::now(),
            }),
            connect_timeout,
        })
    }

    /// Sends `body` as a JSON `POST` to `target`; the answer once its head has come. A reused
    /// connection that ends before any byte of an answer (the worker closed it while it was
    /// idle) is replaced by a new one, once.
    pub(crate) async fn send(
        self: &Arc<Self>,
        target: &Target,
        request_id: &HeaderValue,
        body: &Bytes,
    ) -> Result<Response, String> {
        let head = wire::request_head(&target.path, &target.host, request_id, body.len());
        let mut reused_failed = false;
        loop {
            let reused = match reused_failed {
                false => self.checkout(&target.addr),
                true => None,
            };
            let (mut stream, was_reused) = match reused {
                Some(s) => (s, true),
                None => (self.connect(&target.addr).await?, false),
            };
            let mut buf = BytesMut::with_capacity(READ_CHUNK);
            let sent = async {
                write_all2(&mut stream, &head, body)
                    .await
                    .map_err(Failure::Io)?;
                read_head(&mut stream, &mut buf).await
            }
            .await;
            match sent {
                Ok(head) => {
                    let body = Direct {
                        decoder: Decoder::new(head.framing),
                        stream: Some(stream),
                        buf,
                        keep_alive: head.keep_alive,
                        pool: self.clone(),
                        addr: target.addr.clone(),
                    };
                    return Ok(Response {
                        status: StatusCode::from_u16(head.status)
                            .map_err(|_| format!("bad status {}", head.status))?,
                        content_type: head.content_type,
                        body: Body::Direct(body),
                    });
                }
                Err(Failure::Io(_) | Failure::Closed) if was_reused => reused_failed = true,
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    async fn connect(&self, addr: &str) -> Result<TcpStream, String> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(format!("connect to {addr}: {e}")),
                Err(_) => {
                    return Err(format!(
                "connect to {addr}: no connection within {:.3}s (--upstream-connect-timeout-secs)",
                self.connect_timeout.as_secs_f64()
            ))
                }
            };
        // Small writes (a request, then nothing until the answer) must not wait for acks.
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// An idle connection to `addr` still open, if one is kept.
    fn checkout(&self, addr: &str) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let conns = idle.by_addr.get_mut(addr)?;
        while let Some((stream, since)) = conns.pop() {
            if since.elapsed() >= IDLE_TIMEOUT {
                continue;
            }
            // Open and quiet: nothing to read yet. A close (0) or stray bytes: not reusable.
            match stream.try_read(&mut [0u8; 1]) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(stream),
                _ => continue,
            }
        }
        None
    }

    fn checkin(&self, addr: &Arc<str>, stream: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.sweep();
        let conns = idle.by_addr.entry(addr.clone()).or_default();
        conns.retain(|(_, since)| since.elapsed() < IDLE_TIMEOUT);
        if conns.len() < MAX_IDLE_PER_HOST {
            conns.push((stream, Instant::now()));
        }
    }
}

/// Why sending failed.
#[derive(Debug)]
enum Failure {
    Io(std::io::Error),
    Closed,
    Wire(wire::WireError),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Io(e) => write!(f, "{e}"),
            Failure::Closed => write!(f, "connection closed before an answer"),
            Failure::Wire(e) => write!(f, "{e}"),
        }
    }
}

/// Writes `a` then `b` in as few writes as the socket takes.
async fn write_all2(stream: &mut TcpStream, a: &[u8], b: &[u8]) -> std::io::Result<()> {
    let (mut a, mut b) = (a, b);
    while !a.is_empty() || !b.is_empty() {
        let n = stream
            .write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

/// Reads until a response head is in `buf` (consumed; what follows stays).
async fn read_head(stream: &mut TcpStream, buf: &mut BytesMut) -> Result<wire::Head, Failure> {
    loop {
        if let Some(head) = wire::parse_head(buf).map_err(Failure::Wire)? {
            return Ok(head);
        }
        buf.reserve(READ_CHUNK);
        stream.readable().await.map_err(Failure::Io)?;
        match stream.try_read_buf(buf) {
            Ok(0) if buf.is_empty() => return Err(Failure::Closed),
            Ok(0) => return Err(Failure::Wire(wire::WireError::Closed("within the head"))),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(Failure::Io(e)),
        }
    }
}

/// A body read from its connection by whoever polls it; the connection goes back to the
/// client's idle set once the body is whole (if the worker keeps it open).
pub(crate) struct Direct {
    decoder: Decoder,
    stream: Option<TcpStream>,
    buf: BytesMut,
    keep_alive: bool,
    pool: Arc<Client>,
    addr: Arc<str>,
}

impl Direct {
    fn finished(&mut self) {
        if let Some(stream) = self.stream.take() {
            // Bytes past the body (nothing was asked for): the connection is not reusable.
            if self.keep_alive && self.buf.is_empty() {
                self.pool.checkin(&self.addr, stream);
            }
        }
    }
}

impl Stream for Direct {
    type Item = Result<Bytes, String>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            match this.decoder.decode(&mut this.buf) {
                Ok(Step::Data(b)) => return Poll::Ready(Some(Ok(b))),
                Ok(Step::Done) => {
                    this.finished();
                    return Poll::Ready(None);
                }
                Ok(Step::More) => {}
                Err(e) => {
                    this.stream = None;
                    this.decoder = Decoder::new(wire::Framing::Empty);
                    return Poll::Ready(Some(Err(e.to_string())));
                }
            }
            let Some(stream) = this.stream.as_mut() else {
                return Poll::Ready(None);
            };
            if this.buf.capacity() - this.buf.len() < READ_CHUNK / 4 {
                this.buf.reserve(READ_CHUNK);
            }
            match stream.try_read_buf(&mut this.buf) {
                Ok(0) => {
                    this.stream = None;
                    if let Err(e) = this.decoder.closed() {
                        this.decoder = Decoder::new(wire::Framing::Empty);
                        return Poll::Ready(Some(Err(e.to_string())));
                    }
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Err(e) = ready!(stream.poll_read_ready(cx)) {
                        this.stream = None;
                        this.decoder = Decoder::new(wire::Framing::Empty);
                        return Poll::Ready(Some(Err(e.to_string())));
                    }
                }
                Err(e) => {
                    this.stream = None;
                    this.decoder = Decoder::new(wire::Framing::Empty);
                    return Poll::Ready(Some(Err(e.to_string())));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
