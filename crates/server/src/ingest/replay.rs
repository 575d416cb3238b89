//! Asking an engine's replay socket (a ROUTER) for buffered batches through a DEALER: send
//! `[b"", start_seq]`, read `[b"", topic, seq, payload]` (or the older `[b"", seq, payload]`)
//! until the end marker `seq = u64::MAX`. Bounded by a deadline and the message-size bound, and
//! stopped with the subscriber.

use super::IngestConfig;
use kvrouter_kv_wire::decode_seq;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(100);
/// How often a replay calls its `meanwhile` (while waiting, and between batches).
pub(crate) const MEANWHILE: Duration = Duration::from_millis(50);

/// Why a replay ended early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    #[error("replay socket: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("no end of replay within {0:?}")]
    Timeout(Duration),
    #[error("stopped")]
    Stopped,
}

/// Replays batches `start..until` from `endpoint`, calling `apply(seq, payload)` for each in
/// order, and `meanwhile()` about every [`MEANWHILE`]. Returns the last sequence number applied
/// (`None` when there was none).
pub(crate) fn replay(
    ctx: &zmq::Context,
    config: &IngestConfig,
    endpoint: &str,
    range: std::ops::Range<u64>,
    stop: &AtomicBool,
    mut apply: impl FnMut(u64, &[u8]),
    meanwhile: &mut dyn FnMut(),
) -> Result<Option<u64>, ReplayError> {
    let dealer = ctx.socket(zmq::DEALER)?;
    dealer.set_linger(0)?;
    dealer.set_maxmsgsize(config.hard_frame_bytes())?;
    dealer.connect(endpoint)?;
    dealer.send_multipart([&b""[..], &range.start.to_be_bytes()[..]], 0)?;
    let deadline = Instant::now() + config.replay_timeout;
    let mut last = None;
    let mut called = Instant::now();
    loop {
        if called.elapsed() >= MEANWHILE {
            meanwhile();
            called = Instant::now();
        }
        if stop.load(Ordering::Relaxed) {
            return Err(ReplayError::Stopped);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ReplayError::Timeout(config.replay_timeout));
        }
        let wait = left.min(POLL).min(MEANWHILE);
        if dealer.poll(zmq::POLLIN, wait.as_millis() as i64)? == 0 {
            continue;
        }
        let frames = dealer.recv_multipart(0)?;
        let size: usize = frames.iter().map(Vec::len).sum();
        let (seq, payload) = match frames.as_slice() {
            [_, _, seq, payload] | [_, seq, payload] => match decode_seq(seq) {
                Ok(s) => (s, payload),
                Err(_) => continue,
            },
            _ => continue,
        };
        if seq == u64::MAX {
            return Ok(last);
        }
        if size > config.max_message_bytes || !range.contains(&seq) {
            continue;
        }
        if last.is_some_and(|l| seq <= l) {
            continue;
        }
        apply(seq, payload);
        last = Some(seq);
    }
}
