//! The router's side of the `cost` policy: per-worker timing models, what it learns online
//! (output lengths, churn, step-time fits) and the pick. The arithmetic is in
//! [`crate::policy::cost`]; see docs/routing.md for the objective.

use super::profiles::{FittedProfile, Timing};
use super::{RouteRequest, Router, WorkerSpec};
use crate::event::KvEvent;
use crate::fast_map::FastMap;
use crate::ids::{RequestId, WorkerId, WorkerRank};
use crate::ledger::RankLoad;
use crate::policy::cost::{
    cold_group_spread, estimate_with, steady_terms, CostEstimate, CostWeights, RequestPicture,
    SteadyTerms, WorkerPicture, WorkerTerms,
};
use crate::policy::learn::{OutputLengths, PrefixHeat, Rate};
use crate::policy::Candidate;
use crate::time::Time;
use crate::timing::TimingModel;
use std::sync::Arc;

mod observe;
mod prefill_line;
mod replica;
mod sessions;

/// An active request as the cost policy tracks it.
#[derive(Clone, Copy, Debug)]
struct Active {
    rank: WorkerRank,
    expected: f64,
    group: Option<u64>,
    prompt: Option<u64>,
    routed: Time,
    /// Tokens the chosen worker had to prefill up to and including this request (what was left
    /// of a prefill under way there, as the estimate counts it).
    prefill_work: f64,
    /// Whether its timings may feed its worker's fit: false once the worker was removed (a
    /// worker registered again under the same id is a new one).
    fits: bool,
    /// Whether its output length is a sample (it could produce more than one token).
    samples: bool,
    /// The most output tokens it may produce (`max_tokens`), if the client said: a reported
    /// length past it is learnt as this.
    max_output: Option<u64>,
    /// Its session, if it named one.
    session: Option<u64>,
}

impl Active {
    /// A reported output length as the policy counts it: at most `max_tokens` and the longest
    /// sample it learns from.
    fn counted(&self, output_tokens: u64) -> u64 {
        output_tokens
            .min(self.max_output.unwrap_or(u64::MAX))
            .min(crate::policy::learn::MAX_OUTPUT_SAMPLE)
    }
}

/// The cost policy's state inside the router.
#[derive(Debug, Default)]
pub(super) struct CostState {
    timing: FastMap<WorkerId, Arc<dyn TimingModel>>,
    fitted: FastMap<WorkerId, Fit>,
    /// What is kept per rank (one lookup per candidate). A removed worker's ranks lose their
    /// churn and kept terms at once, and their entries go when their last request does.
    ranks: FastMap<WorkerRank, RankCost>,
    /// Active requests per (rank, RL group).
    siblings: FastMap<(WorkerRank, u64), u32>,
    outputs: OutputLengths,
    active: FastMap<RequestId, Active>,
    /// Sessions: their homes and the KV of those between turns.
    sessions: sessions::Sessions,
    /// Each rank's requests in prefill and since when the oldest has been prefilled.
    prefill: prefill_line::PrefillLines,
    /// Recent requests per cached prefix (for the replica credit).
    heat: PrefixHeat,
    /// Bumped whenever a worker is given a profile, so every kept [`Steady`] is recomputed
    /// (a fit's new point only makes its own worker's terms stale: [`Fit::points`]).
    profiles_epoch: u64,
}

/// A worker's online fit and the number of points it took (its version: a kept [`Steady`]
/// computed from fewer is stale).
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    profile: FittedProfile,
    points: u64,
}

/// The cost policy's state of one rank.
#[derive(Clone, Copy, Debug, Default)]
struct RankCost {
    /// Blocks its engine stores per second (from KV events).
    churn: Rate,
    /// Σ expected output tokens of its active requests.
    expected_out: f64,
    /// Its active requests (a float sum need not come back to exactly 0).
    requests: u32,
    /// Its worker terms but for the survival, kept while its picture (churn aside) and the
    /// profiles stay the same: between two decisions only the ranks whose load moved change.
    steady: Option<Steady>,
}

impl RankCost {
    /// Whether the entry says nothing an absent one would not (so it may go).
    fn is_idle(&self) -> bool {
        self.requests == 0 && self.churn.is_unset() && self.steady.is_none()
    }
}

/// A rank's kept [`SteadyTerms`] and what they were computed from.
#[derive(Clone, Copy, Debug)]
struct Steady {
    /// The picture, its churn set to 0 (the survival is recomputed each decision).
    picture: WorkerPicture,
    /// The profiles' epoch and the worker's fit version (0 without a fit).
    epoch: (u64, u64),
    terms: SteadyTerms,
}

