//! `kvrouter serve` flags for global routing: `--global` with its `--cluster` entries (the
//! router across clusters), and the `--cluster-*` settings of the summary a local router
//! publishes at `GET /admin/cluster-summary`.

use crate::flag_values::{millis, positive};
use crate::headings as H;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_core::global::{GlobalConfig, GlobalPolicy};
use kvrouter_server::config::ClusterSummaryConfig;
use kvrouter_server::global::{ClusterTarget, GlobalServeConfig};

/// Global routing flags (flattened into `serve`).
#[derive(Debug, Args)]
pub(crate) struct GlobalArgs {
    /// Run as the global router: no local engines; each request goes to the `kvrouter serve`
    /// of the cluster the global policy picks (needs --cluster).
    #[arg(help_heading = H::GLOBAL, long)]
    pub(crate) global: bool,
    /// A cluster behind --global (repeatable): NAME=URL of its `kvrouter serve`, optionally
    /// `,rtt_ms=X` (round trip to it, default 0) and `,weight=Y` (static-split share, default 1).
    #[arg(help_heading = H::GLOBAL, long = "cluster", value_name = "NAME=URL[,rtt_ms=X][,weight=Y]")]
    clusters: Vec<String>,
    /// How --global picks a cluster: static-split (fixed share of sessions by weight),
    /// least-loaded (fewest requests per slot, blind to cache) or kv (lowest estimated time
    /// from each cluster's cache sketch and load; sessions stay unless moving is clearly cheaper).
    #[arg(help_heading = H::GLOBAL, long, default_value = "kv")]
    global_policy: String,
    /// Milliseconds between summary fetches from each cluster.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 1000)]
    global_refresh_ms: u64,
    /// Milliseconds one summary fetch may take in all.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 500)]
    global_summary_timeout_ms: u64,
    /// A cluster whose last summary arrived longer ago than this is routed around (its
    /// sessions move).
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 10.0)]
    global_max_summary_age_secs: f64,
    /// Hysteresis: a session leaves its cluster only for one whose estimate is below this
    /// fraction of its own (0 < ratio ≤ 1; 1 = no hysteresis).
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 0.5)]
    global_session_move_ratio: f64,
    /// A session idle this long forgets its cluster.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 3600.0)]
    global_session_ttl_secs: f64,
    /// Window over which --global measures the prefill work it sends each cluster (tokens/s);
    /// against the cluster's prefill capacity it is the share of the workers' time prefill
    /// steps take from decode, which the kv estimate charges.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 5.0)]
    global_load_window_secs: f64,
    /// Bearer token --global sends for the clusters' GET /admin/cluster-summary (their admin
    /// token). Prefer the environment variable: a flag's value is visible in `ps`.
    #[arg(help_heading = H::GLOBAL, long, env = "KVROUTER_CLUSTER_TOKEN", hide_env_values = true)]
    cluster_token: Option<String>,
    /// This router's cluster name in the summary it publishes (GET /admin/cluster-summary).
    #[arg(help_heading = H::GLOBAL, long, default_value = "local")]
    cluster_name: String,
    /// The published summary is rebuilt when older than this many milliseconds: it is never
    /// older, and the index is walked at most once per period however many routers poll.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 1000)]
    cluster_summary_refresh_ms: u64,
    /// Prefill speed of one worker stated in the summary, tokens/s; 0 = unknown (the global
    /// router assumes 10,000), or derived from the timing model with --mock-workers.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 0.0)]
    cluster_prefill_tokens_per_s: f64,
    /// Inter-token latency stated in the summary, ms; 0 = unknown, or derived from the timing
    /// model with --mock-workers.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 0.0)]
    cluster_decode_ms_per_token: f64,
    /// Inter-token latency added per extra running request on a worker, stated in the summary,
    /// ms; 0 = unknown, or derived from the timing model with --mock-workers.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 0.0)]
    cluster_decode_ms_per_token_per_seq: f64,
    /// Batch slots over all workers stated in the summary; 0 = unknown, or --mock-workers ×
    /// the mock engines' --max-num-seqs.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 0)]
    cluster_max_running_requests: u64,
    /// Inter-token latency added per KV block in use on a worker (engines whose steps slow
    /// with the context they hold), stated in the summary through its latency, ms; 0 =
    /// unknown, or derived from the timing model with --mock-workers.
    #[arg(help_heading = H::GLOBAL, long, default_value_t = 0.0)]
    cluster_decode_ms_per_token_per_kv_block: f64,
}

