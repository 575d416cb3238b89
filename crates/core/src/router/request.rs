//! What goes into a routing decision and what comes out.

use crate::hashing::BlockHashes;
use crate::ids::{RequestId, WorkerId, WorkerRank};
use crate::index::TierOverlap;
use crate::policy::{CandidateScore, RouterMode};
use crate::time::Time;
use serde::{Deserialize, Serialize};

/// A worker as the router sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// Its id.
    pub id: WorkerId,
    /// Number of data-parallel ranks (1 to [`MAX_DP_SIZE`]).
    pub dp_size: u32,
    /// The engine's token budget per step, for the prefill busy fraction.
    pub max_num_batched_tokens: Option<u64>,
    /// KV capacity in blocks per rank, for the decode busy fraction.
    pub kv_capacity_blocks: Option<u64>,
    /// The policy (weight) version it serves (RL); 0 when nobody says.
    #[serde(default)]
    pub policy_version: u64,
    /// Whether its KV events reach the router. A worker whose do not (no event endpoint) has
    /// its cache predicted from what is routed to it, as every worker is with
    /// `router_kv_events` off (blocks kept `router_ttl_secs`), instead of being seen as empty.
    #[serde(default = "events_by_default")]
    pub kv_events: bool,
}

fn events_by_default() -> bool {
    true
}

impl WorkerSpec {
    /// A single-rank worker with unknown limits.
    pub fn new(id: WorkerId) -> Self {
        Self {
            id,
            dp_size: 1,
            max_num_batched_tokens: None,
            kv_capacity_blocks: None,
            policy_version: 0,
            kv_events: true,
        }
    }
}

/// A request pinned to a worker (and optionally one of its ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// The worker.
    pub worker: WorkerId,
    /// The rank, or any rank of the worker.
    pub dp_rank: Option<u32>,
}

/// The policy versions a request accepts (every stated bound must hold).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRequirement {
    /// Exactly this version.
    pub exact: Option<u64>,
    /// This version or newer.
    pub min: Option<u64>,
    /// At most this many versions behind the newest registered worker.
    pub max_staleness: Option<u64>,
}

impl VersionRequirement {
    /// Whether no bound is stated.
    pub fn is_any(&self) -> bool {
        *self == Self::default()
    }

    /// Whether a worker at `version` qualifies when the newest registered version is `newest`.
    pub fn accepts(&self, version: u64, newest: u64) -> bool {
        self.exact.is_none_or(|v| version == v)
            && self.min.is_none_or(|v| version >= v)
            && self
                .max_staleness
                .is_none_or(|s| version.saturating_add(s) >= newest)
    }
}

/// A request to place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// Unique while active.
    pub id: RequestId,
    /// Prompt length in tokens.
    pub isl_tokens: u64,
    /// Hashes of the prompt's full blocks, in the request's namespace.
    pub blocks: BlockHashes,
    /// Where the request must go (required in `direct` mode, honoured in every mode).
    pub pin: Option<Pin>,
    /// Only these workers may serve it.
    pub allowed_workers: Option<Vec<WorkerId>>,
    /// Priority (0 = normal, higher goes first in the router queue); bounded by
    /// [`MAX_PRIORITY`].
    pub priority: u8,
    /// The request leaves the router queue with [`RouteError::DeadlineExceeded`] if it cannot
    /// start by then.
    pub deadline: Option<Time>,
    /// The session it belongs to, for affinity (a hash of the session header).
    pub session: Option<u64>,
    /// The RL group it belongs to (samples sharing a prompt), for group placement.
    #[serde(default)]
    pub group: Option<u64>,
    /// Samples in its group (M), when known: placement splits a group whose decode load would
    /// exceed a worker's fair share, and the `group-tail` queue policy counts what is left.
    #[serde(default)]
    pub group_size: Option<u32>,
    /// Samples of the group that are enough (N of M): once N finished, the rest may be ended.
    #[serde(default)]
    pub group_need: Option<u32>,
    /// Policy versions it accepts; with none eligible it waits in the router queue.
    #[serde(default)]
    pub policy: VersionRequirement,
    /// The most output tokens it may produce (`max_tokens`), when the client said. A request
    /// that may produce at most one (a readiness probe, a prefill-only cache warm-up) is not
    /// a sample of output lengths: the `cost` policy does not learn from it.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
}

/// The highest request priority.
pub const MAX_PRIORITY: u8 = 9;

/// The most data-parallel ranks one worker may have. Every rank costs the router a slot in its
/// rank table and the host a KV event subscriber, so the core refuses more rather than trusting
/// the host to have checked.
pub const MAX_DP_SIZE: u32 = 1024;

