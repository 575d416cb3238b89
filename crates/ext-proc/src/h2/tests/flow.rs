//! Flow control both ways: answers waiting for the peer's windows, the windows this side
//! grants back, and the bounds on both.

use super::*;

/// A connection with HTTP/2's default connection window (so that half of it is read soon)
/// to a peer that grants its streams no window: every answer waits.
fn granting_nothing() -> Connection {
    let limits = Limits {
        connection_window: 65_535,
        ..limits()
    };
    open_connection_with(limits, &[(setting::INITIAL_WINDOW_SIZE, 0)])
}

#[test]
fn answers_wait_for_the_peers_window_and_trailers_follow_them() {
    // The client grants 10 bytes per stream.
    let mut c = open_connection(&[(setting::INITIAL_WINDOW_SIZE, 10)]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), true);
    receive(&mut c, &wire);
    c.send_headers(1);
    c.send_data(1, &[7; 25]);
    c.send_trailers(1, 0, "", false);
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(out.len(), 2, "headers and the first 10 bytes: {out:?}");
    assert_eq!((out[1].0.kind, out[1].1.len()), (kind::DATA, 10));
    // The window opens by 10, then by 100: the rest, then the trailers.
    let mut wire = Vec::new();
    frame::window_update(&mut wire, 1, 10);
    receive(&mut c, &wire);
    let out = frames(&std::mem::take(c.output()));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.len(), 10);
    let mut wire = Vec::new();
    frame::window_update(&mut wire, 1, 100);
    receive(&mut c, &wire);
    let out = frames(&std::mem::take(c.output()));
    let shape: Vec<(u8, usize, u8)> = out
        .iter()
        .map(|(h, p)| (h.kind, p.len(), h.flags))
        .collect();
    assert_eq!(shape[0], (kind::DATA, 5, 0));
    assert_eq!(shape[1].0, kind::HEADERS);
    assert!(out[1].0.has(flag::END_STREAM));
    let trailers = loona_hpack::Decoder::new().decode(&out[1].1).unwrap();
    assert_eq!(trailers, [(b"grpc-status".to_vec(), b"0".to_vec())]);
    assert_eq!(c.open_streams(), 0);
}

/// A peer that takes no answers (it grants no window) gets no more connection window once the
/// answers waiting reach the bound, and gets it when they go; one that sends past the window
/// it has is in error.
#[test]
fn the_connection_window_waits_while_answers_do() {
    let mut c = granting_nothing();
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    receive(&mut c, &wire);
    c.send_headers(1);
    c.send_data(1, &[7; 1500]);
    assert_eq!(c.waiting(), 1500);
    std::mem::take(c.output());
    // 40,000 bytes read, past half the window: not granted back while answers wait.
    let mut wire = Vec::new();
    for _ in 0..4 {
        frame::data(&mut wire, 1, &[0; 10_000], false);
    }
    receive(&mut c, &wire);
    assert_eq!(window_updates(&std::mem::take(c.output())), []);
    // The peer opens the stream's window: the answer goes, and the window is granted back.
    let mut wire = Vec::new();
    frame::window_update(&mut wire, 1, 2_000);
    receive(&mut c, &wire);
    let out = std::mem::take(c.output());
    assert_eq!(c.waiting(), 0);
    assert_eq!(window_updates(&out), [(0, 40_000)]);

    // Answers waiting again, and more DATA than the window the peer has: a connection error.
    c.send_data(1, &[7; 1500 + 2_000]);
    let mut wire = Vec::new();
    for _ in 0..7 {
        frame::data(&mut wire, 1, &[0; 10_000], false);
    }
    let mut buf = BytesMut::from(&wire[..]);
    let e = c.receive(&mut buf, &mut Vec::new()).unwrap_err();
    assert_eq!(e.code, code::FLOW_CONTROL_ERROR);
}

