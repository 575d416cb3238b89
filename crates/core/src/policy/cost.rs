//! The `cost` policy: expected seconds per candidate, from the engine's own timing model.
//!
//! For a request with prompt `I` tokens and expected output `L` tokens, on worker `w` with `Q`
//! prefill tokens queued, `n` active requests holding `K` KV tokens (of capacity `C`) that are
//! expected to write `O` more output tokens, a step budget of `B` tokens and a cached prefix of
//! `H` tokens there (the larger of the event-fed index and the prefix held by its active requests:
//! siblings in flight count before any KV event):
//!
//! - `survive = max(0, 1 − wait / turnover)`, `turnover = C / churn` (seconds for the worker to
//!   write a cache's worth of new blocks, churn learned from KV events), `wait` the time until this
//!   request's prefill starts: the chance the cached prefix is still there when it is used;
//! - `Q` is the queue less what the engine has done of it since its oldest request's prefill
//!   began (whole steps, at most that request's tokens: [`prefill_done_tokens`]);
//! - `X = Q + I − survive·H`: tokens to prefill before and including this request;
//! - `decode_now = decode_ms(n, K)` (0 when `n = 0`), `residual = ½·decode_now` (half the step
//!   in progress; the queued prefill `Q` is counted in whole steps below, with no residual);
//! - `TTFT = residual + ⌊X/B⌋·prefill_ms(B) + prefill_ms(X mod B) + ⌈X/B⌉·decode_now + network`;
//! - the decode term uses the time-averaged footprint `F = K + O/2` before and
//!   `F' = F + new KV + L/2 + c·s·L` after (`s` siblings of its RL group already there, whose
//!   lengths are correlated with its own: `c` is the learned coefficient of variation of group
//!   lengths), `itl = decode_ms(n, F)`, `itl' = decode_ms(n + 1, F')`:
//!   `decode = (L·itl' + n·(itl' − itl)·min(L, O/n)) / 1000` seconds: this request's own decode
//!   time in that batch plus the slowdown it adds to the batch;
//! - `own`: the prefill time this request adds to the worker's queue, `P(Q + I − survive·H) −
//!   P(Q)` with `P` the chunked prefill time without decode: joining queued prefill, a request
//!   shares its steps (and their fixed cost) instead of paying a step of its own, so a burst
//!   sibling's uncached tail costs its tokens, not a whole prefill step;
//! - `cost = TTFT + λ·decode + γ·own` (λ = `router_cost_decode_weight`, default 0.5: a second of
//!   decode, the request's own or added to others, counts half a second of TTFT; γ =
//!   `router_cost_prefill_weight`, default 1: the work it puts before later arrivals).
//!
//! - the router then subtracts a replica credit ([`replica_credit_s`]) from a candidate lacking a
//!   hot prefix that others hold, so a hot prefix gets a second holder when its holders are busy.
//!
//! The argmin wins; ties go round the fleet in turn ([`argmin_rotating`]).

use super::CandidateScore;
use crate::timing::{StepShape, TimingModel};

/// What the cost model needs to know about one candidate worker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerPicture {
    /// Uncached prompt tokens of its requests still in prefill (`Q`).
    pub prefill_queue_tokens: u64,
    /// Its active requests (`n`).
    pub active_requests: u32,
    /// KV tokens its active requests hold (`K`).
    pub kv_tokens: u64,
    /// Output tokens its active requests are expected to write still (`O`).
    pub expected_output_tokens: f64,
    /// KV capacity in tokens (`C`).
    pub capacity_tokens: u64,
    /// Token budget per engine step (`B`).
    pub batch_tokens: u64,
    /// Blocks stored per second (learned from KV events), 0 when unknown.
    pub churn_blocks_per_s: f64,
    /// Block size in tokens (to turn churn into tokens per second).
    pub block_size: u64,
}

/// The request, as one candidate sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestPicture {
    /// Prompt tokens (`I`).
    pub isl_tokens: u64,
    /// Prompt tokens cached on the candidate (`H`).
    pub cached_tokens: u64,
    /// KV tokens it would newly hold there (not shared with active requests).
    pub new_kv_tokens: u64,
    /// Expected output tokens (`L`).
    pub expected_output: f64,
    /// One-way network delay to the candidate, seconds.
    pub network_s: f64,
    /// Active requests of its RL group on the candidate (`s`).
    pub siblings_here: u32,
    /// Coefficient of variation of a group's length (`c`): siblings' lengths move together, so
    /// each sibling already there is expected to run `c·L` longer alongside this one.
    pub length_cv: f64,
}

