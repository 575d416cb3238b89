//! The server side of one HTTP/2 connection, sans I/O: the part of RFC 9113 a gRPC service
//! needs. Bytes read from the socket go in ([`Connection::receive`]) and come out as
//! [`Event`]s (a stream opened with its path, request bytes, a reset); answers go in (response
//! headers, messages, trailers) and come out as bytes to write ([`Connection::output`]).
//!
//! Why not `h2`: the picker answers each gateway message at once, so a full ext_proc exchange
//! is six small request/response round trips. Under `h2` and tonic every message crossed the
//! connection task, the stream's task and a channel back; here the I/O loop that reads a batch
//! of frames answers every message in it and writes all the answers with one write.
//!
//! What it does: the preface and SETTINGS (acknowledged; the peer's initial window and frame
//! size applied), PING answered, GOAWAY noted, HEADERS with CONTINUATION decoded by HPACK
//! ([`hpack`]: dynamic table and Huffman included), flow control both ways (the peer's
//! windows bound what is written, the rest waits per stream for its WINDOW_UPDATE; the
//! windows this side grants are topped up as data is read, the connection's only while the
//! answers waiting for the peer's windows stay under [`Limits::max_waiting`]), padding,
//! RST_STREAM both ways, the stream bound ([`Limits::max_streams`]; a stream past it is
//! refused with `REFUSED_STREAM`).
//! What it leaves out: server push, priorities (read and ignored), request trailers' contents
//! (their END_STREAM ends the request), and HTTP/1.1 upgrade (gRPC clients speak HTTP/2 from
//! the first byte). A protocol error ends the connection with GOAWAY ([`ConnError`]).

pub(crate) mod frame;
mod hpack;
mod receive;
mod send;
mod tables;

use bytes::Bytes;
use frame::setting;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// What a client sends first (RFC 9113 §3.4).
pub(crate) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The largest frame either side sends (HTTP/2's default, `SETTINGS_MAX_FRAME_SIZE` not raised).
const MAX_FRAME: usize = 16_384;
/// The largest flow-control window (RFC 9113 §6.9.1).
const MAX_WINDOW: i64 = 0x7fff_ffff;
/// The connection window every connection starts with (RFC 9113 §6.9.2).
const DEFAULT_WINDOW: i64 = 65_535;

/// The bounds of one connection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Streams open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub(crate) max_streams: u32,
    /// The window each stream gets (`SETTINGS_INITIAL_WINDOW_SIZE`).
    pub(crate) stream_window: u32,
    /// The connection's window (raised from 65,535 by a WINDOW_UPDATE at the start).
    pub(crate) connection_window: u32,
    /// The largest header block read (`SETTINGS_MAX_HEADER_LIST_SIZE`, counted on the block's
    /// encoded bytes, and on its decoded fields as RFC 9113 counts them).
    pub(crate) max_header_block: usize,
    /// Answer bytes waiting for the peer's windows past which this side grants no more of the
    /// connection's window: the peer, which takes no answers, sends no more DATA.
    pub(crate) max_waiting: usize,
}

/// What the peer did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A new stream: its request headers. `end`: it carries no body.
    Open {
        id: u32,
        path: String,
        /// `grpc-encoding`, when not `identity`.
        encoding: Option<String>,
        end: bool,
    },
    /// Request body bytes; `end`: the request is over (END_STREAM, or its trailers).
    Data { id: u32, data: Bytes, end: bool },
    /// The peer reset the stream (RST_STREAM): it reads and sends nothing more.
    Reset { id: u32 },
}

/// A connection error (RFC 9113 §5.4.1): the connection ends with GOAWAY carrying `code`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ConnError {
    pub(crate) code: u32,
    pub(crate) reason: &'static str,
}

fn fail<T>(code: u32, reason: &'static str) -> Result<T, ConnError> {
    Err(ConnError { code, reason })
}

/// Tables keyed by stream id. Ids are the peer's odd counter, not chosen to collide, so a
/// multiplicative hash does (SipHash was a visible share of an exchange).
pub(crate) type ById<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// [`ById`]'s hasher: Fibonacci hashing of the id.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// One stream's send side.
#[derive(Debug, Default)]
struct Stream {
    send_window: i64,
    /// DATA payload waiting for window, in order.
    pending: VecDeque<u8>,
    /// The trailers' header block, once the answer ended (written after `pending`).
    trailers: Option<Vec<u8>>,
    /// In the connection's `blocked` list.
    queued: bool,
    /// The peer ended its side.
    remote_closed: bool,
    /// Bytes read on this stream and not yet granted back.
    unacked: u32,
}

