//! Tests of the RL controls (`rl.rs`): pauses, policy versions, group placement.

use super::tests::{request, router, seeded_router, store_event, tokens, BS};
use super::*;
use crate::router::admission::Admission;

#[test]
fn paused_workers_keep_load_and_cache_and_only_resume_undoes_a_pause() {
    let mut r = router(RouterMode::Kv, 2);
    let first = r
        .route(&request(1, &tokens(1, 8)), Time::ZERO)
        .unwrap()
        .rank;
    let w = first.worker;
    assert!(r.set_paused(w, true));
    assert!(r.is_paused(w) && !r.is_available(w));
    for i in 2..6 {
        let d = r.route(&request(i, &tokens(1, 8)), Time::ZERO).unwrap();
        assert_ne!(d.rank.worker, w, "a paused worker gets no new request");
    }
    // Pinned requests are refused too.
    let mut pinned = request(9, &tokens(1, 8));
    pinned.pin = Some(Pin {
        worker: w,
        dp_rank: None,
    });
    assert_eq!(r.route(&pinned, Time::ZERO), Err(RouteError::WorkersPaused));
    // Health coming back does not resume a paused worker.
    r.set_available(w, false);
    r.set_available(w, true);
    assert!(!r.is_available(w));
    assert_eq!(
        r.load(first).active_requests,
        1,
        "load accounting survives the pause"
    );
    assert!(r.set_paused(w, false));
    assert!(r.is_available(w));
    assert!(!r.set_paused(WorkerId(99), true));
    r.check_invariants().unwrap();
}

fn versioned(id: u64, req: VersionRequirement) -> RouteRequest {
    let mut r = request(id, &tokens(id as u32, 2 * BS as u32));
    r.policy = req;
    r
}

#[test]
fn only_workers_of_an_accepted_policy_version_are_eligible() {
    let mut r = router(RouterMode::RoundRobin, 3);
    assert!(r.set_policy_version(WorkerId(0), 1));
    r.set_policy_version(WorkerId(1), 2);
    r.set_policy_version(WorkerId(2), 3);
    assert!(!r.set_policy_version(WorkerId(9), 1));
    assert_eq!(r.newest_policy_version(), 3);
    let exact = VersionRequirement {
        exact: Some(1),
        ..Default::default()
    };
    let min = VersionRequirement {
        min: Some(2),
        ..Default::default()
    };
    let stale = VersionRequirement {
        max_staleness: Some(1),
        ..Default::default()
    };
    let mut id = 0;
    for (req, allowed) in [(exact, vec![0]), (min, vec![1, 2]), (stale, vec![1, 2])] {
        for _ in 0..4 {
            id += 1;
            let d = r.route(&versioned(id, req), Time::ZERO).unwrap();
            assert!(
                allowed.contains(&d.rank.worker.0),
                "{req:?} went to {:?}",
                d.rank
            );
            assert_eq!(d.policy_version, d.rank.worker.0 + 1);
        }
    }
    // Bounds combine; an unmet one leaves nobody.
    let none = VersionRequirement {
        exact: Some(1),
        min: Some(2),
        ..Default::default()
    };
    assert_eq!(
        r.route(&versioned(99, none), Time::ZERO),
        Err(RouteError::NoCompatibleVersion)
    );
    // A pin to a worker of another version is refused the same way.
    let mut pinned = versioned(98, exact);
    pinned.pin = Some(Pin {
        worker: WorkerId(2),
        dp_rank: None,
    });
    assert_eq!(
        r.route(&pinned, Time::ZERO),
        Err(RouteError::NoCompatibleVersion)
    );
}

