//! `kvrouter mock-engine`.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_engine::{EngineConfig, TableProfile};
use kvrouter_mock_engine::{MockEngineConfig, TimingChoice};
use std::path::PathBuf;

/// Flags of `kvrouter mock-engine` (vLLM's names where vLLM has one).
#[derive(Debug, Args)]
pub(crate) struct MockEngineArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// HTTP port (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name served at /v1/models (vLLM's `--served-model-name` is an alias). Repeatable:
    /// every name is served, the first is the one answers carry by default.
    #[arg(
        long,
        visible_alias = "served-model-name",
        default_value = "mock-model"
    )]
    model_name: Vec<String>,
    /// A LoRA adapter loaded on this engine (repeatable): listed at /v1/models with `parent` and
    /// `root` naming the model, and served under its own name.
    #[arg(long = "lora", value_name = "NAME")]
    lora: Vec<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// KV capacity in blocks.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: usize,
    /// Host-memory tier in blocks (0 = none).
    #[arg(long, default_value_t = 0)]
    num_cpu_blocks: usize,
    /// Token budget per engine step.
    #[arg(long, default_value_t = 8_192)]
    max_num_batched_tokens: u32,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Timing model: `dynamo-poly`, a built-in profile (`h100-llama3-8b`, `h200-llama3-8b`) or a
    /// JSON profile file.
    #[arg(long, default_value = "dynamo-poly")]
    profile: String,
    /// Divide every modelled time by this.
    #[arg(long, default_value_t = 1.0)]
    speedup_ratio: f64,
    /// Time to load new weights (POST /update_weights), ms, before the speed-up ratio.
    #[arg(long, default_value_t = 0.0)]
    weight_load_ms: f64,
    /// How far, ms, the host may fall behind the timing model (late timer ticks, a busy CPU)
    /// while the engine keeps working: within it the engine catches up and keeps the model's
    /// pace; beyond it the next step starts from the wall clock.
    #[arg(long, default_value_t = 50.0)]
    max_step_lag_ms: f64,
    /// ZeroMQ endpoint to publish KV events on (bound; port 0 picks one), e.g. tcp://127.0.0.1:5557.
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// ZeroMQ endpoint answering replay requests.
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
    /// Topic of published KV event messages.
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    /// Data-parallel rank written into every KV event batch.
    #[arg(long, default_value_t = 0)]
    dp_rank: u32,
    /// Hugging Face tokenizer.json (a file or a folder holding one); default: the built-in one.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Seed of the generated tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Require `Authorization: Bearer KEY` on /v1/* (401 otherwise), as vLLM's `--api-key`
    /// does; /health, /metrics, /tokenize and the control calls stay open.
    #[arg(long, env = "KVROUTER_MOCK_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    http: crate::serve::HttpArgs,
    #[command(flatten)]
    register: crate::discovery_args::RegisterArgs,
}

fn timing(profile: &str) -> anyhow::Result<TimingChoice> {
    if profile == "dynamo-poly" {
        return Ok(TimingChoice::DynamoPoly);
    }
    if let Some(p) = TableProfile::builtin(profile) {
        return Ok(TimingChoice::Profile(p.into()));
    }
    let path = PathBuf::from(profile);
    if !path.exists() {
        bail!("--profile {profile:?}: not dynamo-poly, not a built-in profile (h100-llama3-8b, h200-llama3-8b), and no such file");
    }
    Ok(TimingChoice::Profile(
        TableProfile::load(&path)
            .with_context(|| format!("--profile {profile}"))?
            .into(),
    ))
}

