//! Property tests of the sketch, the byte form and the global policy against naive models.

use super::*;
use crate::ids::SequenceHash;
use crate::rng::{mix64, SeededRng};
use crate::time::Time;
use proptest::prelude::*;
use std::collections::HashSet;
use std::time::Duration;

pub(super) fn chain(seed: u64, n: usize) -> Vec<SequenceHash> {
    (0..n as u64)
        .map(|i| SequenceHash(mix64(seed.wrapping_mul(0x9E37) ^ mix64(i + 1))))
        .collect()
}

/// A prompt: the first `shared` blocks of chain `seed`, then `extra` blocks of its own.
pub(super) fn prompt(seed: u64, shared: usize, extra: usize, tag: u64) -> Vec<SequenceHash> {
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

pub(super) fn summary(
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
            model: None,
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
        model: None,
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
        model: None,
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
        model: None,
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
