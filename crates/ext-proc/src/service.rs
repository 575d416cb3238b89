//! The tonic service: each gRPC stream is one request through the gateway, driven by its
//! [`Exchange`] on a task of its own; the stream's end (or the gateway going away) drops the
//! exchange, which releases a placement whose answer had not ended.

use crate::exchange::{Exchange, Step};
use crate::pb::envoy::service::ext_proc::v3 as ep;
use crate::ExtProcConfig;
use ep::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use futures::StreamExt;
use kvrouter_server::{AppState, ServeError};
use std::pin::Pin;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// The ext_proc service over a router's state.
#[derive(Clone)]
pub struct ExtProc {
    state: AppState,
    config: ExtProcConfig,
}

impl ExtProc {
    /// The service for `state` (no I/O).
    pub fn new(state: AppState, config: ExtProcConfig) -> Self {
        Self { state, config }
    }

    /// The tonic server of this service.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
    }

    async fn run(
        self,
        mut inbound: Streaming<ep::ProcessingRequest>,
        tx: mpsc::Sender<Result<ep::ProcessingResponse, Status>>,
    ) {
        let mut exchange = Exchange::new(self.config.failure_mode, self.config.max_body_bytes);
        // Bounded by the gateway: one stream carries one request and its answer.
        while let Some(msg) = inbound.next().await {
            let Ok(msg) = msg else {
                // The gateway cancelled the stream: dropping the exchange releases the load.
                return;
            };
            let out = match exchange.on_message(msg) {
                Step::Reply(out) => out,
                Step::Place {
                    headers,
                    body,
                    subset,
                } => {
                    let placed = tokio::time::timeout(
                        self.config.pick_timeout,
                        kvrouter_server::placement::place(
                            &self.state,
                            &headers,
                            &body,
                            subset.as_deref(),
                            self.config.fallbacks,
                            "ext_proc",
                        ),
                    )
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
                    exchange.placed(placed, body)
                }
            };
            for r in out {
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
        }
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
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(self.clone().run(inbound, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the ext_proc service on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: ExtProc,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
