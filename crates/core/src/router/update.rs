//! The weight-update cycle: a pure state machine the host drives. The router takes the workers
//! being updated out of rotation (new requests queue or go to other compatible workers), tells
//! the host which engine calls to make ([`UpdateAction`]), and puts each worker back at the new
//! policy version once the host reports its weights loaded.
//!
//! Modes:
//! - `drain`: every target at once; each loads its weights when its in-flight requests finished.
//! - `abort`: every target at once; the host aborts their in-flight requests (keeping the
//!   partial output, which it continues elsewhere like a migration), then loads.
//! - `rolling`: `batch` targets at a time, drained, while the rest keep serving.
//!
//! The host reports completions and cancellations to the router as usual and then calls
//! [`Router::update_tick`]: a worker with no request left moves on to loading.

use super::Router;
use crate::ids::WorkerId;
use crate::time::Time;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How in-flight requests on a worker being updated are treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdateMode {
    /// Stop admitting, let in-flight requests finish, then load.
    Drain,
    /// Stop admitting, abort in-flight requests (continued elsewhere), then load.
    Abort,
    /// Drain and load `batch` workers at a time while the others serve.
    Rolling,
}

impl UpdateMode {
    /// The API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            UpdateMode::Drain => "drain",
            UpdateMode::Abort => "abort",
            UpdateMode::Rolling => "rolling",
        }
    }
}

impl std::str::FromStr for UpdateMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "drain" => Ok(UpdateMode::Drain),
            "abort" => Ok(UpdateMode::Abort),
            "rolling" => Ok(UpdateMode::Rolling),
            other => Err(format!(
                "unknown update mode `{other}` (expected drain, abort or rolling)"
            )),
        }
    }
}

/// What to update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdatePlan {
    /// The policy version the workers will serve.
    pub version: u64,
    /// How in-flight requests are treated.
    pub mode: UpdateMode,
    /// Workers updated at a time in `rolling` mode (at least 1).
    pub batch: usize,
    /// The workers to update (`None` = every registered worker).
    pub workers: Option<Vec<WorkerId>>,
}

/// Where a worker stands in the cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdatePhase {
    /// Not started yet (rolling): serving at its old version.
    Pending,
    /// Out of rotation; its in-flight requests finish (or are being aborted).
    Draining,
    /// Loading the new weights.
    Updating,
    /// Loaded, out of rotation until no worker that began loading at or before it is still
    /// loading: workers loading together come back together, so requests that waited for them
    /// spread over all of them instead of flooding the first one back.
    Loaded,
    /// Serving the new version.
    Done,
    /// The engine failed to load; left out of rotation (paused) until a later cycle loads on it
    /// or an operator resumes it.
    Failed,
}

/// An engine call the host must make.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateAction {
    /// Abort the worker's in-flight requests (keeping their partial output).
    Abort(WorkerId),
    /// Load the weights of `version` on the worker, then call [`Router::update_loaded`].
    Load {
        /// The worker.
        worker: WorkerId,
        /// The version to load.
        version: u64,
    },
}

/// Why an update cannot start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UpdateError {
    /// Another cycle is running.
    #[error("a weight update to version {0} is already running")]
    InProgress(u64),
    /// The plan names a worker the router does not know.
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerId),
    /// The plan has no worker.
    #[error("no workers to update")]
    NoWorkers,
    /// `batch` is 0.
    #[error("`batch` must be at least 1")]
    ZeroBatch,
    /// The host reported on a worker that is not loading.
    #[error("worker {0} is not loading weights")]
    NotUpdating(WorkerId),
}

/// A cycle's progress, for `GET /admin/policy`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UpdateStatus {
    /// The plan.
    pub plan: UpdatePlan,
    /// Each target's phase.
    pub phases: BTreeMap<WorkerId, UpdatePhase>,
    /// When it started.
    pub started: Time,
    /// When the last target finished (`None` while running).
    pub finished: Option<Time>,
    /// Workers done, out of all targets.
    pub done: usize,
    /// Targets.
    pub total: usize,
}

/// The running (or last) cycle.
#[derive(Clone, Debug)]
pub(super) struct UpdateCycle {
    plan: UpdatePlan,
    phases: BTreeMap<WorkerId, UpdatePhase>,
    /// When each worker started loading.
    load_started: BTreeMap<WorkerId, Time>,
    started: Time,
    finished: Option<Time>,
}

