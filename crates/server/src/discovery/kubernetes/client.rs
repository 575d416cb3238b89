//! The API client of Kubernetes discovery: kube's own stack (its config inferred from
//! `KUBECONFIG`, `~/.kube/config` or the pod's service account) with the bounds kube leaves out.
//!
//! - **Calls** (`--discovery-call-timeout-ms`): every request's answer must begin within it, a
//!   watch's as well; a list's or a pod's body (or a watch refused with an error status) may
//!   then pause at most that long between two reads. kube alone waits 295 s (its read timeout)
//!   on an API server that took the connection and never answers: discovery stalled for five
//!   minutes, with no worker at startup.
//! - **Watch starts** at most one per [`WATCH_PACE`]: kube's watcher starts the next watch
//!   itself when one ends, and tells the caller nothing, so a server (or proxy) that ends each
//!   watch at once had it watching again in a tight loop.
//! - **Watch lines** at most [`MAX_WATCH_LINE`] bytes: kube reads a watch's events as lines with
//!   no length limit, so a line that never ended grew the router's memory without bound.

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::{Frame, SizeHint};
use kube::client::{Body, ClientBuilder, DynBody};
use kube::Client;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};
use tower::{BoxError, Service};

/// The shortest time between the starts of two watches.
pub(crate) const WATCH_PACE: Duration = Duration::from_secs(1);
/// The longest watch event (one line), in bytes.
pub(crate) const MAX_WATCH_LINE: usize = 16 << 20;

/// kube's client with the bounds above.
pub(super) async fn client(call_timeout: Duration) -> Result<Client, String> {
    let config = kube::Config::infer().await.map_err(|e| e.to_string())?;
    let builder = ClientBuilder::try_from(config).map_err(|e| e.to_string())?;
    let layer = tower::layer::layer_fn(move |inner| Bounded {
        inner,
        call_timeout,
        last_watch: Arc::new(Mutex::new(None)),
    });
    Ok(builder.with_layer(&layer).build())
}

/// See the module's documentation.
struct Bounded<S> {
    inner: S,
    call_timeout: Duration,
    /// When the last watch was let start.
    last_watch: Arc<Mutex<Option<Instant>>>,
}

/// Whether a request is a watch (`?watch=true`, as kube sends it; `1` is accepted too).
fn is_watch(uri: &axum::http::Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

/// When a watch asked for at `now` may start, given the last one's start (which it becomes).
fn watch_start(last: &mut Option<Instant>, now: Instant) -> Instant {
    let start = last.map_or(now, |l| now.max(l + WATCH_PACE));
    *last = Some(start);
    start
}

impl<S> Service<axum::http::Request<Body>> for Bounded<S>
where
    S: Service<
        axum::http::Request<Body>,
        Response = axum::http::Response<Box<DynBody>>,
        Error = BoxError,
    >,
    S::Future: Send + 'static,
{
    type Response = axum::http::Response<BoundedBody>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<Body>) -> Self::Future {
        let watch = is_watch(request.uri());
        let start = watch.then(|| {
            let mut last = self.last_watch.lock().expect("watch pace lock");
            watch_start(&mut last, Instant::now())
        });
        let answer = self.inner.call(request);
        let limit = self.call_timeout;
        Box::pin(async move {
            if let Some(start) = start {
                tokio::time::sleep_until(start).await;
            }
            let response = tokio::time::timeout(limit, answer).await.map_err(|_| {
                format!("no answer within {limit:?} (--discovery-call-timeout-ms)")
            })??;
            // A watch refused with an error status answers a body, not an event stream: its
            // pauses are bounded as a list's are (a stalled 503 froze discovery).
            let stream = watch && response.status().is_success();
            Ok(response.map(|inner| BoundedBody {
                inner,
                idle: (!stream).then_some(limit),
                timer: None,
                line: stream.then_some(0),
            }))
        })
    }
}

/// An answer's body: a list's (or a pod's) with its pauses bounded, a watch's with its lines.
pub(crate) struct BoundedBody {
    inner: Box<DynBody>,
    /// The longest pause between two reads (not for a watch, which may idle for minutes).
    idle: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    /// A watch's bytes since its last line feed.
    line: Option<usize>,
}

