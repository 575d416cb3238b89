//! The picker's server: the accept loop, a task per gateway connection
//! ([`crate::connection`]), the placement each `Process` stream asks for, and the shutdown.
//!
//! Shutdown ([`serve`]'s `shutdown`): the picker drains. The health service turns
//! `NOT_SERVING`, new `Process` streams are refused (`UNAVAILABLE`: the gateway's failure mode
//! applies), and the streams in flight go on, for up to the grace period; then the streams still
//! open end (`UNAVAILABLE`), releasing their load, and the connections end with GOAWAY.

use crate::exchange::Step;
use crate::h2::Limits;
use crate::ExtProcConfig;
use kvrouter_server::placement::Placement;
use kvrouter_server::{AppState, ServeError};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long streams still open after the grace period get to end before the server stops.
const CUT_MARGIN: Duration = Duration::from_secs(1);

/// Streams one gateway connection may have open at once (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`).
/// A gateway past it opens another connection: Envoy's HTTP/2 connection pool does so when a
/// connection's streams are all taken.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// The window each stream gets: a usual body message (a 2,048-token prompt as JSON is ~12 KB)
/// arrives without waiting for a WINDOW_UPDATE.
const STREAM_WINDOW: u32 = 1 << 20;
/// The connection's window.
const CONNECTION_WINDOW: u32 = 16 << 20;
/// The largest header block read (a gRPC request's headers are a few hundred bytes).
const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Answers waiting for a gateway's flow-control windows past which the connection's window is
/// not granted back: a gateway that takes no answers can send no more request data.
pub(crate) const MAX_WAITING: usize = 4 << 20;

/// Room in a gateway message for what comes with a body chunk (its framing and flags).
const MESSAGE_OVERHEAD_BYTES: usize = 64 * 1024;

/// Where the picker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Serving,
    /// Shutting down: new `Process` streams are refused, those in flight go on.
    Draining,
    /// The grace period is over: the `Process` streams still open end now.
    Cutting,
    /// The server stops: every connection ends.
    Stopped,
}

/// What every stream of one service shares.
struct Shared {
    phase: watch::Sender<Phase>,
    /// `Process` streams in flight.
    streams: watch::Sender<usize>,
    /// Gateway connections open.
    connections: watch::Sender<usize>,
    /// Bytes of messages not yet whole, all connections together.
    held: AtomicUsize,
    /// Bytes of answers waiting for gateways' windows, all connections together.
    waiting: AtomicUsize,
}

/// One connection's share of a byte total over all connections ([`Shared::held`],
/// [`Shared::waiting`]), given back when the share is dropped (the connection ended).
pub(crate) struct Share {
    shared: Arc<Shared>,
    total: fn(&Shared) -> &AtomicUsize,
    mine: usize,
}

impl Share {
    fn new(shared: &Arc<Shared>, total: fn(&Shared) -> &AtomicUsize) -> Self {
        Self {
            shared: shared.clone(),
            total,
            mine: 0,
        }
    }

    /// This connection's bytes.
    pub(crate) fn mine(&self) -> usize {
        self.mine
    }