/// One candidate's estimate, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostEstimate {
    /// Expected time to first token.
    pub ttft_s: f64,
    /// Own decode time plus the slowdown added to the batch.
    pub decode_s: f64,
    /// The prefill time this request adds to the worker's queue (no decode).
    pub prefill_s: f64,
    /// Probability the cached prefix survives until it is used.
    pub survive: f64,
    /// Replica credit subtracted from `total` (set by the router, 0 from [`estimate`]).
    pub replica_s: f64,
    /// `ttft_s + λ·decode_s + γ·prefill_s − replica_s`.
    pub total: f64,
}

/// The most a step is priced at, ms (1,000 s).
const MAX_STEP_MS: f64 = 1e6;

fn ms<T: TimingModel + ?Sized>(r: Result<f64, crate::timing::TimingError>, _: &T) -> f64 {
    // A profile that refuses a query (outside its table) is answered as expensive, not free;
    // an answer that is not a number, or beyond any step, as the most a step costs.
    match r {
        Ok(v) if v.is_finite() => v.clamp(0.0, MAX_STEP_MS),
        _ => MAX_STEP_MS,
    }
}

fn decode_ms<T: TimingModel + ?Sized>(t: &T, seqs: u64, kv_tokens: f64, capacity: u64) -> f64 {
    if seqs == 0 {
        return 0.0;
    }
    let shape = StepShape {
        prefill_tokens: 0,
        decode_seqs: seqs,
        decode_mean_context: kv_tokens / seqs as f64,
        active_kv_tokens: kv_tokens.max(0.0) as u64,
        kv_capacity_tokens: capacity,
    };
    ms(t.decode_ms(&shape), t)
}

/// Time (ms) to prefill `x` tokens in steps of at most `b` tokens, each step also decoding the
/// batch (`decode_step` ms per step).
pub fn chunked_prefill_ms<T: TimingModel + ?Sized>(t: &T, x: u64, b: u64, decode_step: f64) -> f64 {
    if x == 0 {
        return 0.0;
    }
    let b = b.max(1);
    chunked_with_full_step(t, x, b, ms(t.prefill_ms(b), t), decode_step)
}

/// [`chunked_prefill_ms`] given the time of a full step of `b ≥ 1` tokens, `full_step` (the
/// same figures, one profile query fewer).
fn chunked_with_full_step<T: TimingModel + ?Sized>(
    t: &T,
    x: u64,
    b: u64,
    full_step: f64,
    decode_step: f64,
) -> f64 {
    if x == 0 {
        return 0.0;
    }
    let (full, rem) = (x / b, x % b);
    let mut total = 0.0;
    if full > 0 {
        total += full as f64 * full_step;
    }
    if rem > 0 {
        total += ms(t.prefill_ms(rem), t);
    }
    total + x.div_ceil(b) as f64 * decode_step
}

/// Tokens of a worker's queued prefill (`w.prefill_queue_tokens`) the engine has done
/// `elapsed_ms` after its oldest request's prefill began: whole steps of `B` tokens, each also
/// decoding the batch, and at most `head`, that request's own tokens (past them its first token
/// would have come, so the estimate is off and counts none beyond).
pub fn prefill_done_tokens<T: TimingModel + ?Sized>(
    t: &T,
    w: &WorkerPicture,
    head: u64,
    elapsed_ms: f64,
) -> u64 {
    let b = w.batch_tokens.max(1);
    let cap = w.capacity_tokens.max(1);
    let step = ms(t.prefill_ms(b), t)
        + decode_ms(t, u64::from(w.active_requests), w.kv_tokens as f64, cap);
    let steps = if step > 0.0 {
        (elapsed_ms.max(0.0) / step).floor()
    } else {
        f64::INFINITY
    };
    let done = (steps * b as f64).min(u64::MAX as f64) as u64;
    done.min(head).min(w.prefill_queue_tokens)
}

/// The index of the lowest `total`; among candidates tied with it (within 1e-9 relative), the
/// first at or after `cursor` in rotation, so a symmetric fleet is filled in turn as round-robin
/// would (the host advances `cursor` once per decision). `scores` must not be empty.
pub fn argmin_rotating(scores: &[CandidateScore], cursor: usize) -> usize {
    assert!(!scores.is_empty(), "argmin_rotating needs a candidate");
    let min = scores.iter().map(|s| s.total).fold(f64::INFINITY, f64::min);
    let tol = 1e-9 * min.abs().max(1e-12);
    let n = scores.len();
    (0..n)
        .map(|k| (cursor + k) % n)
        .find(|&i| scores[i].total <= min + tol)
        .unwrap_or(0)
}