impl RouteRequest {
    /// A request with no pin or restriction.
    pub fn new(id: RequestId, isl_tokens: u64, blocks: BlockHashes) -> Self {
        Self {
            id,
            isl_tokens,
            blocks,
            pin: None,
            allowed_workers: None,
            priority: 0,
            deadline: None,
            session: None,
            group: None,
            group_size: None,
            group_need: None,
            policy: VersionRequirement::default(),
            max_output_tokens: None,
        }
    }

    /// Blocks the prompt occupies: its full blocks plus a partial one.
    pub fn request_blocks(&self, block_size: usize) -> u64 {
        self.isl_tokens
            .div_ceil(block_size.max(1) as u64)
            .max(self.blocks.len() as u64)
    }
}

/// Where a request goes, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The request.
    pub request: RequestId,
    /// The chosen rank.
    pub rank: WorkerRank,
    /// The policy that chose.
    pub mode: RouterMode,
    /// The chosen rank's overlap with the prompt.
    pub overlap: TierOverlap,
    /// Prompt tokens expected from the chosen rank's GPU cache, or held there by its active
    /// requests (an engine computes a shared prefix in flight once).
    pub cached_tokens: u64,
    /// Every eligible candidate's score (the KV cost breakdown, whatever the mode; in `cost`
    /// mode `total` is the policy's expected seconds).
    pub candidates: Vec<CandidateScore>,
    /// The policy version of the chosen worker.
    pub policy_version: u64,
}

/// Why a request could not be placed. Says whose fault it is and whether retrying helps.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No worker is registered (or none is allowed for this request).
    #[error("no workers available")]
    NoWorkers,
    /// Every eligible rank is over a busy threshold; retry later.
    #[error("all eligible workers are overloaded")]
    AllEligibleWorkersOverloaded,
    /// The request names a worker the router does not know.
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerId),
    /// The request names a rank the worker does not have.
    #[error("unknown worker rank {0}")]
    UnknownRank(WorkerRank),
    /// `direct` mode and the request names no worker.
    #[error("direct routing needs a target worker")]
    MissingTarget,
    /// A request id that is already active.
    #[error("request {0} is already active")]
    DuplicateRequest(RequestId),
    /// A request id that is not active.
    #[error("request {0} is not active")]
    UnknownRequest(RequestId),
    /// A worker id that is already registered.
    #[error("worker {0} is already registered")]
    DuplicateWorker(WorkerId),
    /// A worker registration with impossible values.
    #[error("worker {0}: {1}")]
    InvalidWorker(WorkerId, &'static str),
    /// The router queue is at its bound; retry later.
    #[error("the router queue is full ({requests} requests, {tokens} prompt tokens waiting)")]
    QueueFull {
        /// Requests waiting.
        requests: usize,
        /// Prompt tokens waiting.
        tokens: u64,
    },
    /// The request alone holds more prompt tokens than the router queue takes
    /// (`router_queue_max_tokens`): it cannot wait, and is placed only when a worker can take
    /// it at once; retry later.
    #[error("the request's {tokens} prompt tokens are more than the router queue holds ({max}, --router-queue-max-tokens): it cannot wait and starts only when a worker can take it at once")]
    OverQueueBound {
        /// The request's prompt tokens.
        tokens: u64,
        /// The queue's bound.
        max: u64,
    },
    /// The request could not start before its deadline.
    #[error("the request could not start before its deadline")]
    DeadlineExceeded,
    /// The request waited the longest the router queue allows (`--router-queue-max-wait-secs`)
    /// and still could not be placed.
    #[error("waited {waited_ms} ms in the router queue (--router-queue-max-wait-secs) for: {waiting_for}")]
    QueueWaitExceeded {
        /// How long it waited.
        waited_ms: u64,
        /// What kept it waiting at the end.
        waiting_for: String,
    },
    /// No eligible worker serves a policy version the request accepts (it waits in the router
    /// queue; this is the answer when it cannot wait).
    #[error("no eligible worker serves an accepted policy version")]
    NoCompatibleVersion,
    /// Every eligible worker is paused or loading new weights (it waits in the router queue;
    /// this is the answer when it cannot wait).
    #[error("every eligible worker is paused or updating its weights")]
    WorkersPaused,
}

impl RouteError {
    /// Whether the client caused it (a bad target or id), as opposed to capacity or state.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            RouteError::UnknownWorker(_)
                | RouteError::UnknownRank(_)
                | RouteError::MissingTarget
                | RouteError::DuplicateRequest(_)
                | RouteError::UnknownRequest(_)
                | RouteError::DuplicateWorker(_)
                | RouteError::InvalidWorker(..)
        )
    }

    /// Whether the request waits in the router queue for this to change (a worker of an accepted
    /// version, or a paused worker coming back) rather than failing.
    pub fn waits(&self) -> bool {
        matches!(
            self,
            RouteError::NoCompatibleVersion | RouteError::WorkersPaused
        )
    }

    /// Whether the same request may succeed later or elsewhere.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RouteError::NoWorkers | RouteError::AllEligibleWorkersOverloaded
        )
    }
}
