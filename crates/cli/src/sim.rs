//! `kvrouter sim`.

use crate::routing_args::{apply_compare_item, RoutingArgs};
use crate::sim_table::{print_fleet, print_table};
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_core::policy::RouterMode;
use kvrouter_engine::EngineConfig;
use kvrouter_sim::summary::FleetBaseline;
use kvrouter_sim::{SimConfig, Simulation, Summary};
use kvrouter_workload::Workload;
use std::io::Write;

/// The most router replicas `--router-replicas` simulates (each holds a whole routing core).
const MAX_ROUTER_REPLICAS: usize = 64;
use std::path::PathBuf;
use std::time::Instant;

/// The global policies `--clusters` compares unless `--global-policy` says otherwise.
pub(crate) const DEFAULT_GLOBAL_POLICIES: &str = "static-split,least-loaded,kv";

/// Flags of `kvrouter sim`.
#[derive(Debug, Args)]
pub(crate) struct SimArgs {
    #[command(flatten)]
    workload: crate::workload_args::WorkloadArgs,
    /// Number of simulated workers.
    #[arg(long, default_value_t = 8, conflicts_with = "clusters")]
    workers: usize,
    #[command(flatten)]
    routing: RoutingArgs,
    /// Timing profile(s), comma-separated and cycled over workers: dynamo-poly, h100-llama3-8b,
    /// h200-llama3-8b or a JSON file.
    #[arg(long, default_value = "dynamo-poly", conflicts_with = "clusters")]
    profile: String,
    /// KV capacity per worker, blocks.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: usize,
    /// Token budget per engine step.
    #[arg(long, default_value_t = 8_192)]
    max_num_batched_tokens: u32,
    /// Most requests running per engine.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Delay from a block being cached to the router seeing it, ms.
    #[arg(long, default_value_t = 50.0)]
    kv_event_delay_ms: f64,
    /// One-way router-engine network delay, ms.
    #[arg(long, default_value_t = 0.0, conflicts_with = "clusters")]
    network_delay_ms: f64,
    /// Router ingress time per prompt token, µs (reading the body, tokenizing, hashing) before a
    /// request is routed: requests that arrive together are then routed shortest first, as live.
    #[arg(long, default_value_t = 0.0, conflicts_with = "clusters")]
    ingress_us_per_token: f64,
    /// Stop sending after this many simulated seconds, as `kvrouter bench --duration-s` does:
    /// later requests (and the later turns of their sessions) are not sent and do not count.
    /// Not with RL workloads (their steps wait for every sample).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Divide open-loop arrival times by this.
    #[arg(long, default_value_t = 1.0, conflicts_with = "clusters")]
    arrival_speedup: f64,
    /// Closed-loop replay with this many requests in flight (ignores arrival times).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Read at most this many requests from the trace (0 = all).
    #[arg(long, default_value_t = 0)]
    max_requests: usize,
    /// Agentic session traces: mean gap between session starts, seconds.
    #[arg(long, default_value_t = 10.0)]
    session_gap_s: f64,
    /// A worker that dies at a time: WORKER@SECONDS (repeatable).
    #[arg(long = "worker-failure", conflicts_with = "clusters")]
    worker_failures: Vec<String>,
    /// A worker that runs slower (< 1) or faster (> 1) than its profile: WORKER@FACTOR
    /// (repeatable).
    #[arg(long = "slow-worker", conflicts_with = "clusters")]
    slow_workers: Vec<String>,
    /// Times a request on a dead worker may be continued elsewhere (0 = it fails).
    #[arg(long, default_value_t = 0, conflicts_with = "clusters")]
    migration_limit: u32,
    /// Router replicas (1 to 64); requests are spread over them round-robin, each reads every
    /// engine's KV events, and replica 0 drives weight updates.
    #[arg(long, default_value_t = 1, conflicts_with = "clusters")]
    router_replicas: usize,
    /// Time before a replica sees the others' events (load, placements, sessions, groups,
    /// versions, update holds), ms (at most an hour).
    #[arg(long, default_value_t = 0.0, conflicts_with = "clusters")]
    replica_sync_delay_ms: f64,
    /// Replicas do not share events (what unsynchronised replicas lose).
    #[arg(long, conflicts_with = "clusters")]
    no_replica_sync: bool,
    #[command(flatten)]
    rl: crate::sim_rl_args::SimRlArgs,
    /// Several configurations on the same workload: MODE[:key=value...],... e.g.
    /// round-robin,least-loaded,kv,kv:router_predicted_ttl_secs=5
    #[arg(long, conflicts_with = "clusters")]
    pub(crate) compare: Option<String>,
    #[command(flatten)]
    pub(crate) planner: crate::sim_planner_args::SimPlannerArgs,
    /// Write each configuration's request timeline as Chrome trace JSON (open in Perfetto);
    /// with several configurations the name gets `-N` per configuration.
    #[arg(long, conflicts_with = "clusters")]
    pub(crate) perfetto: Option<PathBuf>,
    /// Output folder for summary.json and report.html.
    #[arg(long, default_value = "sim-out")]
    pub(crate) out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Global routing across datacenters: a TOML file of `[global]` settings and
    /// `[[cluster]]` entries (workers, profile, speed, network delay, summary refresh); each
    /// datacenter runs its own local router. See docs/global-routing.md.
    #[arg(long)]
    pub(crate) clusters: Option<PathBuf>,
    /// Global policies to compare with --clusters, comma-separated: static-split,
    /// least-loaded, kv.
    #[arg(long, default_value = DEFAULT_GLOBAL_POLICIES)]
    pub(crate) global_policy: String,
}

