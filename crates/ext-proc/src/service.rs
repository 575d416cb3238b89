//! The tonic service: each gRPC stream is one request through the gateway, driven by its
//! [`Exchange`] as its response stream is polled; the stream's end (or the gateway going away)
//! drops the exchange, which releases a placement whose answer had not ended.
//!
//! Shutdown ([`serve`]'s `shutdown`): the picker drains. The health service turns
//! `NOT_SERVING`, new streams are refused (`UNAVAILABLE`: the gateway's failure mode applies),
//! and the streams in flight go on, for up to the grace period; then the port closes and the
//! streams still open end (`UNAVAILABLE`), releasing their load.

use crate::exchange::{Exchange, Step};
use crate::pb::envoy::service::ext_proc::v3 as ep;
use crate::ExtProcConfig;
use ep::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use futures::StreamExt;
use kvrouter_server::{AppState, ServeError};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

/// How long streams still open after the grace period get to end before the server stops.
const CUT_MARGIN: Duration = Duration::from_secs(1);

/// Streams one gateway connection may have open at once (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`;
/// tonic leaves it unlimited). A gateway past it opens another connection: Envoy's HTTP/2
/// connection pool does so when a connection's streams are all taken.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// Where the picker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Serving,
    /// Shutting down: new streams are refused, those in flight go on.
    Draining,
    /// The grace period is over: the streams still open end now.
    Cutting,
}

/// Resolves once `phase` is `at`.
async fn reached(phase: &mut watch::Receiver<Phase>, at: Phase) {
    let _ = phase.wait_for(|p| *p == at).await;
}

/// What every stream of one service shares.
struct Shared {
    phase: watch::Sender<Phase>,
    /// Streams in flight.
    streams: watch::Sender<usize>,
}

/// Counts one stream in flight while it lives.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.streams.send_modify(|n| *n += 1);
        Self(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.streams.send_modify(|n| *n -= 1);
    }
}

/// Room in a gateway message for what comes with a body chunk (its framing and flags).
const MESSAGE_OVERHEAD_BYTES: usize = 64 * 1024;

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
        });
        Self {
            state,
            config,
            shared,
        }
    }

    /// The tonic server of this service. A body message up to the body limit (and
    /// [`MESSAGE_OVERHEAD_BYTES`] more) decodes, where tonic's own default, 4 MiB, ended the
    /// stream without an answer; a body past the limit in several messages is answered 413 by
    /// the exchange, and one message past this size still ends the stream with gRPC's
    /// `OUT_OF_RANGE`.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        let max_message = self
            .config
            .max_body_bytes
            .saturating_add(MESSAGE_OVERHEAD_BYTES);
        ExternalProcessorServer::new(self).max_decoding_message_size(max_message)
    }

    async fn place(&self, step: Step, exchange: &mut Exchange) -> Vec<ep::ProcessingResponse> {
        let Step::Place {
            headers,
            body,
            subset,
        } = step
        else {
            return Vec::new();
        };
        let (fallbacks, source) = (self.config.fallbacks, "ext_proc");
        let placing = async {
            match &body {
                Some(body) => {
                    kvrouter_server::placement::place(
                        &self.state,
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
                        &self.state,
                        &headers,
                        subset.as_deref(),
                        fallbacks,
                        source,
                    )
                    .await
                }
            }
        };
        let placed = tokio::time::timeout(self.config.pick_timeout, placing)
            .await
            .unwrap_or_else(|_| {
                Err(ServeError::Http {
                    status: http::StatusCode::GATEWAY_TIMEOUT,
                    message: format!(
                        "no placement within {:.3}s (--ext-proc-pick-timeout-secs)",
                        self.config.pick_timeout.as_secs_f64()
                    ),
                })
            });
        exchange.placed(placed, body.unwrap_or_default())
    }
}

/// What one stream does next.
enum Next {
    /// Send these responses (none: wait for the next message).
    Replies(Vec<ep::ProcessingResponse>),
    /// Send these responses and end the stream: the gateway sends nothing more.
    Last(Vec<ep::ProcessingResponse>),
    /// The grace period of a shutdown passed: end the stream with `UNAVAILABLE`.
    Cut,
    /// The gateway ended (or cancelled) the stream.
    End,
    /// What came was no ext_proc message (or the stream broke): end with this status.
    Refused(Status),
}

/// One stream while it runs: its messages in, its [`Exchange`], its place in the shutdown.
/// The response stream owns it, so the stream's end (or the gateway going away, which drops
/// the response stream) drops the exchange, releasing the load of an answer that had not
/// ended. Each message is handled as the response stream is polled: no task or channel of its
/// own.
struct Run {
    service: ExtProc,
    inbound: Streaming<ep::ProcessingRequest>,
    exchange: Exchange,
    phase: watch::Receiver<Phase>,
    _in_flight: InFlight,
}

