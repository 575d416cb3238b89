//! The `Router` façade: workers, the prefix index, predicted placements, the load ledger and the
//! selection policy behind plain methods. Events in, decisions out, `now` passed in.
//!
//! Layout: `config.rs` (the validated option tree), `request.rs` (requests, decisions, errors),
//! `admission.rs` (the router queue: `submit`, `poll`), `effects.rs` (finish and cancel, and the
//! [`Effects`] they return: placements and update actions), `rl.rs` (pauses, policy versions, group
//! placement, first-N-of-M), `update.rs` (the weight-update cycle), `replica.rs` and
//! `remote_event.rs` (what router replicas share: remote events in, outgoing events out), this file (the façade).

pub mod admission;
mod cluster;
mod config;
mod cost;
mod effects;
mod profiles;
mod remote_event;
mod replica;
mod request;
mod rl;
mod update;

pub use admission::{Admission, QueuePolicy, QueueStats};
pub use config::{
    ConfigError, KvRetention, RouterConfig, DEFAULT_INDEX_MAX_BLOCKS_PER_WORKER,
    DEFAULT_QUEUE_MAX_REQUESTS, DEFAULT_QUEUE_MAX_WAIT_SECS,
};
pub use effects::Effects;
pub use profiles::FittedProfile;
pub use replica::{
    ActiveRequest, RemoteError, RemoteEvent, DEFAULT_ACTIVE_LIST_MAX, REMOTE_ID_BASE,
};
pub use request::{
    Decision, Pin, RouteError, RouteRequest, VersionRequirement, WorkerSpec, MAX_DP_SIZE,
    MAX_PRIORITY,
};
pub use update::{UpdateAction, UpdateError, UpdateMode, UpdatePhase, UpdatePlan, UpdateStatus};

use crate::approx::ApproxIndex;
use crate::event::KvEvent;
use crate::ids::{RequestId, WorkerId, WorkerRank};
use crate::index::{IndexError, OverlapScores, PrefixIndex, TierCapacity};
use crate::ledger::{LoadLedger, RankLoad};
use crate::policy::{self, Candidate, CandidateScore, RouterMode};
use crate::rng::SeededRng;
use crate::time::Time;
use std::collections::BTreeMap;

/// The routing core. See the crate docs.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    workers: BTreeMap<WorkerId, WorkerSpec>,
    /// Every rank of every worker, sorted.
    ranks: Vec<WorkerRank>,
    index: PrefixIndex,
    /// Approximate mode: the only cache picture. Predicted window: a side index.
    predicted: Option<ApproxIndex>,
    ledger: LoadLedger,
    rng: SeededRng,
    rr_cursor: usize,
    queue: admission::AdmissionQueue,
    /// Session → (rank, binding expiry).
    sessions: BTreeMap<u64, (WorkerRank, Time)>,
    /// Workers the host marked unavailable (unhealthy), keeping their load.
    unavailable: std::collections::BTreeSet<WorkerId>,
    /// RL group → where its siblings go.
    groups: BTreeMap<u64, rl::GroupHome>,
    /// Running grouped requests placed here → (group, rank), to count running siblings.
    group_members: crate::fast_map::FastMap<RequestId, (u64, WorkerRank)>,
    /// RL group → samples finished, for first-N-of-M and the group-tail queue policy.
    progress: BTreeMap<u64, rl::GroupProgress>,
    /// Workers paused by an operator (elastic membership), keeping their load and cache.
    paused: std::collections::BTreeSet<WorkerId>,
    /// The paused workers that a failed weight load paused (not an operator): the next cycle
    /// that loads on them resumes them.
    paused_by_update: std::collections::BTreeSet<WorkerId>,
    /// The running (or last) weight-update cycle.
    update: Option<update::UpdateCycle>,
    /// Other replicas' requests and holds, and this replica's outgoing events.
    replicas: replica::Replicas,
    /// The `cost` policy's timing models and what it learned.
    cost: cost::CostState,
    /// The latest `now` a routing call passed in (stamps KV events, which carry no time).
    last_now: Time,
}