/// The objective's weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostWeights {
    /// λ: weight of the decode term.
    pub decode: f64,
    /// γ: weight of this request's own prefill time (the work it adds before later arrivals).
    pub prefill: f64,
    /// ρ: weight of the replica credit ([`replica_credit_s`]); 0 turns it off.
    pub replica: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            decode: 0.5,
            prefill: 1.0,
            replica: 1.0,
        }
    }
}

/// The replica credit, seconds, of a candidate that lacks a hot prefix `holders` workers hold:
/// placing the request there copies the prefix (its duplicate prefill is already in the
/// candidate's cost), and every later request on the prefix then has one more holder to go to.
/// `recent` requests arrived on the prefix in the last window, so about as many are expected in
/// the next; `saving_s` is how much cheaper the next one would be on this candidate, were it a
/// holder, than on the best holder now; the new holder takes its share `1/(holders + 1)` of them:
///
/// `credit = ρ · recent · max(0, saving) / (holders + 1)`.
pub fn replica_credit_s(weight: f64, recent: f64, holders: u32, saving_s: f64) -> f64 {
    if saving_s <= 0.0 || recent <= 0.0 {
        return 0.0;
    }
    weight * recent * saving_s / f64::from(holders + 1)
}

/// Whether a hot prefix with `holders` holders among `candidates` workers may earn one more
/// through the replica credit: only while a worker that does not hold it stays left over, the
/// reserve that large uncached requests (which no cached prefix helps) find idle. The credit
/// values the copy for the prefix's own traffic; taking the last non-holder would charge that
/// traffic's queueing to every other prompt, which the one-step estimate does not see.
pub fn keeps_a_reserve(holders: u32, candidates: usize) -> bool {
    (holders as usize) + 2 <= candidates
}

/// Seconds added per running sibling above the least crowded candidate's, for a grouped request
/// placed before any output length was observed ([`cold_group_spread`]): large enough that a
/// less crowded eligible worker always wins.
pub const COLD_SPREAD_PENALTY_S: f64 = 1e6;

/// The cold-start spread of an RL group: before any output length was observed the expected
/// output is only the prior, yet siblings' lengths are correlated (one long group decodes long
/// side by side), so a sibling goes to a candidate with the fewest running siblings of its
/// group; among those the cost decides. Returns the penalty to add to each candidate given its
/// running siblings (`siblings[i]`): [`COLD_SPREAD_PENALTY_S`] per sibling above the least.
pub fn cold_group_spread(siblings: &[u32]) -> impl Iterator<Item = f64> + '_ {
    let least = siblings.iter().copied().min().unwrap_or(0);
    siblings
        .iter()
        .map(move |s| f64::from(s - least) * COLD_SPREAD_PENALTY_S)
}

/// The terms of a candidate's estimate that depend on the worker alone: computed once per
/// candidate however many request pictures are priced on it ([`estimate_with`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerTerms {
    /// KV capacity in tokens, at least 1.
    capacity: u64,
    /// Token budget per step, at least 1.
    batch: u64,
    /// Time of a full prefill step of `batch` tokens, ms.
    full_step_ms: f64,
    /// The decode step now (0 with no active request), ms.
    decode_now_ms: f64,
    /// Half the step in progress, ms.
    residual_ms: f64,
    /// Probability a cached prefix survives until this request's prefill starts.
    survive: f64,
    /// Time-averaged KV footprint of the batch, tokens (`F`).
    footprint: f64,
    /// The batch's inter-token latency now, ms.
    itl_ms: f64,
    /// Time to prefill the queued tokens `Q` alone, in chunked steps without decode, ms.
    queue_prefill_ms: f64,
}

/// The worker's terms of [`estimate`].
pub fn worker_terms<T: TimingModel + ?Sized>(timing: &T, w: &WorkerPicture) -> WorkerTerms {
    steady_terms(timing, w).with_churn(w.churn_blocks_per_s, w.block_size)
}

/// [`WorkerTerms`] but for the survival, which moves with the churn rate (and so with time):
/// what a host may keep while the worker's picture (churn aside) and profile stay the same.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SteadyTerms {
    /// The terms with `survive` = 1.
    terms: WorkerTerms,
    /// The wait until a request's prefill would start there, ms.
    wait_ms: f64,
}

