//! HTTP/2 frames (RFC 9113 §4, §6): the 9-byte header read, and the frames a gRPC server sends
//! written into an output buffer. Header blocks are written with HPACK's literal forms only
//! (RFC 7541 §6.1, §6.2.2: the static table, no dynamic table, no Huffman), so the peer's
//! `SETTINGS_HEADER_TABLE_SIZE` never matters to what this side writes.

/// Frame types (RFC 9113 §6).
pub(crate) mod kind {
    pub(crate) const DATA: u8 = 0x0;
    pub(crate) const HEADERS: u8 = 0x1;
    pub(crate) const RST_STREAM: u8 = 0x3;
    pub(crate) const SETTINGS: u8 = 0x4;
    pub(crate) const PUSH_PROMISE: u8 = 0x5;
    pub(crate) const PING: u8 = 0x6;
    pub(crate) const GOAWAY: u8 = 0x7;
    pub(crate) const WINDOW_UPDATE: u8 = 0x8;
    pub(crate) const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub(crate) mod flag {
    pub(crate) const END_STREAM: u8 = 0x1;
    pub(crate) const ACK: u8 = 0x1;
    pub(crate) const END_HEADERS: u8 = 0x4;
    pub(crate) const PADDED: u8 = 0x8;
    pub(crate) const PRIORITY: u8 = 0x20;
}

/// Error codes (RFC 9113 §7).
pub(crate) mod code {
    pub(crate) const NO_ERROR: u32 = 0x0;
    pub(crate) const PROTOCOL_ERROR: u32 = 0x1;
    pub(crate) const FLOW_CONTROL_ERROR: u32 = 0x3;
    pub(crate) const STREAM_CLOSED: u32 = 0x5;
    pub(crate) const FRAME_SIZE_ERROR: u32 = 0x6;
    pub(crate) const REFUSED_STREAM: u32 = 0x7;
    pub(crate) const CANCEL: u32 = 0x8;
    pub(crate) const COMPRESSION_ERROR: u32 = 0x9;
    pub(crate) const ENHANCE_YOUR_CALM: u32 = 0xb;
}

/// Settings identifiers (RFC 9113 §6.5.2).
pub(crate) mod setting {
    pub(crate) const HEADER_TABLE_SIZE: u16 = 0x1;
    pub(crate) const ENABLE_PUSH: u16 = 0x2;
    pub(crate) const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub(crate) const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub(crate) const MAX_FRAME_SIZE: u16 = 0x5;
    pub(crate) const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// A frame header's length.
pub(crate) const HEADER_LEN: usize = 9;

/// A frame's 9-byte header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Head {
    pub(crate) len: usize,
    pub(crate) kind: u8,
    pub(crate) flags: u8,
    pub(crate) stream: u32,
}

impl Head {
    /// Reads a frame header from the first [`HEADER_LEN`] bytes of `b` (which must hold them).
    pub(crate) fn read(b: &[u8]) -> Self {
        Self {
            len: (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        }
    }

    pub(crate) fn has(&self, f: u8) -> bool {
        self.flags & f != 0
    }
}

/// Appends a frame header.
pub(crate) fn head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    debug_assert!(len < 1 << 24);
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

/// Appends a SETTINGS frame with `values` (or its acknowledgement, `values` empty and `ack`).
pub(crate) fn settings(out: &mut Vec<u8>, values: &[(u16, u32)], ack: bool) {
    head(
        out,
        values.len() * 6,
        kind::SETTINGS,
        if ack { flag::ACK } else { 0 },
        0,
    );
    for (id, v) in values {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&v.to_be_bytes());
    }
}

pub(crate) fn window_update(out: &mut Vec<u8>, stream: u32, increment: u32) {
    head(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.extend_from_slice(&(increment & 0x7fff_ffff).to_be_bytes());
}

/// Appends a PING: `flag::ACK` in `flags` for an answer.
pub(crate) fn ping(out: &mut Vec<u8>, flags: u8, payload: &[u8]) {
    head(out, 8, kind::PING, flags, 0);
    out.extend_from_slice(payload);
}

pub(crate) fn rst_stream(out: &mut Vec<u8>, stream: u32, error: u32) {
    head(out, 4, kind::RST_STREAM, 0, stream);
    out.extend_from_slice(&error.to_be_bytes());
}

pub(crate) fn goaway(out: &mut Vec<u8>, last_stream: u32, error: u32) {
    head(out, 8, kind::GOAWAY, 0, 0);
    out.extend_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
}

/// Appends a DATA frame carrying `payload`.
pub(crate) fn data(out: &mut Vec<u8>, stream: u32, payload: &[u8], end: bool) {
    head(
        out,
        payload.len(),
        kind::DATA,
        if end { flag::END_STREAM } else { 0 },
        stream,
    );
    out.extend_from_slice(payload);
}

/// Appends a HEADERS frame with the header block `block` (which must fit one frame).
pub(crate) fn headers(out: &mut Vec<u8>, stream: u32, block: &[u8], end: bool) {
    let flags = flag::END_HEADERS | if end { flag::END_STREAM } else { 0 };
    head(out, block.len(), kind::HEADERS, flags, stream);
    out.extend_from_slice(block);
}

/// Appends an HPACK integer with an `n`-bit prefix whose high bits are `first` (RFC 7541 §5.1).
pub(crate) fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// Appends `:status: 200` (static table entry 8, indexed).
fn hpack_status_200(out: &mut Vec<u8>) {
    out.push(0x80 | 8);
}

/// Appends a gRPC answer's head: `:status: 200` and `content-type: application/grpc`.
pub(crate) fn hpack_grpc_response(out: &mut Vec<u8>) {
    hpack_status_200(out);
    hpack_indexed_name(out, CONTENT_TYPE_INDEX, b"application/grpc");
}

/// Appends a header whose name is static table entry `index`, literal without indexing.
pub(crate) fn hpack_indexed_name(out: &mut Vec<u8>, index: usize, value: &[u8]) {
    hpack_int(out, 0x00, 4, index);
    hpack_int(out, 0x00, 7, value.len());
    out.extend_from_slice(value);
}

/// Appends a header with a literal name, literal without indexing.
pub(crate) fn hpack_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    hpack_int(out, 0x00, 7, name.len());
    out.extend_from_slice(name);
    hpack_int(out, 0x00, 7, value.len());
    out.extend_from_slice(value);
}

/// The static table's `content-type` entry (RFC 7541 Appendix A).
const CONTENT_TYPE_INDEX: usize = 31;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_head_reads_back() {
        let mut out = Vec::new();
        head(&mut out, 70_000, kind::DATA, flag::END_STREAM, 0x8000_0005);
        assert_eq!(out.len(), HEADER_LEN);
        let h = Head::read(&out);
        assert_eq!(
            h,
            Head {
                len: 70_000,
                kind: kind::DATA,
                flags: flag::END_STREAM,
                stream: 5,
            }
        );
        assert!(h.has(flag::END_STREAM) && !h.has(flag::PADDED));
    }

    #[test]
    fn hpack_integers_follow_rfc_7541_examples() {
        // C.1.1: 10 with a 5-bit prefix; C.1.2: 1337 with a 5-bit prefix.
        let mut out = Vec::new();
        hpack_int(&mut out, 0, 5, 10);
        assert_eq!(out, [0x0a]);
        out.clear();
        hpack_int(&mut out, 0, 5, 1337);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
    }

    #[test]
    fn written_header_blocks_decode_with_an_hpack_decoder() {
        let mut block = Vec::new();
        hpack_grpc_response(&mut block);
        let long = "m".repeat(300);
        hpack_literal(&mut block, b"grpc-message", long.as_bytes());
        let decoded = loona_hpack::Decoder::new().decode(&block).unwrap();
        let decoded: Vec<(String, String)> = decoded
            .into_iter()
            .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
            .collect();
        assert_eq!(
            decoded,
            [
                (":status".into(), "200".into()),
                ("content-type".into(), "application/grpc".into()),
                ("grpc-message".into(), long),
            ]
        );
    }
}
