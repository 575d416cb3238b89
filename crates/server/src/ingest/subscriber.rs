//! One rank's subscriber: a libzmq SUB and its socket monitor, polled on a dedicated thread.

use super::apply::apply_payload;
use super::replay::replay;
use super::sequence::{Sequence, Verdict};
use super::{clear, drop_message, Source};
use crate::config::KvTransport;
use crate::state::Inner;
use kvrouter_kv_wire::decode_seq;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the stop flag is looked at.
pub(super) const POLL_MS: i64 = 100;
/// libzmq's reconnect interval, and its bound when backing off.
pub(super) const RECONNECT_IVL_MS: i32 = 100;
pub(super) const RECONNECT_IVL_MAX_MS: i32 = 1000;
/// A publisher that does not finish its handshake in this time is disconnected (and retried).
pub(super) const HANDSHAKE_IVL_MS: i32 = 5000;
/// Messages read per wake-up before the monitor and the stop flag are looked at again.
const BURST: usize = 256;
/// libzmq does not reconnect after a protocol error (4.3 terminates the session): when no socket
/// event was seen for this long while not connected, the subscriber connects again itself.
const WATCHDOG: Duration = Duration::from_millis(1500);
/// Pause before a subscriber that failed is started again, doubling per failure in a row up to
/// the maximum (a bad endpoint is retried, and logged, at most every 30 s).
const RESTART_PAUSE: Duration = Duration::from_secs(1);
const RESTART_PAUSE_MAX: Duration = Duration::from_secs(30);
/// A run this long resets the pause.
const STABLE_RUN: Duration = Duration::from_secs(60);

/// Runs the subscriber until `stop`; a failure (a socket error, a bug) is logged, counted as a
/// break and the subscriber started afresh, so ingestion never dies silently.
pub(super) fn supervise(state: &Inner, source: &Source, stop: &AtomicBool) {
    let mut pause = RESTART_PAUSE;
    let lease = state.zmq.lease();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            // Both transports hand the replay endpoint to libzmq, whose C API cannot take a NUL.
            endpoint_ok(&source.endpoint)?;
            if let Some(r) = &source.replay {
                endpoint_ok(r)?;
            }
            match state.config.kv_ingest.transport {
                KvTransport::Libzmq => run(state, &lease.ctx, source, stop),
                KvTransport::Zmtp => super::native::run(state, &lease.ctx, source, stop),
            }
        }));
        if started.elapsed() > STABLE_RUN {
            pause = RESTART_PAUSE;
        }
        let reason = match outcome {
            Ok(Ok(())) => return,
            Ok(Err(e)) => {
                tracing::error!(worker = %source.worker, dp_rank = source.dp_rank, endpoint = %source.endpoint, "KV event subscriber failed: {e}; starting it again");
                "socket_error"
            }
            Err(_) => {
                tracing::error!(worker = %source.worker, dp_rank = source.dp_rank, "KV event subscriber panicked; starting it again");
                "panic"
            }
        };
        break_stream(state, source, reason);
        sleep_unless_stopped(pause, stop);
        pause = (pause * 2).min(RESTART_PAUSE_MAX);
    }
}

/// Sleeps for `pause`, or less once `stop` is set (looked at every [`POLL_MS`]).
pub(super) fn sleep_unless_stopped(pause: Duration, stop: &AtomicBool) {
    let until = Instant::now() + pause;
    let poll = Duration::from_millis(POLL_MS as u64);
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(poll.min(until.saturating_duration_since(Instant::now())));
    }
}

fn break_stream(state: &Inner, source: &Source, reason: &str) {
    clear(state, source);
    let worker = source.worker.to_string();
    state
        .metrics
        .kv_stream_breaks
        .inc(&[("worker", worker.as_str()), ("reason", reason)]);
}

