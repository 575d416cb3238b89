//! One rank's subscriber over [`super::zmtp::Connection`] (`--kv-event-transport zmtp`, the
//! default): the subscriber thread reads the publisher's socket itself, with the stream rules
//! of [`super::subscriber`] (sequence, replay, breaks and re-syncs) unchanged.

use super::subscriber::{
    sleep_unless_stopped, Stream, SubscriberError, HANDSHAKE_IVL_MS, POLL_MS, RECONNECT_IVL_MAX_MS,
    RECONNECT_IVL_MS,
};
use super::zmtp::{Connection, ZmtpError};
use super::Source;
use crate::state::Inner;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A connection that lasted this long resets the pause before the next one.
const STABLE: Duration = Duration::from_secs(1);
/// Failed connections in a row before one is logged at warn level (about 8 s at the pauses'
/// 1 s ceiling), and how many more between such lines (about ten minutes).
const WARN_AFTER_FAILURES: u64 = 10;
const WARN_EVERY_FAILURES: u64 = 600;

/// `subscriber::run` over a [`Connection`]: the subscriber thread reads the publisher's
/// socket itself. The first replay is asked for once the first connection has subscribed (so
/// what is published meanwhile waits in the socket, not lost before a subscription). Between
/// connections the subscriber waits [`RECONNECT_IVL_MS`], doubling to
/// [`RECONNECT_IVL_MAX_MS`] while connections fail or end within [`STABLE`]; a connection that
/// ends (the publisher went away, broke the protocol or sent a frame over the bound) breaks the
/// stream as libzmq's `DISCONNECTED` does.
pub(super) fn run(
    state: &Inner,
    ctx: &zmq::Context,
    source: &Source,
    stop: &AtomicBool,
) -> Result<(), SubscriberError> {
    let config = &state.config.kv_ingest;
    let mut stream = Stream::new(state, ctx, source, stop);
    let min_pause = Duration::from_millis(RECONNECT_IVL_MS as u64);
    let max_pause = Duration::from_millis(RECONNECT_IVL_MAX_MS as u64);
    let (handshake, poll) = (
        Duration::from_millis(HANDSHAKE_IVL_MS as u64),
        Duration::from_millis(POLL_MS as u64),
    );
    let max_frame = u64::try_from(config.hard_frame_bytes()).unwrap_or(u64::MAX);
    let max_held = config.max_message_bytes.saturating_mul(HELD_MESSAGES);
    let mut pause = min_pause;
    let mut replayed = false;
    let mut failures = 0u64;
    let mut frames = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let mut conn = match Connection::open(&source.endpoint, (handshake, poll), max_frame, stop)
        {
            Ok(c) => c,
            Err(ZmtpError::Stopped) => return Ok(()),
            Err(ZmtpError::Endpoint(e)) => return Err(ZmtpError::Endpoint(e).into()),
            Err(e) => {
                failures += 1;
                // A wrong port (the replay socket, an HTTP server) fails the same way for ever:
                // said at warn level once it has for a while, then every ten minutes or so.
                if failures == WARN_AFTER_FAILURES || failures % WARN_EVERY_FAILURES == 0 {
                    tracing::warn!(worker = %source.worker, dp_rank = source.dp_rank, endpoint = %source.endpoint, failures, "no KV event connection ({e}); retrying, and routing without this rank's cache meanwhile");
                } else {
                    tracing::debug!(worker = %source.worker, dp_rank = source.dp_rank, endpoint = %source.endpoint, "no KV event connection ({e}); retrying");
                }
                sleep_unless_stopped(pause, stop);
                pause = (pause * 2).min(max_pause);
                continue;
            }
        };
        failures = 0;
        let connected = Instant::now();
        let mut held = Held::default();
        if !std::mem::replace(&mut replayed, true) {
            // Learn what the engine already holds.
            stream.replay_from(0, u64::MAX, &mut || held.take(&mut conn, max_held));
        }
        stream.handshake_succeeded(&mut || held.take(&mut conn, max_held));
        while !stop.load(Ordering::Relaxed) {
            let next = match held.messages.pop_front() {
                Some(m) => {
                    held.bytes -= m.iter().map(Vec::len).sum::<usize>();
                    frames = m;
                    Ok(true)
                }
                None => match held.ended.take() {
                    Some(e) => Err(e),
                    None => conn.next_message(&mut frames),
                },
            };
            match next {
                Ok(true) => stream.on_message(&frames, &mut || held.take(&mut conn, max_held)),
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(worker = %source.worker, dp_rank = source.dp_rank, endpoint = %source.endpoint, "KV event connection ended: {e}");
                    stream.disconnected();
                    break;
                }
            }
        }
        if connected.elapsed() >= STABLE {
            pause = min_pause;
        }
        sleep_unless_stopped(pause, stop);
        pause = (pause * 2).min(max_pause);
    }
    Ok(())
}

/// What a replay's wait holds, in messages of the largest size (`--kv-event-max-message-bytes`,
/// so 32 MiB by default): beyond, live messages wait in the socket (and the publisher's
/// buffers) instead.
const HELD_MESSAGES: usize = 4;

/// Live messages read while a replay kept the subscriber busy, applied after it in order, and
/// how the connection ended if it did meanwhile.
#[derive(Default)]
struct Held {
    messages: std::collections::VecDeque<Vec<Vec<u8>>>,
    bytes: usize,
    ended: Option<ZmtpError>,
}

impl Held {
    /// Reads what `conn` has (answering its heartbeats), up to `max_bytes` held.
    fn take(&mut self, conn: &mut Connection, max_bytes: usize) {
        if self.ended.is_none() {
            if let Err(e) = conn.hold_ready(&mut self.messages, &mut self.bytes, max_bytes) {
                self.ended = Some(e);
            }
        }
    }
}
