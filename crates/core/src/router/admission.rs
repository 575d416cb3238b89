//! The router queue: admission decides *when* a request is placed, selection decides *where*.
//!
//! While every eligible rank is over the queue threshold (active prefill tokens above
//! `router_queue_threshold` × its `max_num_batched_tokens`), requests wait here; when capacity
//! frees they are routed with fresh load and cache state. Order:
//! - `fcfs`: by arrival, earlier by one second per priority level (a priority jump);
//! - `wspt`: weighted shortest processing time, largest (1 + priority) / uncached prompt tokens
//!   first, with the uncached tokens measured against the best eligible rank at dequeue time;
//! - `priority`: strict priority tiers, then arrival;
//! - `group-tail`: RL groups with the fewest samples left first, then arrival.
//!
//! Requests waiting for a policy version or a paused worker wait here too, threshold or not.
//! Requests whose deadline passes leave with `DeadlineExceeded`; every request leaves after
//! `router_queue_max_wait_secs` at most with `QueueWaitExceeded`, naming what it waited for, so
//! a request nothing can ever place (a policy version no worker will serve) does not hang. `Router::submit` and
//! `Router::poll` (below) are the façade's side of it.

use crate::ids::RequestId;
use crate::router::{Decision, RouteError, RouteRequest, Router};
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
    /// When it leaves whatever happens (arrival + the queue's max wait).
    pub(crate) give_up: Time,
    seq: u64,
}

impl Queued {
    /// The earlier of its deadline and its give-up time.
    fn leaves_at(&self) -> Time {
        self.request
            .deadline
            .map_or(self.give_up, |d| d.min(self.give_up))
    }
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