impl GlobalArgs {
    /// The global router's settings (`--global`), or `None` without it. `--cluster` without
    /// `--global` is an error (it would be ignored).
    pub(crate) fn config(&self) -> anyhow::Result<Option<GlobalServeConfig>> {
        if !self.global {
            if !self.clusters.is_empty() {
                bail!("--cluster needs --global (it lists the clusters a global router routes to)");
            }
            return Ok(None);
        }
        let clusters = self
            .clusters
            .iter()
            .map(|c| ClusterTarget::parse(c).map_err(|e| anyhow::anyhow!("--cluster {c:?}: {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let policy: GlobalPolicy = self
            .global_policy
            .parse()
            .map_err(|e| anyhow::anyhow!("--global-policy: {e}"))?;
        let ratio = self.global_session_move_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            bail!("--global-session-move-ratio must be in (0, 1], got {ratio}");
        }
        let config = GlobalServeConfig {
            clusters,
            router: GlobalConfig {
                policy,
                max_summary_age: positive(
                    self.global_max_summary_age_secs,
                    "--global-max-summary-age-secs",
                )?,
                session_move_ratio: ratio,
                session_ttl: positive(self.global_session_ttl_secs, "--global-session-ttl-secs")?,
                load_window: positive(self.global_load_window_secs, "--global-load-window-secs")?,
            },
            refresh: millis(self.global_refresh_ms, "--global-refresh-ms")?,
            summary_timeout: millis(
                self.global_summary_timeout_ms,
                "--global-summary-timeout-ms",
            )?,
            summary_token: self.cluster_token.clone().filter(|t| !t.trim().is_empty()),
        };
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(config))
    }

    /// What this router publishes at `GET /admin/cluster-summary`.
    pub(crate) fn summary(&self) -> anyhow::Result<ClusterSummaryConfig> {
        ClusterTarget::parse(&format!("{}=http://x", self.cluster_name))
            .map_err(|e| anyhow::anyhow!("--cluster-name: {e}"))?;
        use kvrouter_core::global::{MAX_STATED_DECODE_MS, MAX_STATED_PREFILL_TOKENS_PER_S};
        let speed = |v: f64, flag: &str| -> anyhow::Result<f64> {
            let max = if flag == "--cluster-prefill-tokens-per-s" {
                MAX_STATED_PREFILL_TOKENS_PER_S
            } else {
                MAX_STATED_DECODE_MS
            };
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                bail!("{flag} must be a number from 0 to {max}, got {v}");
            }
            Ok(v)
        };
        Ok(ClusterSummaryConfig {
            name: self.cluster_name.clone(),
            refresh: millis(
                self.cluster_summary_refresh_ms,
                "--cluster-summary-refresh-ms",
            )?,
            prefill_tokens_per_s: speed(
                self.cluster_prefill_tokens_per_s,
                "--cluster-prefill-tokens-per-s",
            )?,
            decode_ms_per_token: speed(
                self.cluster_decode_ms_per_token,
                "--cluster-decode-ms-per-token",
            )?,
            decode_ms_per_token_per_seq: speed(
                self.cluster_decode_ms_per_token_per_seq,
                "--cluster-decode-ms-per-token-per-seq",
            )?,
            max_running_requests: self.cluster_max_running_requests,
            decode_ms_per_token_per_kv_block: speed(
                self.cluster_decode_ms_per_token_per_kv_block,
                "--cluster-decode-ms-per-token-per-kv-block",
            )?,
        })
    }
}

/// Fills the summary's unknown speeds and batch slots from the `workers` embedded mock
/// engines' configuration and timing model (after their speed-up), so a cluster of slower
/// mocks says it is slower, and how its steps slow as its batches grow.
pub(crate) fn speeds_from_mocks(
    summary: &mut ClusterSummaryConfig,
    mock: &kvrouter_mock_engine::MockEngineConfig,
    workers: usize,
) -> anyhow::Result<()> {
    use kvrouter_engine::timing::StepShape;
    let model = mock.timing.model(mock.speedup_ratio);
    if summary.prefill_tokens_per_s == 0.0 {
        let ms = model.prefill_ms(1024).context("mock timing model")?;
        summary.prefill_tokens_per_s = if ms > 0.0 { 1024.0 / ms * 1e3 } else { 0.0 };
    }
    let capacity = ((mock.engine.num_gpu_blocks * mock.engine.block_size) as u64).max(2048);
    // A decode step of `seqs` requests of 1,024 tokens of context each, `kv` tokens held.
    let step = |seqs: u64, kv: u64| {
        model
            .decode_ms(&StepShape {
                prefill_tokens: 0,
                decode_seqs: seqs,
                decode_mean_context: 1024.0,
                active_kv_tokens: kv.min(capacity),
                kv_capacity_tokens: capacity,
            })
            .context("mock timing model")
    };
    let alone = step(1, 1024)?;
    // The growth with the KV held (one more 1,024 tokens, per block), and what one more
    // request adds beyond its KV (none for dynamo-poly, whose steps follow KV use alone).
    let blocks = (1024 / mock.engine.block_size.max(1)).max(1) as f64;
    let per_block = ((step(1, 2048)? - alone) / blocks).max(0.0);
    if summary.decode_ms_per_token == 0.0 {
        summary.decode_ms_per_token = alone;
    }
    let kv_known = summary.decode_ms_per_token_per_kv_block > 0.0;
    if !kv_known {
        summary.decode_ms_per_token_per_kv_block = per_block;
    }
    if summary.decode_ms_per_token_per_seq == 0.0 {
        let kv_part = summary.decode_ms_per_token_per_kv_block * blocks;
        summary.decode_ms_per_token_per_seq = (step(2, 2048)? - alone - kv_part).max(0.0);
    }
    if summary.max_running_requests == 0 {
        summary.max_running_requests = (workers * mock.engine.max_num_seqs) as u64;
    }
    Ok(())
}

/// Runs `kvrouter serve --global`.
pub(crate) async fn run(
    global: GlobalServeConfig,
    config: kvrouter_server::ServeConfig,
    addr: &str,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--host/--port: binding {addr}"))?;
    let names: Vec<&str> = global.clusters.iter().map(|c| c.name.as_str()).collect();
    let line = format!(
        "kvrouter serve --global listening on http://{} policy={} clusters={}",
        listener.local_addr()?,
        global.router.policy,
        names.join(",")
    );
    let server = kvrouter_server::global::start(global, config, listener).await?;
    let shutdown = crate::signals::shutdown_signal()?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
    }
    shutdown.await?;
    server.stop().await;
    Ok(())
}
