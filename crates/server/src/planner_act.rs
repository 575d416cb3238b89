//! The planner acting on Kubernetes (`--planner-act kubernetes`): each tick, after the advisor's
//! recommendations, every target's `scale` subresource is read (GET), the GPU budget is split
//! between the target pools ([`kvrouter_core::planner::actuate::split_budget`]), and a target
//! whose replicas differ from its grant is patched (merge patch `{"spec":{"replicas":N}}`),
//! no two patches of one target closer than the cool-down. A failed call (403, 500, timeout) is
//! counted and retried at the next tick; a patch without an answer in time may have been
//! applied, so it starts the cool-down as a patch does. The kube config comes from `KUBECONFIG` /
//! `~/.kube/config` or the pod's service account, as for `--discovery kubernetes`.

use crate::config::{PlannerAct, PlannerTarget, WorkloadKind};
use crate::planner::Advisor;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v1::Scale;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use kvrouter_core::planner::actuate::{decide, split_budget, Action, Claim};
use kvrouter_core::time::Time;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Longest wait between attempts to build a kube client.
pub(crate) const CLIENT_BACKOFF_MAX: Duration = Duration::from_secs(30);

#[derive(Default)]
struct TargetState {
    /// Replicas last read or patched.
    current: Option<u32>,
    /// Replicas granted at the last tick.
    grant: Option<u32>,
    last_patch: Option<Time>,
    /// What the last tick did.
    last: String,
}

