//! Physical limits against the simulator: no routing policy serves more hits than the finite
//! ceiling (the fleet's capacity as one Belady-optimal cache), even when caches are small
//! enough to evict and preempt; and the served hit rate never exceeds the unbounded ceiling.

use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::RouterConfig;
use kvrouter_engine::EngineConfig;
use kvrouter_sim::{SimConfig, Simulation};
use kvrouter_workload::generators::{agentic, seed001, AgenticParams, Seed001Params};

#[test]
fn no_policy_beats_the_finite_ceiling_on_random_small_workloads() {
    for seed in 0..6u64 {
        let workloads = [
            seed001(&Seed001Params {
                requests: 60,
                rate_per_s: 2.0 + seed as f64,
                seed,
                ..Seed001Params::default()
            }),
            agentic(&AgenticParams {
                sessions: 4,
                turns_median: 4.0,
                session_gap_s: 1.0,
                seed,
                ..AgenticParams::default()
            }),
        ];
        for w in &workloads {
            for mode in [
                RouterMode::RoundRobin,
                RouterMode::LeastLoaded,
                RouterMode::Kv,
            ] {
                let workers = 1 + seed as usize % 3;
                // Small caches: eviction (and at times preemption) happens.
                let num_gpu_blocks = 400 + 200 * (seed as usize % 3);
                let c = SimConfig {
                    name: "c".into(),
                    workers,
                    router: RouterConfig {
                        router_mode: mode,
                        ..RouterConfig::default()
                    },
                    engine: EngineConfig {
                        num_gpu_blocks,
                        ..EngineConfig::default()
                    },
                    ..SimConfig::default()
                };
                let s = Simulation::new(c, w).unwrap().run().unwrap();
                let finite = s.hit_rate_ceiling_finite.unwrap();
                let lru = s.hit_rate_lru_fleet.unwrap();
                let ctx = format!(
                    "seed {seed} {} {mode:?} {workers}×{num_gpu_blocks}: served {} finite {finite} \
                     lru {lru} unbounded {}",
                    w.name, s.hit_rate, s.hit_rate_ceiling
                );
                assert!(s.hit_rate <= finite + 1e-3, "{ctx}");
                assert!(finite <= s.hit_rate_ceiling + 1e-3, "{ctx}");
                assert!(lru <= finite + 1e-3, "{ctx}");
            }
        }
    }
}
