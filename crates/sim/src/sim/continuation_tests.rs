//! Continuations after a failure follow the live server's rule: placed now, away from the
//! workers the request tried.

use super::*;
use kvrouter_core::event::{BlockContent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, RequestId};
use kvrouter_core::policy::RouterMode;
use kvrouter_workload::WorkloadRequest;

const BS: usize = 64;

fn workload() -> Workload {
    Workload {
        name: "one".into(),
        block_size: BS,
        requests: vec![WorkloadRequest {
            arrival_ms: Some(0.0),
            after: None,
            delay_ms: 0.0,
            session: None,
            blocks: vec![11, 12, 13, 14],
            input_tokens: 4 * BS as u32,
            output_tokens: 8,
            group: None,
            step: None,
            policy_version: None,
        }],
        barrier: None,
    }
}

fn config() -> SimConfig {
    SimConfig {
        workers: 3,
        router: kvrouter_core::router::RouterConfig {
            router_mode: RouterMode::Kv,
            kv_cache_block_size: BS,
            ..Default::default()
        },
        // Deliveries come after the continuation the test schedules at the same instant.
        network_delay_ms: 1.0,
        ..SimConfig::default()
    }
}

/// Worker 1 holds request 0's prompt, so the cache draws it there.
fn cached_on_worker_1(router: &mut Router, w: &Workload) {
    let blocks = w.router_blocks(0, BS);
    let event = KvEvent::Stored {
        worker: WorkerId(1),
        dp_rank: 0,
        parent: None,
        blocks: blocks
            .content
            .iter()
            .enumerate()
            .map(|(i, c)| StoredBlock {
                engine_hash: EngineHash(i as u64 + 1),
                content: BlockContent::Hash(*c),
            })
            .collect(),
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    router.apply_event(&event).unwrap();
}

#[test]
fn a_continuation_never_goes_back_to_a_worker_it_tried_and_matches_the_live_rule() {
    let w = workload();
    let mut sim = Simulation::new(config(), &w).unwrap();
    cached_on_worker_1(&mut sim.router, &w);
    // The same router, driven by the core's continuation rule directly (the live server's
    // retries and migrations call it: kvrouter-server `state::tests`).
    let mut core = Router::new(sim.config.router.clone()).unwrap();
    for spec in sim.router.workers() {
        core.add_worker(spec.clone()).unwrap();
    }
    cached_on_worker_1(&mut core, &w);

    // Arrives, and goes to worker 1 (the cache).
    assert!(sim.step().unwrap());
    assert_eq!(sim.records[0].worker, Some(1));
    let request = sim.route_request_for(0);
    let first = core.route(&request, sim.now).unwrap();
    assert_eq!(first.rank.worker, WorkerId(1));
    // Worker 1 fails the attempt (it stays up): the request continues, through the
    // simulator's own event.
    sim.release(RequestId(0));
    let _ = core.finish(RequestId(0), sim.now).unwrap();
    sim.queue.push(sim.now, Event::Continue(0));
    assert!(sim.step().unwrap());
    let rule = core
        .route_continuation(&request, &[WorkerId(1)], sim.now)
        .unwrap();
    assert_ne!(rule.rank.worker, WorkerId(1));
    assert_eq!(
        sim.records[0].worker,
        Some(rule.rank.worker.0 as usize),
        "the simulator places continuations by the live rule"
    );
    assert_eq!(sim.tried[0], vec![WorkerId(1), rule.rank.worker]);
}

#[test]
fn a_continuation_with_every_worker_tried_fails_instead_of_going_back() {
    let w = workload();
    let mut c = config();
    c.workers = 1;
    let mut sim = Simulation::new(c, &w).unwrap();
    assert!(sim.step().unwrap());
    assert_eq!(sim.records[0].worker, Some(0));
    sim.release(RequestId(0));
    sim.queue.push(sim.now, Event::Continue(0));
    assert!(sim.step().unwrap());
    let rec = &sim.records[0];
    assert!(rec.failed && rec.rejected, "{rec:?}");
}
