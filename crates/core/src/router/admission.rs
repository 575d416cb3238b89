//! The router queue: admission decides *when* a request is placed, selection decides *where*.
//!
//! While every eligible rank is over the queue threshold (active prefill tokens above
//! `router_queue_threshold` × its `max_num_batched_tokens`), requests wait here; when capacity
//! frees they are routed with fresh load and cache state. Order:
//! - `fcfs`: by arrival, earlier by one second per priority level (a priority jump);
//! - `wspt`: weighted shortest processing time, largest (1 + priority) / uncached prompt tokens
//!   first, with the uncached tokens measured against the best eligible rank at dequeue time;
//! - `priority`: strict priority tiers, then arrival.
//!
//! Requests whose deadline passes leave with `DeadlineExceeded`.

use crate::ids::RequestId;
use crate::router::RouteRequest;
use crate::time::Time;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Order of the router queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueuePolicy {
    /// First come, first served (with a priority jump).
    #[default]
    Fcfs,
    /// Weighted shortest processing time.
    Wspt,
    /// Strict priority tiers, then first come, first served.
    Priority,
    /// RL straggler-first: requests of the groups with the fewest samples left to finish (the
    /// ones a step waits on) go first; then first come, first served.
    GroupTail,
}

impl QueuePolicy {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueuePolicy::Fcfs => "fcfs",
            QueuePolicy::Wspt => "wspt",
            QueuePolicy::Priority => "priority",
            QueuePolicy::GroupTail => "group-tail",
        }
    }
}

impl fmt::Display for QueuePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown queue policy name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown queue policy {0:?} (expected fcfs, wspt, priority or group-tail)")]
pub struct UnknownQueuePolicy(pub String);

impl FromStr for QueuePolicy {
    type Err = UnknownQueuePolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            QueuePolicy::Fcfs,
            QueuePolicy::Wspt,
            QueuePolicy::Priority,
            QueuePolicy::GroupTail,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| UnknownQueuePolicy(s.to_owned()))
    }
}

/// What happened to a submitted request.
#[derive(Clone, Debug, PartialEq)]
pub enum Admission {
    /// Placed now.
    Dispatched(crate::router::Decision),
    /// Waiting in the router queue; `poll` places it later.
    Queued,
}

/// Sizes of the queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueStats {
    /// Requests waiting.
    pub pending_requests: usize,
    /// Their prompt tokens.
    pub pending_isl_tokens: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct Queued {
    pub(crate) request: RouteRequest,
    pub(crate) arrival: Time,
    seq: u64,
}

/// The waiting requests. Small and scanned linearly at dequeue (it is bounded).
#[derive(Clone, Debug, Default)]
pub(crate) struct AdmissionQueue {
    entries: Vec<Queued>,
    tokens: u64,
    next_seq: u64,
}

impl AdmissionQueue {
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub(crate) fn stats(&self) -> QueueStats {
        QueueStats {
            pending_requests: self.entries.len(),
            pending_isl_tokens: self.tokens,
        }
    }

    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.entries.iter().any(|e| e.request.id == id)
    }

    pub(crate) fn push(&mut self, request: RouteRequest, arrival: Time) {
        self.tokens += request.isl_tokens;
        self.entries.push(Queued {
            request,
            arrival,
            seq: self.next_seq,
        });
        self.next_seq += 1;
    }

    /// Puts back a request taken out by `remove`, keeping its place in the order.
    pub(crate) fn push_front(&mut self, entry: Queued) {
        self.tokens += entry.request.isl_tokens;
        // Entries stay in submission order (expiry reports them in that order).
        let at = self.entries.partition_point(|e| e.seq < entry.seq);
        self.entries.insert(at, entry);
    }

    pub(crate) fn remove(&mut self, id: RequestId) -> Option<Queued> {
        let i = self.entries.iter().position(|e| e.request.id == id)?;
        let e = self.entries.remove(i);
        self.tokens -= e.request.isl_tokens;
        Some(e)
    }

    /// Removes and returns every request whose deadline is at or before `now`.
    pub(crate) fn expire(&mut self, now: Time) -> Vec<Queued> {
        let (gone, keep): (Vec<Queued>, Vec<Queued>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.request.deadline.is_some_and(|d| d <= now));
        self.entries = keep;
        self.tokens = self.entries.iter().map(|e| e.request.isl_tokens).sum();
        gone
    }

    /// The earliest deadline.
    pub(crate) fn next_deadline(&self) -> Option<Time> {
        self.entries.iter().filter_map(|e| e.request.deadline).min()
    }

    /// The request to place next; `uncached` gives a request's uncached prompt tokens now,
    /// `group_left` the samples its group still has to finish.
    pub(crate) fn best(
        &self,
        policy: QueuePolicy,
        mut uncached: impl FnMut(&RouteRequest) -> u64,
        group_left: impl Fn(&RouteRequest) -> Option<u32>,
    ) -> Option<RequestId> {
        let fcfs_key = |e: &Queued| {
            let jump = i64::from(e.request.priority) * 1_000_000;
            (e.arrival.as_micros() as i64 - jump, e.seq)
        };
        let best = match policy {
            QueuePolicy::Fcfs => self.entries.iter().min_by_key(|e| fcfs_key(e)),
            QueuePolicy::Priority => self
                .entries
                .iter()
                .min_by_key(|e| (std::cmp::Reverse(e.request.priority), e.arrival, e.seq)),
            QueuePolicy::GroupTail => self
                .entries
                .iter()
                .min_by_key(|e| (group_left(&e.request).unwrap_or(u32::MAX), fcfs_key(e))),
            QueuePolicy::Wspt => {
                let mut best: Option<(f64, u64, &Queued)> = None;
                for e in &self.entries {
                    let score =
                        (1.0 + f64::from(e.request.priority)) / uncached(&e.request).max(1) as f64;
                    let better = match best {
                        None => true,
                        Some((s, seq, _)) => score > s || (score == s && e.seq < seq),
                    };
                    if better {
                        best = Some((score, e.seq, e));
                    }
                }
                best.map(|(_, _, e)| e)
            }
        };
        best.map(|e| e.request.id)
    }
}
