//! The request id (`x-request-id`) and the access log (`--access-log`).
//!
//! Every request gets an id: the client's `x-request-id` when it sends a valid one, otherwise
//! one the router makes. It is sent to the engine and returned in the response. The access log
//! is one `tracing` event per sampled request (target `kvrouter::access`), written once, when
//! the request ends, from the same line the provenance log completes (`request_line::log_line`); a
//! request that is not sampled costs one atomic add.

use crate::error::ServeError;
use crate::provenance::Provenance;
use axum::http::{HeaderMap, HeaderValue};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// The request-id header, read from clients, sent to engines, returned to clients.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The longest client request id accepted.
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// The `tracing` target of access lines.
pub const ACCESS_TARGET: &str = "kvrouter::access";

/// Which requests get an access line: a fraction `sample` of them, spread evenly.
#[derive(Debug)]
pub struct AccessLog {
    sample: f64,
    seen: AtomicU64,
}

impl AccessLog {
    /// Logs a fraction `sample` (clamped to 0..=1) of requests.
    pub fn new(sample: f64) -> Self {
        Self {
            sample: if sample.is_finite() {
                sample.clamp(0.0, 1.0)
            } else {
                0.0
            },
            seen: AtomicU64::new(0),
        }
    }

    /// Whether the next request is logged: the n-th request is when `floor(n * sample)` steps
    /// up, so a sample of 0.25 logs every 4th request, deterministically.
    pub(crate) fn sampled(&self) -> bool {
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        ((n + 1) as f64 * self.sample).floor() > (n as f64 * self.sample).floor()
    }
}

/// A random number drawn once per call from std's OS-seeded hasher keys (no RNG crate): the
/// per-process prefix of request ids and tag of pick ids.
pub(crate) fn process_random() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}

/// Makes request ids: a per-process random prefix and a counter.
#[derive(Debug)]
pub(crate) struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl RequestIds {
    pub(crate) fn new() -> Self {
        Self {
            prefix: process_random(),
            next: AtomicU64::new(0),
        }
    }

    /// The client's valid `x-request-id`, or a new one (a 400 naming the header when the
    /// client's is given twice, empty, too long or not made of visible ASCII).
    pub(crate) fn take(
        &self,
        headers: &HeaderMap,
    ) -> Result<HeaderValue, (HeaderValue, ServeError)> {
        let mut values = headers.get_all(REQUEST_ID_HEADER).iter();
        match (values.next(), values.next()) {
            (None, _) => Ok(self.make()),
            (Some(v), None) if valid(v.as_bytes()) => Ok(v.clone()),
            (Some(_), Some(_)) => Err((
                self.make(),
                invalid("is given more than once; give it once"),
            )),
            (Some(_), None) => Err((
                self.make(),
                invalid(&format!(
                    "must be 1 to {MAX_REQUEST_ID_BYTES} visible ASCII characters"
                )),
            )),
        }
    }

    /// `kvr-<prefix, 16 hex digits>-<counter>`, written digit by digit (`format!` cost a pick
    /// about 0.3 µs).
    fn make(&self) -> HeaderValue {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        HeaderValue::from_maybe_shared(bytes::Bytes::from(id_text(self.prefix, n)))
            .expect("ASCII id")
    }
}

/// The text of request id `n` under `prefix` ([`RequestIds::make`]).
fn id_text(prefix: u64, n: u64) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = Vec::with_capacity(4 + 16 + 1 + 20);
    id.extend_from_slice(b"kvr-");
    id.extend(
        (0..16)
            .rev()
            .map(|i| HEX[((prefix >> (4 * i)) & 0xf) as usize]),
    );
    id.push(b'-');
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    id.extend_from_slice(&digits[at..]);
    id
}

fn invalid(what: &str) -> ServeError {
    ServeError::invalid(
        format!("{REQUEST_ID_HEADER} {what}"),
        Some(REQUEST_ID_HEADER),
    )
}

