//! The connection against frames written by hand (a client's side, with an HPACK encoder).

use super::frame::{self, code, flag, kind, setting, Head, HEADER_LEN};
use super::*;
use bytes::BytesMut;

fn limits() -> Limits {
    Limits {
        max_streams: 2,
        stream_window: 1 << 20,
        connection_window: 16 << 20,
        max_header_block: 4096,
        max_waiting: 1000,
    }
}

/// The frames in `out`, with their payloads.
fn frames(out: &[u8]) -> Vec<(Head, Vec<u8>)> {
    let mut v = Vec::new();
    let mut at = 0;
    while at < out.len() {
        let h = Head::read(&out[at..]);
        v.push((h, out[at + HEADER_LEN..at + HEADER_LEN + h.len].to_vec()));
        at += HEADER_LEN + h.len;
    }
    v
}

fn request_block(path: &str) -> Vec<u8> {
    let mut enc = loona_hpack::Encoder::new();
    enc.encode([
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", path.as_bytes()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ])
}

/// A connection that has read the preface and the client's SETTINGS; its output cleared.
fn open_connection(client_settings: &[(u16, u32)]) -> Connection {
    open_connection_with(limits(), client_settings)
}

fn open_connection_with(limits: Limits, client_settings: &[(u16, u32)]) -> Connection {
    let raised = limits.connection_window > 65_535;
    let mut c = Connection::new(limits);
    let mut wire = BytesMut::from(PREFACE);
    let mut settings = Vec::new();
    frame::settings(&mut settings, client_settings, false);
    wire.extend_from_slice(&settings);
    let mut events = Vec::new();
    c.receive(&mut wire, &mut events).unwrap();
    assert!(events.is_empty() && wire.is_empty());
    let out = frames(&std::mem::take(c.output()));
    let kinds: Vec<(u8, u8)> = out.iter().map(|(h, _)| (h.kind, h.flags)).collect();
    let mut expected = vec![(kind::SETTINGS, 0), (kind::SETTINGS, flag::ACK)];
    if raised {
        expected.insert(1, (kind::WINDOW_UPDATE, 0));
    }
    assert_eq!(kinds, expected);
    c
}

fn receive(c: &mut Connection, wire: &[u8]) -> Vec<Event> {
    let mut buf = BytesMut::from(wire);
    let mut events = Vec::new();
    c.receive(&mut buf, &mut events).unwrap();
    events
}

#[test]
fn a_stream_opens_with_its_path_and_its_data_comes_in_order() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/a/B"), false);
    // A padded DATA frame: pad length 3, then the data, then three bytes of padding.
    frame::head(&mut wire, 1 + 5 + 3, kind::DATA, flag::PADDED, 1);
    wire.extend_from_slice(&[3, b'h', b'e', b'l', b'l', b'o', 0, 0, 0]);
    frame::data(&mut wire, 1, b"!", true);
    // Byte by byte: partial frames wait in the buffer.
    let mut buf = BytesMut::new();
    let mut events = Vec::new();
    for b in wire {
        buf.extend_from_slice(&[b]);
        c.receive(&mut buf, &mut events).unwrap();
    }
    assert_eq!(
        events,
        [
            Event::Open {
                id: 1,
                path: "/a/B".into(),
                encoding: None,
                end: false
            },
            Event::Data {
                id: 1,
                data: Bytes::from_static(b"hello"),
                end: false
            },
            Event::Data {
                id: 1,
                data: Bytes::from_static(b"!"),
                end: true
            },
        ]
    );
}

#[test]
fn a_header_block_split_over_continuation_frames_is_read_whole() {
    let mut c = open_connection(&[]);
    let block = request_block("/split/Path");
    let (a, b) = block.split_at(block.len() / 2);
    let mut wire = Vec::new();
    frame::head(&mut wire, a.len(), kind::HEADERS, flag::END_STREAM, 3);
    wire.extend_from_slice(a);
    frame::head(&mut wire, b.len(), kind::CONTINUATION, flag::END_HEADERS, 3);
    wire.extend_from_slice(b);
    let events = receive(&mut c, &wire);
    assert_eq!(
        events,
        [Event::Open {
            id: 3,
            path: "/split/Path".into(),
            encoding: None,
            end: true
        }]
    );
}

#[test]
fn an_answer_that_ends_before_the_request_cuts_the_request_with_no_error() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    receive(&mut c, &wire);
    c.send_trailers(1, 14, "shutting down 100%", true);
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(out.len(), 2);
    let block = loona_hpack::Decoder::new().decode(&out[0].1).unwrap();
    assert_eq!(block[0], (b":status".to_vec(), b"200".to_vec()));
    assert_eq!(block[2], (b"grpc-status".to_vec(), b"14".to_vec()));
    assert_eq!(
        block[3],
        (b"grpc-message".to_vec(), b"shutting down 100%25".to_vec())
    );
    assert_eq!(
        (out[1].0.kind, out[1].1.as_slice()),
        (kind::RST_STREAM, &code::NO_ERROR.to_be_bytes()[..])
    );
    // Its late data is dropped, not an error.
    let mut wire = Vec::new();
    frame::data(&mut wire, 1, b"late", true);
    assert!(receive(&mut c, &wire).is_empty());
}

