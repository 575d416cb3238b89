//! Server-sent events: the one splitter of a byte stream into events (whatever the chunk
//! boundaries, events ended by a blank line in LF or CRLF), and the writer of `data:` events.

use bytes::Bytes;
use serde_json::Value;

/// The event that ends an OpenAI stream.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// The end (exclusive, the blank line included) of the first complete event in `buf`, looking
/// from `from` on (an earlier scan found no end before it).
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some(i + 2);
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') && i > 0 && buf[i - 1] == b'\r'
            {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

/// Whether bytes forwarded so far end an event: a blank line in LF or CRLF (as the splitter
/// reads them), or in CR alone.
pub fn ends_event(bytes: &[u8]) -> bool {
    bytes.ends_with(b"\n\n") || bytes.ends_with(b"\r\n\r\n") || bytes.ends_with(b"\r\r")
}

/// Whether `out` (bytes of a stream, `prev` the bytes that went before it, at least its last
/// line's start) holds the `[DONE]` line: `data:`, spaces, `[DONE]`, spaces, then a line end,
/// at the start of a line (a line not ended yet is not one: what follows may extend it). A JSON
/// string cannot hold a raw line end, so an answer's text saying `data: [DONE]` is not taken
/// for it.
pub fn done_line_in(prev: &[u8], out: &[u8]) -> bool {
    // Near the boundary: `prev`'s last 32 bytes joined to `out`'s first 32, on the stack (this
    // runs on every chunk of a passed-through stream).
    let (prev, head) = (
        &prev[prev.len().saturating_sub(32)..],
        &out[..out.len().min(32)],
    );
    let mut joined = [0u8; 64];
    joined[..prev.len()].copy_from_slice(prev);
    joined[prev.len()..prev.len() + head.len()].copy_from_slice(head);
    done_line(&joined[..prev.len() + head.len()], None) || done_line(out, prev.last())
}

/// [`done_line_in`] within `w`; `before_w`: the byte before `w`.
fn done_line(w: &[u8], before_w: Option<&u8>) -> bool {
    let blank = |b: &u8| *b == b' ' || *b == b'\t';
    memchr::memmem::find_iter(w, b"[DONE]").any(|at| {
        let mut before = &w[..at];
        while before.last().is_some_and(blank) {
            before = &before[..before.len() - 1];
        }
        let Some(start) = before.strip_suffix(b"data:") else {
            return false;
        };
        let line_start = matches!(start.last().or(before_w), Some(b'\n' | b'\r'));
        let line_end = w[at + 6..]
            .iter()
            .find(|b| !blank(b))
            .is_some_and(|b| *b == b'\n' || *b == b'\r');
        line_start && line_end
    })
}

/// The largest unfinished event a reader keeps waiting for its end: a stream past it without a
/// blank line is not SSE (an upstream sending a body without event breaks), and waiting on would
/// hold all of it in memory.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// Splits a stream of chunks into whole events. Bytes of an unfinished event wait in the buffer
/// until the chunk that finishes it arrives (see [`EventSplitter::over_limit`]).
#[derive(Debug, Default)]
pub struct EventSplitter {
    buffer: Vec<u8>,
    /// Bytes of `buffer` known to hold no event end (minus the last few, which may start one).
    scanned: usize,
}

impl EventSplitter {
    /// An empty splitter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buffer.extend_from_slice(chunk);
    }

    /// The next whole event, its blank line included, if one is buffered.
    pub fn next_event(&mut self) -> Option<Vec<u8>> {
        // An end found now may start up to three bytes before the unscanned part.
        match event_end(&self.buffer, self.scanned.saturating_sub(3)) {
            Some(end) => {
                self.scanned = 0;
                Some(self.buffer.drain(..end).collect())
            }
            None => {
                self.scanned = self.buffer.len();
                None
            }
        }
    }

    /// Bytes of an unfinished event.
    pub fn pending(&self) -> &[u8] {
        &self.buffer
    }

    /// Whether the unfinished event has grown past [`MAX_EVENT_BYTES`]: the reader should stop
    /// waiting for its end (fail the stream, or pass the bytes on unparsed).
    pub fn over_limit(&self) -> bool {
        self.buffer.len() > MAX_EVENT_BYTES
    }

    /// Drops the bytes of an unfinished event (its stream ended or was replaced).
    pub fn clear(&mut self) {
        self.buffer.clear();
        self.scanned = 0;
    }
}

