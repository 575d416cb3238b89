use super::tests::{request, router, store_event, tokens, BS};
use super::*;
use crate::policy::cost::{estimate, CostWeights, RequestPicture, WorkerPicture};
use crate::timing::DynamoPoly;
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;

fn at(ms: u64) -> Time {
    Time::ZERO + Duration::from_millis(ms)
}

/// The `cost` mode with the online fit on.
fn fit_config() -> RouterConfig {
    RouterConfig {
        router_mode: RouterMode::Cost,
        kv_cache_block_size: BS,
        router_cost_fit: true,
        ..Default::default()
    }
}

/// The estimate for `rank` rebuilt from the router's public state alone (no learned lengths:
/// the prior), the naive model the policy must agree with.
fn naive_total(r: &Router, req: &RouteRequest, rank: WorkerRank) -> f64 {
    let bs = BS as u64;
    let load = r.load(rank);
    let overlap = r.overlaps(req).get(rank).gpu_blocks as u64;
    let held = r.ledger().held_prefix_blocks(rank, &req.blocks.sequence) as u64;
    let capacity = r.config().router_index_max_blocks_per_worker as u64 * bs;
    let w = WorkerPicture {
        prefill_queue_tokens: load.active_prefill_tokens,
        active_requests: load.active_requests,
        kv_tokens: load.active_decode_blocks * bs,
        expected_output_tokens: f64::from(load.active_requests) * 256.0,
        capacity_tokens: capacity,
        batch_tokens: 8192,
        churn_blocks_per_s: 0.0,
        block_size: bs,
    };
    let p = RequestPicture {
        isl_tokens: req.isl_tokens,
        cached_tokens: overlap.max(held) * bs,
        new_kv_tokens: (req.request_blocks(BS) - held) * bs,
        expected_output: 256.0,
        network_s: 0.0,
        siblings_here: 0,
        length_cv: 1.0,
    };
    estimate(&DynamoPoly, &w, &p, CostWeights::default()).total
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn cost_mode_takes_the_argmin_of_the_naive_estimates(
        loads in proptest::collection::vec((0u32..4, 1u32..600), 0..12),
        cached_on in 0u64..4,
        len in 1u32..800,
    ) {
        let mut r = router(RouterMode::Cost, 4);
        let prompt = tokens(7, len);
        r.apply_event(&store_event(cached_on, &prompt)).unwrap();
        for (i, (w, l)) in loads.iter().enumerate() {
            let mut q = request(100 + i as u64, &tokens(100 + i as u32, *l));
            q.pin = Some(Pin { worker: WorkerId(u64::from(*w)), dp_rank: None });
            r.route(&q, at(0)).unwrap();
        }
        let req = request(1, &prompt);
        let naive: Vec<(WorkerRank, f64)> =
            r.ranks().iter().map(|k| (*k, naive_total(&r, &req, *k))).collect();
        let d = r.route(&req, at(1)).unwrap();
        let min = naive.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
        let chosen = naive.iter().find(|x| x.0 == d.rank).unwrap().1;
        prop_assert!(chosen <= min * (1.0 + 1e-9), "chose {chosen}, min {min}: {naive:?} {:?}", d.candidates);
        for s in &d.candidates {
            let n = naive.iter().find(|x| x.0 == s.rank).unwrap().1;
            prop_assert!((s.total - n).abs() <= 1e-9 * n.max(1e-9), "{} vs {n}", s.total);
        }
    }
}

#[test]
fn a_sibling_burst_follows_the_first_before_any_kv_event() {
    let mut r = router(RouterMode::Cost, 4);
    let prompt = tokens(3, 4000);
    let first = r.route(&request(1, &prompt), at(0)).unwrap();
    // No KV event yet: the second copy sees the first's blocks in flight there.
    let second = r.route(&request(2, &prompt), at(1)).unwrap();
    assert_eq!(second.rank, first.rank);
    // A request for another prompt goes to an idle worker.
    let other = r.route(&request(3, &tokens(4, 4000)), at(2)).unwrap();
    assert_ne!(other.rank, first.rank);
}