#[test]
fn streams_past_the_bound_are_refused_and_pings_answered() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    for id in [1, 3, 5] {
        frame::headers(&mut wire, id, &request_block("/p"), false);
    }
    frame::head(&mut wire, 8, kind::PING, 0, 0);
    wire.extend_from_slice(b"12345678");
    let events = receive(&mut c, &wire);
    assert_eq!(events.len(), 2);
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(
        out[0].0,
        Head {
            len: 4,
            kind: kind::RST_STREAM,
            flags: 0,
            stream: 5
        }
    );
    assert_eq!(out[0].1, code::REFUSED_STREAM.to_be_bytes());
    assert_eq!(
        (out[1].0.kind, out[1].0.flags, out[1].1.as_slice()),
        (kind::PING, flag::ACK, &b"12345678"[..])
    );
    // A reset frees a place.
    let mut wire = Vec::new();
    frame::rst_stream(&mut wire, 1, code::CANCEL);
    frame::headers(&mut wire, 7, &request_block("/p"), false);
    let events = receive(&mut c, &wire);
    assert_eq!(events[0], Event::Reset { id: 1 });
    assert!(matches!(events[1], Event::Open { id: 7, .. }));
}

/// The RST_STREAMs in `out`: (stream, error code).
fn resets(out: &[u8]) -> Vec<(u32, u32)> {
    frames(out)
        .iter()
        .filter(|(h, _)| h.kind == kind::RST_STREAM)
        .map(|(h, p)| (h.stream, u32::from_be_bytes([p[0], p[1], p[2], p[3]])))
        .collect()
}

/// The WINDOW_UPDATEs in `out`: (stream, increment).
fn window_updates(out: &[u8]) -> Vec<(u32, u32)> {
    frames(out)
        .iter()
        .filter(|(h, _)| h.kind == kind::WINDOW_UPDATE)
        .map(|(h, p)| (h.stream, u32::from_be_bytes([p[0], p[1], p[2], p[3]])))
        .collect()
}

#[test]
fn protocol_errors_end_the_connection() {
    let mut c = Connection::new(limits());
    let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\n\r\n"[..]);
    assert_eq!(
        c.receive(&mut buf, &mut Vec::new()).unwrap_err().code,
        code::PROTOCOL_ERROR
    );

    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::head(&mut wire, 20_000, kind::DATA, 0, 1);
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(
        c.receive(&mut buf, &mut Vec::new()).unwrap_err().code,
        code::FRAME_SIZE_ERROR
    );

    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &[0xff, 0xff, 0xff, 0xff], false);
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(
        c.receive(&mut buf, &mut Vec::new()).unwrap_err().code,
        code::COMPRESSION_ERROR
    );

    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 2, &request_block("/p"), false);
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(
        c.receive(&mut buf, &mut Vec::new()).unwrap_err().code,
        code::PROTOCOL_ERROR
    );
}

/// RFC 9113's connection errors, each after an open stream 3: the frame, and its code.
#[test]
fn frames_the_rfc_refuses_end_the_connection_with_its_code() {
    let frame_of = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut wire = Vec::new();
        frame::head(&mut wire, payload.len(), kind, flags, stream);
        wire.extend_from_slice(payload);
        wire
    };
    let mut settings_push = Vec::new();
    frame::settings(&mut settings_push, &[(setting::ENABLE_PUSH, 2)], false);
    let mut lower = Vec::new();
    frame::headers(&mut lower, 1, &request_block("/p"), false);
    let cases: [(&str, Vec<u8>, u32); 9] = [
        (
            "a 7-byte PING",
            frame_of(kind::PING, 0, 0, &[0; 7]),
            code::FRAME_SIZE_ERROR,
        ),
        (
            "a PING on a stream",
            frame_of(kind::PING, 0, 3, &[0; 8]),
            code::PROTOCOL_ERROR,
        ),
        (
            "a 3-byte RST_STREAM",
            frame_of(kind::RST_STREAM, 0, 3, &[0; 3]),
            code::FRAME_SIZE_ERROR,
        ),
        (
            "RST_STREAM on an idle stream",
            frame_of(kind::RST_STREAM, 0, 5, &[0; 4]),
            code::PROTOCOL_ERROR,
        ),
        (
            "WINDOW_UPDATE on an idle stream",
            frame_of(kind::WINDOW_UPDATE, 0, 7, &[0, 0, 0, 1]),
            code::PROTOCOL_ERROR,
        ),
        (
            "SETTINGS on a stream",
            frame_of(kind::SETTINGS, 0, 3, &[]),
            code::PROTOCOL_ERROR,
        ),
        (
            "a SETTINGS ACK with a payload",
            frame_of(kind::SETTINGS, flag::ACK, 0, &[0; 6]),
            code::FRAME_SIZE_ERROR,
        ),
        (
            "SETTINGS_ENABLE_PUSH 2",
            settings_push,
            code::PROTOCOL_ERROR,
        ),
        ("a new stream below the last", lower, code::PROTOCOL_ERROR),
    ];
    for (what, wire, expected) in cases {
        let mut c = open_connection(&[]);
        let mut open = Vec::new();
        frame::headers(&mut open, 3, &request_block("/p"), false);
        receive(&mut c, &open);
        let mut buf = BytesMut::from(&wire[..]);
        let e = c.receive(&mut buf, &mut Vec::new()).expect_err(what);
        assert_eq!(e.code, expected, "{what}: {}", e.reason);
    }
}

