//! `kvrouter serve --mock-workers N`: the embedded mock engines.
//!
//! The server routes to workers by URL and starts no engines; this module starts them, configured
//! like the router (its tokenizer, chat template and KV block size, so that both count the same
//! tokens and hash the same blocks; KV events and replay on loopback when the router listens for
//! them), hands their URLs and event endpoints to the server as workers, and stops them after
//! the router has drained, so that requests still in flight on the router can finish on them.

use kvrouter_mock_engine::{MockEngineConfig, RunningMockEngine};
use kvrouter_server::{RunningServer, ServeConfig, WorkerEntry};
use tokio::net::TcpListener;

/// `template` (from the `--mock-*` flags) made to agree with the router's `config`.
pub(crate) fn like_the_router(
    mut template: MockEngineConfig,
    config: &ServeConfig,
) -> MockEngineConfig {
    template.engine.block_size = config.router.kv_cache_block_size;
    // They serve the names the router lists (`--model-name`), else their default.
    if let Some((first, rest)) = config.model_names.split_first() {
        template.model_name = first.clone();
        template.model_aliases = rest.to_vec();
    }
    // They want the key the router sends (`--worker-api-key`), as real engines would.
    template.api_key = config.worker_api_key.clone();
    template.tokenizer = config.tokenizer.clone();
    template.chat_template = config.chat_template.clone();
    if config.router.router_kv_events {
        template.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
        template.kv_events_replay_endpoint = Some("tcp://127.0.0.1:0".into());
    }
    template
}

/// The worker entry the router gets for an embedded engine (nothing left to discover but its
/// `/server_info`).
fn entry(engine: &RunningMockEngine) -> WorkerEntry {
    WorkerEntry {
        url: format!("http://{}", engine.endpoints.http),
        kv_events_endpoint: engine.endpoints.kv_events.clone(),
        replay_endpoint: engine.endpoints.replay.clone(),
        ..WorkerEntry::default()
    }
}

/// A running router and the embedded engines it routes to (none without `--mock-workers`).
pub(crate) struct Serving {
    /// The router.
    pub(crate) server: RunningServer,
    engines: Vec<RunningMockEngine>,
}

impl Serving {
    /// Starts `n` engines from `template` on loopback, then the router on `listener` with them
    /// registered after the workers `config` names. Engines already started are stopped if the
    /// router cannot start.
    pub(crate) async fn start(
        mut config: ServeConfig,
        template: &MockEngineConfig,
        n: usize,
        listener: TcpListener,
    ) -> anyhow::Result<Self> {
        let engines = kvrouter_mock_engine::start_on_loopback(template, n).await?;
        config.workers.extend(engines.iter().map(entry));
        match kvrouter_server::start(config, listener).await {
            Ok(server) => Ok(Self { server, engines }),
            Err(e) => {
                stop_all(engines).await;
                Err(e.into())
            }
        }
    }

    /// Drains the router (requests in flight get the grace period) while `also` runs (another
    /// server over the same router, draining too), then stops the engines once both are done.
    pub(crate) async fn stop_with(self, also: impl std::future::Future<Output = ()>) {
        tokio::join!(self.server.stop(), also);
        stop_all(self.engines).await;
    }
}

/// Stops engines together: each drains what is left in flight for at most its grace period.
async fn stop_all(engines: Vec<RunningMockEngine>) {
    futures::future::join_all(engines.into_iter().map(RunningMockEngine::stop)).await;
}
