//! Tests of the weight-update cycle (`update.rs`).

use super::tests::{request, router, store_event, tokens};
use super::*;
use crate::router::admission::Admission;

fn plan(version: u64, mode: UpdateMode, batch: usize) -> UpdatePlan {
    UpdatePlan {
        version,
        mode,
        batch,
        workers: None,
    }
}

fn loads(actions: &[UpdateAction]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            UpdateAction::Load { worker, .. } => Some(worker.0),
            UpdateAction::Abort(_) => None,
        })
        .collect()
}

#[test]
fn drain_waits_for_in_flight_requests_and_queues_new_ones_until_a_worker_is_back() {
    let mut r = router(RouterMode::RoundRobin, 2);
    let busy = r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    let w = busy.rank.worker;
    let other = WorkerId(1 - w.0);
    let first = r
        .begin_update(plan(1, UpdateMode::Drain, 1), Time::ZERO)
        .unwrap();
    assert_eq!(
        loads(&first),
        vec![other.0],
        "only the idle worker loads now"
    );
    assert_eq!(r.update_phase(w), Some(UpdatePhase::Draining));
    // Nobody serves: a new request waits instead of failing.
    assert_eq!(
        r.route(&request(2, &tokens(2, 8)), Time::ZERO),
        Err(RouteError::WorkersPaused)
    );
    assert_eq!(
        r.submit(request(2, &tokens(2, 8)), Time::ZERO),
        Ok(Admission::Queued)
    );
    assert!(r.poll(Time::ZERO).is_empty(), "still nobody to serve it");
    // The idle worker loads version 1 and, as no other worker is loading, comes back at once
    // (it does not wait for a drain) and takes the waiting request.
    assert!(r.update_loaded(other, true, Time::ZERO).unwrap().is_empty());
    assert_eq!(r.update_phase(other), Some(UpdatePhase::Done));
    let placed = r.poll(Time::ZERO);
    assert_eq!(placed.len(), 1);
    let d = placed[0].1.as_ref().unwrap();
    assert_eq!((d.rank.worker, d.policy_version), (other, 1));
    // The draining worker loads once its request finished.
    assert!(r.update_tick(Time::ZERO).is_empty());
    let released = r.finish(RequestId(1), Time::ZERO).unwrap();
    assert_eq!(loads(&released.update), vec![w.0]);
    assert!(
        r.update_tick(Time::ZERO).is_empty(),
        "a load is asked for once"
    );
    r.update_loaded(w, true, Time::from_micros(5)).unwrap();
    let status = r.update_status().unwrap();
    assert_eq!((status.done, status.total), (2, 2));
    assert_eq!(status.finished, Some(Time::from_micros(5)));
    assert!(r.is_available(w) && r.workers().all(|s| s.policy_version == 1));
    r.check_invariants().unwrap();
}

#[test]
fn rolling_updates_at_most_batch_workers_at_a_time_while_the_rest_serve() {
    let mut r = router(RouterMode::RoundRobin, 5);
    let mut actions = r
        .begin_update(plan(3, UpdateMode::Rolling, 2), Time::ZERO)
        .unwrap();
    let mut order = Vec::new();
    let mut id = 10;
    while let Some(UpdateAction::Load { worker, version }) = actions.first().cloned() {
        assert_eq!(version, 3);
        let out: Vec<WorkerId> = r
            .workers()
            .map(|w| w.id)
            .filter(|w| {
                r.update_phase(*w)
                    .is_some_and(|p| p != UpdatePhase::Pending && p != UpdatePhase::Done)
            })
            .collect();
        assert!(out.len() <= 2, "at most the batch is out: {out:?}");
        // The others keep serving.
        id += 1;
        let d = r
            .route(&request(id, &tokens(id as u32, 8)), Time::ZERO)
            .unwrap();
        assert!(!out.contains(&d.rank.worker));
        actions.extend(r.finish(RequestId(id), Time::ZERO).unwrap().update);
        order.push(worker.0);
        actions.remove(0);
        actions.extend(r.update_loaded(worker, true, Time::ZERO).unwrap());
    }
    order.sort_unstable();
    assert_eq!(order, vec![0, 1, 2, 3, 4], "every worker loaded once");
    assert!(r.update_status().unwrap().finished.is_some());
    assert!(r.workers().all(|w| w.policy_version == 3));
}

#[test]
fn abort_mode_asks_for_aborts_and_loads_when_the_aborted_requests_are_gone() {
    let mut r = router(RouterMode::RoundRobin, 2);
    r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    r.route(&request(2, &tokens(2, 8)), Time::ZERO).unwrap();
    let actions = r
        .begin_update(plan(7, UpdateMode::Abort, 1), Time::ZERO)
        .unwrap();
    assert_eq!(
        actions,
        vec![
            UpdateAction::Abort(WorkerId(0)),
            UpdateAction::Abort(WorkerId(1))
        ]
    );
    // Each cancel returns the load of the worker it left idle.
    let first = r.cancel(RequestId(1), Time::ZERO).unwrap();
    assert_eq!(loads(&first.update), vec![0]);
    let second = r.cancel(RequestId(2), Time::ZERO).unwrap();
    assert_eq!(loads(&second.update), vec![1]);
    assert!(
        r.update_tick(Time::ZERO).is_empty(),
        "a load is asked for once"
    );
}

