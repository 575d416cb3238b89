//! Predicted cache state: approximate mode (no KV events at all), the predicted-placement
//! window beside the events, and a worker whose events do not reach the router.

use super::tests::{request, router_with, tokens, BS};
use super::*;

/// A router in approximate mode (no KV events), entries kept 10 s, over `workers` workers.
fn approximate(workers: u64) -> Router {
    let config = RouterConfig {
        router_kv_events: false,
        router_ttl_secs: 10.0,
        ..Default::default()
    };
    router_with(config, workers)
}

#[test]
fn approximate_mode_learns_from_its_own_decisions_and_forgets_after_the_ttl() {
    let mut r = approximate(4);
    let prompt = tokens(5, 64);
    let first = r.route(&request(1, &prompt), Time::ZERO).unwrap();
    r.first_token(RequestId(1)).unwrap();
    let _ = r.finish(RequestId(1), Time::from_secs_f64(5.0)).unwrap();
    let again = r
        .route(&request(2, &prompt), Time::from_secs_f64(5.0))
        .unwrap();
    assert_eq!(again.rank, first.rank);
    assert_eq!(again.overlap.gpu_blocks, 16);
    let _ = r.finish(RequestId(2), Time::from_secs_f64(16.0)).unwrap();
    let late = r
        .route(&request(3, &prompt), Time::from_secs_f64(16.0))
        .unwrap();
    assert_eq!(late.overlap.gpu_blocks, 0, "expired after the ttl");
    r.check_invariants().unwrap();
}

#[test]
fn predicted_window_keeps_siblings_together_before_events_arrive() {
    let config = RouterConfig {
        kv_cache_block_size: BS,
        router_predicted_ttl_secs: Some(5.0),
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..8 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let prompt = tokens(7, 400);
    let first = r.route(&request(1, &prompt), Time::ZERO).unwrap();
    // The first sibling is past its prefill, but its KV events have not arrived yet.
    r.first_token(RequestId(1)).unwrap();
    for i in 2..6 {
        let d = r.route(&request(i, &prompt), Time::ZERO).unwrap();
        assert_eq!(
            d.rank, first.rank,
            "sibling {i} follows the predicted prefix"
        );
    }
    // The event-fed index was never written by predictions.
    assert_eq!(r.index().stats().entries, 0);
}

#[test]
fn a_worker_without_kv_events_has_its_cache_predicted_and_the_others_do_not() {
    // Events on (the default): worker 0's events reach the router, worker 1's do not. What is
    // routed to worker 1 is its predicted cache (as with events off); worker 0 is seen only
    // through its events, so a prompt routed there is not predicted.
    let mut r = Router::new(RouterConfig {
        kv_cache_block_size: BS,
        router_mode: RouterMode::Kv,
        ..Default::default()
    })
    .unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(0))).unwrap();
    r.add_worker(WorkerSpec {
        kv_events: false,
        ..WorkerSpec::new(WorkerId(1))
    })
    .unwrap();
    let pinned = |id: u64, prompt: u32, worker: u64| {
        let mut q = request(id, &tokens(prompt, 4 * BS as u32));
        q.pin = Some(Pin {
            worker: WorkerId(worker),
            dp_rank: None,
        });
        q
    };
    let at = |s: u64| Time::ZERO + std::time::Duration::from_secs(s);
    for (id, prompt, worker) in [(1, 1, 1), (2, 2, 0)] {
        r.route(&pinned(id, prompt, worker), at(id)).unwrap();
        let _ = r.finish(RequestId(id), at(id)).unwrap();
    }
    let seen = |r: &Router, prompt: u32, worker: u64| {
        r.overlaps(&request(9, &tokens(prompt, 4 * BS as u32)))
            .get(WorkerRank::new(WorkerId(worker), 0))
            .gpu_blocks
    };
    assert_eq!(seen(&r, 1, 1), 4, "predicted where no events come");
    assert_eq!(seen(&r, 2, 0), 0, "not predicted where events come");
    let d = r
        .route(&request(3, &tokens(1, 4 * BS as u32)), at(3))
        .unwrap();
    assert_eq!(
        d.rank.worker,
        WorkerId(1),
        "the prompt goes back to its predicted cache"
    );
    // Gone with the worker; and a worker registered again with events is not predicted.
    let _ = r.finish(RequestId(3), at(3)).unwrap();
    r.remove_worker(WorkerId(1)).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(1))).unwrap();
    assert_eq!(seen(&r, 1, 1), 0);
    r.route(&pinned(4, 5, 1), at(4)).unwrap();
    assert_eq!(seen(&r, 5, 1), 0);
}

#[test]
fn a_caller_with_an_older_clock_does_not_cut_a_parents_prediction_short() {
    let mut r = approximate(1);
    let ms = |m: f64| Time::from_secs_f64(m / 1e3);
    let (long, short) = (tokens(5, 2 * BS as u32), tokens(5, BS as u32));
    r.route(&request(1, &long), ms(100.0)).unwrap();
    let _ = r.finish(RequestId(1), ms(100.0)).unwrap();
    // A caller that read its clock before the first one but took the lock after it: the first
    // block, sent again, must not expire before the second, which hangs from it.
    r.route(&request(2, &short), ms(99.0)).unwrap();
    let _ = r.finish(RequestId(2), ms(99.0)).unwrap();
    let probe = r.route(&request(3, &long), ms(10_099.5)).unwrap();
    assert_eq!(probe.overlap.gpu_blocks, 2);
    r.check_invariants().unwrap();
}
