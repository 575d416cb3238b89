//! kvrouter-mock-engine: the mock engine as a real-time server.
//!
//! OpenAI-compatible HTTP (`/v1/completions`, `/v1/chat/completions`, streaming or not,
//! `/v1/models`, `/health`, `/metrics`, `/server_info`) in front of a [`kvrouter_engine::Engine`]
//! stepped in real time, and KV events published over ZeroMQ in vLLM's current wire format with a
//! replay socket. It is a product feature (the embedded default of `kvrouter serve`), not a test
//! double.
//!
//! # Layout
//! - [`config`]: the server's settings.
//! - `driver`: the task that owns the engine and steps it against the wall clock.
//! - `publisher`: the ZeroMQ PUB socket and the replay ROUTER socket.
//! - `http`: the axum handlers; `openai`: request parsing and response bodies; `auth`: the
//!   `/v1` routes behind `--api-key`.
//! - `error`: the one mapping from errors to HTTP status and OpenAI error bodies.
//! - `metrics`: Prometheus text.
//!
//! The HTTP serve loop (client timeouts, graceful drain) is `kvrouter-http`'s, shared with
//! `kvrouter serve`. Starting engines is the host's business: `kvrouter serve --mock-workers N`
//! calls [`start_on_loopback`] and hands the router their URLs and event endpoints.

mod auth;
pub mod config;
mod driver;
mod error;
mod http;
mod metrics;
mod openai;
mod publisher;
mod responses;
mod submit;
mod vectors;

pub use config::{MockEngineConfig, TimingChoice, DEFAULT_MAX_STEP_LAG};
pub use http::app;

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Where a running mock engine can be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    /// HTTP address.
    pub http: SocketAddr,
    /// The KV events PUB endpoint (`tcp://host:port`), when publishing.
    pub kv_events: Option<String>,
    /// The replay ROUTER endpoint, when enabled.
    pub replay: Option<String>,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A socket could not be bound.
    #[error("binding {what} {endpoint}: {reason}")]
    Bind {
        /// Which socket.
        what: &'static str,
        /// The endpoint asked for.
        endpoint: String,
        /// The cause.
        reason: String,
    },
}

/// A mock engine running on the current tokio runtime.
pub struct RunningMockEngine {
    /// Its addresses.
    pub endpoints: Endpoints,
    /// Its shutdown phase (draining reports not-ready).
    pub lifecycle: kvrouter_http::Lifecycle,
    shutdown: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

impl RunningMockEngine {
    /// Stops the HTTP server and the engine: drains requests in flight for up to the
    /// configured grace period, then ends the rest.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.server.await;
    }
}

/// Starts a mock engine on `listener`: binds the ZeroMQ sockets, spawns the engine driver and
/// the HTTP server. Returns once everything is listening.
pub async fn start(
    config: MockEngineConfig,
    listener: TcpListener,
) -> Result<RunningMockEngine, StartError> {
    let http_addr = listener.local_addr().map_err(|e| StartError::Bind {
        what: "http",
        endpoint: "listener".into(),
        reason: e.to_string(),
    })?;
    let (publisher, kv_events, replay) = publisher::start(&config).await?;
    let shared = Arc::new(driver::Shared::new(&config));
    let commands = driver::spawn(&config, shared.clone(), publisher);
    let limits = config.http.clone();
    let state = http::AppState::new(config, commands, shared, kv_events.clone(), replay.clone());
    let (shutdown, mut rx) = watch::channel(false);
    let app = app(state);
    let lifecycle = kvrouter_http::Lifecycle::default();
    let server = tokio::spawn(kvrouter_http::serve(
        listener,
        app,
        limits,
        lifecycle.clone(),
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        },
    ));
    Ok(RunningMockEngine {
        endpoints: Endpoints {
            http: http_addr,
            kv_events,
            replay,
        },
        lifecycle,
        shutdown,
        server,
    })
}

/// Starts `n` engines from `template`, each on its own loopback HTTP port (and its own ZeroMQ
/// endpoints where the template asks for port 0), engine `i` seeded `template.engine.seed + i`
/// so that they do not behave in lockstep. If one fails to start, those already started are
/// stopped.
pub async fn start_on_loopback(
    template: &MockEngineConfig,
    n: usize,
) -> Result<Vec<RunningMockEngine>, StartError> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut config = template.clone();
        config.engine.seed = config.engine.seed.wrapping_add(i as u64);
        let started = match TcpListener::bind("127.0.0.1:0").await {
            Ok(listener) => start(config, listener).await,
            Err(e) => Err(StartError::Bind {
                what: "mock engine http",
                endpoint: "127.0.0.1:0".into(),
                reason: e.to_string(),
            }),
        };
        match started {
            Ok(engine) => out.push(engine),
            Err(e) => {
                for engine in out {
                    engine.stop().await;
                }
                return Err(e);
            }
        }
    }
    Ok(out)
}
