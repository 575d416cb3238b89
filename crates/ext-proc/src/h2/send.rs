//! The send side of a [`Connection`]: response headers, DATA within the peer's windows (the
//! rest waits per stream), trailers after a stream's data, resets, PINGs and GOAWAY.

use super::frame::{self, code};
use super::Connection;

/// The payload of this side's PINGs (the peer echoes it).
const KEEPALIVE_PING: &[u8; 8] = b"kvrouter";

impl Connection {
    /// Writes the response headers of stream `id` (`:status: 200`, `content-type`).
    pub(crate) fn send_headers(&mut self, id: u32) {
        if !self.streams.contains_key(&id) {
            return;
        }
        let mut block = Vec::with_capacity(24);
        frame::hpack_grpc_response(&mut block);
        self.write_headers(id, &block, false);
    }

    /// Writes a HEADERS frame, opening its block with the table size update the peer's
    /// settings call for, if one is due.
    fn write_headers(&mut self, id: u32, block: &[u8], end: bool) {
        match self.encoder_table.take() {
            None => frame::headers(&mut self.out, id, block, end),
            Some(size) => {
                let mut with = Vec::with_capacity(block.len() + 6);
                // This side never adds to the table: any size the peer allows will do.
                frame::hpack_int(&mut with, 0x20, 5, size.min(4096) as usize);
                with.extend_from_slice(block);
                frame::headers(&mut self.out, id, &with, end);
            }
        }
    }

    /// Writes `bytes` as DATA on stream `id`, as far as the windows allow (the rest waits).
    pub(crate) fn send_data(&mut self, id: u32, bytes: &[u8]) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        if !s.pending.is_empty() {
            s.pending.extend(bytes);
            self.waiting += bytes.len();
            return;
        }
        let now = write_within(
            &mut self.out,
            (&mut self.send_window, &mut s.send_window),
            self.peer_max_frame,
            id,
            bytes,
        );
        if now < bytes.len() {
            s.pending.extend(&bytes[now..]);
            self.waiting += bytes.len() - now;
            self.park(id);
        }
    }

    /// Ends stream `id` with gRPC trailers (`grpc-status`, and `grpc-message` when not empty),
    /// after its waiting data; `trailers_only`: the stream had no response headers, so they
    /// go in this block too.
    pub(crate) fn send_trailers(
        &mut self,
        id: u32,
        status: u32,
        message: &str,
        trailers_only: bool,
    ) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let mut block = Vec::with_capacity(64);
        if trailers_only {
            frame::hpack_grpc_response(&mut block);
        }
        frame::hpack_literal(&mut block, b"grpc-status", status.to_string().as_bytes());
        if !message.is_empty() {
            // Bounded so that the block fits one frame whatever the message quotes.
            let message = percent_encode(truncated(message, MAX_MESSAGE));
            frame::hpack_literal(&mut block, b"grpc-message", message.as_bytes());
        }
        if s.pending.is_empty() {
            self.write_headers(id, &block, true);
            self.ended(id);
        } else {
            s.trailers = Some(block);
        }
    }

    /// Resets stream `id` (this side gives it up).
    pub(crate) fn reset(&mut self, id: u32, error: u32) {
        if self.remove_stream(id).is_some() {
            frame::rst_stream(&mut self.out, id, error);
        }
    }

    /// Asks the peer for a sign of life: a PING, which it must answer (RFC 9113 §6.7).
    pub(crate) fn ping(&mut self) {
        frame::ping(&mut self.out, 0, KEEPALIVE_PING);
    }

    /// Ends the connection: GOAWAY with `error` naming the last stream read.
    pub(crate) fn goaway(&mut self, error: u32) {
        frame::goaway(&mut self.out, self.last_stream, error);
    }

    /// This side's answer on `id` ended: a request still being sent is cut (RST_STREAM
    /// `NO_ERROR`, RFC 9113 §8.1: the answer is complete, the rest of the request unneeded).
    fn ended(&mut self, id: u32) {
        if let Some(s) = self.remove_stream(id) {
            if !s.remote_closed {
                frame::rst_stream(&mut self.out, id, code::NO_ERROR);
            }
        }
    }

    /// Stream `id`, with data waiting, joins the streams waiting for the connection's window
    /// when its own window has room (one without waits for its own WINDOW_UPDATE or a larger
    /// initial window, and costs nothing meanwhile).
    pub(super) fn park(&mut self, id: u32) {
        if let Some(s) = self.streams.get_mut(&id) {
            if s.send_window > 0 && !s.queued {
                s.queued = true;
                self.blocked.push(id);
            }
        }
    }

    /// The connection's window grew: writes what waited for it, in the order the streams
    /// blocked, until it is used up.
    pub(super) fn flush_blocked(&mut self) {
        let mut blocked = std::mem::take(&mut self.blocked).into_iter();
        let mut still = Vec::new();
        for id in blocked.by_ref() {
            let waits = self.flush_stream(id);
            if let Some(s) = self.streams.get_mut(&id) {
                // Kept while only the connection's window holds it back.
                if waits && s.send_window > 0 {
                    still.push(id);
                } else {
                    s.queued = false;
                }
            }
            if self.send_window <= 0 {
                break;
            }
        }
        still.extend(blocked);
        self.blocked = still;
    }

    /// The streams' initial window grew: every stream with data waiting may go on.
    pub(super) fn flush_all(&mut self) {
        let mut waiting: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| !s.pending.is_empty())
            .map(|(id, _)| *id)
            .collect();
        waiting.sort_unstable();
        for id in waiting {
            self.park(id);
        }
        self.flush_blocked();
    }

    /// Writes what stream `id` has waiting, as far as the windows allow, and its trailers once
    /// all of it went; whether some still waits.
    pub(super) fn flush_stream(&mut self, id: u32) -> bool {
        let Some(s) = self.streams.get_mut(&id) else {
            return false;
        };
        let now = write_within(
            &mut self.out,
            (&mut self.send_window, &mut s.send_window),
            self.peer_max_frame,
            id,
            s.pending.make_contiguous(),
        );
        s.pending.drain(..now);
        let waits = !s.pending.is_empty();
        let trailers = if waits { None } else { s.trailers.take() };
        if now > 0 {
            self.waiting -= now;
            self.grant_connection();
        }
        if let Some(block) = trailers {
            self.write_headers(id, &block, true);
            self.ended(id);
        }
        waits
    }
}

/// Writes as much of `bytes` as both flow-control windows (the connection's, the stream's)
/// allow, as DATA frames of at most `max_frame` bytes, taking it off the windows; how much it
/// wrote.
fn write_within(
    out: &mut Vec<u8>,
    (connection, stream): (&mut i64, &mut i64),
    max_frame: usize,
    id: u32,
    bytes: &[u8],
) -> usize {
    let room = (*connection).min(*stream).max(0) as usize;
    let now = bytes.len().min(room);
    for chunk in bytes[..now].chunks(max_frame) {
        frame::data(out, id, chunk, false);
    }
    *connection -= now as i64;
    *stream -= now as i64;
    now
}

/// The longest `grpc-message` written, in bytes before percent-encoding (at most three times
/// as long after it).
const MAX_MESSAGE: usize = 1024;

/// `s` cut to at most `max` bytes, at a character boundary.
fn truncated(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `grpc-message`'s percent-encoding (gRPC's HTTP/2 protocol: bytes outside 0x20–0x7e and `%`).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
