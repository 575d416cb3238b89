//! The global router: clusters, their latest summaries, session homes, and the choice.

use super::error::GlobalError;
use super::estimate::{estimate, ClusterEstimate, GlobalRequest, PendingLoad};
use super::policy::{GlobalConfig, GlobalConfigError, GlobalPolicy};
use super::summary::ClusterSummary;
use super::ClusterId;
use crate::rng::mix64;
use crate::time::Time;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// A cluster as configured at the global router.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// Name (matches the summaries it publishes).
    pub name: String,
    /// Network round trip from the global router to the cluster, ms (at most [`MAX_RTT_MS`]).
    pub rtt_ms: f64,
    /// Share of sessions under `static-split` (> 0).
    pub weight: f64,
}

/// The longest round trip a cluster may be given, ms (a minute): longer is no network, and a
/// round trip of `1e300` ms overflowed the clock it is taken from.
pub const MAX_RTT_MS: f64 = 60_000.0;
/// The largest static-split weight of a cluster: weights are shares, and their sum must stay a
/// number (two of 10^308 summed to infinity and sent everything to the last cluster).
pub const MAX_CLUSTER_WEIGHT: f64 = 1e6;

/// Why the chosen cluster was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionReason {
    /// The static split's share for the session.
    StaticShare,
    /// Lowest load ratio.
    LeastLoaded,
    /// Lowest estimated cost (new session, or no session).
    LowestCost,
    /// The session's home, kept by hysteresis.
    SessionHome,
    /// The session moved: another cluster was clearly cheaper, or its home is unavailable.
    SessionMoved,
}

/// The global router's choice, with every cluster's estimate as data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GlobalDecision {
    /// Where the request goes.
    pub cluster: ClusterId,
    /// Why.
    pub reason: DecisionReason,
    /// The session's previous cluster when it moved (its KV does not follow: re-prefill).
    pub moved_from: Option<ClusterId>,
    /// Per cluster, in id order.
    pub estimates: Vec<ClusterEstimate>,
}

impl GlobalDecision {
    /// The chosen cluster's estimate.
    pub fn chosen(&self) -> &ClusterEstimate {
        &self.estimates[self.cluster.0 as usize]
    }
}

#[derive(Debug)]
struct ClusterState {
    spec: ClusterSpec,
    summary: Option<ClusterSummary>,
    received_at: Time,
    up: bool,
    /// Work sent since the summary was built: (sent at, load), in the order sent.
    pending: VecDeque<(Time, PendingLoad)>,
    /// The sum of `pending`.
    pending_total: PendingLoad,
    /// Sessions whose home this is.
    resident_sessions: u64,
    /// Output tokens of finished requests reported here: (sum, count).
    outputs: (u64, u64),
    /// Uncached prompt tokens sent within the load window: (sent at, tokens), in the order
    /// sent, and their sum.
    sent: VecDeque<(Time, u64)>,
    sent_tokens: u64,
    /// The models it serves, as its router last listed them (`None`: not known yet, so any).
    models: Option<Vec<String>>,
}

impl ClusterState {
    /// Forgets the work sent before the window ending at `now`.
    fn trim_sent(&mut self, now: Time, window: Duration) {
        while let Some(&(at, tokens)) = self.sent.front() {
            if now.since(at) <= window {
                break;
            }
            self.sent.pop_front();
            self.sent_tokens -= tokens;
        }
    }
}

/// The global router. See the module documentation of [`crate::global`].
#[derive(Debug)]
pub struct GlobalRouter {
    config: GlobalConfig,
    block_size: u32,
    clusters: Vec<ClusterState>,
    /// Session → (home, last request).
    sessions: BTreeMap<u64, (ClusterId, Time)>,
    counter: u64,
}

impl GlobalRouter {
    /// A router with no clusters, hashing prompts in `block_size`-token blocks.
    pub fn new(config: GlobalConfig, block_size: u32) -> Result<Self, GlobalConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            block_size,
            clusters: Vec::new(),
            sessions: BTreeMap::new(),
            counter: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GlobalConfig {
        &self.config
    }

