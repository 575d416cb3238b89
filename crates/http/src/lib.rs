//! kvrouter-http: the HTTP/1 serve loop shared by `kvrouter serve` (the router) and
//! `kvrouter mock-engine`, so that both treat clients and shutdown alike.
//!
//! # Layout
//! - [`listen`]: the accept loop, client-connection timeouts (idle, slow request heads),
//!   TCP_NODELAY, and the shutdown sequence ([`listen::serve`], [`HttpLimits`]).
//! - [`body`]: the request body's deadline ([`body::BodyTimeout`]).
//! - [`drain`]: the shutdown phase every connection watches ([`Lifecycle`]), what is answered
//!   while draining, and the response body that ends a stream when the grace period runs out.
//!
//! It knows nothing of routing or engines: a host hands it an `axum::Router`, its limits, its
//! [`Lifecycle`] and a shutdown future.

pub mod body;
pub mod drain;
pub mod listen;

pub use drain::{Lifecycle, Phase};
pub use listen::{accept, serve, App, HttpLimits, ACCEPT_BACKOFF, CUT_MARGIN};
