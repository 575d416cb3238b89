//! Sibling bursts: the same prompt many times, routed before any KV event tells the router where
//! its blocks are. The ledger knows which ranks hold it in flight; an engine computes those
//! blocks once, so a sibling there adds no prefill, and the `cost` mode keeps a burst together.

use super::tests::{request, router, router_with, tokens, BS};
use super::*;
use std::time::Duration;

fn at(ms: u64) -> Time {
    Time::ZERO + Duration::from_millis(ms)
}

fn pinned(id: u64, prompt: &[u32], worker: u64) -> RouteRequest {
    let mut q = request(id, prompt);
    q.pin = Some(Pin {
        worker: WorkerId(worker),
        dp_rank: None,
    });
    q
}

#[test]
fn a_sibling_in_flight_adds_only_its_uncached_tail_to_the_prefill_queue() {
    for mode in [RouterMode::Kv, RouterMode::Cost] {
        let mut r = router(mode, 2);
        // 10 full blocks and a 2-token tail.
        let prompt = tokens(1, 10 * BS as u32 + 2);
        let first = r.route(&pinned(1, &prompt, 0), at(0)).unwrap();
        assert_eq!(first.cached_tokens, 0);
        let rank = first.rank;
        assert_eq!(r.load(rank).active_prefill_tokens, 42);
        let second = r.route(&pinned(2, &prompt, 0), at(1)).unwrap();
        assert_eq!(
            second.cached_tokens, 40,
            "{mode}: the held prefix is predicted cached"
        );
        assert_eq!(r.load(rank).active_prefill_tokens, 42 + 2, "{mode}");
        // The elder's first token: its share leaves the queue, the sibling's tail stays.
        r.first_token(RequestId(1)).unwrap();
        assert_eq!(r.load(rank).active_prefill_tokens, 2, "{mode}");
        // Elsewhere the same prompt is all prefill.
        r.route(&pinned(3, &prompt, 1), at(2)).unwrap();
        assert_eq!(
            r.load(WorkerRank::new(WorkerId(1), 0))
                .active_prefill_tokens,
            42,
            "{mode}"
        );
        for id in 1..=3 {
            let _ = r.finish(RequestId(id), at(3)).unwrap();
        }
        assert_eq!(r.load(rank).active_prefill_tokens, 0, "{mode}");
        r.check_invariants().unwrap();
    }
}

#[test]
fn cost_keeps_each_prompt_of_a_burst_on_one_worker() {
    // The live GRPO burst of bench/peers (small): 4 prompts × 12 samples of about 2,000 tokens,
    // all at once over 4 workers, no group headers and no KV event yet. Prefilling a prompt on
    // a second worker costs as much as the whole group's decode there saves. The same with a
    // predicted-placement window, whose predictions are not a cache a copy could be made of.
    for predicted in [None, Some(5.0)] {
        burst_on_one_worker_each(predicted);
    }
}

fn burst_on_one_worker_each(predicted: Option<f64>) {
    let mut r = router_with(
        RouterConfig {
            router_mode: RouterMode::Cost,
            router_predicted_ttl_secs: predicted,
            ..Default::default()
        },
        4,
    );
    let mut holders = Vec::new();
    for p in 0..4u64 {
        let prompt = tokens(20 + p as u32, 2003);
        let mut on = [0u32; 4];
        for i in 0..12u64 {
            let d = r.route(&request(p * 100 + i + 1, &prompt), at(0)).unwrap();
            on[d.rank.worker.0 as usize] += 1;
        }
        holders.push(on);
    }
    let copies: usize = holders
        .iter()
        .map(|on| on.iter().filter(|n| **n > 0).count())
        .sum();
    assert_eq!(
        copies, 4,
        "each prompt prefilled once ({predicted:?}): {holders:?}"
    );
    // And the fleet is used: one prompt per worker.
    for w in 0..4 {
        assert_eq!(
            holders.iter().filter(|on| on[w] > 0).count(),
            1,
            "{holders:?}"
        );
    }
}

