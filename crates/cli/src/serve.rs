//! `kvrouter serve`.

use crate::headings as H;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_engine::EngineConfig;
use kvrouter_mock_engine::MockEngineConfig;
use kvrouter_server::{HealthConfig, ServeConfig, SessionReleaseAuth, WorkerEntry, WorkersFile};
use kvrouter_tokenizer::ChatTemplate;

use crate::routing_args::RoutingArgs;
use crate::startup::TemplateSource;
use std::path::PathBuf;
use std::sync::Arc;

/// Flags of `kvrouter serve`, named as in the seeds' frontend where it has one.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// The pick API's leases and bounds.
    #[command(flatten)]
    picker: crate::picker_args::PickerArgs,
    /// Advisory planner: a recommended worker count per model pool from the router's live
    /// signals, at GET /admin/planner (with its reasons) and as
    /// kvrouter_planner_recommended_workers{pool}; nothing is scaled.
    #[arg(help_heading = H::PLANNER, long)]
    planner_advise: bool,
    /// The planner's bounds, targets and windows.
    #[command(flatten)]
    planner: crate::planner_args::PlannerArgs,
    /// Acting on the recommendations (Kubernetes).
    #[command(flatten)]
    planner_act: crate::planner_act_args::PlannerActArgs,
    /// Address to listen on.
    #[arg(help_heading = H::LISTEN, long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(help_heading = H::LISTEN, long, default_value_t = 8000)]
    port: u16,
    /// A worker's base URL (repeatable), e.g. http://10.0.0.5:8000.
    #[arg(help_heading = H::LISTEN, long = "worker")]
    workers: Vec<String>,
    /// A TOML file of `[[workers]]` (url, kv_events_endpoint, replay_endpoint, dp_size,
    /// block_size, max_num_batched_tokens, kv_capacity_blocks, labels).
    #[arg(help_heading = H::LISTEN, long)]
    workers_file: Option<PathBuf>,
    /// Start N embedded mock engines and route to them.
    #[arg(help_heading = H::MOCK, long, default_value_t = 0)]
    mock_workers: usize,
    /// Speed-up ratio of the embedded mock engines.
    #[arg(help_heading = H::MOCK, long, default_value_t = 1.0)]
    mock_speedup_ratio: f64,
    /// Weight-load time of each embedded mock engine (weight updates), ms before the speed-up.
    #[arg(help_heading = H::MOCK, long, default_value_t = 0.0)]
    mock_weight_load_ms: f64,
    /// KV capacity in blocks of each embedded mock engine.
    #[arg(help_heading = H::MOCK, long, default_value_t = 16_384)]
    mock_num_gpu_blocks: usize,
    /// Model name(s) served (default: learned from the first worker's /v1/models).
    #[arg(help_heading = H::LISTEN, long = "model-name")]
    model_names: Vec<String>,
    #[command(flatten)]
    routing: RoutingArgs,
    /// Hugging Face tokenizer.json for routing (default: the built-in tokenizer).
    #[arg(help_heading = H::TOKENIZER, long)]
    tokenizer: Option<PathBuf>,
    /// Jinja chat template (default: tokenizer_config.json beside the tokenizer, else ChatML).
    #[arg(help_heading = H::TOKENIZER, long)]
    chat_template: Option<PathBuf>,
    /// Enable the admin API with this bearer token. Prefer the environment variable or
    /// --admin-token-file: a flag's value is visible to every user in `ps`.
    #[arg(help_heading = H::ADMIN, long, env = "KVROUTER_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Read the admin API's bearer token from this file (surrounding whitespace trimmed).
    #[arg(help_heading = H::ADMIN, long)]
    admin_token_file: Option<PathBuf>,
    /// Who may release session affinity (DELETE /v1/sessions/{id}, POST /finish_session):
    /// open (any client) or admin (the admin token).
    #[arg(help_heading = H::SESSIONS, long, default_value = "open")]
    session_release_auth: String,
    /// Add x-kvrouter-decision (the score breakdown) to responses.
    #[arg(help_heading = H::OBSERVABILITY, long)]
    expose_decisions: bool,
    /// Retries on another worker when an upstream fails before its first byte.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 2)]
    retries: u32,
    /// Times a failed stream may be continued on another worker (0 = never).
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 0)]
    migration_limit: u32,
    /// Text prompts of at most this many bytes are tokenized on the request's task rather than
    /// handed to the blocking pool (0 = always the pool).
    #[arg(help_heading = H::TOKENIZER, long, default_value_t = 2048)]
    tokenize_inline_max_bytes: usize,
    /// A stream silent for this many seconds counts as failed (its worker too; the stream is
    /// migrated or ended with an error event); 0 = never.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 300.0)]
    stream_idle_timeout_secs: f64,
    /// Chunks of a worker's stream that are already there when one comes go to the client as
    /// one write, up to this many bytes (0 = each chunk alone; at most 16777216).
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 65536)]
    stream_coalesce_max_bytes: usize,
    /// Before passing such a batch on, yield up to this many times to the scheduler (lets the
    /// worker connection hand over chunks it already read; no data is waited for; at most 64).
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 0)]
    stream_coalesce_yields: u32,
    /// Append one JSON line per finished request (worker, policy version, tokens, timings).
    #[arg(help_heading = H::RL, long)]
    provenance_log: Option<std::path::PathBuf>,
    /// Rotate the provenance log (to PATH.1) past this many MiB.
    #[arg(help_heading = H::RL, long, default_value_t = 256)]
    provenance_log_max_mib: u64,
    /// Keep the timelines of the last N request attempts for GET /admin/trace (Chrome trace
    /// JSON for Perfetto); 0 = off.
    #[arg(help_heading = H::OBSERVABILITY, long, default_value_t = 0)]
    trace_capture: usize,
    /// Share load, predicted placements, sessions, groups, policy versions, pauses and the
    /// weight-update lease with the other replicas of this router over NATS
    /// (`nats://HOST:PORT`, JetStream on). Off by default: one router alone.
    #[arg(help_heading = H::REPLICAS, long, value_name = "nats://HOST:PORT")]
    replica_sync: Option<String>,
    /// This replica's id among the replicas (default: random).
    #[arg(help_heading = H::REPLICAS, long)]
    replica_id: Option<u64>,
    /// Name of the logical router the replicas form: the prefix of its NATS subjects and
    /// key-value buckets (letters, digits, `_`, `-`).
    #[arg(help_heading = H::REPLICAS, long, default_value = "kvrouter")]
    replica_cluster: String,
    /// Milliseconds between this replica's heartbeats (each lists its active requests).
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 1000)]
    replica_heartbeat_ms: u64,
    /// A replica not heard from for this many milliseconds is gone: its load and update holds
    /// are dropped; also the life of an unrenewed weight-update lease. More than twice the
    /// heartbeat.
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 5000)]
    replica_ttl_ms: u64,
    /// Events waiting to be published to the other replicas, at most; more are dropped and
    /// counted (the next heartbeat repairs lost finishes).
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 65536)]
    replica_outbox_max_events: usize,
    /// Requests one heartbeat lists at most (each with its worker, prompt tokens and blocks, so
    /// the others restore a lost begin); with more active, the lists go round the requests in
    /// ranges of ids.
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 4096)]
    replica_heartbeat_max_requests: usize,
    /// Entries read from each shared key-value bucket (members, sessions, policy) on joining,
    /// at most.
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 100_000)]
    replica_join_max_keys: usize,
    /// Keep worker health verdicts to this replica: do not publish its ejections and
    /// recoveries, and do not apply the other replicas'.
    #[arg(help_heading = H::REPLICAS, long)]
    no_replica_share_health: bool,
    #[command(flatten)]
    pub(crate) log: crate::logging::LogArgs,
    /// Write one access line per request when it ends (log target `kvrouter::access`: request
    /// id, model, worker, status, tokens, queue, TTFT and duration).
    #[arg(help_heading = H::OBSERVABILITY, long)]
    access_log: bool,
    /// With --access-log: the fraction of requests that get a line (0 to 1, spread evenly).
    #[arg(help_heading = H::OBSERVABILITY, long, default_value_t = 1.0)]
    access_log_sample: f64,
    /// Export a trace per sampled request over OTLP/HTTP (protobuf) to this collector base URL
    /// (spans go to URL/v1/traces), e.g. http://127.0.0.1:4318; off when not given.
    #[arg(help_heading = H::OBSERVABILITY, long)]
    otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: the fraction of requests traced (0 to 1, spread evenly).
    #[arg(help_heading = H::OBSERVABILITY, long, default_value_t = 1.0)]
    otlp_sample_ratio: f64,
    /// The prefix of every metric name on /metrics (letters, digits, `_` and `:`, not starting
    /// with a digit; may be empty).
    #[arg(help_heading = H::OBSERVABILITY, long, default_value = "kvrouter_")]
    metrics_prefix: String,
    /// Seconds between active health checks (GET /health); 0 turns them off.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 5.0)]
    health_check_interval_secs: f64,
    /// Consecutive failed health checks that make a worker unhealthy.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 3)]
    health_failure_threshold: u32,
    /// Consecutive passed checks or requests that make it healthy again.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 2)]
    health_recovery_threshold: u32,
    /// Consecutive failed requests (connection errors, 5xx, broken streams) that make a worker
    /// unhealthy.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 3)]
    outlier_consecutive_failures: u32,
    /// Seconds an unhealthy worker keeps its cache entries in the index.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 30.0)]
    unhealthy_index_grace_secs: f64,
    /// Seconds to open a connection to a worker before it counts as failed.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 5.0)]
    upstream_connect_timeout_secs: f64,
    /// Seconds a worker gets to send a streamed request's response headers before the request
    /// is retried elsewhere and the worker counts as failed.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 60.0)]
    upstream_first_byte_timeout_secs: f64,
    /// Seconds a worker gets to answer a non-streamed request (engines send its headers with
    /// the whole answer) before it is retried elsewhere and the worker counts as failed.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 600.0)]
    upstream_response_timeout_secs: f64,
    /// KV event messages larger than this many bytes are dropped (counted as `oversize`) and
    /// the rank re-synced; libzmq refuses frames over 4× this outright.
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 8 << 20)]
    kv_event_max_message_bytes: usize,
    /// Blocks of a KV event applied per hold of the index lock (larger events are applied in
    /// slices, letting requests route in between).
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 512)]
    kv_event_apply_slice_blocks: usize,
    /// Seconds one replay request to an engine's replay socket may take in all.
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 5.0)]
    kv_event_replay_timeout_secs: f64,
    #[command(flatten)]
    http: HttpArgs,
    /// Boxed: keeps `ServeArgs` (and the subcommand enum) small.
    #[command(flatten)]
    discovery: Box<crate::discovery_args::DiscoveryArgs>,
    /// `--global`, `--cluster` and the `--cluster-*` summary settings (boxed like discovery).
    #[command(flatten)]
    global: Box<crate::global_args::GlobalArgs>,
}

