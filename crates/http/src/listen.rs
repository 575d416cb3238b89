//! The HTTP/1 serve loop of `kvrouter serve` and `kvrouter mock-engine`: an accept loop with
//! client-connection timeouts and a graceful drain.
//!
//! - A connection with no request in flight that sends nothing for `idle_timeout` is closed (a
//!   silent connection, or an idle keep-alive one).
//! - A connection whose writes make no progress for `write_timeout` (a client that stopped
//!   reading an answer, or one gone without closing) is closed, which ends its request and
//!   releases what the request held.
//! - A request head must arrive whole within `header_read_timeout` of its first byte (slowloris),
//!   and its body within `body_read_timeout` of the head ([`crate::body`]): reading it then
//!   fails, the request is answered with an error and the connection closed.
//! - On shutdown the server drains ([`crate::drain`]): it keeps accepting, refuses new work with
//!   `503`, lets requests in flight finish for up to `shutdown_grace`, then ends the rest (event
//!   streams with an error event and `[DONE]`) and returns within [`CUT_MARGIN`].
//!
//! TCP_NODELAY is set on every accepted connection.
//!
//! hyper's own `header_read_timeout` (hyper 1.12) starts when it begins waiting for a head, at
//! accept and again after every response, so it cannot tell an idle keep-alive connection from a
//! slow head; both timeouts are kept here instead, from the bytes read and the requests in flight.

use crate::body::{Left, TimedBody};
use crate::drain::{refusal, shutting_down, DrainBody, Lifecycle, Phase};
use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

/// Most request headers hyper parses before answering 431 itself.
const HYPER_MAX_HEADERS: usize = 256;
/// hyper's read buffer, which bounds a request head (hyper's default is about 400 KB).
const HYPER_MAX_BUF_BYTES: usize = 512 * 1024;

/// How long the ended requests get to send their last bytes after the grace period.
pub const CUT_MARGIN: Duration = Duration::from_secs(2);

/// What [`serve`] serves: an axum `Router`, or a service around one (`kvrouter serve`'s edge).
pub trait App:
    tower::Service<
        Request<Body>,
        Response = Response<Body>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> App for S where
    S: tower::Service<
            Request<Body>,
            Response = Response<Body>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Client-connection timeouts and the shutdown grace period.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time to receive a whole request head once its first byte arrived.
    pub header_read_timeout: Duration,
    /// Time to receive a whole request body once its head arrived.
    pub body_read_timeout: Duration,
    /// Time a connection with no request in flight may stay silent.
    pub idle_timeout: Duration,
    /// Time a write to the client may make no progress (its socket buffer full): the
    /// connection is closed. Checked at least every `header_read_timeout`.
    pub write_timeout: Duration,
    /// Time requests in flight get to finish on shutdown.
    pub shutdown_grace: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// What one connection is doing, for its timeouts.
#[derive(Debug)]
struct Activity {
    in_flight: usize,
    /// When the connection last had no request in flight (or was accepted).
    idle_since: Instant,
    /// When the first byte of a request head arrived while none was in flight.
    head_started: Option<Instant>,
    /// Since when a write has waited for room in the socket, if one does.
    write_blocked: Option<Instant>,
}

impl Activity {
    fn new(now: Instant) -> Self {
        Self {
            in_flight: 0,
            idle_since: now,
            head_started: None,
            write_blocked: None,
        }
    }

    /// Why the connection should be closed at `now`, if it should.
    fn expired(&self, now: Instant, limits: &HttpLimits) -> Option<&'static str> {
        if self
            .write_blocked
            .is_some_and(|t| now >= t + limits.write_timeout)
        {
            return Some("write timeout");
        }
        if self.in_flight > 0 {
            return None;
        }
        match self.head_started {
            Some(t) if now >= t + limits.header_read_timeout => Some("header read timeout"),
            Some(_) => None,
            None if now >= self.idle_since + limits.idle_timeout => Some("idle timeout"),
            None => None,
        }
    }

    /// When to look again. A change of activity only moves deadlines later, except a request
    /// head starting; so the check never sleeps longer than the header timeout.
    fn next_check(&self, now: Instant, limits: &HttpLimits) -> Instant {
        let deadline = match (self.in_flight, self.head_started) {
            (0, Some(t)) => t + limits.header_read_timeout,
            (0, None) => self.idle_since + limits.idle_timeout,
            _ => now + limits.idle_timeout,
        };
        let deadline = match self.write_blocked {
            Some(t) => deadline.min(t + limits.write_timeout),
            None => deadline,
        };
        deadline.min(now + limits.header_read_timeout)
    }

    fn bytes_read(&mut self, now: Instant) {
        if self.in_flight == 0 && self.head_started.is_none() {
            self.head_started = Some(now);
        }
    }
}

