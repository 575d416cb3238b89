//! One rank's subscriber over [`super::zmtp::Connection`] (`--kv-event-transport zmtp`, the
//! default): the subscriber thread reads the publisher's socket itself, with the stream rules
//! of [`super::subscriber`] (sequence, replay, breaks and re-syncs) unchanged.

use super::subscriber::{
    Stream, SubscriberError, HANDSHAKE_IVL_MS, POLL_MS, RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS,
};
use super::zmtp::{Connection, ZmtpError};
use super::Source;
use crate::state::Inner;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// `subscriber::run` over a [`Connection`]: the subscriber thread reads the publisher's
/// socket itself. A connection that cannot be made is tried again after [`RECONNECT_IVL_MS`],
/// doubling to [`RECONNECT_IVL_MAX_MS`]; one that ends (the publisher went away, broke the
/// protocol or sent a frame over the bound) breaks the stream as libzmq's `DISCONNECTED` does.
pub(super) fn run(
    state: &Inner,
    ctx: &zmq::Context,
    source: &Source,
    stop: &AtomicBool,
) -> Result<(), SubscriberError> {
    let config = &state.config.kv_ingest;
    let mut stream = Stream::new(state, ctx, source, stop);
    stream.replay_from(0, u64::MAX);
    let min_pause = Duration::from_millis(RECONNECT_IVL_MS as u64);
    let mut pause = min_pause;
    let mut frames = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let handshake = Duration::from_millis(HANDSHAKE_IVL_MS as u64);
        let poll = Duration::from_millis(POLL_MS as u64);
        let max_frame = u64::try_from(config.hard_frame_bytes()).unwrap_or(u64::MAX);
        let mut conn = match Connection::open(&source.endpoint, (handshake, poll), max_frame, stop)
        {
            Ok(c) => c,
            Err(ZmtpError::Stopped) => return Ok(()),
            Err(ZmtpError::Endpoint(e)) => return Err(ZmtpError::Endpoint(e).into()),
            Err(e) => {
                tracing::debug!(worker = %source.worker, dp_rank = source.dp_rank, endpoint = %source.endpoint, "no KV event connection ({e}); retrying");
                let until = Instant::now() + pause;
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(poll.min(until - Instant::now()));
                }
                pause = (pause * 2).min(Duration::from_millis(RECONNECT_IVL_MAX_MS as u64));
                continue;
            }
        };
        pause = min_pause;
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
    }
    Ok(())
}