    /// Adds a cluster (up, without a summary: routed around until its first one arrives).
    pub fn add_cluster(&mut self, spec: ClusterSpec) -> Result<ClusterId, GlobalError> {
        let rtt_ok = (0.0..=MAX_RTT_MS).contains(&spec.rtt_ms);
        let weight_ok = spec.weight > 0.0 && spec.weight <= MAX_CLUSTER_WEIGHT;
        if !(rtt_ok && weight_ok) {
            return Err(GlobalError::InvalidSpec(spec.name));
        }
        self.clusters.push(ClusterState {
            spec,
            summary: None,
            received_at: Time::ZERO,
            up: true,
            pending: VecDeque::new(),
            pending_total: PendingLoad::default(),
            resident_sessions: 0,
            outputs: (0, 0),
            sent: VecDeque::new(),
            sent_tokens: 0,
            models: None,
        });
        Ok(ClusterId(self.clusters.len() as u32 - 1))
    }

    /// The clusters' specs, in id order.
    pub fn clusters(&self) -> impl Iterator<Item = (ClusterId, &ClusterSpec)> {
        self.clusters
            .iter()
            .enumerate()
            .map(|(i, c)| (ClusterId(i as u32), &c.spec))
    }

    /// The cluster of this name.
    pub fn cluster_by_name(&self, name: &str) -> Option<ClusterId> {
        self.clusters
            .iter()
            .position(|c| c.spec.name == name)
            .map(|i| ClusterId(i as u32))
    }

    fn state(&self, id: ClusterId) -> Result<&ClusterState, GlobalError> {
        self.clusters
            .get(id.0 as usize)
            .ok_or(GlobalError::UnknownCluster(id))
    }

    /// Takes a cluster's summary received at `now`. Returns false (and keeps the old one) when
    /// it is not newer (by sequence) than the one held. Work sent more than one round trip
    /// before `now` is taken as counted by this summary.
    pub fn update_summary(
        &mut self,
        id: ClusterId,
        summary: ClusterSummary,
        now: Time,
    ) -> Result<bool, GlobalError> {
        self.state(id)?;
        if summary.block_size != self.block_size {
            return Err(GlobalError::BlockSize {
                cluster: id,
                expected: self.block_size,
                got: summary.block_size,
            });
        }
        let c = &mut self.clusters[id.0 as usize];
        if c.summary
            .as_ref()
            .is_some_and(|s| s.sequence >= summary.sequence)
        {
            return Ok(false);
        }
        let seen_before = now - Duration::from_secs_f64(c.spec.rtt_ms / 1e3);
        while c
            .pending
            .front()
            .is_some_and(|(sent, _)| *sent <= seen_before)
        {
            if let Some((_, p)) = c.pending.pop_front() {
                c.pending_total.requests -= p.requests;
                c.pending_total.prefill_tokens -= p.prefill_tokens;
            }
        }
        c.summary = Some(summary);
        c.received_at = now;
        Ok(true)
    }

    /// The summary held for a cluster and when it arrived.
    pub fn summary(&self, id: ClusterId) -> Option<(&ClusterSummary, Time)> {
        let c = self.clusters.get(id.0 as usize)?;
        c.summary.as_ref().map(|s| (s, c.received_at))
    }

    /// Marks a cluster down (its router failed) or up again. Returns the previous state.
    pub fn set_up(&mut self, id: ClusterId, up: bool) -> Result<bool, GlobalError> {
        self.state(id)?;
        Ok(std::mem::replace(&mut self.clusters[id.0 as usize].up, up))
    }

    /// Whether a cluster can be routed to at `now`: up, with a summary younger than the bound.
    pub fn is_eligible(&self, id: ClusterId, now: Time) -> bool {
        self.state(id).is_ok_and(|c| {
            c.up && c.summary.is_some() && now.since(c.received_at) <= self.config.max_summary_age
        })
    }

    /// The models a cluster serves, as its router lists them (`None`: not known, so requests
    /// for any model may go there).
    pub fn set_models(
        &mut self,
        id: ClusterId,
        models: Option<Vec<String>>,
    ) -> Result<(), GlobalError> {
        self.state(id)?;
        self.clusters[id.0 as usize].models = models;
        Ok(())
    }

    /// Whether a cluster may serve `model`: it lists it, or its models are not known.
    pub fn serves(&self, id: ClusterId, model: &str) -> bool {
        self.state(id).is_ok_and(|c| {
            c.models
                .as_ref()
                .is_none_or(|m| m.iter().any(|x| x == model))
        })
    }

