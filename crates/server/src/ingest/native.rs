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
    let mut pause = min_pause;
    let mut replayed = false;
    let mut frames = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let mut conn = match Connection::open(&source.endpoint, (handshake, poll), max_frame, stop)
        {
            Ok(c) => c,
            Err(ZmtpError::Stopped) => return Ok(()),
            Err(ZmtpError::Endpoint(e)) => return Err(ZmtpError::Endpoint(e).into()),
            Err(e) => {
                tracing::debug!(worker = %source.worker, dp_rank = source.dp_rank, endpoint = %source.endpoint, "no KV event connection ({e}); retrying");
                sleep_unless_stopped(pause, stop);
                pause = (pause * 2).min(max_pause);
                continue;
            }
        };
        let connected = Instant::now();
        if !std::mem::replace(&mut replayed, true) {
            // Learn what the engine already holds.
            stream.replay_from(0, u64::MAX);
        }
        stream.handshake_succeeded();
        while !stop.load(Ordering::Relaxed) {
            match conn.next_message(&mut frames) {
                Ok(true) => stream.on_message(&frames),
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