impl UpdateCycle {
    fn running(&self) -> bool {
        self.finished.is_none()
    }
}

impl Router {
    /// Starts a weight-update cycle: the first batch leaves rotation at once. Returns the engine
    /// calls to make now (aborts in `abort` mode; loads for workers already idle).
    pub fn begin_update(
        &mut self,
        plan: UpdatePlan,
        now: Time,
    ) -> Result<Vec<UpdateAction>, UpdateError> {
        if let Some(c) = self.update.as_ref().filter(|c| c.running()) {
            return Err(UpdateError::InProgress(c.plan.version));
        }
        if plan.batch == 0 {
            return Err(UpdateError::ZeroBatch);
        }
        let targets: Vec<WorkerId> = match &plan.workers {
            Some(ws) => {
                if let Some(w) = ws.iter().find(|w| !self.workers.contains_key(w)) {
                    return Err(UpdateError::UnknownWorker(*w));
                }
                ws.clone()
            }
            None => self.workers.keys().copied().collect(),
        };
        if targets.is_empty() {
            return Err(UpdateError::NoWorkers);
        }
        self.update = Some(UpdateCycle {
            phases: targets.iter().map(|w| (*w, UpdatePhase::Pending)).collect(),
            plan,
            load_started: BTreeMap::new(),
            started: now,
            finished: None,
        });
        Ok(self.next_batch(now))
    }

    /// Moves the next batch of pending targets out of rotation.
    fn next_batch(&mut self, now: Time) -> Vec<UpdateAction> {
        let Some(cycle) = self.update.as_mut().filter(|c| c.running()) else {
            self.announce_update_held();
            return Vec::new();
        };
        let in_progress = cycle
            .phases
            .values()
            .filter(|p| {
                matches!(
                    p,
                    UpdatePhase::Draining | UpdatePhase::Updating | UpdatePhase::Loaded
                )
            })
            .count();
        let width = match cycle.plan.mode {
            UpdateMode::Rolling => cycle.plan.batch,
            UpdateMode::Drain | UpdateMode::Abort => usize::MAX,
        };
        let mut actions = Vec::new();
        let mut room = width.saturating_sub(in_progress);
        for (w, phase) in cycle.phases.iter_mut() {
            if room == 0 {
                break;
            }
            if *phase == UpdatePhase::Pending {
                *phase = UpdatePhase::Draining;
                room -= 1;
                let busy = self
                    .ranks
                    .iter()
                    .filter(|r| r.worker == *w)
                    .any(|r| self.ledger.load(*r).active_requests > 0);
                // An idle worker goes straight to loading; only busy ones are aborted.
                if cycle.plan.mode == UpdateMode::Abort && busy {
                    actions.push(UpdateAction::Abort(*w));
                }
            }
        }
        actions.extend(self.update_tick(now));
        // The other replicas hold the same workers out while this one drives the cycle.
        self.announce_update_held();
        actions
    }

    /// Draining workers with no request left move on to loading: returns their loads.
    /// [`Router::finish`] and [`Router::cancel`] tick themselves and return the loads in their
    /// [`crate::router::Effects`].
    pub fn update_tick(&mut self, now: Time) -> Vec<UpdateAction> {
        let Some(cycle) = self.update.as_mut().filter(|c| c.running()) else {
            return Vec::new();
        };
        let version = cycle.plan.version;
        let mut actions = Vec::new();
        for (w, phase) in cycle.phases.iter_mut() {
            if *phase != UpdatePhase::Draining {
                continue;
            }
            let busy = self
                .ranks
                .iter()
                .filter(|r| r.worker == *w)
                .any(|r| self.ledger.load(*r).active_requests > 0);
            if !busy {
                *phase = UpdatePhase::Updating;
                cycle.load_started.insert(*w, now);
                actions.push(UpdateAction::Load {
                    worker: *w,
                    version,
                });
            }
        }
        actions
    }

