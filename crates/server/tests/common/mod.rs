//! A router in this process with real mock engines behind it. The server starts no engines (the
//! CLI does, for `--mock-workers`), so these tests start them as the CLI would and register them.
#![allow(dead_code, unreachable_pub)]

use kvrouter_mock_engine::{MockEngineConfig, RunningMockEngine};
use kvrouter_server::{RunningServer, ServeConfig, WorkerEntry};

/// A running router and the engines started for it.
pub struct WithEngines {
    pub server: RunningServer,
    pub engines: Vec<RunningMockEngine>,
}

impl std::ops::Deref for WithEngines {
    type Target = RunningServer;
    fn deref(&self) -> &RunningServer {
        &self.server
    }
}

impl WithEngines {
    /// Drains the router, then stops the engines.
    pub async fn stop(self) {
        self.server.stop().await;
        for e in self.engines {
            e.stop().await;
        }
    }
}

/// Starts `n` mock engines at `speedup_ratio`, agreeing with `config`'s block size, tokenizer and
/// chat template (KV events only when the router listens for them), then the router on
/// 127.0.0.1:0 with them registered after `config.workers`.
pub async fn start(mut config: ServeConfig, n: usize, speedup_ratio: f64) -> WithEngines {
    let mut template = MockEngineConfig {
        speedup_ratio,
        tokenizer: config.tokenizer.clone(),
        chat_template: config.chat_template.clone(),
        ..MockEngineConfig::default()
    };
    template.engine.block_size = config.router.kv_cache_block_size;
    if config.router.router_kv_events {
        template.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
        template.kv_events_replay_endpoint = Some("tcp://127.0.0.1:0".into());
    }
    let engines = kvrouter_mock_engine::start_on_loopback(&template, n)
        .await
        .expect("mock engines start");
    config.workers.extend(engines.iter().map(|e| WorkerEntry {
        url: format!("http://{}", e.endpoints.http),
        kv_events_endpoint: e.endpoints.kv_events.clone(),
        replay_endpoint: e.endpoints.replay.clone(),
        ..WorkerEntry::default()
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = kvrouter_server::start(config, listener)
        .await
        .expect("the router starts");
    WithEngines { server, engines }
}
