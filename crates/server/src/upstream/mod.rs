//! The client for requests to workers over plain HTTP/1.1: the answer's body is read from the
//! socket by the task that forwards it.
//!
//! With a general client (reqwest over hyper) each connection runs as its own task and hands
//! the body to the forwarding task through a channel, one chunk at a time, each only after the
//! previous one was taken: every chunk of a stream wakes two tasks, often on two threads. Here
//! the forwarding task reads the socket itself (`Direct`), so the chunks already read come out
//! together and a streamed answer costs one wake-up per read of the socket.
//!
//! Connections are kept per worker address (`pool.rs`: closed after 4 s idle, before the
//! workers' own 5 s keep-alive ends them, and peeked at before reuse). A request is sent again,
//! once, on a new connection only when writing it to a kept connection failed, the worker
//! answered 408 on a kept one (it timed the connection out as idle), or reset a kept one before
//! any byte of an answer (it closed it with the request unread): in each case it did not run
//! it. A kept connection closed cleanly after the request was read is not resent. Any other failure after the request was written is the attempt's
//! (`request/attempt.rs` counts it against the worker and retries elsewhere). A worker that
//! answers before reading the whole request and closes is answered with what it sent, if that
//! comes within 100 ms of the failed write. A redirect is not followed: it fails the attempt.
//! Bounds on what a worker sends: `wire.rs` (64 KiB of response head, 4 KiB chunk-size lines,
//! 64 KiB of trailers). Workers reached over `https`, and every worker when a proxy is set in
//! the environment (`HTTP_PROXY`, `ALL_PROXY`, lower case too), go through reqwest
//! (`response.rs`, its reqwest body), which then follows no redirect either. The answer and its
//! kept first chunk are `response.rs`'s.

mod pool;
mod response;
mod wire;

pub(crate) use response::Response;
pub(crate) use wire::decimal_length;

use axum::http::{HeaderValue, StatusCode};
use bytes::{Bytes, BytesMut};
use futures::stream::Stream;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use wire::{Decoder, Step};

/// Read buffer of an answer, grown by this much when full.
const READ_CHUNK: usize = 16 * 1024;
/// After a failed write, how long an answer the worker already sent may take to be read.
const EARLY_ANSWER_WAIT: Duration = Duration::from_millis(100);

/// Connections to workers, kept between requests.
#[derive(Debug)]
pub(crate) struct Client {
    pool: Arc<pool::Pool>,
    connect_timeout: Duration,
    /// A proxy is set in the environment: reqwest (which honours it) sends everything.
    proxied: bool,
    /// For workers this client does not speak to itself: follows no redirect either.
    fallback: reqwest::Client,
    /// Each worker URL read once ([`Targets`]).
    targets: Targets,
    /// `Bearer <--worker-api-key>`, sent with every request.
    authorization: Option<HeaderValue>,
}

/// The largest number of URLs [`Targets`] holds (about 200 bytes each); a full cache starts
/// over. A worker is sent to at a handful of URLs (one per endpoint), so this holds a fleet of
/// a few thousand workers and fills only as workers come and go.
const MAX_TARGETS: usize = 16_384;

/// Worker URLs already read, with what [`Target::of`] made of them (parsing a URL costs about
/// 2 µs, a request's 2 % of router CPU in the non-streamed realistic case).
#[derive(Debug, Default)]
struct Targets(std::sync::RwLock<std::collections::HashMap<Box<str>, Option<Arc<Target>>>>);

impl Targets {
    fn of(&self, url: &str) -> Option<Arc<Target>> {
        if let Some(t) = self.0.read().expect("targets lock").get(url) {
            return t.clone();
        }
        let target = Target::of(url).map(Arc::new);
        let mut held = self.0.write().expect("targets lock");
        if held.len() >= MAX_TARGETS {
            held.clear();
        }
        held.insert(url.into(), target.clone());
        target
    }
}

