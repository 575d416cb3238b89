//! The planner's settings: advice (`--planner-advise`) and acting on Kubernetes
//! (`--planner-act`).

use std::time::Duration;

/// The planner acting on its recommendations: each target's `scale` subresource is patched.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerAct {
    /// One workload per pool.
    pub targets: Vec<PlannerTarget>,
    /// GPUs shared between the target pools (`None`: unbounded).
    pub gpu_budget: Option<u32>,
    /// GPUs one worker (replica) uses.
    pub gpus_per_worker: u32,
    /// Least time between two patches of one target.
    pub cooldown: Duration,
    /// Longest wait for one API call.
    pub timeout: Duration,
}

/// The workload a pool's recommendation is applied to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannerTarget {
    /// The model pool (as in `GET /admin/planner`).
    pub pool: String,
    /// Its namespace.
    pub namespace: String,
    /// Deployment or StatefulSet.
    pub kind: WorkloadKind,
    /// Its name.
    pub name: String,
}

/// A scalable workload's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    /// `apps/v1` Deployment.
    Deployment,
    /// `apps/v1` StatefulSet.
    StatefulSet,
}

impl std::str::FromStr for PlannerTarget {
    type Err = String;

    /// `POOL=NAMESPACE/deployment/NAME` or `POOL=NAMESPACE/statefulset/NAME`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{s:?}: expected POOL=NAMESPACE/deployment/NAME or POOL=NAMESPACE/statefulset/NAME"
            )
        };
        let (pool, rest) = s.split_once('=').ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [namespace, kind, name] = parts.as_slice() else {
            return Err(bad());
        };
        let kind = match kind.to_ascii_lowercase().as_str() {
            "deployment" => WorkloadKind::Deployment,
            "statefulset" => WorkloadKind::StatefulSet,
            _ => return Err(bad()),
        };
        if [pool, namespace, name].iter().any(|p| p.is_empty()) {
            return Err(bad());
        }
        Ok(Self {
            pool: pool.to_owned(),
            namespace: (*namespace).to_owned(),
            kind,
            name: (*name).to_owned(),
        })
    }
}

/// The planner's advisory mode: a recommended worker count per model pool, from live signals.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerAdvice {
    /// The control law's bounds and targets.
    pub law: kvrouter_core::planner::PlannerConfig,
    /// Time between ticks.
    pub tick: Duration,
}
