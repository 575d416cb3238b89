//! Property tests of the sketch, the byte form and the global policy against naive models.

use super::*;
use crate::ids::SequenceHash;
use crate::rng::{mix64, SeededRng};
use crate::time::Time;
use proptest::prelude::*;
use std::collections::HashSet;
use std::time::Duration;

fn chain(seed: u64, n: usize) -> Vec<SequenceHash> {
    (0..n as u64)
        .map(|i| SequenceHash(mix64(seed.wrapping_mul(0x9E37) ^ mix64(i + 1))))
        .collect()
}

/// A prompt: the first `shared` blocks of chain `seed`, then `extra` blocks of its own.
fn prompt(seed: u64, shared: usize, extra: usize, tag: u64) -> Vec<SequenceHash> {
    let mut p = chain(seed, shared);
    p.extend(chain(tag ^ 0xdead_beef, extra));
    p
}

/// Naive: the longest prefix of `blocks` whose every block is in `held`.
fn naive_prefix(held: &HashSet<SequenceHash>, blocks: &[SequenceHash]) -> usize {
    blocks.iter().take_while(|b| held.contains(b)).count()
}

/// Held chains (seed, held length) as a sketch (keys as the index would give them) and a set.
fn build(chains: &[(u64, usize)], k: u32, bits: u32) -> (PrefixSketch, HashSet<SequenceHash>) {
    let config = SketchConfig {
        checkpoint_interval_blocks: k,
        bits_per_key: bits,
        ..SketchConfig::default()
    };
    let mut held = HashSet::new();
    let mut keys = Vec::new();
    for &(seed, len) in chains {
        let c = chain(seed, len);
        for (d, h) in c.iter().enumerate() {
            held.insert(*h);
            if (d + 1) % k as usize == 0 || d + 1 == len {
                keys.push(*h);
            }
        }
    }
    let mut s = PrefixSketch::with_capacity(config, keys.len()).unwrap();
    keys.into_iter().for_each(|h| s.insert(h));
    (s, held)
}

proptest! {
    #[test]
    fn sketch_prefix_is_within_one_interval_below_the_truth(
        chains in proptest::collection::vec((0u64..8, 1usize..200), 1..6),
        k in 1u32..32,
        queries in proptest::collection::vec((0u64..8, 0usize..220, 0usize..20), 1..20),
    ) {
        // 64 bits per key: false positives ~1e-10, so the bounds are exact.
        let (sketch, held) = build(&chains, k, 64);
        for (seed, shared, extra) in queries {
            let p = prompt(seed, shared, extra, shared as u64);
            let truth = naive_prefix(&held, &p);
            let est = sketch.cached_prefix_blocks(&p);
            prop_assert!(est <= truth, "estimate {est} above truth {truth}");
            prop_assert!(truth - est < k as usize, "estimate {est}, truth {truth}, k {k}");
            // A prompt that continues a held run past its end is exact.
            if let Some(&(_, len)) = chains.iter().find(|(s, _)| *s == seed) {
                if shared >= len && chains.iter().filter(|(s, _)| *s == seed).count() == 1 {
                    prop_assert_eq!(est, truth);
                }
            }
        }
    }

    #[test]
    fn summaries_round_trip_and_corruption_is_an_error(
        keys in proptest::collection::vec(any::<u64>(), 0..300),
        load in proptest::array::uniform8(any::<u64>()),
        speed in 0.0f64..1e6,
        name in "[a-zA-Z0-9é-]{0,40}",
        flip in any::<(usize, u8)>(),
        cut in any::<usize>(),
    ) {
        let mut sketch = PrefixSketch::with_capacity(SketchConfig::default(), keys.len()).unwrap();
        keys.iter().for_each(|k| sketch.insert(SequenceHash(*k)));
        let summary = ClusterSummary {
            name,
            built_at: Time::from_micros(load[0]),
            sequence: load[1],
            block_size: 16,
            sketch,
            load: ClusterLoad {
                workers: load[0], active_requests: load[1], active_prefill_tokens: load[2],
                active_decode_blocks: load[3], queue_depth: load[4], queued_prefill_tokens: load[5],
                free_kv_blocks: load[6], max_running_requests: load[7],
                prefill_tokens_per_s: speed, decode_ms_per_token: speed / 1e3,
                decode_ms_per_token_per_seq: speed / 1e4,
            },
        };
        let bytes = summary.to_bytes();
        prop_assert_eq!(bytes.len(), summary.encoded_len());
        prop_assert_eq!(ClusterSummary::from_bytes(&bytes).unwrap(), summary);
        let mut bad = bytes.clone();
        let at = flip.0 % bad.len();
        bad[at] ^= flip.1.max(1);
        prop_assert!(ClusterSummary::from_bytes(&bad).is_err());
        prop_assert!(ClusterSummary::from_bytes(&bytes[..cut % bytes.len()]).is_err());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        prop_assert!(ClusterSummary::from_bytes(&bytes).is_err());
    }
}