/// The default headers of a reqwest client that talks to workers: `authorization` (a
/// [`bearer`] value, marked sensitive) when the workers want a key.
pub(crate) fn authorization_headers(
    authorization: Option<&HeaderValue>,
) -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(value) = authorization {
        headers.insert(reqwest::header::AUTHORIZATION, value.clone());
    }
    headers
}

/// `Bearer <key>` as a header value, marked sensitive (no log or debug print shows it); `None`
/// without a key. A key that cannot be a header value is refused when the flags are read.
pub(crate) fn bearer(key: Option<&str>) -> Option<HeaderValue> {
    let mut value = HeaderValue::from_str(&format!("Bearer {}", key?)).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// A redirect fails the attempt: a worker that redirects is misconfigured, and following one
/// would turn the POST into a GET.
fn refuse_redirect(status: u16) -> Result<(), String> {
    match (300..400).contains(&status) && status != 304 {
        true => Err(format!("answered {status} (a redirect, not followed)")),
        false => Ok(()),
    }
}

/// Where a request goes: the address to connect to, the `host` header, the request target.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    addr: Arc<str>,
    host: String,
    path: String,
}

impl Target {
    /// `url` when it is plain `http`; `None` for anything this client does not speak.
    fn of(url: &str) -> Option<Self> {
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
    /// `proxied`: a proxy is set in the environment ([`proxy_in_environment`]).
    #[cfg(test)]
    pub(crate) fn new(connect_timeout: Duration, proxied: bool) -> Arc<Self> {
        Self::with_authorization(connect_timeout, proxied, None)
    }

    /// A client sending `authorization` (a worker key's `Bearer ...` value) with every
    /// request.
    pub(crate) fn with_authorization(
        connect_timeout: Duration,
        proxied: bool,
        authorization: Option<HeaderValue>,
    ) -> Arc<Self> {
        let fallback = reqwest::Client::builder()
            .default_headers(authorization_headers(authorization.as_ref()))
            .tcp_nodelay(true)
            .pool_max_idle_per_host(pool::MAX_IDLE_PER_HOST)
            .connect_timeout(connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("HTTP client");
        Arc::new(Self {
            pool: Arc::default(),
            connect_timeout,
            proxied,
            fallback,
            targets: Targets::default(),
            authorization,
        })
    }

    /// Sends `body` as a JSON `POST` to `url`: itself when `url` is plain `http` and no proxy
    /// is set, else through reqwest; the answer once its head has come.
    pub(crate) async fn post(
        self: &Arc<Self>,
        url: &str,
        request_id: &HeaderValue,
        body: &Bytes,
    ) -> Result<Response, String> {
        if let Some(target) = self.target(url) {
            return self.send(&target, request_id, body).await;
        }
        let answer = self
            .fallback
            .post(url)
            .header("content-type", "application/json")
            .header(crate::access::REQUEST_ID_HEADER, request_id.clone())
            .body(body.clone())
            .send()
            .await
            .map_err(|e| e.to_string())?;
        refuse_redirect(answer.status().as_u16())?;
        Ok(Response::from_reqwest(answer))
    }

    /// Where to send `url` with this client; `None` when reqwest must (https, a proxy).
    fn target(&self, url: &str) -> Option<Arc<Target>> {
        match self.proxied {
            true => None,
            false => self.targets.of(url),
        }
    }

    /// Sends `body` as a JSON `POST` to `target`; the answer once its head has come.
    async fn send(
        self: &Arc<Self>,
        target: &Target,
        request_id: &HeaderValue,
        body: &Bytes,
    ) -> Result<Response, String> {
        let request = wire::request_head(
            &target.path,
            &target.host,
            request_id,
            self.authorization.as_ref(),
            body.len(),
        );
        let mut kept = self.pool.checkout(&target.addr);
        loop {
            let reused = kept.is_some();
            let mut stream = match kept.take() {
                Some(s) => s,
                None => self.connect(&target.addr).await?,
            };
            let mut buf = BytesMut::with_capacity(READ_CHUNK);
            let answer = match write_all2(&mut stream, &request, body).await {
                Ok(()) => match read_head(&mut stream, &mut buf).await {
                    // Reset before any byte of an answer: the worker closed the kept
                    // connection with the request unread (a close with unread data is a
                    // reset), so it did not run it.
                    Err(e) if reused && e == RESET_BEFORE_ANSWER => {
                        tracing::debug!(addr = %target.addr, "kept connection reset; sending on a new one");
                        continue;
                    }
                    head => head,
                },
                Err(e) => {
                    // An answer sent before the whole request was read (then a close) is the
                    // outcome; none, on a kept connection: the worker had closed it.
                    let early =
                        tokio::time::timeout(EARLY_ANSWER_WAIT, read_head(&mut stream, &mut buf));
                    match early.await {
                        Ok(Ok(mut h)) => {
                            h.keep_alive = false;
                            Ok(h)
                        }
                        _ if reused => {
                            tracing::debug!(addr = %target.addr, error = %e, "kept connection closed; sending on a new one");
                            continue;
                        }
                        _ => Err(e.to_string()),
                    }
                }
            };
            let head = answer?;
            // 408 on a kept connection: the worker timed it out as idle and did not run this.
            if head.status == 408 && reused {
                tracing::debug!(addr = %target.addr, "kept connection timed out by the worker; sending on a new one");
                continue;
            }
            refuse_redirect(head.status)?;
            let status = StatusCode::from_u16(head.status)
                .map_err(|_| format!("bad status {}", head.status))?;
            let body = Direct {
                decoder: Decoder::new(head.framing),
                stream: Some(stream),
                buf,
                keep_alive: head.keep_alive,
                pool: self.pool.clone(),
                addr: target.addr.clone(),
            };
            return Ok(Response::direct(
                status,
                head.content_type,
                head.passed,
                body,
            ));
        }
    }

    async fn connect(&self, addr: &str) -> Result<TcpStream, String> {
        let connect = tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr));
        let stream = match connect.await {
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
}

/// Whether a proxy for plain-HTTP URLs is set in the environment (as reqwest reads it).
pub(crate) fn proxy_in_environment() -> bool {
    ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
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

/// What [`read_head`] says of a connection reset before any byte of an answer came.
const RESET_BEFORE_ANSWER: &str = "connection reset before an answer";

/// Reads until a response head is in `buf` (consumed; what follows stays).
async fn read_head(stream: &mut TcpStream, buf: &mut BytesMut) -> Result<wire::Head, String> {
    loop {
        if let Some(head) = wire::parse_head(buf).map_err(|e| e.to_string())? {
            return Ok(head);
        }
        buf.reserve(READ_CHUNK);
        match stream.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Err("connection closed before an answer".into()),
            Ok(0) => return Err(wire::WireError::Closed("within the head").to_string()),
            Ok(_) => {}
            Err(e) if buf.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(RESET_BEFORE_ANSWER.into())
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// A body read from its connection by whoever polls it; the connection goes back to the
/// client's idle set once the body is whole (if the worker keeps it open).
struct Direct {
    decoder: Decoder,
    stream: Option<TcpStream>,
    buf: BytesMut,
    keep_alive: bool,
    pool: Arc<pool::Pool>,
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
            // Through `poll_read`, which takes a read that did not fill the buffer as the
            // socket drained: the next poll waits for readiness instead of reading again for
            // nothing (`try_read_buf` would, once per chunk of a stream).
            match ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut *stream),
                cx,
                &mut this.buf
            )) {
                Ok(0) => {
                    this.stream = None;
                    if let Err(e) = this.decoder.closed() {
                        this.decoder = Decoder::new(wire::Framing::Empty);
                        return Poll::Ready(Some(Err(e.to_string())));
                    }
                }
                Ok(_) => {}
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