#[test]
fn cost_keeps_a_burst_together_when_its_kv_events_arrive_mid_burst() {
    // The same burst as live: 4 prompts × 12 samples sent one after another 0.2 ms apart (the
    // bench's pace), engines 10× dynamo-poly, and each prompt's blocks reported cached by its
    // engine 1 ms after its first sample was placed, while its siblings are still arriving.
    // From then on the prefix is cached somewhere and twelve requests on it arrived within a
    // few milliseconds; that is a burst, not traffic a copy would serve sooner, so the replica
    // credit must not split it.
    let mut r = router_with(
        RouterConfig {
            router_mode: RouterMode::Cost,
            router_cost_speedup_ratio: 10.0,
            ..Default::default()
        },
        4,
    );
    let us = |n: u64| Time::ZERO + Duration::from_micros(n);
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|p| tokens(40 + p, 2003)).collect();
    let mut holders = [[0u32; 4]; 4];
    let mut pending: Vec<(u64, u64, usize)> = Vec::new(); // (due µs, worker, prompt)
    for n in 0..48u64 {
        let now = n * 200;
        for (_, w, p) in pending.iter().filter(|(due, ..)| *due <= now) {
            r.apply_event(&super::tests::store_event(*w, &prompts[*p][..2000]))
                .unwrap();
        }
        pending.retain(|(due, ..)| *due > now);
        let p = (n / 12) as usize;
        let d = r.route(&request(n + 1, &prompts[p]), us(now)).unwrap();
        let w = d.rank.worker.0;
        if n % 12 == 0 {
            pending.push((now + 1000, w, p));
        }
        holders[p][w as usize] += 1;
    }
    for (p, on) in holders.iter().enumerate() {
        assert_eq!(
            on.iter().filter(|n| **n > 0).count(),
            1,
            "prompt {p} prefilled on more than one worker: {holders:?}"
        );
    }
}

#[test]
fn a_request_that_may_produce_one_token_teaches_no_output_length() {
    // bench/peers checks each router with a `max_tokens: 1` completion before timing it. As the
    // first finished request it set the expected output to 1 token, so the decode terms of the
    // GRPO burst that followed (and the burst gate of the replica credit) were near 0.
    let mut r = router(RouterMode::Cost, 2);
    let prior = crate::policy::learn::PRIOR_OUTPUT_TOKENS;
    assert_eq!(r.expected_output(), prior);
    let mut probe = request(1, &tokens(1, 4));
    probe.max_output_tokens = Some(1);
    r.route(&probe, at(0)).unwrap();
    r.observe_output(RequestId(1), 1, at(1));
    let _ = r.finish(RequestId(1), at(1)).unwrap();
    assert_eq!(r.expected_output(), prior, "a probe is not a sample");
    // A request that could have gone on is one, whatever it asked for.
    let mut q = request(2, &tokens(2, 4));
    q.max_output_tokens = Some(64);
    r.route(&q, at(2)).unwrap();
    r.observe_output(RequestId(2), 64, at(3));
    let _ = r.finish(RequestId(2), at(3)).unwrap();
    assert_eq!(r.expected_output(), 64.0);

    // A reported length past what the request could produce (a pick's finish report may say
    // anything) is learnt as its budget, and one past any answer's length as the sample bound:
    // one report of 2^32 − 1 tokens had set every later request's expected length.
    let mut r = router(RouterMode::Cost, 2);
    let mut q = request(3, &tokens(3, 4));
    q.max_output_tokens = Some(100);
    r.route(&q, at(0)).unwrap();
    r.observe_output(RequestId(3), u64::from(u32::MAX), at(1));
    let _ = r.finish(RequestId(3), at(1)).unwrap();
    assert_eq!(r.expected_output(), 100.0);
    let mut r = router(RouterMode::Cost, 2);
    r.route(&request(4, &tokens(4, 4)), at(0)).unwrap();
    r.observe_output(RequestId(4), u64::from(u32::MAX), at(1));
    let _ = r.finish(RequestId(4), at(1)).unwrap();
    let most = crate::policy::learn::MAX_OUTPUT_SAMPLE as f64;
    assert_eq!(r.expected_output(), most);
}