/// Client-connection timeouts and the shutdown grace period (`serve` and `mock-engine`).
#[derive(Debug, Args)]
pub(crate) struct HttpArgs {
    /// Seconds a client gets to send a whole request head once it started (slowloris).
    #[arg(help_heading = H::HTTP, long, default_value_t = 10.0)]
    http_header_read_timeout_secs: f64,
    /// Seconds a client connection with no request in flight may stay silent.
    #[arg(help_heading = H::HTTP, long, default_value_t = 60.0)]
    http_idle_timeout_secs: f64,
    /// On SIGTERM or SIGINT, seconds requests in flight get to finish before they are ended.
    #[arg(help_heading = H::HTTP, long, default_value_t = 30.0)]
    shutdown_grace_secs: f64,
}

impl HttpArgs {
    pub(crate) fn limits(&self) -> anyhow::Result<kvrouter_http::HttpLimits> {
        Ok(kvrouter_http::HttpLimits {
            header_read_timeout: positive(
                self.http_header_read_timeout_secs,
                "--http-header-read-timeout-secs",
            )?,
            idle_timeout: positive(self.http_idle_timeout_secs, "--http-idle-timeout-secs")?,
            shutdown_grace: secs(Some(self.shutdown_grace_secs), "--shutdown-grace-secs")?
                .unwrap_or_default(),
        })
    }
}

