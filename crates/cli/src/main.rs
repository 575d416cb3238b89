//! The `kvrouter` binary: `serve`, `mock-engine`, `sim` and `bench`.

mod admin_args;
mod bench;
mod config_file;
mod discovery_args;
mod embedded;
mod files;
mod flag_values;
mod global_args;
mod headings;
mod health_args;
mod kv_event_args;
mod layered;
mod logging;
mod mock_engine;
mod observability_args;
mod outputs;
mod picker_args;
mod plan;
mod planner_act_args;
mod planner_args;
mod planner_serve_args;
mod print_config;
mod replica_args;
mod routing_args;
mod runtime_threads;
mod serve;
mod signals;
mod sim;
mod sim_global;
mod sim_planner_args;
mod sim_rl_args;
mod sim_table;
mod startup;
mod upstream_args;
mod weights;
mod worker_list;
mod workload_args;

use clap::{Parser, Subcommand};

/// jemalloc, not glibc malloc: glibc's `malloc_consolidate` and bin juggling took ~17 % of the
/// router's CPU on the streamed request path, jemalloc ~7 % (bench/overhead/results.md).
#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// kvrouter: a KV-cache-aware router for LLM inference.
#[derive(Debug, Parser)]
#[command(name = "kvrouter", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the KV-aware OpenAI-compatible router in front of workers (or embedded mock engines).
    Serve(Box<serve::ServeArgs>),
    /// Replay a trace or an RL workload through the routing core against simulated engines.
    Sim(Box<sim::SimArgs>),
    /// The smallest worker count whose simulated TTFT p99 or RL step time meets a target.
    Plan(Box<plan::PlanArgs>),
    /// Run a simulated inference engine: OpenAI API over HTTP, KV events over ZeroMQ.
    MockEngine(mock_engine::MockEngineArgs),
    /// Replay a trace or an RL workload against a live OpenAI-compatible endpoint.
    Bench(bench::BenchArgs),
    /// Delta weight sync: diff/apply checkpoints, publish/pull through object storage, serve peers.
    Weights(weights::WeightsArgs),
}

fn main() -> anyhow::Result<()> {
    // Flags, then KVROUTER_<FLAG> variables, then --config FILE, then defaults (layered.rs).
    let layered::Parsed {
        cli,
        sources,
        printed,
    } = layered::parse_args::<Cli>();
    if printed {
        // `--print-config` printed the configuration. What a start here would refuse is said on
        // stderr; the exit status stays 0, since a value may name what only the deployment has
        // (a workers file mounted there, workers given at start).
        if let Err(e) = check(&cli) {
            let e = layered::name_sources(e, &sources);
            eprintln!("warning: a start with this configuration here would be refused: {e:#}");
        }
        return Ok(());
    }
    // A value refused after parsing names its flag; say where a flag not on the command line
    // got it.
    run(cli).map_err(|e| layered::name_sources(e, &sources))
}

/// The checks a start makes before it binds or starts anything (`serve`'s; the other
/// commands read their values as they run).
fn check(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Serve(args) => {
            logging::filter(&args.observability.log)?;
            runtime_threads::runtime_worker_threads(args.worker_threads()?)?;
            args.checked(serve::Outputs::CheckOnly).map(drop)
        }
        _ => Ok(()),
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Serve(args) => logging::init(&args.observability.log)?,
        _ => logging::init(&logging::LogArgs::default())?,
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    let flag = match &cli.command {
        Command::Serve(args) => args.worker_threads()?,
        _ => 0,
    };
    // TOKIO_WORKER_THREADS is checked for every command (tokio panics on a bad one).
    if let Some(n) = runtime_threads::runtime_worker_threads(flag)? {
        runtime.worker_threads(n);
    }
    let runtime = runtime.enable_all().build()?;
    let result = match cli.command {
        Command::Serve(args) => runtime.block_on(serve::run(*args)),
        Command::Sim(args) => sim::run(*args),
        Command::Plan(args) => plan::run(*args),
        Command::MockEngine(args) => runtime.block_on(mock_engine::run(args)),
        Command::Bench(args) => runtime.block_on(bench::run(args)),
        Command::Weights(args) => runtime.block_on(weights::run(args)),
    };
    // Work still running on the runtime's threads (a long tokenization in a blocking task, a
    // request a client abandoned) would hold the process in the runtime's drop for as long as it
    // runs, past any drain's grace period: it gets this long, then the process exits anyway.
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
    result
}

/// How long leftover runtime work may hold the process once a command is done.
const RUNTIME_SHUTDOWN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
