//! The receive side of a [`Connection`]: the preface, then frame by frame (RFC 9113 §6):
//! what the peer did as [`Event`]s, settings, pings and window updates applied, protocol
//! errors as [`ConnError`]s.

use super::frame::{self, code, flag, kind, setting, Head, HEADER_LEN};
use super::hpack;
use super::{
    fail, Collecting, ConnError, Connection, Event, Stream, MAX_FRAME, MAX_WINDOW, PREFACE,
};
use bytes::{Buf, Bytes, BytesMut};

impl Connection {
    /// Reads every whole frame in `buf` (leaving a partial one there), appending what the peer
    /// did to `events`.
    pub(crate) fn receive(
        &mut self,
        buf: &mut BytesMut,
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        if !self.preface_read {
            let n = buf.len().min(PREFACE.len());
            if buf[..n] != PREFACE[..n] {
                return fail(code::PROTOCOL_ERROR, "not an HTTP/2 connection preface");
            }
            if n < PREFACE.len() {
                return Ok(());
            }
            buf.advance(PREFACE.len());
            self.preface_read = true;
        }
        while buf.len() >= HEADER_LEN {
            let head = Head::read(buf);
            if head.len > MAX_FRAME {
                return fail(
                    code::FRAME_SIZE_ERROR,
                    "a frame over SETTINGS_MAX_FRAME_SIZE",
                );
            }
            if buf.len() < HEADER_LEN + head.len {
                buf.reserve(HEADER_LEN + head.len - buf.len());
                break;
            }
            buf.advance(HEADER_LEN);
            let payload = buf.split_to(head.len).freeze();
            self.frame(head, payload, events)?;
        }
        Ok(())
    }

    fn frame(
        &mut self,
        head: Head,
        payload: Bytes,
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        if self.collecting.is_some() && head.kind != kind::CONTINUATION {
            return fail(code::PROTOCOL_ERROR, "a frame inside a header block");
        }
        match head.kind {
            kind::DATA => self.on_data(head, payload, events),
            kind::HEADERS => self.on_headers(head, payload, events),
            kind::CONTINUATION => self.on_continuation(head, payload, events),
            kind::RST_STREAM => {
                if payload.len() != 4 {
                    return fail(code::FRAME_SIZE_ERROR, "an RST_STREAM not 4 bytes long");
                }
                if head.stream == 0 || head.stream > self.last_stream {
                    return fail(code::PROTOCOL_ERROR, "RST_STREAM on an idle stream");
                }
                if self.remove_stream(head.stream).is_some() {
                    events.push(Event::Reset { id: head.stream });
                }
                Ok(())
            }
            kind::SETTINGS => self.on_settings(head, &payload),
            kind::PING => {
                if payload.len() != 8 {
                    return fail(code::FRAME_SIZE_ERROR, "a PING not 8 bytes long");
                }
                if head.stream != 0 {
                    return fail(code::PROTOCOL_ERROR, "a PING on a stream");
                }
                if !head.has(flag::ACK) {
                    frame::ping(&mut self.out, flag::ACK, &payload);
                }
                Ok(())
            }
            kind::GOAWAY => {
                self.peer_gone = true;
                Ok(())
            }
            kind::WINDOW_UPDATE => self.on_window_update(head, &payload, events),
            kind::PUSH_PROMISE => fail(code::PROTOCOL_ERROR, "PUSH_PROMISE from a client"),
            // PRIORITY and unknown types are ignored (RFC 9113 §5.3.2, §4.1).
            _ => Ok(()),
        }
    }

    /// A stream error (RFC 9113 §5.4.2) on open stream `id`: reset with `error`, and its call
    /// told.
    fn stream_error(&mut self, id: u32, error: u32, events: &mut Vec<Event>) {
        self.reset(id, error);
        events.push(Event::Reset { id });
    }

    /// A frame's payload without its padding (RFC 9113 §6.1).
    fn unpadded(head: Head, mut payload: Bytes) -> Result<Bytes, ConnError> {
        if head.has(flag::PADDED) {
            let Some(&pad) = payload.first() else {
                return fail(
                    code::PROTOCOL_ERROR,
                    "a padded frame without its pad length",
                );
            };
            let pad = usize::from(pad);
            if pad >= payload.len() {
                return fail(code::PROTOCOL_ERROR, "padding longer than the frame");
            }
            payload.advance(1);
            payload.truncate(payload.len() - pad);
        }
        Ok(payload)
    }

