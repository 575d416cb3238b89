//! Releases of load carry out their effects without a follow-up call; continuations are placed
//! by the core's rule.

use super::*;
use crate::config::ServeConfig;
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::EngineHash;
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{
    Admission, RouteRequest, RouterConfig, UpdateMode, UpdatePlan, WorkerSpec,
};

const BS: usize = 4;

fn request(id: u64, tokens: &[u32]) -> RouteRequest {
    let blocks = BlockHasher::new(BS, &HashNamespace::none()).hash_blocks(tokens);
    RouteRequest::new(RequestId(id), tokens.len() as u64, blocks)
}

fn tokens(prefix: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| prefix * 10_000 + i).collect()
}

fn state(router: RouterConfig, workers: u64) -> AppState {
    let state = AppState::new(ServeConfig {
        router,
        ..ServeConfig::default()
    })
    .unwrap();
    for w in 0..workers {
        let mut spec = WorkerSpec::new(WorkerId(w));
        spec.max_num_batched_tokens = Some(100);
        state.inner.lock_core().add_worker(spec).unwrap();
    }
    state
}

/// One worker, busy, and request 2 waiting in the queue with its handler registered.
fn one_waiting() -> (AppState, oneshot::Receiver<PlacementResult>) {
    let s = state(
        RouterConfig {
            router_mode: RouterMode::RoundRobin,
            kv_cache_block_size: BS,
            router_queue_threshold: Some(0.0),
            ..RouterConfig::default()
        },
        1,
    );
    let inner = &s.inner;
    let first = inner
        .lock_core()
        .submit(request(1, &tokens(1, 40)), inner.now());
    assert!(matches!(first, Ok(Admission::Dispatched(_))));
    let rx = inner.await_placement(RequestId(2));
    let second = inner
        .lock_core()
        .submit(request(2, &tokens(2, 8)), inner.now());
    assert_eq!(second, Ok(Admission::Queued));
    (s, rx)
}

#[test]
fn a_finish_hands_the_waiting_request_its_placement_without_the_queue_driver() {
    // No runtime, so no queue driver: the release itself must deliver the placement.
    let (s, mut rx) = one_waiting();
    s.inner.release(RequestId(1), Release::Finished);
    let placed = rx.try_recv().expect("placed by the release").unwrap();
    assert_eq!(placed.rank.worker, WorkerId(0));
    assert!(s.inner.lock_core().ledger().is_active(RequestId(2)));
}

#[test]
fn a_placement_whose_handler_has_gone_is_released_again() {
    let (s, rx) = one_waiting();
    drop(rx);
    s.inner.release(RequestId(1), Release::Cancelled);
    let core = s.inner.lock_core();
    assert_eq!(core.ledger().active_requests(), 0, "nothing holds load");
    assert_eq!(core.queue_stats().pending_requests, 0);
}

#[test]
fn a_release_that_idles_a_draining_worker_sends_its_load_to_the_update_driver() {
    let s = state(
        RouterConfig {
            router_mode: RouterMode::RoundRobin,
            kv_cache_block_size: BS,
            ..RouterConfig::default()
        },
        1,
    );
    let inner = &s.inner;
    inner
        .lock_core()
        .route(&request(1, &tokens(1, 8)), inner.now())
        .unwrap();
    let plan = UpdatePlan {
        version: 2,
        mode: UpdateMode::Drain,
        batch: 1,
        workers: None,
    };
    let now = inner.now();
    let (first, mut later) = inner
        .begin_update(|core| core.begin_update(plan, now))
        .unwrap();
    assert!(first.is_empty(), "the worker is busy: it drains first");
    assert!(later.try_recv().is_err());
    inner.release(RequestId(1), Release::Finished);
    assert_eq!(
        later.try_recv().unwrap(),
        vec![UpdateAction::Load {
            worker: WorkerId(0),
            version: 2
        }]
    );
}

/// Worker 1 of three holds the prompt's blocks (the scenario `kvrouter-sim` replays in its own
/// continuation test).
fn cached_on_worker_1(router: &mut Router, prompt: &[u32]) {
    let event = KvEvent::Stored {
        worker: WorkerId(1),
        dp_rank: 0,
        parent: None,
        blocks: prompt
            .chunks_exact(BS)
            .enumerate()
            .map(|(i, c)| StoredBlock {
                engine_hash: EngineHash(i as u64 + 1),
                content: BlockContent::Tokens(c.to_vec()),
            })
            .collect(),
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    router.apply_event(&event).unwrap();
}

#[test]
fn a_continuation_after_a_failure_goes_where_the_core_rule_sends_it() {
    let config = RouterConfig {
        router_mode: RouterMode::Kv,
        kv_cache_block_size: BS,
        ..RouterConfig::default()
    };
    let prompt = tokens(3, 40);
    let s = state(config.clone(), 3);
    cached_on_worker_1(&mut s.inner.lock_core(), &prompt);
    // The same router, driven by the core's rule directly.
    let mut core = Router::new(config).unwrap();
    for w in 0..3 {
        let mut spec = WorkerSpec::new(WorkerId(w));
        spec.max_num_batched_tokens = Some(100);
        core.add_worker(spec).unwrap();
    }
    cached_on_worker_1(&mut core, &prompt);
    let tried = [WorkerId(1)];
    let live = s
        .inner
        .place_continuation(&request(7, &prompt), &tried)
        .unwrap();
    let rule = core
        .route_continuation(&request(7, &prompt), &tried, Time::ZERO)
        .unwrap();
    assert_eq!(live.rank, rule.rank);
    assert_ne!(
        live.rank.worker,
        WorkerId(1),
        "never back to a tried worker"
    );
    // Without the exclusion the cache would have drawn it back to worker 1.
    let free = core.route(&request(8, &prompt), Time::ZERO).unwrap();
    assert_eq!(free.rank.worker, WorkerId(1));
}
