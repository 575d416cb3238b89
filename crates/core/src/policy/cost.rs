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
//! - `X = Q + I − survive·H`: tokens to prefill before and including this request;
//! - `decode_now = decode_ms(n, K)` (0 when `n = 0`), `residual = ½·decode_now` (half the step
//!   in progress; the queued prefill `Q` is counted whole below);
//! - `TTFT = residual + ⌊X/B⌋·prefill_ms(B) + prefill_ms(X mod B) + ⌈X/B⌉·decode_now + network`;
//! - the decode term uses the time-averaged footprint `F = K + O/2` before and
//!   `F' = F + new KV + L/2 + c·s·L` after (`s` siblings of its RL group already there, whose
//!   lengths are correlated with its own: `c` is the learned coefficient of variation of group
//!   lengths), `itl = decode_ms(n, F)`, `itl' = decode_ms(n + 1, F')`:
//!   `decode = (L·itl' + n·(itl' − itl)·min(L, O/n)) / 1000` seconds: this request's own decode
//!   time in that batch plus the slowdown it adds to the batch;
//! - `own`: this request's own uncached prefill time (no queue, no batch);
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
    /// This request's own uncached prefill time (no queue, no batch).
    pub prefill_s: f64,
    /// Probability the cached prefix survives until it is used.
    pub survive: f64,
    /// Replica credit subtracted from `total` (set by the router, 0 from [`estimate`]).
    pub replica_s: f64,
    /// `ttft_s + λ·decode_s + γ·prefill_s − replica_s`.
    pub total: f64,
}

