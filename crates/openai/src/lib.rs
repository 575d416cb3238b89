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

/// The token of an `Authorization: Bearer <token>` header value (the API key of OpenAI's
/// API); the scheme is case-insensitive (RFC 7235 section 2.1): `bearer` is `Bearer`.
pub fn bearer_token(authorization: &[u8]) -> Option<&[u8]> {
    authorization
        .split_first_chunk::<7>()
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"Bearer "))
        .map(|(_, token)| token)
}

/// Largest request body the server and the mock engine read (64 MiB: a 1M-token prompt as JSON
/// token ids is about 8 MB); more is a 413.
pub const MAX_REQUEST_BODY_BYTES: usize = 64 << 20;

#[cfg(test)]
mod tests {
    #[test]
    fn a_bearer_token_is_what_follows_the_scheme_in_any_case() {
        use super::bearer_token;
        assert_eq!(bearer_token(b"Bearer k-1"), Some(&b"k-1"[..]));
        assert_eq!(bearer_token(b"bEARER k"), Some(&b"k"[..]));
        assert_eq!(bearer_token(b"Bearer "), Some(&b""[..]));
        for not in [&b"Basic k"[..], b"Bearer", b"Bearerk", b"k"] {
            assert_eq!(bearer_token(not), None, "{not:?}");
        }
    }
}
