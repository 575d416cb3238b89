//! What one router replica tells the others ([`RemoteEvent`]), and why one may not apply
//! ([`RemoteError`]). Applying them is `replica.rs`.

use crate::hashing::BlockHashes;
use crate::ids::{ReplicaId, RequestId, SequenceHash, WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};

/// A change to shared routing state, made by one replica, for the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum RemoteEvent {
    /// The replica placed a request: its load on `rank`.
    Begin {
        /// The replica that owns it.
        replica: ReplicaId,
        /// Its id at that replica.
        request: RequestId,
        /// Where it runs.
        rank: WorkerRank,
        /// Uncached prompt tokens it prefills.
        prefill_tokens: u64,
        /// Sequence hashes of its full prompt blocks.
        blocks: Vec<SequenceHash>,
        /// Blocks no other request shares.
        private_blocks: u64,
    },
    /// The request produced its first token.
    FirstToken {
        /// The owner.
        replica: ReplicaId,
        /// Its id at the owner.
        request: RequestId,
    },
    /// The request ended (finished, cancelled, failed or continued elsewhere).
    Finish {
        /// The owner.
        replica: ReplicaId,
        /// Its id at the owner.
        request: RequestId,
    },
    /// The replica's active requests with ids in `from..to` (`to` `None`: no upper end), sent
    /// with its heartbeat: the others drop those of its requests in that range not listed (a
    /// lost finish) and recreate those listed they lack (a lost begin) or still count in
    /// prefill (a lost first token). A replica with more active requests than fit in one list
    /// covers them over several heartbeats, range by range.
    Active {
        /// The owner.
        replica: ReplicaId,
        /// Its active requests in the range, by id.
        requests: Vec<ActiveRequest>,
        /// The first id the list covers.
        #[serde(default)]
        from: RequestId,
        /// The first id past the range (`None`: every id from `from` up).
        #[serde(default)]
        to: Option<RequestId>,
    },
    /// A predicted placement (predicted window or approximate mode): `rank` will hold these
    /// blocks; its TTL runs from when the receiver applies it.
    Placement {
        /// The rank.
        rank: WorkerRank,
        /// The prompt's blocks.
        blocks: BlockHashes,
    },
    /// A session is bound to `rank` for `ttl_ms` from when the receiver applies it.
    Session {
        /// The session key.
        session: u64,
        /// Its rank.
        rank: WorkerRank,
        /// Idle time left.
        ttl_ms: u64,
    },
    /// A session's binding was released.
    SessionReleased {
        /// The session key.
        session: u64,
    },
    /// A sibling of an RL group went to `rank`.
    Group {
        /// The group.
        group: u64,
        /// Its rank.
        rank: WorkerRank,
    },
    /// A worker now serves policy `version`.
    Version {
        /// The worker.
        worker: WorkerId,
        /// Its version.
        version: u64,
    },
    /// An operator paused (true) or resumed (false) a worker.
    Paused {
        /// The worker.
        worker: WorkerId,
        /// Paused or not.
        paused: bool,
    },
    /// The workers the replica's running weight update holds out of rotation now (replaces
    /// what it said before; empty when its cycle is over).
    UpdateHeld {
        /// The replica driving the update.
        replica: ReplicaId,
        /// Workers draining, loading or waiting for their batch to come back.
        workers: Vec<WorkerId>,
    },
    /// The replica is gone (no heartbeat within its TTL): drop everything it put here.
    ReplicaExpired {
        /// The replica.
        replica: ReplicaId,
    },
}

/// One active request as a heartbeat lists it: enough to recreate its load where its begin was
/// lost. Its prompt blocks travel as a count (recreated as blocks of its own, not shared with
/// other requests on the rank), which keeps heartbeats small and errs towards more load.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveRequest {
    /// Its id at the owner.
    pub request: RequestId,
    /// Where it runs.
    pub rank: WorkerRank,
    /// Uncached prompt tokens it prefills.
    pub prefill_tokens: u64,
    /// Blocks it holds (full prompt blocks and its own).
    pub blocks: u64,
    /// Past its first token.
    #[serde(default)]
    pub decoding: bool,
}

impl RemoteEvent {
    /// A change that outlasts the requests (a session binding or its release, a worker's
    /// version or pause): replicas keep it in their shared stores, and a full outbox keeps it
    /// over load events (requests begun, finished, placed), which the next heartbeat repairs.
    pub fn is_lasting(&self) -> bool {
        matches!(
            self,
            RemoteEvent::Session { .. }
                | RemoteEvent::SessionReleased { .. }
                | RemoteEvent::Version { .. }
                | RemoteEvent::Paused { .. }
        )
    }

    /// The same event with its worker ids translated from the sender's to this router's
    /// (replicas may number the same engine differently); `None` when one has no counterpart.
    pub fn map_workers(self, map: impl Fn(WorkerId) -> Option<WorkerId>) -> Option<Self> {
        let rank = |r: WorkerRank| map(r.worker).map(|w| WorkerRank::new(w, r.dp_rank));
        Some(match self {
            RemoteEvent::Begin {
                replica,
                request,
                rank: r,
                prefill_tokens,
                blocks,
                private_blocks,
            } => RemoteEvent::Begin {
                replica,
                request,
                rank: rank(r)?,
                prefill_tokens,
                blocks,
                private_blocks,
            },
            RemoteEvent::Placement { rank: r, blocks } => RemoteEvent::Placement {
                rank: rank(r)?,
                blocks,
            },
            RemoteEvent::Session {
                session,
                rank: r,
                ttl_ms,
            } => RemoteEvent::Session {
                session,
                rank: rank(r)?,
                ttl_ms,
            },
            RemoteEvent::Group { group, rank: r } => RemoteEvent::Group {
                group,
                rank: rank(r)?,
            },
            RemoteEvent::Version { worker, version } => RemoteEvent::Version {
                worker: map(worker)?,
                version,
            },
            RemoteEvent::Paused { worker, paused } => RemoteEvent::Paused {
                worker: map(worker)?,
                paused,
            },
            RemoteEvent::Active {
                replica,
                requests,
                from,
                to,
            } => RemoteEvent::Active {
                replica,
                // A request on a worker this replica does not know cannot be counted here
                // (its begin was refused too).
                requests: requests
                    .into_iter()
                    .filter_map(|a| {
                        Some(ActiveRequest {
                            rank: rank(a.rank)?,
                            ..a
                        })
                    })
                    .collect(),
                from,
                to,
            },
            RemoteEvent::UpdateHeld { replica, workers } => RemoteEvent::UpdateHeld {
                replica,
                workers: workers.into_iter().filter_map(&map).collect(),
            },
            other => other,
        })
    }
}

/// Why a remote event was not applied (the host counts these; nothing is corrupted).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    /// The event names a worker or rank this replica does not know (yet).
    #[error("unknown worker rank {0}")]
    UnknownRank(WorkerRank),
    /// A begin for a request already known.
    #[error("replica {0}: request {1} is already active")]
    DuplicateRequest(ReplicaId, RequestId),
    /// A first token or finish for a request not known (its begin was lost, or it was dropped
    /// by an `Active` list or an expiry).
    #[error("replica {0}: request {1} is not active")]
    UnknownRequest(ReplicaId, RequestId),
    /// An event that says it comes from this replica.
    #[error("event from this replica ({0})")]
    OwnEvent(ReplicaId),
}
