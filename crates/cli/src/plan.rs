//! `kvrouter plan`: the smallest worker count whose simulated TTFT p99 (or RL step time) meets a
//! target. The search is `kvrouter_sim::plan::search`; this file runs each batch of counts as
//! parallel simulator runs and writes `plan.json` and `report.html`.

use crate::sim::{run_one, SimArgs};
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_sim::{plan, Summary};
use kvrouter_workload::Workload;
use std::collections::BTreeMap;
use std::time::Instant;

/// Flags of `kvrouter plan`: the workload and engine flags of `sim` (its `--workers` and
/// `--compare` are not used), a target and the range to search.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["ttft_p99_ms", "step_time_s"])))]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    sim: SimArgs,
    /// Target: TTFT p99 at most this many milliseconds.
    #[arg(long)]
    ttft_p99_ms: Option<f64>,
    /// Target: mean RL step time at most this many seconds (RL workloads).
    #[arg(long)]
    step_time_s: Option<f64>,
    /// Smallest worker count searched.
    #[arg(long, default_value_t = 1)]
    min_workers: usize,
    /// Largest worker count searched (at most 4,096).
    #[arg(long, default_value_t = 64)]
    max_workers: usize,
    /// Simulator runs at a time (0 = the available cores).
    #[arg(long, default_value_t = 0)]
    jobs: usize,
}

/// One searched count: the sim's numbers for it.
struct Point {
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    step_time_s: Option<f64>,
    failed: usize,
    rejected: usize,
    sim_wall_s: f64,
}

impl PlanArgs {
    /// (flag, target, metric name).
    fn target(&self) -> anyhow::Result<(&'static str, f64, &'static str)> {
        let (flag, v, name) = match (self.ttft_p99_ms, self.step_time_s) {
            (Some(v), _) => ("--ttft-p99-ms", v, "TTFT p99 ms"),
            (None, Some(v)) => ("--step-time-s", v, "step time s"),
            (None, None) => bail!("give --ttft-p99-ms X or --step-time-s Y"),
        };
        // Below a microsecond (ms) or a millisecond (s) no fleet answers; the bound also keeps
        // the target printable (1e-300 was written out as a 300-digit decimal).
        if !(v.is_finite() && v >= 1e-3) {
            bail!("{flag} must be a number of at least 0.001");
        }
        Ok((flag, v, name))
    }
}

fn cost(p: &Point, step: bool) -> f64 {
    // A count at which requests fail or are refused does not meet any target: its latency
    // figures count only the requests it served.
    if p.failed > 0 || p.rejected > 0 {
        return f64::INFINITY;
    }
    match (step, p.step_time_s) {
        (false, _) => p.ttft_p99_ms,
        (true, Some(s)) => s,
        (true, None) => f64::INFINITY,
    }
}

fn point(s: &Summary) -> Point {
    Point {
        ttft_p50_ms: s.ttft_ms.p50,
        ttft_p99_ms: s.ttft_ms.p99,
        step_time_s: s.rl.as_ref().map(|r| r.step_time_s.mean),
        failed: s.failed,
        rejected: s.rejected,
        sim_wall_s: s.sim_wall_s,
    }
}

/// Runs one batch of counts in parallel, one thread per count.
fn run_batch(
    base: &kvrouter_sim::SimConfig,
    workload: &Workload,
    counts: &[usize],
) -> anyhow::Result<Vec<Summary>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = counts
            .iter()
            .map(|&n| {
                let mut config = base.clone();
                config.workers = n;
                config.name = format!("{n} workers");
                // A fault or speed naming a worker this fleet does not have applies to the
                // larger fleets only (it is refused past --max-workers).
                config.failures.retain(|&(w, _)| w < n);
                config.speed.retain(|&(w, _)| w < n);
                scope.spawn(move || run_one(config, workload, true, None))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a simulator run panicked"))?
            })
            .collect()
    })
}