/// A reset stream's waiting answer goes with it, and the window it held back is granted.
#[test]
fn a_reset_stream_gives_back_what_its_answer_held() {
    let mut c = granting_nothing();
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    frame::headers(&mut wire, 3, &request_block("/p"), false);
    receive(&mut c, &wire);
    c.send_data(1, &[7; 600]);
    c.send_data(3, &[7; 600]);
    let mut wire = Vec::new();
    for _ in 0..4 {
        frame::data(&mut wire, 3, &[0; 10_000], false);
    }
    receive(&mut c, &wire);
    std::mem::take(c.output());
    let mut wire = Vec::new();
    frame::rst_stream(&mut wire, 1, code::CANCEL);
    receive(&mut c, &wire);
    assert_eq!(c.waiting(), 600);
    assert_eq!(window_updates(&std::mem::take(c.output())), [(0, 40_000)]);
}

#[test]
fn data_past_half_a_window_is_granted_back() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    let chunk = vec![0u8; 16_384];
    for _ in 0..40 {
        frame::data(&mut wire, 1, &chunk, false);
    }
    receive(&mut c, &wire);
    let updates: Vec<(u32, u32)> = frames(c.output())
        .iter()
        .filter(|(h, _)| h.kind == kind::WINDOW_UPDATE)
        .map(|(h, p)| (h.stream, u32::from_be_bytes([p[0], p[1], p[2], p[3]])))
        .collect();
    // 640 KiB read: the stream's 1 MiB window topped up once past its half.
    assert_eq!(updates, [(1, 32 * 16_384)]);
}

#[test]
fn bad_window_updates_reset_their_stream_or_end_the_connection() {
    let mut c = open_connection(&[]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    frame::headers(&mut wire, 3, &request_block("/p"), false);
    frame::window_update(&mut wire, 1, 0);
    frame::window_update(&mut wire, 3, 0x7fff_ffff);
    let events = receive(&mut c, &wire);
    assert_eq!(
        &events[2..],
        [Event::Reset { id: 1 }, Event::Reset { id: 3 }]
    );
    assert_eq!(
        resets(c.output()),
        [(1, code::PROTOCOL_ERROR), (3, code::FLOW_CONTROL_ERROR)]
    );
    let mut wire = Vec::new();
    frame::window_update(&mut wire, 0, 0);
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(
        c.receive(&mut buf, &mut Vec::new()).unwrap_err().code,
        code::PROTOCOL_ERROR
    );
}

/// A stream held back by its own window waits off the connection's list (a WINDOW_UPDATE of the
/// connection does not walk it), and goes on with its own WINDOW_UPDATE or a larger initial
/// window.
#[test]
fn a_stream_held_by_its_own_window_waits_for_that_window() {
    let mut c = open_connection(&[(setting::INITIAL_WINDOW_SIZE, 0)]);
    let mut wire = Vec::new();
    frame::headers(&mut wire, 1, &request_block("/p"), false);
    frame::headers(&mut wire, 3, &request_block("/p"), false);
    receive(&mut c, &wire);
    c.send_data(1, &[1; 100]);
    c.send_data(3, &[3; 100]);
    assert!(c.blocked.is_empty());
    let data = |out: &[u8]| -> Vec<(u32, usize)> {
        frames(out)
            .iter()
            .filter(|(h, _)| h.kind == kind::DATA)
            .map(|(h, p)| (h.stream, p.len()))
            .collect()
    };
    assert_eq!(data(&std::mem::take(c.output())), []);
    let mut wire = Vec::new();
    frame::window_update(&mut wire, 0, 1_000);
    frame::window_update(&mut wire, 1, 50);
    receive(&mut c, &wire);
    assert_eq!(data(&std::mem::take(c.output())), [(1, 50)]);
    assert!(c.blocked.is_empty());
    let mut wire = Vec::new();
    frame::settings(&mut wire, &[(setting::INITIAL_WINDOW_SIZE, 1_000)], false);
    receive(&mut c, &wire);
    assert_eq!(data(&std::mem::take(c.output())), [(1, 50), (3, 100)]);
    assert_eq!(c.waiting(), 0);
}
