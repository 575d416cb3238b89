//! Router replicas: several routers that form one logical router share what one of them cannot
//! see by itself (every replica reads the engines' KV events on its own). A replica with sync on
//! queues a [`RemoteEvent`] for each change to shared state it makes (a request begun, past its
//! first token, finished; a predicted placement; a session binding; a group placement; a policy
//! version; the workers its weight update holds out), and the host takes them with
//! [`Router::take_outgoing`] and carries them to the other replicas, which feed them to
//! [`Router::apply_remote`]. The transport is the host's; the core never waits for it.
//!
//! Remote requests sit in the same load ledger as local ones, under ids of their own (the upper
//! half of the id space, see [`REMOTE_ID_BASE`]), keyed by (replica, request id). A replica's
//! periodic [`RemoteEvent::Active`] lists its active requests, so a lost finish is repaired at
//! the next one; [`RemoteEvent::ReplicaExpired`] (the host saw no heartbeat for its TTL) drops
//! everything the replica put on the others: its load and the workers its update held out.

pub use super::remote_event::{ActiveRequest, RemoteError, RemoteEvent};
use super::{Effects, RouteRequest, Router};
use crate::ids::{ReplicaId, RequestId, WorkerId, WorkerRank};
use crate::ledger::{Phase, RequestLoad};
use crate::time::Time;
use std::collections::{BTreeMap, BTreeSet};

/// Local request ids stay below this; remote requests get ids from here up.
pub const REMOTE_ID_BASE: u64 = 1 << 63;

/// Requests one heartbeat lists by default (see [`Router::set_active_list_max`]).
pub const DEFAULT_ACTIVE_LIST_MAX: usize = 4096;

/// What the replicas share, as one router sees it.
#[derive(Debug, Default)]
pub(super) struct Replicas {
    /// This router's id and outgoing events, when sync is on.
    own: Option<Outbox>,
    /// Remote requests: (owner, its id) → the ledger id here.
    remote: BTreeMap<(ReplicaId, RequestId), RequestId>,
    next_remote: u64,
    /// Workers each replica's weight update holds out.
    held: BTreeMap<ReplicaId, BTreeSet<WorkerId>>,
}

#[derive(Debug)]
struct Outbox {
    id: ReplicaId,
    events: Vec<RemoteEvent>,
    max_events: usize,
    dropped: u64,
    /// Requests one active list holds at most.
    active_max: usize,
    /// Where the next active list starts (past the previous one's range).
    active_cursor: RequestId,
}

impl Replicas {
    /// Whether some replica's update holds `worker` out.
    pub(super) fn holds(&self, worker: WorkerId) -> bool {
        self.held.values().any(|ws| ws.contains(&worker))
    }

    /// Queues `event`. Full, a lasting change takes the place of the oldest load event (the
    /// heartbeats repair load; nothing repairs a lost pause before the replica joins); any other
    /// event, or one that finds no load event to replace, is dropped and counted.
    fn push(&mut self, event: RemoteEvent) {
        let Some(o) = &mut self.own else {
            return;
        };
        if o.events.len() < o.max_events {
            o.events.push(event);
            return;
        }
        o.dropped += 1;
        if event.is_lasting() {
            if let Some(oldest) = o.events.iter().position(|e| !e.is_lasting()) {
                o.events.remove(oldest);
                o.events.push(event);
            }
        }
    }

    fn syncing(&self) -> bool {
        self.own.is_some()
    }
}

impl Router {
    /// Turns replica sync on: this router is `id`, and from now on every change to shared state
    /// queues a [`RemoteEvent`] for [`Router::take_outgoing`]. At most `max_events` wait; more
    /// are dropped (counted; the next [`Router::replica_active`] repairs lost load).
    pub fn enable_replica_sync(&mut self, id: ReplicaId, max_events: usize) {
        self.replicas.own = Some(Outbox {
            id,
            events: Vec::new(),
            max_events: max_events.max(1),
            dropped: 0,
            active_max: DEFAULT_ACTIVE_LIST_MAX,
            active_cursor: RequestId(0),
        });
    }

    /// Bounds the requests one active list holds (default [`DEFAULT_ACTIVE_LIST_MAX`]): with
    /// more active, each list covers the next range of ids and the lists go round them.
    pub fn set_active_list_max(&mut self, max: usize) {
        if let Some(o) = &mut self.replicas.own {
            o.active_max = max.max(1);
        }
    }

