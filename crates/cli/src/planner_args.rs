//! The planner's flags, shared by `kvrouter serve --planner-advise` and
//! `kvrouter sim --planner` (the same control law, `kvrouter_core::planner`).

use crate::flag_values::{non_negative, positive};
use crate::headings as H;
use anyhow::bail;
use clap::Args;
use kvrouter_core::planner::PlannerConfig;

/// Bounds, targets and windows of the planner's control law.
#[derive(Args, Debug, Clone)]
pub(crate) struct PlannerArgs {
    /// Fewest workers the planner recommends, per pool.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 1)]
    planner_min_workers: u32,
    /// Most workers the planner recommends, per pool.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 64)]
    planner_max_workers: u32,
    /// Requests (in flight and queued) one worker should carry.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 64)]
    planner_requests_per_worker: u32,
    /// KV usage (fraction of a worker's blocks held by requests) to stay under.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 0.8)]
    planner_kv_usage: f64,
    /// TTFT p99 target, ms: while the observed p99 is over it, one more worker (unset: not a
    /// signal).
    #[arg(help_heading = H::PLANNER, long)]
    planner_ttft_p99_ms: Option<f64>,
    /// Mean ITL target, ms: while the observed mean is over it, one more worker (unset: not a
    /// signal).
    #[arg(help_heading = H::PLANNER, long)]
    planner_itl_ms: Option<f64>,
    /// Scale-up reacts to the largest demand of this window, seconds.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 5.0)]
    planner_up_window_s: f64,
    /// Scale-down waits until every demand of this window was lower (the tail), seconds.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 30.0)]
    planner_down_window_s: f64,
    /// Prediction horizon, seconds: a predicted step is provisioned at most this far ahead,
    /// and one that has not come within it after its time is dropped.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 180.0)]
    planner_horizon_s: f64,
    /// Seconds a new worker takes to serve: the predictive floor rises this long (plus the up
    /// window) before a predicted step; in `sim`, the startup delay of added workers.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 30.0)]
    pub(crate) planner_startup_s: f64,
    /// Prior for RL steps before a gap between two was seen: the share of a synchronous step
    /// spent in rollout (the trainer's phase after a rollout span S lasts S × (1 − r) / r).
    /// Unset: the next RL step may come at once, so the first step and the gap after it hold
    /// the step's peak. Sourced range 0.45–0.9, 0.75 typical (docs/planner.md).
    #[arg(help_heading = H::PLANNER, long)]
    planner_rl_rollout_share: Option<f64>,
    /// Seconds between planner ticks.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 1.0)]
    pub(crate) planner_tick_s: f64,
}

/// The shortest `--planner-tick-s`.
const MIN_TICK_S: f64 = 0.01;

impl PlannerArgs {
    /// The control law's configuration; errors name the flag.
    pub(crate) fn config(&self) -> anyhow::Result<PlannerConfig> {
        if self.planner_min_workers == 0 {
            bail!("--planner-min-workers must be at least 1");
        }
        if self.planner_max_workers < self.planner_min_workers {
            bail!("--planner-max-workers must be at least --planner-min-workers");
        }
        if self.planner_requests_per_worker == 0 {
            bail!("--planner-requests-per-worker must be at least 1");
        }
        if !(self.planner_kv_usage > 0.0 && self.planner_kv_usage <= 1.0) {
            bail!("--planner-kv-usage must be in (0, 1]");
        }
        for (v, flag) in [
            (self.planner_ttft_p99_ms, "--planner-ttft-p99-ms"),
            (self.planner_itl_ms, "--planner-itl-ms"),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                bail!("{flag} must be a positive number of ms");
            }
        }
        let startup = non_negative(self.planner_startup_s, "--planner-startup-s")?;
        // Bounded below: a control loop over seconds; a tick of nanoseconds spun a core.
        if self.planner_tick_s.is_nan() || self.planner_tick_s < MIN_TICK_S {
            bail!(
                "--planner-tick-s must be a number of seconds of at least {MIN_TICK_S}, got {}",
                self.planner_tick_s
            );
        }
        positive(self.planner_tick_s, "--planner-tick-s")?;
        if self
            .planner_rl_rollout_share
            .is_some_and(|r| !(r > 0.0 && r <= 1.0))
        {
            bail!("--planner-rl-rollout-share must be in (0, 1]");
        }
        if self.planner_down_window_s < self.planner_up_window_s {
            // A scale-down after the shorter window is undone at the next tick by the up
            // window's peak: the fleet flaps (found by a probe).
            bail!(
                "--planner-down-window-s ({}) must be at least --planner-up-window-s ({})",
                self.planner_down_window_s,
                self.planner_up_window_s
            );
        }
        let config = PlannerConfig {
            min_workers: self.planner_min_workers,
            max_workers: self.planner_max_workers,
            requests_per_worker: self.planner_requests_per_worker,
            kv_usage_target: self.planner_kv_usage,
            ttft_p99_target_ms: self.planner_ttft_p99_ms,
            itl_target_ms: self.planner_itl_ms,
            up_window: positive(self.planner_up_window_s, "--planner-up-window-s")?,
            down_window: positive(self.planner_down_window_s, "--planner-down-window-s")?,
            horizon: positive(self.planner_horizon_s, "--planner-horizon-s")?,
            startup,
            rl_rollout_share: self.planner_rl_rollout_share,
            ..PlannerConfig::default()
        };
        config.validate()?;
        Ok(config)
    }
}