#[test]
fn wrong_version_magic_and_checksum_are_named() {
    let s = summary("a", &[], 0, 4);
    let bytes = s.to_bytes();
    // Version 1 (before the per-request latency growth) and a future version are refused.
    for v in [1u8, 3] {
        let mut other = bytes.clone();
        other[4] = v;
        assert_eq!(
            ClusterSummary::from_bytes(&other),
            Err(SummaryError::UnsupportedVersion(u16::from(v)))
        );
    }
    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert_eq!(
        ClusterSummary::from_bytes(&magic),
        Err(SummaryError::BadMagic)
    );
    let mut sum = bytes.clone();
    let last = sum.len() - 1;
    sum[last] ^= 1;
    assert_eq!(
        ClusterSummary::from_bytes(&sum),
        Err(SummaryError::BadChecksum)
    );
}

fn summary(
    name: &str,
    chains: &[(u64, usize)],
    active_prefill: u64,
    workers: u64,
) -> ClusterSummary {
    let (sketch, _) = build(chains, 16, 64);
    ClusterSummary {
        name: name.into(),
        built_at: Time::ZERO,
        sequence: 1,
        block_size: 16,
        sketch,
        load: ClusterLoad {
            workers,
            active_prefill_tokens: active_prefill,
            prefill_tokens_per_s: 10_000.0,
            decode_ms_per_token: 10.0,
            ..ClusterLoad::default()
        },
    }
}

/// Naive kv cost: rtt + backlog/(W v) + uncached/v + output × itl, from the held sets.
fn naive_cost(
    held: &HashSet<SequenceHash>,
    p: &[SequenceHash],
    tokens: u64,
    backlog: u64,
    workers: u64,
    rtt: f64,
) -> f64 {
    let cached = naive_prefix(held, p) as u64;
    let uncached = tokens.saturating_sub(cached * 16) as f64;
    rtt + backlog as f64 / (workers as f64 * 10_000.0) * 1e3
        + uncached / 10_000.0 * 1e3
        + DEFAULT_OUTPUT_TOKENS_HINT as f64 * 10.0
}

#[test]
fn kv_policy_matches_a_naive_cost_model_and_routes_around_stale_clusters() {
    let mut rng = SeededRng::new(14);
    for case in 0..200 {
        let n = 2 + (rng.next_u64() % 3) as usize;
        let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
        let mut naive = Vec::new();
        for c in 0..n {
            let rtt = (rng.next_u64() % 100) as f64;
            let id = router
                .add_cluster(ClusterSpec {
                    name: format!("dc{c}"),
                    rtt_ms: rtt,
                    weight: 1.0,
                })
                .unwrap();
            // Chains are multiples of 16 long so the sketch is exact.
            let chains: Vec<(u64, usize)> = (0..3)
                .map(|_| (rng.next_u64() % 6, 16 * (1 + (rng.next_u64() % 8) as usize)))
                .collect();
            let backlog = rng.next_u64() % 50_000;
            let workers = 1 + rng.next_u64() % 8;
            let s = summary(&format!("dc{c}"), &chains, backlog, workers);
            let stale = rng.next_u64() % 4 == 0;
            let at = if stale {
                Time::ZERO
            } else {
                Time::from_secs_f64(20.0)
            };
            router.update_summary(id, s, at).unwrap();
            let (_, held) = build(&chains, 16, 64);
            naive.push((held, backlog, workers, rtt, stale));
        }
        let now = Time::from_secs_f64(20.5);
        let p = prompt(
            rng.next_u64() % 6,
            16 * (rng.next_u64() % 10) as usize,
            3,
            case,
        );
        let tokens = p.len() as u64 * 16;
        let request = GlobalRequest {
            session: None,
            blocks: &p,
            input_tokens: tokens,
            output_tokens_hint: None,
        };
        let result = router.route(&request, now);
        let costs: Vec<Option<f64>> = naive
            .iter()
            .map(|(h, b, w, r, stale)| (!stale).then(|| naive_cost(h, &p, tokens, *b, *w, *r)))
            .collect();
        let best = costs
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.map(|c| (i, c)))
            .fold(None, |acc: Option<(usize, f64)>, (i, c)| match acc {
                Some((_, bc)) if bc <= c => acc,
                _ => Some((i, c)),
            });
        match (best, result) {
            (None, Err(GlobalError::NoCluster)) => {}
            (Some((i, c)), Ok(d)) => {
                let got = d.chosen().cost_ms();
                assert!(
                    (got - c).abs() < 1e-6,
                    "case {case}: chose {} cost {got}, naive {i} cost {c}",
                    d.cluster
                );
                assert!(
                    !naive[d.cluster.0 as usize].4,
                    "case {case}: a stale cluster was chosen"
                );
            }
            (b, r) => panic!("case {case}: naive {b:?}, router {r:?}"),
        }
    }
}