#[test]
fn a_failed_load_leaves_the_worker_paused_and_the_cycle_goes_on() {
    let mut r = router(RouterMode::RoundRobin, 2);
    let actions = r
        .begin_update(plan(2, UpdateMode::Rolling, 1), Time::ZERO)
        .unwrap();
    assert_eq!(loads(&actions), vec![0]);
    let next = r.update_loaded(WorkerId(0), false, Time::ZERO).unwrap();
    assert_eq!(loads(&next), vec![1]);
    assert!(r.is_paused(WorkerId(0)));
    assert_eq!(r.workers().next().unwrap().policy_version, 0);
    r.update_loaded(WorkerId(1), true, Time::ZERO).unwrap();
    let s = r.update_status().unwrap();
    assert_eq!(s.phases[&WorkerId(0)], UpdatePhase::Failed);
    assert_eq!((s.done, s.total), (1, 2));
    assert!(s.finished.is_some());
}

#[test]
fn the_next_load_that_succeeds_resumes_what_a_failed_load_paused_but_not_an_operators_pause() {
    let mut r = router(RouterMode::RoundRobin, 3);
    assert!(r.set_paused(WorkerId(2), true));
    let actions = r
        .begin_update(plan(1, UpdateMode::Drain, 1), Time::ZERO)
        .unwrap();
    assert_eq!(loads(&actions), vec![0, 1, 2]);
    for w in 0..3 {
        r.update_loaded(WorkerId(w), false, Time::ZERO).unwrap();
    }
    assert!((0..3).all(|w| r.is_paused(WorkerId(w))));
    assert!(r.is_paused_by_update(WorkerId(0)) && !r.is_paused_by_update(WorkerId(2)));
    // An operator's pause of a worker a failed load paused makes it the operator's.
    assert!(r.set_paused(WorkerId(1), true));
    assert!(!r.is_paused_by_update(WorkerId(1)));
    let actions = r
        .begin_update(plan(1, UpdateMode::Drain, 1), Time::ZERO)
        .unwrap();
    assert_eq!(loads(&actions), vec![0, 1, 2]);
    for w in 0..3 {
        r.update_loaded(WorkerId(w), true, Time::ZERO).unwrap();
    }
    assert!(!r.is_paused(WorkerId(0)) && r.is_available(WorkerId(0)));
    assert!(r.is_paused(WorkerId(1)) && r.is_paused(WorkerId(2)));
    assert!(r.workers().all(|w| w.policy_version == 1));
}

#[test]
fn bad_plans_and_reports_are_refused() {
    let mut r = router(RouterMode::RoundRobin, 2);
    assert_eq!(
        r.begin_update(plan(1, UpdateMode::Rolling, 0), Time::ZERO),
        Err(UpdateError::ZeroBatch)
    );
    let mut unknown = plan(1, UpdateMode::Drain, 1);
    unknown.workers = Some(vec![WorkerId(9)]);
    assert_eq!(
        r.begin_update(unknown, Time::ZERO),
        Err(UpdateError::UnknownWorker(WorkerId(9)))
    );
    assert_eq!(
        r.update_loaded(WorkerId(0), true, Time::ZERO),
        Err(UpdateError::NotUpdating(WorkerId(0)))
    );
    let mut one = plan(1, UpdateMode::Drain, 1);
    one.workers = Some(vec![WorkerId(1)]);
    r.begin_update(one, Time::ZERO).unwrap();
    assert_eq!(
        r.begin_update(plan(2, UpdateMode::Drain, 1), Time::ZERO),
        Err(UpdateError::InProgress(1))
    );
    assert_eq!(
        r.update_loaded(WorkerId(0), true, Time::ZERO),
        Err(UpdateError::NotUpdating(WorkerId(0))),
        "worker 0 is not part of this cycle"
    );
    // Worker 0 keeps serving at the old version meanwhile.
    let d = r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    assert_eq!((d.rank.worker, d.policy_version), (WorkerId(0), 0));
}

#[test]
fn kv_retention_flush_forgets_the_old_cache_and_retain_keeps_it() {
    for (retention, kept) in [(KvRetention::Flush, 0), (KvRetention::Retain, 2)] {
        let mut r = router(RouterMode::Kv, 1);
        r.config.kv_retention = retention;
        let prompt = tokens(1, 8);
        r.apply_event(&store_event(0, &prompt)).unwrap();
        let actions = r
            .begin_update(plan(1, UpdateMode::Drain, 1), Time::ZERO)
            .unwrap();
        assert_eq!(loads(&actions), vec![0]);
        r.update_loaded(WorkerId(0), true, Time::ZERO).unwrap();
        let d = r.route(&request(1, &prompt), Time::ZERO).unwrap();
        assert_eq!(d.overlap.gpu_blocks, kept, "{retention:?}");
    }
}

