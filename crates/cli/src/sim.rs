//! `kvrouter sim`.

use crate::routing_args::{apply_compare_item, RoutingArgs};
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_engine::EngineConfig;
use kvrouter_sim::summary::FleetBaseline;
use kvrouter_sim::{SimConfig, Simulation, Summary};
use kvrouter_workload::generators::{self, AgenticParams, GrpoParams, Seed001Params};
use kvrouter_workload::readers::ReadOptions;
use kvrouter_workload::{load_trace, Workload};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `kvrouter sim`.
#[derive(Debug, Args)]
pub(crate) struct SimArgs {
    /// A trace: Mooncake JSONL, RL rollout JSONL, an agentic session JSON, or a folder of them.
    #[arg(long, conflicts_with = "workload")]
    trace: Option<PathBuf>,
    /// A generated workload: grpo, agentic or seed001.
    #[arg(long)]
    workload: Option<String>,
    /// Generator parameters as key=value,key=value (names as in docs/workloads.md).
    #[arg(long)]
    workload_args: Option<String>,
    /// Number of simulated workers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    #[command(flatten)]
    routing: RoutingArgs,
    /// Timing profile(s), comma-separated and cycled over workers: dynamo-poly, h100-llama3-8b,
    /// h200-llama3-8b or a JSON file.
    #[arg(long, default_value = "dynamo-poly")]
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
    #[arg(long, default_value_t = 0.0)]
    network_delay_ms: f64,
    /// Divide open-loop arrival times by this.
    #[arg(long, default_value_t = 1.0)]
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
    #[arg(long = "worker-failure")]
    worker_failures: Vec<String>,
    /// A worker that runs slower (< 1) or faster (> 1) than its profile: WORKER@FACTOR
    /// (repeatable).
    #[arg(long = "slow-worker")]
    slow_workers: Vec<String>,
    /// Times a request on a dead worker may be continued elsewhere (0 = it fails).
    #[arg(long, default_value_t = 0)]
    migration_limit: u32,
    /// Router replicas; requests are spread over them round-robin, each reads every engine's
    /// KV events, and replica 0 drives weight updates.
    #[arg(long, default_value_t = 1)]
    router_replicas: usize,
    /// Time before a replica sees the others' events (load, placements, sessions, groups,
    /// versions, update holds), ms.
    #[arg(long, default_value_t = 0.0)]
    replica_sync_delay_ms: f64,
    /// Replicas do not share events (what unsynchronised replicas lose).
    #[arg(long)]
    no_replica_sync: bool,
    /// RL requests carry their group's size (as x-kvrouter-group-size): fair-share group
    /// placement.
    #[arg(long)]
    group_sizes: bool,
    /// First-N-of-M: end a group's other samples once N finished (as x-kvrouter-group-need).
    #[arg(long)]
    group_need: Option<u32>,
    /// Weight updates between RL steps, run by the router: drain, abort or rolling.
    #[arg(long)]
    weight_update: Option<String>,
    /// Workers updated at a time with --weight-update rolling.
    #[arg(long, default_value_t = 1)]
    weight_update_batch: usize,
    /// Time an engine takes to load new weights, ms.
    #[arg(long, default_value_t = 1000.0)]
    weight_load_ms: f64,
    /// Several configurations on the same workload: MODE[:key=value...],... e.g.
    /// round-robin,least-loaded,kv,kv:router_predicted_ttl_secs=5
    #[arg(long)]
    pub(crate) compare: Option<String>,
    /// Run the planner in the loop: `--workers` is the starting fleet, resized every
    /// `--planner-tick-s` by the control law of `serve --planner-advise`; added workers serve
    /// after `--planner-startup-s`, removed ones drain first. A fixed fleet of the planner's
    /// peak is run too, for comparison.
    #[arg(long, conflicts_with = "compare")]
    pub(crate) planner: bool,
    #[command(flatten)]
    planner_args: crate::planner_args::PlannerArgs,
    /// With `--planner`: tail consolidation. A worker the planner drains in an RL step's tail
    /// that holds at most N requests moves them to the serving workers and to the draining
    /// ones that hold more (each re-prefilled there, as a migration after a failure) when
    /// they all fit within `--planner-requests-per-worker`, `--planner-kv-usage`, the KV
    /// they could reach at their max tokens and the delay bound of
    /// `--planner-migrate-slowdown`, and is released at once. 0: off, a drained worker holds
    /// its GPU until its last request ends. Default 64 (the default requests per worker).
    #[arg(long, default_value_t = 64, requires = "planner")]
    planner_migrate_tail: u32,
    /// With `--planner-migrate-tail`: no request (moved, or on a target) may end later than
    /// 1 + this fraction times its end without the moves, however many of the tokens it may
    /// still generate it generates (decode time grows with the KV read; the step's last sample
    /// sets the step time).
    #[arg(long, default_value_t = 0.1, requires = "planner")]
    planner_migrate_slowdown: f64,
    /// Write each configuration's request timeline as Chrome trace JSON (open in Perfetto);
    /// with several configurations the name gets `-N` per configuration.
    #[arg(long)]
    perfetto: Option<PathBuf>,
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
    #[arg(long, default_value = "static-split,least-loaded,kv")]
    pub(crate) global_policy: String,
}

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

