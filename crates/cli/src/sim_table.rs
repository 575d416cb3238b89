//! The result tables `kvrouter sim` (and `bench`) print to stdout.

use kvrouter_sim::Summary;

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
        if r.rejected + r.failed > 0 {
            println!(
                "{}: {} of {} requests refused, {} failed (the latency and hit columns count only those served)",
                r.config, r.rejected, r.requests, r.failed
            );
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
pub(crate) fn print_fleet(runs: &[Summary]) {
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
