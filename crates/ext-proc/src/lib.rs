//! kvrouter as a Gateway API Inference Extension endpoint picker (EPP): Envoy's external
//! processing service (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC), placing each
//! request exactly as `kvrouter serve` places a proxied one and naming the chosen worker in
//! the `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata (with
//! next-best workers as fallbacks). The answer's headers, body and end, which Envoy sends back,
//! account the first token and the completion; a stream that ends early releases its load.
//!
//! # Layout
//! - [`pb`]: the code generated from the vendored protocol files (`proto/`): the messages,
//!   and a tonic client for tests and benches.
//! - `exchange`: one stream's state: what to answer to each message, when to place.
//! - `messages`: reading and building the protocol's messages.
//! - `h2`: the server side of an HTTP/2 connection, sans I/O (frames, HPACK, flow control).
//! - `grpc`: gRPC's length-prefixed messages and status codes.
//! - `connection`: one gateway connection's task: its streams, each message answered in the
//!   batch it came in.
//! - `service`: the accept loop, placing through [`kvrouter_server::placement`] bounded by the
//!   pick timeout, and the drain on shutdown.
//! - `health`: the gRPC health service (`grpc.health.v1.Health`) on the same port.

pub mod pb;

mod connection;
mod exchange;
mod grpc;
mod h2;
mod health;
mod messages;
mod service;

pub use health::EXT_PROC_SERVICE;

pub use exchange::{
    DESTINATION, LB_NAMESPACE, RANK_HEADER, SUBSET_KEY, SUBSET_NAMESPACE, WORKER_HEADER,
};
pub use service::{serve, ExtProc, MAX_STREAMS_PER_CONNECTION};

/// What the picker answers when it cannot place a request (no worker, overloaded, invalid, or
/// the pick timeout passed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailureMode {
    /// Refuse it: an immediate response with the router's error (503 no worker, 429 shed,
    /// 400 invalid, 504 timeout), as the endpoint picker protocol asks.
    #[default]
    Closed,
    /// Let it go on without a destination: the gateway's own load balancing places it.
    Open,
}

/// How much of the answer the picker asks the gateway to send (`--ext-proc-observe`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Observe {
    /// Every phase the gateway's processing mode sends: the response headers, each body chunk
    /// (the first marks the first token, the last carries the usage) and the end.
    #[default]
    Full,
    /// The response headers only: their answer asks Envoy (`mode_override`, honoured when the
    /// filter sets `allow_mode_override`) for no response body and for response trailers, so
    /// the answer's end is the gRPC stream's end (Envoy half-closes it when the HTTP stream
    /// ends; an HTTP/1.1 answer has no trailers) or its trailers. The first token is taken at
    /// the response headers and the output length is not known. Three messages per request
    /// in buffered mode instead of three plus one per body chunk.
    Headers,
}

/// Settings of the ext_proc service (`kvrouter serve --ext-proc-*`).
#[derive(Clone, Debug)]
pub struct ExtProcConfig {
    /// What to answer when a request cannot be placed.
    pub failure_mode: FailureMode,
    /// Next-best workers named after the chosen one (the gateway tries them in order).
    pub fallbacks: usize,
    /// Longest a placement may take (waiting in the router queue included) before the
    /// failure mode applies; keep it below the gateway's `message_timeout`.
    pub pick_timeout: std::time::Duration,
    /// The largest request body read.
    pub max_body_bytes: usize,
    /// On shutdown, how long streams in flight get to finish (`--shutdown-grace-secs`).
    pub shutdown_grace: std::time::Duration,
    /// How much of the answer to ask the gateway for.
    pub observe: Observe,
    /// A gateway connection that sends nothing for this long gets a PING; one that then sends
    /// nothing for as long again is closed, and its streams end (releasing their load).
    pub keepalive: std::time::Duration,
}

impl Default for ExtProcConfig {
    fn default() -> Self {
        Self {
            failure_mode: FailureMode::Closed,
            fallbacks: 1,
            pick_timeout: std::time::Duration::from_secs(10),
            max_body_bytes: 64 << 20,
            shutdown_grace: std::time::Duration::from_secs(30),
            observe: Observe::Full,
            keepalive: std::time::Duration::from_secs(30),
        }
    }
}