impl Run {
    async fn next(&mut self) -> Next {
        let msg = tokio::select! {
            msg = self.inbound.next() => msg,
            () = reached(&mut self.phase, Phase::Cutting) => return Next::Cut,
        };
        // On any end, the exchange's drop ends the answer or releases its load
        // (`Exchange::closed`).
        let msg = match msg {
            Some(Ok(msg)) => msg,
            None => return Next::End,
            Some(Err(e)) => return Next::Refused(refusal(e)),
        };
        let out = match self.exchange.on_message(msg) {
            Step::Reply(out) => out,
            place => self.service.place(place, &mut self.exchange).await,
        };
        if self.exchange.over() {
            Next::Last(out)
        } else {
            Next::Replies(out)
        }
    }

    /// The stream of responses: each message's, in order, until the stream ends.
    fn responses(self) -> Outbound {
        let replies = futures::stream::unfold(Some(self), |run| async move {
            let mut run = run?;
            match run.next().await {
                Next::Replies(out) => Some((out.into_iter().map(Ok).collect(), Some(run))),
                // Ending the response with the last answer lets the server write both at once
                // (the gateway would close the stream after it anyway).
                Next::Last(out) => Some((out.into_iter().map(Ok).collect(), None)),
                Next::Cut => {
                    let cut =
                        Status::unavailable("kvrouter shut down (--shutdown-grace-secs passed)");
                    Some((vec![Err(cut)], None))
                }
                Next::Refused(status) => Some((vec![Err(status)], None)),
                Next::End => None,
            }
        });
        Box::pin(replies.flat_map(|out: Vec<_>| futures::stream::iter(out)))
    }
}

/// The status a stream that could not be read ends with: a message that is no ext_proc
/// message (tonic's decoder calls that, or a frame cut short, `INTERNAL`) is the gateway's
/// `INVALID_ARGUMENT`; other errors (a message over the size bound) keep their code.
fn refusal(e: Status) -> Status {
    match e.code() {
        tonic::Code::Internal | tonic::Code::Unknown => {
            Status::invalid_argument(format!("not an ext_proc message stream: {}", e.message()))
        }
        _ => e,
    }
}

type Outbound = Pin<Box<dyn futures::Stream<Item = Result<ep::ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Outbound;

    async fn process(
        &self,
        request: Request<Streaming<ep::ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        if *self.shared.phase.borrow() != Phase::Serving {
            return Err(Status::unavailable(
                "kvrouter is draining for shutdown and takes no new requests",
            ));
        }
        let run = Run {
            _in_flight: InFlight::new(&self.shared),
            phase: self.shared.phase.subscribe(),
            exchange: Exchange::new(&self.config),
            inbound: request.into_inner(),
            service: self.clone(),
        };
        Ok(Response::new(run.responses()))
    }
}

/// Serves the ext_proc service and the gRPC health service on `listener`. When `shutdown`
/// resolves, drains: health turns `NOT_SERVING`, new streams are refused, and the streams in
/// flight get up to the configured grace period before the server stops.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: ExtProc,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let shared = service.shared.clone();
    let grace = service.config.shutdown_grace;
    let (reporter, health) = tonic_health::server::health_reporter();
    let (drain_tx, drain_rx) = watch::channel(false);
    let reporting = crate::health::report(reporter, service.state.readiness(), drain_rx).await;
    let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<()>();
    let incoming = crate::incoming::accepted(listener);
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .add_service(health)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, async {
            let _ = cut_rx.await;
        });
    tokio::pin!(server);
    let result = async {
        tokio::select! {
            r = &mut server => return Some(r),
            () = shutdown => {}
        }
        shared.phase.send_replace(Phase::Draining);
        let _ = drain_tx.send(true);
        let mut streams = shared.streams.subscribe();
        if let Some(r) = streams_end_within(&mut server, &mut streams, grace).await {
            return Some(r);
        }
        // Streams still open end with UNAVAILABLE; the server is told to stop once they have
        // (or after the margin), so it does not close a connection under a status being sent.
        shared.phase.send_replace(Phase::Cutting);
        if let Some(r) = streams_end_within(&mut server, &mut streams, CUT_MARGIN).await {
            return Some(r);
        }
        let _ = cut_tx.send(());
        tokio::time::timeout(CUT_MARGIN, &mut server).await.ok()
    }
    .await;
    reporting.abort();
    result.unwrap_or(Ok(()))
}

/// Waits up to `limit` for every open stream to end, while the server runs; the server's result
/// if it stopped first.
async fn streams_end_within<S: std::future::Future + Unpin>(
    server: &mut S,
    streams: &mut watch::Receiver<usize>,
    limit: Duration,
) -> Option<S::Output> {
    tokio::select! {
        r = server => Some(r),
        _ = tokio::time::timeout(limit, streams.wait_for(|n| *n == 0)) => None,
    }
}