#[test]
fn data_after_the_requests_end_closes_the_stream() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), true);
    frame::data(&mut wire, 1, b"late", false);
    let events = receive(&mut c, &wire);
    assert!(matches!(
        events[0],
        Event::Open {
            id: 1,
            end: true,
            ..
        }
    ));
    assert_eq!(events[1], Event::Reset { id: 1 });
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(
        (out[0].0.kind, out[0].1.as_slice()),
        (kind::RST_STREAM, &code::STREAM_CLOSED.to_be_bytes()[..])
    );
    // Nothing more is written on it.
    c.send_trailers(1, 0, "", true);
    assert!(c.output().is_empty());
    assert_eq!(c.open_streams(), 0);
}

#[test]
fn a_smaller_peer_table_is_acknowledged_in_the_next_block_written() {
    let mut c = open_connection(&[(setting::HEADER_TABLE_SIZE, 0)]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    frame::headers(&mut wire, 3, &request_block("/p"), false);
    receive(&mut c, &wire);
    c.output().clear();
    c.send_headers(1);
    c.send_headers(3);
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(
        out[0].1[0], 0x20,
        "a size update to 0 opens the first block"
    );
    assert_eq!(out[1].1[0], 0x88, "and only the first");
    let mut d = loona_hpack::Decoder::new();
    d.set_max_allowed_table_size(4096);
    assert_eq!(
        d.decode(&out[0].1).unwrap()[0],
        (b":status".to_vec(), b"200".to_vec())
    );
}

#[test]
fn a_request_with_two_paths_is_refused_and_long_messages_are_cut() {
    let mut c = open_connection(&[]);
    let mut enc = loona_hpack::Encoder::new();
    let block = enc.encode([(&b":path"[..], &b"/a"[..]), (b":path", b"/b")]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &block, false);
    assert!(receive(&mut c, &wire).is_empty());
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(
        (out[0].0.stream, out[0].1.as_slice()),
        (1, &code::PROTOCOL_ERROR.to_be_bytes()[..])
    );

    let mut wire = Vec::new();
    frame::headers(&mut wire, 3, &request_block("/p"), false);
    receive(&mut c, &wire);
    c.send_trailers(3, 12, &"é".repeat(20_000), true);
    let out = frames(&std::mem::take(c.output()));
    assert!(out[0].1.len() < 16_384, "one frame: {}", out[0].1.len());
    let block = loona_hpack::Decoder::new().decode(&out[0].1).unwrap();
    let message = &block.iter().find(|(n, _)| n == b"grpc-message").unwrap().1;
    assert_eq!(
        message.len(),
        512 * 6,
        "1,024 bytes of two-byte characters, percent-encoded"
    );
}

/// A second header block that does not end its request, and one after the request's end, are
/// stream errors: the stream is reset and the connection's other streams go on.
#[test]
fn a_header_block_out_of_place_resets_only_its_stream() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    frame::headers(&mut wire, 3, &request_block("/p"), true);
    receive(&mut c, &wire);
    std::mem::take(c.output());
    let mut wire = Vec::new();
    // Trailers without END_STREAM on 1; a block after the end on 3.
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    frame::headers(&mut wire, 3, &request_block("/p"), true);
    let events = receive(&mut c, &wire);
    assert_eq!(events, [Event::Reset { id: 1 }, Event::Reset { id: 3 }]);
    assert_eq!(
        resets(c.output()),
        [(1, code::PROTOCOL_ERROR), (3, code::STREAM_CLOSED)]
    );
    // The connection goes on.
    let mut wire = Vec::new();
    frame::headers(&mut wire, 5, &request_block("/p"), false);
    let events = receive(&mut c, &wire);
    assert!(
        matches!(events[..], [Event::Open { id: 5, .. }]),
        "{events:?}"
    );
}

mod flow;