    pub(crate) fn push(&mut self, request: RouteRequest, arrival: Time, give_up: Time) {
        self.tokens += request.isl_tokens;
        self.entries.push(Queued {
            request,
            arrival,
            give_up,
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

    /// Removes and returns every request whose deadline or give-up time is at or before `now`.
    pub(crate) fn expire(&mut self, now: Time) -> Vec<Queued> {
        let (gone, keep): (Vec<Queued>, Vec<Queued>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.leaves_at() <= now);
        self.entries = keep;
        self.tokens = self.entries.iter().map(|e| e.request.isl_tokens).sum();
        gone
    }

    /// The earliest deadline or give-up time.
    pub(crate) fn next_deadline(&self) -> Option<Time> {
        self.entries.iter().map(Queued::leaves_at).min()
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

impl Router {
    /// Whether every rank `request` may use is over the queue threshold.
    fn queue_busy(&self, request: &RouteRequest) -> bool {
        let Some(threshold) = self.config.router_queue_threshold else {
            return false;
        };
        let Ok(ranks) = self.allowed_ranks(request, self.config.router_mode) else {
            return false;
        };
        ranks.iter().all(|r| {
            let max = self.workers[&r.worker].max_num_batched_tokens;
            max.is_some_and(|m| {
                self.ledger.load(*r).active_prefill_tokens as f64 > threshold * m as f64
            })
        })
    }

    /// Admission: places `request` now, or queues it while every eligible rank is over the queue
    /// threshold (a new arrival never overtakes a backlog). Without a queue threshold this is
    /// [`Router::route`].
    pub fn submit(&mut self, request: RouteRequest, now: Time) -> Result<Admission, RouteError> {
        if self.ledger.is_active(request.id) || self.queue.contains(request.id) {
            return Err(RouteError::DuplicateRequest(request.id));
        }
        self.note_group(&request, now);
        // A request whose policy version no eligible worker serves waits for one, queue
        // threshold or not.
        let waits_for_version = RouteError::waits;
        if self.config.router_queue_threshold.is_none() {
            match self.route(&request, now) {
                Ok(d) => return Ok(Admission::Dispatched(d)),
                Err(e) if waits_for_version(&e) => {}
                Err(e) => return Err(e),
            }
        } else {
            // Bad targets fail now rather than after waiting.
            match self.allowed_ranks(&request, self.config.router_mode) {
                Ok(_) => {}
                Err(e) if waits_for_version(&e) => {}
                Err(e) => return Err(e),
            }
            if self.queue.is_empty() && !self.queue_busy(&request) {
                match self.route(&request, now) {
                    Ok(d) => return Ok(Admission::Dispatched(d)),
                    Err(RouteError::AllEligibleWorkersOverloaded)
                        if !self.config.reject_when_overloaded => {}
                    Err(e) if waits_for_version(&e) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if let Some(max) = self
            .config
            .router_queue_max_tokens
            .filter(|m| request.isl_tokens > *m)
        {
            return Err(RouteError::OverQueueBound {
                tokens: request.isl_tokens,
                max,
            });
        }
        let stats = self.queue.stats();
        let over_requests = self
            .config
            .router_queue_max_requests
            .is_some_and(|m| stats.pending_requests >= m);
        let over_tokens = self
            .config
            .router_queue_max_tokens
            .is_some_and(|m| stats.pending_isl_tokens + request.isl_tokens > m);
        if over_requests || over_tokens {
            return Err(RouteError::QueueFull {
                requests: stats.pending_requests,
                tokens: stats.pending_isl_tokens,
            });
        }
        let max_wait = Time::from_secs_f64(self.config.router_queue_max_wait_secs);
        let give_up = Time::from_micros(now.as_micros().saturating_add(max_wait.as_micros()));
        self.queue.push(request, now, give_up);
        Ok(Admission::Queued)
    }

    /// Places queued requests while capacity allows, and ends those past their deadline. Call it
    /// when load or eligibility changes outside a release (a first token, a worker added or
    /// back) and at [`Router::next_deadline`]; [`Router::finish`] and [`Router::cancel`] poll
    /// themselves and return the placements in their [`crate::router::Effects`].
    pub fn poll(&mut self, now: Time) -> Vec<(RequestId, Result<Decision, RouteError>)> {
        // The queue's pick reads predicted overlaps as of the latest time seen.
        self.advance_to(now);
        let expired = self.queue.expire(now);
        let mut out: Vec<(RequestId, Result<Decision, RouteError>)> = expired
            .into_iter()
            .map(|e| (e.request.id, Err(self.why_expired(&e, now))))
            .collect();
        let mut waiting = Vec::new();
        while !self.queue.is_empty() {
            let policy = self.config.router_queue_policy;
            let bs = self.config.kv_cache_block_size as u64;
            let picked = {
                let this = &*self;
                this.queue.best(
                    policy,
                    |r| {
                        let best = this
                            .overlaps(r)
                            .ranks
                            .iter()
                            .map(|o| u64::from(o.overlap.gpu_blocks))
                            .max()
                            .unwrap_or(0);
                        r.isl_tokens.saturating_sub(best * bs)
                    },
                    |r| this.group_left(r.group?),
                )
            };
            let Some(id) = picked else { break };
            let request = self.queue.remove(id).expect("picked from the queue");
            if self.queue_busy(&request.request) {
                self.queue.push_front(request);
                break;
            }
            match self.route(&request.request, now) {
                Ok(d) => out.push((id, Ok(d))),
                Err(RouteError::AllEligibleWorkersOverloaded) => {
                    self.queue.push_front(request);
                    break;
                }
                // Still no worker of an accepted version, or every one is paused: it keeps
                // waiting, without holding up the requests behind it.
                Err(e) if e.waits() => waiting.push(request),
                Err(e) => out.push((id, Err(e))),
            }
        }
        for request in waiting.into_iter().rev() {
            self.queue.push_front(request);
        }
        out
    }

    /// The error of a request leaving the queue at `now` unplaced.
    fn why_expired(&self, e: &Queued, now: Time) -> RouteError {
        if e.request.deadline.is_some_and(|d| d <= e.give_up) {
            return RouteError::DeadlineExceeded;
        }
        let waiting_for = match self.allowed_ranks(&e.request, self.config.router_mode) {
            Err(err) => err.to_string(),
            Ok(_) if self.queue_busy(&e.request) => {
                "every eligible worker is over --router-queue-threshold".to_owned()
            }
            Ok(_) => RouteError::AllEligibleWorkersOverloaded.to_string(),
        };
        RouteError::QueueWaitExceeded {
            waited_ms: now.since(e.arrival).as_millis() as u64,
            waiting_for,
        }
    }

    /// When the next queued request's deadline falls.
    pub fn next_deadline(&self) -> Option<Time> {
        self.queue.next_deadline()
    }

    /// Takes a request out of the queue (its client went away). Returns whether it was queued.
    pub fn cancel_queued(&mut self, id: RequestId) -> bool {
        self.queue.remove(id).is_some()
    }

    /// Sizes of the router queue.
    pub fn queue_stats(&self) -> QueueStats {
        self.queue.stats()
    }
}
