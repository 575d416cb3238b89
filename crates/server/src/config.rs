//! Settings of `kvrouter serve`, validated at the edge. The planner's are in `config/planner.rs`,
//! discovery's and replica sync's in `config/fleet.rs`.

mod fleet;
mod planner;
mod profiles;

pub use fleet::{DiscoveryConfig, DiscoverySource, ReplicaSyncConfig};
pub use planner::{PlannerAct, PlannerAdvice, PlannerTarget, WorkloadKind};
pub use profiles::{ProfileLookup, Profiles};

use kvrouter_core::router::RouterConfig;
use kvrouter_tokenizer::{ChatTemplate, Tokenizer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// One worker, as given by `--worker`, `--workers-file` or `POST /admin/workers`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerEntry {
    /// Id to use (assigned when absent).
    #[serde(default)]
    pub id: Option<u64>,
    /// Base URL of the engine's OpenAI API, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// ZeroMQ endpoint of its KV events (rank 0; rank r uses port + r). Discovered from
    /// `/server_info` when absent.
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    /// ZeroMQ endpoint of its replay socket (rank 0; rank r uses port + r).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Data-parallel ranks.
    #[serde(default)]
    pub dp_size: Option<u32>,
    /// KV block size in tokens (must equal the router's).
    #[serde(default)]
    pub block_size: Option<usize>,
    /// The engine's token budget per step.
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    /// KV capacity in blocks per rank.
    #[serde(default)]
    pub kv_capacity_blocks: Option<u64>,
    /// Free-form labels shown by the admin API.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The policy (weight) version it serves at registration (RL; default 0).
    #[serde(default)]
    pub policy_version: Option<u64>,
    /// The engine behind the URL (`mock`, `vllm`, `sglang`), for the weight-update calls;
    /// read from its `/server_info` when absent.
    #[serde(default)]
    pub engine: Option<crate::engines::EngineKind>,
    /// The models it serves; learned from its `/v1/models` (with its LoRA adapters) when
    /// empty. Requests go only to the workers that serve their `model`.
    #[serde(default)]
    pub models: Vec<String>,
    /// The step-time profile the `cost` policy prices it with: `dynamo-poly`, a built-in
    /// (`h100-llama3-8b`, `h200-llama3-8b`) or a JSON profile's path; default
    /// `--router-cost-profile`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

/// A `--workers-file` (TOML): `[[workers]]` tables.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkersFile {
    /// The workers.
    #[serde(default)]
    pub workers: Vec<WorkerEntry>,
}

/// Who may call a data-plane control endpoint: releasing a session's affinity
/// (`DELETE /v1/sessions/{id}`, `POST /finish_session`) or the pick API and its reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionReleaseAuth {
    /// Any client that can reach the data plane (the default: sessions are not secret).
    #[default]
    Open,
    /// Only callers with the admin token (`Authorization: Bearer ...`).
    Admin,
}

