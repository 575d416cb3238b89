//! `kvrouter serve`.

use crate::flag_values::{positive, secs};
use crate::headings as H;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_engine::EngineConfig;
use kvrouter_mock_engine::MockEngineConfig;
use kvrouter_server::{ServeConfig, WorkerEntry};
use kvrouter_tokenizer::ChatTemplate;

use crate::routing_args::RoutingArgs;
use crate::startup::TemplateSource;
use std::path::PathBuf;
use std::sync::Arc;

mod checked;

pub(crate) use checked::{Checked, Outputs};

/// Most embedded mock engines `serve --mock-workers` starts.
const MAX_MOCK_WORKERS: usize = 256;

/// Flags of `kvrouter serve`, named as in the seeds' frontend where it has one. Groups of flags
/// live in `*_args.rs` beside the code that checks them; the order of the fields here is the
/// order of `--help` and `--print-config`.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on.
    #[arg(help_heading = H::LISTEN, long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(help_heading = H::LISTEN, long, default_value_t = 8000)]
    port: u16,
    /// A worker's base URL (repeatable), e.g. http://10.0.0.5:8000.
    #[arg(help_heading = H::LISTEN, long = "worker")]
    workers: Vec<String>,
    /// A TOML file of `[[workers]]` (id, url, kv_events_endpoint, replay_endpoint, dp_size,
    /// block_size, max_num_batched_tokens, kv_capacity_blocks, labels, policy_version, engine,
    /// models, profile; docs/serve.md, "Workers file").
    #[arg(help_heading = H::LISTEN, long)]
    workers_file: Option<PathBuf>,
    /// Start N embedded mock engines and route to them (at most 256).
    #[arg(help_heading = H::MOCK, long, default_value_t = 0)]
    mock_workers: usize,
    /// Speed-up ratio of the embedded mock engines.
    #[arg(help_heading = H::MOCK, long, default_value_t = 1.0)]
    mock_speedup_ratio: f64,
    /// Weight-load time of each embedded mock engine (weight updates), ms before the speed-up.
    #[arg(help_heading = H::MOCK, long, default_value_t = 0.0)]
    mock_weight_load_ms: f64,
    /// How far, ms, the host may fall behind the embedded mock engines' timing model while they
    /// keep working (they catch up within it; see `kvrouter mock-engine --max-step-lag-ms`).
    #[arg(help_heading = H::MOCK, long, default_value_t = 50.0)]
    mock_max_step_lag_ms: f64,
    /// KV capacity in blocks of each embedded mock engine.
    #[arg(help_heading = H::MOCK, long, default_value_t = 16_384)]
    mock_num_gpu_blocks: usize,
    /// Model name(s) served (default: learned from the first worker's /v1/models).
    #[arg(help_heading = H::LISTEN, long = "model-name")]
    model_names: Vec<String>,
    #[command(flatten)]
    routing: RoutingArgs,
    /// `cost` mode: the step-time profile the workers run, for those that name none of their
    /// own (`profile` in --workers-file, the admin API, discovery): `dynamo-poly`, a built-in
    /// (`h100-llama3-8b`, `h200-llama3-8b`) or a JSON profile's path (docs/routing.md); times
    /// divided by --router-cost-speedup-ratio. Default: dynamo-poly, or the online fit with
    /// --router-cost-fit (a worker's own profile wins over the fit).
    #[arg(help_heading = H::ROUTING, long)]
    router_cost_profile: Option<String>,
    /// Hugging Face tokenizer.json for routing (default: the built-in tokenizer).
    #[arg(help_heading = H::TOKENIZER, long)]
    tokenizer: Option<PathBuf>,
    /// Jinja chat template (default: tokenizer_config.json beside the tokenizer, else ChatML).
    #[arg(help_heading = H::TOKENIZER, long)]
    chat_template: Option<PathBuf>,
    /// The admin token and who may release sessions.
    #[command(flatten)]
    admin: crate::admin_args::AdminArgs,
    /// Decision headers, request traces, logs, the access log, OTLP and metric names.
    #[command(flatten)]
    pub(crate) observability: crate::observability_args::ObservabilityArgs,
    /// Retries, migration, stream and upstream timeouts.
    #[command(flatten)]
    upstream: crate::upstream_args::UpstreamArgs,
    /// Runtime worker threads (0 = auto: `TOKIO_WORKER_THREADS` when set, else one per CPU);
    /// at most 1024. On a 2-CPU host 1 saves CPU per streamed chunk, but then a large body's
    /// parse and chat template hold up every other request for as long as they take.
    #[arg(help_heading = H::LISTEN, long, default_value_t = 0)]
    worker_threads: usize,
    /// Text prompts of at most this many bytes are tokenized on the request's task rather than
    /// handed to the blocking pool (0 = always the pool).
    #[arg(help_heading = H::TOKENIZER, long, default_value_t = 2048)]
    tokenize_inline_max_bytes: usize,
    /// Append one JSON line per finished request (worker, policy version, tokens, timings).
    #[arg(help_heading = H::RL, long)]
    provenance_log: Option<std::path::PathBuf>,
    /// Rotate the provenance log (to PATH.1) past this many MiB.
    #[arg(help_heading = H::RL, long, default_value_t = 256)]
    provenance_log_max_mib: u64,
    /// Sharing state with the other replicas of this router over NATS.
    #[command(flatten)]
    replicas: crate::replica_args::ReplicaArgs,
    /// Health checks and outlier detection.
    #[command(flatten)]
    health: crate::health_args::HealthArgs,
    /// Bounds of KV event ingestion.
    #[command(flatten)]
    kv_events: crate::kv_event_args::KvEventArgs,
    #[command(flatten)]
    http: HttpArgs,
    /// The pick API's leases and bounds.
    #[command(flatten)]
    picker: crate::picker_args::PickerArgs,
    /// Boxed: keeps `ServeArgs` (and the subcommand enum) small.
    #[command(flatten)]
    discovery: Box<crate::discovery_args::DiscoveryArgs>,
    /// `--global`, `--cluster` and the `--cluster-*` summary settings (boxed like discovery).
    #[command(flatten)]
    global: Box<crate::global_args::GlobalArgs>,
    /// `--planner-advise`, the planner's bounds, targets and windows, and its actions.
    #[command(flatten)]
    planner: crate::planner_serve_args::PlannerServeArgs,
}

