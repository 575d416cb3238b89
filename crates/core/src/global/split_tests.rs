//! The static split, and figures past their bounds: weights and stated speeds refused, and a
//! cost that is no number never chosen.

use super::tests::{chain, summary};
use super::*;
use crate::time::Time;

/// A router of one-worker clusters with these static-split weights, each with a summary at `t`.
fn weighted(config: GlobalConfig, clusters: &[(&str, f64)], t: Time) -> GlobalRouter {
    let mut router = GlobalRouter::new(config, 16).unwrap();
    for &(name, weight) in clusters {
        let id = router
            .add_cluster(ClusterSpec {
                name: name.into(),
                rtt_ms: 0.0,
                weight,
            })
            .unwrap();
        router
            .update_summary(id, summary(name, &[], 0, 1), t)
            .unwrap();
    }
    router
}

#[test]
fn static_split_keeps_sessions_and_follows_weights() {
    let config = GlobalConfig {
        policy: GlobalPolicy::StaticSplit,
        ..GlobalConfig::default()
    };
    let t = Time::from_secs_f64(1.0);
    let mut router = weighted(config, &[("a", 3.0), ("b", 1.0)], t);
    let p = chain(1, 4);
    let mut counts = [0usize; 2];
    for s in 0..4000u64 {
        let req = GlobalRequest {
            session: Some(s),
            blocks: &p,
            input_tokens: 64,
            output_tokens_hint: None,
            model: None,
        };
        let first = router.route(&req, t).unwrap().cluster;
        assert_eq!(router.route(&req, t).unwrap().cluster, first);
        counts[first.0 as usize] += 1;
    }
    let share = counts[0] as f64 / 4000.0;
    assert!((share - 0.75).abs() < 0.03, "share {share}");
}

#[test]
fn stated_speeds_and_weights_past_their_bounds_are_refused() {
    for (prefill, decode) in [(1e13, 10.0), (10_000.0, 1e308), (10_000.0, 60_001.0)] {
        let mut s = summary("a", &[], 0, 4);
        s.load.prefill_tokens_per_s = prefill;
        s.load.decode_ms_per_token = decode;
        assert!(
            matches!(
                ClusterSummary::from_bytes(&s.to_bytes()),
                Err(SummaryError::Invalid(_))
            ),
            "{prefill} {decode}"
        );
    }
    let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
    for weight in [0.0, -1.0, f64::NAN, MAX_CLUSTER_WEIGHT * 2.0, 1e308] {
        let spec = ClusterSpec {
            name: "a".into(),
            rtt_ms: 0.0,
            weight,
        };
        assert!(router.add_cluster(spec).is_err(), "{weight}");
    }
}

#[test]
fn a_cost_that_is_not_a_number_never_wins() {
    // A cluster stating the slowest decode a summary may state, loaded past its slots, prices
    // its wait for a slot as 0 × ∞ once the figures overflow; listed first, it must not win.
    let mut router = GlobalRouter::new(GlobalConfig::default(), 16).unwrap();
    let t = Time::from_secs_f64(1.0);
    let p = chain(1, 4);
    for (name, decode) in [("x", f64::MAX), ("a", 10.0)] {
        let id = router
            .add_cluster(ClusterSpec {
                name: name.into(),
                rtt_ms: 0.0,
                weight: 1.0,
            })
            .unwrap();
        let mut s = summary(name, &[], 0, 1);
        // Set past the decoder's bound on purpose: what a summary built in memory may hold.
        s.load.decode_ms_per_token = decode;
        s.load.decode_ms_per_token_per_seq = decode;
        s.load.max_running_requests = 4;
        router.update_summary(id, s, t).unwrap();
    }
    for session in 0..8u64 {
        let req = GlobalRequest {
            session: Some(session),
            blocks: &p,
            input_tokens: 64,
            output_tokens_hint: Some(100),
            model: None,
        };
        let d = router.route(&req, t).unwrap();
        assert!(d.estimates[0].cost_ms().is_nan(), "{:?}", d.estimates[0]);
        assert_eq!(
            d.cluster,
            ClusterId(1),
            "session {session}: {:?}",
            d.estimates
        );
    }
}

#[test]
fn static_split_sends_unkeyed_requests_by_weight_from_the_first() {
    let config = GlobalConfig {
        policy: GlobalPolicy::StaticSplit,
        ..GlobalConfig::default()
    };
    let t = Time::from_secs_f64(1.0);
    let p = chain(1, 4);
    // A tiny first share: the first request without a session is not sent there (mix64(0) is
    // 0, which every fresh router sent to the first cluster).
    let mut router = weighted(config, &[("a", 0.001), ("b", 1000.0)], t);
    let req = GlobalRequest {
        session: None,
        blocks: &p,
        input_tokens: 64,
        output_tokens_hint: None,
        model: None,
    };
    assert_eq!(router.route(&req, t).unwrap().cluster, ClusterId(1));
}
