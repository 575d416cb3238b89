//! A worker's answer as the request path sees it: status, content type and a body read either
//! by the forwarding task itself ([`Direct`]) or through reqwest; its first chunk may be waited
//! for and kept ([`Response::first_chunk`]).

use super::Direct;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};
use std::time::Duration;

/// The largest whole (non-streamed) answer read from a worker, as the request body's bound
/// (`MAX_REQUEST_BODY_BYTES`, 64 MiB): past it the attempt fails (a 502) instead of the router
/// holding whatever the worker sends. Streams are forwarded as they come and need no bound.
pub(crate) const MAX_ANSWER_BYTES: usize = kvrouter_openai::MAX_REQUEST_BODY_BYTES;

/// A worker's answer: status, content type, body.
pub(crate) struct Response {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    /// The worker's headers passed on to the client (`retry-after`, `x-ratelimit-*`).
    passed: Vec<(HeaderName, HeaderValue)>,
    body: Body,
    /// What waiting for the body's first chunk gave ([`Response::first_chunk`]).
    first: First,
    /// How long that wait took.
    waited: Duration,
}

/// What waiting for an answer's first chunk gave; the chunk is kept and comes first.
#[derive(Debug, Default)]
pub(super) enum First {
    /// Not waited for.
    #[default]
    NotAsked,
    /// It came, and is kept.
    Chunk(Bytes),
    /// The body ended, empty.
    Ended,
    /// It had not come within the wait.
    NotYet,
}

/// An answer's body.
enum Body {
    /// Read from the socket by whoever polls it.
    Direct(Direct),
    /// From reqwest (`https` workers, or any behind a proxy).
    Reqwest(reqwest::Response),
}

impl Response {
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    pub(crate) fn content_type(&self) -> Option<&HeaderValue> {
        self.content_type.as_ref()
    }

    /// The worker's headers that go on to the client (`retry-after`, `x-ratelimit-*`).
    pub(crate) fn passed_headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.passed
    }

    /// Whether the body is read by the task that polls it (no connection task between).
    pub(crate) fn read_here(&self) -> bool {
        matches!(self.body, Body::Direct(_))
    }

    /// Waits up to `wait` for the body's first chunk and keeps it (it comes first from
    /// [`Response::into_stream`] and [`Response::bytes`]); an error when the body fails before
    /// any chunk came. Nothing is lost when the wait ends first: the chunk comes later.
    pub(crate) async fn first_chunk(&mut self, wait: Duration) -> Result<(), String> {
        let next = async {
            match &mut self.body {
                Body::Direct(d) => d.next().await.transpose(),
                Body::Reqwest(r) => r.chunk().await.map_err(|e| e.to_string()),
            }
        };
        let started = tokio::time::Instant::now();
        let first = tokio::time::timeout(wait, next).await;
        self.waited = started.elapsed();
        self.first = match first {
            Ok(Ok(Some(chunk))) => First::Chunk(chunk),
            Ok(Ok(None)) => First::Ended,
            Ok(Err(e)) => return Err(e),
            Err(_) => First::NotYet,
        };
        Ok(())
    }

    /// Whether [`Response::first_chunk`] found the body ended, empty.
    pub(crate) fn ended_empty(&self) -> bool {
        matches!(self.first, First::Ended)
    }

    /// How long [`Response::first_chunk`] waited (zero when it was not called).
    pub(crate) fn waited(&self) -> Duration {
        self.waited
    }

    /// The body as chunks.
    pub(crate) fn into_stream(self) -> BoxStream<'static, Result<Bytes, String>> {
        let first = match self.first {
            First::Ended => return futures::stream::empty().boxed(),
            First::Chunk(chunk) => Some(chunk),
            First::NotAsked | First::NotYet => None,
        };
        let rest = match self.body {
            Body::Direct(d) => d.boxed(),
            Body::Reqwest(r) => r
                .bytes_stream()
                .map(|r| r.map_err(|e| e.to_string()))
                .boxed(),
        };
        match first {
            Some(chunk) => futures::stream::once(async move { Ok(chunk) })
                .chain(rest)
                .boxed(),
            None => rest,
        }
    }

    /// The whole body, up to [`MAX_ANSWER_BYTES`].
    pub(crate) async fn bytes(self) -> Result<Bytes, String> {
        self.bytes_within(MAX_ANSWER_BYTES).await
    }

    /// The whole body; an error as soon as it grows past `limit` bytes (nothing more is read).
    pub(crate) async fn bytes_within(self, limit: usize) -> Result<Bytes, String> {
        let mut chunks = match self.first {
            First::Ended => return Ok(Bytes::new()),
            First::Chunk(chunk) => vec![chunk],
            First::NotAsked | First::NotYet => Vec::new(),
        };
        let mut len: usize = chunks.iter().map(Bytes::len).sum();
        let mut body = self.body;
        loop {
            if len > limit {
                return Err(format!(
                    "the answer's body is larger than {limit} bytes (a whole answer's bound)"
                ));
            }
            let chunk = match &mut body {
                Body::Reqwest(r) => r.chunk().await.map_err(|e| e.to_string())?,
                Body::Direct(d) => d.next().await.transpose()?,
            };
            let Some(chunk) = chunk else { break };
            len += chunk.len();
            chunks.push(chunk);
        }
        Ok(match chunks.len() {
            1 => chunks.pop().unwrap_or_default(),
            _ => Bytes::from(chunks.concat()),
        })
    }

    /// An answer whose body this task reads from its connection.
    pub(super) fn direct(
        status: StatusCode,
        content_type: Option<HeaderValue>,
        passed: Vec<(HeaderName, HeaderValue)>,
        body: Direct,
    ) -> Self {
        Self {
            status,
            content_type,
            passed,
            body: Body::Direct(body),
            first: First::NotAsked,
            waited: Duration::ZERO,
        }
    }

    /// What [`Response::first_chunk`] found (tests).
    #[cfg(test)]
    pub(super) fn first(&self) -> &First {
        &self.first
    }

    pub(super) fn from_reqwest(r: reqwest::Response) -> Self {
        Self {
            status: StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
            content_type: r
                .headers()
                .get("content-type")
                .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()),
            passed: r
                .headers()
                .iter()
                .filter(|(name, _)| super::wire::passed_on(name.as_str()))
                .filter_map(|(name, value)| {
                    let name = HeaderName::from_bytes(name.as_str().as_bytes()).ok()?;
                    Some((name, HeaderValue::from_bytes(value.as_bytes()).ok()?))
                })
                .collect(),
            body: Body::Reqwest(r),
            first: First::NotAsked,
            waited: Duration::ZERO,
        }
    }
}