/// A header block being collected across CONTINUATION frames.
struct Collecting {
    stream: u32,
    end_stream: bool,
    block: Vec<u8>,
}

/// One HTTP/2 connection's state.
pub(crate) struct Connection {
    limits: Limits,
    preface_read: bool,
    decoder: hpack::Decoder,
    collecting: Option<Collecting>,
    /// The highest stream id the peer opened.
    last_stream: u32,
    streams: ById<Stream>,
    /// Streams with data waiting for window.
    blocked: Vec<u32>,
    /// Bytes of DATA waiting for window, all streams together.
    waiting: usize,
    peer_initial_window: i64,
    peer_max_frame: usize,
    send_window: i64,
    /// Connection-level bytes read and not yet granted back (at most the connection window:
    /// a peer that sends more is in error).
    unacked: u32,
    /// The peer sent GOAWAY.
    peer_gone: bool,
    /// The peer's `SETTINGS_HEADER_TABLE_SIZE`, to acknowledge at the start of the next header
    /// block written.
    encoder_table: Option<u32>,
    out: Vec<u8>,
}

impl Connection {
    /// A connection that has sent nothing yet; its SETTINGS and window are in the output.
    pub(crate) fn new(limits: Limits) -> Self {
        // HPACK's default table size: this side does not raise SETTINGS_HEADER_TABLE_SIZE.
        let decoder = hpack::Decoder::new(4096).with_list_bound(limits.max_header_block);
        let mut out = Vec::with_capacity(4096);
        frame::settings(
            &mut out,
            &[
                (setting::MAX_CONCURRENT_STREAMS, limits.max_streams),
                (setting::INITIAL_WINDOW_SIZE, limits.stream_window),
                (
                    setting::MAX_HEADER_LIST_SIZE,
                    limits.max_header_block as u32,
                ),
            ],
            false,
        );
        let raise = i64::from(limits.connection_window) - DEFAULT_WINDOW;
        if raise > 0 {
            frame::window_update(&mut out, 0, raise as u32);
        }
        Self {
            limits,
            preface_read: false,
            decoder,
            collecting: None,
            last_stream: 0,
            streams: ById::default(),
            blocked: Vec::new(),
            peer_initial_window: DEFAULT_WINDOW,
            peer_max_frame: MAX_FRAME,
            send_window: DEFAULT_WINDOW,
            waiting: 0,
            unacked: 0,
            peer_gone: false,
            encoder_table: None,
            out,
        }
    }

    /// Bytes to write, in order; the caller writes and clears them.
    pub(crate) fn output(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Bytes in the output, not yet taken by the caller.
    pub(crate) fn unwritten(&self) -> usize {
        self.out.len()
    }

    /// The connection window the peer has when nothing is unacknowledged (the default, if the
    /// limit is below it: the window is never lowered).
    fn connection_window(&self) -> u32 {
        self.limits.connection_window.max(DEFAULT_WINDOW as u32)
    }

    /// Removes stream `id`, with whatever of its answer still waits for window.
    fn remove_stream(&mut self, id: u32) -> Option<Stream> {
        let s = self.streams.remove(&id)?;
        if !s.pending.is_empty() {
            self.waiting -= s.pending.len();
            self.grant_connection();
        }
        Some(s)
    }

    /// Grants the peer the connection window it used once that is half of it, unless the
    /// answers waiting for the peer's windows reached [`Limits::max_waiting`] (then when they
    /// go under it).
    fn grant_connection(&mut self) {
        let due = self.unacked >= self.connection_window() / 2;
        if due && self.waiting < self.limits.max_waiting {
            frame::window_update(&mut self.out, 0, self.unacked);
            self.unacked = 0;
        }
    }

    /// Bytes of answers waiting for the peer's windows.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting
    }

    /// Streams open (not yet ended both ways or reset), answers waiting for window included.
    pub(crate) fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// The peer sent GOAWAY: it opens no more streams.
    pub(crate) fn peer_gone(&self) -> bool {
        self.peer_gone
    }
}

#[cfg(test)]
mod tests;
