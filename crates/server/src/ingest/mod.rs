//! KV event ingestion: one subscriber per worker rank, on its own thread, feeding the core's
//! index.
//!
//! By default (`--kv-event-transport zmtp`) the subscriber thread connects to the engine's PUB
//! and speaks ZMTP 3.0 on the socket itself ([`zmtp`], [`native`]): one thread woken per
//! message. With `--kv-event-transport libzmq` a libzmq SUB reads the connection on libzmq's I/O
//! thread and the subscriber polls it and a socket monitor ([`subscriber`]). Either way the
//! subscriber waits with a short timeout, so it stops soon after its worker is removed (the
//! tokio task that registry.rs keeps holds a stop guard: aborting the task stops the thread),
//! and reconnects by itself (every 100 ms, backing off to 1 s). When the publisher goes away
//! the rank's index is cleared (counted in `kvrouter_kv_stream_breaks_total`); when it comes
//! back the rank is re-synced through the replay socket when there is one (counted in
//! `kvrouter_kv_stream_resyncs_total`).
//!
//! Sequence numbers are judged by [`sequence`]: a gap is recovered through the replay socket when
//! it has one, otherwise the rank is cleared and re-learned from new events; numbering that goes
//! backwards (a restarted or broken publisher) re-syncs the rank. Malformed and oversize messages
//! are counted and dropped; nothing from the network panics or stops a stream for good.
//!
//! # Layout
//! - [`sequence`]: the pure judgement of sequence numbers.
//! - [`apply`]: decoding and applying a batch in bounded slices.
//! - [`replay`]: the DEALER asking an engine's replay socket for buffered batches.
//! - [`subscriber`]: a rank's stream rules, and the libzmq SUB + monitor loop.
//! - [`zmtp`]: a ZMTP 3.0 SUB connection read on the calling thread; [`native`]: the loop over it.

mod apply;
mod native;
mod replay;
mod sequence;
mod subscriber;
mod zmtp;

pub(crate) use crate::config::IngestConfig;
use crate::state::Inner;
use kvrouter_core::event::KvEvent;
use kvrouter_core::ids::WorkerId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::task::JoinHandle;

impl IngestConfig {
    /// The libzmq `ZMQ_MAXMSGSIZE` bound: well above the counted one, so an oversize message is
    /// normally counted, not silently refused by libzmq.
    fn hard_frame_bytes(&self) -> i64 {
        i64::try_from(self.max_message_bytes.saturating_mul(4)).unwrap_or(i64::MAX)
    }
}

/// Where one rank publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    pub(crate) worker: WorkerId,
    pub(crate) dp_rank: u32,
    pub(crate) endpoint: String,
    pub(crate) replay: Option<String>,
}

/// Sets the stop flag when dropped (when the task holding it is aborted).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Starts the subscriber of one rank on its own thread. Aborting (or dropping the runtime of)
/// the returned task stops the thread within one poll interval.
pub(crate) fn spawn(state: Arc<Inner>, source: Source) -> JoinHandle<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let guard = StopOnDrop(stop.clone());
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let name = format!("kv-ingest-{}-{}", source.worker, source.dp_rank);
    let thread = std::thread::Builder::new().name(name).spawn(move || {
        subscriber::supervise(&state, &source, &stop);
        drop(done_tx);
    });
    if let Err(e) = &thread {
        tracing::error!("cannot start a KV event subscriber thread: {e}");
    }
    tokio::spawn(async move {
        let _guard = guard;
        if thread.is_ok() {
            let _ = done_rx.await;
        }
    })
}

fn drop_message(state: &Inner, reason: &str) {
    state.metrics.kv_messages_dropped.inc(&[("reason", reason)]);
}

/// Forgets what the index holds for this rank.
fn clear(state: &Inner, source: &Source) {
    let event = KvEvent::Cleared {
        worker: source.worker,
        dp_rank: source.dp_rank,
    };
    let _ = state.lock_core().apply_event(&event);
}