#[test]
fn requests_wait_for_their_policy_version_without_blocking_others() {
    for threshold in [None, Some(10.0)] {
        let config = RouterConfig {
            router_mode: RouterMode::RoundRobin,
            kv_cache_block_size: BS,
            router_queue_threshold: threshold,
            ..Default::default()
        };
        let mut r = Router::new(config).unwrap();
        for w in 0..2 {
            let mut spec = WorkerSpec::new(WorkerId(w));
            spec.max_num_batched_tokens = Some(8192);
            r.add_worker(spec).unwrap();
        }
        let wants_new = VersionRequirement {
            exact: Some(1),
            ..Default::default()
        };
        assert_eq!(
            r.submit(versioned(1, wants_new), Time::ZERO),
            Ok(Admission::Queued)
        );
        let mut deadline = versioned(2, wants_new);
        deadline.deadline = Some(Time::from_secs_f64(1.0));
        assert_eq!(r.submit(deadline, Time::ZERO), Ok(Admission::Queued));
        // Others pass (through the queue when it has a threshold, since arrivals never
        // overtake a backlog).
        let other = r
            .submit(versioned(3, VersionRequirement::default()), Time::ZERO)
            .unwrap();
        let placed: Vec<RequestId> = match other {
            Admission::Dispatched(d) => vec![d.request],
            Admission::Queued => r
                .poll(Time::ZERO)
                .into_iter()
                .map(|(id, d)| {
                    d.unwrap();
                    id
                })
                .collect(),
        };
        assert_eq!(placed, vec![RequestId(3)], "threshold {threshold:?}");
        assert_eq!(r.queue_stats().pending_requests, 2);
        // The deadline passes while no worker serves version 1.
        let expired = r.poll(Time::from_secs_f64(2.0));
        assert_eq!(
            expired,
            vec![(RequestId(2), Err(RouteError::DeadlineExceeded))]
        );
        // A worker loads version 1: the waiting request goes there.
        r.set_policy_version(WorkerId(1), 1);
        let placed = r.poll(Time::from_secs_f64(2.0));
        assert_eq!(placed.len(), 1);
        let d = placed[0].1.clone().unwrap();
        assert_eq!(
            (d.request, d.rank.worker, d.policy_version),
            (RequestId(1), WorkerId(1), 1)
        );
        assert_eq!(r.queue_stats().pending_requests, 0);
        r.check_invariants().unwrap();
    }
}

#[test]
fn group_siblings_follow_their_group_until_the_skew_bound() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_group_max_skew: 2,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..3 {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    let sibling = |id: u64| {
        let mut q = request(id, &tokens(7, 8));
        q.group = Some(42);
        q
    };
    let home = r.route(&sibling(1), Time::ZERO).unwrap().rank;
    // Round-robin alone would rotate; siblings stay while home carries ≤ least + 2.
    for id in 2..=3 {
        assert_eq!(r.route(&sibling(id), Time::ZERO).unwrap().rank, home);
    }
    // Home now has 3 active, the others 0: the next sibling spills, and that becomes home.
    let spilled = r.route(&sibling(4), Time::ZERO).unwrap().rank;
    assert_ne!(spilled, home);
    assert_eq!(r.route(&sibling(5), Time::ZERO).unwrap().rank, spilled);
    assert_eq!(r.group_count(), 1);
    // Requests of no group are placed as before, and skew 0 turns grouping off.
    let mut off = router(RouterMode::RoundRobin, 3);
    let a = off.route(&sibling(1), Time::ZERO).unwrap().rank;
    let b = off.route(&sibling(2), Time::ZERO).unwrap().rank;
    assert_ne!(a, b);
    assert_eq!(off.group_count(), 0);
    r.check_invariants().unwrap();
}

fn sized(id: u64, group: u64, size: u32) -> RouteRequest {
    let mut q = request(id, &tokens(group as u32, 8));
    q.group = Some(group);
    q.group_size = Some(size);
    q
}

#[test]
fn a_sized_group_splits_across_the_fewest_workers_that_keep_it_within_a_fair_share() {
    // Idle fleet of 4, group of 8: a fair share is 2 requests, so 2 siblings per worker,
    // even though worker 0 holds the prompt and attracts every sibling by cost.
    let mut r = router(RouterMode::Kv, 4);
    r.apply_event(&store_event(0, &tokens(1, 8))).unwrap();
    let mut per_worker = std::collections::BTreeMap::new();
    for id in 0..8 {
        let d = r.route(&sized(id, 1, 8), Time::ZERO).unwrap();
        *per_worker.entry(d.rank.worker.0).or_insert(0) += 1;
    }
    assert_eq!(
        per_worker.values().copied().collect::<Vec<u32>>(),
        vec![2, 2, 2, 2]
    );
    // A busy fleet (12 active each): a fair share is 14, so the whole group fits on one.
    let mut busy = router(RouterMode::Kv, 4);
    for id in 0..48 {
        busy.route(&request(100 + id, &tokens(100 + id as u32, 8)), Time::ZERO)
            .unwrap();
    }
    let homes: std::collections::BTreeSet<u64> = (0..8)
        .map(|id| {
            busy.route(&sized(id, 2, 8), Time::ZERO)
                .unwrap()
                .rank
                .worker
                .0
        })
        .collect();
    assert_eq!(homes.len(), 1, "kept together: {homes:?}");
    busy.check_invariants().unwrap();
}