impl MockEngineArgs {
    fn config(&self) -> anyhow::Result<MockEngineConfig> {
        // What a router takes from /server_info (larger ones also broke the engine's own
        // block arithmetic: 2^32 panicked its step, and the engine stopped).
        use kvrouter_core::router::MAX_BLOCK_SIZE_TOKENS;
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE_TOKENS {
            bail!("--block-size must be from 1 to {MAX_BLOCK_SIZE_TOKENS}");
        }
        if self.num_gpu_blocks == 0 || self.num_gpu_blocks > kvrouter_engine::MAX_NUM_GPU_BLOCKS {
            bail!(
                "--num-gpu-blocks must be from 1 to {}",
                kvrouter_engine::MAX_NUM_GPU_BLOCKS
            );
        }
        if self.max_num_batched_tokens == 0 {
            bail!("--max-num-batched-tokens must be at least 1");
        }
        if self.max_num_seqs == 0 {
            bail!("--max-num-seqs must be at least 1");
        }
        if !(self.speedup_ratio.is_finite()
            && self.speedup_ratio >= kvrouter_engine::MIN_SPEEDUP_RATIO)
        {
            bail!(
                "--speedup-ratio must be a number of at least {}, got {}",
                kvrouter_engine::MIN_SPEEDUP_RATIO,
                self.speedup_ratio
            );
        }
        if self.kv_events_replay_endpoint.is_some() && self.kv_events_endpoint.is_none() {
            bail!("--kv-events-replay-endpoint needs --kv-events-endpoint");
        }
        let tokenizer =
            kvrouter_tokenizer::load(self.tokenizer.as_deref()).context("--tokenizer")?;
        if let Some(bad) = self.model_name.iter().find(|m| m.is_empty()) {
            bail!("--model-name {bad:?}: a model needs a name");
        }
        if let Some(bad) = self
            .lora
            .iter()
            .find(|a| a.is_empty() || self.model_name.contains(a))
        {
            bail!("--lora {bad:?}: an adapter needs a name of its own (not empty, not a --model-name)");
        }
        if let Some(key) = &self.api_key {
            if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
                bail!("--api-key (or KVROUTER_MOCK_API_KEY): a key is printable ASCII without spaces, and not empty");
            }
        }
        let (model_name, aliases) = self
            .model_name
            .split_first()
            .expect("clap gives --model-name a default");
        Ok(MockEngineConfig {
            model_name: model_name.clone(),
            model_aliases: aliases.to_vec(),
            lora_adapters: self.lora.clone(),
            engine: EngineConfig {
                block_size: self.block_size,
                num_gpu_blocks: self.num_gpu_blocks,
                num_cpu_blocks: self.num_cpu_blocks,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_num_seqs: self.max_num_seqs,
                seed: self.seed,
                ..EngineConfig::default()
            },
            timing: timing(&self.profile)?,
            speedup_ratio: self.speedup_ratio,
            kv_events_endpoint: self.kv_events_endpoint.clone(),
            kv_events_replay_endpoint: self.kv_events_replay_endpoint.clone(),
            topic: self.kv_events_topic.clone(),
            dp_rank: self.dp_rank,
            tokenizer,
            weight_load: crate::flag_values::non_negative_ms(
                self.weight_load_ms,
                "--weight-load-ms",
            )?,
            http: self.http.limits()?,
            max_step_lag: crate::flag_values::non_negative_ms(
                self.max_step_lag_ms,
                "--max-step-lag-ms",
            )?,
            api_key: self.api_key.clone(),
            ..MockEngineConfig::default()
        })
    }
}

pub(crate) async fn run(args: MockEngineArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    args.register.validate()?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("--host/--port: binding {addr}"))?;
    let running = kvrouter_mock_engine::start(config, listener).await?;
    let e = &running.endpoints;
    let registration = kvrouter_server::discovery::Registration {
        url: format!("http://{}", e.http),
        kv_events_endpoint: e.kv_events.clone(),
        replay_endpoint: e.replay.clone(),
        dp_size: Some(1),
        model: args.model_name.first().cloned(),
        // The router prices it with the same model; a profile file stays unnamed (the router
        // need not have it).
        profile: (args.profile == "dynamo-poly" || TableProfile::builtin(&args.profile).is_some())
            .then(|| args.profile.clone()),
    };
    let registered = match args
        .register
        .start(&registration, &e.http.to_string())
        .await
    {
        Ok(r) => r,
        Err(err) => {
            running.stop().await;
            return Err(err);
        }
    };
    let shutdown = crate::signals::shutdown_signal()?;
    // One machine-readable line on stdout, so scripts and tests learn the ports.
    println!(
        "kvrouter mock-engine listening on http://{} kv_events={} replay={}",
        e.http,
        e.kv_events.as_deref().unwrap_or("none"),
        e.replay.as_deref().unwrap_or("none")
    );
    shutdown.await?;
    // Deregistered first, so the router drains this engine before it stops answering.
    if let Some(r) = registered {
        r.revoke().await;
    }
    running.stop().await;
    Ok(())
}
