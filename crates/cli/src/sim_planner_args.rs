//! `kvrouter sim --planner`: the planner in the loop (the control law's own flags are
//! `planner_args.rs`, shared with `serve --planner-advise`).

use anyhow::bail;
use clap::Args;

/// The planner-in-the-loop flags of `kvrouter sim`.
#[derive(Debug, Args)]
pub(crate) struct SimPlannerArgs {
    /// Run the planner in the loop: `--workers` is the starting fleet, resized every
    /// `--planner-tick-s` by the control law of `serve --planner-advise`; added workers serve
    /// after `--planner-startup-s`, removed ones drain first. A fixed fleet of the planner's
    /// peak is run too, for comparison.
    #[arg(long, conflicts_with_all = ["compare", "clusters"])]
    planner: bool,
    #[command(flatten)]
    planner_args: crate::planner_args::PlannerArgs,
    /// With `--planner`: tail consolidation. A worker the planner drains in an RL step's tail
    /// that holds at most N requests moves them to the serving workers and to the draining
    /// ones that hold more (each re-prefilled there, as a migration after a failure) when
    /// they all fit within `--planner-requests-per-worker`, `--planner-kv-usage`, the KV
    /// they could reach at their max tokens and the delay bound of
    /// `--planner-migrate-slowdown`, and is released at once. 0: off, a drained worker holds
    /// its GPU until its last request ends. Default 64 (the default requests per worker).
    #[arg(long, default_value_t = 64)]
    planner_migrate_tail: u32,
    /// With `--planner-migrate-tail`: no request (moved, or on a target) may end later than
    /// 1 + this fraction times its end without the moves, however many of the tokens it may
    /// still generate it generates (decode time grows with the KV read; the step's last sample
    /// sets the step time).
    #[arg(long, default_value_t = 0.1)]
    planner_migrate_slowdown: f64,
}

impl SimPlannerArgs {
    /// Whether --planner was given.
    pub(crate) fn enabled(&self) -> bool {
        self.planner
    }

    /// The planner in the loop, if --planner; `exclusive` says whether a flag it cannot run
    /// with (--weight-update, several --router-replicas) was given. Errors name the flag.
    pub(crate) fn sim(&self, exclusive: bool) -> anyhow::Result<Option<kvrouter_sim::PlannerSim>> {
        Ok(if self.planner {
            let law = self.planner_args.config()?;
            if exclusive {
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
        })
    }
}