#[test]
fn first_n_of_m_is_satisfied_once_and_group_tail_admits_the_closest_group_first() {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_queue_threshold: Some(0.0),
        router_queue_policy: QueuePolicy::GroupTail,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    let mut spec = WorkerSpec::new(WorkerId(0));
    spec.max_num_batched_tokens = Some(8);
    r.add_worker(spec).unwrap();
    let member = |id: u64, group: u64| {
        let mut q = sized(id, group, 4);
        q.group_need = Some(3);
        q
    };
    // One request in prefill keeps the worker over the threshold: the rest queue.
    let Ok(Admission::Dispatched(_)) = r.submit(member(1, 7), Time::ZERO) else {
        panic!("the first request is placed");
    };
    for (id, group) in [(2, 8), (3, 7), (4, 8)] {
        assert_eq!(
            r.submit(member(id, group), Time::ZERO),
            Ok(Admission::Queued)
        );
    }
    assert_eq!((r.group_left(7), r.group_left(8)), (Some(3), Some(3)));
    assert!(!r.group_sample_finished(7, Time::ZERO));
    assert!(!r.group_sample_finished(7, Time::ZERO));
    assert_eq!(r.group_left(7), Some(1));
    r.first_token(RequestId(1)).unwrap();
    // Group 7 is one sample from done: its request goes before group 8's older one.
    let placed: Vec<u64> = r.poll(Time::ZERO).into_iter().map(|(id, _)| id.0).collect();
    assert_eq!(placed.first(), Some(&3), "{placed:?}");
    assert!(
        r.group_sample_finished(7, Time::ZERO),
        "the third of 3 needed"
    );
    assert!(r.group_satisfied(7) && !r.group_satisfied(8));
    assert!(!r.group_sample_finished(7, Time::ZERO), "satisfied once");
    assert_eq!(r.group_left(7), Some(0));
    assert!(
        !r.group_sample_finished(99, Time::ZERO),
        "unknown groups are ignored"
    );
}