fn params<T: serde::de::DeserializeOwned + serde::Serialize + Default>(
    args: Option<&str>,
) -> anyhow::Result<T> {
    let mut value = serde_json::to_value(T::default())?;
    for kv in args
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.trim().is_empty())
    {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--workload-args: {kv:?} is not key=value"))?;
        value[k.trim()] = serde_json::from_str(v.trim())
            .unwrap_or_else(|_| serde_json::Value::String(v.trim().to_owned()));
    }
    serde_json::from_value(value).context("--workload-args")
}

/// Loads a trace or generates a workload (shared by `sim` and `bench`).
pub(crate) fn load_workload(
    trace: Option<&std::path::Path>,
    workload: Option<&str>,
    workload_args: Option<&str>,
    session_gap_s: f64,
    max_requests: usize,
) -> anyhow::Result<Workload> {
    match (trace, workload) {
        (Some(path), _) => {
            let opts = ReadOptions {
                session_gap_s,
                seed: 0,
                max_requests,
            };
            Ok(load_trace(path, opts).map_err(|e| anyhow::anyhow!("--trace {e}"))?)
        }
        (None, Some("grpo")) => Ok(generators::grpo(&params::<GrpoParams>(workload_args)?)),
        (None, Some("agentic")) => Ok(generators::agentic(&params::<AgenticParams>(
            workload_args,
        )?)),
        (None, Some("seed001")) => Ok(generators::seed001(&params::<Seed001Params>(
            workload_args,
        )?)),
        (None, Some("seed002")) => Ok(kvrouter_workload::seed002::seed002(&params::<
            kvrouter_workload::seed002::Seed002Params,
        >(
            workload_args
        )?)),
        (None, Some(other)) => {
            bail!("--workload {other:?}: expected grpo, agentic, seed001 or seed002")
        }
        (None, None) => bail!("give --trace PATH or --workload grpo|agentic|seed001|seed002"),
    }
}

impl SimArgs {
    /// The generator named by --workload, if any.
    pub(crate) fn workload_name(&self) -> Option<&str> {
        self.workload.as_deref()
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

    /// --concurrency, --kv-event-delay-ms and the router flags, for the global simulation.
    pub(crate) fn global_inputs(
        &self,
    ) -> anyhow::Result<(Option<usize>, f64, kvrouter_core::router::RouterConfig)> {
        Ok((
            self.concurrency,
            self.kv_event_delay_ms,
            self.routing.config()?,
        ))
    }

    pub(crate) fn workload(&self) -> anyhow::Result<Workload> {
        load_workload(
            self.trace.as_deref(),
            self.workload.as_deref(),
            self.workload_args.as_deref(),
            self.session_gap_s,
            self.max_requests,
        )
    }

    pub(crate) fn configs(&self) -> anyhow::Result<Vec<SimConfig>> {
        let base_router = self.routing.config()?;
        let base = SimConfig {
            name: self.routing.router_mode.clone(),
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
            group_sizes: self.group_sizes,
            group_need: self.group_need,
            planner: if self.planner {
                let law = self.planner_args.config()?;
                if self.weight_update.is_some() || self.router_replicas > 1 {
                    bail!("--planner runs without --weight-update and with one --router-replicas");
                }
                Some(kvrouter_sim::PlannerSim {
                    law,
                    startup_ms: self.planner_args.planner_startup_s * 1000.0,
                    tick_ms: self.planner_args.planner_tick_s * 1000.0,
                    migrate_tail: self.planner_migrate_tail,
                    migrate_slowdown: if self.planner_migrate_slowdown.is_finite()
                        && self.planner_migrate_slowdown >= 0.0
                    {
                        self.planner_migrate_slowdown
                    } else {
                        bail!("--planner-migrate-slowdown must be a non-negative number");
                    },
                })
            } else {
                None
            },
            weight_update: match &self.weight_update {
                None => None,
                Some(mode) => Some(kvrouter_sim::config::WeightUpdate {
                    mode: mode
                        .parse()
                        .map_err(|e: String| anyhow::anyhow!("--weight-update: {e}"))?,
                    batch: self.weight_update_batch,
                    load_ms: self.weight_load_ms,
                }),
            },
        };
        if self.group_need == Some(0) {
            bail!("--group-need must be at least 1");
        }
        if self.weight_update_batch == 0 {
            bail!("--weight-update-batch must be at least 1");
        }
        if !(self.weight_load_ms.is_finite() && self.weight_load_ms >= 0.0) {
            bail!("--weight-load-ms must be a non-negative number");
        }
        if self.workers == 0 {
            bail!("--workers must be at least 1");
        }
        if self.router_replicas == 0 {
            bail!("--router-replicas must be at least 1");
        }
        if !(self.replica_sync_delay_ms.is_finite() && self.replica_sync_delay_ms >= 0.0) {
            bail!("--replica-sync-delay-ms must be a non-negative number");
        }
        match &self.compare {
            None => Ok(vec![base]),
            Some(list) => list
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|item| {
                    let router = apply_compare_item(&base_router, item.trim())?;
                    Ok(SimConfig {
                        name: item.trim().to_owned(),
                        router,
                        ..base.clone()
                    })
                })
                .collect(),
        }
    }
}

