//! A ZMTP 3.0 SUB connection read on the subscriber's own thread (`--kv-event-transport zmtp`):
//! the engine's PUB (libzmq's, as vLLM and SGLang publish with pyzmq, or zeromq-rs's, as the mock
//! engine does) is read straight from the socket, where libzmq's SUB reads it on its I/O thread
//! and hands each message to the subscriber thread through a mailbox (a second thread woken per
//! message, and a `poll` per mailbox check).
//!
//! What is spoken (ZMTP 3.0, RFC 23, with the NULL mechanism): the 64-byte greeting, the READY
//! commands (the peer must be a PUB or XPUB), a subscription to every topic sent as a message
//! (`\x01`: the 3.0 form, which every 3.x publisher reads), then frames: messages of one or
//! more frames, and commands, of which PING is answered with PONG (and its TTL kept: nothing
//! heard for that long ends the connection, RFC 37) and ERROR ends the connection. A frame over
//! the size bound ends the connection (as libzmq's `ZMQ_MAXMSGSIZE`).

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Why a connection could not be made or ended.
#[derive(Debug, thiserror::Error)]
pub(super) enum ZmtpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("endpoint {0:?} is neither tcp://HOST:PORT nor ipc://PATH")]
    Endpoint(String),
    #[error("the publisher broke the protocol: {0}")]
    Protocol(String),
    #[error("a frame of {0} bytes is over the bound of {1}")]
    Oversize(u64, u64),
    #[error("the subscriber is stopping")]
    Stopped,
}

fn protocol(what: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(what.into())
}

/// The socket under a connection.
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    /// Connects to `endpoint`: an error that another try cannot mend (no such scheme, no
    /// port, an ipc path a socket address cannot hold) is [`ZmtpError::Endpoint`]; a name that
    /// does not resolve now, or a refused connection, is an I/O error, tried again.
    fn open(endpoint: &str, timeout: Duration) -> Result<Self, ZmtpError> {
        let bad = || ZmtpError::Endpoint(endpoint.to_owned());
        if let Some(path) = endpoint.strip_prefix("ipc://") {
            // `@name`: a Linux abstract socket, as libzmq reads it.
            let addr = match path.strip_prefix('@') {
                #[cfg(target_os = "linux")]
                Some(name) => {
                    use std::os::linux::net::SocketAddrExt;
                    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
                }
                #[cfg(not(target_os = "linux"))]
                Some(_) => return Err(bad()),
                None => std::os::unix::net::SocketAddr::from_pathname(path),
            }
            .map_err(|_| bad())?;
            return Ok(Socket::Unix(UnixStream::connect_addr(&addr)?));
        }
        let addr = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
        let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad());
        }
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    // A subscriber never writes after subscribing, so a publisher whose host
                    // vanished (no FIN, no RST) would go unnoticed: TCP keepalive ends such a
                    // connection within about KEEPALIVE_IDLE + 3 x KEEPALIVE_INTERVAL.
                    let keepalive = socket2::TcpKeepalive::new()
                        .with_time(KEEPALIVE_IDLE)
                        .with_interval(KEEPALIVE_INTERVAL)
                        .with_retries(3);
                    socket2::SockRef::from(&s).set_tcp_keepalive(&keepalive)?;
                    return Ok(Socket::Tcp(s));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(
            || ZmtpError::Io(ErrorKind::AddrNotAvailable.into()),
            ZmtpError::Io,
        ))
    }

    /// Reads wait at most `read`; a write that cannot go out within `write` (a peer that stops
    /// reading) fails instead of holding the thread.
    fn set_timeouts(&self, read: Duration, write: Duration) -> std::io::Result<()> {
        self.set_read_timeout(read)?;
        match self {
            Socket::Tcp(s) => s.set_write_timeout(Some(write)),
            Socket::Unix(s) => s.set_write_timeout(Some(write)),
        }
    }

    fn set_read_timeout(&self, read: Duration) -> std::io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(Some(read)),
            Socket::Unix(s) => s.set_read_timeout(Some(read)),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// TCP keepalive of a KV event connection: probes after this long without traffic...
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// ...this far apart, three unanswered ending it.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// How long [`Connection::hold_ready`] waits for bytes not yet there.
const READY_WAIT: Duration = Duration::from_millis(1);

