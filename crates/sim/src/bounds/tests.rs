use super::*;
use crate::Simulation;
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::RouterConfig;
use kvrouter_engine::timing::DynamoPoly;
use kvrouter_workload::generators::{agentic, grpo, AgenticParams, GrpoParams};
use kvrouter_workload::{Barrier, WorkloadRequest};

fn config(workers: usize, mode: RouterMode) -> SimConfig {
    SimConfig {
        name: "b".into(),
        workers,
        router: RouterConfig {
            router_mode: mode,
            ..RouterConfig::default()
        },
        ..SimConfig::default()
    }
}

fn one_request(input_tokens: u32, output_tokens: u32) -> Workload {
    Workload {
        name: "one".into(),
        block_size: 64,
        requests: vec![WorkloadRequest {
            arrival_ms: None,
            after: None,
            delay_ms: 0.0,
            session: None,
            blocks: (0..u64::from(input_tokens.div_ceil(64))).collect(),
            input_tokens,
            output_tokens,
            group: Some(0),
            step: Some(0),
            policy_version: None,
        }],
        barrier: Some(Barrier {
            pause_ms: 0.0,
            staleness: 0,
            rollout_share: None,
        }),
    }
}

/// A lone request: the bound is its prefill plus one decode step per further token, summed by
/// hand from the published polynomial, and the simulator takes exactly that long.
#[test]
fn a_lone_request_is_its_own_bound_and_the_simulator_meets_it() {
    let w = one_request(10_000, 50);
    let c = config(2, RouterMode::RoundRobin);
    let capacity = (c.engine.num_gpu_blocks * 64) as f64;
    let mut by_hand = DynamoPoly.prefill_ms(8192).unwrap() + DynamoPoly.prefill_ms(1808).unwrap();
    for k in 1..50u32 {
        let p = f64::from(10_000 + k) / capacity;
        by_hand += (-25.74 * p * p + 54.01 * p + 5.74f64).max(1.0);
    }
    let bound = step_lower_bounds(&c, &w).unwrap()[&0];
    assert!(
        (bound - by_hand / 1e3).abs() < 1e-9,
        "{bound} vs {by_hand} ms"
    );
    let s = Simulation::new(c, &w).unwrap().run().unwrap();
    let rl = s.rl.unwrap();
    let step = rl.step_time_s.max;
    // The engine counts whole blocks of KV in use, so it is slightly slower, never faster.
    assert!(
        step >= bound - 1e-6 && step <= bound * 1.01,
        "{step} vs {bound}"
    );
    assert_eq!(
        rl.step_time_lower_bound_s.unwrap().max,
        (bound * 1e3).round() / 1e3
    );
}

/// Work over capacity: many short requests on one worker are bound by their total prefill.
#[test]
fn many_short_requests_are_bound_by_total_work() {
    let mut w = one_request(4_000, 1);
    let proto = w.requests[0].clone();
    w.requests = (0..40u64)
        .map(|i| WorkloadRequest {
            blocks: (0..63).map(|b| i * 1000 + b).collect(),
            ..proto.clone()
        })
        .collect();
    let c = config(1, RouterMode::RoundRobin);
    let bound = step_lower_bounds(&c, &w).unwrap()[&0];
    let cheapest = (1..=8192u64)
        .map(|t| DynamoPoly.prefill_ms(t).unwrap() / t as f64)
        .fold(f64::INFINITY, f64::min);
    assert!((bound - 40.0 * 4000.0 * cheapest / 1e3).abs() < 1e-9);
    assert!(bound > DynamoPoly.prefill_ms(4000).unwrap() / 1e3);
}

/// No policy beats the bound on random small RL workloads, single-turn and multi-turn.
#[test]
fn no_policy_beats_the_step_bound_on_random_small_rl_workloads() {
    for seed in 0..4u64 {
        let workloads = [
            grpo(&GrpoParams {
                prompts: 4,
                group_size: 4,
                steps: 2,
                output_median: 400.0,
                output_cap: 3000,
                seed,
                ..GrpoParams::default()
            }),
            agentic(&AgenticParams {
                sessions: 3,
                steps: 2,
                group_size: 2,
                turns_median: 3.0,
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
                let c = config(1 + seed as usize % 3, mode);
                let bounds = step_lower_bounds(&c, w).unwrap();
                let s = Simulation::new(c, w).unwrap().run().unwrap();
                let times = &s.timeline.step_times_s;
                assert_eq!(times.len(), bounds.len());
                for (t, b) in times.iter().zip(bounds.values()) {
                    assert!(
                        *t >= b - 1e-6,
                        "seed {seed} {} {mode:?}: step {t} s < bound {b} s",
                        w.name
                    );
                }
            }
        }
    }
}