impl CostState {
    /// Forgets an ended request that wrote `output_tokens`; its session, if this was its last
    /// request in flight, is resident on its home for `window` ([`sessions`]).
    fn forget_request(
        &mut self,
        id: RequestId,
        output_tokens: u64,
        window: std::time::Duration,
        now: Time,
    ) -> Option<Active> {
        let a = self.active.remove(&id)?;
        self.prefill.left(a.rank, id, now);
        if let Some(session) = a.session {
            // A request of a removed worker leaves its session resident nowhere.
            let window = if a.fits { window } else { Default::default() };
            self.sessions
                .ended(session, a.rank, a.counted(output_tokens), window, now);
        }
        if let Some(s) = self.ranks.get_mut(&a.rank) {
            s.expected_out = (s.expected_out - a.expected).max(0.0);
            s.requests = s.requests.saturating_sub(1);
            if s.is_idle() {
                self.ranks.remove(&a.rank);
            }
        }
        if let Some(g) = a.group {
            if let Some(n) = self.siblings.get_mut(&(a.rank, g)) {
                *n -= 1;
                if *n == 0 {
                    self.siblings.remove(&(a.rank, g));
                }
            }
        }
        Some(a)
    }
}

/// What every candidate's pictures share: the request and the moment.
struct PriceContext {
    block_size: u64,
    request_blocks: u64,
    isl_tokens: u64,
    expected: f64,
    cv: f64,
    group: Option<u64>,
    now: Time,
    session: Option<u64>,
}

/// One candidate as the estimate sees it.
struct Priced<'a> {
    timing: Timing<'a>,
    w: WorkerPicture,
    r: RequestPicture,
    terms: WorkerTerms,
}

/// The prompt key for per-prompt output history: the hash of its last full block.
fn prompt_key(request: &RouteRequest) -> Option<u64> {
    request.blocks.sequence.last().map(|h| h.0)
}

impl Router {
    /// Times the `cost` policy's estimates for `worker` with `timing` (the profile the engine
    /// runs; the simulator passes the engine model's own). Workers without one use
    /// [`DynamoPoly`](crate::timing::DynamoPoly), or the online fit with `router_cost_fit`.
    pub fn set_worker_timing(&mut self, worker: WorkerId, timing: Arc<dyn TimingModel>) {
        self.cost.timing.insert(worker, timing);
        self.cost.profiles_epoch += 1;
    }

    /// Forgets every kept steady term, so the next decision computes all afresh (tests compare
    /// decisions with and without them).
    #[cfg(test)]
    pub(super) fn forget_kept_terms(&mut self) {
        for s in self.cost.ranks.values_mut() {
            s.steady = None;
        }
    }

    /// Drops what the cost policy learned or was told about a removed worker: its ranks' churn
    /// and kept terms, its fitted profile, its profile (a worker registered again under the same
    /// id is given its own). The expected output of requests still active there stays until
    /// they end (the entry goes with the last), and their timings no longer feed a fit.
    pub(super) fn cost_worker_removed(&mut self, worker: WorkerId) {
        self.cost.fitted.remove(&worker);
        if self.cost.timing.remove(&worker).is_some() {
            self.cost.profiles_epoch += 1;
        }
        self.cost.sessions.worker_removed(worker);
        self.cost.prefill.worker_removed(worker);
        for a in self.cost.active.values_mut() {
            if a.rank.worker == worker {
                a.fits = false;
            }
        }
        self.cost.ranks.retain(|rank, s| {
            if rank.worker == worker {
                s.churn = Rate::default();
                s.steady = None;
            }
            !s.is_idle()
        });
    }

    /// The output length the cost policy expects of an ungrouped request with no history.
    #[cfg(test)]
    pub(super) fn expected_output(&self) -> f64 {
        self.cost.outputs.expected(None, None)
    }

    /// KV tokens of the sessions resident on `rank` (tests).
    #[cfg(test)]
    pub(super) fn resident_kv(&self, rank: WorkerRank) -> u64 {
        self.cost.sessions.resident_kv(rank, None)
    }

    /// Entries of the cost policy's per-rank state (tests check it stays bounded).
    #[cfg(test)]
    pub(super) fn cost_rank_entries(&self) -> usize {
        self.cost.ranks.len()
    }

    pub(super) fn cost_released(&mut self, id: RequestId, now: Time) {
        let window = self.session_window();
        self.cost.forget_request(id, 0, window, now);
    }