#[derive(Default)]
struct State {
    targets: Vec<TargetState>,
    /// Patches done, by (pool, "up" | "down").
    actions: BTreeMap<(String, &'static str), u64>,
    /// Failed calls, by (pool, "get" | "patch" | "client").
    failures: BTreeMap<(String, &'static str), u64>,
}

/// The actuator: the targets and what was done to them.
pub(crate) struct Actuator {
    config: PlannerAct,
    state: Mutex<State>,
}

impl Actuator {
    /// No I/O: the client is built by [`spawn`]'s task.
    pub(crate) fn new(config: PlannerAct) -> Self {
        let targets = config
            .targets
            .iter()
            .map(|_| TargetState::default())
            .collect();
        Self {
            config,
            state: Mutex::new(State {
                targets,
                ..State::default()
            }),
        }
    }

    /// Counts a failed client set-up against every target.
    pub(crate) fn client_failed(&self) {
        for t in &self.config.targets {
            self.failed(&t.pool, "client");
        }
    }

    fn failed(&self, pool: &str, op: &'static str) {
        let mut s = self.state.lock().expect("planner act lock");
        *s.failures.entry((pool.to_owned(), op)).or_insert(0) += 1;
    }

    /// One tick: read, split, patch.
    pub(crate) async fn tick(&self, client: &Client, advisor: &Advisor, now: Time) {
        let (law, recs) = (advisor.law(), advisor.recommendations());
        let t = self.config.timeout;
        let mut current = Vec::with_capacity(self.config.targets.len());
        for target in &self.config.targets {
            let got = match tokio::time::timeout(t, get_scale(client, target)).await {
                Ok(Ok(n)) => Ok(n),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer in {t:?}")),
            };
            current.push(match got {
                Ok(n) => Some(n),
                Err(e) => {
                    tracing::warn!(pool = %target.pool, "planner: reading {}: {e}", describe(target));
                    self.failed(&target.pool, "get");
                    None
                }
            });
        }
        // A pool without a recommendation, or whose replicas are unknown, claims what it has.
        let claims: Vec<Claim> = self
            .config
            .targets
            .iter()
            .zip(&current)
            .map(|(target, cur)| match (recs.get(&target.pool), cur) {
                (Some(rec), Some(cur)) => Claim {
                    desired: rec.workers.clamp(law.min_workers, law.max_workers),
                    floor: law.min_workers.max(rec.in_flight_need.min(*cur)),
                },
                (None, Some(cur)) => Claim {
                    desired: *cur,
                    floor: *cur,
                },
                (_, None) => Claim {
                    desired: law.min_workers,
                    floor: law.min_workers,
                },
            })
            .collect();
        let budget = self
            .config
            .gpu_budget
            .map(|b| b / self.config.gpus_per_worker.max(1));
        let grants = split_budget(&claims, budget);
        for (i, target) in self.config.targets.iter().enumerate() {
            let Some(cur) = current[i] else {
                self.note(i, None, None, "replicas unknown (GET failed)".into());
                continue;
            };
            let grant = grants[i];
            let last_patch = self.state.lock().expect("planner act lock").targets[i].last_patch;
            match decide(cur, grant, now, last_patch, self.config.cooldown) {
                Action::Keep => self.note(i, Some(cur), Some(grant), "kept".into()),
                Action::CoolDown { left } => self.note(
                    i,
                    Some(cur),
                    Some(grant),
                    format!("cooling down for {:.1} s", left.as_secs_f64()),
                ),
                Action::Patch(n) => {
                    let r = tokio::time::timeout(t, patch_scale(client, target, n)).await;
                    match r {
                        Ok(Ok(())) => {
                            let dir = if n > cur { "up" } else { "down" };
                            tracing::info!(pool = %target.pool, "planner: scaled {} from {cur} to {n}", describe(target));
                            let mut s = self.state.lock().expect("planner act lock");
                            *s.actions.entry((target.pool.clone(), dir)).or_insert(0) += 1;
                            s.targets[i] = TargetState {
                                current: Some(n),
                                grant: Some(grant),
                                last_patch: Some(now),
                                last: format!("patched from {cur} to {n}"),
                            };
                        }
                        Ok(Err(e)) => self.patch_failed(i, target, cur, grant, e.to_string()),
                        Err(_) => {
                            self.patch_failed(i, target, cur, grant, format!("no answer in {t:?}"));
                            // The API may have applied it (or may still): the cool-down
                            // starts as for a patch, so a late-landing patch is not sent again
                            // at every tick.
                            let mut s = self.state.lock().expect("planner act lock");
                            s.targets[i].last_patch = Some(now);
                        }
                    }
                }
            }
        }
    }

    fn patch_failed(&self, i: usize, target: &PlannerTarget, cur: u32, grant: u32, e: String) {
        tracing::warn!(pool = %target.pool, "planner: patching {}: {e}", describe(target));
        self.failed(&target.pool, "patch");
        self.note(i, Some(cur), Some(grant), format!("patch failed: {e}"));
    }

    fn note(&self, i: usize, current: Option<u32>, grant: Option<u32>, last: String) {
        let mut s = self.state.lock().expect("planner act lock");
        let t = &mut s.targets[i];
        t.current = current.or(t.current);
        t.grant = grant;
        t.last = last;
    }

    /// The `actuation` part of `GET /admin/planner`.
    pub(crate) fn status(&self) -> Value {
        let s = self.state.lock().expect("planner act lock");
        let targets: Vec<Value> = self
            .config
            .targets
            .iter()
            .zip(&s.targets)
            .map(|(t, st)| {
                json!({
                    "pool": t.pool, "target": describe(t), "replicas": st.current,
                    "granted": st.grant, "last": st.last,
                })
            })
            .collect();
        json!({
            "mode": "kubernetes",
            "gpu_budget": self.config.gpu_budget,
            "gpus_per_worker": self.config.gpus_per_worker,
            "cooldown_s": self.config.cooldown.as_secs_f64(),
            "targets": targets,
        })
    }

    /// The counters on `/metrics`.
    pub(crate) fn render(&self, out: &mut String, prefix: &str) {
        let s = self.state.lock().expect("planner act lock");
        let esc = crate::metrics::escape;
        let name = format!("{prefix}planner_actions_total");
        let _ = writeln!(out, "# HELP {name} Scale patches the planner made, by pool and direction.\n# TYPE {name} counter");
        for ((pool, dir), n) in &s.actions {
            let _ = writeln!(
                out,
                "{name}{{pool=\"{}\",direction=\"{dir}\"}} {n}",
                esc(pool)
            );
        }
        let name = format!("{prefix}planner_action_failures_total");
        let _ = writeln!(out, "# HELP {name} Kubernetes API calls of the planner that failed (retried next tick), by pool and call.\n# TYPE {name} counter");
        for ((pool, op), n) in &s.failures {
            let _ = writeln!(out, "{name}{{pool=\"{}\",op=\"{op}\"}} {n}", esc(pool));
        }
        let name = format!("{prefix}planner_target_replicas");
        let _ = writeln!(out, "# HELP {name} Replicas of each pool's target, as last read or patched.\n# TYPE {name} gauge");
        for (t, st) in self.config.targets.iter().zip(&s.targets) {
            if let Some(n) = st.current {
                let _ = writeln!(out, "{name}{{pool=\"{}\"}} {n}", esc(&t.pool));
            }
        }
    }
}

fn describe(t: &PlannerTarget) -> String {
    let kind = match t.kind {
        WorkloadKind::Deployment => "deployment",
        WorkloadKind::StatefulSet => "statefulset",
    };
    format!("{}/{kind}/{}", t.namespace, t.name)
}

fn replicas(scale: &Scale) -> u32 {
    scale
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .and_then(|r| u32::try_from(r).ok())
        .unwrap_or(0)
}

async fn get_scale(client: &Client, t: &PlannerTarget) -> kube::Result<u32> {
    let scale = match t.kind {
        WorkloadKind::Deployment => {
            Api::<Deployment>::namespaced(client.clone(), &t.namespace)
                .get_scale(&t.name)
                .await?
        }
        WorkloadKind::StatefulSet => {
            Api::<StatefulSet>::namespaced(client.clone(), &t.namespace)
                .get_scale(&t.name)
                .await?
        }
    };
    Ok(replicas(&scale))
}

async fn patch_scale(client: &Client, t: &PlannerTarget, n: u32) -> kube::Result<()> {
    let patch = Patch::Merge(json!({"spec": {"replicas": n}}));
    let pp = PatchParams::default();
    match t.kind {
        WorkloadKind::Deployment => {
            Api::<Deployment>::namespaced(client.clone(), &t.namespace)
                .patch_scale(&t.name, &pp, &patch)
                .await?;
        }
        WorkloadKind::StatefulSet => {
            Api::<StatefulSet>::namespaced(client.clone(), &t.namespace)
                .patch_scale(&t.name, &pp, &patch)
                .await?;
        }
    }
    Ok(())
}