#[test]
fn sessions_stay_home_unless_another_cluster_is_clearly_cheaper() {
    let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
    let a = router
        .add_cluster(ClusterSpec {
            name: "a".into(),
            rtt_ms: 10.0,
            weight: 1.0,
        })
        .unwrap();
    let b = router
        .add_cluster(ClusterSpec {
            name: "b".into(),
            rtt_ms: 10.0,
            weight: 1.0,
        })
        .unwrap();
    let t = Time::from_secs_f64(1.0);
    router
        .update_summary(a, summary("a", &[], 0, 4), t)
        .unwrap();
    router
        .update_summary(b, summary("b", &[], 1_000, 4), t)
        .unwrap();
    let p = chain(1, 64);
    let req = GlobalRequest {
        session: Some(7),
        blocks: &p,
        input_tokens: 1024,
        output_tokens_hint: Some(10),
    };
    assert_eq!(router.route(&req, t).unwrap().cluster, a);
    // B becomes somewhat cheaper (a has a backlog): the session stays.
    let mut s = summary("a", &[], 4_000, 4);
    s.sequence = 2;
    router.update_summary(a, s, t).unwrap();
    let d = router.route(&req, t).unwrap();
    assert_eq!((d.cluster, d.reason), (a, DecisionReason::SessionHome));
    // A is swamped: clearly cheaper elsewhere, the session moves and says from where.
    let mut s = summary("a", &[], 2_000_000, 4);
    s.sequence = 3;
    router.update_summary(a, s, t).unwrap();
    let d = router.route(&req, t).unwrap();
    assert_eq!(
        (d.cluster, d.reason, d.moved_from),
        (b, DecisionReason::SessionMoved, Some(a))
    );
    // B goes stale: routed around, back to a.
    let later = t + DEFAULT_MAX_SUMMARY_AGE + Duration::from_millis(1);
    let mut s = summary("a", &[], 0, 4);
    s.sequence = 4;
    router.update_summary(a, s, later).unwrap();
    assert_eq!(router.route(&req, later).unwrap().cluster, a);
    // An older summary is ignored; a down cluster is skipped.
    assert!(!router
        .update_summary(a, summary("a", &[], 0, 4), later)
        .unwrap());
    router.set_up(a, false).unwrap();
    assert_eq!(router.route(&req, later), Err(GlobalError::NoCluster));
}

#[test]
fn static_split_keeps_sessions_and_follows_weights() {
    let config = GlobalConfig {
        policy: GlobalPolicy::StaticSplit,
        ..GlobalConfig::default()
    };
    let mut router = GlobalRouter::new(config, 16).unwrap();
    let t = Time::from_secs_f64(1.0);
    for (name, w) in [("a", 3.0), ("b", 1.0)] {
        let id = router
            .add_cluster(ClusterSpec {
                name: name.into(),
                rtt_ms: 0.0,
                weight: w,
            })
            .unwrap();
        router
            .update_summary(id, summary(name, &[], 0, 1), t)
            .unwrap();
    }
    let p = chain(1, 4);
    let mut counts = [0usize; 2];
    for s in 0..4000u64 {
        let req = GlobalRequest {
            session: Some(s),
            blocks: &p,
            input_tokens: 64,
            output_tokens_hint: None,
        };
        let first = router.route(&req, t).unwrap().cluster;
        assert_eq!(router.route(&req, t).unwrap().cluster, first);
        counts[first.0 as usize] += 1;
    }
    let share = counts[0] as f64 / 4000.0;
    assert!((share - 0.75).abs() < 0.03, "share {share}");
}

