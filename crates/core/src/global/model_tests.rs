//! Model-aware placement: a request naming a model goes only to clusters that list it (or
//! whose lists are not known).

use super::tests::{chain, summary};
use super::*;
use crate::time::Time;

/// A request naming a model goes only to clusters that serve it (or whose models are not known
/// yet), under every policy and whatever its session's home; one that no available cluster
/// serves is refused as such, not as "no cluster".
#[test]
fn requests_go_only_to_clusters_that_serve_their_model() {
    for policy in [
        GlobalPolicy::Kv,
        GlobalPolicy::LeastLoaded,
        GlobalPolicy::StaticSplit,
    ] {
        let config = GlobalConfig {
            policy,
            ..GlobalConfig::default()
        };
        let mut router = GlobalRouter::new(config, 16).unwrap();
        let t = Time::from_secs_f64(1.0);
        let mut ids = Vec::new();
        for name in ["a", "b", "c"] {
            let id = router
                .add_cluster(ClusterSpec {
                    name: name.into(),
                    rtt_ms: 0.0,
                    weight: 1.0,
                })
                .unwrap();
            // `a` holds the prompt's prefix and is idle: the best place but for its models.
            let held: &[(u64, usize)] = if name == "a" { &[(1, 8)] } else { &[] };
            let busy = if name == "a" { 0 } else { 50_000 };
            router
                .update_summary(id, summary(name, held, busy, 2), t)
                .unwrap();
            ids.push(id);
        }
        router
            .set_models(ids[0], Some(vec!["small".into()]))
            .unwrap();
        router
            .set_models(ids[1], Some(vec!["big".into(), "small".into()]))
            .unwrap();
        // `c`'s models are not known: it may take any.
        let p = chain(1, 8);
        let ask = |model| GlobalRequest {
            session: Some(7),
            blocks: &p,
            input_tokens: 128,
            output_tokens_hint: None,
            model,
        };
        let home = router.route(&ask(Some("small")), t).unwrap().cluster;
        assert!(router.serves(home, "small"), "{policy:?}");
        for _ in 0..6 {
            let d = router.route(&ask(Some("big")), t).unwrap();
            assert_ne!(d.cluster, ids[0], "{policy:?}: `a` does not serve big");
            assert!(!d.estimates[0].eligible, "{policy:?}");
        }
        router
            .set_models(ids[2], Some(vec!["small".into()]))
            .unwrap();
        for _ in 0..3 {
            assert_eq!(router.route(&ask(Some("big")), t).unwrap().cluster, ids[1]);
        }
        assert_eq!(
            router.route(&ask(Some("tiny")), t).unwrap_err(),
            GlobalError::ModelNotServed("tiny".into())
        );
        // Without a model, every available cluster is a candidate, as before.
        assert!(router.route(&ask(None), t).is_ok());
        // Nothing available: "no cluster", whatever the model.
        for &id in &ids {
            router.set_up(id, false).unwrap();
        }
        assert_eq!(
            router.route(&ask(Some("tiny")), t).unwrap_err(),
            GlobalError::NoCluster
        );
    }
}
