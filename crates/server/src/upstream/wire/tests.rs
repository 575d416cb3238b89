use super::*;
use proptest::prelude::*;

fn head(text: &str) -> Result<Option<Head>, WireError> {
    parse_head(&mut BytesMut::from(text))
}

/// Feeds `wire` to a decoder in the given pieces: the body, and whether it ended.
fn decode_pieces(
    framing: Framing,
    wire: &[u8],
    cuts: &[usize],
) -> Result<(Vec<u8>, bool), WireError> {
    let mut d = Decoder::new(framing);
    let mut buf = BytesMut::new();
    let mut body = Vec::new();
    let mut at = 0;
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.push(wire.len());
    for cut in cuts {
        buf.extend_from_slice(&wire[at..cut.max(at)]);
        at = cut.max(at);
        loop {
            match d.decode(&mut buf)? {
                Step::Data(b) => body.extend_from_slice(&b),
                Step::More => break,
                Step::Done => return Ok((body, true)),
            }
        }
    }
    Ok((body, false))
}

#[test]
fn a_request_head_names_its_target_host_length_and_id() {
    let h = request_head(
        "/v1/completions?x=1",
        "127.0.0.1:8000",
        &HeaderValue::from_static("abc-1"),
        None,
        42,
    );
    let text = String::from_utf8(h).unwrap();
    assert!(text.starts_with("POST /v1/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n"));
    assert!(text.contains("\r\ncontent-length: 42\r\n\r\n"));
    assert!(text.contains(&format!(
        "\r\n{}: abc-1\r\n",
        crate::access::REQUEST_ID_HEADER
    )));
    // It parses as a request.
    let mut headers = [httparse::EMPTY_HEADER; 16];
    let mut req = httparse::Request::new(&mut headers);
    assert!(req.parse(text.as_bytes()).unwrap().is_complete());
}

#[test]
fn a_request_head_carries_the_workers_key_when_one_is_set() {
    let key = HeaderValue::from_static("Bearer k-1");
    let h = request_head(
        "/v1/completions",
        "h:1",
        &HeaderValue::from_static("id"),
        Some(&key),
        7,
    );
    let text = String::from_utf8(h).unwrap();
    assert!(text.ends_with("\r\ncontent-length: 7\r\nauthorization: Bearer k-1\r\n\r\n"));
    let plain = request_head(
        "/v1/completions",
        "h:1",
        &HeaderValue::from_static("id"),
        None,
        7,
    );
    assert!(!String::from_utf8(plain).unwrap().contains("authorization"));
}