/// `PATH` for one configuration, `PATH-N.ext` for the N-th of several.
fn numbered(path: &std::path::Path, n: usize, of: usize) -> PathBuf {
    if of <= 1 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("trace");
    let ext = path.extension().and_then(|s| s.to_str()).unwrap_or("json");
    path.with_file_name(format!("{stem}-{n}.{ext}"))
}

pub(crate) fn run_one(
    config: SimConfig,
    workload: &Workload,
    quiet: bool,
    perfetto: Option<&std::path::Path>,
) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let name = config.name.clone();
    let mut sim = Simulation::new(config, workload)?;
    let mut events = 0u64;
    let mut last_report = started;
    while sim.step()? {
        events += 1;
        if !quiet
            && events % 8192 == 0
            && last_report.elapsed().as_millis() >= 250
            && started.elapsed().as_secs_f64() > 1.0
        {
            let (done, total) = sim.progress();
            let width = 30;
            let filled = (done * width / total.max(1)).min(width);
            eprint!(
                "\r[{name}] [{}{}] {done}/{total} requests, sim time {:.0} s",
                "#".repeat(filled),
                ".".repeat(width - filled),
                sim.now().as_secs_f64()
            );
            let _ = std::io::stderr().flush();
            last_report = Instant::now();
        }
    }
    if !quiet && started.elapsed().as_secs_f64() > 1.0 {
        eprintln!();
    }
    let wall = started.elapsed().as_secs_f64();
    if let Some(path) = perfetto {
        let file = std::fs::File::create(path)
            .with_context(|| format!("--perfetto {}: cannot create", path.display()))?;
        kvrouter_sim::perfetto::write(
            std::io::BufWriter::new(file),
            sim.workload(),
            sim.records(),
            sim.update_spans(),
        )
        .with_context(|| format!("--perfetto {}: cannot write", path.display()))?;
    }
    let mut summary = finish(sim)?;
    summary.sim_wall_s = (wall * 1000.0).round() / 1000.0;
    Ok(summary)
}

fn finish(sim: Simulation<'_>) -> anyhow::Result<Summary> {
    Ok(sim.run()?)
}

