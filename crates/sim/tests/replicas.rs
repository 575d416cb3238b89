//! Router replicas in the simulator (`--router-replicas N`): requests spread round-robin over N
//! routers that see each other's events after a delay, or not at all (`--no-replica-sync`).

use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{RouterConfig, UpdateMode};
use kvrouter_sim::config::WeightUpdate;
use kvrouter_sim::{SimConfig, Simulation, Summary};
use kvrouter_workload::generators::{grpo, GrpoParams};
use kvrouter_workload::Workload;

/// A GRPO burst: every group's samples share a long prompt and arrive together.
fn burst() -> Workload {
    grpo(&GrpoParams {
        prompts: 16,
        group_size: 8,
        steps: 1,
        template_tokens: 200,
        problem_median: 1800.0,
        problem_cap: 1800,
        output_median: 64.0,
        output_cap: 128,
        seed: 3,
        ..GrpoParams::default()
    })
}

fn config(replicas: usize, sync: bool, delay_ms: f64) -> SimConfig {
    SimConfig {
        name: format!("{replicas}x sync={sync} delay={delay_ms}"),
        workers: 8,
        router: RouterConfig {
            router_mode: RouterMode::Kv,
            router_predicted_ttl_secs: Some(5.0),
            ..RouterConfig::default()
        },
        router_replicas: replicas,
        replica_sync: sync,
        replica_sync_delay_ms: delay_ms,
        ..SimConfig::default()
    }
}

fn run(c: SimConfig, w: &Workload) -> Summary {
    Simulation::new(c, w).unwrap().run().unwrap()
}

#[test]
fn synced_replicas_place_like_one_router_and_unsynced_ones_do_not() {
    let w = burst();
    let one = run(config(1, true, 0.0), &w);
    let synced = run(config(3, true, 0.0), &w);
    let lagged = run(config(3, true, 5.0), &w);
    let unsynced = run(config(3, false, 0.0), &w);
    for s in [&one, &synced, &lagged, &unsynced] {
        assert_eq!(s.completed, 128, "{}", s.config);
    }
    for s in [&one, &synced, &lagged, &unsynced] {
        eprintln!(
            "{}: hit rate {:.3}, TTFT p50 {:.1} ms",
            s.config, s.hit_rate, s.ttft_ms.p50
        );
    }
    // Synced replicas place like one router (the targets: hit rate >= 0.97x, TTFT
    // p50 <= 1.10x); unsynced ones do not, and neither do replicas whose sync lags behind a
    // burst that arrives at once.
    let close = |s: &Summary| {
        (s.hit_rate - one.hit_rate).abs() <= 0.03 * one.hit_rate
            && s.ttft_ms.p50 <= 1.10 * one.ttft_ms.p50
            && s.ttft_ms.p50 >= one.ttft_ms.p50 / 1.10
    };
    assert!(close(&synced));
    assert!(!close(&unsynced));
    assert!(!close(&lagged));
}

#[test]
fn one_replica_is_the_router_alone() {
    let w = burst();
    let alone = run(SimConfig::default(), &w);
    let one = run(
        SimConfig {
            router_replicas: 1,
            replica_sync_delay_ms: 7.0,
            ..SimConfig::default()
        },
        &w,
    );
    assert_eq!(alone.hit_rate, one.hit_rate);
    assert_eq!(alone.ttft_ms.p50, one.ttft_ms.p50);
}

#[test]
fn an_update_driven_by_one_replica_holds_workers_out_at_every_replica() {
    let w = grpo(&GrpoParams {
        prompts: 6,
        group_size: 8,
        steps: 3,
        output_median: 300.0,
        output_cap: 2048,
        seed: 5,
        ..GrpoParams::default()
    });
    for sync in [true, false] {
        let c = SimConfig {
            weight_update: Some(WeightUpdate {
                mode: UpdateMode::Drain,
                batch: 2,
                load_ms: 500.0,
            }),
            ..config(3, sync, 1.0)
        };
        let mut sim = Simulation::new(c, &w).unwrap();
        while sim.step().unwrap() {}
        let served_stale = sim
            .records()
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                r.policy_version.unwrap_or(0) < u64::from(w.requests[*i].step.unwrap())
            })
            .count();
        let lost = sim
            .records()
            .iter()
            .filter(|r| r.finish.is_none() || r.rejected)
            .count();
        if sync {
            // Every replica honours the driver's holds and learns the new versions.
            assert_eq!((lost, served_stale), (0, 0));
        } else {
            // The others never learn the new versions (or the holds): requests wait in vain
            // or run on workers being updated.
            assert!(lost + served_stale > 0);
        }
    }
}