    fn on_data(
        &mut self,
        head: Head,
        payload: Bytes,
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        if head.stream == 0 {
            return fail(code::PROTOCOL_ERROR, "DATA on stream 0");
        }
        // Flow control counts the whole payload, padding included (§6.9.1).
        let counted = payload.len() as u32;
        self.unacked += counted;
        if self.unacked > self.connection_window() {
            return fail(
                code::FLOW_CONTROL_ERROR,
                "DATA past the connection's window",
            );
        }
        self.grant_connection();
        let data = Self::unpadded(head, payload)?;
        let end = head.has(flag::END_STREAM);
        let stream_window = self.limits.stream_window;
        let Some(s) = self.streams.get_mut(&head.stream) else {
            // A stream this side ended or never saw: its data is dropped.
            if head.stream > self.last_stream {
                return fail(code::PROTOCOL_ERROR, "DATA on an idle stream");
            }
            return Ok(());
        };
        if s.remote_closed {
            // DATA after the request's end: the stream is closed (RFC 9113 §5.1), and so
            // is its answer.
            self.stream_error(head.stream, code::STREAM_CLOSED, events);
            return Ok(());
        }
        s.unacked += counted;
        if s.unacked > stream_window {
            return fail(code::FLOW_CONTROL_ERROR, "DATA past the stream's window");
        }
        if end {
            s.remote_closed = true;
        } else if s.unacked >= stream_window / 2 {
            frame::window_update(&mut self.out, head.stream, s.unacked);
            s.unacked = 0;
        }
        events.push(Event::Data {
            id: head.stream,
            data,
            end,
        });
        Ok(())
    }

    fn on_headers(
        &mut self,
        head: Head,
        payload: Bytes,
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        if head.stream == 0 {
            return fail(code::PROTOCOL_ERROR, "HEADERS on stream 0");
        }
        let mut block = Self::unpadded(head, payload)?;
        if head.has(flag::PRIORITY) {
            if block.len() < 5 {
                return fail(code::PROTOCOL_ERROR, "HEADERS too short for its priority");
            }
            block.advance(5);
        }
        let collecting = Collecting {
            stream: head.stream,
            end_stream: head.has(flag::END_STREAM),
            block: block.to_vec(),
        };
        self.collected(collecting, head, events)
    }

    fn on_continuation(
        &mut self,
        head: Head,
        payload: Bytes,
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        let Some(mut c) = self.collecting.take() else {
            return fail(code::PROTOCOL_ERROR, "CONTINUATION outside a header block");
        };
        if c.stream != head.stream {
            return fail(code::PROTOCOL_ERROR, "CONTINUATION on another stream");
        }
        c.block.extend_from_slice(&payload);
        self.collected(c, head, events)
    }

    /// A header block grown by the frame `head`: bounded, read once whole (END_HEADERS),
    /// else kept for the CONTINUATION frames.
    fn collected(
        &mut self,
        c: Collecting,
        head: Head,
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        if c.block.len() > self.limits.max_header_block {
            return fail(
                code::ENHANCE_YOUR_CALM,
                "a header block over the header list bound",
            );
        }
        if head.has(flag::END_HEADERS) {
            self.header_block(c, events)
        } else {
            self.collecting = Some(c);
            Ok(())
        }
    }

    /// A whole header block: a new stream's request headers, or a request's trailers.
    fn header_block(&mut self, c: Collecting, events: &mut Vec<Event>) -> Result<(), ConnError> {
        // Every block is decoded, whatever becomes of its stream: the decoder's table must
        // follow the peer's encoder.
        // Only the first `:path` and `grpc-encoding` are kept (a block that repeats a short
        // reference to a long value costs a lookup per byte, not a copy); a second `:path`
        // makes the request malformed (RFC 9113 §8.3.1).
        let (mut path, mut encoding, mut paths) = (None, None, 0);
        self.decoder
            .decode(&c.block, |name, value| match name {
                b":path" => {
                    paths += 1;
                    if paths == 1 {
                        path = Some(String::from_utf8_lossy(value).into_owned());
                    }
                }
                b"grpc-encoding" if value != b"identity" && encoding.is_none() => {
                    encoding = Some(String::from_utf8_lossy(value).into_owned());
                }
                _ => {}
            })
            .map_err(|e| match e.0 {
                hpack::LIST_TOO_LONG => ConnError {
                    code: code::ENHANCE_YOUR_CALM,
                    reason: hpack::LIST_TOO_LONG,
                },
                _ => ConnError {
                    code: code::COMPRESSION_ERROR,
                    reason: "a header block HPACK cannot decode",
                },
            })?;
        let id = c.stream;
        if let Some(s) = self.streams.get_mut(&id) {
            // Trailers: they end the request. Trailers that do not end it make it malformed
            // (RFC 9113 §8.1), and a block after its end is on a closed stream (§5.1): stream
            // errors, so the connection's other streams go on.
            let error = match (c.end_stream, s.remote_closed) {
                (_, true) => Some(code::STREAM_CLOSED),
                (false, _) => Some(code::PROTOCOL_ERROR),
                (true, false) => None,
            };
            if let Some(error) = error {
                self.stream_error(id, error, events);
                return Ok(());
            }
            s.remote_closed = true;
            events.push(Event::Data {
                id,
                data: Bytes::new(),
                end: true,
            });
            return Ok(());
        }
        if id <= self.last_stream {
            // Trailers of a stream this side already ended: nothing to do. Request headers
            // (they name a path) are a new stream's, whose id must be above the last one's.
            if paths > 0 {
                return fail(
                    code::PROTOCOL_ERROR,
                    "a new stream's id not above the last one's",
                );
            }
            return Ok(());
        }
        if id % 2 == 0 {
            return fail(code::PROTOCOL_ERROR, "a client stream with an even id");
        }
        self.last_stream = id;
        if paths > 1 {
            frame::rst_stream(&mut self.out, id, code::PROTOCOL_ERROR);
            return Ok(());
        }
        if self.streams.len() >= self.limits.max_streams as usize {
            frame::rst_stream(&mut self.out, id, code::REFUSED_STREAM);
            return Ok(());
        }
        self.streams.insert(
            id,
            Stream {
                send_window: self.peer_initial_window,
                remote_closed: c.end_stream,
                ..Stream::default()
            },
        );
        events.push(Event::Open {
            id,
            path: path.unwrap_or_default(),
            encoding,
            end: c.end_stream,
        });
        Ok(())
    }