impl Router {
    /// A router with no workers. Fails if the configuration is invalid.
    pub fn new(config: RouterConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let block_size = config.kv_cache_block_size;
        let predicted = if !config.router_kv_events {
            Some(ApproxIndex::new(
                block_size,
                config.approx_config(config.router_ttl_secs),
            ))
        } else {
            config
                .router_predicted_ttl_secs
                .map(|ttl| ApproxIndex::new(block_size, config.approx_config(ttl)))
        };
        Ok(Self {
            rng: SeededRng::new(config.seed),
            index: PrefixIndex::new(block_size),
            predicted,
            config,
            workers: BTreeMap::new(),
            ranks: Vec::new(),
            ledger: LoadLedger::new(),
            rr_cursor: 0,
            queue: admission::AdmissionQueue::default(),
            sessions: BTreeMap::new(),
            unavailable: std::collections::BTreeSet::new(),
            paused: std::collections::BTreeSet::new(),
            paused_by_update: std::collections::BTreeSet::new(),
            groups: BTreeMap::new(),
            group_members: Default::default(),
            progress: BTreeMap::new(),
            update: None,
            replicas: replica::Replicas::default(),
            cost: cost::CostState::default(),
            last_now: Time::ZERO,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The event-fed prefix index.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The load ledger.
    pub fn ledger(&self) -> &LoadLedger {
        &self.ledger
    }

    /// Registered workers.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerSpec> {
        self.workers.values()
    }

    /// Every rank, sorted.
    pub fn ranks(&self) -> &[WorkerRank] {
        &self.ranks
    }

    /// Registers a worker and its ranks. Refuses impossible specs (no ranks, more than
    /// [`MAX_DP_SIZE`] ranks, a zero token budget or capacity) with
    /// [`RouteError::InvalidWorker`].
    pub fn add_worker(&mut self, spec: WorkerSpec) -> Result<(), RouteError> {
        if self.workers.contains_key(&spec.id) {
            return Err(RouteError::DuplicateWorker(spec.id));
        }
        let invalid = |why| Err(RouteError::InvalidWorker(spec.id, why));
        if spec.dp_size == 0 {
            return invalid("dp_size must be at least 1");
        }
        if spec.dp_size > MAX_DP_SIZE {
            return invalid("dp_size is over the limit (kvrouter_core::router::MAX_DP_SIZE)");
        }
        if spec.max_num_batched_tokens == Some(0) {
            return invalid("max_num_batched_tokens must be at least 1");
        }
        if spec.kv_capacity_blocks == Some(0) {
            return invalid("kv_capacity_blocks must be at least 1");
        }
        // The declared capacity is the GPU pool's; offload tiers get at least the default.
        let default = self.config.router_index_max_blocks_per_worker;
        let gpu = spec
            .kv_capacity_blocks
            .map_or(default, |c| usize::try_from(c).unwrap_or(usize::MAX));
        let capacity = TierCapacity {
            gpu_blocks: gpu,
            offload_blocks: gpu.max(default),
        };
        self.index.set_worker_capacity(spec.id, Some(capacity));
        self.workers.insert(spec.id, spec);
        self.rebuild_ranks();
        Ok(())
    }

    /// Forgets a worker and drops all its cached blocks. Its active requests stay in the ledger
    /// until the host finishes or cancels them.
    pub fn remove_worker(&mut self, id: WorkerId) -> Result<WorkerSpec, RouteError> {
        let spec = self
            .workers
            .remove(&id)
            .ok_or(RouteError::UnknownWorker(id))?;
        self.unavailable.remove(&id);
        self.paused.remove(&id);
        self.paused_by_update.remove(&id);
        self.index.remove_worker(id);
        self.index.set_worker_capacity(id, None);
        self.ledger.forget_idle(id);
        if let Some(p) = &mut self.predicted {
            p.remove_worker(id);
        }
        self.cost_worker_removed(id);
        self.rebuild_ranks();
        Ok(spec)
    }

    /// Takes a worker out of (false) or back into (true) the eligible set without touching its
    /// load accounting or cache state. Returns whether the worker is known.
    pub fn set_available(&mut self, id: WorkerId, available: bool) -> bool {
        if !self.workers.contains_key(&id) {
            return false;
        }
        if available {
            self.unavailable.remove(&id);
        } else {
            self.unavailable.insert(id);
        }
        true
    }

    /// Whether a worker is in the eligible set (known, not unavailable, not paused).
    pub fn is_available(&self, id: WorkerId) -> bool {
        self.workers.contains_key(&id) && !self.excluded(id)
    }

    /// Forgets everything cached on a worker (event-fed and predicted), e.g. after it was
    /// unhealthy for a while or came back under the same id.
    pub fn clear_worker_cache(&mut self, id: WorkerId) {
        self.index.remove_worker(id);
        if let Some(p) = &mut self.predicted {
            p.remove_worker(id);
        }
    }

    fn rebuild_ranks(&mut self) {
        self.ranks = self
            .workers
            .values()
            .flat_map(|w| (0..w.dp_size).map(move |r| WorkerRank::new(w.id, r)))
            .collect();
    }

    /// Applies a KV event from a registered worker. `Cleared` also drops that rank's predicted
    /// placements.
    pub fn apply_event(&mut self, event: &KvEvent) -> Result<(), IndexError> {
        let rank = event.rank();
        let known = self
            .workers
            .get(&rank.worker)
            .is_some_and(|w| rank.dp_rank < w.dp_size);
        if !known {
            return Err(IndexError::UnknownWorker { rank });
        }
        if let (KvEvent::Cleared { .. }, Some(p)) = (event, &mut self.predicted) {
            p.clear_rank(rank);
        }
        let now = self.last_now;
        self.cost_event(event, now);
        self.index.apply(event)
    }

    /// The overlap of every rank with a prompt: event-fed, predicted, or the larger of both.
    pub fn overlaps(&self, request: &RouteRequest) -> OverlapScores {
        let query = &request.blocks.sequence;
        match (&self.predicted, self.config.router_kv_events) {
            (Some(p), false) => p.find_matches(query),
            (Some(p), true) => self
                .index
                .find_matches(query)
                .max_with(&p.find_matches(query)),
            (None, _) => self.index.find_matches(query),
        }
    }

    fn is_busy(&self, rank: WorkerRank, load: &RankLoad) -> bool {
        let c = &self.config;
        if let Some(t) = c.active_prefill_tokens_threshold {
            if load.active_prefill_tokens > t {
                return true;
            }
        }
        if c.active_decode_blocks_threshold.is_none()
            && c.active_prefill_tokens_threshold_frac.is_none()
        {
            // The spec is not needed (and its lookup is not free, once per candidate).
            return false;
        }
        let spec = &self.workers[&rank.worker];
        if let (Some(t), Some(capacity)) =
            (c.active_decode_blocks_threshold, spec.kv_capacity_blocks)
        {
            if load.active_decode_blocks as f64 > t * capacity as f64 {
                return true;
            }
        }
        if let (Some(f), Some(max)) = (
            c.active_prefill_tokens_threshold_frac,
            spec.max_num_batched_tokens,
        ) {
            if load.active_prefill_tokens as f64 > f * max as f64 {
                return true;
            }
        }
        false
    }

    /// Chooses a rank for `request`, records the request's load on it and, in approximate or
    /// predicted mode, its blocks. The decision carries every candidate's score.
    pub fn route(&mut self, request: &RouteRequest, now: Time) -> Result<Decision, RouteError> {
        if self.ledger.is_active(request.id) {
            return Err(RouteError::DuplicateRequest(request.id));
        }
        if let Some(p) = &mut self.predicted {
            p.expire(now);
        }
        self.last_now = self.last_now.max(now);
        let mode = self.config.router_mode;
        let allowed = self.allowed_ranks(request, mode)?;
        // Sized up front: a filtered collect grows by reallocation.
        let mut eligible: Vec<(WorkerRank, RankLoad)> = Vec::with_capacity(allowed.len());
        eligible.extend(
            allowed
                .iter()
                .map(|r| (*r, self.ledger.load(*r)))
                .filter(|(r, load)| !self.is_busy(*r, load)),
        );
        if eligible.is_empty() {
            return Err(RouteError::AllEligibleWorkersOverloaded);
        }
        let overlaps = self.overlaps(request);
        let held = self.ledger.held_prefixes(&request.blocks.sequence);
        let request_blocks = request.request_blocks(self.config.kv_cache_block_size);
        // Eligible ranks come in rank order: both lookups walk forward.
        let (mut overlap_of, mut held_of) = (overlaps.walk(), held.walk());
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|(rank, load)| Candidate {
                rank: *rank,
                load: *load,
                overlap: overlap_of(*rank),
                new_blocks: request_blocks - held_of(*rank) as u64,
            })
            .collect();
        let mut scores = policy::kv_scores(
            &candidates,
            request.isl_tokens,
            self.config.kv_cache_block_size,
            &self.config.kv_params(),
        );
        let mut home = None;
        let mut prefix = None;
        if mode == RouterMode::Cost {
            // The policy's own figure: expected seconds (docs/routing.md).
            let (estimates, key) = self.cost_estimates(request, &candidates, now);
            prefix = key;
            home = self.cost_home(request, &candidates, &estimates);
            for (s, e) in scores.iter_mut().zip(&estimates) {
                s.total = e.total;
            }
        }
        let sticky = self
            .session_rank(request, now)
            .and_then(|r| candidates.iter().position(|c| c.rank == r))
            .or(home);
        let grouped = match sticky {
            Some(_) => None,
            None => self.group_choice(request, &candidates),
        };
        let chosen = match sticky.or(grouped) {
            Some(i) => i,
            None => match self.group_room(request, &candidates) {
                // A sized group that filled its workers' shares spills to another worker.
                Some(room) => {
                    let sub: Vec<Candidate> = room.iter().map(|i| candidates[*i]).collect();
                    let sub_scores: Vec<CandidateScore> = room.iter().map(|i| scores[*i]).collect();
                    room[self.pick(mode, &sub, &sub_scores)]
                }
                None => match self.group_first_choice(request, mode, &scores) {
                    Some(i) => i,
                    None => self.pick(mode, &candidates, &scores),
                },
            },
        };
        let score = scores[chosen];
        let rank = score.rank;

        let block_size = self.config.kv_cache_block_size as u64;
        let cached_tokens =
            (u64::from(score.overlap.gpu_blocks) * block_size).min(request.isl_tokens);
        let full = request.blocks.sequence.len() as u64;
        self.ledger
            .begin_chain(
                request.id,
                rank,
                request.isl_tokens - cached_tokens,
                &request.blocks.sequence,
                request_blocks - full,
            )
            .map_err(|_| RouteError::DuplicateRequest(request.id))?;
        if let Some(p) = &mut self.predicted {
            p.insert(rank, &request.blocks, now);
        }
        self.place_in_group(request, rank, now);
        if mode == RouterMode::Cost {
            self.cost_placed(request, rank, prefix, now);
        }
        if let (Some(session), Some(ttl)) = (
            request.session,
            self.config.router_session_affinity_ttl_secs,
        ) {
            self.sessions.insert(
                session,
                (rank, now + std::time::Duration::from_secs_f64(ttl)),
            );
        }
        self.announce_route(request, rank);
        Ok(Decision {
            request: request.id,
            rank,
            mode,
            overlap: score.overlap,
            cached_tokens,
            candidates: scores,
            policy_version: self.workers[&rank.worker].policy_version,
        })
    }

    /// Places a request that continues one already admitted (a retry after a failed send, a
    /// migration after a worker failure): now, outside the router queue, on a worker it has not
    /// tried, among those it may use. The live server and the simulator both place
    /// continuations here, so a simulated migration is evidence about a live one.
    pub fn route_continuation(
        &mut self,
        request: &RouteRequest,
        tried: &[WorkerId],
        now: Time,
    ) -> Result<Decision, RouteError> {
        let allowed: Vec<WorkerId> = self
            .workers
            .keys()
            .filter(|w| !tried.contains(w))
            .filter(|w| {
                request
                    .allowed_workers
                    .as_ref()
                    .is_none_or(|a| a.contains(w))
            })
            .copied()
            .collect();
        let mut request = request.clone();
        request.allowed_workers = Some(allowed);
        self.route(&request, now)
    }

    fn allowed_ranks(
        &self,
        request: &RouteRequest,
        mode: RouterMode,
    ) -> Result<Vec<WorkerRank>, RouteError> {
        if self.ranks.is_empty() {
            return Err(RouteError::NoWorkers);
        }
        if let Some(pin) = request.pin {
            let spec = self
                .workers
                .get(&pin.worker)
                .ok_or(RouteError::UnknownWorker(pin.worker))?;
            if self.excluded(pin.worker) {
                return Err(if self.held(pin.worker) {
                    RouteError::WorkersPaused
                } else {
                    RouteError::NoWorkers
                });
            }
            let ranks = match pin.dp_rank {
                Some(r) if r >= spec.dp_size => {
                    return Err(RouteError::UnknownRank(WorkerRank::new(pin.worker, r)))
                }
                Some(r) => vec![WorkerRank::new(pin.worker, r)],
                None => (0..spec.dp_size)
                    .map(|r| WorkerRank::new(pin.worker, r))
                    .collect(),
            };
            return self.version_filter(request, ranks);
        }
        if mode == RouterMode::Direct {
            return Err(RouteError::MissingTarget);
        }
        let permitted = |r: &&WorkerRank| {
            request
                .allowed_workers
                .as_ref()
                .is_none_or(|a| a.contains(&r.worker))
        };
        let mut ranks: Vec<WorkerRank> = Vec::with_capacity(self.ranks.len());
        ranks.extend(
            self.ranks
                .iter()
                .filter(permitted)
                .filter(|r| !self.excluded(r.worker))
                .copied(),
        );
        if ranks.is_empty() {
            // Workers held out by an operator or an update come back: wait for them.
            let held = self
                .ranks
                .iter()
                .filter(permitted)
                .any(|r| self.held(r.worker));
            return Err(if held {
                RouteError::WorkersPaused
            } else {
                RouteError::NoWorkers
            });
        }
        self.version_filter(request, ranks)
    }

    fn pick(
        &mut self,
        mode: RouterMode,
        candidates: &[Candidate],
        scores: &[CandidateScore],
    ) -> usize {
        match mode {
            RouterMode::RoundRobin => {
                let i = policy::round_robin(candidates.len(), self.rr_cursor);
                self.rr_cursor = self.rr_cursor.wrapping_add(1);
                i
            }
            RouterMode::Random => policy::random_pick(candidates.len(), &mut self.rng),
            RouterMode::LeastLoaded => policy::least_loaded(candidates, &mut self.rng),
            RouterMode::PowerOfTwo => policy::power_of_two(candidates, &mut self.rng),
            RouterMode::Kv | RouterMode::Direct => {
                policy::pick_by_cost(scores, self.config.router_temperature, &mut self.rng)
            }
            RouterMode::Cost => {
                let i = policy::cost::argmin_rotating(scores, self.rr_cursor);
                self.rr_cursor = self.rr_cursor.wrapping_add(1);
                i
            }
        }
    }

    fn session_rank(&self, request: &RouteRequest, now: Time) -> Option<WorkerRank> {
        self.config.router_session_affinity_ttl_secs?;
        let (rank, expires) = self.sessions.get(&request.session?)?;
        (*expires > now).then_some(*rank)
    }

    /// Releases a session's binding. Returns whether there was one.
    pub fn release_session(&mut self, session: u64) -> bool {
        let had = self.sessions.remove(&session).is_some();
        if had {
            self.announce(|_| RemoteEvent::SessionReleased { session });
        }
        had
    }

    /// The rank a session is bound to at `now`, if any.
    pub fn session_binding(&self, session: u64, now: Time) -> Option<WorkerRank> {
        let (rank, expires) = self.sessions.get(&session)?;
        (*expires > now).then_some(*rank)
    }

    /// Drops expired session bindings.
    pub fn expire_sessions(&mut self, now: Time) {
        self.sessions.retain(|_, (_, expires)| *expires > now);
    }

    /// Number of live session bindings.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// The request produced its first token.
    pub fn first_token(&mut self, id: RequestId) -> Result<(), RouteError> {
        let prefill = matches!(
            self.ledger.get(id),
            Some((_, crate::ledger::Phase::Prefill))
        );
        self.ledger
            .first_token(id)
            .map_err(|_| RouteError::UnknownRequest(id))?;
        if prefill && id.0 < REMOTE_ID_BASE {
            self.announce(|replica| RemoteEvent::FirstToken {
                replica,
                request: id,
            });
        }
        Ok(())
    }

    /// The current load of a rank.
    pub fn load(&self, rank: WorkerRank) -> RankLoad {
        self.ledger.load(rank)
    }

    /// Checks the invariants of every part.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.index.check_invariants()?;
        if let Some(p) = &self.predicted {
            p.check_invariants()?;
        }
        self.ledger.check_invariants()
    }
}

#[cfg(test)]
mod cost_tests;
#[cfg(test)]
mod effects_tests;
#[cfg(test)]
mod replica_tests;
#[cfg(test)]
mod rl_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod update_tests;
