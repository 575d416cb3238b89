//! `SimConfig::duration_ms`: the simulator stops sending when `kvrouter bench --duration-s`
//! would, so a live run's slice of a session trace can be replayed as it was sent.

use kvrouter_sim::{SimConfig, Simulation};
use kvrouter_workload::generators::{agentic, AgenticParams};

#[test]
fn a_duration_sends_only_what_is_due_before_it_and_counts_only_that() {
    let w = agentic(&AgenticParams {
        sessions: 12,
        seed: 3,
        ..AgenticParams::default()
    });
    let whole = Simulation::new(SimConfig::default(), &w)
        .unwrap()
        .run()
        .unwrap();
    assert_eq!(whole.requests, w.requests.len());
    let cut_ms = 60_000.0;
    let config = SimConfig {
        duration_ms: Some(cut_ms),
        ..SimConfig::default()
    };
    let mut sim = Simulation::new(config.clone(), &w).unwrap();
    while sim.step().unwrap() {}
    let sent: Vec<usize> = (0..w.requests.len())
        .filter(|&i| sim.records()[i].arrival.is_some())
        .collect();
    assert!(
        !sent.is_empty() && sent.len() < w.requests.len(),
        "{}",
        sent.len()
    );
    for &i in &sent {
        let at = sim.records()[i].arrival.unwrap();
        assert!(at.since(kvrouter_core::time::Time::ZERO).as_secs_f64() * 1e3 <= cut_ms);
        assert!(
            sim.records()[i].finish.is_some(),
            "request {i} sent and not finished"
        );
    }
    // A turn not sent ends its session: no later turn of it was sent.
    for (i, r) in w.requests.iter().enumerate() {
        if let Some(prev) = r.after {
            if sim.records()[prev].arrival.is_none() {
                assert!(
                    sim.records()[i].arrival.is_none(),
                    "turn {i} after an unsent turn"
                );
            }
        }
    }
    let cut = Simulation::new(config, &w).unwrap().run().unwrap();
    assert_eq!(cut.requests, sent.len());
    assert_eq!(cut.completed, sent.len());
    // The run ends with its last work, not at the last request it did not send.
    let first = sent
        .iter()
        .filter_map(|&i| sim.records()[i].arrival)
        .min()
        .unwrap();
    let last = sent
        .iter()
        .filter_map(|&i| sim.records()[i].finish)
        .max()
        .unwrap();
    let span = last.since(first).as_secs_f64();
    assert!(
        (cut.makespan_s - span).abs() < 1e-3,
        "makespan {} vs last finish - first arrival {span}",
        cut.makespan_s
    );
    assert!(cut.makespan_s < whole.makespan_s);
    assert_eq!(cut.rejected, 0);
}

#[test]
fn the_planner_runs_the_whole_workload() {
    // Its ticks run until every request is done, which a cut request never is.
    let w = agentic(&AgenticParams {
        sessions: 2,
        ..AgenticParams::default()
    });
    let config = SimConfig {
        duration_ms: Some(1000.0),
        planner: Some(kvrouter_sim::PlannerSim {
            law: kvrouter_core::planner::PlannerConfig::default(),
            startup_ms: 1000.0,
            tick_ms: 1000.0,
            migrate_tail: 0,
            migrate_slowdown: 0.1,
        }),
        ..SimConfig::default()
    };
    let e = Simulation::new(config, &w).err().expect("refused");
    assert!(e.to_string().contains("--duration-s"), "{e}");
}

#[test]
fn the_makespan_ends_with_the_last_request_not_with_events_still_in_flight() {
    let w = agentic(&AgenticParams {
        sessions: 4,
        seed: 5,
        ..AgenticParams::default()
    });
    let run = |delay_ms: f64| {
        let config = SimConfig {
            kv_event_delay_ms: delay_ms,
            ..SimConfig::default()
        };
        Simulation::new(config, &w).unwrap().run().unwrap()
    };
    let (prompt, late) = (run(0.0), run(3_600_000.0));
    // An hour's KV-event delay changes placements at most; it adds no hour to the run.
    assert!(
        late.makespan_s < prompt.makespan_s * 2.0 + 60.0,
        "{} against {}",
        late.makespan_s,
        prompt.makespan_s
    );
    assert!(late.output_tokens_per_s > 0.0);
}