pub(crate) fn print_table(runs: &[Summary]) {
    let rl = runs.iter().any(|r| r.rl.is_some());
    print!(
        "| config | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | hit rate | ceiling | finite ceiling | output tok/s |"
    );
    println!(
        "{}",
        if rl {
            " step time s | step bound s | GPU idle |"
        } else {
            ""
        }
    );
    print!("|---|---|---|---|---|---|---|---|");
    println!("{}", if rl { "---|---|---|" } else { "" });
    let opt =
        |v: Option<f64>, decimals: usize| v.map_or("–".to_owned(), |v| format!("{v:.decimals$}"));
    for r in runs {
        print!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {} | {:.0} |",
            r.config,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.hit_rate,
            r.hit_rate_ceiling,
            opt(r.hit_rate_ceiling_finite, 3),
            r.output_tokens_per_s
        );
        let bound = |x: &kvrouter_sim::summary::RlSummary| {
            opt(x.step_time_lower_bound_s.map(|b| b.mean), 2)
        };
        match &r.rl {
            // A live bench cannot see GPU busy time.
            Some(x) if rl && r.router_mode == "live" => {
                println!(" {:.2} | {} | – |", x.step_time_s.mean, bound(x))
            }
            Some(x) if rl => println!(
                " {:.2} | {} | {:.3} |",
                x.step_time_s.mean,
                bound(x),
                x.gpu_idle_fraction
            ),
            _ if rl => println!(" – | – | – |"),
            _ => println!(),
        }
    }
    for r in runs {
        let Some(x) = &r.rl else { continue };
        if x.ended_early + x.rollouts_lost + x.update_aborts > 0 {
            println!(
                "{}: {} samples ended early (first-N-of-M), {} rollouts lost, {} aborted by weight updates, {} tokens recomputed",
                r.config, x.ended_early, x.rollouts_lost, x.update_aborts, x.tokens_recomputed
            );
        }
    }
}

/// The planner's figures against the fixed fleet sized for its peak.
fn print_fleet(runs: &[Summary]) {
    for r in runs {
        let Some(f) = &r.fleet else { continue };
        print!(
            "{}: planner fleet {:.1} GPU-s (mean {:.2} workers, peak {})",
            r.config, f.gpu_seconds, f.mean_workers, f.peak_workers
        );
        match &f.baseline {
            Some(b) => println!(
                "; fixed {} workers {:.1} GPU-s: {:.1} % fewer GPU-seconds, step time {:.2} s vs {:.2} s ({:.3}x)",
                b.workers,
                b.gpu_seconds,
                b.gpu_seconds_saved * 100.0,
                r.rl.as_ref().map_or(0.0, |x| x.step_time_s.mean),
                b.step_time_s,
                b.step_time_ratio
            ),
            None => println!(),
        }
        if f.tail_moves > 0 {
            println!(
                "{}: {} requests moved off workers released in RL tails",
                r.config, f.tail_moves
            );
        }
    }
}

impl SimArgs {
    /// What the report's head says about the run.
    pub(crate) fn report_parameters(&self) -> Vec<(String, String)> {
        let workload = match (&self.trace, &self.workload) {
            (Some(path), _) => format!("trace {}", path.display()),
            (None, Some(w)) => match &self.workload_args {
                Some(a) => format!("{w} ({a})"),
                None => w.clone(),
            },
            (None, None) => String::new(),
        };
        let mut p = vec![
            ("workload".to_owned(), workload),
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

pub(crate) fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.clusters.is_some() {
        return crate::sim_global::run(&args);
    }
    let workload = args.workload()?;
    let configs = args.configs()?;
    let mut runs = Vec::with_capacity(configs.len());
    let count = configs.len();
    for (n, config) in configs.into_iter().enumerate() {
        let trace = args.perfetto.as_deref().map(|p| numbered(p, n, count));
        let fixed = config.planner.is_some().then(|| config.clone());
        let mut run = run_one(config, &workload, args.quiet, trace.as_deref())?;
        if let (Some(base), Some(fleet)) = (fixed, run.fleet.as_mut()) {
            // The fleet sized for the planner's peak, fixed, on the same workload.
            let workers = (fleet.peak_workers as usize).max(1);
            let baseline = SimConfig {
                name: format!("fixed-{workers}"),
                workers,
                planner: None,
                ..base
            };
            let b = run_one(baseline, &workload, args.quiet, None)?;
            fleet.baseline = Some(FleetBaseline::against(
                &b,
                fleet.gpu_seconds,
                run.rl.as_ref(),
            ));
            runs.push(run);
            runs.push(b);
            continue;
        }
        runs.push(run);
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let summary = serde_json::to_string_pretty(&runs)? + "\n";
    std::fs::write(args.out.join("summary.json"), summary)
        .with_context(|| format!("--out {}", args.out.display()))?;
    std::fs::write(
        args.out.join("report.html"),
        kvrouter_sim::report::render_with(&runs, &args.report_parameters()),
    )?;
    print_table(&runs);
    print_fleet(&runs);
    println!(
        "wrote {} and {}",
        args.out.join("summary.json").display(),
        args.out.join("report.html").display()
    );
    Ok(())
}
