//! Global simulation: small scenarios, determinism, staleness.

use super::config::{ClusterEntry, ClustersFile, GlobalSection, GlobalSimConfig};
use super::GlobalSimulation;
use kvrouter_core::global::GlobalPolicy;
use kvrouter_core::router::RouterConfig;
use kvrouter_engine::EngineConfig;
use kvrouter_workload::seed002::{seed002, Seed002Params};

fn cluster(name: &str, workers: usize, speed: f64, delay: f64) -> ClusterEntry {
    ClusterEntry {
        name: name.into(),
        workers,
        profile: "dynamo-poly".into(),
        speed,
        network_delay_ms: delay,
        summary_refresh_ms: None,
        weight: None,
        max_num_seqs: None,
        num_gpu_blocks: None,
    }
}

fn config(policy: GlobalPolicy, clusters: Vec<ClusterEntry>) -> GlobalSimConfig {
    GlobalSimConfig {
        clusters: ClustersFile {
            global: GlobalSection::default(),
            clusters,
        },
        policy,
        router: RouterConfig {
            kv_cache_block_size: 16,
            ..RouterConfig::default()
        },
        engine: EngineConfig {
            block_size: 16,
            ..EngineConfig::default()
        },
        kv_event_delay_ms: 50.0,
        sessions_in_flight: Some(8),
    }
}

fn small() -> kvrouter_workload::Workload {
    seed002(&Seed002Params {
        steps: 2,
        tasks: 6,
        group_size: 2,
        turns_median: 4.0,
        harness_tokens: 1000,
        tool_tokens_median: 300.0,
        ..Seed002Params::default()
    })
}

fn two_dcs() -> Vec<ClusterEntry> {
    vec![cluster("a", 2, 1.0, 5.0), cluster("b", 2, 0.5, 20.0)]
}

#[test]
fn every_policy_finishes_every_request_deterministically() {
    let w = small();
    for policy in GlobalPolicy::ALL {
        let run = || {
            GlobalSimulation::new(config(policy, two_dcs()), &w)
                .unwrap()
                .run()
                .unwrap()
        };
        let a = run();
        assert_eq!(a, run(), "{policy}: same inputs, same summary");
        let served: usize = a.clusters.iter().map(|c| c.requests).sum();
        assert_eq!(served, w.requests.len(), "{policy}");
        assert_eq!(a.step_time_s.len(), 2, "{policy}: both steps ended");
        assert!(a.summary_bytes_max > 0);
        assert!(a
            .clusters
            .iter()
            .all(|c| c.timeline.iter().all(|b| (0.0..=1.0001).contains(b))));
    }
}

#[test]
fn kv_keeps_sessions_home_and_hits_more_than_least_loaded() {
    let w = small();
    let kv = GlobalSimulation::new(config(GlobalPolicy::Kv, two_dcs()), &w)
        .unwrap()
        .run()
        .unwrap();
    let ll = GlobalSimulation::new(config(GlobalPolicy::LeastLoaded, two_dcs()), &w)
        .unwrap()
        .run()
        .unwrap();
    assert!(
        kv.hit_rate > ll.hit_rate,
        "kv {} vs least-loaded {}",
        kv.hit_rate,
        ll.hit_rate
    );
    assert!(kv.session_moves < ll.session_moves);
    assert!(kv.sketch_error.checks > 0);
    assert!(kv.sketch_error.over_share < 0.05, "{:?}", kv.sketch_error);
}

#[test]
fn local_routers_learn_from_first_tokens_and_outputs_as_in_serve() {
    // `kvrouter serve` and plain `kvrouter sim` report each first token and each finished
    // output to the router (the `cost` policy's online fit and learned output lengths); the
    // datacenters' local routers must too, or `--router-mode cost` behaves differently here.
    let w = small();
    // Static split: both datacenters serve sessions.
    let mut c = config(GlobalPolicy::StaticSplit, two_dcs());
    c.router.router_mode = kvrouter_core::policy::RouterMode::Cost;
    c.router.router_cost_fit = true;
    let mut sim = GlobalSimulation::new(c, &w).unwrap();
    while sim.step().unwrap() {}
    for d in 0..2 {
        let router = sim.local_router(d).unwrap();
        let fed: Vec<bool> = (0..2)
            .map(|w| {
                router
                    .fitted_profile(kvrouter_core::ids::WorkerId(w))
                    .is_some_and(|f| f.prefill.line().is_some() || f.decode.line().is_some())
            })
            .collect();
        assert!(fed.iter().any(|f| *f), "datacenter {d}: {fed:?}");
    }
}

