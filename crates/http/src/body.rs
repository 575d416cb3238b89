//! The request body's deadline: a request's whole body must arrive within `body_read_timeout` of
//! its head. A client that stops sending mid-body, or trickles it, otherwise holds a connection
//! and a request in flight for good (the idle and header timeouts do not cover a request in
//! flight), and holds a drain for its whole grace period.

use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::future::Future;
use std::pin::Pin;
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
}

impl TimedBody {
    pub(crate) fn new(inner: Incoming, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            deadline: None,
            start: tokio::time::Instant::now(),
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