/// Client-connection timeouts and the shutdown grace period (`serve` and `mock-engine`).
#[derive(Debug, Args)]
pub(crate) struct HttpArgs {
    /// Seconds a client gets to send a whole request head once it started (slowloris).
    #[arg(help_heading = H::HTTP, long, default_value_t = 10.0)]
    http_header_read_timeout_secs: f64,
    /// Seconds a client gets to send a whole request body once its head arrived (a body that
    /// stalls or trickles; at the 64 MiB body limit the default asks for about 1.1 MB/s).
    #[arg(help_heading = H::HTTP, long, default_value_t = 60.0)]
    http_body_read_timeout_secs: f64,
    /// Seconds a client connection with no request in flight may stay silent.
    #[arg(help_heading = H::HTTP, long, default_value_t = 60.0)]
    http_idle_timeout_secs: f64,
    /// Seconds a write to a client may make no progress (a client that stopped reading its
    /// answer, or one gone without closing): its connection is closed and its request ended.
    #[arg(help_heading = H::HTTP, long, default_value_t = 60.0)]
    http_write_timeout_secs: f64,
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
            body_read_timeout: positive(
                self.http_body_read_timeout_secs,
                "--http-body-read-timeout-secs",
            )?,
            idle_timeout: positive(self.http_idle_timeout_secs, "--http-idle-timeout-secs")?,
            write_timeout: positive(self.http_write_timeout_secs, "--http-write-timeout-secs")?,
            shutdown_grace: secs(Some(self.shutdown_grace_secs), "--shutdown-grace-secs")?
                .unwrap_or_default(),
        })
    }
}

