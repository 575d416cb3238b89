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

#[test]
fn a_request_joining_queued_prefill_adds_its_tokens_not_a_step_of_its_own() {
    // A burst sibling: the worker already queues its elder's 2,000-token prefill; the sibling's
    // 18 uncached tokens share those steps.
    let r = request(2018, 2000, 64.0);
    let queued = estimate(&DynamoPoly, &worker(2000, 1, 2048), &r, W);
    let p = |t| DynamoPoly.prefill_ms(t).unwrap();
    assert!((queued.prefill_s * 1e3 - (p(2018) - p(2000))).abs() < 1e-9);
    assert!(
        queued.prefill_s * 1e3 < 0.02 * p(18),
        "{}",
        queued.prefill_s
    );
    // With nothing queued it pays the whole prefill, step cost included.
    let idle = estimate(&DynamoPoly, &worker(0, 0, 0), &request(2018, 0, 64.0), W);
    assert!((idle.prefill_s * 1e3 - p(2018)).abs() < 1e-9);
    // Across chunk boundaries it is the difference of the two chunked schedules.
    let long = estimate(
        &DynamoPoly,
        &worker(8000, 1, 8192),
        &request(500, 0, 64.0),
        W,
    );
    let want = chunked_prefill_ms(&DynamoPoly, 8500, 8192, 0.0)
        - chunked_prefill_ms(&DynamoPoly, 8000, 8192, 0.0);
    assert!((long.prefill_s * 1e3 - want).abs() < 1e-9);
}
