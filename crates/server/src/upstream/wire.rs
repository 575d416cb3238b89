//! HTTP/1.1 on the wire for the upstream client, without I/O: the request's head, the
//! response's head (RFC 9112 §4–6) and the response body's framing (a length, chunked, or to
//! the connection's close). Bytes in, bytes out; the caller reads and writes the socket.

use axum::http::{HeaderName, HeaderValue};
use bytes::{Buf, Bytes, BytesMut};

/// Whether a worker's response header is passed on to the client: `retry-after` (and
/// `retry-after-ms`, which openai-python reads first) and the `x-ratelimit-*` family, which
/// tell a client when to come back. The router writes its own
/// framing, content type and `x-kvrouter-*` headers; the rest of the worker's are not sent.
pub(crate) fn passed_on(name: &str) -> bool {
    const RATE: &str = "x-ratelimit-";
    name.eq_ignore_ascii_case("retry-after")
        || name.eq_ignore_ascii_case("retry-after-ms")
        || name
            .get(..RATE.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(RATE))
}

/// Longest response head read (status line and headers).
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers in a response head.
const MAX_HEADERS: usize = 128;
/// Longest chunk-size line (size, extensions and CRLF).
const MAX_CHUNK_LINE: usize = 4096;
/// Most trailer bytes after the last chunk.
const MAX_TRAILER_BYTES: usize = 64 * 1024;

/// A length as a Content-Length writes it: ASCII digits only, surrounding whitespace aside
/// (`str::parse` would also take a leading `+`). `None` for anything else or too large.
pub(crate) fn decimal_length(value: &str) -> Option<u64> {
    let v = value.trim();
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// What is wrong with the upstream's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("response head longer than {MAX_HEAD_BYTES} bytes")]
    HeadTooLong,
    #[error("malformed chunked body: {0}")]
    Chunk(&'static str),
    #[error("connection closed {0}")]
    Closed(&'static str),
}

/// The head of a request: `POST` of a JSON body to `target` (path and query) at `host`, with
/// `authorization` when the workers want a key. (Both header values: no CR or LF can be in
/// them.)
pub(crate) fn request_head(
    target: &str,
    host: &str,
    request_id: &HeaderValue,
    authorization: Option<&HeaderValue>,
    body_len: usize,
) -> Vec<u8> {
    let request_id = request_id.as_bytes();
    let auth = authorization.map_or(&[][..], HeaderValue::as_bytes);
    let mut head =
        Vec::with_capacity(192 + target.len() + host.len() + request_id.len() + auth.len());
    for part in [
        "POST ".as_bytes(),
        target.as_bytes(),
        b" HTTP/1.1\r\nhost: ",
        host.as_bytes(),
        b"\r\ncontent-type: application/json\r\naccept: */*\r\n",
        crate::access::REQUEST_ID_HEADER.as_bytes(),
        b": ",
        request_id,
        b"\r\ncontent-length: ",
    ] {
        head.extend_from_slice(part);
    }
    head.extend_from_slice(body_len.to_string().as_bytes());
    if !auth.is_empty() {
        head.extend_from_slice(b"\r\nauthorization: ");
        head.extend_from_slice(auth);
    }
    head.extend_from_slice(b"\r\n\r\n");
    head
}

/// How the body of a response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body (204, 304).
    Empty,
    /// `content-length` bytes.
    Length(u64),
    /// `transfer-encoding: chunked`.
    Chunked,
    /// Everything until the connection closes.
    Close,
}

/// A response's head, as the router reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Head {
    pub(crate) status: u16,
    pub(crate) content_type: Option<HeaderValue>,
    /// The headers passed on to the client ([`passed_on`]).
    pub(crate) passed: Vec<(HeaderName, HeaderValue)>,
    pub(crate) framing: Framing,
    /// The connection may carry another request once the body has been read.
    pub(crate) keep_alive: bool,
}

/// Reads a response head from the front of `buf`, consuming it (and any informational 1xx
/// heads before it); `Ok(None)` while it is incomplete.
pub(crate) fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, WireError> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let len = match response.parse(buf) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLong)
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(WireError::Head(e.to_string())),
        };
        if len > MAX_HEAD_BYTES {
            return Err(WireError::HeadTooLong);
        }
        let status = response.code.unwrap_or(0);
        if status == 101 {
            return Err(WireError::Head("101 Switching Protocols".into()));
        }
        if (100..200).contains(&status) {
            // 100 Continue, 103 Early Hints: the final head follows.
            buf.advance(len);
            continue;
        }
        let head = head_of(status, response.version.unwrap_or(1), response.headers)?;
        buf.advance(len);
        return Ok(Some(head));
    }
}