    /// Work sent to a cluster that its summary does not show yet, its resident sessions, and
    /// the rate of prefill work sent there over the load window (as of the last `route`).
    pub fn pending(&self, id: ClusterId) -> PendingLoad {
        let window = self.config.load_window.as_secs_f64();
        self.state(id)
            .map_or(PendingLoad::default(), |c| PendingLoad {
                resident_sessions: c.resident_sessions,
                sent_prefill_tokens_per_s: c.sent_tokens as f64 / window,
                ..c.pending_total
            })
    }

    /// Records a finished request's output length (from the response's usage) for the output
    /// hint of requests that state none.
    pub fn record_output(&mut self, id: ClusterId, output_tokens: u64) -> Result<(), GlobalError> {
        self.state(id)?;
        let o = &mut self.clusters[id.0 as usize].outputs;
        *o = (o.0.saturating_add(output_tokens), o.1 + 1);
        Ok(())
    }

    /// The output hint for a request without one at a cluster: the running mean of the
    /// outputs finished there, else over every cluster, else `None` (the estimate then
    /// assumes [`super::DEFAULT_OUTPUT_TOKENS_HINT`]).
    pub fn output_tokens_mean(&self, id: ClusterId) -> Option<u64> {
        let mean = |(sum, n): (u64, u64)| (n > 0).then(|| (sum as f64 / n as f64).round() as u64);
        let all = self.clusters.iter().fold((0u64, 0u64), |a, c| {
            (a.0.saturating_add(c.outputs.0), a.1 + c.outputs.1)
        });
        self.state(id)
            .ok()
            .and_then(|c| mean(c.outputs))
            .or_else(|| mean(all))
    }

    /// Every cluster's estimate for a request at `now` (ineligible ones marked).
    pub fn estimates(&self, request: &GlobalRequest<'_>, now: Time) -> Vec<ClusterEstimate> {
        (0..self.clusters.len())
            .map(|i| {
                let id = ClusterId(i as u32);
                let c = &self.clusters[i];
                let request = GlobalRequest {
                    output_tokens_hint: request
                        .output_tokens_hint
                        .or_else(|| self.output_tokens_mean(id)),
                    ..*request
                };
                let serves = request.model.is_none_or(|m| self.serves(id, m));
                match (&c.summary, serves && self.is_eligible(id, now)) {
                    (Some(s), true) => estimate(id, s, self.pending(id), c.spec.rtt_ms, &request),
                    _ => ClusterEstimate::ineligible(id),
                }
            })
            .collect()
    }

    /// Chooses a cluster for a request at `now` and records it (session home, pending work).
    pub fn route(
        &mut self,
        request: &GlobalRequest<'_>,
        now: Time,
    ) -> Result<GlobalDecision, GlobalError> {
        let window = self.config.load_window;
        self.clusters
            .iter_mut()
            .for_each(|c| c.trim_sent(now, window));
        let estimates = self.estimates(request, now);
        let eligible: Vec<&ClusterEstimate> = estimates.iter().filter(|e| e.eligible).collect();
        if eligible.is_empty() {
            let available =
                (0..self.clusters.len()).any(|i| self.is_eligible(ClusterId(i as u32), now));
            return Err(match request.model {
                Some(m) if available => GlobalError::ModelNotServed(m.to_owned()),
                _ => GlobalError::NoCluster,
            });
        }
        let home = request
            .session
            .and_then(|s| self.sessions.get(&s))
            .filter(|(_, last)| now.since(*last) <= self.config.session_ttl)
            .map(|(c, _)| *c);
        let cheapest = pick_min(&eligible, ClusterEstimate::cost_ms);
        let (cluster, reason) = match self.config.policy {
            GlobalPolicy::StaticSplit => (
                self.static_share(request, &estimates),
                DecisionReason::StaticShare,
            ),
            GlobalPolicy::LeastLoaded => (
                pick_min(&eligible, |e| e.load_ratio),
                DecisionReason::LeastLoaded,
            ),
            GlobalPolicy::Kv => match home.map(|h| &estimates[h.0 as usize]) {
                Some(h) if h.eligible => {
                    let best = &estimates[cheapest.0 as usize];
                    if best.cost_ms() < h.cost_ms() * self.config.session_move_ratio {
                        (cheapest, DecisionReason::SessionMoved)
                    } else {
                        (h.cluster, DecisionReason::SessionHome)
                    }
                }
                Some(_) => (cheapest, DecisionReason::SessionMoved),
                None => (cheapest, DecisionReason::LowestCost),
            },
        };
        let moved_from = home.filter(|h| *h != cluster);
        let reason = match (reason, moved_from) {
            (DecisionReason::LowestCost, Some(_)) => DecisionReason::SessionMoved,
            (r, _) => r,
        };
        if let Some(s) = request.session {
            if let Some((old, _)) = self.sessions.insert(s, (cluster, now)) {
                self.clusters[old.0 as usize].resident_sessions -= 1;
            }
            self.clusters[cluster.0 as usize].resident_sessions += 1;
        }
        let sent = PendingLoad {
            requests: 1,
            prefill_tokens: estimates[cluster.0 as usize].uncached_tokens,
            ..PendingLoad::default()
        };
        let c = &mut self.clusters[cluster.0 as usize];
        c.sent.push_back((now, sent.prefill_tokens));
        c.sent_tokens += sent.prefill_tokens;
        c.pending.push_back((now, sent));
        c.pending_total.requests += sent.requests;
        c.pending_total.prefill_tokens += sent.prefill_tokens;
        self.counter += 1;
        Ok(GlobalDecision {
            cluster,
            reason,
            moved_from,
            estimates,
        })
    }

