//! What the picker's HTTP/2 connections promise a gateway: a bound on the streams one connection
//! carries (tonic leaves it unlimited; a gateway past it opens another connection).

use std::time::Duration;

#[tokio::test]
async fn a_connection_advertises_the_stream_bound() {
    let (_p, _base, grpc) = super::picker("1", &[]).await;
    let tcp = tokio::net::TcpStream::connect(&grpc)
        .await
        .expect("connect");
    let (send, mut connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let mut pings = connection
        .ping_pong()
        .expect("the connection's ping handle");
    let driver = tokio::spawn(connection);
    // A server's SETTINGS come before anything else it sends: once the pong is back, the
    // client has applied them.
    tokio::time::timeout(Duration::from_secs(10), pings.ping(h2::Ping::opaque()))
        .await
        .expect("a pong in time")
        .expect("a pong");
    assert_eq!(
        send.current_max_send_streams(),
        kvrouter_ext_proc::MAX_STREAMS_PER_CONNECTION as usize
    );
    driver.abort();
}

/// A peer that does not speak HTTP/2 gets the server's SETTINGS, a GOAWAY with
/// `PROTOCOL_ERROR` and the connection's end; the picker goes on serving.
#[tokio::test]
async fn a_peer_that_is_no_http2_client_is_sent_away_and_others_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_p, _base, grpc) = super::picker("1", &[]).await;
    let mut tcp = tokio::net::TcpStream::connect(&grpc)
        .await
        .expect("connect");
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut got))
        .await
        .expect("the picker closes the connection in time")
        .expect("read");
    let mut kinds = Vec::new();
    while let Some((kind, _, _, payload)) = take_frame(&mut got) {
        kinds.push(kind);
        if kind == 0x7 {
            assert_eq!(
                payload[4..8],
                1u32.to_be_bytes(),
                "GOAWAY with PROTOCOL_ERROR"
            );
        }
    }
    assert_eq!(kinds.first(), Some(&0x4), "SETTINGS first: {kinds:?}");
    assert_eq!(kinds.last(), Some(&0x7), "GOAWAY last: {kinds:?}");

    let mut client = super::connect(&grpc).await;
    let mut envoy = super::Envoy::open(&mut client).await;
    envoy
        .send(super::request_headers(super::BUFFERED, &[], None))
        .await;
    let r = envoy.recv().await;
    assert!(
        matches!(r.response, Some(super::Out::RequestHeaders(_))),
        "{r:?}"
    );
}

/// A gateway gone without closing its connection (a proxy between them drops every byte and
/// closes nothing): the picker PINGs the connection, hears nothing, closes it, and the load of
/// its stream is released. A gateway that answers PINGs keeps a quiet stream through many
/// keepalive periods.
#[tokio::test]
async fn a_gateway_gone_silent_is_cut_and_its_load_released_and_a_quiet_one_kept() {
    use super::common::proxy::Proxy;
    use super::{await_metric, completion, destination, metrics, request_body, response_headers};
    use super::{sum, ACTIVE, BUFFERED, SSE};
    let keepalive = 0.5;
    let (_p, base, grpc) =
        super::picker("1", &["--ext-proc-keepalive-secs", &keepalive.to_string()]).await;
    let port = grpc.rsplit(':').next().unwrap().parse().unwrap();
    let mut proxy = Proxy::new(port);
    proxy.start().await;

    // A request placed through each: the quiet gateway's directly, the lost one's via the proxy.
    let open = |addr: String, tail: u64| async move {
        let mut client = super::connect(&addr).await;
        let mut envoy = super::Envoy::open(&mut client).await;
        envoy
            .send(super::request_headers(BUFFERED, &[], None))
            .await;
        envoy.recv().await;
        envoy.send(request_body(&completion(2, tail), true)).await;
        assert!(destination(&envoy.recv().await).0.is_some());
        (client, envoy)
    };
    let (_quiet_client, mut quiet) = open(grpc.clone(), 0).await;
    let (_lost_client, _lost) = open(proxy.addr(), 1).await;
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 2.0);

    proxy.black_hole();
    await_metric(&base, ACTIVE, 1.0).await;
    await_metric(
        &base,
        "kvrouter_picks_total{source=\"ext_proc\",end=\"cancelled\"}",
        1.0,
    )
    .await;

    // Quiet for six periods more (time must pass: no event marks a cut that does not happen),
    // then the quiet stream's answer goes on and ends.
    tokio::time::sleep(Duration::from_secs_f64(keepalive * 6.0)).await;
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    quiet.send(response_headers(200)).await;
    quiet.recv().await;
    for (i, chunk) in SSE.iter().enumerate() {
        quiet
            .send(super::response_body(chunk, i == SSE.len() - 1))
            .await;
        quiet.recv().await;
    }
    await_metric(&base, ACTIVE, 0.0).await;
}

/// An HTTP/2 client written frame by frame, so that the picker reads its frames in the order
/// written: a PING written after them is answered once it has read them all.
struct RawClient {
    tcp: tokio::net::TcpStream,
    read: Vec<u8>,
}

/// One frame read: type, flags, stream and payload.
type RawFrame = (u8, u8, u32, Vec<u8>);