#[test]
fn a_request_no_worker_will_ever_serve_leaves_the_queue_after_the_max_wait() {
    let config = RouterConfig {
        kv_cache_block_size: BS,
        router_queue_max_wait_secs: 30.0,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    r.add_worker(WorkerSpec::new(WorkerId(0))).unwrap();
    let wants_new = VersionRequirement {
        exact: Some(7),
        ..Default::default()
    };
    assert_eq!(
        r.submit(versioned(1, wants_new), Time::from_secs_f64(2.0)),
        Ok(Admission::Queued)
    );
    // Its own (later) deadline does not keep it longer than the bound.
    let mut late = versioned(2, wants_new);
    late.deadline = Some(Time::from_secs_f64(500.0));
    r.submit(late, Time::from_secs_f64(2.0)).unwrap();
    assert_eq!(r.next_deadline(), Some(Time::from_secs_f64(32.0)));
    assert!(r.poll(Time::from_secs_f64(31.9)).is_empty());
    let out = r.poll(Time::from_secs_f64(32.0));
    let why = RouteError::QueueWaitExceeded {
        waited_ms: 30_000,
        waiting_for: RouteError::NoCompatibleVersion.to_string(),
    };
    assert_eq!(
        out,
        vec![(RequestId(1), Err(why.clone())), (RequestId(2), Err(why))]
    );
    assert_eq!(r.queue_stats().pending_requests, 0);
    assert_eq!(
        RouterConfig::default().router_queue_max_requests,
        Some(1024)
    );
}

#[test]
fn a_sized_group_counts_only_running_siblings_against_its_share() {
    // Idle fleet of 4, group of 8 whose prompt worker 0 holds, sent one at a time (each sibling
    // finishes before the next): nothing runs beside it, so every sibling stays with the prefix.
    // Counting finished siblings as load spread the group over every worker.
    let mut r = router(RouterMode::Kv, 4);
    r.apply_event(&store_event(0, &tokens(1, 8))).unwrap();
    let mut workers = std::collections::BTreeSet::new();
    for id in 0..8 {
        let d = r.route(&sized(id, 1, 8), Time::ZERO).unwrap();
        workers.insert(d.rank.worker.0);
        let _ = r.finish(RequestId(id), Time::ZERO).unwrap();
    }
    assert_eq!(workers.into_iter().collect::<Vec<u64>>(), vec![0]);
    r.check_invariants().unwrap();
}

#[test]
fn the_skew_bound_applies_to_a_sized_group_too() {
    // Busy fleet (12 active each): a fair share keeps a group of 8 on one worker, but with
    // `router_group_max_skew` 2 the group's worker takes siblings only while it carries at most
    // 2 active requests above the least-loaded worker.
    let config = RouterConfig {
        router_mode: RouterMode::Kv,
        kv_cache_block_size: BS,
        router_group_max_skew: 2,
        ..Default::default()
    };
    let mut busy = Router::new(config).unwrap();
    for w in 0..4 {
        busy.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    for id in 0..48 {
        busy.route(&request(100 + id, &tokens(100 + id as u32, 8)), Time::ZERO)
            .unwrap();
    }
    let mut per_worker = std::collections::BTreeMap::new();
    for id in 0..8 {
        let d = busy.route(&sized(id, 2, 8), Time::ZERO).unwrap();
        *per_worker.entry(d.rank.worker.0).or_insert(0u32) += 1;
    }
    assert!(per_worker.len() > 1, "spread past the skew: {per_worker:?}");
    assert!(per_worker.values().all(|n| *n <= 3), "{per_worker:?}");
    busy.check_invariants().unwrap();
}

fn synced_replica(seed: u64, workers: u64) -> Router {
    let mut r = seeded_router(RouterMode::Kv, seed, workers);
    r.enable_replica_sync(crate::ids::ReplicaId(seed), 1024);
    r
}

#[test]
fn synced_replicas_start_a_new_group_on_the_same_worker_before_hearing_of_each_other() {
    // Two replicas with their own seeds place the first sibling each of 16 new groups, taking
    // turns, before any event passes between them. Their views stay alike (each placed the
    // same siblings), but their random tie-breaks differ. They agree on every group's worker.
    let (mut a, mut b) = (synced_replica(1, 8), synced_replica(2, 8));
    for g in 0..16u64 {
        let ra = a.route(&sized(2 * g, 100 + g, 8), Time::ZERO).unwrap().rank;
        let rb = b
            .route(&sized(2 * g + 1, 100 + g, 8), Time::ZERO)
            .unwrap()
            .rank;
        assert_eq!(ra, rb, "group {g}");
    }
    // Without sync each starts the group on its own argmin (seeded ties): they disagree.
    let (mut c, mut d) = (
        seeded_router(RouterMode::Kv, 1, 8),
        seeded_router(RouterMode::Kv, 2, 8),
    );
    let split = (0..16u64)
        .filter(|g| {
            let rc = c.route(&sized(2 * g, 100 + g, 8), Time::ZERO).unwrap().rank;
            let rd = d
                .route(&sized(2 * g + 1, 100 + g, 8), Time::ZERO)
                .unwrap()
                .rank;
            rc != rd
        })
        .count();
    assert!(
        split > 0,
        "unsynced replicas agreed on every group by chance"
    );
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
}

#[test]
fn a_new_groups_worker_costs_at_most_one_more_prompt_than_the_best() {
    // Naive model: whatever the load, the rendezvous choice is among the candidates within the
    // request's own blocks of the cheapest.
    let mut rng = crate::rng::SeededRng::new(7);
    for case in 0..64u64 {
        let mut r = synced_replica(case, 6);
        for i in 0..rng.below(24) as u64 {
            let len = 4 + 4 * rng.below(6) as u32;
            r.route(
                &request(1_000 + i, &tokens(1_000 + i as u32, len)),
                Time::ZERO,
            )
            .unwrap();
        }
        let q = sized(1, 500 + case, 4);
        let d = r.route(&q, Time::ZERO).unwrap();
        let best = d
            .candidates
            .iter()
            .map(|s| s.total)
            .fold(f64::INFINITY, f64::min);
        let chosen = d.candidates.iter().find(|s| s.rank == d.rank).unwrap();
        let margin = q.request_blocks(BS) as f64;
        assert!(
            chosen.total <= best + margin,
            "case {case}: {} > {best} + {margin}",
            chosen.total
        );
    }
}
