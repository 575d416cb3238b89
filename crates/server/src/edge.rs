//! The router's edge: what every request of `kvrouter serve`'s HTTP API passes through before
//! and after routing, as one service around the axum [`Router`] (`app.rs`). A global router
//! (`serve --global`, `global/proxy.rs`) keeps its own layers.
//!
//! - Before: a request with a too long URI, too many or too large headers, or a body announced
//!   past the limit is refused with OpenAI-shaped JSON ([`head_refusal`]); every other request
//!   gets the same limit ([`MAX_REQUEST_BODY_BYTES`]) as the one axum's `Bytes` extractor reads
//!   ([`DefaultBodyLimit`]).
//! - After: axum's own rejections (plain text or nothing) become OpenAI-shaped JSON with the
//!   same status ([`shaped`]); every other answer passes as it is ([`is_shaped`]).
//!
//! The same as three axum layers (`from_fn`, `map_response`, `DefaultBodyLimit`), without their
//! per-request cost: a `Router` layer is re-boxed around every route and clones its boxed
//! service on each call, and `from_fn` boxes its `Next` and its future as well. Here the
//! common case allocates nothing beyond the router's own call; only a rejection being shaped
//! (it reads its body) is boxed.

use crate::error::{head_refusal, is_shaped, shaped};
use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::Request;
use axum::response::Response;
use axum::routing::future::RouteFuture;
use axum::Router;
use futures::future::{ready, BoxFuture, Either, FutureExt, Ready, Then};
use kvrouter_openai::MAX_REQUEST_BODY_BYTES;
use std::convert::Infallible;
use std::task::{Context, Poll};
use tower::{Layer, Service};

/// The router with its body limit ([`DefaultBodyLimit`] as a plain wrapper, not a layer).
type Limited = <DefaultBodyLimit as Layer<Router>>::Service;

type Answer = Result<Response, Infallible>;

/// An answer after the edge: as it is, or being shaped.
type AfterRouting = Either<Ready<Answer>, BoxFuture<'static, Answer>>;

/// The edge around `kvrouter serve`'s routes (module docs). Cheap to clone (the router is).
#[derive(Clone)]
pub struct Edge {
    inner: Limited,
}

impl Edge {
    /// `router` behind the edge.
    pub(crate) fn new(router: Router) -> Self {
        Self {
            inner: DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES).layer(router),
        }
    }
}

/// An answer leaving the router: passed on, or shaped as OpenAI JSON.
fn after_routing(answer: Answer) -> AfterRouting {
    let Ok(response) = answer;
    if is_shaped(&response) {
        Either::Left(ready(Ok(response)))
    } else {
        Either::Right(shaped(response).map(Ok).boxed())
    }
}

impl Service<Request<Body>> for Edge {
    type Response = Response;
    type Error = Infallible;
    type Future = Either<
        Ready<Answer>,
        Then<RouteFuture<Infallible>, AfterRouting, fn(Answer) -> AfterRouting>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<Request<Body>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if let Some(refused) = head_refusal(&request) {
            return Either::Left(ready(Ok(refused)));
        }
        let after: fn(Answer) -> AfterRouting = after_routing;
        Either::Right(self.inner.call(request).then(after))
    }
}