#[test]
fn pending_work_counts_until_a_summary_covers_it() {
    let config = GlobalConfig {
        policy: GlobalPolicy::LeastLoaded,
        ..GlobalConfig::default()
    };
    let mut router = GlobalRouter::new(config, 16).unwrap();
    let t = Time::from_secs_f64(1.0);
    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let id = router
            .add_cluster(ClusterSpec {
                name: name.into(),
                rtt_ms: 10.0,
                weight: 1.0,
            })
            .unwrap();
        router
            .update_summary(id, summary(name, &[], 0, 2), t)
            .unwrap();
        ids.push(id);
    }
    let p = chain(1, 4);
    let req = GlobalRequest {
        session: None,
        blocks: &p,
        input_tokens: 64,
        output_tokens_hint: None,
    };
    let picks: Vec<ClusterId> = (0..4)
        .map(|_| router.route(&req, t).unwrap().cluster)
        .collect();
    assert_eq!(
        picks,
        vec![ids[0], ids[1], ids[0], ids[1]],
        "pending work spreads requests"
    );
    assert_eq!(router.pending(ids[0]).requests, 2);
    let mut s = summary("a", &[], 0, 2);
    s.sequence = 2;
    router
        .update_summary(ids[0], s, t + Duration::from_millis(20))
        .unwrap();
    assert_eq!(router.pending(ids[0]).requests, 0);
}

#[test]
fn resident_sessions_follow_homes_and_count_toward_the_slot_wait() {
    let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
    let t = Time::from_secs_f64(1.0);
    let mut ids = Vec::new();
    // b is 5 ms further away: a is cheaper until its slots are spoken for (not a tie, which
    // the prefill a's first sessions sent would break).
    for (name, rtt_ms) in [("a", 0.0), ("b", 5.0)] {
        let id = router
            .add_cluster(ClusterSpec {
                name: name.into(),
                rtt_ms,
                weight: 1.0,
            })
            .unwrap();
        let mut s = summary(name, &[], 0, 1);
        s.load.max_running_requests = 2;
        router.update_summary(id, s, t).unwrap();
        ids.push(id);
    }
    let p = chain(1, 4);
    let req = |s| GlobalRequest {
        session: Some(s),
        blocks: &p,
        input_tokens: 64,
        output_tokens_hint: Some(100),
    };
    let mut homes = Vec::new();
    for s in 0..4u64 {
        // A fresh summary each time: the requests have finished (sessions are between turns),
        // only their residence remains.
        let now = t + Duration::from_millis(s + 1);
        for (k, name) in ["a", "b"].into_iter().enumerate() {
            let mut fresh = summary(name, &[], 0, 1);
            fresh.load.max_running_requests = 2;
            fresh.sequence = s + 2;
            router.update_summary(ids[k], fresh, now).unwrap();
        }
        homes.push(router.route(&req(s), now).unwrap().cluster);
    }
    // Two slots each: the sessions living in a (between turns) push new ones to b.
    assert_eq!(homes, vec![ids[0], ids[0], ids[1], ids[1]]);
    assert_eq!(router.pending(ids[0]).resident_sessions, 2);
    assert!(router.end_session(0));
    assert!(!router.end_session(0));
    assert_eq!(router.pending(ids[0]).resident_sessions, 1);
    router.expire_sessions(t + DEFAULT_SESSION_TTL + Duration::from_secs(1));
    assert_eq!(
        (
            router.pending(ids[0]).resident_sessions,
            router.pending(ids[1]).resident_sessions
        ),
        (0, 0)
    );
}

/// A cluster with `workers` workers of base latency `itl` ms growing by `per_seq` ms per
/// request on a worker.
fn decode_cluster(name: &str, workers: u64, itl: f64, per_seq: f64) -> ClusterSummary {
    let mut s = summary(name, &[], 0, workers);
    s.load.decode_ms_per_token = itl;
    s.load.decode_ms_per_token_per_seq = per_seq;
    s
}