#[test]
fn the_summary_counts_engine_changes_inside_a_datacenter() {
    let w = small();
    let mut hard = config(GlobalPolicy::StaticSplit, two_dcs());
    hard.router.router_session_affinity_ttl_secs = Some(3600.0);
    let pinned = GlobalSimulation::new(hard, &w).unwrap().run().unwrap();
    // Static split and hard session affinity: every turn on its session's first engine.
    assert_eq!(pinned.engine_changes_within_dc, 0);
    let mut spread = config(GlobalPolicy::StaticSplit, two_dcs());
    spread.router.router_mode = kvrouter_core::policy::RouterMode::RoundRobin;
    let rr = GlobalSimulation::new(spread, &w).unwrap().run().unwrap();
    assert!(rr.engine_changes_within_dc > 0);
    assert!(rr.cache_lost_within_dc_tokens > pinned.cache_lost_within_dc_tokens);
}

#[test]
fn a_datacenter_whose_summaries_go_stale_is_routed_around() {
    let w = small();
    let mut dcs = two_dcs();
    // b publishes once at t = 0 and then only every 100 s: stale after the 10 s bound.
    dcs[1].summary_refresh_ms = Some(100_000.0);
    let run = GlobalSimulation::new(config(GlobalPolicy::Kv, dcs), &w)
        .unwrap()
        .run()
        .unwrap();
    let late: usize = run.clusters[1].requests;
    let all = w.requests.len();
    assert!(late < all / 2, "stale b still served {late} of {all}");
    assert_eq!(run.clusters.iter().map(|c| c.requests).sum::<usize>(), all);
}

#[test]
fn bad_clusters_are_refused_naming_the_field() {
    let w = small();
    let mut dcs = two_dcs();
    dcs[0].workers = 0;
    let err = GlobalSimulation::new(config(GlobalPolicy::Kv, dcs), &w)
        .err()
        .unwrap();
    assert!(err.to_string().contains("workers"), "{err}");
    let err = GlobalSimulation::new(config(GlobalPolicy::Kv, Vec::new()), &w)
        .err()
        .unwrap();
    assert!(err.to_string().contains("cluster"), "{err}");
    // Weights whose sum is no number, names serve would refuse (the report's rows could not be
    // told apart), and every cluster stale between its summaries.
    let refused = |edit: &dyn Fn(&mut Vec<ClusterEntry>), needle: &str| {
        let mut dcs = two_dcs();
        edit(&mut dcs);
        let err = GlobalSimulation::new(config(GlobalPolicy::StaticSplit, dcs), &w)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    };
    refused(&|d| d[0].weight = Some(1e308), "weight");
    refused(&|d| d[0].name = String::new(), "name");
    refused(&|d| d[1].name = "a ".into(), "name");
    refused(
        &|d| {
            for c in d.iter_mut() {
                c.summary_refresh_ms = Some(10_000.0);
            }
        },
        "max_summary_age_s",
    );
}

#[test]
fn each_step_names_the_rollout_that_ended_it_and_accounts_for_its_time() {
    let w = small();
    for policy in GlobalPolicy::ALL {
        let run = GlobalSimulation::new(config(policy, two_dcs()), &w)
            .unwrap()
            .run()
            .unwrap();
        assert_eq!(
            run.critical_rollouts.len(),
            run.step_time_s.len(),
            "{policy}"
        );
        for (c, step) in run.critical_rollouts.iter().zip(&run.step_time_s) {
            // The step ends when its last rollout does.
            assert!((c.end_s - step).abs() < 0.01, "{policy}: {c:?} vs {step}");
            // Its span is its turns' waits, decodes and the gaps between them, nothing else.
            let parts = c.to_first_token_s + c.decode_s + c.between_turns_s;
            assert!(
                (c.end_s - c.start_s - parts).abs() < 0.01,
                "{policy}: {c:?}"
            );
            assert_eq!(c.turns_per_datacenter.iter().sum::<usize>(), c.turns);
            assert!(c.output_tokens > 0 && c.decode_ms_per_token > 0.0);
            if policy == GlobalPolicy::StaticSplit {
                assert_eq!(c.datacenter_changes, 0);
            }
        }
    }
}

