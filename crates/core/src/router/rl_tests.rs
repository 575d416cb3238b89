//! Tests of the RL controls (`rl.rs`): pauses, policy versions, group placement.

use super::tests::{request, router, tokens, BS};
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
