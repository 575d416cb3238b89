//! Embedded mock engines: `--mock-workers N` starts N engines in this process, each on its own
//! loopback HTTP port and ZeroMQ endpoints, and registers them.

use crate::config::{ServeConfig, WorkerEntry};
use kvrouter_mock_engine::{MockEngineConfig, RunningMockEngine};

pub(crate) async fn start_mocks(
    config: &ServeConfig,
) -> Result<Vec<RunningMockEngine>, kvrouter_mock_engine::StartError> {
    let mut out = Vec::with_capacity(config.mock_workers);
    for i in 0..config.mock_workers {
        let mut c: MockEngineConfig = config.mock_engine.clone();
        c.engine.block_size = config.router.kv_cache_block_size;
        c.engine.seed = c.engine.seed.wrapping_add(i as u64);
        c.tokenizer = config.tokenizer.clone();
        c.chat_template = config.chat_template.clone();
        if config.router.router_kv_events {
            c.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
            c.kv_events_replay_endpoint = Some("tcp://127.0.0.1:0".into());
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| kvrouter_mock_engine::StartError::Bind {
                what: "mock engine http",
                endpoint: "127.0.0.1:0".into(),
                reason: e.to_string(),
            })?;
        out.push(kvrouter_mock_engine::start(c, listener).await?);
    }
    Ok(out)
}

pub(crate) fn entry_for(m: &RunningMockEngine) -> WorkerEntry {
    WorkerEntry {
        url: format!("http://{}", m.endpoints.http),
        kv_events_endpoint: m.endpoints.kv_events.clone(),
        replay_endpoint: m.endpoints.replay.clone(),
        ..WorkerEntry::default()
    }
}
