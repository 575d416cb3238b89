//! The global policy's decode pricing: load a summary does not show, stacked sessions, the
//! output hint learned from finished requests, and prefill sent lately.

use super::tests::{chain, prompt, summary};
use super::*;
use crate::time::Time;
use proptest::prelude::*;

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
        model: None,
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
        let req = GlobalRequest { session: None, blocks: &p, input_tokens: 16, output_tokens_hint: Some(64), model: None };
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
            model: None,
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
        model: None,
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
        model: None,
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
            model: None,
        };
        placed.push(router.route(&req, t).unwrap().cluster);
    }
    let on_slow = placed.iter().filter(|c| **c == slow).count();
    assert!(
        (2..=40).contains(&on_slow),
        "{on_slow} of 80 fresh sessions on the slow cluster"
    );
}