/// A request in flight on a connection (held by its response body).
struct InFlight(Arc<Mutex<Activity>>);

impl InFlight {
    fn begin(activity: &Arc<Mutex<Activity>>) -> Self {
        let mut a = activity.lock().expect("activity lock");
        a.in_flight += 1;
        a.head_started = None;
        drop(a);
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut a = self.0.lock().expect("activity lock");
        a.in_flight -= 1;
        if a.in_flight == 0 {
            a.idle_since = Instant::now();
        }
    }
}

/// The connection's socket, noting when bytes arrive and when a write waits for room.
struct Watched {
    io: TcpStream,
    activity: Arc<Mutex<Activity>>,
    /// A write is waiting for room (noted in the activity; cleared by the next that goes).
    blocked: bool,
}

impl Watched {
    /// Notes whether a write went (`polled` ready) or waits for room; the activity is locked
    /// only when that changes.
    fn note_write<T>(&mut self, polled: &Poll<T>) {
        let blocked = polled.is_pending();
        if blocked != self.blocked {
            self.blocked = blocked;
            let mut a = self.activity.lock().expect("activity lock");
            a.write_blocked = blocked.then(Instant::now);
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity
                .lock()
                .expect("activity lock")
                .bytes_read(Instant::now());
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.note_write(&polled);
        polled
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.note_write(&polled);
        polled
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// One request: refused while draining, answered `503` if the grace period ends before the
/// answer starts, otherwise served by `app` with a body that the end of the grace period cuts.
async fn handle<S: App>(
    app: S,
    lifecycle: Lifecycle,
    activity: Arc<Mutex<Activity>>,
    body_read_timeout: Duration,
    request: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let held = InFlight::begin(&activity);
    if lifecycle.is_draining() {
        if let Some(refused) = refusal(&request) {
            return Ok(DrainBody::whole(refused, held));
        }
    }
    // A client that waits for `100 Continue` is not asked for a body the answer did not need.
    let expects = request.headers().contains_key(header::EXPECT);
    let (parts, body) = request.into_parts();
    let (body, unread) = TimedBody::new(body, body_read_timeout);
    let request = Request::from_parts(parts, Body::new(body));
    let mut response = tokio::select! {
        r = app.oneshot(request) => {
            match r { Ok(r) => r, Err(e) => match e {} }
        }
        _ = lifecycle.reached(Phase::Cutting) => {
            return Ok(DrainBody::whole(shutting_down(StatusCode::SERVICE_UNAVAILABLE), held));
        }
    };
    // Left unread: read the rest to keep the connection, else say it closes (hyper closes a
    // connection whose request body it cannot skip, without a word).
    let keep = match unread.take() {
        None => true,
        Some(Left::Body(body)) => !expects && crate::body::drain(body).await,
        Some(Left::Failed) => false,
    };
    if !keep {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    Ok(DrainBody::wrap(response, &lifecycle, held))
}

/// Serves one connection until it ends, times out or the drain closes it.
async fn connection<S: App>(tcp: TcpStream, app: S, lifecycle: Lifecycle, limits: HttpLimits) {
    let activity = Arc::new(Mutex::new(Activity::new(Instant::now())));
    let io = TokioIo::new(Watched {
        io: tcp,
        activity: activity.clone(),
        blocked: false,
    });
    let (svc_lifecycle, svc_activity) = (lifecycle.clone(), activity.clone());
    let body_read_timeout = limits.body_read_timeout;
    let service = hyper::service::service_fn(move |request| {
        handle(
            app.clone(),
            svc_lifecycle.clone(),
            svc_activity.clone(),
            body_read_timeout,
            request,
        )
    });
    // A connection opened while draining serves one request (a readiness probe, a refusal).
    let draining_at_start = lifecycle.is_draining();
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(!draining_at_start)
        // Kept here instead (module docs).
        .header_read_timeout(None)
        // Above the router's own, OpenAI-shaped limits (100 headers, 64 KiB), so that a client
        // meets those first; hyper answers a wordless 431 past these.
        .max_headers(HYPER_MAX_HEADERS)
        .max_buf_size(HYPER_MAX_BUF_BYTES)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut drain = std::pin::pin!(lifecycle.reached(Phase::Draining));
    let mut closing = draining_at_start;
    loop {
        let check = activity
            .lock()
            .expect("activity lock")
            .next_check(Instant::now(), &limits);
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = drain.as_mut(), if !closing => {
                // Finishes the request in flight, if any, then closes.
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tokio::time::sleep_until(check) => {
                let now = Instant::now();
                if let Some(why) = activity.lock().expect("activity lock").expired(now, &limits) {
                    tracing::debug!("closing a client connection: {why}");
                    return;
                }
            }
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module docs).
pub async fn serve<S: App>(
    listener: TcpListener,
    app: S,
    limits: HttpLimits,
    lifecycle: Lifecycle,
    shutdown: impl Future<Output = ()>,
) {
    let mut conns = JoinSet::new();
    let spawn = |conns: &mut JoinSet<()>, tcp| {
        conns.spawn(connection(
            tcp,
            app.clone(),
            lifecycle.clone(),
            limits.clone(),
        ));
    };
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            tcp = accept(&listener) => spawn(&mut conns, tcp),
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = &mut shutdown => break,
        }
    }
    lifecycle.advance(Phase::Draining);
    let grace_end = Instant::now() + limits.shutdown_grace;
    loop {
        tokio::select! {
            tcp = accept(&listener) => spawn(&mut conns, tcp),
            joined = conns.join_next() => if joined.is_none() { return },
            _ = tokio::time::sleep_until(grace_end) => break,
        }
    }
    drop(listener);
    lifecycle.advance(Phase::Cutting);
    let _ = tokio::time::timeout(CUT_MARGIN, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    conns.abort_all();
}

/// The wait after a failed accept before the next.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The next connection on `listener`, with TCP_NODELAY set. A failed accept (out of file
/// descriptors and the like) is logged and tried again after [`ACCEPT_BACKOFF`], not at once:
/// the error would come back at once, and the loop spin a core.
pub async fn accept(listener: &TcpListener) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((tcp, _)) => {
                let _ = tcp.set_nodelay(true);
                return tcp;
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
        }
    }

    #[test]
    fn a_write_waiting_for_room_closes_after_the_write_timeout_even_in_flight() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut a = Activity::new(t0);
        a.in_flight = 1;
        a.write_blocked = Some(t0 + s(5));
        assert_eq!(a.next_check(t0 + s(6), &limits()), t0 + s(16));
        assert_eq!(a.expired(t0 + s(34), &limits()), None);
        assert_eq!(a.expired(t0 + s(35), &limits()), Some("write timeout"));
        // A write that went: no deadline.
        a.write_blocked = None;
        assert_eq!(a.expired(t0 + s(1000), &limits()), None);
    }

    #[test]
    fn silence_closes_after_the_idle_timeout_and_a_partial_head_after_the_header_timeout() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut a = Activity::new(t0);
        assert_eq!(a.expired(t0 + s(59), &limits()), None);
        assert_eq!(a.expired(t0 + s(60), &limits()), Some("idle timeout"));
        a.bytes_read(t0 + s(5));
        a.bytes_read(t0 + s(9));
        assert_eq!(a.next_check(t0 + s(9), &limits()), t0 + s(15));
        assert_eq!(a.expired(t0 + s(14), &limits()), None);
        assert_eq!(
            a.expired(t0 + s(15), &limits()),
            Some("header read timeout")
        );
        // A request in flight is never timed out here, however long it runs.
        a.in_flight = 1;
        a.head_started = None;
        assert_eq!(a.expired(t0 + s(1000), &limits()), None);
        assert!(a.next_check(t0 + s(1000), &limits()) <= t0 + s(1010));
    }
}