/// The events of a buffer read whole, blank lines included; a last unfinished event too.
pub fn events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = event_end(rest, 0).unwrap_or(rest.len());
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// The payloads of an event's `data:` lines, trimmed.
pub fn data_lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    event
        .split(|b| *b == b'\n')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(<[u8]>::trim_ascii)
}

/// The payload of an event's first `data:` line (OpenAI events carry one).
pub fn data(event: &[u8]) -> Option<&[u8]> {
    data_lines(event).next()
}

/// Whether a payload is the stream's end marker.
pub fn is_done(data: &[u8]) -> bool {
    data == b"[DONE]"
}

/// The JSON payload of an event, if it carries one.
pub fn json(event: &[u8]) -> Option<Value> {
    serde_json::from_slice(data(event)?).ok()
}

/// One `data:` event carrying `value`.
pub fn data_event(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut out, value).expect("a JSON value serializes");
    out.extend_from_slice(b"\n\n");
    out
}

/// `value` as an event followed by `[DONE]`: the last events of a stream.
pub fn last_events(value: &Value) -> Bytes {
    let mut out = data_event(value);
    out.extend_from_slice(DONE_EVENT);
    Bytes::from(out)
}

/// An in-band error (the OpenAI error shape, an upstream's fault) followed by `[DONE]`: how a
/// stream that already answered 200 ends when its worker fails.
pub fn error_event(message: &str) -> Bytes {
    last_events(&crate::error::error_body(
        message,
        "upstream_error",
        None,
        502,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_event_without_an_end_is_over_the_limit_past_max_event_bytes() {
        let mut s = EventSplitter::new();
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..(MAX_EVENT_BYTES >> 20) {
            s.push(&chunk);
            assert!(s.next_event().is_none());
        }
        assert!(!s.over_limit());
        s.push(b"x");
        assert!(s.over_limit());
        s.clear();
        s.push(b"data: 1\n\n");
        assert_eq!(s.next_event().unwrap(), b"data: 1\n\n");
        assert!(!s.over_limit());
    }

    #[test]
    fn an_event_end_and_the_done_event_are_seen_in_any_line_ending() {
        for end in [&b"data: {}\n\n"[..], b"data: {}\r\n\r\n", b"data: {}\r\r"] {
            assert!(ends_event(end), "{end:?}");
        }
        for open in [
            &b"data: {}\n"[..],
            b"data: {}\r\n",
            b"data: {}\n\r",
            b"data: {}",
        ] {
            assert!(!ends_event(open), "{open:?}");
        }
        // The [DONE] line, whatever follows it, wherever the chunks were cut.
        let prev = b"\n";
        for done in [
            &b"data: [DONE]\n\n"[..],
            b"x\n\ndata:[DONE]\r\n\r\n",
            b"data: [DONE]  \n: ping\n\n",
        ] {
            assert!(done_line_in(prev, done), "{done:?}");
        }
        // A line not ended yet: what follows may extend it (`data: [DONE]garbage`).
        assert!(!done_line_in(prev, b"data: [DONE]"));
        assert!(done_line_in(b"\ndata: [DONE]", b"\n\n"));
        assert!(!done_line_in(b"\ndata: [DONE]", b"garbage\n\n"));
        assert!(done_line_in(b"{}\n\ndata: [DO", b"NE]\n\n"));
        assert!(done_line_in(b"{}\n\nda", b"ta: [DONE]\n\n"));
        for other in [
            &b"data: {}\n\n"[..],
            b"data: {\"text\":\"data: [DONE]\"}\n\n",
            b"[DONE]\n\n",
            b"data: [DONE]x\n\n",
        ] {
            assert!(!done_line_in(prev, other), "{other:?}");
        }
        // Not at a line start.
        assert!(!done_line_in(b"abc", b"data: [DONE]\n\n"));
    }

    #[test]
    fn event_boundaries_accept_lf_and_crlf() {
        assert_eq!(event_end(b"data: x\n\ndata: y", 0), Some(9));
        assert_eq!(event_end(b"data: x\r\n\r\n", 0), Some(11));
        assert_eq!(event_end(b"data: x\n", 0), None);
        assert_eq!(event_end(b"data: x\r\n", 0), None);
    }

    #[test]
    fn payloads_are_read_and_written() {
        let e = data_event(&serde_json::json!({"a": 1}));
        assert_eq!(e, b"data: {\"a\":1}\n\n");
        assert_eq!(data(&e), Some(&b"{\"a\":1}"[..]));
        assert_eq!(json(&e).unwrap()["a"], 1);
        assert!(is_done(data(DONE_EVENT).unwrap()));
        assert_eq!(data(b": keep-alive\n\n"), None);
        assert_eq!(data(b": c\r\ndata: x\r\n\r\n"), Some(&b"x"[..]));
        let err = error_event("gone");
        let first = events(&err).next().unwrap();
        assert_eq!(json(first).unwrap()["error"]["code"], 502);
        assert!(err.ends_with(DONE_EVENT));
        let all: Vec<&[u8]> = events(b"data: a\n\ndata: b").collect();
        assert_eq!(all, vec![&b"data: a\n\n"[..], &b"data: b"[..]]);
    }

    /// One event: a few `data:`/comment lines (no line breaks inside) and its line ending.
    fn event() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::collection::vec("(data: |: |data:)[a-z{}\":, \\[\\]]{0,12}", 1..3),
            any::<bool>(),
        )
            .prop_map(|(lines, crlf)| {
                let eol = if crlf { "\r\n" } else { "\n" };
                let mut e = String::new();
                for l in lines {
                    e += &l;
                    e += eol;
                }
                e += eol;
                e.into_bytes()
            })
    }

    fn config() -> ProptestConfig {
        ProptestConfig {
            cases: 256,
            failure_persistence: None,
            rng_algorithm: prop::test_runner::RngAlgorithm::ChaCha,
            rng_seed: prop::test_runner::RngSeed::Fixed(0x7373_652d_7370_6c74),
            ..ProptestConfig::default()
        }
    }

    proptest! {
        #![proptest_config(config())]

        /// Whatever the chunk boundaries, the splitter gives back exactly the events written,
        /// in order, and keeps an unfinished tail.
        #[test]
        fn splitting_is_independent_of_chunk_boundaries(
            written in prop::collection::vec(event(), 0..8),
            tail in "(data: )?[a-z]{0,6}",
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        ) {
            let mut stream: Vec<u8> = written.concat();
            stream.extend_from_slice(tail.as_bytes());
            // The naive model: cut the stream at sorted positions, feed each piece.
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
            at.sort_unstable();
            let mut splitter = EventSplitter::new();
            let mut got = Vec::new();
            let mut prev = 0;
            for cut in at.into_iter().chain([stream.len()]) {
                splitter.push(&stream[prev..cut]);
                prev = cut;
                while let Some(e) = splitter.next_event() {
                    got.push(e);
                }
            }
            prop_assert_eq!(&got, &written);
            prop_assert_eq!(splitter.pending(), tail.as_bytes());
            let whole: Vec<Vec<u8>> = events(&stream).map(<[u8]>::to_vec).collect();
            let mut expected = written.clone();
            if !tail.is_empty() {
                expected.push(tail.into_bytes());
            }
            prop_assert_eq!(whole, expected);
        }
    }
}