/// The most KV blocks all simulated engines together hold (4,096 workers of 16,384 blocks).
const MAX_FLEET_GPU_BLOCKS: usize = 1 << 26;

/// Refuses `blocks` KV blocks past what a simulation holds (each simulated engine holds its
/// blocks from the start); `what` names the flags that came to them.
pub(crate) fn check_fleet_blocks(
    blocks: usize,
    what: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if blocks > MAX_FLEET_GPU_BLOCKS {
        bail!(
            "{} is {blocks} blocks, more than the {MAX_FLEET_GPU_BLOCKS} a simulation holds \
             (about 5 GB)",
            what()
        );
    }
    Ok(())
}

/// Largest `--ingress-us-per-token`: 1 ms a token (a 10M-token prompt then takes under four
/// hours to arrive, well within the clock).
const MAX_INGRESS_US_PER_TOKEN: f64 = 1_000.0;
/// Largest `--kv-event-delay-ms` and `--network-delay-ms`: an hour.
const MAX_DELAY_MS: f64 = 3_600_000.0;
/// Latest simulated time a flag may name (`--worker-failure`): a year.
const MAX_TIME_MS: f64 = 365.0 * 86_400_000.0;

fn pairs(values: &[String], flag: &str) -> anyhow::Result<Vec<(usize, f64)>> {
    values
        .iter()
        .map(|v| {
            let (w, x) = v
                .split_once('@')
                .with_context(|| format!("{flag} {v:?}: expected WORKER@NUMBER"))?;
            let w: usize = w
                .parse()
                .with_context(|| format!("{flag} {v:?}: the worker is not a number"))?;
            let x: f64 = x
                .parse()
                .with_context(|| format!("{flag} {v:?}: not a number after @"))?;
            Ok((w, x))
        })
        .collect()
}

impl SimArgs {
    /// The generator named by --workload, if any.
    pub(crate) fn workload_name(&self) -> Option<&str> {
        self.workload.name()
    }