/// Failures that end one run of the subscriber.
#[derive(Debug, thiserror::Error)]
pub(super) enum SubscriberError {
    #[error("{0}")]
    Zmq(#[from] zmq::Error),
    #[error("{0}")]
    Zmtp(#[from] super::zmtp::ZmtpError),
    #[error("endpoint {0:?} contains a NUL byte")]
    Endpoint(String),
}

/// Refuses an endpoint libzmq would refuse (a NUL byte, which its C API cannot take).
fn endpoint_ok(e: &str) -> Result<(), SubscriberError> {
    match e.contains('\0') {
        true => Err(SubscriberError::Endpoint(e.to_owned())),
        false => Ok(()),
    }
}

fn run(
    state: &Inner,
    ctx: &zmq::Context,
    source: &Source,
    stop: &AtomicBool,
) -> Result<(), SubscriberError> {
    let config = &state.config.kv_ingest;
    let sockets = Monitored::open(ctx, config.hard_frame_bytes())?;
    let (sub, monitor) = (sockets.sub(), &sockets.monitor);
    sub.connect(&source.endpoint)?;
    let mut stream = Stream::new(state, ctx, source, stop);
    // Learn what the engine already holds (libzmq's I/O thread reads the SUB meanwhile).
    stream.replay_from(0, u64::MAX, &mut || {});
    while !stop.load(Ordering::Relaxed) {
        let mut items = [
            monitor.as_poll_item(zmq::POLLIN),
            sub.as_poll_item(zmq::POLLIN),
        ];
        zmq::poll(&mut items, POLL_MS)?;
        let data = items[1].is_readable();
        stream.on_monitor(monitor)?;
        stream.watchdog(sub)?;
        if !data {
            continue;
        }
        for _ in 0..BURST {
            // Socket events first: a break clears the rank before anything of the new
            // connection is applied.
            stream.on_monitor(monitor)?;
            match sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => stream.on_message(&frames, &mut || {}),
                Err(zmq::Error::EAGAIN) => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// A SUB socket and the PAIR socket that reads its monitor events, closed in the one order
/// libzmq survives: closing the SUB sends its last events (`CLOSED`, `MONITOR_STOPPED`) to the
/// monitor from libzmq's own threads, and a PAIR send with no peer blocks forever, taking every
/// socket of the context (every worker's ingestion) with it. So the SUB goes first and the
/// monitor is drained until `MONITOR_STOPPED` (bounded by [`MONITOR_DRAIN`]) before it closes,
/// whichever way `run` ends (stop, error, panic).
struct Monitored {
    sub: Option<zmq::Socket>,
    monitor: zmq::Socket,
}

/// How long a closing subscriber waits for its monitor's last event.
const MONITOR_DRAIN: Duration = Duration::from_secs(2);

impl Monitored {
    fn open(ctx: &zmq::Context, hard_frame_bytes: i64) -> Result<Self, SubscriberError> {
        static MONITORS: AtomicU64 = AtomicU64::new(0);
        let sub = ctx.socket(zmq::SUB)?;
        sub.set_linger(0)?;
        sub.set_reconnect_ivl(RECONNECT_IVL_MS)?;
        sub.set_reconnect_ivl_max(RECONNECT_IVL_MAX_MS)?;
        sub.set_maxmsgsize(hard_frame_bytes)?;
        sub.set_handshake_ivl(HANDSHAKE_IVL_MS)?;
        sub.set_subscribe(b"")?;
        let endpoint = format!(
            "inproc://kvrouter-ingest-monitor-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        // The reader connects (inproc allows it before the bind) before monitoring starts, so
        // no event is ever sent to a PAIR without its peer.
        let monitor = ctx.socket(zmq::PAIR)?;
        monitor.set_linger(0)?;
        monitor.connect(&endpoint)?;
        let sockets = Self {
            sub: Some(sub),
            monitor,
        };
        sockets
            .sub()
            .monitor(&endpoint, zmq::SocketEvent::ALL as i32)?;
        Ok(sockets)
    }

    fn sub(&self) -> &zmq::Socket {
        self.sub.as_ref().expect("the SUB socket lives until drop")
    }
}

impl Drop for Monitored {
    fn drop(&mut self) {
        drop(self.sub.take());
        let deadline = Instant::now() + MONITOR_DRAIN;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!("KV event monitor did not report MONITOR_STOPPED in time");
                return;
            }
            let mut items = [self.monitor.as_poll_item(zmq::POLLIN)];
            if zmq::poll(&mut items, left.as_millis().max(1) as i64).is_err() {
                return;
            }
            while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
                let stopped = frames.first().and_then(|f| f.get(..2)).is_some_and(|b| {
                    matches!(
                        zmq::SocketEvent::from_raw(u16::from_le_bytes([b[0], b[1]])),
                        zmq::SocketEvent::MONITOR_STOPPED
                    )
                });
                if stopped {
                    return;
                }
            }
        }
    }
}

/// The state of one rank's stream between messages.
pub(super) struct Stream<'a> {
    state: &'a Inner,
    /// The context its sockets (and its replays') are opened in.
    ctx: &'a zmq::Context,
    source: &'a Source,
    stop: &'a AtomicBool,
    seq: Sequence,
    /// A publisher is connected (its handshake succeeded).
    connected: bool,
    /// A TCP connection is up (its handshake may still be running).
    tcp_up: bool,
    /// The publisher went away; the next handshake is a come-back.
    broken: bool,
    /// When the monitor last said anything.
    last_event: Instant,
    /// Messages with events dropped for their block size (see [`Stream::applied`]).
    block_size_drops: u64,
}

impl<'a> Stream<'a> {
    /// A rank's stream before its first connection.
    pub(super) fn new(
        state: &'a Inner,
        ctx: &'a zmq::Context,
        source: &'a Source,
        stop: &'a AtomicBool,
    ) -> Self {
        Stream {
            state,
            ctx,
            source,
            stop,
            seq: Sequence::default(),
            connected: false,
            tcp_up: false,
            broken: false,
            last_event: Instant::now(),
            block_size_drops: 0,
        }
    }

    fn worker_label(&self) -> String {
        self.source.worker.to_string()
    }

    /// Handles the socket events waiting on the monitor.
    fn on_monitor(&mut self, monitor: &zmq::Socket) -> Result<(), zmq::Error> {
        for _ in 0..64 {
            let frames = match monitor.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.last_event = Instant::now();
            let Some(event) = frames
                .first()
                .and_then(|f| f.get(..2))
                .map(|b| zmq::SocketEvent::from_raw(u16::from_le_bytes([b[0], b[1]])))
            else {
                continue;
            };
            match event {
                zmq::SocketEvent::CONNECTED => self.tcp_up = true,
                zmq::SocketEvent::DISCONNECTED | zmq::SocketEvent::CLOSED => self.tcp_up = false,
                _ => {}
            }
            match event {
                zmq::SocketEvent::DISCONNECTED if self.connected => self.disconnected(),
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED => self.handshake_succeeded(&mut || {}),
                _ => {}
            }
        }
        Ok(())
    }

    /// The publisher went away: the rank is cleared until it comes back.
    pub(super) fn disconnected(&mut self) {
        self.connected = false;
        self.broken = true;
        self.seq.reset();
        break_stream(self.state, self.source, "disconnected");
        if self.state.lifecycle.is_draining() {
            // The router is shutting down: engines stopping now are expected.
            tracing::debug!(worker = %self.source.worker, dp_rank = self.source.dp_rank, endpoint = %self.source.endpoint, "KV event stream closed while the router shuts down");
        } else {
            tracing::warn!(worker = %self.source.worker, dp_rank = self.source.dp_rank, endpoint = %self.source.endpoint, "KV event stream broke (the publisher disconnected, or sent a message over 4 x --kv-event-max-message-bytes, which ends the connection); rank cleared, reconnecting");
        }
    }

    /// A publisher's handshake succeeded: a come-back re-syncs the rank. `meanwhile` is
    /// called while a replay waits (see [`Stream::replay_from`]).
    pub(super) fn handshake_succeeded(&mut self, meanwhile: &mut dyn FnMut()) {
        self.connected = true;
        if std::mem::take(&mut self.broken) {
            self.resync("reconnect", meanwhile);
            tracing::info!(worker = %self.source.worker, dp_rank = self.source.dp_rank, endpoint = %self.source.endpoint, "KV event stream came back; rank re-synced");
        }
    }

    /// A message was applied; `dropped`: its events of another block size were refused. Those
    /// are only counted (`kv_events_applied_total{status="block_size_mismatch"}`) and routing
    /// silently finds no prefix on this worker, so the first such message of the stream, and
    /// every 10,000th after, is logged too.
    fn applied(&mut self, dropped: Option<kvrouter_core::index::IndexError>) {
        let Some(err) = dropped else { return };
        if self.block_size_drops % 10_000 == 0 {
            tracing::warn!(worker = %self.source.worker, dp_rank = self.source.dp_rank, endpoint = %self.source.endpoint, "KV events dropped: {err}; the engine's block size and --kv-cache-block-size (or the worker's block_size) must agree");
        }
        self.block_size_drops += 1;
    }

    /// Connects again when libzmq gave up (no socket event for [`WATCHDOG`] while not
    /// connected: after a protocol error it does not retry by itself).
    fn watchdog(&mut self, sub: &zmq::Socket) -> Result<(), zmq::Error> {
        if self.connected || self.tcp_up || self.last_event.elapsed() < WATCHDOG {
            return Ok(());
        }
        tracing::debug!(worker = %self.source.worker, dp_rank = self.source.dp_rank, endpoint = %self.source.endpoint, "no KV event connection and libzmq not retrying; connecting again");
        let _ = sub.disconnect(&self.source.endpoint);
        sub.connect(&self.source.endpoint)?;
        self.last_event = Instant::now();
        Ok(())
    }

    /// Clears the rank and learns it again (through the replay socket when there is one, else
    /// from the next events).
    fn resync(&mut self, reason: &str, meanwhile: &mut dyn FnMut()) {
        clear(self.state, self.source);
        self.seq.reset();
        let worker = self.worker_label();
        self.state
            .metrics
            .kv_stream_resyncs
            .inc(&[("worker", worker.as_str()), ("reason", reason)]);
        self.replay_from(0, u64::MAX, meanwhile);
    }

    /// Replays `start..until`; returns the last sequence number applied. `meanwhile` is called
    /// about every [`replay::MEANWHILE`] while the replay waits or runs: the ZMTP reader keeps
    /// its live connection read there (heartbeats answered, messages held for afterwards),
    /// which the replay would otherwise leave unread for up to `--kv-event-replay-timeout-secs`.
    pub(super) fn replay_from(
        &mut self,
        start: u64,
        until: u64,
        meanwhile: &mut dyn FnMut(),
    ) -> Option<u64> {
        let endpoint = self.source.replay.as_deref()?;
        let (state, source) = (self.state, self.source);
        let mut dropped = Vec::new();
        let result = replay(
            self.ctx,
            &state.config.kv_ingest,
            endpoint,
            start..until,
            self.stop,
            |_, payload| dropped.extend(apply_payload(state, source, payload)),
            meanwhile,
        );
        for err in dropped {
            self.applied(Some(err));
        }
        match result {
            Ok(last) => {
                if let Some(l) = last {
                    self.seq.applied_replay(l);
                }
                last
            }
            Err(e) => {
                tracing::warn!(worker = %source.worker, dp_rank = source.dp_rank, endpoint, "KV event replay failed: {e}");
                None
            }
        }
    }

    /// Handles one message `[topic, seq, payload]` of the live stream (`meanwhile`: as for
    /// [`Stream::replay_from`], when it has to replay).
    pub(super) fn on_message(&mut self, frames: &[Vec<u8>], meanwhile: &mut dyn FnMut()) {
        let size: usize = frames.iter().map(Vec::len).sum();
        let max = self.state.config.kv_ingest.max_message_bytes;
        let (seq, payload) = match frames {
            [_, seq, payload] => match decode_seq(seq) {
                Ok(s) => (s, payload.as_slice()),
                Err(_) => return drop_message(self.state, "malformed"),
            },
            _ => return drop_message(self.state, "malformed"),
        };
        if size > max {
            drop_message(self.state, "oversize");
            tracing::warn!(worker = %self.source.worker, dp_rank = self.source.dp_rank, seq, size_bytes = size, max_bytes = max, "dropped a KV event message over --kv-event-max-message-bytes; rank re-synced");
            self.resync("oversize", meanwhile);
            if self.seq.applied().is_none_or(|a| seq > a) {
                self.seq.applied_live(seq);
            }
            return;
        }
        let mut verdict = self.seq.judge(seq);
        if verdict == Verdict::Backwards {
            drop_message(self.state, "seq_backwards");
            tracing::warn!(worker = %self.source.worker, dp_rank = self.source.dp_rank, seq, last = ?self.seq.applied(), "KV event sequence went backwards (publisher restarted?); rank re-synced");
            self.resync("seq_backwards", meanwhile);
            verdict = match self.seq.judge(seq) {
                Verdict::Backwards => Verdict::Apply,
                v => v,
            };
        }
        match verdict {
            Verdict::Duplicate => return drop_message(self.state, "duplicate"),
            Verdict::Gap { from, to } => {
                drop_message(self.state, "sequence_gap");
                let recovered = self.replay_from(from, to, meanwhile);
                if recovered.is_none_or(|r| r + 1 < to) {
                    drop_message(self.state, "gap_cleared");
                    clear(self.state, self.source);
                }
            }
            Verdict::Apply | Verdict::Backwards => {}
        }
        let dropped = apply_payload(self.state, self.source, payload);
        self.applied(dropped);
        self.seq.applied_live(seq);
    }
}
