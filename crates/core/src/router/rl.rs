//! The RL controls of the router: operator pauses (elastic membership), policy versions, and
//! GRPO group placement.

use super::{RouteError, RouteRequest, Router, RouterMode};
use crate::ids::{RequestId, WorkerId, WorkerRank};
use crate::policy::{Candidate, CandidateScore};
use crate::rng::mix64;
use crate::time::Time;
use std::collections::BTreeMap;

/// Groups remembered before the idlest half is forgotten.
const MAX_GROUPS: usize = 65_536;

/// Where a group's siblings go.
#[derive(Clone, Debug)]
pub(super) struct GroupHome {
    /// The rank.
    pub(super) rank: WorkerRank,
    /// Siblings placed anywhere (here or at another replica).
    pub(super) total: u32,
    /// Siblings placed here and still running, per rank (a group spans few ranks).
    pub(super) running: Vec<(WorkerRank, u32)>,
    /// Last placement.
    pub(super) last: Time,
}

impl GroupHome {
    /// Siblings of the group running on `rank` (placed by this replica).
    fn running_on(&self, rank: WorkerRank) -> u32 {
        self.running
            .iter()
            .find(|(r, _)| *r == rank)
            .map_or(0, |(_, n)| *n)
    }
}

/// How far a group is.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct GroupProgress {
    size: Option<u32>,
    need: Option<u32>,
    finished: u32,
    satisfied: bool,
    last: Time,
}

/// Drops the entries idle longest (a step's groups finish within it).
fn forget_idlest<V>(map: &mut BTreeMap<u64, V>, last: impl Fn(&V) -> Time) {
    let mut ages: Vec<Time> = map.values().map(&last).collect();
    ages.sort_unstable();
    let cut = ages[ages.len() / 2];
    map.retain(|_, v| last(v) > cut);
}

impl Router {
    /// Out of the eligible set: marked unavailable (health) or paused.
    pub(super) fn excluded(&self, id: WorkerId) -> bool {
        self.unavailable.contains(&id) || self.held(id)
    }

    /// Held out of rotation on purpose and coming back: paused, or in a weight update.
    pub(super) fn held(&self, id: WorkerId) -> bool {
        self.paused.contains(&id) || self.updating(id) || self.replicas.holds(id)
    }

    /// Pauses (true) or resumes (false) a worker: out of rotation, e.g. a colocated engine put to
    /// sleep between RL steps, without being marked failed. Unlike health, a pause keeps the
    /// worker's cache picture as well as its load accounting, and only an explicit resume
    /// undoes it (or, for a worker a failed weight load paused, the next load that succeeds on
    /// it). An operator's pause or resume takes the worker over from the update cycle: a paused
    /// worker stays paused until the operator resumes it. Returns whether the worker is known.
    pub fn set_paused(&mut self, id: WorkerId, paused: bool) -> bool {
        if !self.workers.contains_key(&id) {
            return false;
        }
        self.paused_by_update.remove(&id);
        self.set_paused_as(id, paused);
        true
    }

    /// A failed weight load paused the worker, unless an operator had: the next load that
    /// succeeds on it resumes it.
    pub(super) fn pause_for_failed_load(&mut self, id: WorkerId) {
        if self.workers.contains_key(&id) && !self.paused.contains(&id) {
            self.set_paused_as(id, true);
            self.paused_by_update.insert(id);
        }
    }

    /// The worker now runs the version a cycle loaded: back in rotation if only a failed load
    /// had paused it.
    pub(super) fn resume_after_load(&mut self, id: WorkerId) {
        if self.paused_by_update.remove(&id) {
            self.set_paused_as(id, false);
        }
    }

    /// Whether the worker is paused because a weight load failed on it (not by an operator).
    pub fn is_paused_by_update(&self, id: WorkerId) -> bool {
        self.paused_by_update.contains(&id)
    }

