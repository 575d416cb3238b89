//! The OpenAI protocol as kvrouter reads and writes it, in one pure crate used by the server,
//! the mock engine and `kvrouter bench`: no I/O runtime, no clock, only bytes and JSON in and out.
//!
//! # Layout
//! - [`request`]: the endpoint ([`Kind`]), typed views of a request body (model, prompt or
//!   messages, the sampling fields the router and the mock engine read), each error naming its
//!   field.
//! - [`body`]: a request body read once, a token-id `prompt` (or `token_ids`) read straight
//!   into `u32`s rather than a JSON value per token.
//! - `scan`: the one-pass reading of an object body and its token ids from the raw text.
//! - [`error`]: the one OpenAI error body `{"error":{"message","type","param","code"}}` and the
//!   errors of reading a request.
//! - [`sse`]: the one server-sent-events splitter (any chunk boundaries, LF or CRLF) and writer.
//! - [`usage`]: finding a response's `usage` and folding the usages of a continued answer.
//! - [`continuation`]: the request that continues an answer elsewhere (`body + generated tokens`)
//!   and what cannot be continued faithfully.
//! - [`fingerprint`]: stamping `system_fingerprint` on stream events and whole bodies.
//! - [`passthrough`]: the Responses, embeddings and tokenize endpoints: what the router routes
//!   on, and the Responses API's answer shapes.
//! - [`first_n`]: the answers of requests ended because their RL group has enough samples.

pub mod body;
pub mod continuation;
pub mod error;
pub mod fingerprint;
pub mod first_n;
pub mod passthrough;
pub mod request;
mod scan;
pub mod sse;
pub mod usage;

pub use body::Body;
pub use error::{error_body, RequestError};
pub use request::Kind;

/// Largest request body the server and the mock engine read (64 MiB: a 1M-token prompt as JSON
/// token ids is about 8 MB); more is a 413.
pub const MAX_REQUEST_BODY_BYTES: usize = 64 << 20;