#[test]
fn a_group_learned_long_spreads_its_siblings() {
    let mut r = router(RouterMode::Cost, 2);
    let prompt = tokens(8, 40);
    // Ungrouped requests of 50 tokens, then group 1 finished a sample of 20,000 tokens and
    // group 2 one of 50.
    let mut finished = vec![(90u64, None, 50u64); 40];
    finished.extend([(0, Some(1u64), 20_000u64), (0, Some(2), 50)]);
    for (i, (_, g, out)) in finished.into_iter().enumerate() {
        let id = 1000 + i as u64;
        let mut q = request(id, &tokens(1000 + i as u32, 40));
        q.group = g;
        r.route(&q, at(0)).unwrap();
        r.observe_output(RequestId(id), out, at(1));
        let _ = r.finish(RequestId(id), at(1)).unwrap();
    }
    let mut a = request(1, &prompt);
    a.group = Some(1);
    let first = r.route(&a, at(2)).unwrap().rank;
    let mut b = request(2, &prompt);
    b.group = Some(1);
    // The prefix is held on `first`, but the pair would decode ~10k tokens side by side there.
    let d = r.route(&b, at(3)).unwrap();
    assert_ne!(d.rank, first, "{:?}", d.candidates);
    // Short siblings stay together with their prefix.
    let mut c = request(3, &tokens(9, 4000));
    c.group = Some(2);
    let home = r.route(&c, at(4)).unwrap().rank;
    let mut d = request(4, &tokens(9, 4000));
    d.group = Some(2);
    assert_eq!(r.route(&d, at(5)).unwrap().rank, home);
}

#[test]
fn the_online_fit_learns_a_workers_prefill_line() {
    let mut r = Router::new(fit_config()).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(0))).unwrap();
    assert!(r.fitted_profile(WorkerId(0)).is_none());
    for i in 0..20u64 {
        let len = 100 + 100 * i as u32;
        r.route(&request(i, &tokens(i as u32, len)), at(1000 * i))
            .unwrap();
        // TTFT = 10 ms + 0.02 ms per token to prefill.
        let ttft = 10.0 + 0.02 * f64::from(len);
        r.observe_first_token(
            RequestId(i),
            at(1000 * i) + Duration::from_secs_f64(ttft / 1e3),
        );
        r.observe_output(RequestId(i), 10, at(1000 * i + 500));
        let _ = r.finish(RequestId(i), at(1000 * i + 500)).unwrap();
    }
    let (a, b) = r
        .fitted_profile(WorkerId(0))
        .unwrap()
        .prefill
        .line()
        .unwrap();
    assert!((a - 10.0).abs() < 0.1 && (b - 0.02).abs() < 1e-4, "{a} {b}");
}

#[test]
fn a_fits_new_point_makes_its_workers_kept_terms_stale() {
    let config = fit_config();
    let (mut kept, mut fresh) = (
        Router::new(config.clone()).unwrap(),
        Router::new(config).unwrap(),
    );
    let pinned = |id: u64, len: u32| {
        let mut q = request(id, &tokens(id as u32, len));
        q.pin = Some(Pin {
            worker: WorkerId(0),
            dp_rank: None,
        });
        q
    };
    for r in [&mut kept, &mut fresh] {
        for w in 0..2 {
            // Small steps, so the kept full-step time enters every estimate.
            let mut spec = WorkerSpec::new(WorkerId(w));
            spec.max_num_batched_tokens = Some(256);
            r.add_worker(spec).unwrap();
        }
        // Two TTFTs on worker 0 (its prefill line answers from the third).
        r.route(&pinned(1, 300), at(0)).unwrap();
        r.route(&pinned(2, 900), at(1)).unwrap();
        r.observe_first_token(RequestId(1), at(40));
        r.observe_first_token(RequestId(2), at(90));
        // Worker 0's terms are kept here; a third TTFT then gives it a line, and the request
        // ends, so its picture is what it was.
        r.route(&pinned(3, 600), at(100)).unwrap();
        r.observe_first_token(RequestId(3), at(900));
        let _ = r.finish(RequestId(3), at(901)).unwrap();
    }
    fresh.forget_kept_terms();
    let probe = request(4, &tokens(9, 700));
    assert_eq!(kept.route(&probe, at(902)), fresh.route(&probe, at(902)));
}

