//! Simulator behaviour: golden summaries, determinism, virtual-time sanity, RL step barriers, and
//! the published ordering of policies on the Mooncake conversation trace.

use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::RouterConfig;
use kvrouter_engine::{DynamoPoly, EngineConfig, TimingModel};
use kvrouter_sim::{SimConfig, Simulation, Summary};
use kvrouter_workload::generators::{grpo, seed001, GrpoParams, Seed001Params};
use kvrouter_workload::readers::ReadOptions;
use kvrouter_workload::{load_trace, Workload, WorkloadRequest};
use std::path::PathBuf;

fn config(name: &str, mode: RouterMode, workers: usize) -> SimConfig {
    SimConfig {
        name: name.into(),
        workers,
        router: RouterConfig {
            router_mode: mode,
            ..RouterConfig::default()
        },
        ..SimConfig::default()
    }
}

fn run(c: SimConfig, w: &Workload) -> Summary {
    Simulation::new(c, w).unwrap().run().unwrap()
}

// The test harness, not the simulator, reads the environment: regenerating golden files is a
// developer action (`KVROUTER_UPDATE_GOLDEN=1 cargo test -p kvrouter-sim`).
#[allow(clippy::disallowed_methods)]
fn golden(name: &str, summaries: &[Summary]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let text = serde_json::to_string_pretty(summaries).unwrap() + "\n";
    if std::env::var_os("KVROUTER_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (set KVROUTER_UPDATE_GOLDEN=1 to create)",
            path.display()
        )
    });
    assert_eq!(
        text,
        want,
        "routing behaviour changed: diff {} against this output",
        path.display()
    );
}

fn small_seed001() -> Workload {
    seed001(&Seed001Params {
        requests: 80,
        rate_per_s: 4.0,
        seed: 7,
        ..Seed001Params::default()
    })
}

fn small_grpo() -> Workload {
    grpo(&GrpoParams {
        prompts: 6,
        group_size: 8,
        steps: 2,
        output_median: 300.0,
        output_cap: 2048,
        seed: 3,
        ..GrpoParams::default()
    })
}

#[test]
fn seed001_golden_summary() {
    let w = small_seed001();
    // Small KV caches, so the 12k-token documents evict the shared prefix unless routing keeps
    // it where it is.
    let runs: Vec<Summary> = [
        ("round-robin", RouterMode::RoundRobin),
        ("kv", RouterMode::Kv),
    ]
    .iter()
    .map(|(n, m)| {
        let mut c = config(n, *m, 4);
        c.engine.num_gpu_blocks = 400;
        run(c, &w)
    })
    .collect();
    assert!(
        runs[1].hit_rate > runs[0].hit_rate,
        "kv reuses more cache than round-robin"
    );
    golden("seed001_4_workers.json", &runs);
}

#[test]
fn grpo_golden_summary_with_steps() {
    let w = small_grpo();
    let runs: Vec<Summary> = [
        ("least-loaded", RouterMode::LeastLoaded),
        ("kv", RouterMode::Kv),
    ]
    .iter()
    .map(|(n, m)| run(config(n, *m, 3), &w))
    .collect();
    for r in &runs {
        let rl = r.rl.as_ref().expect("RL figures");
        assert_eq!(rl.steps, 2);
        assert_eq!(r.completed, 96);
        assert!(rl.gpu_idle_fraction >= 0.0 && rl.gpu_idle_fraction < 1.0);
    }
    golden("grpo_3_workers.json", &runs);
}

