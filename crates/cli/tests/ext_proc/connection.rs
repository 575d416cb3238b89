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
