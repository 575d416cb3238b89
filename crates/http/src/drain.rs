//! Draining for shutdown: the phase every connection watches, the answers given while draining,
//! and the response body that ends a stream cleanly when the grace period runs out.
//!
//! While draining, new requests that would start work (`POST`) get `503` with an OpenAI-shaped
//! error, `GET /ready` and `GET /health` answer `503 {"status":"draining"}`, and requests in
//! flight go on. When the grace period passes, every event stream still open gets one in-band
//! error event and `data: [DONE]`; other bodies are cut.

use axum::body::{Body, Bytes};
use axum::http::{header, Method, Request, Response, StatusCode};
use http_body::Frame;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::watch;

/// Where a server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Taking requests.
    Serving,
    /// Shutting down: requests in flight finish, new ones are refused.
    Draining,
    /// The grace period is over: what is still in flight is ended now.
    Cutting,
}

/// The shared phase of one server (cheap to clone).
#[derive(Clone, Debug)]
pub struct Lifecycle {
    phase: Arc<watch::Sender<Phase>>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            phase: Arc::new(watch::channel(Phase::Serving).0),
        }
    }
}

impl Lifecycle {
    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Whether the server is shutting down.
    pub fn is_draining(&self) -> bool {
        self.phase() != Phase::Serving
    }

    /// The phase, to watch for changes (a readiness report that follows draining).
    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Moves to `phase` (never back).
    pub(crate) fn advance(&self, phase: Phase) {
        self.phase.send_if_modified(|p| {
            let later = (phase as u8) > (*p as u8);
            if later {
                *p = phase;
            }
            later
        });
    }

    /// Resolves once the phase is `phase` or later.
    pub(crate) fn reached(&self, phase: Phase) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.phase.subscribe();
        async move {
            let _ = rx.wait_for(|p| (*p as u8) >= (phase as u8)).await;
        }
    }
}

fn json_response(status: StatusCode, body: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONNECTION, "close")
        .body(Body::from(body.to_string()))
        .expect("valid response")
}

/// The answer to `request` while draining, when it is not served: readiness and health report
/// not-ready, and requests that would start work are refused.
pub(crate) fn refusal<B>(request: &Request<B>) -> Option<Response<Body>> {
    let path = request.uri().path();
    if request.method() == Method::GET && (path == "/ready" || path == "/health") {
        return Some(json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "draining"}),
        ));
    }
    (request.method() == Method::POST).then(|| shutting_down(StatusCode::SERVICE_UNAVAILABLE))
}

/// The OpenAI-shaped error of a request the shutdown refused or ended.
pub(crate) fn shutting_down(status: StatusCode) -> Response<Body> {
    json_response(
        status,
        kvrouter_openai::error_body(
            "the server is shutting down; retry on another instance",
            "service_unavailable",
            None,
            status.as_u16(),
        ),
    )
}

/// The last events of a stream the shutdown ended.
fn cut_events(after_partial_event: bool) -> Bytes {
    let body = kvrouter_openai::error_body(
        "the server shut down before the response was complete (--shutdown-grace-secs)",
        "service_unavailable",
        None,
        503,
    );
    let sep: &[u8] = if after_partial_event { b"\n\n" } else { b"" };
    Bytes::from([sep, &kvrouter_openai::sse::last_events(&body)].concat())
}

/// A response body that ends when the server's grace period runs out: an event stream with an
/// error event and `[DONE]`, any other body with an error (the connection is closed).
/// `held` lives as long as the body (the connection's count of requests in flight).
pub(crate) struct DrainBody<H> {
    inner: Body,
    sse: bool,
    cut: Pin<Box<dyn Future<Output = ()> + Send>>,
    state: CutState,
    /// The last data frame ended an SSE event (or none was sent).
    at_event_boundary: bool,
    _held: H,
}

#[derive(PartialEq)]
enum CutState {
    Running,
    Cut,
    Ended,
}