    /// Engine limits from the flags.
    pub(crate) fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.routing.kv_cache_block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            ..EngineConfig::default()
        }
    }

    /// Checks the engine and delay flags every simulation reads: a zero `--max-num-seqs` would
    /// never admit a request (the run would not end), and a delay past an hour (or not a
    /// number) is a typo, not a network.
    fn check_engine_and_delays(&self) -> anyhow::Result<()> {
        if self.max_num_seqs == 0 {
            bail!("--max-num-seqs must be at least 1");
        }
        if self.num_gpu_blocks == 0 || self.num_gpu_blocks > kvrouter_engine::MAX_NUM_GPU_BLOCKS {
            bail!(
                "--num-gpu-blocks must be from 1 to {}",
                kvrouter_engine::MAX_NUM_GPU_BLOCKS
            );
        }
        if !(self.arrival_speedup.is_finite()
            && self.arrival_speedup >= crate::flag_values::MIN_ARRIVAL_SPEEDUP)
        {
            bail!(
                "--arrival-speedup must be a number of at least {}",
                crate::flag_values::MIN_ARRIVAL_SPEEDUP
            );
        }
        for (flag, v) in [
            ("--kv-event-delay-ms", self.kv_event_delay_ms),
            ("--network-delay-ms", self.network_delay_ms),
        ] {
            if !(v.is_finite() && (0.0..=MAX_DELAY_MS).contains(&v)) {
                bail!("{flag} must be a number of milliseconds from 0 to {MAX_DELAY_MS}");
            }
        }
        Ok(())
    }

    /// --concurrency, --kv-event-delay-ms and the router flags, for the global simulation.
    pub(crate) fn global_inputs(
        &self,
    ) -> anyhow::Result<(Option<usize>, f64, kvrouter_core::router::RouterConfig)> {
        self.check_engine_and_delays()?;
        Ok((
            self.concurrency,
            self.kv_event_delay_ms,
            self.routing.config()?,
        ))
    }

    pub(crate) fn workload(&self) -> anyhow::Result<Workload> {
        let w = self.workload.load(self.session_gap_s, self.max_requests)?;
        if self.duration_s.is_some() {
            if w.barrier.is_some() || w.requests.iter().any(|r| r.step.is_some()) {
                bail!("--duration-s cannot cut an RL workload: its steps wait for every sample");
            }
            if self.clusters.is_some() {
                bail!("--duration-s is not supported with --clusters");
            }
        }
        Ok(w)
    }

    pub(crate) fn configs(&self) -> anyhow::Result<Vec<SimConfig>> {
        self.configs_up_to(self.workers)
    }

    /// The configurations, for fleets of up to `fleet` workers (`plan` searches sizes past
    /// `--workers`, so a fault may name a worker only its larger fleets have).
    pub(crate) fn configs_up_to(&self, fleet: usize) -> anyhow::Result<Vec<SimConfig>> {
        let base_router = self.routing.config()?;
        let base = SimConfig {
            name: base_router.router_mode.to_string(),
            workers: self.workers,
            router: base_router.clone(),
            engine: EngineConfig {
                block_size: self.routing.kv_cache_block_size,
                num_gpu_blocks: self.num_gpu_blocks,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_num_seqs: self.max_num_seqs,
                ..EngineConfig::default()
            },
            profiles: self.profile.split(',').map(str::to_owned).collect(),
            kv_event_delay_ms: self.kv_event_delay_ms,
            network_delay_ms: self.network_delay_ms,
            ingress_us_per_token: self.ingress_us_per_token,
            duration_ms: self.duration_s.map(|d| d * 1000.0),
            arrival_speedup: self.arrival_speedup,
            concurrency: self.concurrency,
            failures: pairs(&self.worker_failures, "--worker-failure")?
                .into_iter()
                .map(|(w, s)| (w, s * 1000.0))
                .collect(),
            speed: pairs(&self.slow_workers, "--slow-worker")?,
            migration_limit: self.migration_limit,
            router_replicas: self.router_replicas,
            replica_sync_delay_ms: self.replica_sync_delay_ms,
            replica_sync: !self.no_replica_sync,
            group_sizes: self.rl.group_sizes(),
            group_ids: self.rl.group_ids(),
            group_need: self.rl.group_need(),
            planner: self
                .planner
                .sim(self.rl.updates_weights() || self.router_replicas > 1)?,
            weight_update: self.rl.weight_update()?,
        };
        self.rl.check()?;
        self.check_engine_and_delays()?;
        if self.workers == 0 || self.workers > kvrouter_sim::MAX_WORKERS {
            bail!("--workers must be from 1 to {}", kvrouter_sim::MAX_WORKERS);
        }
        // Each simulated engine holds its KV blocks from the start (~80 bytes each), and one the
        // planner adds keeps them after it leaves: the most engines the run may hold, times
        // their blocks, is bounded, not only each flag (64 workers of 2^24 blocks took ~84 GB).
        let most = match &base.planner {
            Some(p) => {
                let max = p.law.max_workers as usize;
                if max > kvrouter_sim::MAX_WORKERS {
                    bail!(
                        "--planner-max-workers must be at most {}",
                        kvrouter_sim::MAX_WORKERS
                    );
                }
                fleet.max(max)
            }
            None => fleet,
        };
        check_fleet_blocks(most.saturating_mul(self.num_gpu_blocks), || {
            format!(
                "{most} workers (the largest fleet run: --workers, --planner-max-workers with \
                 --planner, or plan's --max-workers) × --num-gpu-blocks ({})",
                self.num_gpu_blocks
            )
        })?;
        if self.concurrency == Some(0) {
            bail!("--concurrency must be at least 1");
        }
        for (w, at_ms) in &base.failures {
            if *w >= fleet || !(at_ms.is_finite() && *at_ms >= 0.0 && *at_ms <= MAX_TIME_MS) {
                bail!(
                    "--worker-failure {w}@{}: the worker must be below {fleet} (the fleet) and \
                     the time a number of seconds from 0 to {}",
                    at_ms / 1000.0,
                    MAX_TIME_MS / 1000.0
                );
            }
        }
        for (w, factor) in &base.speed {
            if *w >= fleet || !(factor.is_finite() && (1e-3..=1e3).contains(factor)) {
                bail!(
                    "--slow-worker {w}@{factor}: the worker must be below {fleet} (the fleet) \
                     and the factor from 0.001 to 1000"
                );
            }
        }
        if self.router_replicas == 0 || self.router_replicas > MAX_ROUTER_REPLICAS {
            bail!("--router-replicas must be from 1 to {MAX_ROUTER_REPLICAS}");
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0 && d <= MAX_TIME_MS / 1000.0) {
                bail!(
                    "--duration-s must be a number of seconds above 0, at most {}",
                    MAX_TIME_MS / 1000.0
                );
            }
        }
        if !(0.0..=MAX_INGRESS_US_PER_TOKEN).contains(&self.ingress_us_per_token) {
            bail!(
                "--ingress-us-per-token must be a number of µs from 0 to {MAX_INGRESS_US_PER_TOKEN} \
                 (beyond, a long prompt's ingress passes the simulator's clock)"
            );
        }
        if !(self.replica_sync_delay_ms.is_finite()
            && (0.0..=3_600_000.0).contains(&self.replica_sync_delay_ms))
        {
            bail!("--replica-sync-delay-ms must be from 0 to 3600000");
        }
        let Some(list) = &self.compare else {
            return Ok(vec![base]);
        };
        let none = "names no configuration (a comma list such as kv,cost)";
        crate::flag_values::comma_items(list, "--compare", none)?
            .into_iter()
            .map(|item| {
                let router = apply_compare_item(&base_router, item)?;
                Ok(SimConfig {
                    name: item.to_owned(),
                    router,
                    ..base.clone()
                })
            })
            .collect()
    }
}