/// Frame flags (RFC 23).
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// The read buffer's first size (it doubles for a larger frame, up to the frame bound).
const READ_BUFFER: usize = 64 << 10;
/// Frames one message may have (a KV event message has 3).
const MAX_FRAMES: usize = 16;
/// Longest a write (the handshake's, a PONG) may wait for the peer to read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest PING context answered (RFC 37's bound).
const MAX_PING_CONTEXT: usize = 16;

/// Our greeting: ZMTP 3.0, the NULL mechanism, not the server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A command frame (short or long) with `name` and `body`.
fn command(name: &[u8], body: &[u8]) -> Vec<u8> {
    let len = 1 + name.len() + body.len();
    let mut out = Vec::with_capacity(len + 9);
    match u8::try_from(len) {
        Ok(short) => out.extend([COMMAND, short]),
        Err(_) => {
            out.push(COMMAND | LONG);
            out.extend((len as u64).to_be_bytes());
        }
    }
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(body);
    out
}

/// READY with our socket type.
fn ready() -> Vec<u8> {
    let mut props = vec![11];
    props.extend_from_slice(b"Socket-Type");
    props.extend(3u32.to_be_bytes());
    props.extend_from_slice(b"SUB");
    command(b"READY", &props)
}

/// A command frame's body as its name and what follows the name (`None`: the name is cut).
fn command_parts(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let (&n, rest) = body.split_first()?;
    let n = usize::from(n);
    Some((rest.get(..n)?, &rest[n..]))
}

/// The value of property `name` in a READY command's body (after its name).
fn property<'a>(mut props: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    while let Some((&n, rest)) = props.split_first() {
        let key = rest.get(..usize::from(n))?;
        let rest = &rest[usize::from(n)..];
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = rest.get(4..4 + len)?;
        if key.eq_ignore_ascii_case(name) {
            return Some(value);
        }
        props = &rest[4 + len..];
    }
    None
}

/// When a handshake gives up, and the flag that stops the subscriber.
type Deadline<'a> = (Instant, &'a AtomicBool);

/// An error once the handshake's time is up or the subscriber is stopping.
fn over((deadline, stop): Deadline<'_>) -> Result<(), ZmtpError> {
    if stop.load(Ordering::Relaxed) {
        return Err(ZmtpError::Stopped);
    }
    if Instant::now() >= deadline {
        return Err(protocol("the handshake timed out"));
    }
    Ok(())
}

/// One frame as read: its flags and body.
struct Frame {
    flags: u8,
    body: Vec<u8>,
}

/// A SUB connection after its handshake.
pub(super) struct Connection {
    socket: Socket,
    /// Bytes read and not yet framed: `buf[at..end]`.
    buf: Vec<u8>,
    at: usize,
    end: usize,
    /// Frames of the message being read (a message may span reads).
    partial: Vec<Vec<u8>>,
    /// Largest frame taken.
    max_frame: u64,
    /// Longest a [`Connection::next_message`] waits.
    poll: Duration,
    /// The publisher's heartbeat TTL (from its last PING): the connection ends when nothing
    /// comes for that long.
    ttl: Option<Duration>,
    /// When bytes last came.
    heard: Instant,
}