impl<H: Send + Unpin + 'static> DrainBody<H> {
    pub(crate) fn wrap(response: Response<Body>, lifecycle: &Lifecycle, held: H) -> Response<Body> {
        let sse = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        response.map(|inner| {
            Body::new(DrainBody {
                inner,
                sse,
                cut: Box::pin(lifecycle.reached(Phase::Cutting)),
                state: CutState::Running,
                at_event_boundary: true,
                _held: held,
            })
        })
    }

    /// Wraps an answer the drain itself gave (a refusal, or the `503` of a request the grace
    /// period ended before its answer started): it is sent whole, never cut, since the cut has
    /// usually happened already and would close the connection before any byte of it.
    pub(crate) fn whole(response: Response<Body>, held: H) -> Response<Body> {
        response.map(|inner| {
            Body::new(DrainBody {
                inner,
                sse: false,
                cut: Box::pin(std::future::pending()),
                state: CutState::Running,
                at_event_boundary: true,
                _held: held,
            })
        })
    }
}

impl<H: Unpin> http_body::Body for DrainBody<H> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if this.state == CutState::Running && this.cut.as_mut().poll(cx).is_ready() {
            this.state = CutState::Cut;
        }
        match this.state {
            CutState::Ended => Poll::Ready(None),
            CutState::Cut => {
                this.state = CutState::Ended;
                if this.sse {
                    let last = cut_events(!this.at_event_boundary);
                    Poll::Ready(Some(Ok(Frame::data(last))))
                } else {
                    Poll::Ready(Some(Err(axum::Error::new("the server shut down"))))
                }
            }
            CutState::Running => {
                let polled = Pin::new(&mut this.inner).poll_frame(cx);
                if let Poll::Ready(Some(Ok(frame))) = &polled {
                    if let Some(data) = frame.data_ref().filter(|d| !d.is_empty()) {
                        this.at_event_boundary = data.ends_with(b"\n\n");
                    }
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == CutState::Ended
            || (self.state == CutState::Running && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.sse {
            // It may grow by the closing events.
            http_body::SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[test]
    fn the_phase_only_moves_forward() {
        let l = Lifecycle::default();
        assert!(!l.is_draining());
        l.advance(Phase::Cutting);
        l.advance(Phase::Draining);
        assert_eq!(l.phase(), Phase::Cutting);
    }

    #[test]
    fn draining_refuses_work_and_reports_not_ready() {
        let req = |m: Method, p: &str| Request::builder().method(m).uri(p).body(()).unwrap();
        let ready = refusal(&req(Method::GET, "/ready")).expect("answered");
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        let post = refusal(&req(Method::POST, "/v1/completions")).expect("refused");
        assert_eq!(post.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(refusal(&req(Method::GET, "/metrics")).is_none());
        assert!(refusal(&req(Method::GET, "/live")).is_none());
    }

    #[tokio::test]
    async fn a_cut_stream_ends_with_an_error_event_and_done() {
        let l = Lifecycle::default();
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
        let response = Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from_stream(rx))
            .unwrap();
        let mut body = DrainBody::wrap(response, &l, ())
            .into_body()
            .into_data_stream();
        tx.unbounded_send(Ok(Bytes::from_static(b"data: {\"a\":1}\n\n")))
            .unwrap();
        assert_eq!(
            &body.next().await.unwrap().unwrap()[..],
            b"data: {\"a\":1}\n\n"
        );
        // Half an event, then the grace period ends.
        tx.unbounded_send(Ok(Bytes::from_static(b"data: {\"b\"")))
            .unwrap();
        body.next().await.unwrap().unwrap();
        l.advance(Phase::Cutting);
        let last = body.next().await.unwrap().unwrap();
        let text = std::str::from_utf8(&last).unwrap();
        assert!(text.starts_with("\n\ndata: {\"error\""), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert!(body.next().await.is_none());
    }
}
