use super::tests::{request, router, store_event, tokens, BS};
use super::*;
use crate::ids::ReplicaId;
use crate::ledger::RankLoad;

const A: ReplicaId = ReplicaId(1);
const B: ReplicaId = ReplicaId(2);

fn pair(mode: RouterMode, workers: u64) -> (Router, Router) {
    let mut a = router(mode, workers);
    let mut b = router(mode, workers);
    a.enable_replica_sync(A, 1024);
    b.enable_replica_sync(B, 1024);
    (a, b)
}

/// Delivers everything `from` queued to `to`.
fn deliver(from: &mut Router, to: &mut Router, now: Time) {
    for e in from.take_outgoing() {
        let _ = to.apply_remote(e, now).unwrap();
    }
}

fn rank(w: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(w), 0)
}

#[test]
fn remote_load_follows_begin_first_token_finish() {
    let (mut a, mut b) = pair(RouterMode::Kv, 2);
    let d = a.route(&request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.load(d.rank), a.load(d.rank));
    assert_eq!(b.load(d.rank).active_prefill_tokens, 40);
    a.first_token(RequestId(1)).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.load(d.rank), a.load(d.rank));
    let _ = a.finish(RequestId(1), Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.load(d.rank), RankLoad::default());
    assert_eq!(b.remote_requests().len(), 0);
    b.check_invariants().unwrap();
}

#[test]
fn remote_events_are_checked() {
    let (mut a, mut b) = pair(RouterMode::Kv, 1);
    let begin = |replica, request| RemoteEvent::Begin {
        replica,
        request: RequestId(request),
        rank: rank(0),
        prefill_tokens: 4,
        blocks: vec![],
        private_blocks: 1,
    };
    assert_eq!(
        a.apply_remote(begin(A, 1), Time::ZERO),
        Err(RemoteError::OwnEvent(A))
    );
    let mut unknown = begin(B, 1);
    if let RemoteEvent::Begin { rank, .. } = &mut unknown {
        *rank = WorkerRank::new(WorkerId(9), 0);
    }
    assert!(matches!(
        a.apply_remote(unknown, Time::ZERO),
        Err(RemoteError::UnknownRank(_))
    ));
    let _ = a.apply_remote(begin(B, 1), Time::ZERO).unwrap();
    assert_eq!(
        a.apply_remote(begin(B, 1), Time::ZERO),
        Err(RemoteError::DuplicateRequest(B, RequestId(1)))
    );
    let finish = RemoteEvent::Finish {
        replica: B,
        request: RequestId(7),
    };
    assert_eq!(
        a.apply_remote(finish, Time::ZERO),
        Err(RemoteError::UnknownRequest(B, RequestId(7)))
    );
    // The same request id from two replicas is two requests.
    let _ = b.apply_remote(begin(A, 1), Time::ZERO).unwrap();
    let _ = a.apply_remote(begin(ReplicaId(3), 1), Time::ZERO).unwrap();
    assert_eq!(a.load(rank(0)).active_requests, 2);
    a.check_invariants().unwrap();
}

#[test]
fn an_expired_replica_leaves_no_load_and_no_hold() {
    let (mut a, mut b) = pair(RouterMode::Kv, 2);
    for i in 0..6 {
        a.route(&request(i, &tokens(i as u32, 16)), Time::ZERO)
            .unwrap();
    }
    a.first_token(RequestId(2)).unwrap();
    let plan = UpdatePlan {
        version: 5,
        mode: UpdateMode::Drain,
        batch: 1,
        workers: Some(vec![WorkerId(1)]),
    };
    a.begin_update(plan, Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.ledger().active_requests(), 6);
    assert!(!b.is_available(WorkerId(1)), "held by A's update");
    let _ = b
        .apply_remote(RemoteEvent::ReplicaExpired { replica: A }, Time::ZERO)
        .unwrap();
    assert_eq!(b.ledger().active_requests(), 0);
    assert_eq!(b.load(rank(0)), RankLoad::default());
    assert_eq!(b.load(rank(1)), RankLoad::default());
    assert!(b.is_available(WorkerId(1)), "a dead replica's hold is gone");
    b.check_invariants().unwrap();
}