impl Connection {
    /// Connects to `endpoint`, completes the handshake within `handshake` and subscribes to
    /// every topic; reads then wait at most `poll` before [`Connection::next_message`] returns
    /// with nothing, so the caller can look at its stop flag.
    pub(super) fn open(
        endpoint: &str,
        (handshake, poll): (Duration, Duration),
        max_frame: u64,
        stop: &AtomicBool,
    ) -> Result<Self, ZmtpError> {
        let socket = Socket::open(endpoint, handshake.min(Duration::from_secs(1)))?;
        socket.set_timeouts(poll, WRITE_TIMEOUT)?;
        let mut c = Connection {
            socket,
            buf: vec![0; READ_BUFFER],
            at: 0,
            end: 0,
            partial: Vec::new(),
            max_frame,
            poll,
            ttl: None,
            heard: Instant::now(),
        };
        let deadline = (Instant::now() + handshake, stop);
        let mut hello = greeting().to_vec();
        hello.extend(ready());
        c.socket.write_all(&hello)?;
        let theirs = c.take(64, deadline)?;
        if theirs[0] != 0xff || theirs[9] != 0x7f {
            return Err(protocol("no ZMTP greeting"));
        }
        if theirs[10] < 3 {
            return Err(protocol(format!("ZMTP {}.x, not 3.x", theirs[10])));
        }
        if !theirs[12..32].starts_with(b"NULL") || theirs[12..32][4..].iter().any(|&b| b != 0) {
            return Err(protocol("a security mechanism other than NULL"));
        }
        let frame = c.frame(deadline)?;
        let props = match command_parts(&frame.body) {
            Some((b"READY", props)) if frame.flags & COMMAND != 0 => props,
            _ => return Err(protocol("no READY after the greeting")),
        };
        match property(props, b"Socket-Type") {
            Some(b"PUB" | b"XPUB") => {}
            other => {
                return Err(protocol(format!(
                    "the peer is a {} socket, not a PUB",
                    String::from_utf8_lossy(other.unwrap_or(b"(no type)"))
                )))
            }
        }
        // Every topic: the subscription as a one-byte message.
        c.socket.write_all(&[0, 1, 1])?;
        Ok(c)
    }

    /// `n` bytes, waiting for them until the handshake's deadline (or the stop flag).
    fn take(&mut self, n: usize, deadline: Deadline<'_>) -> Result<Vec<u8>, ZmtpError> {
        while self.end - self.at < n {
            over(deadline)?;
            self.fill()?;
        }
        let out = self.buf[self.at..self.at + n].to_vec();
        self.at += n;
        Ok(out)
    }

    /// A whole frame, waiting for it until the handshake's deadline (or the stop flag).
    fn frame(&mut self, deadline: Deadline<'_>) -> Result<Frame, ZmtpError> {
        loop {
            if let Some(frame) = self.parse()? {
                return Ok(frame);
            }
            over(deadline)?;
            self.fill()?;
        }
    }