/// Everything `kvrouter serve` needs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Routing options (the core's configuration tree).
    pub router: RouterConfig,
    /// Workers to register at start.
    pub workers: Vec<WorkerEntry>,
    /// Model names served; learned from the first worker's `/v1/models` when empty.
    pub model_names: Vec<String>,
    /// Tokenizer for routing.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// Chat template for routing.
    pub chat_template: Arc<ChatTemplate>,
    /// Bearer token of the admin API (`None` = admin API off).
    pub admin_token: Option<String>,
    /// Bearer tokens of the data plane (`--api-key`): with any, the OpenAI endpoints, the pick
    /// API and session release need one of them (or the admin token). Empty: open.
    pub api_keys: Vec<String>,
    /// Sent to every worker as `Authorization: Bearer <key>` (`--worker-api-key`: engines
    /// started with `--api-key`).
    pub worker_api_key: Option<String>,
    /// Who may release session affinity.
    pub session_release_auth: SessionReleaseAuth,
    /// Add `x-kvrouter-decision` to responses.
    pub expose_decisions: bool,
    /// Retries on another worker when an upstream fails before its first byte.
    pub retries: u32,
    /// Token ids kept by the tokenization cache.
    pub tokenizer_cache_tokens: usize,
    /// Concurrent tokenizations on the blocking pool.
    pub tokenize_concurrency: usize,
    /// Prompts of at most this many bytes are tokenized on the request's own task instead of
    /// the blocking pool (the hand-off costs more than tokenizing a short prompt); 0 = never.
    pub tokenize_inline_max_bytes: usize,
    /// Worker health checks and outlier detection.
    pub health: HealthConfig,
    /// Times a failed stream may be continued on another worker (0 = never).
    pub migration_limit: u32,
    /// A stream that sends nothing for this long counts as failed (`None` = never).
    pub stream_idle_timeout: Option<std::time::Duration>,
    /// Chunks of a worker's stream already there when one comes are passed on to the client
    /// together, up to this many bytes (0 = each alone).
    pub stream_coalesce_max_bytes: usize,
    /// Before passing such a batch on, yield to the scheduler so the worker connection's task
    /// can hand over chunks it already read, until this many turns in a row brought nothing
    /// (0 = never).
    pub stream_coalesce_yields: u32,
    /// The longest a batch waits in such turns after its first chunk came.
    pub stream_coalesce_max_hold: std::time::Duration,
    /// A streamed answer's status and headers wait up to this long for its first chunk, so
    /// that both go to the client in one write (zero: only a chunk already there).
    pub stream_head_hold: std::time::Duration,
    /// Where finished requests are logged (`--provenance-log`).
    pub provenance: Option<Arc<crate::provenance::ProvenanceLog>>,
    /// Recent request timelines kept for `GET /admin/trace` (0 = off).
    pub trace_capture: usize,
    /// The access log (`--access-log`; `None` = off).
    pub access_log: Option<Arc<crate::access::AccessLog>>,
    /// OTLP trace export (`--otlp-endpoint`; `None` = off).
    pub otel: Option<Arc<crate::otel::Otel>>,
    /// The prefix of every metric name on `/metrics` (`--metrics-prefix`).
    pub metrics_prefix: String,
    /// Client-connection timeouts and the shutdown grace period.
    pub http: kvrouter_http::HttpLimits,
    /// Time to open a connection to a worker.
    pub upstream_connect_timeout: std::time::Duration,
    /// Time a worker gets to answer a streamed request's headers.
    pub upstream_first_byte_timeout: std::time::Duration,
    /// Time a worker gets to answer a non-streamed request's headers (engines send them with
    /// the whole answer, so this bounds the generation).
    pub upstream_response_timeout: std::time::Duration,
    /// Bounds of KV event ingestion.
    pub kv_ingest: IngestConfig,
    /// Where workers are discovered (`--discovery`; `None`: only the listed ones).
    pub discovery: Option<DiscoveryConfig>,
    /// Router replicas sharing state over NATS (`--replica-sync`); `None` = one router alone.
    pub replica_sync: Option<ReplicaSyncConfig>,
    /// The pick API's leases and bounds (`POST /v1/pick`, ext_proc).
    pub picks: PickConfig,
    /// What `GET /admin/cluster-summary` publishes for a global router.
    pub cluster_summary: ClusterSummaryConfig,
    /// The planner's advisory mode (`--planner-advise`; `None` = off).
    pub planner: Option<PlannerAdvice>,
    /// The planner acting on Kubernetes (`--planner-act kubernetes`; `None` = advice only).
    pub planner_act: Option<PlannerAct>,
    /// The step-time profiles of the `cost` policy (`--router-cost-profile`, a worker's
    /// `profile`).
    pub profiles: Profiles,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            workers: Vec::new(),
            model_names: Vec::new(),
            tokenizer: Arc::new(kvrouter_tokenizer::BuiltinTokenizer::new()),
            chat_template: Arc::new(ChatTemplate::ChatMl),
            admin_token: None,
            api_keys: Vec::new(),
            worker_api_key: None,
            session_release_auth: SessionReleaseAuth::Open,
            expose_decisions: false,
            retries: 2,
            tokenizer_cache_tokens: 4 << 20,
            tokenize_concurrency: 2,
            tokenize_inline_max_bytes: 2048,
            health: HealthConfig::default(),
            migration_limit: 0,
            stream_idle_timeout: Some(std::time::Duration::from_secs(300)),
            stream_coalesce_max_bytes: 64 * 1024,
            stream_coalesce_yields: 2,
            stream_coalesce_max_hold: std::time::Duration::from_micros(500),
            stream_head_hold: std::time::Duration::from_millis(100),
            trace_capture: 0,
            provenance: None,
            access_log: None,
            otel: None,
            metrics_prefix: "kvrouter_".into(),
            http: kvrouter_http::HttpLimits::default(),
            upstream_connect_timeout: std::time::Duration::from_secs(5),
            upstream_first_byte_timeout: std::time::Duration::from_secs(60),
            upstream_response_timeout: std::time::Duration::from_secs(600),
            kv_ingest: IngestConfig::default(),
            discovery: None,
            replica_sync: None,
            picks: PickConfig::default(),
            cluster_summary: ClusterSummaryConfig::default(),
            planner: None,
            planner_act: None,
            profiles: Profiles::default(),
        }
    }
}