#[test]
fn the_active_list_repairs_a_lost_finish() {
    let (mut a, mut b) = pair(RouterMode::Kv, 2);
    a.route(&request(1, &tokens(1, 16)), Time::ZERO).unwrap();
    a.route(&request(2, &tokens(2, 16)), Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    let _ = a.finish(RequestId(1), Time::ZERO).unwrap();
    let lost = a.take_outgoing();
    assert_eq!(lost.len(), 1, "the finish");
    a.replica_active();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.ledger().active_requests(), 1);
    assert_eq!(b.remote_requests()[&A], 1);
    b.check_invariants().unwrap();
}

#[test]
fn the_active_list_restores_a_lost_begin_and_first_token() {
    let (mut a, mut b) = pair(RouterMode::Kv, 2);
    let d1 = a.route(&request(1, &tokens(1, 16)), Time::ZERO).unwrap();
    let d2 = a.route(&request(2, &tokens(2, 16)), Time::ZERO).unwrap();
    a.first_token(RequestId(2)).unwrap();
    // Request 1's begin arrives; request 2's begin and first token are lost.
    let sent = a.take_outgoing();
    let kept: Vec<RemoteEvent> = sent
        .into_iter()
        .filter(|e| {
            !matches!(
                e,
                RemoteEvent::Begin {
                    request: RequestId(2),
                    ..
                } | RemoteEvent::FirstToken { .. }
            )
        })
        .collect();
    for e in kept {
        let _ = b.apply_remote(e, Time::ZERO).unwrap();
    }
    assert_eq!(
        b.ledger().active_requests(),
        1,
        "request 2's load is invisible"
    );
    a.replica_active();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.remote_requests()[&A], 2, "the heartbeat restored it");
    for r in [d1.rank, d2.rank] {
        let (here, there) = (a.load(r), b.load(r));
        assert_eq!(there.active_requests, here.active_requests);
        // Request 2 is past its first token there too: no prefill tokens left.
        assert_eq!(there.active_prefill_tokens, here.active_prefill_tokens);
        // Restored blocks count as its own: never less than the owner counts.
        assert!(there.active_decode_blocks >= here.active_decode_blocks);
    }
    b.check_invariants().unwrap();
    // Its finish then releases it as if nothing was lost.
    let _ = a.finish(RequestId(2), Time::ZERO).unwrap();
    let _ = a.finish(RequestId(1), Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.ledger().active_requests(), 0);
    assert!(b.remote_requests().is_empty());
}

#[test]
fn active_lists_over_their_bound_go_round_the_ids() {
    let (mut a, mut b) = pair(RouterMode::Kv, 2);
    a.set_active_list_max(2);
    for id in 1..=5 {
        a.route(&request(id, &tokens(id as u32, 8)), Time::ZERO)
            .unwrap();
    }
    let _ = a.take_outgoing(); // every begin lost
    let mut sizes = Vec::new();
    for _ in 0..3 {
        a.replica_active();
        let out = a.take_outgoing();
        for e in &out {
            if let RemoteEvent::Active { requests, .. } = e {
                sizes.push(requests.len());
            }
        }
        for e in out {
            let _ = b.apply_remote(e, Time::ZERO).unwrap();
        }
    }
    assert_eq!(sizes, vec![2, 2, 1], "bounded lists, round the ids");
    assert_eq!(b.remote_requests()[&A], 5);
    // A finish lost for an id in a later range is repaired when the lists reach it.
    let _ = a.finish(RequestId(5), Time::ZERO).unwrap();
    let _ = a.take_outgoing();
    a.replica_active(); // ids 1, 2: not 5's range
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.remote_requests()[&A], 5);
    a.replica_active(); // ids 3 up
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.remote_requests()[&A], 4);
    b.check_invariants().unwrap();
}

#[test]
fn sessions_and_groups_placed_by_one_replica_hold_at_the_other() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_session_affinity_ttl_secs: Some(60.0),
        router_group_max_skew: 100,
        ..Default::default()
    };
    let mk = |config: &RouterConfig, id| {
        let mut r = Router::new(config.clone()).unwrap();
        for w in 0..3 {
            r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
        }
        r.enable_replica_sync(id, 64);
        r
    };
    let (mut a, mut b) = (mk(&config, A), mk(&config, B));
    // B's round-robin cursor is elsewhere, so only the shared binding can agree.
    b.route(&request(100, &tokens(9, 8)), Time::ZERO).unwrap();
    b.take_outgoing();
    let mut first = request(1, &tokens(1, 8));
    first.session = Some(77);
    first.group = Some(5);
    let d = a.route(&first, Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.session_binding(77, Time::ZERO), Some(d.rank));
    let mut next = request(2, &tokens(1, 8));
    next.session = Some(77);
    assert_eq!(b.route(&next, Time::ZERO).unwrap().rank, d.rank);
    let mut sibling = request(3, &tokens(1, 8));
    sibling.group = Some(5);
    assert_eq!(b.route(&sibling, Time::ZERO).unwrap().rank, d.rank);
    // A release at A releases it at B.
    assert!(a.release_session(77));
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.session_binding(77, Time::ZERO), None);
}