#[test]
fn decode_is_priced_under_the_load_the_summary_does_not_show() {
    let p = chain(3, 2);
    let req = GlobalRequest {
        session: None,
        blocks: &p,
        input_tokens: 32,
        output_tokens_hint: Some(100),
    };
    let s = decode_cluster("a", 4, 10.0, 1.0);
    let idle = estimate(ClusterId(0), &s, PendingLoad::default(), 0.0, &req);
    assert_eq!(idle.decode_ms, 1000.0);
    // 8 resident sessions coming back join the 4 workers' batches: +2 per worker.
    let busy = PendingLoad {
        resident_sessions: 8,
        ..PendingLoad::default()
    };
    let loaded = estimate(ClusterId(0), &s, busy, 0.0, &req);
    assert!((loaded.decode_ms - 100.0 * (10.0 + 2.0)).abs() < 1e-9);
    // Requests the summary shows are already in the stated latency.
    let mut shown = s.clone();
    shown.load.active_requests = 8;
    let seen = estimate(ClusterId(0), &shown, busy, 0.0, &req);
    assert_eq!(seen.decode_ms, 1000.0);
}

proptest! {
    #[test]
    fn decode_cost_never_falls_as_sessions_stack(
        workers in 1u64..16, itl in 0.1f64..50.0, per_seq in 0.0f64..5.0,
        a in 0u64..200, b in 0u64..200, slots in 0u64..64,
    ) {
        let p = chain(4, 1);
        let req = GlobalRequest { session: None, blocks: &p, input_tokens: 16, output_tokens_hint: Some(64) };
        let mut s = decode_cluster("a", workers, itl, per_seq);
        s.load.max_running_requests = slots;
        let at = |n| estimate(ClusterId(0), &s, PendingLoad { resident_sessions: n, ..PendingLoad::default() }, 0.0, &req);
        let (lo, hi) = (a.min(b), a.max(b));
        prop_assert!(at(lo).cost_ms() <= at(hi).cost_ms() + 1e-9);
        prop_assert!(at(lo).decode_ms >= 64.0 * itl - 1e-9);
    }
}

#[test]
fn stacked_sessions_send_new_ones_to_the_slower_idle_cluster() {
    let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
    let t = Time::from_secs_f64(1.0);
    // fast: 4 ms per token growing 1 ms per request per worker; slow: 10 ms, same growth.
    let fast = router
        .add_cluster(ClusterSpec {
            name: "fast".into(),
            rtt_ms: 0.0,
            weight: 1.0,
        })
        .unwrap();
    let slow = router
        .add_cluster(ClusterSpec {
            name: "slow".into(),
            rtt_ms: 0.0,
            weight: 1.0,
        })
        .unwrap();
    router
        .update_summary(fast, decode_cluster("fast", 1, 4.0, 1.0), t)
        .unwrap();
    router
        .update_summary(slow, decode_cluster("slow", 1, 10.0, 1.0), t)
        .unwrap();
    let p = chain(5, 1);
    let mut placed = Vec::new();
    for s in 0..20u64 {
        let req = GlobalRequest {
            session: Some(s),
            blocks: &p,
            input_tokens: 16,
            output_tokens_hint: Some(50),
        };
        placed.push(router.route(&req, t).unwrap().cluster);
    }
    let on_slow = placed.iter().filter(|c| **c == slow).count();
    // Equal cost at fast + n_f = slow + n_s: about (20 - 6) / 2 = 7 sessions on slow.
    assert!((5..=9).contains(&on_slow), "{on_slow} of 20 on slow");
}

