//! The ZMTP connection against a real libzmq PUB (what vLLM and SGLang publish with) and bad peers.

use super::*;
use std::io::{Read, Write};

const POLL: Duration = Duration::from_millis(50);

/// A libzmq PUB (what vLLM and SGLang publish with, through pyzmq) bound at `endpoint`; its
/// endpoint as bound.
fn libzmq_pub(ctx: &zmq::Context, endpoint: &str, heartbeat_ms: i32) -> (zmq::Socket, String) {
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    if heartbeat_ms > 0 {
        publisher.set_heartbeat_ivl(heartbeat_ms).unwrap();
        publisher.set_heartbeat_timeout(heartbeat_ms * 3).unwrap();
    }
    publisher.bind(endpoint).unwrap();
    let bound = publisher.get_last_endpoint().unwrap().unwrap();
    (publisher, bound)
}

/// The next message, the publisher sending `frames` again every poll until it arrives (a
/// PUB drops what it sends before the subscription reaches it); bounded.
fn receive(conn: &mut Connection, publisher: &zmq::Socket, frames: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    for _ in 0..100 {
        publisher.send_multipart(frames, 0).unwrap();
        if conn.next_message(&mut got).unwrap() {
            return got;
        }
    }
    panic!("no message from the publisher");
}

#[test]
fn a_libzmq_publisher_is_read_over_tcp_and_ipc() {
    let ctx = zmq::Context::new();
    let dir = std::env::temp_dir().join(format!("kvr-zmtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ipc = format!("ipc://{}", dir.join("pub").display());
    let stop = AtomicBool::new(false);
    for endpoint in ["tcp://127.0.0.1:0", ipc.as_str()] {
        let (publisher, bound) = libzmq_pub(&ctx, endpoint, 0);
        let mut conn =
            Connection::open(&bound, (Duration::from_secs(5), POLL), 1 << 20, &stop).unwrap();
        let seq = 7u64.to_be_bytes();
        let payload = vec![0xab; 3000];
        let frames: [&[u8]; 3] = [b"", &seq, &payload];
        let got = receive(&mut conn, &publisher, &frames);
        assert_eq!(got, frames.map(<[u8]>::to_vec), "{endpoint}");
        // Messages come whole and in order after the first.
        for n in 0..50u64 {
            publisher
                .send_multipart([&b"t"[..], &n.to_be_bytes(), &[1, 2, 3]], 0)
                .unwrap();
        }
        let mut seen = Vec::new();
        let mut frames = Vec::new();
        while seen.len() < 50 {
            if conn.next_message(&mut frames).unwrap() && frames[0] == b"t" {
                seen.push(u64::from_be_bytes(frames[1][..].try_into().unwrap()));
            }
        }
        assert_eq!(seen, (0..50).collect::<Vec<_>>(), "{endpoint}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_publisher_that_pings_is_answered_and_keeps_the_connection() {
    // libzmq ends a connection whose peer does not answer its PINGs within the timeout
    // (here 3 x 50 ms): reading on for ten times that shows the PONGs went back.
    let ctx = zmq::Context::new();
    let (publisher, bound) = libzmq_pub(&ctx, "tcp://127.0.0.1:0", 50);
    let stop = AtomicBool::new(false);
    let mut conn =
        Connection::open(&bound, (Duration::from_secs(5), POLL), 1 << 20, &stop).unwrap();
    receive(&mut conn, &publisher, &[b"", b"first"]);
    let until = Instant::now() + Duration::from_millis(1500);
    let mut frames = Vec::new();
    while Instant::now() < until {
        conn.next_message(&mut frames)
            .expect("the connection stays up");
    }
    publisher.send_multipart([&b""[..], b"after"], 0).unwrap();
    let mut last = Vec::new();
    for _ in 0..40 {
        if conn.next_message(&mut frames).unwrap() {
            last = frames.clone();
            break;
        }
    }
    assert_eq!(last, [b"".to_vec(), b"after".to_vec()]);
}

#[test]
fn bad_peers_and_bounds_are_errors_not_hangs() {
    let stop = AtomicBool::new(false);
    let times = (Duration::from_millis(300), POLL);
    // Not an endpoint we can connect to.
    assert!(matches!(
        Connection::open("inproc://x", times, 1 << 20, &stop),
        Err(ZmtpError::Endpoint(_))
    ));
    // A peer that never greets: the handshake times out; a stop ends it at once.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", silent.local_addr().unwrap());
    let started = Instant::now();
    assert!(matches!(
        Connection::open(&endpoint, times, 1 << 20, &stop),
        Err(ZmtpError::Protocol(_))
    ));
    assert!(started.elapsed() < Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    assert!(matches!(
        Connection::open(&endpoint, times, 1 << 20, &stop),
        Err(ZmtpError::Stopped)
    ));
    stop.store(false, Ordering::Relaxed);
    // A SUB is no publisher.
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_linger(0).unwrap();
    sub.bind("tcp://127.0.0.1:0").unwrap();
    let bound = sub.get_last_endpoint().unwrap().unwrap();
    assert!(matches!(
        Connection::open(&bound, times, 1 << 20, &stop),
        Err(ZmtpError::Protocol(_) | ZmtpError::Io(_))
    ));
    // A frame over the bound ends the connection.
    let (publisher, bound) = libzmq_pub(&ctx, "tcp://127.0.0.1:0", 0);
    let mut conn = Connection::open(&bound, times, 1000, &stop).unwrap();
    let big = vec![0u8; 5000];
    let mut frames = Vec::new();
    let err = (0..100).find_map(|_| {
        publisher.send_multipart([&big[..]], 0).unwrap();
        conn.next_message(&mut frames).err()
    });
    assert!(
        matches!(err, Some(ZmtpError::Oversize(5000, 1000))),
        "{err:?}"
    );
}

#[test]
fn a_pings_ttl_ends_a_connection_that_then_goes_quiet() {
    // A raw publisher: the handshake, one PING with a TTL of 0.3 s, then silence (a half-open
    // connection). The PONG comes back, and the connection ends once the TTL has passed.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let publisher = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut ready = vec![0x04, 0];
        let mut props = vec![5];
        props.extend_from_slice(b"READY");
        props.push(11);
        props.extend_from_slice(b"Socket-Type");
        props.extend(3u32.to_be_bytes());
        props.extend_from_slice(b"PUB");
        ready[1] = props.len() as u8;
        ready.extend(props);
        s.write_all(&greeting()).unwrap();
        s.write_all(&ready).unwrap();
        // Theirs: greeting (64), READY (2 + 25), subscription (3).
        let mut theirs = [0u8; 64 + 27 + 3];
        s.read_exact(&mut theirs).unwrap();
        assert_eq!(
            &theirs[64 + 27..],
            [0, 1, 1],
            "a subscription to every topic"
        );
        // PING: TTL 3 tenths, context "ab".
        s.write_all(&command(b"PING", &[0, 3, b'a', b'b'])).unwrap();
        let mut pong = [0u8; 2 + 5 + 2];
        s.read_exact(&mut pong).unwrap();
        assert_eq!(pong, [0x04, 7, 4, b'P', b'O', b'N', b'G', b'a', b'b']);
        // Quiet, but open, until the subscriber gives up.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let stop = AtomicBool::new(false);
    let mut conn =
        Connection::open(&endpoint, (Duration::from_secs(5), POLL), 1 << 20, &stop).unwrap();
    let started = Instant::now();
    let mut frames = Vec::new();
    let ended = loop {
        match conn.next_message(&mut frames) {
            Ok(_) if started.elapsed() < Duration::from_secs(5) => {}
            Ok(_) => break None,
            Err(e) => break Some(e),
        }
    };
    assert!(matches!(ended, Some(ZmtpError::Protocol(_))), "{ended:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    drop(conn);
    publisher.join().unwrap();
}
