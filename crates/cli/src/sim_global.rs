//! `kvrouter sim --clusters FILE`: the global simulation, one run per global policy.

use crate::sim::SimArgs;
use anyhow::{bail, Context};
use kvrouter_core::global::GlobalPolicy;
use kvrouter_sim::global::{ClustersFile, GlobalSimConfig, GlobalSimulation, GlobalSummary};
use kvrouter_workload::seed002::SEED002_SESSIONS_IN_FLIGHT;
use std::time::Instant;

/// Reads and checks a clusters file; errors name the flag and the field.
pub(crate) fn read_clusters(path: &std::path::Path) -> anyhow::Result<ClustersFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--clusters {}: cannot read", path.display()))?;
    let file: ClustersFile =
        toml::from_str(&text).with_context(|| format!("--clusters {}", path.display()))?;
    if let Err(e) = file.validate() {
        bail!("--clusters {}: {e}", path.display());
    }
    Ok(file)
}

fn policies(list: &str) -> anyhow::Result<Vec<GlobalPolicy>> {
    let none = "names no policy (static-split, least-loaded or kv)";
    let mut out: Vec<GlobalPolicy> = Vec::new();
    for item in crate::flag_values::comma_items(list, "--global-policy", none)? {
        let policy = item.parse().context("--global-policy")?;
        if out.contains(&policy) {
            bail!("--global-policy {list:?} names {item} twice");
        }
        out.push(policy);
    }
    Ok(out)
}

pub(crate) fn run(args: &SimArgs) -> anyhow::Result<()> {
    let Some(path) = &args.clusters else {
        bail!("--clusters is required here");
    };
    let clusters = read_clusters(path)?;
    // The same memory bound as one cluster's simulation: each engine holds its blocks.
    let default_blocks = args.engine_config().num_gpu_blocks;
    let blocks: usize = clusters
        .clusters
        .iter()
        .map(|c| {
            c.workers
                .saturating_mul(c.num_gpu_blocks.unwrap_or(default_blocks))
        })
        .fold(0, usize::saturating_add);
    crate::sim::check_fleet_blocks(blocks, || {
        format!(
            "--clusters {}: the clusters' workers × num_gpu_blocks (or --num-gpu-blocks)",
            path.display()
        )
    })?;
    let policies = policies(&args.global_policy)?;
    let workload = args.workload()?;
    let (concurrency, kv_event_delay_ms, router) = args.global_inputs()?;
    crate::outputs::check_dir(&args.out, "--out")?;
    let sessions_in_flight = concurrency
        .or((args.workload_name() == Some("seed002")).then_some(SEED002_SESSIONS_IN_FLIGHT));
    let mut runs: Vec<GlobalSummary> = Vec::new();
    for policy in policies {
        let config = GlobalSimConfig {
            clusters: clusters.clone(),
            policy,
            router: router.clone(),
            engine: args.engine_config(),
            kv_event_delay_ms,
            sessions_in_flight,
        };
        let started = Instant::now();
        let sim = GlobalSimulation::new(config, &workload)?;
        let mut summary = sim.run()?;
        summary.sim_wall_s = (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
        runs.push(summary);
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    std::fs::write(
        args.out.join("summary.json"),
        serde_json::to_string_pretty(&runs)? + "\n",
    )
    .with_context(|| format!("--out {}", args.out.display()))?;
    let parameters = vec![
        ("clusters".to_owned(), path.display().to_string()),
        ("workload".to_owned(), workload.name.clone()),
        (
            "sessions in flight".to_owned(),
            sessions_in_flight.map_or("all".to_owned(), |n| n.to_string()),
        ),
        (
            "kvrouter version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        ),
    ];
    std::fs::write(
        args.out.join("report.html"),
        kvrouter_sim::global::report::render(&runs, &parameters),
    )?;
    println!("| policy | step time s | TTFT p50 ms | TTFT p99 ms | hit rate | moves | engine changes in DC | tail idle s per DC |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        let tails: Vec<String> = r
            .clusters
            .iter()
            .map(|c| format!("{} {:.1}", c.name, c.tail_idle_s))
            .collect();
        println!(
            "| {} | {:.2} | {:.0} | {:.0} | {:.3} | {} | {} | {} |",
            r.policy,
            r.step_time_mean_s,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.hit_rate,
            r.session_moves,
            r.engine_changes_within_dc,
            tails.join(", ")
        );
    }
    for r in runs.iter().filter(|r| r.rejected > 0) {
        println!(
            "{}: {} of {} requests refused (by a datacenter's router, past \
             --router-queue-max-wait-secs, or finding no fresh summary for a day), left out of \
             the figures",
            r.policy, r.rejected, r.requests
        );
    }
    for r in runs.iter().filter(|r| r.summary_retries > 0) {
        println!(
            "{}: requests waited {} times for a fresh summary (a refresh period each; in their \
             TTFT and E2E)",
            r.policy, r.summary_retries
        );
    }
    println!(
        "wrote {} and {}",
        args.out.join("summary.json").display(),
        args.out.join("report.html").display()
    );
    Ok(())
}
