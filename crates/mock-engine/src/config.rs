//! Settings of a mock engine server.

use kvrouter_engine::{DynamoPoly, EngineConfig, SpeedUp, TableProfile, TimingModel};
use kvrouter_tokenizer::{BuiltinTokenizer, ChatTemplate, Tokenizer};
use std::sync::Arc;

/// Which timing model the engine uses.
#[derive(Clone, Debug)]
pub enum TimingChoice {
    /// Dynamo mocker's polynomial (the default).
    DynamoPoly,
    /// A table profile (built-in name or file).
    Profile(Arc<TableProfile>),
}

impl TimingChoice {
    /// The model, divided by `speedup_ratio`.
    pub fn model(&self, speedup_ratio: f64) -> Box<dyn TimingModel> {
        match self {
            TimingChoice::DynamoPoly => Box::new(SpeedUp {
                inner: DynamoPoly,
                ratio: speedup_ratio,
            }),
            TimingChoice::Profile(p) => Box::new(SpeedUp {
                inner: TableProfile::clone(p),
                ratio: speedup_ratio,
            }),
        }
    }
}

/// Everything a mock engine server needs.
#[derive(Clone, Debug)]
pub struct MockEngineConfig {
    /// The model name it serves (requests naming another model get 404).
    pub model_name: String,
    /// More names of the same model (vLLM's repeated `--served-model-name`), each served.
    pub model_aliases: Vec<String>,
    /// LoRA adapters it has loaded (`--lora`): listed at `/v1/models` with `parent` and `root`
    /// the base model, as vLLM lists them, and served under their own names.
    pub lora_adapters: Vec<String>,
    /// Engine sizes and limits.
    pub engine: EngineConfig,
    /// Timing model.
    pub timing: TimingChoice,
    /// Divides every modelled time (> 0).
    pub speedup_ratio: f64,
    /// ZeroMQ PUB endpoint for KV events (`None` = do not publish). The mock engine always binds
    /// it; port 0 picks a free port.
    pub kv_events_endpoint: Option<String>,
    /// ZeroMQ ROUTER endpoint answering replay requests (`None` = no replay).
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic of published messages.
    pub topic: String,
    /// Data-parallel rank written into every batch.
    pub dp_rank: u32,
    /// Batches kept for replay.
    pub replay_buffer_steps: usize,
    /// Tokenizer for prompts and generated text.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// How chat messages become a prompt (the default: ChatML). Embedded engines take the
    /// router's, so both count the same tokens.
    pub chat_template: Arc<ChatTemplate>,
    /// `max_tokens` of completions that give none.
    pub default_max_tokens: u32,
    /// How long loading new weights takes (`POST /update_weights`), before the speed-up ratio.
    pub weight_load: std::time::Duration,
    /// Client-connection timeouts and the shutdown grace period.
    pub http: kvrouter_http::HttpLimits,
    /// How far the host may fall behind the timing model (late timer ticks, a busy CPU) while
    /// the engine keeps working: within it the engine catches up, so its steps keep the model's
    /// pace; beyond it the next step starts from the wall clock. Default
    /// [`DEFAULT_MAX_STEP_LAG`].
    pub max_step_lag: std::time::Duration,
    /// With a key, `/v1/*` needs `Authorization: Bearer <key>` (401 otherwise), as vLLM's
    /// `--api-key` guards its `/v1` routes; probes, metrics and control calls stay open.
    pub api_key: Option<String>,
}

/// Default [`MockEngineConfig::max_step_lag`]: 50 ms.
pub const DEFAULT_MAX_STEP_LAG: std::time::Duration = std::time::Duration::from_millis(50);

impl MockEngineConfig {
    /// The namespace a request naming `model` with `cache_salt` hashes its blocks in: the
    /// adapter's, when `model` is one of its LoRA adapters, and the salt's (as vLLM does, and
    /// as the router hashes it; the KV events carry both).
    pub fn namespace_of(
        &self,
        model: &str,
        cache_salt: Option<&str>,
    ) -> kvrouter_core::hashing::HashNamespace {
        kvrouter_core::hashing::HashNamespace {
            lora_name: self
                .lora_adapters
                .iter()
                .any(|a| a == model)
                .then(|| model.to_owned()),
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
        }
    }

    /// Every name a request may give as `model`: the model's names, then its adapters.
    pub fn served_names(&self) -> Vec<String> {
        std::iter::once(self.model_name.clone())
            .chain(self.model_aliases.iter().cloned())
            .chain(self.lora_adapters.iter().cloned())
            .collect()
    }
}

impl Default for MockEngineConfig {
    fn default() -> Self {
        Self {
            model_name: "mock-model".into(),
            model_aliases: Vec::new(),
            lora_adapters: Vec::new(),
            engine: EngineConfig::default(),
            timing: TimingChoice::DynamoPoly,
            speedup_ratio: 1.0,
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            topic: String::new(),
            dp_rank: 0,
            replay_buffer_steps: 10_000,
            tokenizer: Arc::new(BuiltinTokenizer::new()),
            chat_template: Arc::new(ChatTemplate::ChatMl),
            default_max_tokens: 16,
            weight_load: std::time::Duration::ZERO,
            http: kvrouter_http::HttpLimits::default(),
            max_step_lag: DEFAULT_MAX_STEP_LAG,
            api_key: None,
        }
    }
}