fn head_of(status: u16, version: u8, headers: &[httparse::Header<'_>]) -> Result<Head, WireError> {
    let mut content_type = None;
    let mut passed = Vec::new();
    let mut length: Option<u64> = None;
    let mut chunked = None;
    let mut close = version == 0;
    for h in headers {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-type") {
            // The first, as `HeaderMap::get` answers.
            if content_type.is_none() {
                content_type = HeaderValue::from_bytes(h.value).ok();
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            for v in h.value.split(|&b| b == b',') {
                let v = std::str::from_utf8(v).map(str::trim).unwrap_or("");
                let n = decimal_length(v);
                match (n, length) {
                    (Some(n), None) => length = Some(n),
                    (Some(n), Some(m)) if n == m => {}
                    _ => return Err(WireError::Head(format!("content-length {v:?}"))),
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // The last coding decides: chunked, or the body runs to the close.
            let last = h.value.rsplit(|&b| b == b',').next().unwrap_or(b"");
            chunked = Some(trim(last).eq_ignore_ascii_case(b"chunked"));
        } else if passed_on(name) {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(h.value),
            ) {
                passed.push((n, v));
            }
        } else if name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|&b| b == b',').map(trim) {
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && version == 0 {
                    close = false;
                }
            }
        }
    }
    if version == 0 && chunked.is_some() {
        // RFC 9112 §6.1: a transfer coding in an HTTP/1.0 message is faulty framing.
        return Err(WireError::Head(
            "transfer-encoding in an HTTP/1.0 response".into(),
        ));
    }
    let framing = match (status, chunked, length) {
        (204 | 304, _, _) => Framing::Empty,
        (_, Some(true), _) => Framing::Chunked,
        (_, Some(false), _) => Framing::Close,
        (_, None, Some(n)) => Framing::Length(n),
        (_, None, None) => Framing::Close,
    };
    // A body framed by the close, or by both a coding and a length, ends the connection.
    let keep_alive =
        !close && framing != Framing::Close && !(chunked.is_some() && length.is_some());
    Ok(Head {
        status,
        content_type,
        passed,
        framing,
        keep_alive,
    })
}

fn trim(s: &[u8]) -> &[u8] {
    let start = s
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(s.len());
    let end = s
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &s[start..end]
}

/// What decoding gave.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Body bytes.
    Data(Bytes),
    /// More input is needed.
    More,
    /// The body is whole.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Body bytes left.
    Length(u64),
    /// A chunk-size line is next.
    Size,
    /// Bytes of the current chunk left.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines after the last chunk, and the empty line; bytes of them read so far.
    Trailers(usize),
    /// To the close.
    Close,
    Done,
}

/// The body of one response, decoded from the bytes after its head.
#[derive(Debug)]
pub(crate) struct Decoder {
    state: State,
}

impl Decoder {
    pub(crate) fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size,
            Framing::Close => State::Close,
        };
        Self { state }
    }

    /// The body is whole.
    #[cfg(test)]
    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Takes the next body bytes (or framing) from the front of `buf`.
    pub(crate) fn decode(&mut self, buf: &mut BytesMut) -> Result<Step, WireError> {
        loop {
            match self.state {
                State::Done => return Ok(Step::Done),
                State::Length(left) | State::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    let n = left.min(buf.len() as u64);
                    let data = buf.split_to(n as usize).freeze();
                    self.state = match (self.state, left - n) {
                        (State::Length(_), 0) => State::Done,
                        (State::Length(_), rest) => State::Length(rest),
                        (_, 0) => State::DataEnd,
                        (_, rest) => State::Data(rest),
                    };
                    return Ok(Step::Data(data));
                }
                State::Close => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    return Ok(Step::Data(buf.split().freeze()));
                }
                State::Size => {
                    let Some(line) = line_end(buf, MAX_CHUNK_LINE, "chunk-size line too long")?
                    else {
                        return Ok(Step::More);
                    };
                    let size = chunk_size(&buf[..line])?;
                    buf.advance(line + 2);
                    self.state = match size {
                        0 => State::Trailers(0),
                        n => State::Data(n),
                    };
                }
                State::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Step::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::Chunk("no CRLF after a chunk's data"));
                    }
                    buf.advance(2);
                    self.state = State::Size;
                }
                State::Trailers(read) => {
                    let left = MAX_TRAILER_BYTES.saturating_sub(read);
                    let Some(line) = line_end(buf, left, "trailers too long")? else {
                        return Ok(Step::More);
                    };
                    buf.advance(line + 2);
                    self.state = match line {
                        0 => State::Done,
                        _ => State::Trailers(read + line + 2),
                    };
                }
            }
        }
    }

    /// The connection closed: fine for a body that runs to the close (it is whole now), an
    /// error for any other that is not whole.
    pub(crate) fn closed(&mut self) -> Result<(), WireError> {
        match self.state {
            State::Done => Ok(()),
            State::Close => {
                self.state = State::Done;
                Ok(())
            }
            _ => Err(WireError::Closed("before the end of the body")),
        }
    }
}

/// Where the CRLF of the line at the front of `buf` begins; `None` while it is not all there.
fn line_end(buf: &[u8], max: usize, too_long: &'static str) -> Result<Option<usize>, WireError> {
    match memchr::memchr(b'\n', buf) {
        Some(0) => Err(WireError::Chunk("bare LF")),
        Some(i) if buf[i - 1] != b'\r' => Err(WireError::Chunk("bare LF")),
        Some(i) if i + 1 > max => Err(WireError::Chunk(too_long)),
        Some(i) => Ok(Some(i - 1)),
        None if buf.len() >= max => Err(WireError::Chunk(too_long)),
        None => Ok(None),
    }
}

/// The size of a chunk-size line (hex digits, then optional extensions).
fn chunk_size(line: &[u8]) -> Result<u64, WireError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let zeros = line[..digits].iter().take_while(|&&b| b == b'0').count();
    // At most 15 significant digits: any size that fits, none that could overflow.
    if digits == 0 || digits - zeros.min(digits - 1) > 15 {
        return Err(WireError::Chunk("bad chunk size"));
    }
    match line[digits..].iter().find(|b| !matches!(b, b' ' | b'\t')) {
        None | Some(b';') => {}
        Some(_) => return Err(WireError::Chunk("bad chunk size")),
    }
    let significant = &line[zeros.min(digits - 1)..digits];
    let text = std::str::from_utf8(significant).expect("hex digits are ASCII");
    u64::from_str_radix(text, 16).map_err(|_| WireError::Chunk("bad chunk size"))
}

#[cfg(test)]
mod tests;