pub(crate) fn run(args: PlanArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let (flag, target, metric) = args.target()?;
    if args.sim.compare.is_some() {
        bail!("--compare is not used by plan: give one routing configuration");
    }
    if args.sim.planner.enabled() {
        bail!("--planner is not used by plan: it searches fixed fleets");
    }
    if args.sim.clusters.is_some() || args.sim.global_policy != crate::sim::DEFAULT_GLOBAL_POLICIES
    {
        bail!("--clusters and --global-policy are not used by plan: it sizes one cluster");
    }
    if args.sim.perfetto.is_some() {
        bail!("--perfetto is not used by plan: run `kvrouter sim --workers N --perfetto` on the size it finds");
    }
    if args.min_workers == 0 {
        bail!("--min-workers must be at least 1");
    }
    crate::outputs::check_dir(&args.sim.out, "--out")?;
    if args.max_workers < args.min_workers {
        bail!("--max-workers must be at least --min-workers");
    }
    if args.max_workers > kvrouter_sim::MAX_WORKERS {
        bail!(
            "--max-workers must be at most {}",
            kvrouter_sim::MAX_WORKERS
        );
    }
    let jobs = match args.jobs {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let step = args.step_time_s.is_some() && args.ttft_p99_ms.is_none();
    let workload = args.sim.workload()?;
    let base = args.sim.configs_up_to(args.max_workers)?.remove(0);
    let mut points: BTreeMap<usize, Point> = BTreeMap::new();
    let plan = plan::search(args.min_workers, args.max_workers, jobs, target, |counts| {
        let summaries = run_batch(&base, &workload, counts)?;
        let mut costs = Vec::with_capacity(counts.len());
        for (&n, s) in counts.iter().zip(&summaries) {
            if step && s.rl.is_none() {
                bail!("--step-time-s needs an RL workload (a grpo workload or RL rollout trace)");
            }
            let p = point(s);
            let c = cost(&p, step);
            eprintln!(
                "workers {n}: {metric} {c:.1} ({}), sim {:.1} s",
                if c <= target { "meets" } else { "misses" },
                p.sim_wall_s
            );
            costs.push(c);
            points.insert(n, p);
        }
        Ok(costs)
    })?;
    let wall_s = started.elapsed().as_secs_f64();
    write_outputs(&args, &plan, &points, (flag, target, metric), jobs, wall_s)?;
    match plan.workers {
        Some(n) => {
            println!("workers: {n}");
            eprintln!(
                "{} points in {} rounds, {wall_s:.1} s; wrote {}",
                plan.points.len(),
                plan.rounds,
                args.sim.out.join("plan.json").display()
            );
            Ok(())
        }
        None => {
            // A size that refuses or loses requests fails whatever its latency: say so, since
            // more workers may not help (a prompt larger than an engine's KV cache).
            let lost = points
                .get(&args.max_workers)
                .filter(|p| p.rejected + p.failed > 0)
                .map_or(String::new(), |p| {
                    format!(", {} requests refused, {} failed", p.rejected, p.failed)
                });
            let advice = no_count_advice(args.max_workers);
            bail!(
                "no worker count up to --max-workers {} meets {flag} {target} (at {}: {metric} {:.1}{lost}); {advice}",
                args.max_workers,
                args.max_workers,
                plan.points.last().map_or(f64::NAN, |p| p.1)
            )
        }
    }
}

fn write_outputs(
    args: &PlanArgs,
    plan: &plan::Plan,
    points: &BTreeMap<usize, Point>,
    (flag, target, metric): (&str, f64, &str),
    jobs: usize,
    wall_s: f64,
) -> anyhow::Result<()> {
    let out = &args.sim.out;
    std::fs::create_dir_all(out).with_context(|| format!("--out {}", out.display()))?;
    let json_points: Vec<_> = points
        .iter()
        .map(|(n, p)| {
            serde_json::json!({
                "workers": n,
                "ttft_p50_ms": p.ttft_p50_ms,
                "ttft_p99_ms": p.ttft_p99_ms,
                "step_time_s": p.step_time_s,
                "failed": p.failed,
                "rejected": p.rejected,
                "meets": plan.points.iter().any(|&(m, c)| m == *n && c <= target),
                "sim_wall_s": p.sim_wall_s,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "workers": plan.workers,
        "target": { flag.trim_start_matches("--").replace('-', "_"): target },
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "jobs": jobs,
        "rounds": plan.rounds,
        "wall_s": (wall_s * 1000.0).round() / 1000.0,
        "points": json_points,
    });
    std::fs::write(
        out.join("plan.json"),
        serde_json::to_string_pretty(&doc)? + "\n",
    )
    .with_context(|| format!("--out {}", out.display()))?;
    let mut params: Vec<(String, String)> = args
        .sim
        .report_parameters()
        .into_iter()
        .filter(|(k, _)| k != "workers")
        .collect();
    params.push(("target".to_owned(), format!("{flag} {target}")));
    params.push((
        "searched".to_owned(),
        format!(
            "{}..={} workers, {jobs} runs at a time",
            args.min_workers, args.max_workers
        ),
    ));
    let html = kvrouter_sim::plan_report::render(plan, metric, target, &params);
    std::fs::write(out.join("report.html"), html)
        .with_context(|| format!("--out {}", out.display()))?;
    Ok(())
}

/// What to do when no count up to `max_workers` meets the target: raise the bound, unless it is
/// already the most the planner simulates.
fn no_count_advice(max_workers: usize) -> &'static str {
    if max_workers >= kvrouter_sim::MAX_WORKERS {
        "that is the most the planner simulates: the target needs faster workers or a looser target"
    } else {
        "raise --max-workers"
    }
}

#[cfg(test)]
mod advice_tests {
    use super::no_count_advice;

    #[test]
    fn at_the_cap_the_advice_is_not_to_raise_it() {
        assert_eq!(no_count_advice(64), "raise --max-workers");
        let cap = no_count_advice(kvrouter_sim::MAX_WORKERS);
        assert!(
            !cap.contains("raise --max-workers") && cap.contains("the most"),
            "{cap}"
        );
    }
}