impl http_body::Body for BoundedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                if let (Some(run), Some(Ok(f))) = (this.line.as_mut(), &frame) {
                    if let Some(data) = f.data_ref() {
                        *run = match memchr::memrchr(b'\n', data) {
                            Some(i) => data.len() - i - 1,
                            None => *run + data.len(),
                        };
                        if *run > MAX_WATCH_LINE {
                            return Poll::Ready(Some(Err(format!(
                                "a watch event longer than {MAX_WATCH_LINE} bytes"
                            )
                            .into())));
                        }
                    }
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let Some(idle) = this.idle else {
                    return Poll::Pending;
                };
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                        "the answer paused over {idle:?} (--discovery-call-timeout-ms)"
                    )
                    .into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_told_apart_by_their_query() {
        let uri = |s: &str| s.parse::<axum::http::Uri>().unwrap();
        assert!(is_watch(&uri(
            "/apis/x?labelSelector=a&watch=true&resourceVersion=1"
        )));
        assert!(is_watch(&uri("/apis/x?watch=1")));
        assert!(!is_watch(&uri("/apis/x?labelSelector=watch%3Dtrue")));
        assert!(!is_watch(&uri("/apis/x")));
    }

    fn body(chunks: Vec<Bytes>, pending_after: bool, watch: bool) -> BoundedBody {
        use futures::StreamExt;
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, BoxError>(Frame::data(c)));
        let frames = futures::stream::iter(frames);
        let inner: Box<DynBody> = if pending_after {
            Box::new(http_body_util::StreamBody::new(Box::pin(
                frames.chain(futures::stream::pending()),
            )))
        } else {
            Box::new(http_body_util::StreamBody::new(frames))
        };
        BoundedBody {
            inner,
            idle: (!watch).then_some(Duration::from_secs(5)),
            timer: None,
            line: watch.then_some(0),
        }
    }

    async fn read(mut b: BoundedBody) -> Result<usize, String> {
        use http_body_util::BodyExt;
        let mut n = 0;
        while let Some(f) = b.frame().await {
            n += f
                .map_err(|e| e.to_string())?
                .into_data()
                .map_or(0, |d| d.len());
        }
        Ok(n)
    }

    #[tokio::test]
    async fn a_watch_line_past_the_bound_fails_and_lines_under_it_pass() {
        let mib = |n: usize, tail: &[u8]| {
            let mut v = vec![b'x'; n << 20];
            v.extend_from_slice(tail);
            Bytes::from(v)
        };
        let whole = vec![mib(10, b"\n"), mib(10, b"\n"), mib(15, b"")];
        assert_eq!(
            read(body(whole, false, true)).await.unwrap(),
            (35 << 20) + 2
        );
        let endless = vec![mib(10, b""), mib(10, b"")];
        let e = read(body(endless.clone(), false, true)).await.unwrap_err();
        assert!(e.contains("longer than"), "{e}");
        // Not a watch: a list's body is one long line.
        assert_eq!(read(body(endless, false, false)).await.unwrap(), 20 << 20);
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_body_that_pauses_past_the_call_timeout_fails() {
        let e = read(body(vec![Bytes::from_static(b"{")], true, false))
            .await
            .unwrap_err();
        assert!(e.contains("--discovery-call-timeout-ms"), "{e}");
    }

    #[test]
    fn watch_starts_are_paced() {
        let t0 = Instant::now();
        let mut last = None;
        assert_eq!(watch_start(&mut last, t0), t0, "the first starts at once");
        let second = watch_start(&mut last, t0 + Duration::from_millis(10));
        assert_eq!(second, t0 + WATCH_PACE);
        let third = watch_start(&mut last, t0 + Duration::from_millis(20));
        assert_eq!(third, t0 + 2 * WATCH_PACE, "a burst is spread out");
        let later = t0 + 10 * WATCH_PACE;
        assert_eq!(
            watch_start(&mut last, later),
            later,
            "one after a long watch waits not"
        );
    }
}
