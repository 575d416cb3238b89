//! The picker's accepted connections. tonic applies `Server::tcp_nodelay` only to listeners it
//! binds itself, not to a stream of connections handed to it, so this stream sets TCP_NODELAY on
//! each: without it every gRPC answer written while an earlier one is unacknowledged waits for
//! that ACK (Nagle). The accept is the HTTP listener's ([`kvrouter_http::accept`]), which also
//! waits a little after a failed accept: tonic skips an incoming error and polls again at once,
//! which on `EMFILE` would spin a core.

use futures::Stream;
use tokio::net::{TcpListener, TcpStream};

/// Connections accepted on `listener`, with TCP_NODELAY set. Never yields an error.
pub(crate) fn accepted(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> {
    futures::stream::unfold(listener, |listener| async move {
        let tcp = kvrouter_http::accept(&listener).await;
        Some((Ok(tcp), listener))
    })
}

#[cfg(test)]
mod tests {
    use super::accepted;
    use futures::StreamExt;

    #[tokio::test]
    async fn accepted_connections_have_nodelay_set() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Box::pin(accepted(listener));
        let client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let server_side = incoming.next().await.unwrap().unwrap();
        assert!(server_side.nodelay().unwrap());
        drop(client);
    }
}
