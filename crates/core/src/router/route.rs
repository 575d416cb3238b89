//! Placement: the busy filters, the ranks a request may go to (pins, policy versions, groups,
//! sessions), the policy's pick, and recording the decision.

use super::{Decision, RouteError, RouteRequest, Router};
use crate::ids::{WorkerId, WorkerRank};
use crate::ledger::RankLoad;
use crate::policy::{self, Candidate, CandidateScore, RouterMode};
use crate::time::Time;

impl Router {
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
        let latest = self.advance_to(now);
        if let Some(p) = &mut self.predicted {
            p.expire(latest);
        }
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
        // A sibling of a request in flight finds the blocks its elder computes: engines cache a
        // full block as soon as it is scheduled.
        let cached_tokens =
            (candidates[chosen].reused_blocks(request_blocks) * block_size).min(request.isl_tokens);
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
        self.record_prediction(rank, &request.blocks);
        self.place_in_group(request, rank, now);
        if mode == RouterMode::Cost {
            self.cost_placed(request, rank, prefix, now);
        }
        if let (Some(session), Some(ttl)) = (
            request.session,
            self.config.router_session_affinity_ttl_secs,
        ) {
            let until = now + std::time::Duration::from_secs_f64(ttl);
            self.bind_session(session, rank, until, now);
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

    pub(super) fn allowed_ranks(
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
}