impl SteadyTerms {
    /// The worker's terms at a churn of `churn_blocks_per_s` blocks of `block_size` tokens.
    pub fn with_churn(&self, churn_blocks_per_s: f64, block_size: u64) -> WorkerTerms {
        let churn_tokens_per_s = churn_blocks_per_s * block_size.max(1) as f64;
        let survive = if churn_tokens_per_s > 0.0 {
            let turnover_s = self.terms.capacity as f64 / churn_tokens_per_s;
            (1.0 - self.wait_ms / 1e3 / turnover_s).clamp(0.0, 1.0)
        } else {
            1.0
        };
        WorkerTerms {
            survive,
            ..self.terms
        }
    }
}

/// The worker's terms but for the survival (`w.churn_blocks_per_s` is not read).
pub fn steady_terms<T: TimingModel + ?Sized>(timing: &T, w: &WorkerPicture) -> SteadyTerms {
    let cap = w.capacity_tokens.max(1);
    let batch = w.batch_tokens.max(1);
    let full_step_ms = ms(timing.prefill_ms(batch), timing);
    let n = u64::from(w.active_requests);
    let k = w.kv_tokens as f64;
    let decode_now = decode_ms(timing, n, k, cap);
    // Half the step in progress; the queued prefill (less what is done of it, in the caller) is
    // counted in the chunks below.
    let residual = if n > 0 { 0.5 * decode_now } else { 0.0 };
    let queue_prefill_ms =
        chunked_with_full_step(timing, w.prefill_queue_tokens, batch, full_step_ms, 0.0);
    let wait_ms =
        residual + queue_prefill_ms + w.prefill_queue_tokens.div_ceil(batch) as f64 * decode_now;
    let footprint = k + w.expected_output_tokens.max(0.0) / 2.0;
    SteadyTerms {
        terms: WorkerTerms {
            capacity: cap,
            batch,
            full_step_ms,
            decode_now_ms: decode_now,
            residual_ms: residual,
            survive: 1.0,
            footprint,
            itl_ms: decode_ms(timing, n, footprint, cap),
            queue_prefill_ms,
        },
        wait_ms,
    }
}

/// The estimate for one candidate.
pub fn estimate<T: TimingModel + ?Sized>(
    timing: &T,
    w: &WorkerPicture,
    r: &RequestPicture,
    weights: CostWeights,
) -> CostEstimate {
    estimate_with(timing, w, &worker_terms(timing, w), r, weights)
}

/// [`estimate`] with the worker's terms already computed (`terms` from [`worker_terms`] of the
/// same `timing` and `w`).
pub fn estimate_with<T: TimingModel + ?Sized>(
    timing: &T,
    w: &WorkerPicture,
    terms: &WorkerTerms,
    r: &RequestPicture,
    weights: CostWeights,
) -> CostEstimate {
    let &WorkerTerms {
        capacity: cap,
        batch,
        full_step_ms,
        decode_now_ms: decode_now,
        residual_ms: residual,
        survive,
        footprint,
        itl_ms: itl,
        queue_prefill_ms,
    } = terms;
    let n = u64::from(w.active_requests);
    let held = r.cached_tokens.min(r.isl_tokens);
    // The same figure either way; `round` is a library call, skipped when the prefix survives.
    let cached = if survive == 1.0 {
        held
    } else {
        (held as f64 * survive).round() as u64
    };
    let x = w.prefill_queue_tokens + r.isl_tokens - cached;
    let prefill_ms = chunked_with_full_step(timing, x, batch, full_step_ms, 0.0);
    let ttft_ms = residual + prefill_ms + x.div_ceil(batch) as f64 * decode_now;
    let ttft_s = ttft_ms / 1e3 + r.network_s;
    let own_s = (prefill_ms - queue_prefill_ms).max(0.0) / 1e3;

    let l = r.expected_output.max(0.0);
    let correlated = r.length_cv.max(0.0) * f64::from(r.siblings_here) * l;
    let after = footprint + r.new_kv_tokens as f64 + l / 2.0 + correlated;
    let itl_after = decode_ms(timing, n + 1, after, cap);
    let others = if n > 0 {
        n as f64 * (itl_after - itl).max(0.0) * l.min(w.expected_output_tokens.max(0.0) / n as f64)
    } else {
        0.0
    };
    let decode_s = (l * itl_after + others) / 1e3;
    CostEstimate {
        ttft_s,
        decode_s,
        prefill_s: own_s,
        survive,
        replica_s: 0.0,
        total: ttft_s + weights.decode * decode_s + weights.prefill * own_s,
    }
}

#[cfg(test)]
mod tests;