/// Health-check settings.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthConfig {
    /// Interval of active checks (`None` = no active checks).
    pub interval: Option<Duration>,
    /// Consecutive failed active checks that make a worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive passed checks (or successful requests) that make it healthy again.
    pub recovery_threshold: u32,
    /// Consecutive failed requests (connection errors, 5xx, broken streams) that make it
    /// unhealthy.
    pub outlier_failures: u32,
    /// How long an unhealthy worker keeps its cache entries before they are dropped.
    pub index_grace: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Some(Duration::from_secs(5)),
            failure_threshold: 3,
            recovery_threshold: 2,
            outlier_failures: 3,
            index_grace: Duration::from_secs(30),
        }
    }
}

/// Bounds of KV event ingestion (`kvrouter serve --kv-event-*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// Messages larger than this (all frames together) are dropped, counted and logged, and the
    /// rank is re-synced. A frame over 4× this ends the connection (libzmq's `ZMQ_MAXMSGSIZE`,
    /// or the ZMTP reader's own bound), which breaks the stream.
    pub max_message_bytes: usize,
    /// Blocks applied per hold of the core lock; longer events are applied in parent-chained
    /// slices with the lock released between them.
    pub apply_slice_blocks: usize,
    /// How long one replay request may take in all.
    pub replay_timeout: Duration,
    /// What reads the engines' PUB sockets.
    pub transport: KvTransport,
}

/// What reads a rank's KV event stream (`--kv-event-transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransport {
    /// A libzmq SUB socket (its I/O thread reads the connection and wakes the subscriber
    /// thread through a mailbox) and its socket monitor.
    Libzmq,
    /// The subscriber thread speaks ZMTP 3.0 on the connection itself (`ingest/zmtp.rs`): one
    /// thread woken per message.
    #[default]
    Zmtp,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_message_bytes: 8 << 20,
            apply_slice_blocks: 512,
            replay_timeout: Duration::from_secs(5),
            transport: KvTransport::Zmtp,
        }
    }
}

/// Leases and bounds of placements handed out without forwarding (`kvrouter serve --pick-*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickConfig {
    /// A pick with no first token and no finish reported within this time expires and its
    /// load is released (`--pick-lease-secs`).
    pub lease: Duration,
    /// A pick whose first token was reported expires this long after it, unless finished
    /// (`--pick-max-duration-secs`): a caller that died mid-generation does not hold load
    /// forever.
    pub max_duration: Duration,
    /// Outstanding picks at most; more are refused with 529 (`--pick-max-outstanding`).
    pub max_outstanding: usize,
    /// Who may pick and report (`--pick-auth`): reports release load and a `failed` one counts
    /// against its worker's health, so an untrusted data plane should not send them.
    pub auth: SessionReleaseAuth,
}

impl Default for PickConfig {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            max_duration: Duration::from_secs(600),
            max_outstanding: 65_536,
            auth: SessionReleaseAuth::Open,
        }
    }
}

/// The cluster summary this router publishes at `GET /admin/cluster-summary` for a global
/// router (`kvrouter serve --cluster-*`).
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSummaryConfig {
    /// The cluster's name in its summaries (`--cluster-name`).
    pub name: String,
    /// A summary older than this is rebuilt when asked for; the one served is never older
    /// (`--cluster-summary-refresh-ms`).
    pub refresh: Duration,
    /// Prefill speed of one worker, tokens/s; 0 = unknown (`--cluster-prefill-tokens-per-s`).
    pub prefill_tokens_per_s: f64,
    /// Inter-token latency of one request alone on a worker, ms; 0 = unknown
    /// (`--cluster-decode-ms-per-token`).
    pub decode_ms_per_token: f64,
    /// Inter-token latency added per extra running request on a worker, ms; 0 = unknown
    /// (`--cluster-decode-ms-per-token-per-seq`).
    pub decode_ms_per_token_per_seq: f64,
    /// Batch slots over all workers; 0 = unknown (`--cluster-max-running-requests`).
    pub max_running_requests: u64,
    /// Inter-token latency added per KV block in use on a worker, ms; 0 = unknown
    /// (`--cluster-decode-ms-per-token-per-kv-block`): engines whose steps slow with the
    /// context they hold, not only with the requests they run.
    pub decode_ms_per_token_per_kv_block: f64,
}

impl Default for ClusterSummaryConfig {
    fn default() -> Self {
        Self {
            name: "local".into(),
            refresh: Duration::from_secs(1),
            prefill_tokens_per_s: 0.0,
            decode_ms_per_token: 0.0,
            decode_ms_per_token_per_seq: 0.0,
            max_running_requests: 0,
            decode_ms_per_token_per_kv_block: 0.0,
        }
    }
}
