//! The planner in the loop (`kvrouter sim --planner`): the fleet follows the control law on RL
//! step bursts, pays fewer GPU-seconds than a fixed fleet of its peak, loses no request and
//! keeps the step time.

use kvrouter_core::planner::PlannerConfig;
use kvrouter_sim::summary::FleetBaseline;
use kvrouter_sim::{PlannerSim, SimConfig, Simulation, Summary};
use kvrouter_workload::generators::{grpo, GrpoParams};
use kvrouter_workload::Workload;

fn workload() -> Workload {
    grpo(&GrpoParams {
        prompts: 8,
        group_size: 8,
        steps: 3,
        output_median: 400.0,
        output_cap: 2048,
        sync_pause_s: 150.0,
        seed: 7,
        ..GrpoParams::default()
    })
}

fn run(c: SimConfig, w: &Workload) -> Summary {
    Simulation::new(c, w).unwrap().run().unwrap()
}

fn planned(startup_ms: f64) -> SimConfig {
    SimConfig {
        name: "planner".into(),
        workers: 4,
        planner: Some(PlannerSim {
            law: PlannerConfig {
                requests_per_worker: 16,
                max_workers: 8,
                ..PlannerConfig::default()
            },
            startup_ms,
            tick_ms: 1000.0,
        }),
        ..SimConfig::default()
    }
}

#[test]
fn the_fleet_shrinks_between_bursts_and_is_back_for_each_step() {
    let w = workload();
    let p = run(planned(10_000.0), &w);
    assert_eq!(p.completed, p.requests, "no request lost");
    let fleet = p.fleet.clone().expect("a planner run has a fleet summary");
    assert_eq!(fleet.peak_workers, 4);
    // It went down (drained, released) and came back up.
    let provisioned: Vec<u32> = fleet.samples.iter().map(|s| s.provisioned).collect();
    let low = provisioned
        .iter()
        .position(|n| *n == 1)
        .expect("down to one worker");
    assert!(provisioned[low..].contains(&4), "{provisioned:?}");
    let fixed = run(
        SimConfig {
            name: "fixed".into(),
            workers: 4,
            ..SimConfig::default()
        },
        &w,
    );
    let b = FleetBaseline::against(&fixed, fleet.gpu_seconds, p.rl.as_ref());
    assert!(b.gpu_seconds_saved > 0.2, "{b:?}");
    assert!(b.step_time_ratio <= 1.10, "{b:?}");
    // A pure function of (config, workload).
    assert_eq!(run(planned(10_000.0), &w).fleet, p.fleet);
}

#[test]
fn bad_planner_settings_are_refused() {
    let w = workload();
    let mut c = planned(-1.0);
    assert!(Simulation::new(c.clone(), &w).is_err());
    c = planned(1000.0);
    if let Some(p) = c.planner.as_mut() {
        p.law.min_workers = 0;
    }
    assert!(Simulation::new(c, &w).is_err());
}