#[test]
fn heads_say_how_the_body_ends_and_whether_the_connection_stays() {
    let h = head(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .unwrap()
    .unwrap();
    assert_eq!(h.status, 200);
    assert_eq!(h.framing, Framing::Chunked);
    assert_eq!(h.content_type.unwrap(), "text/event-stream");
    assert!(h.keep_alive);
    let h = head("HTTP/1.1 400 Bad Request\r\nContent-Length: 12\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(
        (h.status, h.framing, h.keep_alive),
        (400, Framing::Length(12), true)
    );
    let h = head("HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 1\r\n\r\n")
        .unwrap()
        .unwrap();
    assert!(!h.keep_alive);
    // HTTP/1.0 keeps the connection only when asked to.
    let h = head("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n")
        .unwrap()
        .unwrap();
    assert!(!h.keep_alive);
    let h = head("HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\n")
        .unwrap()
        .unwrap();
    assert!(h.keep_alive);
    // No length, no coding: to the close.
    let h = head("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
    assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
    // A coding other than chunked last: to the close.
    let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(h.framing, Framing::Close);
    // Both a coding and a length: the coding wins, and the connection ends after it.
    let h = head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
    for status in [204, 304] {
        let h = head(&format!("HTTP/1.1 {status} X\r\ncontent-length: 9\r\n\r\n"))
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Empty);
    }
    // A coding in an HTTP/1.0 response is faulty framing.
    assert!(head("HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").is_err());
    // The first content-type counts.
    let h = head(
        "HTTP/1.1 200 OK\r\ncontent-type: a/b\r\ncontent-type: c/d\r\ncontent-length: 0\r\n\r\n",
    )
    .unwrap()
    .unwrap();
    assert_eq!(h.content_type.unwrap(), "a/b");
    // When to come back is kept for the client; other headers are not.
    let h = head(
        "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\nretry-after-ms: 7000\r\nX-RateLimit-Remaining-Requests: 0\r\n\
         server: uvicorn\r\nx-ratelimit: odd\r\ncontent-length: 0\r\n\r\n",
    )
    .unwrap()
    .unwrap();
    let passed: Vec<(String, &str)> = h
        .passed
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap()))
        .collect();
    assert_eq!(
        passed,
        [
            ("retry-after".to_owned(), "7"),
            ("retry-after-ms".to_owned(), "7000"),
            ("x-ratelimit-remaining-requests".to_owned(), "0")
        ]
    );
    // The same length twice is one length; two lengths are an error.
    let h = head("HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(h.framing, Framing::Length(3));
    for bad in ["3, 4", "-1", "+3", "3x", "", "99999999999999999999999"] {
        let text = format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\n");
        assert!(matches!(head(&text), Err(WireError::Head(_))), "{bad:?}");
    }
}

#[test]
fn informational_heads_are_skipped_and_partial_heads_wait() {
    let mut buf = BytesMut::from(
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi",
    );
    let h = parse_head(&mut buf).unwrap().unwrap();
    assert_eq!(h.status, 200);
    assert_eq!(&buf[..], b"hi");
    assert_eq!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap(), None);
    assert!(matches!(
        head("HTTP/1.1 101 Switching\r\n\r\n"),
        Err(WireError::Head(_))
    ));
    assert!(matches!(head("garbage\r\n\r\n"), Err(WireError::Head(_))));
    let long = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD_BYTES + 1));
    assert_eq!(head(&long), Err(WireError::HeadTooLong));
}

#[test]
fn chunked_bodies_with_extensions_and_trailers_decode_whole() {
    let wire = b"5;name=v\r\nhello\r\n1 \r\n,\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";
    let mut d = Decoder::new(Framing::Chunked);
    let mut buf = BytesMut::from(&wire[..]);
    let mut body = Vec::new();
    loop {
        match d.decode(&mut buf).unwrap() {
            Step::Data(b) => body.extend_from_slice(&b),
            Step::Done => break,
            Step::More => panic!("all there"),
        }
    }
    assert_eq!(body, b"hello, world");
    // What follows the body stays in the buffer.
    assert_eq!(&buf[..], b"NEXT");
    assert!(d.is_done());
}

#[test]
fn broken_framing_is_an_error_not_a_hang() {
    for bad in [
        &b"zz\r\n"[..],
        b"\r\n",
        b"5\nhello\r\n",
        b"5\r\nhelloXY",
        b"1234567890abcdef0\r\n",
        b"5 x\r\n",
    ] {
        let r = decode_pieces(Framing::Chunked, bad, &[]);
        assert!(r.is_err(), "{:?}: {r:?}", String::from_utf8_lossy(bad));
    }
    // Leading zeros are not significant digits.
    let padded = b"0000000000000000000005\r\nhello\r\n0\r\n\r\n";
    assert_eq!(
        decode_pieces(Framing::Chunked, padded, &[]).unwrap(),
        (b"hello".to_vec(), true)
    );
    let long = vec![b'1'; MAX_CHUNK_LINE];
    assert!(decode_pieces(Framing::Chunked, &long, &[]).is_err());
    let mut trailers = b"0\r\n".to_vec();
    while trailers.len() <= MAX_TRAILER_BYTES {
        trailers.extend_from_slice(b"x-t: 1\r\n");
    }
    assert!(decode_pieces(Framing::Chunked, &trailers, &[]).is_err());
    // A close before the end is an error, except for a body framed by the close.
    let mut d = Decoder::new(Framing::Length(3));
    assert!(d.closed().is_err());
    let mut d = Decoder::new(Framing::Close);
    assert!(d.closed().is_ok() && d.is_done());
}