    fn on_settings(&mut self, head: Head, payload: &[u8]) -> Result<(), ConnError> {
        if head.stream != 0 {
            return fail(code::PROTOCOL_ERROR, "SETTINGS on a stream");
        }
        if payload.len() % 6 != 0 || (head.has(flag::ACK) && !payload.is_empty()) {
            return fail(code::FRAME_SIZE_ERROR, "a malformed SETTINGS");
        }
        if head.has(flag::ACK) {
            return Ok(());
        }
        // Whether the streams' windows grew: only then can waiting data go.
        let mut opened = false;
        for s in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([s[0], s[1]]);
            let v = u32::from_be_bytes([s[2], s[3], s[4], s[5]]);
            match id {
                setting::INITIAL_WINDOW_SIZE => {
                    if v > 0x7fff_ffff {
                        return fail(
                            code::FLOW_CONTROL_ERROR,
                            "SETTINGS_INITIAL_WINDOW_SIZE too large",
                        );
                    }
                    let delta = i64::from(v) - self.peer_initial_window;
                    self.peer_initial_window = i64::from(v);
                    for s in self.streams.values_mut() {
                        s.send_window += delta;
                        if s.send_window > MAX_WINDOW {
                            return fail(code::FLOW_CONTROL_ERROR, "a stream window past 2^31-1");
                        }
                    }
                    opened |= delta > 0;
                }
                setting::MAX_FRAME_SIZE => {
                    if !(16_384..=16_777_215).contains(&v) {
                        return fail(code::PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range");
                    }
                    // This side writes frames of at most the default size anyway.
                    self.peer_max_frame = (v as usize).min(MAX_FRAME);
                }
                // The peer's decoder table: this side's literal encoding never adds to it, but
                // a table smaller than the one in use must be acknowledged by a size update at
                // the start of the next header block written (RFC 7541 §4.2; nghttp2 refuses
                // a block without it).
                setting::HEADER_TABLE_SIZE => self.encoder_table = Some(v),
                setting::ENABLE_PUSH if v > 1 => {
                    return fail(code::PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1");
                }
                // The other settings concern the peer's sending.
                _ => {}
            }
        }
        frame::settings(&mut self.out, &[], true);
        if opened {
            self.flush_all();
        }
        Ok(())
    }

    fn on_window_update(
        &mut self,
        head: Head,
        payload: &[u8],
        events: &mut Vec<Event>,
    ) -> Result<(), ConnError> {
        if payload.len() != 4 {
            return fail(code::FRAME_SIZE_ERROR, "a malformed WINDOW_UPDATE");
        }
        let inc = i64::from(
            u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) & 0x7fff_ffff,
        );
        if head.stream > self.last_stream {
            return fail(code::PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream");
        }
        if head.stream == 0 {
            if inc == 0 {
                return fail(code::PROTOCOL_ERROR, "a WINDOW_UPDATE of 0");
            }
            self.send_window += inc;
            if self.send_window > MAX_WINDOW {
                return fail(
                    code::FLOW_CONTROL_ERROR,
                    "the connection window past 2^31-1",
                );
            }
            self.flush_blocked();
        } else if let Some(s) = self.streams.get_mut(&head.stream) {
            s.send_window += inc;
            // A stream error (§6.9, §6.9.1): the stream is reset, the connection goes on.
            let error = match inc {
                0 => Some(code::PROTOCOL_ERROR),
                _ if s.send_window > MAX_WINDOW => Some(code::FLOW_CONTROL_ERROR),
                _ => None,
            };
            if let Some(error) = error {
                self.stream_error(head.stream, error, events);
            } else if !s.pending.is_empty() {
                // Only this stream's window grew.
                if self.flush_stream(head.stream) {
                    self.park(head.stream);
                }
            }
        }
        Ok(())
    }
}