    /// This router's replica id, when sync is on.
    pub fn replica_id(&self) -> Option<ReplicaId> {
        self.replicas.own.as_ref().map(|o| o.id)
    }

    /// Takes the events queued for the other replicas, oldest first.
    pub fn take_outgoing(&mut self) -> Vec<RemoteEvent> {
        self.replicas
            .own
            .as_mut()
            .map(|o| std::mem::take(&mut o.events))
            .unwrap_or_default()
    }

    /// Whether events wait in the outbox.
    pub fn has_outgoing(&self) -> bool {
        self.replicas
            .own
            .as_ref()
            .is_some_and(|o| !o.events.is_empty())
    }

    /// Events dropped because the outbox was full.
    pub fn outgoing_dropped(&self) -> u64 {
        self.replicas.own.as_ref().map_or(0, |o| o.dropped)
    }

    /// Queues the list of this replica's active requests (send it with each heartbeat): all of
    /// them when they fit in one list, else the next range of ids (see
    /// [`Router::set_active_list_max`]).
    pub fn replica_active(&mut self) {
        let Some(o) = &self.replicas.own else {
            return;
        };
        let (replica, max, cursor) = (o.id, o.active_max, o.active_cursor);
        let ids = self.ledger.active_ids();
        let local = &ids[..ids.partition_point(|id| id.0 < REMOTE_ID_BASE)];
        let rest = &local[local.partition_point(|id| *id < cursor)..];
        let (listed, to) = if rest.len() > max {
            (&rest[..max], Some(rest[max]))
        } else {
            (rest, None)
        };
        let requests = listed
            .iter()
            .filter_map(|id| {
                let load = self.ledger.request_load(*id)?;
                let (_, phase) = self.ledger.get(*id)?;
                Some(ActiveRequest {
                    request: *id,
                    rank: load.rank,
                    prefill_tokens: load.prefill_tokens,
                    blocks: load.chain_blocks + load.private_blocks,
                    decoding: phase == Phase::Decode,
                })
            })
            .collect();
        if let Some(o) = &mut self.replicas.own {
            o.active_cursor = to.unwrap_or(RequestId(0));
        }
        self.replicas.push(RemoteEvent::Active {
            replica,
            requests,
            from: cursor,
            to,
        });
    }

    /// Whether another replica's weight update holds `worker` out.
    pub fn held_elsewhere(&self, worker: WorkerId) -> bool {
        self.replicas.holds(worker)
    }