    /// Reads what the socket has into the buffer (moving what is left to its start, or
    /// doubling it when a frame needs more room): `false` when the read timed out.
    fn fill(&mut self) -> Result<bool, ZmtpError> {
        if self.at == self.end {
            (self.at, self.end) = (0, 0);
            if self.buf.len() > READ_BUFFER {
                // A large frame has been taken: give its room back.
                self.buf.truncate(READ_BUFFER);
                self.buf.shrink_to_fit();
            }
        }
        if self.end == self.buf.len() {
            if self.at > 0 {
                self.buf.copy_within(self.at..self.end, 0);
                (self.at, self.end) = (0, self.end - self.at);
            } else {
                // One frame over the buffer (its size is within the bound, `parse` checked):
                // room for at most that frame, its header and a read more.
                let most = usize::try_from(self.max_frame)
                    .unwrap_or(usize::MAX)
                    .saturating_add(9 + READ_BUFFER);
                self.buf.resize((self.buf.len() * 2).min(most), 0);
            }
        }
        match self.socket.read(&mut self.buf[self.end..]) {
            Ok(0) => Err(ZmtpError::Io(ErrorKind::UnexpectedEof.into())),
            Ok(n) => {
                self.end += n;
                self.heard = Instant::now();
                Ok(true)
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// The next whole frame in the buffer, if one is there.
    fn parse(&mut self) -> Result<Option<Frame>, ZmtpError> {
        let b = &self.buf[self.at..self.end];
        let Some(&flags) = b.first() else {
            return Ok(None);
        };
        let (size, head) = if flags & LONG != 0 {
            match b.get(1..9) {
                Some(s) => (u64::from_be_bytes(s.try_into().expect("8 bytes")), 9),
                None => return Ok(None),
            }
        } else {
            match b.get(1) {
                Some(&s) => (u64::from(s), 2),
                None => return Ok(None),
            }
        };
        if size > self.max_frame {
            return Err(ZmtpError::Oversize(size, self.max_frame));
        }
        let size = size as usize;
        if b.len() < head + size {
            return Ok(None);
        }
        let body = b[head..head + size].to_vec();
        self.at += head + size;
        Ok(Some(Frame { flags, body }))
    }

    /// The next message's frames into `frames` (`true`), or `false` when the poll interval
    /// passed first (a message begun is kept for the next call), also while commands keep
    /// coming (a publisher's heartbeats), so the caller looks at its stop flag that often.
    pub(super) fn next_message(&mut self, frames: &mut Vec<Vec<u8>>) -> Result<bool, ZmtpError> {
        let until = Instant::now() + self.poll;
        loop {
            while let Some(frame) = self.parse()? {
                if frame.flags & COMMAND != 0 {
                    self.on_command(&frame.body)?;
                    continue;
                }
                self.partial.push(frame.body);
                let bytes: usize = self.partial.iter().map(Vec::len).sum();
                if self.partial.len() > MAX_FRAMES || bytes as u64 > self.max_frame {
                    return Err(protocol(format!(
                        "a message of more than {MAX_FRAMES} frames or {} bytes",
                        self.max_frame
                    )));
                }
                if frame.flags & MORE == 0 {
                    frames.clear();
                    frames.append(&mut self.partial);
                    return Ok(true);
                }
            }
            let filled = self.fill()?;
            if let Some(ttl) = self.ttl.filter(|ttl| self.heard.elapsed() > *ttl) {
                return Err(protocol(format!(
                    "nothing came within the publisher's heartbeat TTL ({} ms)",
                    ttl.as_millis()
                )));
            }
            if !filled || Instant::now() >= until {
                return Ok(false);
            }
        }
    }

    /// Takes the messages already received, waiting at most [`READY_WAIT`] for more, into
    /// `held` until it holds `max_bytes` (PINGs are answered on the way): what the subscriber
    /// does while a replay keeps it from reading, so that a publisher's heartbeats are answered
    /// and live messages wait, in order, in `held` instead of in the socket.
    pub(super) fn hold_ready(
        &mut self,
        held: &mut std::collections::VecDeque<Vec<Vec<u8>>>,
        held_bytes: &mut usize,
        max_bytes: usize,
    ) -> Result<(), ZmtpError> {
        self.socket.set_read_timeout(READY_WAIT)?;
        let mut frames = Vec::new();
        let result = loop {
            if *held_bytes >= max_bytes {
                break Ok(());
            }
            match self.next_message(&mut frames) {
                Ok(true) => {
                    *held_bytes += frames.iter().map(Vec::len).sum::<usize>();
                    held.push_back(std::mem::take(&mut frames));
                }
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.socket.set_read_timeout(self.poll)?;
        result
    }

    /// PING is answered (PONG with its context); ERROR ends the connection; others are let be.
    fn on_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, rest) = command_parts(body).unwrap_or_default();
        match name {
            b"PING" => {
                // A 2-byte TTL in tenths of a second (0: none), then the context to send back
                // (at most 16 bytes).
                if let Some(ttl) = rest.get(..2) {
                    let tenths = u16::from_be_bytes([ttl[0], ttl[1]]);
                    self.ttl = (tenths > 0).then(|| Duration::from_millis(100 * u64::from(tenths)));
                }
                let context = rest.get(2..).unwrap_or_default();
                let context = &context[..context.len().min(MAX_PING_CONTEXT)];
                self.socket.write_all(&command(b"PONG", context))?;
                Ok(())
            }
            b"ERROR" => Err(protocol(format!(
                "the publisher sent ERROR: {}",
                String::from_utf8_lossy(rest.get(1..).unwrap_or_default())
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
#[path = "zmtp_tests.rs"]
mod tests;
