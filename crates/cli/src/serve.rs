//! `kvrouter serve`.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_engine::EngineConfig;
use kvrouter_mock_engine::MockEngineConfig;
use kvrouter_server::{HealthConfig, ServeConfig, WorkerEntry, WorkersFile};
use kvrouter_tokenizer::ChatTemplate;

use crate::routing_args::RoutingArgs;
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
    /// Weight-load time of each embedded mock engine (weight updates), ms before the speed-up.
    #[arg(long, default_value_t = 0.0)]
    mock_weight_load_ms: f64,
    /// KV capacity in blocks of each embedded mock engine.
    #[arg(long, default_value_t = 16_384)]
    mock_num_gpu_blocks: usize,
    /// Model name(s) served (default: learned from the first worker's /v1/models).
    #[arg(long = "model-name")]
    model_names: Vec<String>,
    #[command(flatten)]
    routing: RoutingArgs,
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
    /// Times a failed stream may be continued on another worker (0 = never).
    #[arg(long, default_value_t = 0)]
    migration_limit: u32,
    /// A stream silent for this many seconds counts as failed.
    #[arg(long)]
    stream_idle_timeout_secs: Option<f64>,
    /// Append one JSON line per finished request (worker, policy version, tokens, timings).
    #[arg(long)]
    provenance_log: Option<std::path::PathBuf>,
    /// Rotate the provenance log (to PATH.1) past this many MiB.
    #[arg(long, default_value_t = 256)]
    provenance_log_max_mib: u64,
    /// Keep the timelines of the last N request attempts for GET /admin/trace (Chrome trace
    /// JSON for Perfetto); 0 = off.
    #[arg(long, default_value_t = 0)]
    trace_capture: usize,
    /// Seconds between active health checks (GET /health); 0 turns them off.
    #[arg(long, default_value_t = 5.0)]
    health_check_interval_secs: f64,
    /// Consecutive failed health checks that make a worker unhealthy.
    #[arg(long, default_value_t = 3)]
    health_failure_threshold: u32,
    /// Consecutive passed checks or requests that make it healthy again.
    #[arg(long, default_value_t = 2)]
    health_recovery_threshold: u32,
    /// Consecutive failed requests (connection errors, 5xx, broken streams) that make a worker
    /// unhealthy.
    #[arg(long, default_value_t = 3)]
    outlier_consecutive_failures: u32,
    /// Seconds an unhealthy worker keeps its cache entries in the index.
    #[arg(long, default_value_t = 30.0)]
    unhealthy_index_grace_secs: f64,
    /// KV event messages larger than this many bytes are dropped (counted as `oversize`) and
    /// the rank re-synced; libzmq refuses frames over 4× this outright.
    #[arg(long, default_value_t = 8 << 20)]
    kv_event_max_message_bytes: usize,
    /// Blocks of a KV event applied per hold of the index lock (larger events are applied in
    /// slices, letting requests route in between).
    #[arg(long, default_value_t = 512)]
    kv_event_apply_slice_blocks: usize,
    /// Seconds one replay request to an engine's replay socket may take in all.
    #[arg(long, default_value_t = 5.0)]
    kv_event_replay_timeout_secs: f64,
}

fn secs(v: Option<f64>, flag: &str) -> anyhow::Result<Option<std::time::Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(std::time::Duration::from_secs_f64(s))),
        Some(s) => bail!("{flag} must be a number of seconds ≥ 0, got {s}"),
    }
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
        let router = self.routing.config()?;
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
            weight_load: std::time::Duration::try_from_secs_f64(self.mock_weight_load_ms / 1e3)
                .map_err(|_| {
                    anyhow::anyhow!("--mock-weight-load-ms must be a non-negative number")
                })?,
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
            migration_limit: self.migration_limit,
            stream_idle_timeout: secs(self.stream_idle_timeout_secs, "--stream-idle-timeout-secs")?,
            trace_capture: self.trace_capture,
            provenance: match &self.provenance_log {
                None => None,
                Some(path) => Some(Arc::new(
                    kvrouter_server::provenance::ProvenanceLog::open(
                        path,
                        self.provenance_log_max_mib.saturating_mul(1 << 20),
                    )
                    .map_err(|e| anyhow::anyhow!("--provenance-log {}: {e}", path.display()))?,
                )),
            },
            health: HealthConfig {
                interval: secs(
                    Some(self.health_check_interval_secs),
                    "--health-check-interval-secs",
                )?
                .filter(|d| !d.is_zero()),
                failure_threshold: self.health_failure_threshold.max(1),
                recovery_threshold: self.health_recovery_threshold.max(1),
                outlier_failures: self.outlier_consecutive_failures.max(1),
                index_grace: secs(
                    Some(self.unhealthy_index_grace_secs),
                    "--unhealthy-index-grace-secs",
                )?
                .unwrap_or_default(),
            },
            kv_ingest: self.kv_ingest()?,
            ..ServeConfig::default()
        })
    }

    fn kv_ingest(&self) -> anyhow::Result<kvrouter_server::IngestConfig> {
        if self.kv_event_max_message_bytes == 0 {
            bail!("--kv-event-max-message-bytes must be at least 1");
        }
        if self.kv_event_apply_slice_blocks == 0 {
            bail!("--kv-event-apply-slice-blocks must be at least 1");
        }
        let replay_timeout = secs(
            Some(self.kv_event_replay_timeout_secs),
            "--kv-event-replay-timeout-secs",
        )?
        .unwrap_or_default();
        Ok(kvrouter_server::IngestConfig {
            max_message_bytes: self.kv_event_max_message_bytes,
            apply_slice_blocks: self.kv_event_apply_slice_blocks,
            replay_timeout,
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
        args.routing.router_mode,
        server.state.worker_count()
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    server.stop().await;
    Ok(())
}