#[test]
fn requests_that_waited_for_an_update_spread_over_the_workers_coming_back() {
    let mut r = router(RouterMode::Kv, 4);
    let actions = r
        .begin_update(plan(1, UpdateMode::Drain, 1), Time::ZERO)
        .unwrap();
    for id in 0..8 {
        assert_eq!(
            r.submit(request(id, &tokens(id as u32, 8)), Time::ZERO),
            Ok(Admission::Queued)
        );
    }
    let mut placed = Vec::new();
    for w in loads(&actions) {
        r.update_loaded(WorkerId(w), true, Time::ZERO).unwrap();
        placed.extend(r.poll(Time::ZERO));
        if w < 3 {
            assert!(placed.is_empty(), "nobody serves while others still load");
            assert_eq!(
                r.newest_policy_version(),
                0,
                "the version counts once served"
            );
        }
    }
    let mut per_worker = std::collections::BTreeMap::new();
    for (_, d) in &placed {
        *per_worker
            .entry(d.as_ref().unwrap().rank.worker.0)
            .or_insert(0) += 1;
    }
    assert_eq!(
        per_worker.values().copied().collect::<Vec<u32>>(),
        vec![2, 2, 2, 2],
        "not all on the first worker back"
    );
}

#[test]
fn a_loaded_worker_does_not_wait_for_loads_that_started_after_its_own() {
    let mut r = router(RouterMode::RoundRobin, 3);
    for id in 1..=3 {
        r.route(&request(id, &tokens(id as u32, 8)), Time::ZERO)
            .unwrap();
    }
    // Worker 0's request finishes at once; the others drain later, one after the other.
    let _ = r.finish(RequestId(1), Time::ZERO).unwrap();
    let t = Time::from_millis;
    let first = r.begin_update(plan(1, UpdateMode::Drain, 1), t(0)).unwrap();
    assert_eq!(loads(&first), vec![0]);
    assert_eq!(
        loads(&r.finish(RequestId(2), t(10)).unwrap().update),
        vec![1]
    );
    r.update_loaded(WorkerId(0), true, t(15)).unwrap();
    assert_eq!(
        r.update_phase(WorkerId(0)),
        Some(UpdatePhase::Done),
        "worker 1 started later"
    );
    assert_eq!(
        loads(&r.finish(RequestId(3), t(20)).unwrap().update),
        vec![2]
    );
    r.update_loaded(WorkerId(1), true, t(25)).unwrap();
    assert_eq!(r.update_phase(WorkerId(1)), Some(UpdatePhase::Done));
    r.update_loaded(WorkerId(2), true, t(35)).unwrap();
    assert!(r.update_status().unwrap().finished.is_some());
}

/// Found by a probe: a worker removed while it loaded kept the cycle running for good (the
/// worker loaded beside it waited for its load, and the cycle for its end), so the fleet stayed
/// out of rotation. A removed worker leaves the cycle.
#[test]
fn a_worker_removed_during_the_cycle_leaves_it() {
    let mut r = router(RouterMode::RoundRobin, 2);
    let first = r
        .begin_update(plan(3, UpdateMode::Drain, 1), Time::ZERO)
        .unwrap();
    assert_eq!(loads(&first), vec![0, 1], "both idle: both load");
    // Worker 1 loads, but waits for worker 0, which began loading with it.
    r.update_loaded(WorkerId(1), true, Time::from_micros(1))
        .unwrap();
    assert_eq!(r.update_phase(WorkerId(1)), Some(UpdatePhase::Loaded));
    assert!(!r.is_available(WorkerId(1)));
    // Worker 0 is removed mid-load: worker 1 comes back, and the cycle is over.
    r.remove_worker(WorkerId(0)).unwrap();
    let next = r.update_worker_removed(WorkerId(0), Time::from_micros(2));
    assert!(next.is_empty());
    let status = r.update_status().unwrap();
    assert_eq!(status.finished, Some(Time::from_micros(2)));
    assert_eq!((status.done, status.total), (1, 1));
    assert!(r.is_available(WorkerId(1)));
    assert_eq!(r.workers().next().map(|w| w.policy_version), Some(3));
    // Its load's late answer is not the cycle's any more.
    assert!(r
        .update_loaded(WorkerId(0), true, Time::from_micros(3))
        .is_err());
    // A worker that took no part changes nothing.
    assert!(r
        .update_worker_removed(WorkerId(7), Time::from_micros(4))
        .is_empty());
    r.check_invariants().unwrap();
}