impl RawClient {
    async fn open(grpc: &str) -> Self {
        use tokio::io::AsyncWriteExt;
        let mut tcp = tokio::net::TcpStream::connect(grpc).await.expect("connect");
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend_from_slice(&Self::frame(0x4, 0, 0, &[]));
        tcp.write_all(&hello).await.expect("write");
        Self {
            tcp,
            read: Vec::new(),
        }
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Opens `Process` stream `id` and sends a message prefix announcing `announced` bytes,
    /// then `sent` bytes of it (zeros: no ext_proc message).
    async fn partial_message(&mut self, id: u32, announced: u32, sent: usize) {
        use tokio::io::AsyncWriteExt;
        // HPACK: :method POST and :scheme http indexed, the rest literals without indexing.
        let mut block = vec![0x83, 0x86];
        for (name, value) in [
            (
                ":path",
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            ),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] {
            block.push(0);
            block.push(name.len() as u8);
            block.extend_from_slice(name.as_bytes());
            block.push(value.len() as u8);
            block.extend_from_slice(value.as_bytes());
        }
        let mut wire = Self::frame(0x1, 0x4, id, &block);
        let mut message = vec![0u8];
        message.extend_from_slice(&announced.to_be_bytes());
        message.resize(5 + sent, 0);
        for chunk in message.chunks(16_384) {
            wire.extend_from_slice(&Self::frame(0x0, 0, id, chunk));
        }
        self.tcp.write_all(&wire).await.expect("write");
    }

    /// The frames the picker sent until it had read and answered everything written before:
    /// a PING is answered as it is read, before the effects of the frames read with it, which
    /// go out in the same write after it; so a second PING, written once the first is
    /// answered, is answered after them.
    async fn sync(&mut self) -> Vec<RawFrame> {
        let mut frames = self.ping().await;
        frames.extend(self.ping().await);
        frames
    }

    /// Writes a PING and reads until its answer: the frames the picker sent meanwhile.
    async fn ping(&mut self) -> Vec<RawFrame> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ping = Self::frame(0x6, 0, 0, b"rawsync!");
        self.tcp.write_all(&ping).await.expect("write");
        let mut frames = Vec::new();
        loop {
            while let Some(frame) = take_frame(&mut self.read) {
                if frame.0 == 0x6 && frame.1 & 1 != 0 && frame.3 == *b"rawsync!" {
                    return frames;
                }
                frames.push(frame);
            }
            let mut buf = [0u8; 65_536];
            let n = tokio::time::timeout(Duration::from_secs(30), self.tcp.read(&mut buf))
                .await
                .expect("the picker answers in time")
                .expect("read");
            assert!(n > 0, "the picker closed the connection");
            self.read.extend_from_slice(&buf[..n]);
        }
    }
}

/// The first whole frame of `read`, taken off it; `None` until one is whole.
fn take_frame(read: &mut Vec<u8>) -> Option<RawFrame> {
    let len = u32::from_be_bytes([0, *read.first()?, *read.get(1)?, *read.get(2)?]) as usize;
    if read.len() < 9 + len {
        return None;
    }
    let f: Vec<u8> = read.drain(..9 + len).collect();
    let stream = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & 0x7fff_ffff;
    Some((f[3], f[4], stream, f[9..].to_vec()))
}

/// The streams that ended among `frames`, with the `grpc-status` digit of their trailers
/// (written by the picker as a literal without Huffman coding).
fn ended(frames: &[RawFrame]) -> Vec<(u32, u8)> {
    frames
        .iter()
        .filter(|(kind, flags, _, _)| *kind == 0x1 && flags & 0x1 != 0)
        .map(|(_, _, stream, block)| {
            let at = block
                .windows(12)
                .position(|w| w == b"grpc-status\x01")
                .expect("grpc-status");
            (*stream, block[at + 12] - b'0')
        })
        .collect()
}

/// Messages not yet whole are bounded: two of the largest (the body bound + 64 KiB) per
/// gateway connection, and four over all connections. With a 1 MiB body bound: streams of
/// about 1 MB into their messages fit two to a connection, a third on that connection ends
/// `RESOURCE_EXHAUSTED`, and so does one on a third connection once two hold theirs; when a
/// connection closes, what it held is free again.
#[tokio::test]
async fn messages_not_yet_whole_are_bounded_per_connection_and_over_all() {
    const MB: usize = 1_000_000;
    let (_p, _base, grpc) = super::picker("1", &["--ext-proc-max-body-bytes", "1048576"]).await;
    let announced = 1 << 20;
    let (mut a, mut b, mut c) = (
        RawClient::open(&grpc).await,
        RawClient::open(&grpc).await,
        RawClient::open(&grpc).await,
    );
    a.partial_message(1, announced, MB).await;
    a.partial_message(3, announced, MB).await;
    assert_eq!(ended(&a.sync().await), []);
    a.partial_message(5, announced, 300_000).await;
    assert_eq!(
        ended(&a.sync().await),
        [(5, 8)],
        "past the connection's bound"
    );
    b.partial_message(1, announced, MB).await;
    b.partial_message(3, announced, MB).await;
    assert_eq!(ended(&b.sync().await), []);
    // A and B hold 4 MB; 0.6 MB more passes the 4.46 MB over all connections.
    c.partial_message(1, announced, 600_000).await;
    assert_eq!(ended(&c.sync().await), [(1, 8)], "past the bound over all");
    // A goes, and what it held with it: the same on C is read whole (and refused as no
    // ext_proc message, INVALID_ARGUMENT), not refused for room. The picker learns of A's end
    // on its own time (no event tells the client), so C tries again, a bounded number of
    // times, while the room is not back yet.
    drop(a);
    let mut id = 3;
    for attempt in 0.. {
        c.partial_message(id, announced, announced as usize).await;
        let ends = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let ends = ended(&c.sync().await);
                if !ends.is_empty() {
                    return ends;
                }
            }
        })
        .await
        .expect("C's stream ends in time");
        if ends == [(id, 8)] && attempt < 50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            id += 2;
            continue;
        }
        assert_eq!(ends, [(id, 3)], "room again once A closed");
        break;
    }
}
