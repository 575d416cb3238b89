use super::*;
use crate::event::{BlockContent, Medium, StoredBlock};
use crate::hashing::{BlockHasher, HashNamespace};
use crate::ids::EngineHash;

pub(super) const BS: usize = 4;

pub(super) fn router(mode: RouterMode, workers: u64) -> Router {
    router_with(
        RouterConfig {
            router_mode: mode,
            ..Default::default()
        },
        workers,
    )
}

/// A router of `mode` with its own `seed` over `workers` single-rank workers.
pub(super) fn seeded_router(mode: RouterMode, seed: u64, workers: u64) -> Router {
    router_with(
        RouterConfig {
            router_mode: mode,
            seed,
            ..Default::default()
        },
        workers,
    )
}

/// A router of `config` with block size [`BS`] over `workers` single-rank workers.
pub(super) fn router_with(config: RouterConfig, workers: u64) -> Router {
    let mut r = Router::new(RouterConfig {
        kv_cache_block_size: BS,
        ..config
    })
    .unwrap();
    for w in 0..workers {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    r
}

pub(super) fn tokens(prefix: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| prefix * 10_000 + i).collect()
}

pub(super) fn request(id: u64, toks: &[u32]) -> RouteRequest {
    let blocks = BlockHasher::new(BS, &HashNamespace::none()).hash_blocks(toks);
    RouteRequest::new(RequestId(id), toks.len() as u64, blocks)
}

pub(super) fn store_event(worker: u64, toks: &[u32]) -> KvEvent {
    KvEvent::Stored {
        worker: WorkerId(worker),
        dp_rank: 0,
        parent: None,
        blocks: toks
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
    }
}

#[test]
fn kv_mode_follows_the_cache() {
    let mut r = router(RouterMode::Kv, 3);
    let prompt = tokens(1, 40);
    r.apply_event(&store_event(2, &prompt)).unwrap();
    let d = r.route(&request(1, &prompt), Time::ZERO).unwrap();
    assert_eq!(d.rank.worker, WorkerId(2));
    assert_eq!(d.overlap.gpu_blocks, 10);
    assert_eq!(d.cached_tokens, 40);
    assert_eq!(d.candidates.len(), 3);
    // Nothing to prefill on worker 2, so only decode load was added.
    assert_eq!(r.load(d.rank).active_prefill_tokens, 0);
    assert_eq!(r.load(d.rank).active_decode_blocks, 10);
    r.check_invariants().unwrap();
}

#[test]
fn kv_mode_balances_when_nothing_is_cached() {
    let mut r = router(RouterMode::Kv, 2);
    let a = r.route(&request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    let b = r.route(&request(2, &tokens(2, 40)), Time::ZERO).unwrap();
    assert_ne!(
        a.rank, b.rank,
        "the second request avoids the loaded worker"
    );
}

#[test]
fn load_aware_ignores_the_cache() {
    let config = RouterConfig {
        kv_cache_block_size: BS,
        ..RouterConfig::load_aware()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..2 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let prompt = tokens(1, 40);
    r.apply_event(&store_event(1, &prompt)).unwrap();
    // Load worker 1 so that the cached worker is the more expensive one.
    r.route(&request(1, &tokens(9, 8)), Time::ZERO).unwrap();
    let busy = r.ledger().get(RequestId(1)).unwrap().0;
    let d = r.route(&request(2, &prompt), Time::ZERO).unwrap();
    assert_ne!(d.rank, busy);
}

#[test]
fn round_robin_cycles_and_finish_releases_load() {
    let mut r = router(RouterMode::RoundRobin, 3);
    let picks: Vec<u64> = (0..6)
        .map(|i| {
            r.route(&request(i, &tokens(1, 8)), Time::ZERO)
                .unwrap()
                .rank
                .worker
                .0
        })
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    for i in 0..6 {
        r.first_token(RequestId(i)).unwrap();
        let _ = r.finish(RequestId(i), Time::ZERO).unwrap();
    }
    assert_eq!(r.ledger().active_requests(), 0);
    assert_eq!(
        r.finish(RequestId(0), Time::ZERO),
        Err(RouteError::UnknownRequest(RequestId(0)))
    );
}

#[test]
fn direct_mode_needs_a_known_target() {
    let mut r = router(RouterMode::Direct, 2);
    assert_eq!(
        r.route(&request(1, &tokens(1, 8)), Time::ZERO),
        Err(RouteError::MissingTarget)
    );
    let mut req = request(1, &tokens(1, 8));
    req.pin = Some(Pin {
        worker: WorkerId(7),
        dp_rank: None,
    });
    assert_eq!(
        r.route(&req, Time::ZERO),
        Err(RouteError::UnknownWorker(WorkerId(7)))
    );
    req.pin = Some(Pin {
        worker: WorkerId(1),
        dp_rank: Some(3),
    });
    assert!(matches!(
        r.route(&req, Time::ZERO),
        Err(RouteError::UnknownRank(_))
    ));
    req.pin = Some(Pin {
        worker: WorkerId(1),
        dp_rank: None,
    });
    assert_eq!(r.route(&req, Time::ZERO).unwrap().rank.worker, WorkerId(1));
}

#[test]
fn busy_thresholds_filter_and_report_overload() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        active_prefill_tokens_threshold: Some(10),
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(0))).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(1))).unwrap();
    r.route(&request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    r.route(&request(2, &tokens(2, 40)), Time::ZERO).unwrap();
    assert_eq!(
        r.route(&request(3, &tokens(3, 4)), Time::ZERO),
        Err(RouteError::AllEligibleWorkersOverloaded)
    );
    r.first_token(RequestId(1)).unwrap();
    assert!(r.route(&request(3, &tokens(3, 4)), Time::ZERO).is_ok());
}