    /// This connection's bytes are `now`: the total over all connections now.
    pub(crate) fn set(&mut self, now: usize) -> usize {
        let total = (self.total)(&self.shared);
        // The usual case, a message whole in its frame: no write to the shared total.
        if now == self.mine {
            return total.load(Ordering::Relaxed);
        }
        let after = if now > self.mine {
            let grown = now - self.mine;
            total.fetch_add(grown, Ordering::Relaxed) + grown
        } else {
            let shrunk = self.mine - now;
            total.fetch_sub(shrunk, Ordering::Relaxed) - shrunk
        };
        self.mine = now;
        after
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Counts one thing while it lives, on one of [`Shared`]'s counters: a `Process` stream in
/// flight ([`ExtProc::in_flight`]) or a gateway connection open ([`ExtProc::open`]).
pub(crate) struct Counted(Arc<Shared>, fn(&Shared) -> &watch::Sender<usize>);

impl Counted {
    fn new(shared: &Arc<Shared>, counter: fn(&Shared) -> &watch::Sender<usize>) -> Self {
        counter(shared).send_modify(|n| *n += 1);
        Self(shared.clone(), counter)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        (self.1)(&self.0).send_modify(|n| *n -= 1);
    }
}

/// A `Process` stream in flight.
pub(crate) type InFlight = Counted;

/// A placement's outcome, with the request body it was placed from (a full-duplex stream
/// sends it back).
pub(crate) struct Placed {
    pub(crate) result: Result<Placement, ServeError>,
    pub(crate) body: Vec<u8>,
}

/// The ext_proc service over a router's state.
#[derive(Clone)]
pub struct ExtProc {
    state: AppState,
    config: ExtProcConfig,
    shared: Arc<Shared>,
}

impl ExtProc {
    /// The service for `state` (no I/O).
    pub fn new(state: AppState, config: ExtProcConfig) -> Self {
        let shared = Arc::new(Shared {
            phase: watch::channel(Phase::Serving).0,
            streams: watch::channel(0).0,
            connections: watch::channel(0).0,
            held: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
        });
        Self {
            state,
            config,
            shared,
        }
    }

    pub(crate) fn config(&self) -> &ExtProcConfig {
        &self.config
    }

    /// A new connection's share of the bytes of messages not yet whole.
    pub(crate) fn held_share(&self) -> Share {
        Share::new(&self.shared, |s| &s.held)
    }

    /// A new connection's share of the bytes of answers waiting for gateways' windows.
    pub(crate) fn waiting_share(&self) -> Share {
        Share::new(&self.shared, |s| &s.waiting)
    }

    /// The largest gRPC message read: a body message up to the body limit (and
    /// [`MESSAGE_OVERHEAD_BYTES`] more); a body past the limit in several messages is answered
    /// 413 by the exchange, one message past this size ends the stream with `OUT_OF_RANGE`.
    pub(crate) fn max_message(&self) -> usize {
        self.config
            .max_body_bytes
            .saturating_add(MESSAGE_OVERHEAD_BYTES)
    }

    pub(crate) fn h2_limits(&self) -> Limits {
        Limits {
            max_streams: MAX_STREAMS_PER_CONNECTION,
            stream_window: STREAM_WINDOW,
            connection_window: CONNECTION_WINDOW,
            max_header_block: MAX_HEADER_BLOCK,
            max_waiting: MAX_WAITING,
        }
    }

    /// Counts a new `Process` stream in flight.
    pub(crate) fn in_flight(&self) -> InFlight {
        Counted::new(&self.shared, |s| &s.streams)
    }

    /// Counts a new gateway connection open.
    pub(crate) fn open(&self) -> Counted {
        Counted::new(&self.shared, |s| &s.connections)
    }

    /// The placement a [`Step::Place`] asks for, bounded by the pick timeout.
    pub(crate) fn place(&self, step: Step) -> impl Future<Output = Placed> + Send + 'static {
        let (state, fallbacks, timeout) = (
            self.state.clone(),
            self.config.fallbacks,
            self.config.pick_timeout,
        );
        async move {
            let Step::Place {
                headers,
                body,
                subset,
            } = step
            else {
                unreachable!("only a Place step is placed");
            };
            let source = "ext_proc";
            let placing = async {
                match &body {
                    Some(body) => {
                        kvrouter_server::placement::place(
                            &state,
                            &headers,
                            body,
                            subset.as_deref(),
                            fallbacks,
                            source,
                        )
                        .await
                    }
                    None => {
                        kvrouter_server::placement::place_without_body(
                            &state,
                            &headers,
                            subset.as_deref(),
                            fallbacks,
                            source,
                        )
                        .await
                    }
                }
            };
            // Most placements end at their first poll; only one that waits (the router
            // queue) gets a timer.
            let result = {
                let mut placing = std::pin::pin!(placing);
                match futures::poll!(placing.as_mut()) {
                    std::task::Poll::Ready(r) => r,
                    std::task::Poll::Pending => tokio::time::timeout(timeout, placing)
                        .await
                        .unwrap_or_else(|_| {
                            Err(ServeError::Http {
                                status: http::StatusCode::GATEWAY_TIMEOUT,
                                message: format!(
                                    "no placement within {:.3}s (--ext-proc-pick-timeout-secs)",
                                    timeout.as_secs_f64()
                                ),
                            })
                        }),
                }
            };
            Placed {
                result,
                body: body.unwrap_or_default(),
            }
        }
    }
}

/// Serves the ext_proc service and the gRPC health service on `listener`. When `shutdown`
/// resolves, drains: health turns `NOT_SERVING`, new streams are refused, and the streams in
/// flight get up to the configured grace period before the server stops.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: ExtProc,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let shared = service.shared.clone();
    let grace = service.config.shutdown_grace;
    let (drain_tx, drain_rx) = watch::channel(false);
    let (health, reporting) = crate::health::report(service.state.readiness(), drain_rx);
    let accepting = {
        let (service, health) = (service.clone(), health.clone());
        let phase = shared.phase.subscribe();
        async move {
            loop {
                let tcp = kvrouter_http::accept(&listener).await;
                let conn =
                    crate::connection::run(tcp, service.clone(), phase.clone(), health.clone());
                tokio::spawn(conn);
            }
        }
    };
    let accepting = tokio::spawn(accepting);
    shutdown.await;
    shared.phase.send_replace(Phase::Draining);
    let _ = drain_tx.send(true);
    let mut streams = shared.streams.subscribe();
    if !all_end_within(&mut streams, grace).await {
        // Streams still open end with UNAVAILABLE.
        shared.phase.send_replace(Phase::Cutting);
        all_end_within(&mut streams, CUT_MARGIN).await;
    }
    accepting.abort();
    // The connections write their GOAWAY and close.
    shared.phase.send_replace(Phase::Stopped);
    all_end_within(&mut shared.connections.subscribe(), CUT_MARGIN).await;
    reporting.abort();
    Ok(())
}

/// Waits up to `limit` for a counter (`Process` streams in flight, connections open) to reach
/// 0; whether it did.
async fn all_end_within(counter: &mut watch::Receiver<usize>, limit: Duration) -> bool {
    tokio::time::timeout(limit, counter.wait_for(|n| *n == 0))
        .await
        .is_ok()
}
