use super::*;
use crate::WorkloadRequest;
use kvrouter_core::rng::SeededRng;
use std::collections::HashSet;

/// A request of `blocks` full 64-token blocks plus one token (so every block may be a hit).
fn req(blocks: Vec<u64>) -> WorkloadRequest {
    WorkloadRequest {
        arrival_ms: Some(0.0),
        after: None,
        delay_ms: 0.0,
        session: None,
        input_tokens: blocks.len() as u32 * 64 + 1,
        blocks,
        output_tokens: 1,
        group: None,
        step: None,
        policy_version: None,
    }
}

fn workload(requests: Vec<WorkloadRequest>) -> Workload {
    Workload {
        name: "t".into(),
        block_size: 64,
        requests,
        barrier: None,
    }
}

#[test]
fn a_tiny_trace_by_hand() {
    // Blocks A = [1], B = [1, 2], C = [3]; accesses A B C A B C; 388 prompt tokens.
    let w = workload(vec![
        req(vec![1, 2]),
        req(vec![3]),
        req(vec![1, 2]),
        req(vec![3]),
    ]);
    let c = finite_ceilings(&w, &[0, 1, 2, 3], 64, 2);
    // Optimal with 2 blocks: keep A and B, do not cache C: 2 hits.
    assert!((c.optimal - 128.0 / 388.0).abs() < 1e-12, "{c:?}");
    // LRU with 2 blocks: C evicts A, so the third request finds no prefix; C was evicted again.
    assert_eq!(c.lru, 0.0);
    assert!((c.unbounded - 192.0 / 388.0).abs() < 1e-12);
    assert_eq!(unbounded_ceiling(&w, &[0, 1, 2, 3], 64), c.unbounded);
    // Enough room: optimal reaches the unbounded figure.
    assert_eq!(
        finite_ceilings(&w, &[0, 1, 2, 3], 64, 3).optimal,
        c.unbounded
    );
    assert_eq!(finite_ceilings(&w, &[0, 1, 2, 3], 64, 0).optimal, 0.0);
}

#[test]
fn the_last_prompt_token_is_never_a_hit() {
    // Exactly one block of 64 tokens: the engine computes the last token, so no hit is possible.
    let mut r = req(vec![5]);
    r.input_tokens = 64;
    let w = workload(vec![r.clone(), r]);
    assert_eq!(finite_ceilings(&w, &[0, 1], 64, 10).unbounded, 0.0);
}

/// The best hit count over every caching decision (cache or not, evict any block), found by
/// exhaustive search: the naive model Belady's MIN must match.
fn naive_optimal(accesses: &[Access], capacity: usize, cache: &mut Vec<u64>) -> u64 {
    let Some((a, rest)) = accesses.split_first() else {
        return 0;
    };
    if cache.contains(&a.key) {
        // Keep it, or drop it (never better, but the search does not assume so).
        let hit = u64::from(a.counted);
        let keep = naive_optimal(rest, capacity, cache);
        let pos = cache.iter().position(|k| *k == a.key).expect("present");
        cache.remove(pos);
        let drop = naive_optimal(rest, capacity, cache);
        cache.insert(pos, a.key);
        return hit + keep.max(drop);
    }
    let mut best = naive_optimal(rest, capacity, cache);
    if cache.len() < capacity {
        cache.push(a.key);
        best = best.max(naive_optimal(rest, capacity, cache));
        cache.pop();
    } else {
        for v in 0..cache.len() {
            let old = std::mem::replace(&mut cache[v], a.key);
            best = best.max(naive_optimal(rest, capacity, cache));
            cache[v] = old;
        }
    }
    best
}

#[test]
fn belady_matches_exhaustive_search_on_random_small_sequences() {
    for seed in 0..300u64 {
        let mut rng = SeededRng::new(seed);
        let len = 1 + rng.below(9);
        let accesses: Vec<Access> = (0..len)
            .map(|_| Access {
                key: rng.below(4) as u64,
                counted: rng.below(4) != 0,
            })
            .collect();
        for capacity in 0..3 {
            assert_eq!(
                belady_hits(&accesses, capacity as u64),
                naive_optimal(&accesses, capacity, &mut Vec::new()),
                "seed {seed} capacity {capacity}: {accesses:?}"
            );
        }
    }
}

/// Hits of `workers` separate LRU prefix caches of `per_worker` blocks each, requests placed by
/// `place`: a naive fleet, independent of the code under test.
fn fleet_hits(
    w: &Workload,
    workers: usize,
    per_worker: usize,
    mut place: impl FnMut(usize) -> usize,
) -> f64 {
    let mut caches: Vec<Vec<u64>> = vec![Vec::new(); workers];
    let (mut hit_tokens, mut tokens) = (0u64, 0u64);
    for (i, r) in w.requests.iter().enumerate() {
        let cache = &mut caches[place(i)];
        let blocks = w.router_blocks(i, 64).sequence;
        let cap = (r.input_tokens as usize - 1) / 64;
        let hits = blocks
            .iter()
            .take(cap)
            .take_while(|s| cache.contains(&s.0))
            .count();
        hit_tokens += hits as u64 * 64;
        tokens += u64::from(r.input_tokens);
        for s in &blocks {
            cache.retain(|k| *k != s.0);
            cache.push(s.0);
            if cache.len() > per_worker {
                cache.remove(0);
            }
        }
    }
    hit_tokens as f64 / tokens as f64
}

#[test]
fn no_fleet_beats_the_optimal_ceiling_on_random_small_traces() {
    for seed in 0..200u64 {
        let mut rng = SeededRng::new(seed);
        // Prompts drawn from a few shared prefixes with private tails.
        let requests: Vec<WorkloadRequest> = (0..12)
            .map(|i| {
                let prefix = rng.below(3) as u64;
                let shared = 1 + rng.below(3);
                let mut blocks: Vec<u64> = (0..shared as u64).map(|k| prefix * 100 + k).collect();
                blocks.extend((0..rng.below(3) as u64).map(|k| 10_000 + i * 10 + k));
                req(blocks)
            })
            .collect();
        let w = workload(requests);
        let order: Vec<usize> = (0..w.requests.len()).collect();
        let (workers, per_worker) = (1 + rng.below(3), 1 + rng.below(5));
        let c = finite_ceilings(&w, &order, 64, (workers * per_worker) as u64);
        let mut policies: Vec<Box<dyn FnMut(usize) -> usize>> = vec![
            Box::new(|i| i % workers),
            Box::new(|_| 0),
            Box::new({
                let mut r = SeededRng::new(seed ^ 7);
                move |_| r.below(workers)
            }),
        ];
        for (p, place) in policies.iter_mut().enumerate() {
            let got = fleet_hits(&w, workers, per_worker, place);
            assert!(
                got <= c.optimal + 1e-12,
                "seed {seed} policy {p}: fleet {got} > ceiling {c:?}"
            );
        }
        assert!(c.lru <= c.optimal + 1e-12 && c.optimal <= c.unbounded + 1e-12);
        assert!((unbounded_ceiling(&w, &order, 64) - c.unbounded).abs() < 1e-12);
        let distinct: HashSet<u64> = order
            .iter()
            .flat_map(|&i| w.router_blocks(i, 64).sequence)
            .map(|s| s.0)
            .collect();
        let room = finite_ceilings(&w, &order, 64, distinct.len() as u64);
        assert!((room.optimal - room.unbounded).abs() < 1e-12, "seed {seed}");
    }
}