#[test]
fn prefill_fraction_uses_each_workers_budget() {
    let config = RouterConfig {
        kv_cache_block_size: BS,
        active_prefill_tokens_threshold_frac: Some(0.5),
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    let mut spec = WorkerSpec::new(WorkerId(0));
    spec.max_num_batched_tokens = Some(100);
    r.add_worker(spec).unwrap();
    r.route(&request(1, &tokens(1, 60)), Time::ZERO).unwrap();
    assert_eq!(
        r.route(&request(2, &tokens(2, 4)), Time::ZERO),
        Err(RouteError::AllEligibleWorkersOverloaded)
    );
}

#[test]
fn unknown_event_sources_and_duplicate_ids_are_rejected() {
    let mut r = router(RouterMode::Kv, 1);
    assert_eq!(
        r.apply_event(&store_event(9, &tokens(1, 8)))
            .unwrap_err()
            .status(),
        "unknown_worker"
    );
    r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    assert_eq!(
        r.route(&request(1, &tokens(1, 8)), Time::ZERO),
        Err(RouteError::DuplicateRequest(RequestId(1)))
    );
    assert_eq!(
        r.add_worker(WorkerSpec::new(WorkerId(0))),
        Err(RouteError::DuplicateWorker(WorkerId(0)))
    );
}

#[test]
fn removing_a_worker_drops_its_cache_and_candidacy() {
    let mut r = router(RouterMode::Kv, 2);
    let prompt = tokens(1, 16);
    r.apply_event(&store_event(1, &prompt)).unwrap();
    r.remove_worker(WorkerId(1)).unwrap();
    assert_eq!(r.index().stats().entries, 0);
    let d = r.route(&request(1, &prompt), Time::ZERO).unwrap();
    assert_eq!(d.rank.worker, WorkerId(0));
    assert_eq!(
        r.remove_worker(WorkerId(1)),
        Err(RouteError::UnknownWorker(WorkerId(1)))
    );
    let empty = &mut router(RouterMode::Kv, 0);
    assert_eq!(
        empty.route(&request(1, &prompt), Time::ZERO),
        Err(RouteError::NoWorkers)
    );
}

#[test]
fn allowed_workers_restrict_candidates() {
    let mut r = router(RouterMode::RoundRobin, 4);
    let mut req = request(1, &tokens(1, 8));
    req.allowed_workers = Some(vec![WorkerId(3)]);
    for i in 0..3 {
        req.id = RequestId(i);
        assert_eq!(r.route(&req, Time::ZERO).unwrap().rank.worker, WorkerId(3));
    }
}

#[test]
fn same_seed_same_decisions() {
    let run = |seed| {
        let mut r = seeded_router(RouterMode::Random, seed, 8);
        (0..50)
            .map(|i| {
                r.route(&request(i, &tokens(1, 4)), Time::ZERO)
                    .unwrap()
                    .rank
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

/// Found by probing: `serve` never swept expired bindings, so the table kept every session it
/// had seen. It stays within about twice the live bindings (at least the sweep floor).
#[test]
fn expired_session_bindings_do_not_pile_up() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_session_affinity_ttl_secs: Some(1.0),
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(0))).unwrap();
    let mut most = 0;
    // 20,000 sessions, 1,000 a second, each bound for a second: about 1,000 live at a time.
    for i in 0..20_000u64 {
        let mut req = request(i, &tokens(1, 8));
        req.session = Some(i);
        let now = Time::from_millis(i);
        r.route(&req, now).unwrap();
        let _ = r.finish(RequestId(i), now).unwrap();
        most = most.max(r.session_count());
    }
    assert!(most <= 2 * 1_001 + super::SESSIONS_SWEEP_MIN, "{most}");
    assert!(r.session_count() < 20_000);
}

#[test]
fn sessions_stick_to_their_worker_until_the_binding_expires() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_session_affinity_ttl_secs: Some(10.0),
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..3 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let turn = |id: u64, session: Option<u64>| {
        let mut req = request(id, &tokens(1, 8));
        req.session = session;
        req
    };
    let first = r.route(&turn(1, Some(7)), Time::ZERO).unwrap().rank;
    for i in 2..6 {
        let t = Time::from_secs_f64(i as f64);
        assert_eq!(
            r.route(&turn(i, Some(7)), t).unwrap().rank,
            first,
            "turn {i} sticks (each turn refreshes the TTL)"
        );
        r.route(&turn(100 + i, None), t).unwrap();
    }
    // 10 s after the last turn the binding is gone and round-robin places it anew.
    let later = r
        .route(&turn(50, Some(7)), Time::from_secs_f64(16.0))
        .unwrap()
        .rank;
    let again = r
        .route(&turn(51, Some(7)), Time::from_secs_f64(17.0))
        .unwrap()
        .rank;
    assert_eq!(again, later, "re-bound");
    assert!(r.release_session(7));
    assert!(!r.release_session(7));
    // A bound worker that disappears: the session is re-placed on a live one.
    r.route(&turn(60, Some(8)), Time::from_secs_f64(20.0))
        .unwrap();
    let bound = r.ledger().get(RequestId(60)).unwrap().0;
    r.remove_worker(bound.worker).unwrap();
    let moved = r
        .route(&turn(61, Some(8)), Time::from_secs_f64(21.0))
        .unwrap()
        .rank;
    assert_ne!(moved.worker, bound.worker);
}

#[test]
fn unavailable_workers_leave_the_eligible_set_but_keep_their_load() {
    let mut r = router(RouterMode::RoundRobin, 2);
    r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    let loaded = r.ledger().get(RequestId(1)).unwrap().0;
    assert!(r.set_available(loaded.worker, false));
    for i in 2..5 {
        assert_ne!(
            r.route(&request(i, &tokens(1, 8)), Time::ZERO)
                .unwrap()
                .rank
                .worker,
            loaded.worker
        );
    }
    assert_eq!(
        r.load(loaded).active_requests,
        1,
        "health never resets load accounting"
    );
    r.set_available(loaded.worker, true);
    assert!(r.is_available(loaded.worker));
    assert!(!r.set_available(WorkerId(99), false));
}

#[test]
fn impossible_worker_specs_are_typed_errors_not_allocations() {
    let mut r = router(RouterMode::RoundRobin, 1);
    let id = WorkerId(77);
    let huge = WorkerSpec {
        dp_size: u32::MAX,
        ..WorkerSpec::new(id)
    };
    assert!(matches!(
        r.add_worker(huge),
        Err(RouteError::InvalidWorker(w, _)) if w == id
    ));
    let over = WorkerSpec {
        dp_size: MAX_DP_SIZE + 1,
        ..WorkerSpec::new(id)
    };
    assert!(matches!(
        r.add_worker(over),
        Err(RouteError::InvalidWorker(..))
    ));
    for spec in [
        WorkerSpec {
            max_num_batched_tokens: Some(0),
            ..WorkerSpec::new(id)
        },
        WorkerSpec {
            kv_capacity_blocks: Some(0),
            ..WorkerSpec::new(id)
        },
    ] {
        assert!(matches!(
            r.add_worker(spec),
            Err(RouteError::InvalidWorker(..))
        ));
    }
    assert!(r.workers().all(|w| w.id != id), "nothing was registered");
    let max = WorkerSpec {
        dp_size: MAX_DP_SIZE,
        ..WorkerSpec::new(id)
    };
    r.add_worker(max).unwrap();
    assert_eq!(
        r.ranks().iter().filter(|k| k.worker == id).count(),
        MAX_DP_SIZE as usize
    );
}

#[test]
fn the_index_is_bounded_by_each_workers_declared_capacity_or_the_default() {
    use crate::index::TierCapacity;
    let config = RouterConfig {
        router_index_max_blocks_per_worker: 100,
        ..RouterConfig::default()
    };
    let mut r = Router::new(config).unwrap();
    let mut declared = WorkerSpec::new(WorkerId(0));
    declared.kv_capacity_blocks = Some(16);
    r.add_worker(declared).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(1))).unwrap();
    let gpu_16 = TierCapacity {
        gpu_blocks: 16,
        offload_blocks: 100,
    };
    assert_eq!(r.index().worker_capacity(WorkerId(0)), Some(gpu_16));
    assert_eq!(
        r.index().worker_capacity(WorkerId(1)),
        Some(TierCapacity::uniform(100))
    );
    r.remove_worker(WorkerId(0)).unwrap();
    assert_eq!(r.index().worker_capacity(WorkerId(0)), None);
}