    /// Workers replica `replica`'s weight update holds out here.
    pub fn held_by(&self, replica: ReplicaId) -> Vec<WorkerId> {
        self.replicas
            .held
            .get(&replica)
            .map(|ws| ws.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Remote requests active here, per owning replica.
    pub fn remote_requests(&self) -> BTreeMap<ReplicaId, usize> {
        let mut out = BTreeMap::new();
        for (replica, _) in self.replicas.remote.keys() {
            *out.entry(*replica).or_insert(0) += 1;
        }
        out
    }

    /// Queues an event when sync is on.
    pub(super) fn announce(&mut self, event: impl FnOnce(ReplicaId) -> RemoteEvent) {
        if let Some(id) = self.replica_id() {
            self.replicas.push(event(id));
        }
    }

    /// A local request was placed on `rank`: its load, predicted placement, session binding
    /// and group placement go out.
    pub(super) fn announce_route(&mut self, request: &RouteRequest, rank: WorkerRank) {
        if !self.replicas.syncing() {
            return;
        }
        if let Some(load) = self.ledger.request_load(request.id) {
            // The ledger's chain is the request's full blocks.
            let blocks = request.blocks.sequence.clone();
            self.announce(|replica| RemoteEvent::Begin {
                replica,
                request: request.id,
                rank,
                prefill_tokens: load.prefill_tokens,
                blocks,
                private_blocks: load.private_blocks,
            });
        }
        if self.predicted.is_some()
            && self.predicts(rank.worker)
            && !request.blocks.sequence.is_empty()
        {
            let blocks = request.blocks.clone();
            self.announce(|_| RemoteEvent::Placement { rank, blocks });
        }
        if let (Some(session), Some(ttl)) = (
            request.session,
            self.config.router_session_affinity_ttl_secs,
        ) {
            let ttl_ms = (ttl * 1000.0) as u64;
            self.announce(|_| RemoteEvent::Session {
                session,
                rank,
                ttl_ms,
            });
        }
        if let (true, Some(group)) = (self.group_placed(request), request.group) {
            self.announce(|_| RemoteEvent::Group { group, rank });
        }
    }

    /// The workers this router's running update holds out went out (call after the cycle
    /// changed; the host does so as it drives it).
    pub fn announce_update_held(&mut self) {
        let workers: Vec<WorkerId> = self
            .workers
            .keys()
            .copied()
            .filter(|w| self.updating(*w))
            .collect();
        self.announce(|replica| RemoteEvent::UpdateHeld { replica, workers });
    }

    /// Applies another replica's event at `now`. Releases of load return what they set in
    /// motion, as [`Router::finish`] does.
    pub fn apply_remote(&mut self, event: RemoteEvent, now: Time) -> Result<Effects, RemoteError> {
        if let Some(own) = self.replica_id() {
            let from = match &event {
                RemoteEvent::Begin { replica, .. }
                | RemoteEvent::FirstToken { replica, .. }
                | RemoteEvent::Finish { replica, .. }
                | RemoteEvent::Active { replica, .. }
                | RemoteEvent::UpdateHeld { replica, .. }
                | RemoteEvent::ReplicaExpired { replica } => Some(*replica),
                _ => None,
            };
            if from == Some(own) {
                return Err(RemoteError::OwnEvent(own));
            }
        }
        match event {
            RemoteEvent::Begin {
                replica,
                request,
                rank,
                prefill_tokens,
                blocks,
                private_blocks,
            } => {
                self.known_rank(rank)?;
                if self.replicas.remote.contains_key(&(replica, request)) {
                    return Err(RemoteError::DuplicateRequest(replica, request));
                }
                let id = RequestId(REMOTE_ID_BASE + self.replicas.next_remote);
                self.replicas.next_remote = (self.replicas.next_remote + 1) % REMOTE_ID_BASE;
                let load = RequestLoad {
                    rank,
                    prefill_tokens,
                    blocks,
                    private_blocks,
                };
                self.ledger
                    .begin(id, load)
                    .map_err(|_| RemoteError::DuplicateRequest(replica, request))?;
                self.replicas.remote.insert((replica, request), id);
                Ok(Effects::default())
            }
            RemoteEvent::FirstToken { replica, request } => {
                let id = self.remote_id(replica, request)?;
                self.ledger
                    .first_token(id)
                    .map_err(|_| RemoteError::UnknownRequest(replica, request))?;
                Ok(Effects {
                    placed: self.poll(now),
                    update: Vec::new(),
                })
            }
            RemoteEvent::Finish { replica, request } => {
                let id = self.remote_id(replica, request)?;
                self.replicas.remote.remove(&(replica, request));
                let _ = self.ledger.release(id);
                Ok(self.released(now))
            }
            RemoteEvent::Active {
                replica,
                requests,
                from,
                to,
            } => Ok(self.apply_active(replica, requests, from, to, now)),
            RemoteEvent::ReplicaExpired { replica } => {
                let gone: Vec<RequestId> = self.remote_of(replica).map(|(r, _)| r).collect();
                let had_held = self.replicas.held.remove(&replica).is_some();
                let mut effects = self.drop_remote(replica, &gone, now);
                if had_held && gone.is_empty() {
                    effects.placed.extend(self.poll(now));
                }
                Ok(effects)
            }
            RemoteEvent::Placement { rank, blocks } => {
                self.known_rank(rank)?;
                self.advance_to(now);
                self.record_prediction(rank, &blocks);
                Ok(Effects::default())
            }
            RemoteEvent::Session {
                session,
                rank,
                ttl_ms,
            } => {
                self.known_rank(rank)?;
                let until = now + std::time::Duration::from_millis(ttl_ms);
                self.bind_session(session, rank, until, now);
                Ok(Effects::default())
            }
            RemoteEvent::SessionReleased { session } => {
                self.sessions.remove(&session);
                Ok(Effects::default())
            }
            RemoteEvent::Group { group, rank } => {
                self.known_rank(rank)?;
                self.record_group(group, rank, None, now);
                Ok(Effects::default())
            }
            RemoteEvent::Version { worker, version } => {
                self.known_rank(WorkerRank::new(worker, 0))?;
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.policy_version = version;
                }
                Ok(Effects {
                    placed: self.poll(now),
                    update: Vec::new(),
                })
            }
            RemoteEvent::Paused { worker, paused } => {
                self.known_rank(WorkerRank::new(worker, 0))?;
                // Another replica's operator (or update cycle) owns the pause now.
                self.paused_by_update.remove(&worker);
                if paused {
                    self.paused.insert(worker);
                } else {
                    self.paused.remove(&worker);
                }
                Ok(Effects {
                    placed: self.poll(now),
                    update: Vec::new(),
                })
            }
            RemoteEvent::UpdateHeld { replica, workers } => {
                if workers.is_empty() {
                    self.replicas.held.remove(&replica);
                } else {
                    self.replicas
                        .held
                        .insert(replica, workers.into_iter().collect());
                }
                Ok(Effects {
                    placed: self.poll(now),
                    update: Vec::new(),
                })
            }
        }
    }

    /// A heartbeat's active list: drops the replica's requests in `from..to` it does not list,
    /// recreates those it lists that are missing here, and moves to decode those it lists as
    /// past their first token.
    fn apply_active(
        &mut self,
        replica: ReplicaId,
        requests: Vec<ActiveRequest>,
        from: RequestId,
        to: Option<RequestId>,
        now: Time,
    ) -> Effects {
        let keep: BTreeSet<RequestId> = requests.iter().map(|a| a.request).collect();
        let in_range = |r: RequestId| r >= from && to.is_none_or(|t| r < t);
        let gone: Vec<RequestId> = self
            .remote_of(replica)
            .filter(|(r, _)| in_range(*r) && !keep.contains(r))
            .map(|(r, _)| r)
            .collect();
        let mut effects = self.drop_remote(replica, &gone, now);
        let mut moved = false;
        for a in requests.into_iter().filter(|a| in_range(a.request)) {
            if !self.replicas.remote.contains_key(&(replica, a.request)) {
                // A lost begin: its load, as the heartbeat describes it. Its blocks count as
                // its own (their hashes do not travel in heartbeats).
                let begin = RemoteEvent::Begin {
                    replica,
                    request: a.request,
                    rank: a.rank,
                    prefill_tokens: a.prefill_tokens,
                    blocks: Vec::new(),
                    private_blocks: a.blocks,
                };
                if self.apply_remote(begin, now).is_err() {
                    continue;
                }
            }
            let Ok(id) = self.remote_id(replica, a.request) else {
                continue;
            };
            if a.decoding && matches!(self.ledger.get(id), Some((_, Phase::Prefill))) {
                moved |= self.ledger.first_token(id).is_ok();
            }
        }
        if moved {
            effects.placed.extend(self.poll(now));
        }
        effects
    }

    fn known_rank(&self, rank: WorkerRank) -> Result<(), RemoteError> {
        match self.workers.get(&rank.worker) {
            Some(w) if rank.dp_rank < w.dp_size => Ok(()),
            _ => Err(RemoteError::UnknownRank(rank)),
        }
    }

    fn remote_id(&self, replica: ReplicaId, request: RequestId) -> Result<RequestId, RemoteError> {
        self.replicas
            .remote
            .get(&(replica, request))
            .copied()
            .ok_or(RemoteError::UnknownRequest(replica, request))
    }

    /// The replica's requests known here: (its id, the ledger id).
    fn remote_of(&self, replica: ReplicaId) -> impl Iterator<Item = (RequestId, RequestId)> + '_ {
        self.replicas
            .remote
            .range((replica, RequestId(0))..=(replica, RequestId(u64::MAX)))
            .map(|((_, r), id)| (*r, *id))
    }

    fn drop_remote(&mut self, replica: ReplicaId, requests: &[RequestId], now: Time) -> Effects {
        if requests.is_empty() {
            return Effects::default();
        }
        for r in requests {
            if let Some(id) = self.replicas.remote.remove(&(replica, *r)) {
                let _ = self.ledger.release(id);
            }
        }
        self.released(now)
    }
}
