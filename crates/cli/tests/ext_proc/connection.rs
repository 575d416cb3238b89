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

/// Messages not yet whole are bounded per connection, whatever the streams: two of the largest
/// size (64 MiB + 64 KiB each by default). Three streams each 50 MiB into a message announced
/// at 60 MiB: the one whose bytes pass the bound ends `RESOURCE_EXHAUSTED`, the others go on,
/// and the picker serves a new exchange.
#[tokio::test]
async fn messages_not_yet_whole_are_bounded_per_connection() {
    use bytes::Bytes;
    let (_p, _base, grpc) = super::picker("1", &[]).await;
    let tcp = tokio::net::TcpStream::connect(&grpc)
        .await
        .expect("connect");
    let (mut send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let driver = tokio::spawn(connection);
    let request = || {
        tonic::codegen::http::Request::post(format!(
            "http://{grpc}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
    };
    let chunk = Bytes::from(vec![0u8; 1 << 20]);
    let mut streams = Vec::new();
    for _ in 0..3 {
        send = send.ready().await.expect("ready");
        let (response, mut body) = send.send_request(request(), false).expect("a stream");
        let mut prefix = vec![0u8];
        prefix.extend_from_slice(&(60u32 << 20).to_be_bytes());
        body.send_data(prefix.into(), false).expect("prefix");
        for _ in 0..50 {
            body.send_data(chunk.clone(), false).expect("data");
        }
        streams.push((response, body));
    }
    // The third stream ends RESOURCE_EXHAUSTED.
    let (third, _third_body) = streams.pop().expect("three streams");
    let ended = async {
        let mut body = third.await.expect("an answer").into_body();
        while let Some(data) = body.data().await {
            data.expect("data");
        }
        body.trailers().await.expect("trailers").expect("trailers")
    };
    let trailers = tokio::time::timeout(Duration::from_secs(30), ended)
        .await
        .expect("the stream ends in time");
    let status = trailers
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(status.as_deref(), Some("8"), "{trailers:?}");
    drop(streams);
    driver.abort();

    let mut client = super::connect(&grpc).await;
    let mut envoy = super::Envoy::open(&mut client).await;
    envoy
        .send(super::request_headers(super::BUFFERED, &[], None))
        .await;
    assert!(matches!(
        envoy.recv().await.response,
        Some(super::Out::RequestHeaders(_))
    ));
}