#[test]
fn the_same_seed_gives_a_byte_identical_summary() {
    let w = small_seed001();
    let a = serde_json::to_string(&run(config("random", RouterMode::Random, 4), &w)).unwrap();
    let b = serde_json::to_string(&run(config("random", RouterMode::Random, 4), &w)).unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_lone_request_takes_the_models_prefill_time() {
    let w = Workload {
        name: "one".into(),
        block_size: 64,
        requests: vec![WorkloadRequest {
            arrival_ms: Some(0.0),
            after: None,
            delay_ms: 0.0,
            session: None,
            blocks: (0..16).collect(),
            input_tokens: 1000,
            output_tokens: 1,
            group: None,
            step: None,
            policy_version: None,
        }],
        barrier: None,
    };
    let s = run(config("kv", RouterMode::Kv, 1), &w);
    let want = DynamoPoly.prefill_ms(1000).unwrap();
    assert!(
        (s.ttft_ms.p50 - want).abs() < 0.01,
        "{} vs {want}",
        s.ttft_ms.p50
    );
}

#[test]
fn a_synchronous_step_starts_after_the_previous_one_and_its_pause() {
    let w = small_grpo();
    let s = run(config("kv", RouterMode::Kv, 3), &w);
    let rl = s.rl.unwrap();
    // Two steps plus a 1 s pause fit in the makespan, and nothing overlaps.
    assert!(
        s.makespan_s + 0.01 >= rl.step_time_s.mean * 2.0 + 1.0,
        "{} vs {:?}",
        s.makespan_s,
        rl.step_time_s
    );
}

#[test]
fn bounded_staleness_overlaps_steps() {
    let params = GrpoParams {
        prompts: 4,
        group_size: 4,
        steps: 4,
        output_median: 300.0,
        output_cap: 2048,
        seed: 5,
        ..GrpoParams::default()
    };
    let sync = run(config("kv", RouterMode::Kv, 2), &grpo(&params));
    let stale = run(
        config("kv", RouterMode::Kv, 2),
        &grpo(&GrpoParams {
            staleness: 1,
            ..params
        }),
    );
    assert_eq!(sync.completed, 64);
    assert_eq!(stale.completed, 64);
    assert!(
        stale.makespan_s < sync.makespan_s,
        "async {} vs sync {}",
        stale.makespan_s,
        sync.makespan_s
    );
}

fn failing(limit: u32) -> Summary {
    let w = seed001(&Seed001Params {
        requests: 120,
        rate_per_s: 10.0,
        seed: 11,
        ..Seed001Params::default()
    });
    let mut c = config("kv", RouterMode::Kv, 4);
    c.failures = vec![(1, 4_000.0)];
    c.migration_limit = limit;
    run(c, &w)
}

#[test]
fn a_dead_worker_loses_its_requests_without_migration() {
    let s = failing(0);
    assert!(s.failed > 0, "worker 1 had requests in flight");
    assert_eq!(s.completed + s.failed + s.rejected, s.requests);
    assert_eq!(s.migrations, 0);
}

#[test]
fn with_migration_every_request_completes_with_all_its_tokens() {
    let w = seed001(&Seed001Params {
        requests: 120,
        rate_per_s: 10.0,
        seed: 11,
        ..Seed001Params::default()
    });
    let s = failing(3);
    assert_eq!(s.failed, 0);
    assert_eq!(s.completed, s.requests);
    assert!(s.migrations > 0);
    let want: u64 = w.requests.iter().map(|r| u64::from(r.output_tokens)).sum();
    assert_eq!(s.output_tokens, want, "no token lost or duplicated");
}

#[test]
fn the_router_queue_holds_requests_under_pressure_and_loses_none() {
    let w = seed001(&Seed001Params {
        requests: 100,
        rate_per_s: 50.0,
        seed: 2,
        ..Seed001Params::default()
    });
    let mut c = config("kv-queued", RouterMode::Kv, 2);
    c.router.router_queue_threshold = Some(0.5);
    let queued = run(c, &w);
    let plain = run(config("kv", RouterMode::Kv, 2), &w);
    assert_eq!(queued.completed, 100);
    assert!(queued.queue_ms.mean > 0.0);
    assert_eq!(queued.output_tokens, plain.output_tokens);
}

#[test]
fn slow_workers_take_longer() {
    let w = small_seed001();
    let fast = run(config("kv", RouterMode::RoundRobin, 2), &w);
    let mut c = config("kv", RouterMode::RoundRobin, 2);
    c.speed = vec![(0, 0.25), (1, 0.25)];
    let slow = run(c, &w);
    assert!(slow.e2e_ms.mean > fast.e2e_ms.mean);
    let mut bad = config("kv", RouterMode::RoundRobin, 2);
    bad.speed = vec![(0, 0.0)];
    assert!(Simulation::new(bad, &w).is_err());
}

#[test]
fn bad_configurations_are_refused() {
    let w = small_seed001();
    assert!(Simulation::new(
        SimConfig {
            workers: 0,
            ..SimConfig::default()
        },
        &w
    )
    .is_err());
    let c = SimConfig {
        router: RouterConfig {
            kv_cache_block_size: 48,
            ..RouterConfig::default()
        },
        ..SimConfig::default()
    };
    let e = Simulation::new(c, &w).err().unwrap().to_string();
    assert!(e.contains("block size"), "{e}");
    let c = SimConfig {
        profiles: vec!["no-such-profile".into()],
        ..SimConfig::default()
    };
    assert!(Simulation::new(c, &w).is_err());
    let _ = EngineConfig::default();
}

/// The Mooncake paper orders average TTFT random > load-balancing > cache-aware; checked here on
/// the first part of the conversation trace with 16 workers (the full trace is in the bench).
#[test]
fn mooncake_conversation_orders_policies_as_published() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/mooncake_conversation/conversation_trace.jsonl");
    let w = load_trace(
        &path,
        ReadOptions {
            max_requests: 2500,
            ..ReadOptions::default()
        },
    )
    .unwrap();
    let ttft = |mode| {
        let mut c = config("x", mode, 16);
        c.arrival_speedup = 2.0;
        run(c, &w).ttft_ms.mean
    };
    let (random, balanced, kv) = (
        ttft(RouterMode::Random),
        ttft(RouterMode::LeastLoaded),
        ttft(RouterMode::Kv),
    );
    assert!(
        random > balanced && balanced > kv,
        "random {random}, least-loaded {balanced}, kv {kv}"
    );
}