fn ms<T: TimingModel + ?Sized>(r: Result<f64, crate::timing::TimingError>, _: &T) -> f64 {
    // A profile that refuses a query (outside its table) is answered as expensive, not free.
    r.unwrap_or(1e6).max(0.0)
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
    // Half the step in progress; the queued prefill is counted whole in the chunks below.
    let residual = if n > 0 { 0.5 * decode_now } else { 0.0 };
    let wait_ms = residual
        + chunked_with_full_step(
            timing,
            w.prefill_queue_tokens,
            batch,
            full_step_ms,
            decode_now,
        );
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
    let ttft_ms = residual + chunked_with_full_step(timing, x, batch, full_step_ms, decode_now);
    let ttft_s = ttft_ms / 1e3 + r.network_s;
    let own_s =
        chunked_with_full_step(timing, r.isl_tokens - cached, batch, full_step_ms, 0.0) / 1e3;

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
mod tests {
    use super::*;
    use crate::timing::DynamoPoly;
    use proptest::prelude::*;

    const W: CostWeights = CostWeights {
        decode: 1.0,
        prefill: 1.0,
        replica: 1.0,
    };

    /// The engine's loop, step by step: each step prefills at most `b` tokens and decodes the
    /// batch.
    fn brute_force_prefill_ms(x: u64, b: u64, decode_step: f64) -> f64 {
        let (mut left, mut t) = (x, 0.0);
        while left > 0 {
            let chunk = left.min(b);
            t += DynamoPoly.prefill_ms(chunk).unwrap() + decode_step;
            left -= chunk;
        }
        t
    }

    fn worker(q: u64, n: u32, kv: u64) -> WorkerPicture {
        WorkerPicture {
            prefill_queue_tokens: q,
            active_requests: n,
            kv_tokens: kv,
            expected_output_tokens: 0.0,
            capacity_tokens: 1 << 20,
            batch_tokens: 8192,
            churn_blocks_per_s: 0.0,
            block_size: 64,
        }
    }

    fn request(isl: u64, cached: u64, out: f64) -> RequestPicture {
        RequestPicture {
            isl_tokens: isl,
            cached_tokens: cached,
            new_kv_tokens: isl - cached.min(isl),
            expected_output: out,
            network_s: 0.0,
            siblings_here: 0,
            length_cv: 1.0,
        }
    }

    proptest! {
        #[test]
        fn chunked_prefill_matches_the_step_loop(x in 0u64..100_000, b in 1u64..20_000, d in 0.0f64..50.0) {
            let fast = chunked_prefill_ms(&DynamoPoly, x, b, d);
            let slow = brute_force_prefill_ms(x, b, d);
            prop_assert!((fast - slow).abs() <= 1e-6 * slow.max(1.0), "{fast} vs {slow}");
        }

        #[test]
        fn ttft_is_the_brute_force_sum_and_monotone_in_queue_and_cache(
            q in 0u64..50_000, n in 0u32..64, isl in 1u64..20_000, cached in 0u64..20_000,
        ) {
            let w = worker(q, n, u64::from(n) * 4096);
            let r = request(isl, cached, 100.0);
            let e = estimate(&DynamoPoly, &w, &r, W);
            // Brute force: residual of the step in progress, then the loop over everything queued
            // and this request's uncached part.
            let decode_now = if n > 0 { decode_ms(&DynamoPoly, u64::from(n), w.kv_tokens as f64, w.capacity_tokens) } else { 0.0 };
            let residual = 0.5 * decode_now;
            let want = (residual + brute_force_prefill_ms(q + isl - cached.min(isl), 8192, decode_now)) / 1e3;
            prop_assert!((e.ttft_s - want).abs() < 1e-9, "{} vs {want}", e.ttft_s);
            let more_queue = estimate(&DynamoPoly, &worker(q + 1000, n, w.kv_tokens), &r, W);
            prop_assert!(more_queue.ttft_s >= e.ttft_s);
            let more_cache = estimate(&DynamoPoly, &w, &request(isl, cached.min(isl) + 64, 100.0), W);
            prop_assert!(more_cache.ttft_s <= e.ttft_s + 1e-12);
            prop_assert!((e.total - (e.ttft_s + e.decode_s + e.prefill_s)).abs() < 1e-12);
        }
    }

    #[test]
    fn an_idle_worker_starts_at_once_a_busy_one_finishes_its_step_first() {
        let r = request(200, 0, 0.0);
        let idle = estimate(&DynamoPoly, &worker(0, 0, 0), &r, W);
        assert!((idle.ttft_s * 1e3 - DynamoPoly.prefill_ms(200).unwrap()).abs() < 1e-9);
        let busy = estimate(&DynamoPoly, &worker(0, 4, 4096), &r, W);
        assert!(busy.ttft_s > idle.ttft_s);
    }

    #[test]
    fn churn_discounts_a_prefix_that_would_be_evicted_before_use() {
        let r = request(8192, 8192, 0.0);
        let mut w = worker(100_000, 8, 8 * 4096);
        let kept = estimate(&DynamoPoly, &w, &r, W);
        assert_eq!(kept.survive, 1.0);
        // A cache's worth of blocks every second: the ~2.5 s queue outlives the prefix.
        w.churn_blocks_per_s = (w.capacity_tokens / 64) as f64;
        let churned = estimate(&DynamoPoly, &w, &r, W);
        assert_eq!(churned.survive, 0.0);
        assert!(churned.ttft_s > kept.ttft_s);
    }

    #[test]
    fn a_long_expected_output_weighs_the_batch_it_joins() {
        // Same TTFT; one batch already holds much KV and long decodes ahead.
        let r = request(100, 0, 5000.0);
        let light = estimate(&DynamoPoly, &worker(0, 8, 8 * 1000), &r, W);
        let mut heavy_w = worker(0, 8, 8 * 1000);
        heavy_w.expected_output_tokens = 8.0 * 20_000.0;
        let heavy = estimate(&DynamoPoly, &heavy_w, &r, W);
        assert!((light.ttft_s - heavy.ttft_s).abs() < 1e-12);
        assert!(heavy.decode_s > light.decode_s);
        let ttft_only = CostWeights {
            decode: 0.0,
            prefill: 0.0,
            replica: 0.0,
        };
        assert!(estimate(&DynamoPoly, &heavy_w, &r, ttft_only).total == heavy.ttft_s);
    }

    #[test]
    fn a_hot_prefix_earns_a_replica_where_its_holder_is_busier() {
        // seed001's shape: one worker holds a 6,144-token prefix and decodes 2 requests; an idle
        // worker lacks it. For this request alone the holder is cheaper ...
        let r = request(6200, 6144, 200.0);
        let holder = estimate(&DynamoPoly, &worker(0, 2, 2 * 6400), &r, W);
        let idle = worker(0, 0, 0);
        let copy = estimate(&DynamoPoly, &idle, &request(6200, 0, 200.0), W);
        assert!(copy.total > holder.total);
        // ... but were the idle worker a holder, the next request would be cheaper there.
        let as_holder = estimate(&DynamoPoly, &idle, &r, W);
        let saving = holder.total - as_holder.total;
        assert!(saving > 0.0);
        // Forty-eight requests on the prefix in the last window: the copy pays for itself.
        let credit = replica_credit_s(W.replica, 48.0, 1, saving);
        assert!(
            copy.total - credit < holder.total,
            "{} {credit}",
            copy.total
        );
        // A cold prefix (one request, this one) does not; nor does a candidate no better placed.
        assert!(copy.total - replica_credit_s(W.replica, 1.0, 1, saving) > holder.total);
        assert_eq!(replica_credit_s(W.replica, 48.0, 1, -saving), 0.0);
        assert_eq!(replica_credit_s(0.0, 48.0, 1, saving), 0.0);
        // More holders already: each new one takes a smaller share.
        assert!(replica_credit_s(1.0, 48.0, 3, saving) < credit);
    }

    #[test]
    fn a_cold_group_spreads_by_running_siblings() {
        let p: Vec<f64> = cold_group_spread(&[2, 1, 1, 3]).collect();
        assert_eq!(
            p,
            [COLD_SPREAD_PENALTY_S, 0.0, 0.0, 2.0 * COLD_SPREAD_PENALTY_S]
        );
        assert_eq!(cold_group_spread(&[]).count(), 0);
    }

    #[test]
    fn siblings_already_there_make_a_worker_dearer_for_decode() {
        let w = worker(0, 8, 8 * 1000);
        let alone = estimate(&DynamoPoly, &w, &request(100, 0, 3000.0), W);
        let mut r = request(100, 0, 3000.0);
        r.siblings_here = 3;
        let crowded = estimate(&DynamoPoly, &w, &r, W);
        assert!(crowded.decode_s > alone.decode_s);
        assert_eq!(crowded.ttft_s, alone.ttft_s);
    }
}
