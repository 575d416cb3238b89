//! A cluster's answer forwarded to the client: its body streamed back as it comes, watched for
//! its usage (the global router's learned output length), and ended with an error when the
//! cluster breaks it off or goes silent ([`respond`]).

use super::metrics::FailKind;
use super::GlobalState;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use kvrouter_core::global::ClusterId;
use std::sync::Arc;

use crate::error::CLUSTER_HEADER;

/// Why a cluster's answer ended before its end.
#[derive(Debug)]
enum Broke {
    /// The connection failed.
    Transfer(reqwest::Error),
    /// Nothing came for this long.
    Idle(std::time::Duration),
}

impl std::fmt::Display for Broke {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Broke::Transfer(e) => write!(f, "{e}"),
            Broke::Idle(d) => write!(
                f,
                "nothing for {} s (twice --stream-idle-timeout-secs)",
                d.as_secs_f64()
            ),
        }
    }
}

pub(super) fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "transfer-encoding" | "upgrade" | "te" | "trailer"
    )
}

/// Watches a response body for its usage's `completion_tokens` (the last one: a stream's final
/// chunk) and, when the body is done, tells the global router (its learned output hint).
pub(super) struct UsageTap {
    state: Arc<GlobalState>,
    cluster: ClusterId,
    /// The end of the previous chunk, for a key split across chunks.
    tail: Vec<u8>,
    output_tokens: Option<u64>,
}

impl UsageTap {
    /// A tap on a body from `cluster`.
    pub(super) fn new(state: Arc<GlobalState>, cluster: ClusterId) -> Self {
        Self {
            state,
            cluster,
            tail: Vec::new(),
            output_tokens: None,
        }
    }

    /// The cluster broke off the body: counted, and the cluster marked down if `down`.
    fn broken(&self, down: bool) {
        self.state.metrics.failed(self.cluster, FailKind::Broken);
        if down {
            let _ = self.state.lock().set_up(self.cluster, false);
        }
    }

    fn feed(&mut self, chunk: &[u8]) {
        let mut buf = std::mem::take(&mut self.tail);
        buf.extend_from_slice(chunk);
        if let Some(n) = completion_tokens(&buf) {
            self.output_tokens = Some(n);
        }
        self.tail = buf[buf.len().saturating_sub(64)..].to_vec();
    }
}

impl Drop for UsageTap {
    fn drop(&mut self) {
        if let Some(n) = self.output_tokens {
            let _ = self.state.lock().record_output(self.cluster, n);
        }
    }
}

/// What a forwarded body has sent so far, as far as its end needs: its last bytes.
struct Forwarded {
    /// The last bytes sent (at most [`Forwarded::KEPT`]).
    tail: Vec<u8>,
    /// The stream has ended (after an error event).
    ended: bool,
}

impl Forwarded {
    const KEPT: usize = 32;

    fn keep_tail(&mut self, chunk: &[u8]) {
        self.tail.extend_from_slice(chunk);
        let cut = self.tail.len().saturating_sub(Self::KEPT);
        self.tail.drain(..cut);
    }

    /// Whether the body ended with `data: [DONE]` (the stream's end).
    fn done(&self) -> bool {
        let t = self.tail.trim_ascii_end();
        t.ends_with(b"data: [DONE]") || t.ends_with(b"data:[DONE]")
    }

    /// Whether the body sent so far ends between two events (nothing, or a blank line).
    fn at_event_end(&self) -> bool {
        self.tail.is_empty() || self.tail.ends_with(b"\n\n") || self.tail.ends_with(b"\r\n\r\n")
    }
}