impl ServeArgs {
    /// The configuration; with [`Outputs::CheckOnly`] its OTLP exporter and provenance log are
    /// left out after their values are checked (nothing is created or started).
    fn config(&self, outputs: Outputs) -> anyhow::Result<ServeConfig> {
        let mut router = self.routing.config()?;
        let mut workers: Vec<WorkerEntry> = self
            .workers
            .iter()
            .map(|url| WorkerEntry {
                url: url.clone(),
                ..WorkerEntry::default()
            })
            .collect();
        for w in &workers {
            w.validate().with_context(|| {
                format!(
                    "--worker {}",
                    crate::print_config::without_credentials(&w.url)
                )
            })?;
        }
        if let Some(path) = &self.workers_file {
            workers.extend(crate::worker_list::read_workers_file(path)?);
        }
        let access = self.admin.config()?;
        let picks = self.picker.picks(access.admin_token.is_some())?;
        if self.global.global && (!workers.is_empty() || self.mock_workers > 0) {
            bail!("--global starts no engines and routes to clusters: drop --worker, --workers-file and --mock-workers");
        }
        if self.global.global {
            // What a global router does not run: it would start without them and say nothing.
            let unread: Vec<&str> = [
                self.discovery.enabled().then_some("--discovery"),
                self.picker.ext_proc_port.map(|_| "--ext-proc-port"),
                self.replicas.enabled().then_some("--replica-sync"),
                self.planner.given(),
            ]
            .into_iter()
            .flatten()
            .collect();
            if !unread.is_empty() {
                bail!(
                    "--global routes to clusters, each with its own router: {} belong to those \
                     routers (drop them here)",
                    unread.join(", ")
                );
            }
        }
        if workers.is_empty()
            && self.mock_workers == 0
            && !self.discovery.enabled()
            && !self.global.global
        {
            bail!("no workers: give --worker URL, --workers-file PATH, --mock-workers N or --discovery");
        }
        if self.mock_workers > MAX_MOCK_WORKERS {
            bail!(
                "--mock-workers must be at most {MAX_MOCK_WORKERS} (each is an HTTP server and a \
                 KV event socket in this process; run more with `kvrouter mock-engine` processes)"
            );
        }
        if !(self.mock_speedup_ratio.is_finite()
            && self.mock_speedup_ratio >= kvrouter_engine::MIN_SPEEDUP_RATIO)
        {
            bail!(
                "--mock-speedup-ratio must be a finite number of at least {}",
                kvrouter_engine::MIN_SPEEDUP_RATIO
            );
        }
        if self.mock_workers > 0 && self.routing.router_cost_speedup_ratio.is_none() {
            // The embedded engines run dynamo-poly this much faster: the cost model knows.
            router.router_cost_speedup_ratio = self.mock_speedup_ratio;
        }
        if self.mock_num_gpu_blocks == 0
            || self.mock_num_gpu_blocks > kvrouter_engine::MAX_NUM_GPU_BLOCKS
        {
            bail!(
                "--mock-num-gpu-blocks must be from 1 to {}",
                kvrouter_engine::MAX_NUM_GPU_BLOCKS
            );
        }
        let speedup = router.router_cost_speedup_ratio;
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
            admin_token: access.admin_token,
            api_keys: access.api_keys,
            worker_api_key: access.worker_api_key,
            session_release_auth: access.session_release_auth,
            expose_decisions: self.observability.expose_decisions,
            retries: self.upstream.retries,
            tokenize_inline_max_bytes: self.tokenize_inline_max_bytes,
            migration_limit: self.upstream.migration_limit,
            stream_idle_timeout: self.upstream.stream_idle_timeout()?,
            stream_coalesce_max_bytes: self.upstream.stream_coalesce_max_bytes()?,
            stream_coalesce_yields: self.upstream.stream_coalesce_yields()?,
            stream_coalesce_max_hold: self.upstream.stream_coalesce_max_hold()?,
            stream_head_hold: self.upstream.stream_head_hold()?,
            trace_capture: self.observability.trace_capture()?,
            metrics_prefix: self.observability.metrics_prefix()?,
            otel: match outputs {
                Outputs::Open => self.observability.otel()?,
                Outputs::CheckOnly => self.observability.otel_settings().map(|_| None)?,
            },
            access_log: self.observability.access_log()?,
            http: self.http.limits()?,
            upstream_connect_timeout: self.upstream.connect_timeout()?,
            upstream_first_byte_timeout: self.upstream.first_byte_timeout()?,
            upstream_response_timeout: self.upstream.response_timeout()?,
            provenance: match &self.provenance_log {
                None => None,
                Some(_) if outputs == Outputs::CheckOnly => None,
                Some(path) => Some(Arc::new(
                    kvrouter_server::provenance::ProvenanceLog::open(
                        path,
                        self.provenance_log_max_mib.saturating_mul(1 << 20),
                    )
                    .map_err(|e| anyhow::anyhow!("--provenance-log {}: {e}", path.display()))?,
                )),
            },
            health: self.health.config()?,
            kv_ingest: self.kv_events.config()?,
            discovery: self.discovery.config()?,
            replica_sync: self.replicas.config()?,
            picks,
            cluster_summary: self.global.summary()?,
            planner_act: self.planner.act()?,
            planner: self.planner.advice()?,
            profiles: crate::worker_list::profiles(self.router_cost_profile.as_deref(), speedup)?,
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
            weight_load: crate::flag_values::non_negative_ms(
                self.mock_weight_load_ms,
                "--mock-weight-load-ms",
            )?,
            // They stop after the router's drain, which ended everything it sent them; what is
            // left (a weight load the drain cut short) is ended at once, not given a second
            // grace period (found by a probe: the exit took twice the grace).
            http: kvrouter_http::HttpLimits {
                shutdown_grace: std::time::Duration::ZERO,
                ..self.http.limits()?
            },
            max_step_lag: crate::flag_values::non_negative_ms(
                self.mock_max_step_lag_ms,
                "--mock-max-step-lag-ms",
            )?,
            ..MockEngineConfig::default()
        };
        Ok(crate::embedded::like_the_router(template, config))
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
    let Checked {
        config,
        mock_engine,
        global,
        mut ext_proc,
        warnings,
    } = args.checked(Outputs::Open)?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    let mode = config.router.router_mode;
    let otel = config.otel.clone();
    let addr = format!("{}:{}", args.host, args.port);
    if let Some(global) = global {
        return crate::global_args::run(global, config, &addr).await;
    }
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("--host/--port: binding {addr}"))?;
    // The embedded engines are started here, not by the server, and stopped after it drained.
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
    let shutdown = crate::signals::shutdown_signal()?;
    let first = format!(
        "kvrouter serve listening on http://{} mode={} workers={}{ext_proc_line}",
        server.addr,
        mode,
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
    shutdown.await?;
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

impl ServeArgs {
    /// `--worker-threads`, bounded (0 = auto, see
    /// [`runtime_worker_threads`](crate::runtime_threads::runtime_worker_threads)).
    pub(crate) fn worker_threads(&self) -> anyhow::Result<usize> {
        crate::flag_values::at_most(
            self.worker_threads,
            crate::runtime_threads::MAX_WORKER_THREADS,
            "--worker-threads",
        )
    }
}

#[cfg(test)]
mod cost_speed_tests;
