//! The RL controls of the router: operator pauses (elastic membership), policy versions, and
//! GRPO group placement.

use super::{RouteError, RouteRequest, Router};
use crate::ids::{WorkerId, WorkerRank};
use crate::policy::Candidate;

impl Router {
    /// Out of the eligible set: marked unavailable (health) or paused.
    pub(super) fn excluded(&self, id: WorkerId) -> bool {
        self.unavailable.contains(&id) || self.held(id)
    }

    /// Held out of rotation on purpose and coming back: paused, or in a weight update.
    pub(super) fn held(&self, id: WorkerId) -> bool {
        self.paused.contains(&id) || self.updating(id)
    }

    /// Pauses (true) or resumes (false) a worker: out of rotation, e.g. a colocated engine put to
    /// sleep between RL steps, without being marked failed. Unlike health, a pause keeps the
    /// worker's cache picture as well as its load accounting, and only an explicit resume
    /// undoes it. Returns whether the worker is known.
    pub fn set_paused(&mut self, id: WorkerId, paused: bool) -> bool {
        if !self.workers.contains_key(&id) {
            return false;
        }
        if paused {
            self.paused.insert(id);
        } else {
            self.paused.remove(&id);
        }
        true
    }

    /// Whether an operator paused the worker.
    pub fn is_paused(&self, id: WorkerId) -> bool {
        self.paused.contains(&id)
    }

    /// Sets the policy (weight) version a worker serves. Requests waiting for that version can
    /// now be placed: call [`Router::poll`]. Returns whether the worker is known.
    pub fn set_policy_version(&mut self, id: WorkerId, version: u64) -> bool {
        match self.workers.get_mut(&id) {
            Some(w) => {
                w.policy_version = version;
                true
            }
            None => false,
        }
    }

    /// The newest policy version among registered workers.
    pub fn newest_policy_version(&self) -> u64 {
        self.workers
            .values()
            .map(|w| w.policy_version)
            .max()
            .unwrap_or(0)
    }

    /// Keeps the ranks whose worker serves a version `request` accepts.
    pub(super) fn version_filter(
        &self,
        request: &RouteRequest,
        ranks: Vec<WorkerRank>,
    ) -> Result<Vec<WorkerRank>, RouteError> {
        if request.policy.is_any() {
            return Ok(ranks);
        }
        let newest = self.newest_policy_version();
        let kept: Vec<WorkerRank> = ranks
            .into_iter()
            .filter(|r| {
                request
                    .policy
                    .accepts(self.workers[&r.worker].policy_version, newest)
            })
            .collect();
        if kept.is_empty() {
            Err(RouteError::NoCompatibleVersion)
        } else {
            Ok(kept)
        }
    }

    /// The rank a session is bound to, while the binding lives and affinity is on.
    /// Group placement: the candidate holding the request's group, unless it carries more than
    /// `router_group_max_skew` active requests above the least-loaded candidate.
    pub(super) fn group_choice(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
    ) -> Option<usize> {
        let skew = self.config.router_group_max_skew;
        if skew == 0 {
            return None;
        }
        let (rank, _) = self.groups.get(&request.group?)?;
        let i = candidates.iter().position(|c| c.rank == *rank)?;
        let least = candidates.iter().map(|c| c.load.active_requests).min()?;
        (candidates[i].load.active_requests <= least + skew).then_some(i)
    }

    /// Number of RL groups with a placement.
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }
}
