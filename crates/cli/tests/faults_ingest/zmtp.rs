//! A hand-written ZMTP 3.0 publisher over raw TCP, to send a subscriber exactly the bytes a test
//! wants: valid greetings and messages, and the malformed ones a real PUB never sends.

#![allow(unreachable_pub, dead_code)]

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// A listening "publisher"; each subscriber connection is accepted by the test.
pub struct RawPub {
    listener: TcpListener,
}

impl RawPub {
    pub async fn bind() -> Self {
        Self {
            listener: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("tcp://{}", self.listener.local_addr().unwrap())
    }

    /// The next subscriber connection (the router reconnects within about a second).
    pub async fn accept(&self) -> TcpStream {
        let (stream, _) = timeout(Duration::from_secs(15), self.listener.accept())
            .await
            .expect("the subscriber (re)connects in time")
            .unwrap();
        stream.set_nodelay(true).unwrap();
        stream
    }
}

/// The 64-byte greeting of a NULL-mechanism ZMTP 3.0 peer.
pub fn greeting() -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut mechanism = b"NULL".to_vec();
    mechanism.resize(20, 0);
    g.extend(mechanism);
    g.push(0); // as-server
    g.resize(64, 0);
    g
}

/// A command frame: `name` then `body`.
pub fn command(name: &str, body: &[u8]) -> Vec<u8> {
    let mut data = vec![name.len() as u8];
    data.extend(name.as_bytes());
    data.extend(body);
    frame_with_flags(0x04, &data)
}

/// `READY` announcing a PUB socket.
pub fn ready() -> Vec<u8> {
    let mut props = vec![11u8];
    props.extend(b"Socket-Type");
    props.extend(3u32.to_be_bytes());
    props.extend(b"PUB");
    command("READY", &props)
}

fn frame_with_flags(flags: u8, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 9);
    if data.len() < 256 {
        out.push(flags);
        out.push(data.len() as u8);
    } else {
        out.push(flags | 0x02);
        out.extend((data.len() as u64).to_be_bytes());
    }
    out.extend(data);
    out
}

/// A message of `frames`.
pub fn message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { 0x01 } else { 0 };
        out.extend(frame_with_flags(more, f));
    }
    out
}

/// A KV event message `[topic, seq, payload]`.
pub fn event_message(seq: u64, payload: &[u8]) -> Vec<u8> {
    message(&[b"", &seq.to_be_bytes(), payload])
}

/// Reads one frame (or command) of the peer; returns its body.
async fn read_frame(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let flags = stream.read_u8().await?;
    let len = if flags & 0x02 != 0 {
        stream.read_u64().await? as usize
    } else {
        stream.read_u8().await? as usize
    };
    let mut body = vec![0; len.min(1 << 16)];
    stream.read_exact(&mut body).await?;
    Ok(body)
}

/// Completes the handshake as a PUB: greetings, then READY both ways. An error means the
/// subscriber closed this connection (it may have given up on it for a newer one).
pub async fn handshake(stream: &mut TcpStream) -> std::io::Result<()> {
    timeout(Duration::from_secs(10), async {
        stream.write_all(&greeting()).await?;
        let mut peer = [0u8; 64];
        stream.read_exact(&mut peer).await?;
        assert_eq!(peer[0], 0xff, "a ZMTP greeting");
        stream.write_all(&ready()).await?;
        let body = read_frame(stream).await?;
        assert!(body.starts_with(b"\x05READY"), "the subscriber's READY");
        Ok(())
    })
    .await
    .expect("handshake in time")
}

impl RawPub {
    /// The next subscriber connection that completes a handshake (at most 5 tries).
    pub async fn accept_handshaken(&self) -> TcpStream {
        for _ in 0..5 {
            let mut conn = self.accept().await;
            if handshake(&mut conn).await.is_ok() {
                return conn;
            }
        }
        panic!("no subscriber connection completed a handshake in 5 tries");
    }
}

/// Deterministic bytes (xorshift64*).
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.max(1);
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}