    /// How long a session between turns counts on its home (`router_cost_session_window_secs`).
    fn session_window(&self) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.config.router_cost_session_window_secs)
            .unwrap_or_default()
    }

    pub(super) fn cost_event(&mut self, event: &KvEvent, now: Time) {
        if let KvEvent::Stored { blocks, .. } = event {
            self.cost
                .ranks
                .entry(event.rank())
                .or_default()
                .churn
                .add(blocks.len() as f64, now);
        }
    }

    /// The worker's profile and its fit version (0 unless the fit answers).
    fn timing_of(&self, worker: WorkerId) -> (Timing<'_>, u64) {
        if let Some(t) = self.cost.timing.get(&worker) {
            return (Timing::Model(t.as_ref()), 0);
        }
        if self.config.router_cost_fit {
            if let Some(f) = self.cost.fitted.get(&worker) {
                return (Timing::Model(&f.profile), f.points);
            }
        }
        (Timing::Poly(self.config.router_cost_speedup_ratio), 0)
    }

    /// One candidate's pictures, profile and worker terms; `spec` is its worker's and `ranks`
    /// the per-rank state (taken out of the router while the candidates borrow it).
    fn priced(
        &self,
        c: &Candidate,
        spec: &WorkerSpec,
        cx: &PriceContext,
        ranks: &mut FastMap<WorkerRank, RankCost>,
    ) -> Priced<'_> {
        let bs = cx.block_size;
        let state = ranks.entry(c.rank).or_default();
        let cached_blocks = c.reused_blocks(cx.request_blocks);
        let ledger = self.ledger_picture(&c.load, spec);
        let mut w = WorkerPicture {
            // Sessions between turns will decode here again (`sessions.rs`), as far as the
            // worker can hold them.
            kv_tokens: ledger.kv_tokens
                + self
                    .cost
                    .sessions
                    .resident_kv(c.rank, cx.session)
                    .min(ledger.capacity_tokens.saturating_sub(ledger.kv_tokens)),
            expected_output_tokens: state.expected_out,
            churn_blocks_per_s: state.churn.rate(cx.now),
            ..ledger
        };
        let r = RequestPicture {
            isl_tokens: cx.isl_tokens,
            cached_tokens: cached_blocks * bs,
            new_kv_tokens: c.new_blocks * bs,
            expected_output: cx.expected,
            network_s: 0.0,
            siblings_here: cx
                .group
                .and_then(|g| self.cost.siblings.get(&(c.rank, g)).copied())
                .unwrap_or(0),
            length_cv: cx.cv,
        };
        let (timing, fit_version) = self.timing_of(c.rank.worker);
        w.prefill_queue_tokens -= self.prefill_done(c.rank, &ledger, &timing, cx.now);
        let key = WorkerPicture {
            churn_blocks_per_s: 0.0,
            ..w
        };
        let epoch = (self.cost.profiles_epoch, fit_version);
        let kept = match state.steady {
            Some(k) if k.picture == key && k.epoch == epoch => k.terms,
            _ => {
                let terms = steady_terms(&timing, &w);
                state.steady = Some(Steady {
                    picture: key,
                    epoch,
                    terms,
                });
                terms
            }
        };
        let terms = kept.with_churn(w.churn_blocks_per_s, w.block_size);
        Priced {
            timing,
            w,
            r,
            terms,
        }
    }

    /// What the ledger says of a rank, as the cost model's picture: its queued prefill, requests
    /// in flight and their KV, and its worker's capacity and step budget (the rest 0).
    fn ledger_picture(&self, load: &RankLoad, spec: &WorkerSpec) -> WorkerPicture {
        let bs = self.config.kv_cache_block_size as u64;
        let capacity = spec
            .kv_capacity_blocks
            .unwrap_or(self.config.router_index_max_blocks_per_worker as u64);
        WorkerPicture {
            prefill_queue_tokens: load.active_prefill_tokens,
            active_requests: load.active_requests,
            kv_tokens: load.active_decode_blocks * bs,
            capacity_tokens: capacity * bs,
            batch_tokens: spec.max_num_batched_tokens.unwrap_or(8192),
            block_size: bs,
            ..WorkerPicture::default()
        }
    }

    /// Every candidate's estimate, in candidate order (replica credit included), and the key of
    /// the deepest prefix any candidate holds (for [`Router::cost_placed`] to count).
    pub(super) fn cost_estimates(
        &mut self,
        request: &RouteRequest,
        candidates: &[Candidate],
        now: Time,
    ) -> (Vec<CostEstimate>, Option<u64>) {
        let window = self.session_window();
        self.cost.sessions.expire(window, now);
        let mut ranks = std::mem::take(&mut self.cost.ranks);
        let out = self.estimates_keeping(request, candidates, now, &mut ranks);
        self.cost.ranks = ranks;
        out
    }

    /// [`Router::cost_estimates`], reusing and updating the kept steady terms.
    fn estimates_keeping(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
        now: Time,
        ranks: &mut FastMap<WorkerRank, RankCost>,
    ) -> (Vec<CostEstimate>, Option<u64>) {
        let bs = self.config.kv_cache_block_size as u64;
        let cx = PriceContext {
            block_size: bs,
            request_blocks: request.request_blocks(self.config.kv_cache_block_size),
            isl_tokens: request.isl_tokens,
            expected: self
                .cost
                .outputs
                .expected(request.group, prompt_key(request)),
            cv: self.cost.outputs.group_cv(),
            group: request.group,
            now,
            session: request.session,
        };
        let weights = CostWeights {
            decode: self.config.router_cost_decode_weight,
            prefill: self.config.router_cost_prefill_weight,
            replica: self.config.router_cost_replica_weight,
        };
        // Each candidate's pictures, profile and worker terms, computed once. Candidates come in
        // rank order, so their specs are found by one walk (a lookup for any out of order).
        let mut specs = self.workers.iter().peekable();
        let priced: Vec<Priced> = candidates
            .iter()
            .map(|c| {
                let worker = c.rank.worker;
                while specs.next_if(|(w, _)| **w < worker).is_some() {}
                let spec = match specs.peek() {
                    Some((w, s)) if **w == worker => s,
                    _ => &self.workers[&worker],
                };
                self.priced(c, spec, &cx, ranks)
            })
            .collect();
        let mut estimates: Vec<CostEstimate> = priced
            .iter()
            .map(|p| estimate_with(&p.timing, &p.w, &p.terms, &p.r, weights))
            .collect();
        // Cold start: no output length observed yet, so a group's siblings spread (their lengths
        // are correlated and unknown; docs/routing.md).
        if request.group.is_some() && !self.cost.outputs.observed() {
            let siblings: Vec<u32> = priced.iter().map(|p| p.r.siblings_here).collect();
            for (e, penalty) in estimates.iter_mut().zip(cold_group_spread(&siblings)) {
                e.total += penalty;
            }
        }
        let key = self.replica_credit(request, candidates, &priced, &mut estimates, weights, now);
        (estimates, key)
    }

    /// The session's last rank among the candidates, if it is within the margin of the best:
    /// soft affinity (a session moves only when that is clearly cheaper).
    pub(super) fn cost_home(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
        estimates: &[CostEstimate],
    ) -> Option<usize> {
        let rank = self.cost.sessions.home(request.session?)?;
        let h = candidates.iter().position(|c| c.rank == rank)?;
        let best = estimates
            .iter()
            .map(|e| e.total)
            .fold(f64::INFINITY, f64::min);
        (estimates[h].total <= best * (1.0 + self.config.router_cost_session_margin)).then_some(h)
    }

    /// Records a `cost` placement; `prefix` is the key [`Router::cost_estimates`] returned.
    pub(super) fn cost_placed(
        &mut self,
        request: &RouteRequest,
        rank: WorkerRank,
        prefix: Option<u64>,
        now: Time,
    ) {
        if let Some(k) = prefix {
            self.cost.heat.observe(k, now);
        }
        let expected = self
            .cost
            .outputs
            .expected(request.group, prompt_key(request));
        let window = self.session_window();
        self.cost.forget_request(request.id, 0, window, now);
        let left = self.prefill_placed(request.id, rank, now);
        let active = Active {
            rank,
            expected,
            group: request.group,
            prompt: prompt_key(request),
            routed: now,
            prefill_work: left as f64,
            fits: true,
            samples: request.max_output_tokens.is_none_or(|m| m > 1),
            max_output: request.max_output_tokens,
            session: request.session,
        };
        self.cost.active.insert(request.id, active);
        let state = self.cost.ranks.entry(rank).or_default();
        state.expected_out += expected;
        state.requests += 1;
        if let Some(g) = request.group {
            *self.cost.siblings.entry((rank, g)).or_default() += 1;
        }
        if let Some(s) = request.session {
            self.cost.sessions.placed(s, rank, request.isl_tokens, now);
        }
    }
}