#[test]
fn what_the_policy_learns_of_a_worker_goes_with_it() {
    // Discovery churn: workers come and go under new ids; each stores blocks, serves three
    // requests (expected lengths differ and are fractional, as learned lengths are) and has its
    // speed fitted. Two of its requests are still running when it leaves, and every tenth
    // worker comes back under the same id while they do.
    let mut r = Router::new(fit_config()).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(0))).unwrap();
    for i in 1..=200u64 {
        let now = at(100 * i);
        let later = now + Duration::from_millis(50);
        r.add_worker(WorkerSpec::new(WorkerId(i))).unwrap();
        r.apply_event(&store_event(i, &tokens(i as u32, 256)))
            .unwrap();
        let ids = [3 * i, 3 * i + 1, 3 * i + 2].map(RequestId);
        for (k, id) in ids.iter().enumerate() {
            let mut q = request(id.0, &tokens(i as u32, 300));
            q.pin = Some(Pin {
                worker: WorkerId(i),
                dp_rank: None,
            });
            r.route(&q, now).unwrap();
            if k == 1 {
                // The first ends: a length learned between placements moves the third's
                // expectation, so the rank's sum of them need not return to exactly 0.
                r.observe_first_token(ids[0], now + Duration::from_millis(20));
                r.observe_output(ids[0], 7 + i % 13, later);
                let _ = r.finish(ids[0], later).unwrap();
            }
        }
        r.remove_worker(WorkerId(i)).unwrap();
        let back = i % 10 == 0;
        if back {
            r.add_worker(WorkerSpec::new(WorkerId(i))).unwrap();
        }
        // The requests that were running there end now: their timings are not the new
        // worker's (nor a removed one's) to fit.
        r.observe_first_token(ids[1], later);
        for id in &ids[1..] {
            r.observe_output(*id, 11 + i % 7, later);
            let _ = r.finish(*id, later).unwrap();
        }
        assert!(r.fitted_profile(WorkerId(i)).is_none(), "worker {i}");
        if back {
            r.remove_worker(WorkerId(i)).unwrap();
        }
        assert_eq!(r.cost_rank_entries(), 0, "after worker {i}");
    }
}

#[test]
fn a_workers_profile_prices_it_and_goes_when_it_is_removed() {
    // Two idle workers, one given a profile twice as slow: every request goes to the other
    // (without profiles, exact ties go round the fleet). Removed and registered again under the
    // same id, the slow one is priced as the default again, so ties rotate once more.
    let config = RouterConfig {
        router_mode: RouterMode::Cost,
        kv_cache_block_size: BS,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..2 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    r.set_worker_timing(WorkerId(1), Arc::new(Slower));
    let place = |r: &mut Router, id: u64| {
        let d = r
            .route(&request(id, &tokens(id as u32, 64)), at(id))
            .unwrap();
        let _ = r.finish(RequestId(id), at(id)).unwrap();
        d.rank.worker
    };
    for id in 0..4 {
        assert_eq!(place(&mut r, id), WorkerId(0), "request {id}");
    }
    r.remove_worker(WorkerId(1)).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(1))).unwrap();
    let placed: Vec<_> = (4..8).map(|id| place(&mut r, id)).collect();
    assert!(placed.contains(&WorkerId(1)), "{placed:?}");
}