/// The last `"completion_tokens": N` in `bytes`.
fn completion_tokens(bytes: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"completion_tokens\"";
    let at = bytes.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = bytes[at + KEY.len()..]
        .iter()
        .skip_while(|b| b.is_ascii_whitespace() || **b == b':');
    let digits: Vec<u8> = rest.take_while(|b| b.is_ascii_digit()).copied().collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

/// The cluster's answer as the client's: status, headers but hop-by-hop ones,
/// `x-kvrouter-cluster`, and the body (`tap` watching it for its usage), which ends with an error
/// (an SSE error event for a stream) when the cluster breaks it off or sends nothing for `idle`
/// (twice `--stream-idle-timeout-secs`).
pub(super) fn respond(
    r: reqwest::Response,
    cluster: &str,
    tap: Option<UsageTap>,
    idle: Option<std::time::Duration>,
) -> Response {
    let status = r.status();
    let mut headers = HeaderMap::new();
    for (name, value) in r.headers() {
        if !hop_by_hop(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(cluster) {
        headers.insert(HeaderName::from_static(CLUSTER_HEADER), v);
    }
    let sse = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let cluster: Arc<str> = Arc::from(cluster);
    let upstream = futures::StreamExt::boxed(futures::StreamExt::map(r.bytes_stream(), |c| {
        c.map_err(Broke::Transfer)
    }));
    let state = Forwarded {
        tail: Vec::new(),
        ended: false,
    };
    // A broken stream's error event is its last item.
    let body = futures::stream::unfold(
        (upstream, tap, state),
        move |(mut up, mut tap, mut seen)| {
            let cluster = Arc::clone(&cluster);
            async move {
                if seen.ended {
                    return None;
                }
                let next = futures::StreamExt::next(&mut up);
                let next = match idle {
                    Some(bound) => match tokio::time::timeout(bound, next).await {
                        Ok(next) => next,
                        Err(_) => Some(Err(Broke::Idle(bound))),
                    },
                    None => next.await,
                };
                match next? {
                    Ok(b) => {
                        if let Some(t) = tap.as_mut() {
                            t.feed(&b);
                        }
                        seen.keep_tail(&b);
                        Some((Ok(b), (up, tap, seen)))
                    }
                    // The answer was whole ([DONE] went out): the cluster closing after it is
                    // no failure of this request.
                    Err(_) if sse && seen.done() => None,
                    Err(e) => {
                        // Silence is not a failure of the cluster's router (its poller says
                        // whether that answers): counted, not marked down.
                        let silent = matches!(e, Broke::Idle(_));
                        tracing::warn!(cluster = %cluster, error = %e, silent, "cluster broke off a response");
                        if let Some(t) = &tap {
                            t.broken(!silent);
                        }
                        seen.ended = true;
                        let item = if sse {
                            // The error goes out as an event of its own, after a partial one.
                            let mut out = Vec::new();
                            if !seen.at_event_end() {
                                out.extend_from_slice(b"\n\n");
                            }
                            out.extend_from_slice(&kvrouter_openai::sse::error_event(&format!(
                                "cluster {cluster} broke off the stream: {e}"
                            )));
                            Ok(Bytes::from(out))
                        } else {
                            Err(std::io::Error::other(e.to_string()))
                        };
                        Some((item, (up, tap, seen)))
                    }
                }
            }
        },
    );
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
mod tests {
    use super::{completion_tokens, Forwarded};

    #[test]
    fn a_forwarded_body_knows_its_end_and_event_boundary() {
        let mut f = Forwarded {
            tail: Vec::new(),
            ended: false,
        };
        assert!(f.at_event_end() && !f.done());
        f.keep_tail(b"data: {\"a\":1}\n\ndata: {\"b\"");
        assert!(!f.at_event_end() && !f.done());
        f.keep_tail(b":2}\n\n");
        assert!(f.at_event_end() && !f.done());
        f.keep_tail(b"data: [DO");
        f.keep_tail(b"NE]\n\n");
        assert!(f.done() && f.at_event_end());
        assert!(f.tail.len() <= Forwarded::KEPT);
    }

    #[test]
    fn completion_tokens_reads_the_last_usage() {
        assert_eq!(completion_tokens(b"{}"), None);
        let body = br#"{"usage":{"prompt_tokens":9,"completion_tokens": 42,"total_tokens":51}}"#;
        assert_eq!(completion_tokens(body), Some(42));
        let sse = b"data: {\"usage\":{\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"completion_tokens\":7}}\n\ndata: [DONE]";
        assert_eq!(completion_tokens(sse), Some(7));
        assert_eq!(completion_tokens(br#""completion_tokens":null"#), None);
    }
}
