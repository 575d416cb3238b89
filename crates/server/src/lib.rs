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
//! - `edge`: what every request of the API meets before and after routing (head and body
//!   limits, rejections as OpenAI JSON).
//! - `app`: routes, health, metrics, admin API. `request`: one request from parse to last byte
//!   (attempt, continuation machine, forwarder); `guard`: the load guard of one attempt;
//!   `request_line`: a request's line, written once when it ends.
//! - `headers`: pins, priority, deadline, session, group and policy versions from request headers.
//! - [`provenance`]: the per-request JSON-lines log. [`access`]: the request id and the access log.
//! - `routing`: request bodies to tokens and block hashes. `registry`: adding and removing workers.
//! - `ingest`: libzmq subscribers (a thread per rank), reconnect re-syncs, sequence-gap recovery, bounded slices. `metrics`: Prometheus text.
//! - `replica`: router replicas sharing load, placements, sessions, versions and the
//!   weight-update lease over NATS (`--replica-sync`).
//! - [`placement`]: placements for hosts that carry the request themselves (ext_proc).
//! - `picks`: outstanding picks of the pick API under their leases, and the reaper that
//!   expires them (the table lives with the pick routes); `request::pick`: the pick API.
//! - [`otel`]: OTLP trace export of sampled requests' timelines.
//! - `update_metrics`: the weight-update cycle's gauges on `/metrics`.
//! - `queue`: the driver that places queued requests when load changes or deadlines pass.
//! - `planner_act`: the planner acting on Kubernetes (`--planner-act`): scale subresources
//!   patched within the bounds, a shared GPU budget and a cool-down.
//! - `planner`: the planner's advisory mode (`--planner-advise`): live signals per model pool
//!   into the core's control law, `GET /admin/planner` and its gauge.
//! - `error`: the one mapping from errors to HTTP responses.
//!
//! The server routes to workers by URL and starts no engines: `kvrouter serve --mock-workers N`
//! starts its embedded mock engines itself and hands their URLs and event endpoints over as
//! [`WorkerEntry`]s. The HTTP serve loop (client timeouts, drain) is `kvrouter-http`'s.
//! - `auth`: the admin token layer and session-release protection (constant-time compare).
//! - [`validate`]: the limits on worker registrations and the one check of a worker entry.
//! - [`discovery`]: workers from etcd or Kubernetes (`--discovery`), drained when they go.
//! - `cluster_summary`: `GET /admin/cluster-summary`, this router's summary for a global router.
//! - [`global`]: `kvrouter serve --global`, the router across clusters (no local workers).

pub mod access;
mod app;
mod auth;
mod capture;
mod cluster_summary;
pub mod config;
pub mod discovery;
mod edge;
mod endpoints;
mod engines;
mod error;
pub mod global;
mod guard;
mod headers;
mod health;
mod ingest;
mod metrics;
mod metrics_page;
pub mod otel;
mod picks;
pub mod placement;
mod planner;
mod planner_act;
mod planner_driver;
mod pools;
pub mod provenance;
mod queue;
pub mod readiness;
mod registry;
mod replica;
mod replica_state;
mod request;
mod request_line;
mod routing;
mod state;
mod update;
mod update_lanes;
mod update_metrics;
mod upstream;
pub mod validate;
mod weight_source;
mod zmq_contexts;

pub use app::app;
pub use config::{
    HealthConfig, IngestConfig, KvTransport, PickConfig, ServeConfig, SessionReleaseAuth,
    WorkerEntry, WorkersFile,
};
pub use edge::Edge;
pub use error::ServeError;
pub use state::AppState;

use std::net::SocketAddr;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// How long the engines a weight update holds paused are given to answer their resume when
/// the router stops (docs/operations.md, shutdown).
const RELEASE_AT_STOP: std::time::Duration = std::time::Duration::from_secs(2);

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
}

impl RunningServer {
    /// Stops the router: requests in flight get up to the grace period (`ServeConfig::http`)
    /// to finish, then the rest are ended. Returns once the drain is over, so a host that
    /// started the workers itself can stop them after this.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.server.await;
    }
}

/// Registers every worker of `config` (in order) and serves on `listener`.
pub async fn start(
    config: ServeConfig,
    listener: TcpListener,
) -> Result<RunningServer, StartError> {
    let addr = listener.local_addr().map_err(StartError::Listener)?;
    let state = AppState::new(config.clone())?;
    for entry in config.workers.clone() {
        let url = entry.url.clone();
        registry::add_worker(&state, entry)
            .await
            .map_err(|error| StartError::Worker { url, error })?;
    }
    let driver = queue::spawn(state.inner.clone());
    let advisor = planner_driver::spawn_advisor(state.inner.clone());
    let actuator = planner_driver::spawn_actuator(state.inner.clone());
    let discovery = config
        .discovery
        .as_ref()
        .map(|d| discovery::spawn(&state, d));
    replica::spawn(&state);
    let (shutdown, mut rx) = watch::channel(false);
    let router = app(state.clone());
    let (limits, lifecycle) = (config.http.clone(), state.inner.lifecycle.clone());
    let state_for_stop = state.clone();
    let server = tokio::spawn(async move {
        // Client timeouts, TCP_NODELAY, and the drain on shutdown.
        kvrouter_http::serve(listener, router, limits, lifecycle, async move {
            let _ = rx.wait_for(|stop| *stop).await;
        })
        .await;
        // An update cut short by the shutdown leaves no engine paused.
        update::release_held_engines(&state_for_stop, RELEASE_AT_STOP).await;
        driver.abort();
        if let Some(task) = advisor {
            task.abort();
        }
        if let Some(task) = actuator {
            task.abort();
        }
        for task in discovery.iter().flatten() {
            task.abort();
        }
    });
    Ok(RunningServer {
        addr,
        state,
        shutdown,
        server,
    })
}
