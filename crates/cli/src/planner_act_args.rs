//! `kvrouter serve --planner-act kubernetes`: the flags of the planner acting on its
//! recommendations (kvrouter_server's `planner_act`).

use crate::headings as H;
use anyhow::bail;
use clap::{Args, ValueEnum};
use kvrouter_server::config::{PlannerAct, PlannerTarget};
use std::collections::BTreeSet;

/// Where the planner acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum ActOn {
    /// Patch Deployments' or StatefulSets' scale subresource.
    Kubernetes,
}

/// Targets, budget and pacing of the planner's actions.
#[derive(Args, Debug, Clone)]
pub(crate) struct PlannerActArgs {
    /// Act on the recommendations (implies --planner-advise): patch each --planner-target's
    /// replicas (kube config from KUBECONFIG, ~/.kube/config or the pod's service account).
    #[arg(help_heading = H::PLANNER, long, value_enum)]
    planner_act: Option<ActOn>,
    /// A pool's workload, POOL=NAMESPACE/deployment/NAME or POOL=NAMESPACE/statefulset/NAME
    /// (repeatable; one per pool; POOL as in GET /admin/planner).
    #[arg(help_heading = H::PLANNER, long = "planner-target")]
    planner_targets: Vec<String>,
    /// GPUs shared between the target pools (unset: unbounded). When short, each pool first
    /// gets its min (and its in-flight need), the rest in proportion to demand above that.
    #[arg(help_heading = H::PLANNER, long)]
    planner_gpu_budget: Option<u32>,
    /// GPUs one worker (replica) uses, against --planner-gpu-budget.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 1)]
    planner_gpus_per_worker: u32,
    /// Least seconds between two patches of one target (0: none), so replicas do not flap.
    #[arg(help_heading = H::PLANNER, long, default_value_t = 10.0)]
    planner_act_cooldown_s: f64,
    /// Longest wait for one Kubernetes API call, seconds (a late one is a failure, retried
    /// at the next tick).
    #[arg(help_heading = H::PLANNER, long, default_value_t = 5.0)]
    planner_act_timeout_s: f64,
}

impl PlannerActArgs {
    /// Whether the planner acts (so it must advise).
    pub(crate) fn enabled(&self) -> bool {
        self.planner_act.is_some()
    }

    /// The actuation's configuration (`None` without --planner-act); errors name the flag.
    pub(crate) fn config(&self, min_workers: u32) -> anyhow::Result<Option<PlannerAct>> {
        let Some(ActOn::Kubernetes) = self.planner_act else {
            if !self.planner_targets.is_empty() || self.planner_gpu_budget.is_some() {
                bail!("--planner-target and --planner-gpu-budget need --planner-act kubernetes");
            }
            return Ok(None);
        };
        if self.planner_targets.is_empty() {
            bail!("--planner-act kubernetes needs at least one --planner-target");
        }
        let mut targets = Vec::new();
        let mut pools = BTreeSet::new();
        for t in &self.planner_targets {
            let target: PlannerTarget = t
                .parse()
                .map_err(|e| anyhow::anyhow!("--planner-target {e}"))?;
            if !pools.insert(target.pool.clone()) {
                bail!("--planner-target: pool {:?} has two targets", target.pool);
            }
            // Two pools scaling one workload would each set its replicas (found by a probe).
            let same = |o: &&PlannerTarget| {
                (&o.namespace, o.kind, &o.name) == (&target.namespace, target.kind, &target.name)
            };
            if let Some(other) = targets.iter().find(same) {
                let pool = &other.pool;
                bail!("--planner-target {t}: pool {pool:?} scales that workload already");
            }
            targets.push(target);
        }
        if self.planner_gpus_per_worker == 0 {
            bail!("--planner-gpus-per-worker must be at least 1");
        }
        if let Some(budget) = self.planner_gpu_budget {
            let floors = u64::from(min_workers)
                * u64::from(self.planner_gpus_per_worker)
                * targets.len() as u64;
            if u64::from(budget) < floors {
                bail!("--planner-gpu-budget {budget} is below the targets' minimum ({floors} GPUs: --planner-min-workers × --planner-gpus-per-worker × targets)");
            }
        }
        use crate::flag_values::{non_negative as secs, positive};
        let timeout = positive(self.planner_act_timeout_s, "--planner-act-timeout-s")?;
        Ok(Some(PlannerAct {
            targets,
            gpu_budget: self.planner_gpu_budget,
            gpus_per_worker: self.planner_gpus_per_worker,
            cooldown: secs(self.planner_act_cooldown_s, "--planner-act-cooldown-s")?,
            timeout,
        }))
    }
}
