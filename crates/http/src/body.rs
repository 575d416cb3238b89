//! The request body's deadline: a request's whole body must arrive within `body_read_timeout` of
//! its head. A client that stops sending mid-body, or trickles it, otherwise holds a connection
//! and a request in flight for good (the idle and header timeouts do not cover a request in
//! flight), and holds a drain for its whole grace period.
//!
//! A body the handler leaves unread (a 404, a 405, a 401 for a missing key, a report whose
//! handler needs no body) goes back to the serve loop when it is dropped ([`Unread`]): the loop
//! reads what is left of it ([`drain`], at most [`DRAIN_MAX_BYTES`] within [`DRAIN_WAIT`]) so
//! the connection can carry the next request. hyper alone drains only what it already holds,
//! and otherwise closes the connection after the answer without saying so; a body that cannot be
//! drained (too long, too slow, its reading failed, or its client waits for `100 Continue`
//! before sending it) gets `Connection: close` in the answer instead.

use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Sleep;

/// The error a body yields when its deadline passes first.
#[derive(Debug)]
pub struct BodyTimeout(pub Duration);

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body did not arrive within {} s of its head \
             (--http-body-read-timeout-secs)",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for BodyTimeout {}

/// The most of an unread body the serve loop reads to keep its connection.
pub(crate) const DRAIN_MAX_BYTES: u64 = 64 * 1024;
/// The longest the serve loop waits for the rest of an unread body.
pub(crate) const DRAIN_WAIT: Duration = Duration::from_millis(200);

/// A request body that fails with [`BodyTimeout`] once its deadline passes.
pub(crate) struct TimedBody {
    /// `None` once handed back unread (in `drop`).
    inner: Option<Incoming>,
    limit: Duration,
    /// Armed when the body is first waited for (a body read at once never touches the timer).
    deadline: Option<Pin<Box<Sleep>>>,
    /// When the head arrived: the deadline counts from here.
    start: tokio::time::Instant,
    /// Where the body goes if it is dropped before its end; `None` for a body empty from the
    /// start, and once it ended.
    unread: Option<oneshot::Sender<Left>>,
    /// Reading it failed (its framing, its deadline): hyper closes the connection.
    failed: bool,
}

/// What a handler left of a request's body.
pub(crate) enum Left {
    /// The rest, unread.
    Body(Incoming),
    /// Reading it failed: the connection cannot carry another request.
    Failed,
}

/// The request's body, if the handler dropped it before its end (see the module's
/// documentation).
pub(crate) struct Unread(Option<oneshot::Receiver<Left>>);

impl Unread {
    /// What was left of the body, if anything (`None` too while something still holds it).
    pub(crate) fn take(self) -> Option<Left> {
        self.0.and_then(|mut rx| rx.try_recv().ok())
    }
}

impl TimedBody {
    /// The body, and where it comes back if left unread.
    pub(crate) fn new(inner: Incoming, limit: Duration) -> (Self, Unread) {
        // A body with nothing in it (a GET, `content-length: 0`) is read already.
        let (tx, rx) = match inner.is_end_stream() {
            true => (None, None),
            false => {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            }
        };
        let body = Self {
            inner: Some(inner),
            limit,
            deadline: None,
            start: tokio::time::Instant::now(),
            unread: tx,
            failed: false,
        };
        (body, Unread(rx))
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        if let (Some(tx), Some(inner)) = (self.unread.take(), self.inner.take()) {
            let _ = tx.send(match self.failed {
                true => Left::Failed,
                false => Left::Body(inner),
            });
        }
    }
}

/// Reads the rest of an unread body, at most [`DRAIN_MAX_BYTES`] within [`DRAIN_WAIT`]; whether
/// it ended (the connection can then serve the next request).
pub(crate) async fn drain(mut body: Incoming) -> bool {
    if body.size_hint().lower() > DRAIN_MAX_BYTES {
        return false;
    }
    let mut read = 0u64;
    let reading = async {
        loop {
            match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                None => return true,
                Some(Err(_)) => return false,
                Some(Ok(frame)) => {
                    read += frame.data_ref().map_or(0, |d| d.len() as u64);
                    if read > DRAIN_MAX_BYTES {
                        return false;
                    }
                }
            }
        }
    };
    tokio::time::timeout(DRAIN_WAIT, reading)
        .await
        .unwrap_or(false)
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(frame) = Pin::new(&mut *inner).poll_frame(cx) {
            match &frame {
                Some(Err(_)) => this.failed = true,
                // Read to its end: nothing to hand back.
                None => this.unread = None,
                Some(Ok(_)) if inner.is_end_stream() => this.unread = None,
                Some(Ok(_)) => {}
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let (start, limit) = (this.start, this.limit);
        let deadline = this
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(start + limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.failed = true;
                Poll::Ready(Some(Err(Box::new(BodyTimeout(limit)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint)
    }
}
