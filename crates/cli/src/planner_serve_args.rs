//! `kvrouter serve`'s planner flags: `--planner-advise`, the control law's flags (shared with
//! `sim`, crate::planner_args) and acting on the recommendations (crate::planner_act_args).

use crate::headings as H;
use crate::planner_act_args::PlannerActArgs;
use crate::planner_args::PlannerArgs;
use clap::Args;
use kvrouter_server::config::{PlannerAct, PlannerAdvice};

/// The advisory planner and its actions.
#[derive(Debug, Args)]
pub(crate) struct PlannerServeArgs {
    /// Advisory planner: a recommended worker count per model pool from the router's live
    /// signals, at GET /admin/planner (with its reasons) and as
    /// kvrouter_planner_recommended_workers{pool}; nothing is scaled.
    #[arg(help_heading = H::PLANNER, long)]
    planner_advise: bool,
    /// The planner's bounds, targets and windows.
    #[command(flatten)]
    planner: PlannerArgs,
    /// Acting on the recommendations (Kubernetes).
    #[command(flatten)]
    planner_act: PlannerActArgs,
}

impl PlannerServeArgs {
    /// The flag that turns the planner on (`--planner-advise`, `--planner-act`), if given.
    pub(crate) fn given(&self) -> Option<&'static str> {
        if self.planner_act.enabled() {
            Some("--planner-act")
        } else {
            self.planner_advise.then_some("--planner-advise")
        }
    }

    /// The actuation's configuration (`None` without --planner-act).
    pub(crate) fn act(&self) -> anyhow::Result<Option<PlannerAct>> {
        self.planner_act.config(self.planner.config()?.min_workers)
    }

    /// The planner's law and tick (`None` unless it advises or acts).
    pub(crate) fn advice(&self) -> anyhow::Result<Option<PlannerAdvice>> {
        Ok(match self.planner_advise || self.planner_act.enabled() {
            true => Some(PlannerAdvice {
                law: self.planner.config()?,
                tick: crate::flag_values::positive(
                    self.planner.planner_tick_s,
                    "--planner-tick-s",
                )?,
            }),
            false => None,
        })
    }
}
