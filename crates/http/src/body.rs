//! The request body's deadline: a request's whole body must arrive within `body_read_timeout` of
//! its head. A client that stops sending mid-body, or trickles it, otherwise holds a connection
//! and a request in flight for good (the idle and header timeouts do not cover a request in
//! flight), and holds a drain for its whole grace period.
//!
//! It also says whether the body was read to its end ([`ReadToEnd`]): an answer given with the
//! body still unread (a 404, a 405, a 401 for a missing key) leaves the next request's start
//! unknown, so hyper closes the connection after it; the serve loop then says so in the answer
//! (`Connection: close`), or the client would send its next request into a closed connection.

use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
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

/// A request body that fails with [`BodyTimeout`] once its deadline passes.
pub(crate) struct TimedBody {
    inner: Incoming,
    limit: Duration,
    /// Armed when the body is first waited for (a body read at once never touches the timer).
    deadline: Option<Pin<Box<Sleep>>>,
    /// When the head arrived: the deadline counts from here.
    start: tokio::time::Instant,
    /// Set once the body has been read to its end; `None` for a body empty from the start.
    ended: Option<Arc<AtomicBool>>,
}

/// Whether a request's body was read to its end (see the module's documentation).
#[derive(Clone, Debug)]
pub(crate) struct ReadToEnd(Option<Arc<AtomicBool>>);

impl ReadToEnd {
    pub(crate) fn get(&self) -> bool {
        self.0.as_ref().is_none_or(|e| e.load(Ordering::Relaxed))
    }
}

impl TimedBody {
    /// The body, and what tells whether it was read to its end.
    pub(crate) fn new(inner: Incoming, limit: Duration) -> (Self, ReadToEnd) {
        // A body with nothing in it (a GET, `content-length: 0`) is read already: no flag.
        let ended = (!inner.is_end_stream()).then(|| Arc::new(AtomicBool::new(false)));
        let read = ReadToEnd(ended.clone());
        let body = Self {
            inner,
            limit,
            deadline: None,
            start: tokio::time::Instant::now(),
            ended,
        };
        (body, read)
    }

    fn mark_ended(&self) {
        if let Some(e) = &self.ended {
            e.store(true, Ordering::Relaxed);
        }
    }
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if frame.is_none() || this.inner.is_end_stream() {
                this.mark_ended();
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let (start, limit) = (this.start, this.limit);
        let deadline = this
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(start + limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimeout(limit))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