fn positive(v: f64, flag: &str) -> anyhow::Result<std::time::Duration> {
    match secs(Some(v), flag)? {
        Some(d) if !d.is_zero() => Ok(d),
        _ => bail!("{flag} must be a number of seconds > 0, got {v}"),
    }
}

/// Resolves on the first SIGINT or SIGTERM (Kubernetes stops pods with SIGTERM); a second one
/// ends the process at once.
pub(crate) async fn shutdown_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    eprintln!("{name}: draining (a second signal stops at once)");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        eprintln!("second signal: stopping now");
        std::process::exit(130);
    });
    Ok(())
}

/// Largest `--stream-coalesce-max-bytes`.
const MAX_STREAM_COALESCE_BYTES: usize = 16 << 20;
/// Largest `--stream-coalesce-yields`.
const MAX_STREAM_COALESCE_YIELDS: u32 = 64;

fn at_most<T: PartialOrd + std::fmt::Display>(v: T, max: T, flag: &str) -> anyhow::Result<T> {
    if v > max {
        bail!("{flag}: {v} is above {max}");
    }
    Ok(v)
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
    for (i, w) in file.workers.iter().enumerate() {
        if let Err(e) = w.validate() {
            bail!("--workers-file {}: workers[{i}].{e}", path.display());
        }
    }
    Ok(file.workers)
}