#[test]
fn the_output_hint_is_learned_from_finished_requests() {
    let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
    let t = Time::from_secs_f64(1.0);
    let a = router
        .add_cluster(ClusterSpec {
            name: "a".into(),
            rtt_ms: 0.0,
            weight: 1.0,
        })
        .unwrap();
    let b = router
        .add_cluster(ClusterSpec {
            name: "b".into(),
            rtt_ms: 0.0,
            weight: 1.0,
        })
        .unwrap();
    router
        .update_summary(a, decode_cluster("a", 1, 10.0, 0.0), t)
        .unwrap();
    router
        .update_summary(b, decode_cluster("b", 1, 10.0, 0.0), t)
        .unwrap();
    let p = chain(6, 1);
    let req = GlobalRequest {
        session: None,
        blocks: &p,
        input_tokens: 16,
        output_tokens_hint: None,
    };
    // No data yet: the default hint.
    let e = router.estimates(&req, t);
    assert_eq!(e[0].decode_ms, DEFAULT_OUTPUT_TOKENS_HINT as f64 * 10.0);
    for out in [20, 40, 30] {
        router.record_output(a, out).unwrap();
    }
    assert_eq!(router.output_tokens_mean(a), Some(30));
    // b has no data of its own: the mean over every cluster.
    assert_eq!(router.output_tokens_mean(b), Some(30));
    router.record_output(b, 100).unwrap();
    let e = router.estimates(&req, t);
    assert_eq!((e[0].decode_ms, e[1].decode_ms), (300.0, 1000.0));
    // A stated hint wins.
    let hinted = GlobalRequest {
        output_tokens_hint: Some(5),
        ..req
    };
    assert_eq!(router.estimates(&hinted, t)[0].decode_ms, 50.0);
    assert!(router.record_output(ClusterId(9), 1).is_err());
}

#[test]
fn prefill_sent_lately_takes_its_share_of_decode() {
    let p = chain(6, 1);
    let req = GlobalRequest {
        session: None,
        blocks: &p,
        input_tokens: 16,
        output_tokens_hint: Some(100),
    };
    // 2 workers × 10,000 prefill tokens/s; 10 ms per token alone.
    let s = decode_cluster("a", 2, 10.0, 0.0);
    let at = |rate: f64| {
        let pending = PendingLoad {
            sent_prefill_tokens_per_s: rate,
            ..PendingLoad::default()
        };
        estimate(ClusterId(0), &s, pending, 0.0, &req).decode_ms
    };
    assert_eq!(at(0.0), 1000.0);
    // Prefill steps hold half the workers' time: decode at half speed.
    assert!((at(10_000.0) - 2000.0).abs() < 1e-6, "{}", at(10_000.0));
    // Overload is capped, not infinite.
    let cap = 1000.0 / (1.0 - MAX_PREFILL_SHARE);
    assert!((at(1e9) - cap).abs() < 1e-6, "{}", at(1e9));
}

/// Fresh sessions, one every 250 ms, each 2,000 uncached tokens: the summaries (every 250 ms)
/// show both clusters idle, since each prefill is done before the next arrives. The fast
/// cluster (10,000 tokens/s, 4 ms per token) takes them until the prefill work sent there
/// lately (8,000 tokens/s, 80 % of its prefill capacity) slows its decode past the slow one's
/// (4,000 tokens/s, 10 ms per token); before, it took every one.
#[test]
fn a_cluster_taking_every_fresh_session_pays_for_its_prefill_steps() {
    let config = GlobalConfig::default();
    let mut router = GlobalRouter::new(config, 16).unwrap();
    let spec = |name: &str| ClusterSpec {
        name: name.into(),
        rtt_ms: 0.0,
        weight: 1.0,
    };
    let fast = router.add_cluster(spec("fast")).unwrap();
    let slow = router.add_cluster(spec("slow")).unwrap();
    let mut placed = Vec::new();
    for k in 0..80u64 {
        let t = Time::from_millis(250 * k + 1);
        let mut f = decode_cluster("fast", 1, 4.0, 0.0);
        let mut s = decode_cluster("slow", 1, 10.0, 0.0);
        f.load.prefill_tokens_per_s = 10_000.0;
        s.load.prefill_tokens_per_s = 4_000.0;
        (f.sequence, s.sequence) = (k + 1, k + 1);
        router.update_summary(fast, f, t).unwrap();
        router.update_summary(slow, s, t).unwrap();
        let p = prompt(100 + k, 0, 125, k);
        let req = GlobalRequest {
            session: Some(k),
            blocks: &p,
            input_tokens: 2_000,
            output_tokens_hint: Some(50),
        };
        placed.push(router.route(&req, t).unwrap().cluster);
    }
    let on_slow = placed.iter().filter(|c| **c == slow).count();
    assert!(
        (2..=40).contains(&on_slow),
        "{on_slow} of 80 fresh sessions on the slow cluster"
    );
}
