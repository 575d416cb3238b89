//! One simulated datacenter: its own local router (the same core as `kvrouter serve`), its
//! engines, and the summary it publishes.

use super::config::{ClusterEntry, GlobalSimConfig};
use crate::sim::SimError;
use kvrouter_core::global::{ClusterSummary, SummaryOptions};
use kvrouter_core::ids::{SequenceHash, WorkerId, WorkerRank};
use kvrouter_core::router::{Router, WorkerSpec};
use kvrouter_core::time::millis_f64 as ms;
use kvrouter_core::time::Time;
use kvrouter_engine::timing::{StepShape, TimingModel};
use kvrouter_engine::{Engine, StepOutcome};
use std::time::Duration;

pub(super) struct Worker {
    pub(super) engine: Engine,
    pub(super) pending: Option<StepOutcome>,
    pub(super) busy_since: Option<Time>,
    pub(super) busy: Vec<(Time, Time)>,
}

pub(super) struct Dc {
    pub(super) entry: ClusterEntry,
    pub(super) router: Router,
    pub(super) workers: Vec<Worker>,
    /// The cluster's profile, for the speeds it states in its summary.
    timing: std::sync::Arc<dyn kvrouter_engine::TimingModel>,
    pub(super) delay: Duration,
    pub(super) refresh: Duration,
    options: SummaryOptions,
    kv_capacity_tokens: u64,
    /// Prompts routed here since the last summary: the next summary's sketch is checked
    /// against the index on them (the error the sketch alone causes).
    pub(super) recent: Vec<Vec<SequenceHash>>,
}

impl Dc {
    pub(super) fn new(entry: &ClusterEntry, config: &GlobalSimConfig) -> Result<Self, SimError> {
        let bs = config.router.kv_cache_block_size;
        let mut router =
            Router::new(config.router.clone()).map_err(|e| SimError::Config(e.to_string()))?;
        // The cluster's profile, loaded once and shared by its engines.
        let timing: std::sync::Arc<dyn kvrouter_engine::TimingModel> = std::sync::Arc::from(
            kvrouter_engine::timing::by_name(&entry.profile, entry.speed)
                .map_err(|e| SimError::Config(format!("cluster {:?}: {e}", entry.name)))?,
        );
        let mut engine_config = config.engine.clone();
        engine_config.block_size = bs;
        if let Some(n) = entry.max_num_seqs {
            engine_config.max_num_seqs = n;
        }
        if let Some(n) = entry.num_gpu_blocks {
            engine_config.num_gpu_blocks = n;
        }
        let mut workers = Vec::with_capacity(entry.workers);
        for w in 0..entry.workers {
            let rank = WorkerRank::new(WorkerId(w as u64), 0);
            let mut c = engine_config.clone();
            c.seed = c.seed.wrapping_add(w as u64);
            workers.push(Worker {
                engine: Engine::new(c, rank, Box::new(std::sync::Arc::clone(&timing))),
                pending: None,
                busy_since: None,
                busy: Vec::new(),
            });
            // As in `kvrouter sim`: the router's cost policy times its estimates with the
            // engine's own model (this cluster's profile at its speed).
            router.set_worker_timing(WorkerId(w as u64), std::sync::Arc::clone(&timing));
            router
                .add_worker(WorkerSpec {
                    id: WorkerId(w as u64),
                    dp_size: 1,
                    max_num_batched_tokens: Some(u64::from(engine_config.max_num_batched_tokens)),
                    kv_capacity_blocks: Some(engine_config.num_gpu_blocks as u64),
                    policy_version: 0,
                    kv_events: true,
                })
                .map_err(|e| SimError::Config(e.to_string()))?;
        }
        let budget = u64::from(engine_config.max_num_batched_tokens);
        let prefill_ms = timing
            .prefill_ms(budget)
            .map_err(|e| SimError::Timing(e.to_string()))?;
        let refresh = entry
            .summary_refresh_ms
            .unwrap_or(config.clusters.global.summary_refresh_ms);
        Ok(Self {
            options: SummaryOptions {
                name: entry.name.clone(),
                sequence: 0,
                sketch: config.clusters.sketch(),
                prefill_tokens_per_s: budget as f64 / prefill_ms.max(1e-3) * 1e3,
                decode_ms_per_token: 0.0,
                decode_ms_per_token_per_seq: 0.0,
                max_running_requests: (entry.workers * engine_config.max_num_seqs) as u64,
            },
            entry: entry.clone(),
            router,
            workers,
            timing,
            delay: ms(entry.network_delay_ms),
            refresh: ms(refresh),
            kv_capacity_tokens: (engine_config.num_gpu_blocks * bs) as u64,
            recent: Vec::new(),
        })
    }

    /// The inter-token latency a request placed now would see (the mean over workers of a
    /// decode step at their current KV use, one more sequence), and how much one more request
    /// per worker adds to it (one more sequence of the workers' mean context).
    fn decode_ms_per_token(&self) -> (f64, f64) {
        let (mut now, mut more) = (0.0, 0.0);
        for w in &self.workers {
            let s = w.engine.stats();
            let kv = (s.used_blocks * w.engine.config().block_size) as u64;
            let per_seq = if s.running > 0 {
                kv / s.running as u64
            } else {
                1024
            };
            let shape = |seqs: u64, kv: u64| StepShape {
                prefill_tokens: 0,
                decode_seqs: seqs,
                decode_mean_context: 0.0,
                active_kv_tokens: kv.min(self.kv_capacity_tokens),
                kv_capacity_tokens: self.kv_capacity_tokens,
            };
            let a = self
                .timing
                .decode_ms(&shape(s.running as u64 + 1, kv))
                .unwrap_or(0.0);
            let b = self
                .timing
                .decode_ms(&shape(s.running as u64 + 2, kv + per_seq))
                .unwrap_or(a);
            now += a;
            more += (b - a).max(0.0);
        }
        let n = self.workers.len().max(1) as f64;
        (now / n, more / n)
    }

    /// Builds the next summary at `now`.
    pub(super) fn summary(&mut self, now: Time) -> Result<ClusterSummary, SimError> {
        self.options.sequence += 1;
        (
            self.options.decode_ms_per_token,
            self.options.decode_ms_per_token_per_seq,
        ) = self.decode_ms_per_token();
        self.router
            .cluster_summary(&self.options, now)
            .map_err(|e| SimError::Config(e.to_string()))
    }

    /// The longest prefix of `blocks` any worker here holds (the truth the sketch estimates).
    pub(super) fn exact_prefix_blocks(&self, blocks: &[SequenceHash]) -> u64 {
        self.router
            .index()
            .find_matches(blocks)
            .ranks
            .iter()
            .map(|r| u64::from(r.overlap.total_blocks()))
            .max()
            .unwrap_or(0)
    }
}
