//! `kvrouter serve`.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::RouterConfig;
use kvrouter_engine::EngineConfig;
use kvrouter_mock_engine::MockEngineConfig;
use kvrouter_server::{ServeConfig, WorkerEntry, WorkersFile};
use kvrouter_tokenizer::ChatTemplate;
use std::path::PathBuf;
use std::sync::Arc;

/// Flags of `kvrouter serve`, named as in the seeds' frontend where it has one.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A worker's base URL (repeatable), e.g. http://10.0.0.5:8000.
    #[arg(long = "worker")]
    workers: Vec<String>,
    /// A TOML file of `[[workers]]` (url, kv_events_endpoint, replay_endpoint, dp_size,
    /// block_size, max_num_batched_tokens, kv_capacity_blocks, labels).
    #[arg(long)]
    workers_file: Option<PathBuf>,
    /// Start N embedded mock engines and route to them.
    #[arg(long, default_value_t = 0)]
    mock_workers: usize,
    /// Speed-up ratio of the embedded mock engines.
    #[arg(long, default_value_t = 1.0)]
    mock_speedup_ratio: f64,
    /// KV capacity in blocks of each embedded mock engine.
    #[arg(long, default_value_t = 16_384)]
    mock_num_gpu_blocks: usize,
    /// Model name(s) served (default: learned from the first worker's /v1/models).
    #[arg(long = "model-name")]
    model_names: Vec<String>,
    /// Selection policy.
    #[arg(long, default_value = "kv")]
    router_mode: String,
    /// Sampling temperature of the KV policy (0 = lowest cost).
    #[arg(long, default_value_t = 0.0)]
    router_temperature: f64,
    /// Credit per GPU-cached block.
    #[arg(long, default_value_t = 1.0)]
    router_kv_overlap_score_credit: f64,
    /// Decay of the credit on workers with excess prefill load.
    #[arg(long, default_value_t = 0.0)]
    router_kv_overlap_score_credit_decay: f64,
    /// Weight of the prefill term.
    #[arg(long, default_value_t = 1.0)]
    router_prefill_load_scale: f64,
    /// Block-equivalent cost per active request.
    #[arg(long, default_value_t = 0.0)]
    router_decode_active_request_weight: f64,
    /// KV-aware routing without cache credit (load only).
    #[arg(long)]
    load_aware: bool,
    /// Predict cache state from routing decisions instead of engine KV events.
    #[arg(long)]
    no_router_kv_events: bool,
    /// Predicted-placement window next to the event-fed index, seconds.
    #[arg(long)]
    router_predicted_ttl_secs: Option<f64>,
    /// Time-to-live of predicted blocks without KV events, seconds.
    #[arg(long, default_value_t = 120.0)]
    router_ttl_secs: f64,
    /// A worker is busy above this fraction of its KV capacity in active decode blocks.
    #[arg(long)]
    active_decode_blocks_threshold: Option<f64>,
    /// A worker is busy above this many active prefill tokens.
    #[arg(long)]
    active_prefill_tokens_threshold: Option<u64>,
    /// A worker is busy above this fraction of its max_num_batched_tokens in prefill tokens.
    #[arg(long)]
    active_prefill_tokens_threshold_frac: Option<f64>,
    /// KV block size in tokens; must match the engines.
    #[arg(long, default_value_t = 64)]
    kv_cache_block_size: usize,
    /// Seed of the randomized policies.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hugging Face tokenizer.json for routing (default: the built-in tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Jinja chat template (default: tokenizer_config.json beside the tokenizer, else ChatML).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Enable the admin API with this bearer token.
    #[arg(long)]
    admin_token: Option<String>,
    /// Add x-kvrouter-decision (the score breakdown) to responses.
    #[arg(long)]
    expose_decisions: bool,
    /// Retries on another worker when an upstream fails before its first byte.
    #[arg(long, default_value_t = 2)]
    retries: u32,
}

fn read_workers_file(path: &PathBuf) -> anyhow::Result<Vec<WorkerEntry>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--workers-file {}", path.display()))?;
    let file: WorkersFile =
        toml::from_str(&text).with_context(|| format!("--workers-file {}", path.display()))?;
    Ok(file.workers)
}

impl ServeArgs {
    pub(crate) fn config(&self) -> anyhow::Result<ServeConfig> {
        let mode: RouterMode = self.router_mode.parse().context("--router-mode")?;
        let mut router = RouterConfig {
            router_mode: mode,
            kv_cache_block_size: self.kv_cache_block_size,
            router_temperature: self.router_temperature,
            router_kv_overlap_score_credit: self.router_kv_overlap_score_credit,
            router_kv_overlap_score_credit_decay: self.router_kv_overlap_score_credit_decay,
            router_prefill_load_scale: self.router_prefill_load_scale,
            router_decode_active_request_weight: self.router_decode_active_request_weight,
            router_kv_events: !self.no_router_kv_events,
            router_ttl_secs: self.router_ttl_secs,
            router_predicted_ttl_secs: self.router_predicted_ttl_secs,
            active_decode_blocks_threshold: self.active_decode_blocks_threshold,
            active_prefill_tokens_threshold: self.active_prefill_tokens_threshold,
            active_prefill_tokens_threshold_frac: self.active_prefill_tokens_threshold_frac,
            seed: self.seed,
            ..RouterConfig::default()
        };
        if self.load_aware {
            router.router_mode = RouterMode::Kv;
            router.router_kv_overlap_score_credit = 0.0;
        }
        router.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut workers: Vec<WorkerEntry> = self
            .workers
            .iter()
            .map(|url| WorkerEntry {
                url: url.clone(),
                ..WorkerEntry::default()
            })
            .collect();
        if let Some(path) = &self.workers_file {
            workers.extend(read_workers_file(path)?);
        }
        if workers.is_empty() && self.mock_workers == 0 {
            bail!("no workers: give --worker URL, --workers-file PATH or --mock-workers N");
        }
        if !(self.mock_speedup_ratio.is_finite() && self.mock_speedup_ratio > 0.0) {
            bail!("--mock-speedup-ratio must be a positive number");
        }
        let tokenizer =
            kvrouter_tokenizer::load(self.tokenizer.as_deref()).context("--tokenizer")?;
        let chat_template = match (&self.chat_template, &self.tokenizer) {
            (Some(path), _) => ChatTemplate::from_file(path).context("--chat-template")?,
            (None, Some(tok)) => ChatTemplate::from_tokenizer_config(tok)
                .context("--tokenizer")?
                .unwrap_or_default(),
            (None, None) => ChatTemplate::ChatMl,
        };
        let mock_engine = MockEngineConfig {
            engine: EngineConfig {
                num_gpu_blocks: self.mock_num_gpu_blocks,
                ..EngineConfig::default()
            },
            speedup_ratio: self.mock_speedup_ratio,
            ..MockEngineConfig::default()
        };
        Ok(ServeConfig {
            router,
            workers,
            mock_workers: self.mock_workers,
            mock_engine,
            model_names: self.model_names.clone(),
            tokenizer,
            chat_template: Arc::new(chat_template),
            admin_token: self.admin_token.clone(),
            expose_decisions: self.expose_decisions,
            retries: self.retries,
            ..ServeConfig::default()
        })
    }
}

pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("--host/--port: binding {addr}"))?;
    let server = kvrouter_server::start(config, listener).await?;
    println!(
        "kvrouter serve listening on http://{} mode={} workers={}",
        server.addr,
        args.router_mode,
        server.state.worker_count()
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    server.stop().await;
    Ok(())
}
