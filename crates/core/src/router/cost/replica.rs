//! The `cost` policy's replica credit (docs/routing.md, "Replica credit"): a worker lacking a
//! hot prefix that others hold is credited for the later requests on it it would serve sooner.

use super::Priced;
use crate::index::TierOverlap;
use crate::policy::cost::{
    estimate_with, keeps_a_reserve, replica_credit_s, CostEstimate, CostWeights, RequestPicture,
};
use crate::policy::Candidate;
use crate::router::{RouteRequest, Router};
use crate::time::Time;

impl Router {
    /// Lowers each candidate's estimate by its replica credit, for a prefix some candidate holds
    /// and others lack; returns the key of the deepest prefix any candidate holds (for
    /// [`Router::cost_placed`] to count).
    pub(super) fn replica_credit(
        &self,
        request: &RouteRequest,
        candidates: &[Candidate],
        priced: &[Priced],
        estimates: &mut [CostEstimate],
        weights: CostWeights,
        now: Time,
    ) -> Option<u64> {
        let bs = self.config.kv_cache_block_size as u64;
        let deepest = priced.iter().map(|p| p.r.cached_tokens).max().unwrap_or(0);
        let depth_blocks = (deepest / bs.max(1)) as usize;
        let key = depth_blocks
            .checked_sub(1)
            .and_then(|i| request.blocks.sequence.get(i))
            .map(|h| h.0);
        let (Some(k), true) = (key, weights.replica > 0.0) else {
            return key;
        };
        let recent = self.cost.heat.recent(k, now);
        let lasted_s = self.cost.heat.lasted_s(k, now);
        let holders = priced
            .iter()
            .filter(|p| p.r.cached_tokens >= deepest)
            .count() as u32;
        // A prefix no engine has cached yet is still being computed where it is held: a copy
        // elsewhere would be ready no sooner than the original, so it earns no credit. Only the
        // engines' own events say "cached": without a predicted window the candidates' overlap
        // is the event-fed index's; with one it may count predictions, so the index is asked.
        let deep = |o: TierOverlap| u64::from(o.gpu_blocks) * bs >= deepest;
        let cached_somewhere = || match &self.predicted {
            None => candidates.iter().any(|c| deep(c.overlap)),
            Some(_) => {
                let cached = self.index.find_matches(&request.blocks.sequence);
                candidates.iter().any(|c| deep(cached.get(c.rank)))
            }
        };
        // The credit is at most ρ·recent/(holders + 1) × the best holder's whole cost: skip the
        // second estimates when that cannot matter (a cold prefix).
        if weights.replica * recent / f64::from(holders + 1) < 1.0
            || !keeps_a_reserve(holders, candidates.len())
            || !cached_somewhere()
        {
            return key;
        }
        let best_holder = estimates
            .iter()
            .zip(priced)
            .filter(|(_, p)| p.r.cached_tokens >= deepest)
            .map(|(e, _)| e.total)
            .fold(f64::INFINITY, f64::min);
        for (p, e) in priced.iter().zip(estimates.iter_mut()) {
            let r = &p.r;
            if r.cached_tokens >= deepest {
                continue;
            }
            let copied = deepest.min(r.isl_tokens) - r.cached_tokens.min(r.isl_tokens);
            let as_holder = RequestPicture {
                cached_tokens: deepest,
                new_kv_tokens: r.new_kv_tokens.saturating_sub(copied),
                ..*r
            };
            // Traffic that has not yet outlasted one request (the time this request would take
            // here: first token and decode) is a burst, not a rate: its requests arrive while
            // the one that brought the prefix is still being served, and the plain cost already
            // prices each of them as it comes. Counting them again as later requests a copy
            // would serve sooner split GRPO bursts sent over a few milliseconds (live, once the
            // first siblings' blocks were reported cached). Only traffic that went on longer
            // than that earns the credit.
            if lasted_s < e.ttft_s + e.decode_s {
                continue;
            }
            let next = estimate_with(&p.timing, &p.w, &p.terms, &as_holder, weights);
            let credit =
                replica_credit_s(weights.replica, recent, holders, best_holder - next.total);
            e.replica_s = credit;
            e.total -= credit;
        }
        key
    }
}