    /// The static split's cluster: the session's (or, without one, the request counter's)
    /// weighted share; when that cluster is not eligible, the next eligible one.
    fn static_share(
        &self,
        request: &GlobalRequest<'_>,
        estimates: &[ClusterEstimate],
    ) -> ClusterId {
        // A request without a session is keyed by the router's count, a step of the golden
        // ratio off it: `mix64(0)` is 0, which put every fresh router's first such request on
        // the first cluster whatever the weights. Sessions keep their split.
        let key = match request.session {
            Some(s) => mix64(s),
            None => mix64(self.counter.wrapping_add(0x9E37_79B9_7F4A_7C15)),
        };
        let total: f64 = self.clusters.iter().map(|c| c.spec.weight).sum();
        let x = (key >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0;
        let mut share = self.clusters.len() - 1;
        for (i, c) in self.clusters.iter().enumerate() {
            acc += c.spec.weight;
            if x < acc {
                share = i;
                break;
            }
        }
        (0..self.clusters.len())
            .map(|k| (share + k) % self.clusters.len())
            .find(|&i| estimates[i].eligible)
            .map_or(ClusterId(share as u32), |i| ClusterId(i as u32))
    }

    /// The session's home at `now`, if any.
    pub fn session_home(&self, session: u64, now: Time) -> Option<ClusterId> {
        self.sessions
            .get(&session)
            .filter(|(_, last)| now.since(*last) <= self.config.session_ttl)
            .map(|(c, _)| *c)
    }

    /// Forgets a session (it ended). Returns whether it was known.
    pub fn end_session(&mut self, session: u64) -> bool {
        match self.sessions.remove(&session) {
            Some((home, _)) => {
                self.clusters[home.0 as usize].resident_sessions -= 1;
                true
            }
            None => false,
        }
    }

    /// Forgets sessions idle past the TTL.
    pub fn expire_sessions(&mut self, now: Time) {
        let ttl = self.config.session_ttl;
        let clusters = &mut self.clusters;
        self.sessions.retain(|_, (home, last)| {
            let keep = now.since(*last) <= ttl;
            if !keep {
                clusters[home.0 as usize].resident_sessions -= 1;
            }
            keep
        });
    }

    /// Sessions with a home.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }
}

/// The eligible estimate with the lowest `key` (lowest id on ties).
fn pick_min(eligible: &[&ClusterEstimate], key: impl Fn(&ClusterEstimate) -> f64) -> ClusterId {
    // A figure that is not a number ranks last: first in the list, it would never be beaten.
    let key = |e: &ClusterEstimate| {
        let v = key(e);
        if v.is_nan() {
            f64::INFINITY
        } else {
            v
        }
    };
    let mut best = eligible[0];
    for e in &eligible[1..] {
        if key(e) < key(best) {
            best = e;
        }
    }
    best.cluster
}