#[test]
fn a_hot_prefix_is_copied_to_an_idle_worker_a_cold_one_is_not() {
    // seed001's shape: worker 0 holds a 6,000-token prefix; requests on it arrive every 500 ms
    // and decode for 1.2 s, so the holder is usually busy while worker 1 idles.
    let shared = tokens(8, 6000);
    let run = |hot: bool| {
        let mut r = router(RouterMode::Cost, 3);
        r.apply_event(&store_event(0, &shared)).unwrap();
        let mut on = [0u32; 3];
        let mut live: Vec<(u64, u64)> = Vec::new();
        for i in 0..60u64 {
            let t = i * 500;
            for (id, _) in live.iter().filter(|(_, end)| *end <= t) {
                let _ = r.finish(RequestId(*id), at(t)).unwrap();
            }
            live.retain(|(_, end)| *end > t);
            // The hot run repeats the shared prefix; the cold one asks for a fresh one each time
            // (stored on worker 0 as if it had been computed there before).
            let prompt = if hot {
                let mut p = shared.clone();
                p.extend(tokens(1000 + i as u32, 200));
                p
            } else {
                let p = tokens(2000 + i as u32, 6200);
                r.apply_event(&store_event(0, &p)).unwrap();
                p
            };
            let d = r.route(&request(i + 1, &prompt), at(t)).unwrap();
            on[d.rank.worker.0 as usize] += 1;
            live.push((i + 1, t + 1200));
        }
        on
    };
    let hot = run(true);
    assert!(
        hot[1] + hot[2] > 0,
        "the hot prefix never got a second holder: {hot:?}"
    );
    // A prefix seen once is not worth a copy: every request stays with its holder.
    assert_eq!(run(false), [60, 0, 0]);
}

#[test]
fn a_hot_prefix_leaves_one_worker_free_for_uncached_prompts() {
    // seed001's shape under heavier traffic: requests on one hot prefix every 150 ms, each
    // decoding for 1.2 s (about 8 in flight), over 4 workers. The replica credit copies the
    // prefix while that keeps one worker holding none of it, so a large uncached prompt arriving
    // later finds a worker without the prefix's decodes (the p99 of seed001).
    let shared = tokens(8, 6000);
    let mut r = router(RouterMode::Cost, 4);
    r.apply_event(&store_event(0, &shared)).unwrap();
    let mut on = [0u32; 4];
    let mut live: Vec<(u64, u64)> = Vec::new();
    for i in 0..80u64 {
        let t = i * 150;
        for (id, _) in live.iter().filter(|(_, end)| *end <= t) {
            let _ = r.finish(RequestId(*id), at(t)).unwrap();
        }
        live.retain(|(_, end)| *end > t);
        let mut p = shared.clone();
        p.extend(tokens(1000 + i as u32, 200));
        let d = r.route(&request(i + 1, &p), at(t)).unwrap();
        on[d.rank.worker.0 as usize] += 1;
        live.push((i + 1, t + 1200));
    }
    assert!(
        on.iter().filter(|n| **n > 0).count() >= 2,
        "the hot prefix never got a second holder: {on:?}"
    );
    assert!(
        on.contains(&0),
        "every worker took the hot prefix, none left for uncached prompts: {on:?}"
    );
}

#[test]
fn a_group_placed_before_any_output_is_known_spreads_evenly() {
    // A GRPO step's first burst: 8 groups of 16 siblings, each group on its own 2,000-token
    // prompt, all at once over 8 workers, nothing finished yet. Their lengths are unknown and
    // correlated, so every group spreads 2 per worker rather than following its prefix.
    let mut r = router(RouterMode::Cost, 8);
    let mut per_group = Vec::new();
    for g in 0..8u64 {
        let prompt = tokens(10 + g as u32, 2000);
        let mut on = [0u32; 8];
        for i in 0..16u64 {
            let mut q = request(g * 100 + i + 1, &prompt);
            q.group = Some(g);
            on[r.route(&q, at(0)).unwrap().rank.worker.0 as usize] += 1;
        }
        per_group.push(on);
    }
    assert!(
        per_group.iter().all(|on| on.iter().all(|n| *n == 2)),
        "{per_group:?}"
    );
    // Once a length is known the cost decides again: a short group's siblings share a prefix.
    r.observe_output(RequestId(1), 50, at(20));
    let _ = r.finish(RequestId(1), at(20)).unwrap();
    let other = tokens(4, 4000);
    let mut a = request(10_000, &other);
    a.group = Some(99);
    let home = r.route(&a, at(21)).unwrap().rank;
    let mut b = request(10_001, &other);
    b.group = Some(99);
    assert_eq!(r.route(&b, at(22)).unwrap().rank, home);
}