/// `body` in chunks of the given sizes, with an extension on some, and trailers.
fn chunked(body: &[u8], sizes: &[usize], trailers: bool) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut at = 0;
    for (i, s) in sizes.iter().cycle().enumerate() {
        if at >= body.len() {
            break;
        }
        let n = (*s).max(1).min(body.len() - at);
        match i % 3 {
            0 => wire.extend_from_slice(format!("{n:x}\r\n").as_bytes()),
            1 => wire.extend_from_slice(format!("{n:X};ext=\"a\"\r\n").as_bytes()),
            _ => wire.extend_from_slice(format!("{n:x} ;e\r\n").as_bytes()),
        }
        wire.extend_from_slice(&body[at..at + n]);
        wire.extend_from_slice(b"\r\n");
        at += n;
    }
    wire.extend_from_slice(b"0\r\n");
    if trailers {
        wire.extend_from_slice(b"x-a: 1\r\nx-b: 2\r\n");
    }
    wire.extend_from_slice(b"\r\n");
    wire
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any body, in any chunk sizes, read in any pieces, comes out exactly (against the body
    /// itself as the model).
    #[test]
    fn chunked_decoding_gives_the_body_whatever_the_reads(
        body in proptest::collection::vec(any::<u8>(), 0..2000),
        sizes in proptest::collection::vec(1usize..300, 1..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        trailers in any::<bool>(),
    ) {
        let wire = chunked(&body, &sizes, trailers);
        let (out, done) = decode_pieces(Framing::Chunked, &wire, &cuts).unwrap();
        prop_assert!(done);
        prop_assert_eq!(out, body);
    }

    #[test]
    fn length_decoding_takes_exactly_its_length(
        body in proptest::collection::vec(any::<u8>(), 0..2000),
        extra in proptest::collection::vec(any::<u8>(), 0..50),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut wire = body.clone();
        wire.extend_from_slice(&extra);
        let (out, done) = decode_pieces(Framing::Length(body.len() as u64), &wire, &cuts).unwrap();
        prop_assert!(done);
        prop_assert_eq!(&out, &body);
        // Whole input at once: what follows the body stays in the buffer.
        let mut d = Decoder::new(Framing::Length(body.len() as u64));
        let mut buf = BytesMut::from(&wire[..]);
        let mut taken = Vec::new();
        while let Step::Data(b) = d.decode(&mut buf).unwrap() {
            taken.extend_from_slice(&b);
        }
        prop_assert_eq!(taken, body);
        prop_assert_eq!(&buf[..], &extra[..]);
    }

    /// Arbitrary bytes as a chunked body: an answer or an error, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(wire in proptest::collection::vec(any::<u8>(), 0..600),
                                   cuts in proptest::collection::vec(any::<usize>(), 0..6)) {
        let _ = decode_pieces(Framing::Chunked, &wire, &cuts);
        let _ = parse_head(&mut BytesMut::from(&wire[..]));
    }
}

/// A length is digits only, as a Content-Length writes it.
#[test]
fn a_decimal_length_is_digits_only() {
    assert_eq!(decimal_length("42"), Some(42));
    assert_eq!(decimal_length(" 7 "), Some(7));
    assert_eq!(decimal_length("0"), Some(0));
    for v in [
        "",
        " ",
        "+2",
        "-1",
        "1.0",
        "0x10",
        "1 2",
        "18446744073709551616",
    ] {
        assert_eq!(decimal_length(v), None, "{v:?}");
    }
}