    fn set_paused_as(&mut self, id: WorkerId, paused: bool) {
        if paused {
            self.paused.insert(id);
        } else {
            self.paused.remove(&id);
        }
        self.announce(|_| super::RemoteEvent::Paused { worker: id, paused });
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
                self.announce(|_| super::RemoteEvent::Version {
                    worker: id,
                    version,
                });
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
        let mut kept: Vec<WorkerRank> = ranks;
        kept.retain(|r| {
            request
                .policy
                .accepts(self.workers[&r.worker].policy_version, newest)
        });
        if kept.is_empty() {
            Err(RouteError::NoCompatibleVersion)
        } else {
            Ok(kept)
        }
    }

    /// Group placement: the candidate holding the request's group, while it keeps its share.
    ///
    /// With the group's size known, the group's worker takes the sibling while fewer than
    /// `ceil(size / k)` of the group's siblings are still running there, where `k` is the fewest
    /// workers that keep the group within a worker's fair share of the active requests (the
    /// siblings not placed yet included); otherwise the sibling goes where the policy puts it
    /// (usually beside the prefix) and that becomes the group's worker. In both cases, with
    /// `router_group_max_skew` > 0, the group's worker is used only while it carries at most that
    /// many active requests above the least-loaded candidate (without a size, 0 turns grouping
    /// off). Finished siblings do not count.
    pub(super) fn group_choice(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
    ) -> Option<usize> {
        let home = self.groups.get(&request.group?)?;
        let i = candidates.iter().position(|c| c.rank == home.rank)?;
        let skew = self.config.router_group_max_skew;
        let within_skew = || {
            let least = candidates.iter().map(|c| c.load.active_requests).min();
            least.is_some_and(|l| candidates[i].load.active_requests <= l + skew)
        };
        if let Some(cap) = self.group_cap(request, candidates) {
            return (home.running_on(home.rank) < cap && (skew == 0 || within_skew())).then_some(i);
        }
        (skew > 0 && within_skew()).then_some(i)
    }

    /// The worker of a group's first sibling this replica places, when replica sync is on and no
    /// sibling's worker is known here yet (`kv` mode at temperature 0): among the candidates
    /// costing at most the best plus this request's own blocks, the one the group hashes highest
    /// with (rendezvous hashing). Replicas that place siblings of one group at the same instant,
    /// before they hear of each other, then agree on its worker whenever that favourite is within
    /// the margin in each one's view, instead of each starting the group on its own argmin (the
    /// siblings of a whole-batch burst then pay one prefill of the prompt per replica). The margin
    /// is one more copy of the prompt, which is what the group's later siblings save.
    pub(super) fn group_first_choice(
        &self,
        request: &RouteRequest,
        mode: RouterMode,
        scores: &[CandidateScore],
    ) -> Option<usize> {
        if self.replica_id().is_none()
            || mode != RouterMode::Kv
            || self.config.router_temperature > 0.0
            || !self.group_placed(request)
        {
            return None;
        }
        let group = request.group?;
        if self.groups.contains_key(&group) {
            return None;
        }
        let best = scores.iter().map(|s| s.total).fold(f64::INFINITY, f64::min);
        let margin = request.request_blocks(self.config.kv_cache_block_size) as f64;
        scores
            .iter()
            .enumerate()
            .filter(|(_, s)| s.total <= best + margin)
            .max_by_key(|(_, s)| rendezvous(group, s.rank))
            .map(|(i, _)| i)
    }

    /// Running siblings of a sized group one worker takes: `ceil(size / k)` with `k` the fewest
    /// workers that keep the group within a fair share of the active requests, once the rest of
    /// the group is in.
    fn group_cap(&self, request: &RouteRequest, candidates: &[Candidate]) -> Option<u32> {
        let size = request.group_size.filter(|s| *s > 0)?;
        let total = self.groups.get(&request.group?).map_or(0, |h| h.total);
        let n = candidates.len().max(1) as u32;
        let active: u32 = candidates.iter().map(|c| c.load.active_requests).sum();
        let fair = (active + size.saturating_sub(total)).div_ceil(n).max(1);
        let k = size.div_ceil(fair).max(1);
        Some(size.div_ceil(k))
    }

