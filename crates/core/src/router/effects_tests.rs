//! Releases return their effects; continuations avoid the workers they tried.

use super::admission::{Admission, QueuePolicy};
use super::queue_tests::queued_router;
use super::tests::{request, router, store_event, tokens};
use super::*;

/// A router whose only worker is busy and one request waiting in its queue.
fn one_waiting() -> Router {
    let mut r = queued_router(QueuePolicy::Fcfs);
    assert!(matches!(
        r.submit(request(1, &tokens(1, 40)), Time::ZERO),
        Ok(Admission::Dispatched(_))
    ));
    assert_eq!(
        r.submit(request(2, &tokens(2, 8)), Time::ZERO),
        Ok(Admission::Queued)
    );
    assert!(r.poll(Time::ZERO).is_empty(), "the worker is still busy");
    r
}

#[test]
fn a_finish_that_frees_capacity_returns_the_waiting_requests_placement() {
    let mut r = one_waiting();
    let effects = r.finish(RequestId(1), Time::from_millis(3)).unwrap();
    assert_eq!(effects.placed.len(), 1, "{effects:?}");
    let (id, placed) = &effects.placed[0];
    assert_eq!(*id, RequestId(2));
    assert_eq!(placed.as_ref().unwrap().rank.worker, WorkerId(0));
    assert!(effects.update.is_empty(), "no update cycle runs");
    // The placement is made once: the queue is empty and its load is recorded.
    assert_eq!(r.queue_stats().pending_requests, 0);
    assert!(r.ledger().is_active(RequestId(2)));
    r.check_invariants().unwrap();
}

#[test]
fn a_cancel_that_frees_capacity_returns_the_waiting_requests_placement() {
    let mut r = one_waiting();
    let effects = r.cancel(RequestId(1), Time::from_millis(3)).unwrap();
    let placed: Vec<RequestId> = effects
        .placed
        .iter()
        .filter(|(_, d)| d.is_ok())
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(placed, vec![RequestId(2)]);
}

#[test]
fn a_release_that_frees_nothing_waited_on_has_no_effects() {
    let mut r = router(RouterMode::RoundRobin, 2);
    r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    let effects = r.finish(RequestId(1), Time::ZERO).unwrap();
    assert!(effects.is_empty());
    assert_eq!(
        r.cancel(RequestId(1), Time::ZERO),
        Err(RouteError::UnknownRequest(RequestId(1))),
        "released once"
    );
}

#[test]
fn the_release_that_idles_a_draining_worker_returns_its_load() {
    let mut r = router(RouterMode::RoundRobin, 1);
    r.route(&request(1, &tokens(1, 8)), Time::ZERO).unwrap();
    let plan = UpdatePlan {
        version: 4,
        mode: UpdateMode::Drain,
        batch: 1,
        workers: None,
    };
    assert!(r.begin_update(plan, Time::ZERO).unwrap().is_empty());
    let effects = r.cancel(RequestId(1), Time::from_millis(2)).unwrap();
    assert_eq!(
        effects.update,
        vec![UpdateAction::Load {
            worker: WorkerId(0),
            version: 4
        }]
    );
}

#[test]
fn a_continuation_avoids_the_workers_it_tried() {
    let prompt = tokens(7, 40);
    let cached_on_1 = || {
        let mut r = router(RouterMode::Kv, 3);
        r.apply_event(&store_event(1, &prompt)).unwrap();
        r
    };
    // Unconstrained, the cache draws it to worker 1.
    let d = cached_on_1()
        .route(&request(1, &prompt), Time::ZERO)
        .unwrap();
    assert_eq!(d.rank.worker, WorkerId(1));
    // Having tried worker 1, it goes elsewhere; having tried all, nowhere.
    let mut r = cached_on_1();
    let d = r
        .route_continuation(&request(1, &prompt), &[WorkerId(1)], Time::ZERO)
        .unwrap();
    assert_ne!(d.rank.worker, WorkerId(1));
    let tried = [WorkerId(0), WorkerId(1), WorkerId(2)];
    assert_eq!(
        r.route_continuation(&request(2, &prompt), &tried, Time::ZERO),
        Err(RouteError::NoWorkers)
    );
    // Its own allowed workers still bound it.
    let mut only_1_and_2 = request(3, &prompt);
    only_1_and_2.allowed_workers = Some(vec![WorkerId(1), WorkerId(2)]);
    let d = r
        .route_continuation(&only_1_and_2, &[WorkerId(1)], Time::ZERO)
        .unwrap();
    assert_eq!(d.rank.worker, WorkerId(2));
}