    /// The host finished loading weights on `worker` (`ok`), or failed to. A loaded worker is
    /// back in rotation once no worker that began loading at or before it is still loading; from
    /// then on it serves the new version and its cache picture is dropped unless KV retention is
    /// `retain`, and a pause an earlier failed load left on it is lifted (an operator's pause
    /// stays). A failed one stays out (paused). Returns the next engine calls.
    pub fn update_loaded(
        &mut self,
        worker: WorkerId,
        ok: bool,
        now: Time,
    ) -> Result<Vec<UpdateAction>, UpdateError> {
        let cycle = self
            .update
            .as_mut()
            .filter(|c| c.running())
            .ok_or(UpdateError::NotUpdating(worker))?;
        match cycle.phases.get_mut(&worker) {
            Some(p) if *p == UpdatePhase::Updating => {
                *p = if ok {
                    UpdatePhase::Loaded
                } else {
                    UpdatePhase::Failed
                }
            }
            _ => return Err(UpdateError::NotUpdating(worker)),
        }
        if !ok {
            self.pause_for_failed_load(worker);
        }
        Ok(self.settle_update(now))
    }

    /// A worker of the running cycle was removed from the fleet (`remove_worker`): it leaves
    /// the cycle, so loaded workers no longer wait for its load and the cycle can finish
    /// without it. Returns the next engine calls (none when it took no part).
    pub fn update_worker_removed(&mut self, worker: WorkerId, now: Time) -> Vec<UpdateAction> {
        let Some(cycle) = self.update.as_mut().filter(|c| c.running()) else {
            return Vec::new();
        };
        if cycle.phases.remove(&worker).is_none() {
            return Vec::new();
        }
        cycle.load_started.remove(&worker);
        self.settle_update(now)
    }

    /// Brings loaded workers back once no earlier load is still under way, ends the cycle when
    /// every target is done or failed, and moves the next batch out of rotation.
    fn settle_update(&mut self, now: Time) -> Vec<UpdateAction> {
        let Some(cycle) = self.update.as_mut().filter(|c| c.running()) else {
            return Vec::new();
        };
        let version = cycle.plan.version;
        // A loaded worker waits for the loads that started no later than its own (loads take
        // about as long as each other, so workers loading together come back together), not
        // for later ones nor for workers still draining (a drain lasts as long as its longest
        // request).
        let started = |w: &WorkerId| cycle.load_started.get(w).copied().unwrap_or(now);
        let first_loading = cycle
            .phases
            .iter()
            .filter(|(_, p)| **p == UpdatePhase::Updating)
            .map(|(w, _)| started(w))
            .min();
        let back: Vec<WorkerId> = cycle
            .phases
            .iter()
            .filter(|(w, p)| {
                **p == UpdatePhase::Loaded && first_loading.is_none_or(|f| started(w) < f)
            })
            .map(|(w, _)| *w)
            .collect();
        for w in &back {
            cycle.phases.insert(*w, UpdatePhase::Done);
        }
        if cycle
            .phases
            .values()
            .all(|p| matches!(p, UpdatePhase::Done | UpdatePhase::Failed))
        {
            cycle.finished = Some(now);
        }
        // They serve the new version from now on; what they cached before is forgotten unless
        // KV is retained.
        for w in back {
            self.set_policy_version(w, version);
            self.resume_after_load(w);
            if self.config.kv_retention == super::KvRetention::Flush {
                self.clear_worker_cache(w);
            }
        }
        self.next_batch(now)
    }

    /// The running or last cycle.
    pub fn update_status(&self) -> Option<UpdateStatus> {
        let c = self.update.as_ref()?;
        Some(UpdateStatus {
            plan: c.plan.clone(),
            phases: c.phases.clone(),
            started: c.started,
            finished: c.finished,
            done: c
                .phases
                .values()
                .filter(|p| **p == UpdatePhase::Done)
                .count(),
            total: c.phases.len(),
        })
    }

    /// The phase of a worker in the running cycle, if it takes part and is not done.
    pub fn update_phase(&self, id: WorkerId) -> Option<UpdatePhase> {
        let c = self.update.as_ref().filter(|c| c.running())?;
        c.phases.get(&id).copied()
    }

    /// Out of rotation for the running cycle (draining, loading, or waiting for its batch).
    pub(super) fn updating(&self, id: WorkerId) -> bool {
        matches!(
            self.update_phase(id),
            Some(UpdatePhase::Draining | UpdatePhase::Updating | UpdatePhase::Loaded)
        )
    }
}
