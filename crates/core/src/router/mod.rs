//! The `Router` façade: workers, the prefix index, predicted placements, the load ledger and the
//! selection policy behind plain methods. Events in, decisions out, `now` passed in.
//!
//! Layout: `config.rs` (the validated option tree), `request.rs` (requests, decisions, errors),
//! `admission.rs` (the router queue: `submit`, `poll`), `effects.rs` (finish and cancel, and the
//! [`Effects`] they return: placements and update actions), `rl.rs` (pauses, policy versions, group
//! placement, first-N-of-M), `update.rs` (the weight-update cycle), `replica.rs` and
//! `remote_event.rs` (what router replicas share: remote events in, outgoing events out),
//! `membership.rs` (adding, removing and pausing workers), `route.rs` (placement: filters, allowed
//! ranks, the pick), this file (the façade: state, events, sessions, first token).

pub mod admission;
mod cluster;
mod config;
mod cost;
mod effects;
mod membership;
mod profiles;
mod remote_event;
mod replica;
mod request;
mod rl;
mod route;
mod unread;
mod update;

pub use admission::{Admission, QueuePolicy, QueueStats};
pub use config::{
    ConfigError, KvRetention, RouterConfig, DEFAULT_INDEX_MAX_BLOCKS_PER_WORKER,
    DEFAULT_QUEUE_MAX_REQUESTS, DEFAULT_QUEUE_MAX_WAIT_SECS, MAX_BLOCK_SIZE_TOKENS,
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
use crate::index::{IndexError, OverlapScores, PrefixIndex};
use crate::ledger::{LoadLedger, RankLoad};
use crate::policy::RouterMode;
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
    /// Bindings held when expired ones are next swept out ([`Router::bind_session`]).
    sessions_sweep_at: usize,
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

/// The fewest session bindings at which expired ones are swept out.
const SESSIONS_SWEEP_MIN: usize = 4096;

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
            sessions_sweep_at: SESSIONS_SWEEP_MIN,
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

    /// Moves the router's latest time to `now` when that is later, and returns it. Predictions
    /// (and KV events) are stamped with it, not with a caller's `now`: a caller that read its
    /// clock before it waited for the lock must not make a block expire before blocks inserted
    /// after it (the predicted index relies on parents outliving children).
    pub(super) fn advance_to(&mut self, now: Time) -> Time {
        self.last_now = self.last_now.max(now);
        self.last_now
    }

    /// Records that `rank` will hold `blocks`, when the router predicts its worker's cache.
    pub(super) fn record_prediction(
        &mut self,
        rank: WorkerRank,
        blocks: &crate::hashing::BlockHashes,
    ) {
        if self.predicts(rank.worker) {
            if let Some(p) = &mut self.predicted {
                p.insert(rank, blocks, self.last_now);
            }
        }
    }

    /// Whether what is routed to `worker` is recorded as its predicted cache: for every worker
    /// without KV events (`router_kv_events` off), for every worker for a while
    /// (`router_predicted_ttl_secs`), and for a worker whose events do not reach the router.
    pub fn predicts(&self, worker: WorkerId) -> bool {
        !self.config.router_kv_events
            || self.config.router_predicted_ttl_secs.is_some()
            || self.workers.get(&worker).is_some_and(|w| !w.kv_events)
    }

    /// Blocks the router predicts each rank holds (workers whose cache it predicts), within
    /// their time-to-live as of the latest time a routing call passed in; O(entries).
    pub fn predicted_blocks(&self) -> Vec<(WorkerRank, usize)> {
        let mut out: Vec<(WorkerRank, usize)> = self
            .predicted
            .as_ref()
            .map(|p| p.live_counts(self.last_now).into_iter().collect())
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// The overlap of every rank with a prompt: event-fed, predicted, or the larger of both
    /// (predictions are only recorded where [`Router::predicts`]).
    pub fn overlaps(&self, request: &RouteRequest) -> OverlapScores {
        let query = &request.blocks.sequence;
        match (&self.predicted, self.config.router_kv_events) {
            (Some(p), false) => p.find_matches(query, self.last_now),
            (Some(p), true) => self
                .index
                .find_matches(query)
                .max_with(&p.find_matches(query, self.last_now)),
            (None, _) => self.index.find_matches(query),
        }
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

    /// Binds `session` to `rank` until `until`. Expired bindings are swept out whenever the
    /// table has doubled since the last sweep (at least [`SESSIONS_SWEEP_MIN`]), so it holds
    /// at most about twice the live bindings at an amortized constant cost per binding: a
    /// router that no one asks to sweep (`serve`) kept every session it ever saw (found by a
    /// probe).
    pub(super) fn bind_session(&mut self, session: u64, rank: WorkerRank, until: Time, now: Time) {
        self.sessions.insert(session, (rank, until));
        if self.sessions.len() >= self.sessions_sweep_at {
            self.expire_sessions(now);
            self.sessions_sweep_at = (self.sessions.len() * 2).max(SESSIONS_SWEEP_MIN);
        }
    }

    /// Up to `max` live session bindings at `now`: each session, its rank and the milliseconds
    /// left of its binding (what a replica writes back into a shared store that lost them).
    pub fn session_bindings(&self, now: Time, max: usize) -> Vec<(u64, WorkerRank, u64)> {
        self.sessions
            .iter()
            .filter(|(_, (_, expires))| *expires > now)
            .take(max)
            .map(|(s, (rank, expires))| (*s, *rank, expires.since(now).as_millis() as u64))
            .collect()
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
mod burst_tests;
#[cfg(test)]
mod cost_session_tests;
#[cfg(test)]
mod cost_tests;
#[cfg(test)]
mod effects_tests;
#[cfg(test)]
mod predicted_tests;
#[cfg(test)]
mod queue_tests;
#[cfg(test)]
mod replica_tests;
#[cfg(test)]
mod rl_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod update_tests;