/// The longest `--metrics-prefix`.
const MAX_METRICS_PREFIX_BYTES: usize = 64;

/// `--metrics-prefix`, checked to make valid Prometheus metric names.
fn metrics_prefix(p: &str) -> anyhow::Result<String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    if p.len() > MAX_METRICS_PREFIX_BYTES
        || !p.chars().all(ok_char)
        || p.starts_with(|c: char| c.is_ascii_digit())
    {
        bail!(
            "--metrics-prefix {p:?}: use at most {MAX_METRICS_PREFIX_BYTES} letters, digits, `_` \
             and `:`, not starting with a digit"
        );
    }
    Ok(p.to_owned())
}

/// The longest `--admin-token-file` read; a token file holds only the token.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// Reads `--admin-token-file`: a regular file of at most [`MAX_TOKEN_FILE_BYTES`] (a device or
/// a FIFO such as `/dev/zero` could otherwise be read without end).
fn read_token_file(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read;
    let flag = || format!("--admin-token-file {}", path.display());
    let meta = std::fs::metadata(path).with_context(flag)?;
    if !meta.is_file() {
        bail!("{}: not a regular file", flag());
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .with_context(flag)?
        .take(MAX_TOKEN_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .with_context(flag)?;
    if text.len() as u64 > MAX_TOKEN_FILE_BYTES {
        bail!(
            "{}: longer than {MAX_TOKEN_FILE_BYTES} bytes (the file holds only the token)",
            flag()
        );
    }
    Ok(text)
}

/// The admin token from --admin-token / KVROUTER_ADMIN_TOKEN or --admin-token-file (not both).
fn admin_token(
    flag: Option<&str>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<Option<String>> {
    let token = match (flag, file) {
        (Some(_), Some(_)) => bail!(
            "--admin-token (or KVROUTER_ADMIN_TOKEN) and --admin-token-file are both given; use one"
        ),
        (Some(t), None) => t.trim().to_owned(),
        (None, Some(path)) => read_token_file(path)?.trim().to_owned(),
        (None, None) => return Ok(None),
    };
    if token.is_empty() {
        bail!(
            "the admin token (--admin-token, KVROUTER_ADMIN_TOKEN or --admin-token-file) is empty"
        );
    }
    Ok(Some(token))
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
        for w in &workers {
            w.validate()
                .with_context(|| format!("--worker {}", w.url))?;
        }
        if let Some(path) = &self.workers_file {
            workers.extend(read_workers_file(path)?);
        }
        let admin_token = admin_token(
            self.admin_token.as_deref(),
            self.admin_token_file.as_deref(),
        )?;
        let session_release_auth = match self.session_release_auth.as_str() {
            "open" => SessionReleaseAuth::Open,
            "admin" if admin_token.is_some() => SessionReleaseAuth::Admin,
            "admin" => bail!("--session-release-auth admin needs an admin token (--admin-token)"),
            other => bail!("--session-release-auth must be open or admin, got {other:?}"),
        };
        if self.global.global && (!workers.is_empty() || self.mock_workers > 0) {
            bail!("--global starts no engines and routes to clusters: drop --worker, --workers-file and --mock-workers");
        }
        if workers.is_empty()
            && self.mock_workers == 0
            && !self.discovery.enabled()
            && !self.global.global
        {
            bail!("no workers: give --worker URL, --workers-file PATH, --mock-workers N or --discovery");
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
        Ok(ServeConfig {
            router,
            workers,
            model_names: self.model_names.clone(),
            tokenizer,
            chat_template: Arc::new(chat_template),
            admin_token,
            session_release_auth,
            expose_decisions: self.expose_decisions,
            retries: self.retries,
            tokenize_inline_max_bytes: self.tokenize_inline_max_bytes,
            migration_limit: self.migration_limit,
            stream_idle_timeout: secs(
                Some(self.stream_idle_timeout_secs),
                "--stream-idle-timeout-secs",
            )?
            .filter(|d| !d.is_zero()),
            stream_coalesce_max_bytes: at_most(
                self.stream_coalesce_max_bytes,
                MAX_STREAM_COALESCE_BYTES,
                "--stream-coalesce-max-bytes",
            )?,
            stream_coalesce_yields: at_most(
                self.stream_coalesce_yields,
                MAX_STREAM_COALESCE_YIELDS,
                "--stream-coalesce-yields",
            )?,
            trace_capture: self.trace_capture,
            metrics_prefix: metrics_prefix(&self.metrics_prefix)?,
            otel: match (&self.otlp_endpoint, self.otlp_sample_ratio) {
                (_, s) if !(0.0..=1.0).contains(&s) => {
                    bail!("--otlp-sample-ratio must be between 0 and 1, got {s}")
                }
                (Some(url), s) => {
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        bail!("--otlp-endpoint {url:?}: give an http:// or https:// URL");
                    }
                    let otel = kvrouter_server::otel::Otel::open(url, s)
                        .with_context(|| format!("--otlp-endpoint {url}"))?;
                    Some(Arc::new(otel))
                }
                (None, _) => None,
            },
            access_log: match (self.access_log, self.access_log_sample) {
                (_, s) if !(0.0..=1.0).contains(&s) => {
                    bail!("--access-log-sample must be between 0 and 1, got {s}")
                }
                (true, s) => Some(Arc::new(kvrouter_server::access::AccessLog::new(s))),
                (false, _) => None,
            },
            http: self.http.limits()?,
            upstream_connect_timeout: positive(
                self.upstream_connect_timeout_secs,
                "--upstream-connect-timeout-secs",
            )?,
            upstream_first_byte_timeout: positive(
                self.upstream_first_byte_timeout_secs,
                "--upstream-first-byte-timeout-secs",
            )?,
            upstream_response_timeout: positive(
                self.upstream_response_timeout_secs,
                "--upstream-response-timeout-secs",
            )?,
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
            discovery: self.discovery.config()?,
            replica_sync: self.replica_sync()?,
            picks: self.picker.picks()?,
            cluster_summary: self.global.summary()?,
            planner_act: self
                .planner_act
                .config(self.planner.config()?.min_workers)?,
            planner: match self.planner_advise || self.planner_act.enabled() {
                true => Some(kvrouter_server::config::PlannerAdvice {
                    law: self.planner.config()?,
                    tick: std::time::Duration::from_secs_f64(self.planner.planner_tick_s),
                }),
                false => None,
            },
            ..ServeConfig::default()
        })
    }

    /// The embedded mock engines' settings (`--mock-*`), made to agree with the router's.
    pub(crate) fn mock_engine(&self, config: &ServeConfig) -> anyhow::Result<MockEngineConfig> {
        let template = MockEngineConfig {
            engine: EngineConfig {
                num_gpu_blocks: self.mock_num_gpu_blocks,
                ..EngineConfig::default()
            },
            speedup_ratio: self.mock_speedup_ratio,
            weight_load: std::time::Duration::try_from_secs_f64(self.mock_weight_load_ms / 1e3)
                .map_err(|_| {
                    anyhow::anyhow!("--mock-weight-load-ms must be a non-negative number")
                })?,
            http: self.http.limits()?,
            ..MockEngineConfig::default()
        };
        Ok(crate::embedded::like_the_router(template, config))
    }

    fn replica_sync(&self) -> anyhow::Result<Option<kvrouter_server::config::ReplicaSyncConfig>> {
        let Some(url) = &self.replica_sync else {
            return Ok(None);
        };
        let id = self.replica_id.unwrap_or_else(|| {
            use std::hash::{BuildHasher, Hasher};
            // OS-seeded: a replica restarted without --replica-id is a new replica.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish() >> 11
        });
        let config = kvrouter_server::config::ReplicaSyncConfig {
            url: url.clone(),
            replica_id: id,
            cluster: self.replica_cluster.clone(),
            heartbeat: std::time::Duration::from_millis(self.replica_heartbeat_ms),
            ttl: std::time::Duration::from_millis(self.replica_ttl_ms),
            outbox_max_events: self.replica_outbox_max_events,
            active_list_max: self.replica_heartbeat_max_requests,
            join_max_keys: self.replica_join_max_keys,
            share_health: !self.no_replica_share_health,
        };
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(config))
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

impl ServeArgs {
    /// Where `template` (the one [`ServeArgs::config`] chose) came from.
    pub(crate) fn template_source(&self, template: &ChatTemplate) -> TemplateSource {
        match (&self.chat_template, &self.tokenizer, template) {
            (Some(p), _, _) => TemplateSource::Flag(p.display().to_string()),
            (None, Some(_), ChatTemplate::Jinja { origin, .. }) => {
                TemplateSource::TokenizerConfig(origin.clone())
            }
            (None, Some(tok), _) => TemplateSource::ChatMlFallback {
                tokenizer: tok.display().to_string(),
            },
            (None, None, _) => TemplateSource::ChatMlDefault,
        }
    }
}

/// The startup lines after the first (crate::startup).
fn startup_lines(args: &ServeArgs, server: &kvrouter_server::RunningServer) -> Vec<String> {
    let config = server.state.config();
    let template = args.template_source(&config.chat_template);
    let tokenizer = match &args.tokenizer {
        None => format!("{} (built-in; no --tokenizer)", config.tokenizer.name()),
        Some(p) => format!("{} ({})", config.tokenizer.name(), p.display()),
    };
    crate::startup::lines(&crate::startup::Facts {
        models: &server.state.model_names(),
        block_size_tokens: config.router.kv_cache_block_size,
        tokenizer,
        template: &template,
        kv_events: config.router.router_kv_events,
        workers: &server.state.worker_entries(),
    })
}

pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = args.config()?;
    let otel = config.otel.clone();
    let mock_engine = args.mock_engine(&config)?;
    let addr = format!("{}:{}", args.host, args.port);
    if let Some(global) = args.global.config()? {
        return crate::global_args::run(global, config, &addr).await;
    }
    if args.mock_workers > 0 {
        crate::global_args::speeds_from_mocks(
            &mut config.cluster_summary,
            &mock_engine,
            args.mock_workers,
        )?;
    }
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("--host/--port: binding {addr}"))?;
    // The embedded engines are started here, not by the server, and stopped after it drained.
    let mut ext_proc = args.picker.ext_proc()?;
    // The picker drains for as long as the HTTP server does.
    ext_proc.shutdown_grace = config.http.shutdown_grace;
    let serving =
        crate::embedded::Serving::start(config, &mock_engine, args.mock_workers, listener).await?;
    let server = &serving.server;
    // The ext_proc endpoint picker, on its own port, over the same state.
    let (stop_ext_proc, ext_proc_task, ext_proc_line) = match args.picker.ext_proc_port {
        None => (None, None, String::new()),
        Some(port) => {
            let addr = format!("{}:{port}", args.host);
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .with_context(|| format!("--host/--ext-proc-port: binding {addr}"))?;
            let bound = listener.local_addr()?;
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let service = kvrouter_ext_proc::ExtProc::new(server.state.clone(), ext_proc);
            let task = tokio::spawn(kvrouter_ext_proc::serve(listener, service, async {
                let _ = rx.await;
            }));
            (Some(tx), Some(task), format!(" ext_proc={bound}"))
        }
    };
    let first = format!(
        "kvrouter serve listening on http://{} mode={} workers={}{ext_proc_line}",
        server.addr,
        args.routing.router_mode,
        server.state.worker_count()
    );
    // Best effort: a reader may take the first line and close the pipe (scripts, tests), or
    // stdout may be closed; neither may take the router down (println! would panic).
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        for line in std::iter::once(first).chain(startup_lines(&args, server)) {
            if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                break;
            }
        }
    }
    shutdown_signal().await?;
    // The picker and the HTTP server drain together (each for up to the grace period); the
    // embedded engines stop after both.
    if let Some(tx) = stop_ext_proc {
        let _ = tx.send(());
    }
    serving
        .stop_with(async {
            if let Some(task) = ext_proc_task {
                let _ = task.await;
            }
        })
        .await;
    if let Some(otel) = otel {
        // Sends the spans still buffered (the batch processor's thread blocks on the export).
        tokio::task::spawn_blocking(move || otel.shutdown()).await?;
    }
    Ok(())
}