impl SimArgs {
    /// Routing flags given that no configuration of the run reads; the simulator hands the
    /// router every engine's own timing model, so `--router-cost-speedup-ratio` never is.
    fn unread_warnings(&self, configs: &[SimConfig]) -> anyhow::Result<Vec<String>> {
        let runs: Vec<RouterMode> = configs.iter().map(|c| c.router.router_mode).collect();
        let mut out = self.routing.mode_warnings(&runs)?;
        // A `--compare` item's own key its mode does not read (a setting the base already
        // moved, `--load-aware`'s credit included, was named above or is not the user's).
        let given = self.routing.config()?.moved_mode_settings();
        for c in configs {
            for flag in c.router.unread_settings() {
                if !given.contains(&flag) {
                    out.push(format!(
                        "--compare item {}: {} is not read by {}",
                        c.name,
                        flag.trim_start_matches("--").replace('-', "_"),
                        c.router.router_mode
                    ));
                }
            }
        }
        let ratio = "--router-cost-speedup-ratio";
        out.retain(|w| !w.starts_with(ratio));
        if self.routing.router_cost_speedup_ratio.is_some() {
            out.push(format!(
                "{ratio} is not read by sim: the router prices each simulated engine with its own timing model"
            ));
        }
        Ok(out)
    }
}

impl SimArgs {
    /// What the report's head says about the run.
    pub(crate) fn report_parameters(&self) -> Vec<(String, String)> {
        let mut p = vec![
            ("workload".to_owned(), self.workload.describe()),
            ("workers".to_owned(), self.workers.to_string()),
            ("profile".to_owned(), self.profile.clone()),
            ("seed".to_owned(), self.routing.seed.to_string()),
            (
                "kvrouter version".to_owned(),
                env!("CARGO_PKG_VERSION").to_owned(),
            ),
        ];
        if let Some(c) = &self.compare {
            p.push(("configurations".to_owned(), c.clone()));
        }
        p
    }
}

mod run;
pub(crate) use run::{run, run_one};