/// A profile twice as slow as [`DynamoPoly`], to swap in mid-run.
#[derive(Debug)]
struct Slower;

impl crate::timing::TimingModel for Slower {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, crate::timing::TimingError> {
        Ok(2.0 * DynamoPoly.prefill_ms(tokens)?)
    }
    fn decode_ms(
        &self,
        shape: &crate::timing::StepShape,
    ) -> Result<f64, crate::timing::TimingError> {
        Ok(2.0 * DynamoPoly.decode_ms(shape)?)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Route { prompt: u32, len: u32 },
    Finish(usize),
    FirstToken(usize),
    Output(usize, u64),
    Store(u64, u32),
    Slow(u64),
    Remove(u64),
    Add(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..5, 1u32..700).prop_map(|(prompt, len)| Op::Route { prompt, len }),
        2 => (0usize..64).prop_map(Op::Finish),
        1 => (0usize..64).prop_map(Op::FirstToken),
        1 => (0usize..64, 2u64..400).prop_map(|(i, n)| Op::Output(i, n)),
        1 => (0u64..4, 0u32..5).prop_map(|(w, p)| Op::Store(w, p)),
        1 => (0u64..4).prop_map(Op::Slow),
        1 => (0u64..4).prop_map(Op::Remove),
        1 => (0u64..4).prop_map(Op::Add),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The steady terms kept across decisions change nothing: a router that forgets them before
    /// every decision makes the same decisions with the same figures, whatever happens between
    /// (loads moving, churn, the online fit's new points, a new profile, workers leaving and
    /// coming back).
    #[test]
    fn kept_worker_terms_decide_as_fresh_ones(ops in proptest::collection::vec(op(), 1..60)) {
        let config = fit_config();
        let mut kept = Router::new(config.clone()).unwrap();
        let mut fresh = Router::new(config).unwrap();
        for r in [&mut kept, &mut fresh] {
            for w in 0..4 {
                r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
            }
        }
        let mut active: Vec<RequestId> = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            let now = at(10 * step as u64);
            let pick = |i: &usize| active.get(i % active.len().max(1)).copied();
            match op {
                Op::Route { prompt, len } => {
                    let req = request(step as u64, &tokens(*prompt, *len));
                    fresh.forget_kept_terms();
                    let (a, b) = (kept.route(&req, now), fresh.route(&req, now));
                    prop_assert_eq!(&a, &b);
                    if a.is_ok() {
                        active.push(req.id);
                    }
                }
                Op::Finish(i) => {
                    if let Some(id) = pick(i) {
                        active.retain(|x| *x != id);
                        prop_assert_eq!(kept.finish(id, now).is_ok(), fresh.finish(id, now).is_ok());
                    }
                }
                Op::FirstToken(i) => {
                    if let Some(id) = pick(i) {
                        kept.observe_first_token(id, now);
                        fresh.observe_first_token(id, now);
                    }
                }
                Op::Output(i, n) => {
                    if let Some(id) = pick(i) {
                        kept.observe_output(id, *n, now);
                        fresh.observe_output(id, *n, now);
                    }
                }
                Op::Store(w, p) => {
                    let e = store_event(*w, &tokens(*p, 256));
                    prop_assert_eq!(kept.apply_event(&e).is_ok(), fresh.apply_event(&e).is_ok());
                }
                Op::Slow(w) => {
                    kept.set_worker_timing(WorkerId(*w), Arc::new(Slower));
                    fresh.set_worker_timing(WorkerId(*w), Arc::new(Slower));
                }
                Op::Remove(w) => {
                    prop_assert_eq!(
                        kept.remove_worker(WorkerId(*w)).is_ok(),
                        fresh.remove_worker(WorkerId(*w)).is_ok()
                    );
                }
                Op::Add(w) => {
                    let mut spec = WorkerSpec::new(WorkerId(*w));
                    spec.kv_capacity_blocks = Some(64 + 64 * *w);
                    prop_assert_eq!(kept.add_worker(spec.clone()).is_ok(), fresh.add_worker(spec).is_ok());
                }
            }
        }
    }
}