#[test]
fn the_global_router_is_told_each_requests_output_when_clients_send_max_tokens() {
    use super::config::OutputHint;
    assert_eq!(OutputHint::Learned.for_request(300), None);
    assert_eq!(OutputHint::MaxTokens.for_request(300), Some(300));
    assert_eq!(OutputHint::MaxTokens.for_request(0), Some(1));
    assert_eq!(
        serde_json::from_str::<OutputHint>("\"max-tokens\"").unwrap(),
        OutputHint::MaxTokens
    );
    // The hint reaches the kv estimate: a near, slow DC and a far one at full speed, where a
    // short answer is cheaper near and a long one far. Told each request's output (here from
    // a few tokens to over a thousand) instead of a running mean, kv places some sessions
    // elsewhere. The other policies do not read it.
    let w = small();
    let run = |hint: OutputHint, policy: GlobalPolicy| {
        let dcs = vec![cluster("far", 2, 1.0, 150.0), cluster("near", 2, 0.5, 1.0)];
        let mut c = config(policy, dcs);
        c.clusters.global.output_hint = hint;
        GlobalSimulation::new(c, &w).unwrap().run().unwrap()
    };
    let dcs = |s: &super::GlobalSummary| s.clusters.iter().map(|c| c.requests).collect::<Vec<_>>();
    let (learned, told) = (
        run(OutputHint::Learned, GlobalPolicy::Kv),
        run(OutputHint::MaxTokens, GlobalPolicy::Kv),
    );
    assert_ne!(dcs(&learned), dcs(&told), "kv: the hint changes placements");
    assert_eq!(
        run(OutputHint::Learned, GlobalPolicy::LeastLoaded),
        run(OutputHint::MaxTokens, GlobalPolicy::LeastLoaded),
        "least-loaded does not read the hint"
    );
}

/// With the local routers' queue on (`--router-queue-threshold`), a release that places a
/// queued request on the worker whose step just ended starts that worker's next step; the step
/// end must not start a second one over it (`start_step` asserts it in debug builds), which lost
/// the first step's requests: on the seed scenario the run then published summaries forever,
/// waiting for them.
#[test]
fn queued_requests_placed_by_a_release_are_all_served() {
    let w = seed002(&Seed002Params {
        steps: 1,
        tasks: 12,
        group_size: 2,
        turns_median: 4.0,
        harness_tokens: 12_000,
        tool_tokens_median: 300.0,
        ..Seed002Params::default()
    });
    for policy in GlobalPolicy::ALL {
        let mut c = config(policy, two_dcs());
        c.sessions_in_flight = Some(24);
        c.router.router_queue_threshold = Some(1.0);
        let summary = GlobalSimulation::new(c, &w).unwrap().run().unwrap();
        let served: usize = summary.clusters.iter().map(|c| c.requests).sum();
        assert_eq!(served, w.requests.len(), "{policy}");
        assert_eq!(summary.step_time_s.len(), 1, "{policy}: the step ended");
    }
}

/// A request that waits past `--router-queue-max-wait-secs` in a datacenter's queue is counted
/// refused and its rollout goes on, as `kvrouter sim` does, instead of ending the run.
#[test]
fn a_request_given_up_in_a_datacenter_queue_is_counted_and_the_run_goes_on() {
    let w = small();
    let mut c = config(GlobalPolicy::Kv, two_dcs());
    // Nearly everything queues, and gives up after a millisecond.
    c.router.router_queue_threshold = Some(0.0);
    c.router.router_queue_max_wait_secs = 0.001;
    let summary = GlobalSimulation::new(c, &w).unwrap().run().unwrap();
    assert!(summary.rejected > 0, "{summary:?}");
    let served: usize = summary.clusters.iter().map(|c| c.requests).sum();
    assert_eq!(served + summary.rejected, w.requests.len());
    assert_eq!(summary.step_time_s.len(), 2, "both steps ended");
}