/// What a replica writes back into a shared store that lost its sessions: the live bindings
/// with the time each has left, expired ones left out, at most `max`.
#[test]
fn live_session_bindings_are_listed_with_their_time_left() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_session_affinity_ttl_secs: Some(10.0),
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..2 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let bind = |r: &mut Router, id: u64, session: u64, at: Time| {
        let mut req = request(id, &tokens(id as u32, 8));
        req.session = Some(session);
        r.route(&req, at).unwrap().rank
    };
    let first = bind(&mut r, 1, 7, Time::ZERO);
    let second = bind(&mut r, 2, 9, Time::from_millis(4_000));
    let at = Time::from_millis(6_000);
    assert_eq!(
        r.session_bindings(at, 10),
        vec![(7, first, 4_000), (9, second, 8_000)]
    );
    assert_eq!(r.session_bindings(at, 1).len(), 1);
    // Past the first binding's end it is left out, though not yet expired from the table.
    assert_eq!(
        r.session_bindings(Time::from_millis(11_000), 10),
        vec![(9, second, 3_000)]
    );
}

#[test]
fn predicted_placements_are_shared() {
    let config = RouterConfig {
        router_mode: RouterMode::Kv,
        kv_cache_block_size: BS,
        router_predicted_ttl_secs: Some(30.0),
        ..Default::default()
    };
    let mk = |id| {
        let mut r = Router::new(config.clone()).unwrap();
        for w in 0..4 {
            r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
        }
        r.enable_replica_sync(id, 64);
        r
    };
    let (mut a, mut b) = (mk(A), mk(B));
    let prompt = tokens(3, 64);
    let d = a.route(&request(1, &prompt), Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    let _ = a.finish(RequestId(1), Time::ZERO).unwrap();
    deliver(&mut a, &mut b, Time::ZERO);
    // No KV event yet: only the shared prediction says where the prefix goes.
    let again = b.route(&request(2, &prompt), Time::ZERO).unwrap();
    assert_eq!(again.rank, d.rank);
    assert_eq!(again.overlap.gpu_blocks, 16);
}

#[test]
fn versions_and_pauses_are_shared_and_nothing_echoes() {
    let (mut a, mut b) = pair(RouterMode::Kv, 2);
    a.set_policy_version(WorkerId(1), 3);
    a.set_paused(WorkerId(0), true);
    deliver(&mut a, &mut b, Time::ZERO);
    assert_eq!(b.newest_policy_version(), 3);
    assert!(b.is_paused(WorkerId(0)));
    assert!(!b.has_outgoing(), "applied remote events are not sent on");
    let _ = b.apply_event(&store_event(1, &tokens(1, 8)));
}

#[test]
fn a_full_outbox_drops_and_counts() {
    let mut a = router(RouterMode::Kv, 1);
    a.enable_replica_sync(A, 2);
    for i in 0..3 {
        a.route(&request(i, &tokens(i as u32, 8)), Time::ZERO)
            .unwrap();
    }
    assert_eq!(a.take_outgoing().len(), 2);
    assert_eq!(a.outgoing_dropped(), 1);
    assert!(!a.has_outgoing());
    // Found by probing: a pause made while the outbox was full of load events (a replica
    // that has not joined yet) was the one dropped. It takes the oldest load event's place.
    for i in 10..12 {
        a.route(&request(i, &tokens(i as u32, 8)), Time::ZERO)
            .unwrap();
    }
    assert!(a.set_paused(WorkerId(0), true));
    let queued = a.take_outgoing();
    assert_eq!(queued.len(), 2);
    assert!(!queued[0].is_lasting(), "the newer load event stays");
    assert_eq!(
        queued[1],
        RemoteEvent::Paused {
            worker: WorkerId(0),
            paused: true
        }
    );
    assert_eq!(a.outgoing_dropped(), 2);
}

#[test]
fn without_sync_nothing_is_queued() {
    let mut a = router(RouterMode::Kv, 1);
    a.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    assert!(a.take_outgoing().is_empty());
    assert_eq!(a.replica_id(), None);
}