/// 1 to [`MAX_REQUEST_ID_BYTES`] visible ASCII characters.
fn valid(id: &[u8]) -> bool {
    !id.is_empty() && id.len() <= MAX_REQUEST_ID_BYTES && id.iter().all(|b| b.is_ascii_graphic())
}

/// Writes the access line of a request that ended (answered, cancelled, failed or aborted).
pub(crate) fn emit(p: &Provenance) {
    tracing::info!(
        target: ACCESS_TARGET,
        request_id = p.x_request_id.as_deref().unwrap_or(""),
        model = p.model.as_deref(),
        worker = p.worker,
        status = p.status,
        http_status = p.http_status,
        prompt_tokens = p.prompt_tokens,
        completion_tokens = p.output_tokens,
        cached_tokens = p.cached_tokens,
        queue_ms = p.queue_ms,
        ttft_ms = p.ttft_ms,
        duration_ms = p.e2e_ms,
        migrations = p.migrations,
        pick = p.pick,
        "request"
    );
}

/// Writes the access line of a request the router refused before a worker answered it
/// (`pick`: a pick's source, as in [`emit`]).
pub(crate) fn emit_error(
    id: &HeaderValue,
    (model, pick): (Option<&str>, Option<&'static str>),
    e: &ServeError,
    e2e_ms: f64,
) {
    tracing::info!(
        target: ACCESS_TARGET,
        request_id = id.to_str().unwrap_or(""),
        model,
        status = e.status_label(),
        http_status = e.parts().0.as_u16(),
        duration_ms = e2e_ms,
        error = %e,
        pick,
        "request"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_logs_an_even_share_of_requests() {
        for (sample, of_100) in [(0.0, 0), (0.25, 25), (0.1, 10), (1.0, 100), (f64::NAN, 0)] {
            let log = AccessLog::new(sample);
            let n = (0..100).filter(|_| log.sampled()).count();
            assert_eq!(n, of_100, "sample {sample}");
        }
        let quarter = AccessLog::new(0.25);
        let picks: Vec<bool> = (0..8).map(|_| quarter.sampled()).collect();
        assert_eq!(
            picks,
            [false, false, false, true, false, false, false, true]
        );
    }

    #[test]
    fn request_ids_read_as_the_format_they_replace() {
        for (prefix, n) in [
            (0, 0),
            (0x0123_4567_89ab_cdef, 9),
            (u64::MAX, 10),
            (0xfeed, 1_234_567_890),
            (1, u64::MAX),
        ] {
            assert_eq!(
                id_text(prefix, n),
                format!("kvr-{prefix:016x}-{n}").into_bytes(),
                "{prefix:x} {n}"
            );
        }
    }

    #[test]
    fn client_ids_are_kept_when_valid_and_refused_otherwise() {
        let ids = RequestIds::new();
        let mut h = HeaderMap::new();
        let made = ids.take(&h).unwrap();
        assert!(made.to_str().unwrap().starts_with("kvr-"));
        assert_ne!(made, ids.take(&h).unwrap());
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("abc-123"));
        assert_eq!(ids.take(&h).unwrap(), "abc-123");
        for bad in ["", "has space", &"x".repeat(MAX_REQUEST_ID_BYTES + 1)] {
            h.insert(REQUEST_ID_HEADER, HeaderValue::from_str(bad).unwrap());
            let (fresh, e) = ids.take(&h).unwrap_err();
            assert!(fresh.to_str().unwrap().starts_with("kvr-"));
            assert!(e.to_string().contains(REQUEST_ID_HEADER), "{e}");
        }
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("a"));
        h.append(REQUEST_ID_HEADER, HeaderValue::from_static("b"));
        assert!(ids.take(&h).is_err());
        h.insert(
            REQUEST_ID_HEADER,
            HeaderValue::from_str(&"y".repeat(128)).unwrap(),
        );
        assert!(ids.take(&h).is_ok());
    }
}