    /// For a sized group leaving its worker: the candidates running fewer than their share of
    /// it (`None`: no restriction).
    pub(super) fn group_room(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
    ) -> Option<Vec<usize>> {
        let home = self.groups.get(&request.group?)?;
        let cap = self.group_cap(request, candidates)?;
        let room: Vec<usize> = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| home.running_on(c.rank) < cap)
            .map(|(i, _)| i)
            .collect();
        (!room.is_empty()).then_some(room)
    }

    /// Group placement is on for this request: its size is known, or a skew bound is set.
    pub(super) fn group_placed(&self, request: &RouteRequest) -> bool {
        request.group.is_some()
            && (request.group_size.is_some_and(|s| s > 0) || self.config.router_group_max_skew > 0)
    }

    /// Records where a sibling went.
    pub(super) fn place_in_group(&mut self, request: &RouteRequest, rank: WorkerRank, now: Time) {
        if !self.group_placed(request) {
            return;
        }
        let Some(group) = request.group else { return };
        self.record_group(group, rank, Some(request.id), now);
    }

    /// Records that a sibling of `group` went to `rank`: placed here (`id`, running until it
    /// finishes) or at another replica (`None`: it moves the group's worker but is not counted
    /// as running, since its finish is not tied to the group here).
    pub(super) fn record_group(
        &mut self,
        group: u64,
        rank: WorkerRank,
        id: Option<RequestId>,
        now: Time,
    ) {
        let home = self.groups.entry(group).or_insert(GroupHome {
            rank,
            total: 0,
            running: Vec::new(),
            last: now,
        });
        home.rank = rank;
        home.total += 1;
        home.last = now;
        if let Some(id) = id {
            match home.running.iter_mut().find(|(r, _)| *r == rank) {
                Some((_, n)) => *n += 1,
                None => home.running.push((rank, 1)),
            }
            self.group_members.insert(id, (group, rank));
        }
        if self.groups.len() > MAX_GROUPS {
            forget_idlest(&mut self.groups, |h| h.last);
        }
    }

    /// A request finished or was cancelled: it no longer counts as a running sibling.
    pub(super) fn group_released(&mut self, id: RequestId) {
        let Some((group, rank)) = self.group_members.remove(&id) else {
            return;
        };
        if let Some(home) = self.groups.get_mut(&group) {
            if let Some(k) = home.running.iter().position(|(r, _)| *r == rank) {
                home.running[k].1 = home.running[k].1.saturating_sub(1);
                if home.running[k].1 == 0 {
                    home.running.swap_remove(k);
                }
            }
        }
    }

    /// Records a request's group size and need (at submission).
    pub(super) fn note_group(&mut self, request: &RouteRequest, now: Time) {
        let Some(group) = request.group else { return };
        if request.group_size.is_none() && request.group_need.is_none() {
            return;
        }
        let p = self.progress.entry(group).or_default();
        p.size = request.group_size.or(p.size);
        p.need = request.group_need.or(p.need);
        p.last = now;
        if self.progress.len() > MAX_GROUPS {
            forget_idlest(&mut self.progress, |p| p.last);
        }
    }

    /// A sample of `group` finished (completed, not cancelled). Returns true exactly once: when
    /// this completion is the group's N-th of a first-N-of-M group, so the host ends the rest.
    pub fn group_sample_finished(&mut self, group: u64, now: Time) -> bool {
        let Some(p) = self.progress.get_mut(&group) else {
            return false;
        };
        p.finished += 1;
        p.last = now;
        if !p.satisfied && p.need.is_some_and(|n| p.finished >= n) {
            p.satisfied = true;
            return true;
        }
        false
    }

    /// Whether a first-N-of-M group has its N samples (later siblings are not needed).
    pub fn group_satisfied(&self, group: u64) -> bool {
        self.progress.get(&group).is_some_and(|p| p.satisfied)
    }

    /// Samples the group still has to finish before its step can go on (its need, else its
    /// size, minus those finished), when known.
    pub fn group_left(&self, group: u64) -> Option<u32> {
        let p = self.progress.get(&group)?;
        let target = p.need.or(p.size)?;
        Some(target.saturating_sub(p.finished))
    }

    /// Number of RL groups with a placement.
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }
}

/// The rendezvous weight of `rank` for `group`: the same on every replica.
fn rendezvous(group: u64, rank: WorkerRank) -> u64 {
    mix64(group ^ mix64(rank.worker.0.rotate_left(32) ^ u64::from(rank.dp_rank)))
}
