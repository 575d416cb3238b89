//! kvrouter-server: `kvrouter serve`, the OpenAI-compatible, KV-aware frontend.
//!
//! Requests are tokenized (or taken as token ids), hashed into blocks, placed by the core
//! [`kvrouter_core::Router`] and forwarded unchanged; responses stream back unchanged, with the
//! chosen worker in `x-kvrouter-worker`. KV events from every worker rank feed the core's index
//! over ZeroMQ.
//!
//! # Layout
//! - [`config`]: the validated settings and the workers-file format.
//! - `state`: shared state (core behind a short mutex, registry, client, tokenizer, metrics).
//! - `app`: routes, health, metrics, admin API. `proxy`: the request path and the load guard.
//! - `headers`: pins, priority, deadline, session, group and policy versions from request headers.
//! - [`provenance`]: the per-request JSON-lines log.
//! - `routing`: request bodies to tokens and block hashes. `registry`: adding and removing workers.
//! - `ingest`: libzmq subscribers (a thread per rank), reconnect re-syncs, sequence-gap recovery, bounded slices. `metrics`: Prometheus text.
//! - `queue`: the driver that places queued requests when load changes or deadlines pass.
//! - `error`: the one mapping from errors to HTTP responses. `mock`: embedded mock engines.
//! - `auth`: the admin token layer and session-release protection (constant-time compare).
//! - [`validate`]: the limits on worker registrations and the one check of a worker entry.

mod app;
mod auth;
mod capture;
pub mod config;
mod engines;
mod error;
mod guard;
mod headers;
mod health;
mod ingest;
mod metrics;
mod migrate;
mod mock;
pub mod provenance;
mod proxy;
mod queue;
mod registry;
mod routing;
mod state;
mod update;
pub mod validate;

pub use app::app;
pub use config::{ServeConfig, SessionReleaseAuth, WorkerEntry, WorkersFile};
pub use error::ServeError;
pub use health::HealthConfig;
pub use ingest::IngestConfig;
pub use state::AppState;

use std::net::SocketAddr;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The routing options are invalid.
    #[error(transparent)]
    Config(#[from] kvrouter_core::router::ConfigError),
    /// A worker could not be registered.
    #[error("worker {url}: {error}")]
    Worker {
        /// Its URL.
        url: String,
        /// Why.
        error: ServeError,
    },
    /// An embedded mock engine could not start.
    #[error(transparent)]
    Mock(#[from] kvrouter_mock_engine::StartError),
    /// The listener is unusable.
    #[error("listener: {0}")]
    Listener(std::io::Error),
}

/// A running router.
pub struct RunningServer {
    /// Its HTTP address.
    pub addr: SocketAddr,
    /// Its state (for tests and embedding).
    pub state: AppState,
    shutdown: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    mocks: Vec<kvrouter_mock_engine::RunningMockEngine>,
}

impl RunningServer {
    /// Stops the router and its embedded engines: requests in flight get up to the grace
    /// period (`ServeConfig::http`) to finish, then the rest are ended.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.server.await;
        for m in self.mocks {
            m.stop().await;
        }
    }

    /// The embedded mock engines' endpoints.
    pub fn mock_endpoints(&self) -> Vec<kvrouter_mock_engine::Endpoints> {
        self.mocks.iter().map(|m| m.endpoints.clone()).collect()
    }
}

/// Starts embedded engines, registers every worker, and serves on `listener`.
pub async fn start(
    config: ServeConfig,
    listener: TcpListener,
) -> Result<RunningServer, StartError> {
    let addr = listener.local_addr().map_err(StartError::Listener)?;
    let state = AppState::new(config.clone())?;
    let mocks = mock::start_mocks(&config).await?;
    let mut entries = config.workers.clone();
    entries.extend(mocks.iter().map(mock::entry_for));
    for entry in entries {
        let url = entry.url.clone();
        registry::add_worker(&state, entry)
            .await
            .map_err(|error| StartError::Worker { url, error })?;
    }
    let driver = queue::spawn(state.inner.clone());
    let (shutdown, mut rx) = watch::channel(false);
    let router = app(state.clone());
    let (limits, lifecycle) = (config.http.clone(), state.inner.lifecycle.clone());
    let server = tokio::spawn(async move {
        // Client timeouts, TCP_NODELAY, and the drain on shutdown.
        kvrouter_mock_engine::listen::serve(listener, router, limits, lifecycle, async move {
            let _ = rx.wait_for(|stop| *stop).await;
        })
        .await;
        driver.abort();
    });
    Ok(RunningServer {
        addr,
        state,
        shutdown,
        server,
        mocks,
    })
}