/// A long prompt and a short one arriving together at one worker: routed on arrival, the short
/// one waits behind the long one's prefill (trace order); with an ingress time per prompt token
/// the short one is read, routed and prefilled first, as a live router places them, and each
/// time to first token includes its own ingress.
#[test]
fn with_an_ingress_time_requests_arriving_together_are_routed_shortest_first() {
    let req = |first_block: u64, input_tokens: u32| WorkloadRequest {
        arrival_ms: Some(0.0),
        after: None,
        delay_ms: 0.0,
        session: None,
        blocks: (first_block..first_block + u64::from(input_tokens) / 64).collect(),
        input_tokens,
        output_tokens: 2,
        group: None,
        step: None,
        policy_version: None,
    };
    let w = Workload {
        name: "ingress".into(),
        block_size: 64,
        requests: vec![req(0, 32_768), req(1_000, 128)],
        barrier: None,
    };
    let ttft = |ingress_us_per_token: f64| -> Vec<f64> {
        let c = SimConfig {
            ingress_us_per_token,
            ..config("kv", RouterMode::Kv, 1)
        };
        let mut sim = Simulation::new(c, &w).unwrap();
        while sim.step().unwrap() {}
        sim.records()
            .iter()
            .map(|r| {
                r.first_token
                    .unwrap()
                    .since(r.arrival.unwrap())
                    .as_secs_f64()
                    * 1e3
            })
            .collect()
    };
    let on_arrival = ttft(0.0);
    assert!(on_arrival[1] > on_arrival[0], "{on_arrival:?}");
    let read_first = ttft(0.1);
    assert!(read_first[1] < read_first[0], "{read_first:?}");
    assert!(
        read_first[1] < on_arrival[1] / 10.0,
        "{read_first:?} {on_arrival:?}"
    );
    // The long prompt's 3.3 ms of ingress is in its time to first token.
    assert!(
        read_first[0] >= on_arrival[0] + 3.2,
        "{read_first:?} {on_arrival:?}"
    );
}
