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
    // Frames: type at byte 3 of each 9-byte header.
    let mut kinds = Vec::new();
    let mut at = 0;
    while at + 9 <= got.len() {
        let len =
            usize::from(got[at]) << 16 | usize::from(got[at + 1]) << 8 | usize::from(got[at + 2]);
        kinds.push(got[at + 3]);
        if got[at + 3] == 0x7 {
            let error = &got[at + 13..at + 17];
            assert_eq!(error, 1u32.to_be_bytes(), "GOAWAY with PROTOCOL_ERROR");
        }
        at += 9 + len;
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
