//! The picker's accepted connections. tonic applies `Server::tcp_nodelay` only to listeners it
//! binds itself, not to a stream of connections handed to it, so this stream sets TCP_NODELAY on
//! each: without it every gRPC answer written while an earlier one is unacknowledged waits for
//! that ACK (Nagle). An accept error (out of file descriptors, say) is logged and retried after
//! [`ACCEPT_BACKOFF`], as the HTTP listener does, instead of at once: tonic skips an incoming
//! error and polls again, which on `EMFILE` would spin a core.

use futures::Stream;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// Wait after a failed accept before the next.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Connections accepted on `listener`, with TCP_NODELAY set. Never yields an error.
pub(crate) fn accepted(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> {
    futures::stream::unfold(listener, |listener| async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!("ext_proc: cannot set TCP_NODELAY: {e}");
                    }
                    return Some((Ok(stream), listener));
                }
                Err(e) => {
                    tracing::warn!("ext_proc: accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
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
