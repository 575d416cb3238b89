//! The router's admission queue: waiting while every worker is over the threshold, FCFS with
//! priority, WSPT, deadlines and bounds, and rejection when overloaded.

use super::tests::{request, tokens, BS};
use super::*;
use crate::router::admission::{Admission, QueuePolicy, QueueStats};

pub(super) fn queued_router(policy: QueuePolicy) -> Router {
    let config = RouterConfig {
        router_mode: RouterMode::RoundRobin,
        kv_cache_block_size: BS,
        router_queue_threshold: Some(0.0),
        router_queue_policy: policy,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    let mut spec = WorkerSpec::new(WorkerId(0));
    spec.max_num_batched_tokens = Some(100);
    r.add_worker(spec).unwrap();
    r
}

fn dispatched(r: &mut Router, now: Time) -> Vec<u64> {
    r.poll(now)
        .into_iter()
        .filter(|(_, d)| d.is_ok())
        .map(|(id, _)| id.0)
        .collect()
}

#[test]
fn requests_wait_while_every_worker_is_over_the_queue_threshold() {
    let mut r = queued_router(QueuePolicy::Fcfs);
    assert!(matches!(
        r.submit(request(1, &tokens(1, 40)), Time::ZERO),
        Ok(Admission::Dispatched(_))
    ));
    assert_eq!(
        r.submit(request(2, &tokens(2, 40)), Time::ZERO),
        Ok(Admission::Queued)
    );
    assert_eq!(
        r.submit(request(3, &tokens(3, 8)), Time::ZERO),
        Ok(Admission::Queued)
    );
    assert_eq!(
        r.queue_stats(),
        QueueStats {
            pending_requests: 2,
            pending_isl_tokens: 48
        }
    );
    assert!(dispatched(&mut r, Time::ZERO).is_empty(), "still busy");
    r.first_token(RequestId(1)).unwrap();
    assert_eq!(
        dispatched(&mut r, Time::ZERO),
        vec![2],
        "one placed, then busy again"
    );
    r.first_token(RequestId(2)).unwrap();
    assert_eq!(dispatched(&mut r, Time::ZERO), vec![3]);
    assert_eq!(r.queue_stats().pending_requests, 0);
    r.check_invariants().unwrap();
}

#[test]
fn fcfs_gives_priority_a_one_second_jump_and_priority_is_strict() {
    let mut r = queued_router(QueuePolicy::Fcfs);
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    r.submit(request(2, &tokens(2, 40)), Time::ZERO).unwrap();
    let mut late = request(3, &tokens(3, 40));
    late.priority = 2;
    r.submit(late, Time::from_secs_f64(1.5)).unwrap();
    r.first_token(RequestId(1)).unwrap();
    assert_eq!(
        dispatched(&mut r, Time::from_secs_f64(2.0)),
        vec![3],
        "1.5 s - 2 s jump beats 0 s"
    );

    let mut r = queued_router(QueuePolicy::Priority);
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    let mut mid = request(2, &tokens(2, 40));
    mid.priority = 1;
    r.submit(mid, Time::ZERO).unwrap();
    let mut high = request(3, &tokens(3, 40));
    high.priority = 5;
    r.submit(high, Time::from_secs_f64(100.0)).unwrap();
    r.first_token(RequestId(1)).unwrap();
    assert_eq!(dispatched(&mut r, Time::from_secs_f64(100.0)), vec![3]);
}

#[test]
fn wspt_places_the_least_uncached_work_first() {
    let mut r = queued_router(QueuePolicy::Wspt);
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    r.submit(request(2, &tokens(2, 80)), Time::ZERO).unwrap();
    r.submit(request(3, &tokens(3, 8)), Time::ZERO).unwrap();
    r.first_token(RequestId(1)).unwrap();
    assert_eq!(dispatched(&mut r, Time::ZERO), vec![3]);
}

#[test]
fn deadlines_and_bounds_end_requests_with_clear_errors() {
    let mut r = queued_router(QueuePolicy::Fcfs);
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    let mut soon = request(2, &tokens(2, 40));
    soon.deadline = Some(Time::from_secs_f64(5.0));
    r.submit(soon, Time::ZERO).unwrap();
    assert_eq!(r.next_deadline(), Some(Time::from_secs_f64(5.0)));
    let out = r.poll(Time::from_secs_f64(5.0));
    assert_eq!(out, vec![(RequestId(2), Err(RouteError::DeadlineExceeded))]);

    let config = RouterConfig {
        router_queue_max_requests: Some(1),
        ..queued_router(QueuePolicy::Fcfs).config().clone()
    };
    let mut r = Router::new(config).unwrap();
    let mut spec = WorkerSpec::new(WorkerId(0));
    spec.max_num_batched_tokens = Some(100);
    r.add_worker(spec).unwrap();
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    r.submit(request(2, &tokens(2, 40)), Time::ZERO).unwrap();
    assert!(matches!(
        r.submit(request(3, &tokens(3, 40)), Time::ZERO),
        Err(RouteError::QueueFull { requests: 1, .. })
    ));
    assert!(r.cancel_queued(RequestId(2)));
    assert_eq!(r.queue_stats().pending_requests, 0);

    // Found by probing: a request bigger than the whole token bound was told the queue was
    // full (0 requests, 0 tokens waiting). It is told it cannot wait at all.
    let config = RouterConfig {
        router_queue_max_tokens: Some(50),
        ..queued_router(QueuePolicy::Fcfs).config().clone()
    };
    let mut r = Router::new(config).unwrap();
    let mut spec = WorkerSpec::new(WorkerId(0));
    spec.max_num_batched_tokens = Some(100);
    r.add_worker(spec).unwrap();
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    let refused = r.submit(request(2, &tokens(2, 60)), Time::ZERO);
    assert_eq!(
        refused,
        Err(RouteError::OverQueueBound {
            tokens: 60,
            max: 50
        })
    );
    assert!(refused
        .unwrap_err()
        .to_string()
        .contains("--router-queue-max-tokens"));
    // One that fits the bound waits as before.
    assert!(r.submit(request(3, &tokens(3, 40)), Time::ZERO).is_ok());
    assert_eq!(r.queue_stats().pending_requests, 1);
}

#[test]
fn reject_when_overloaded_refuses_instead_of_queueing() {
    let config = RouterConfig {
        kv_cache_block_size: BS,
        router_queue_threshold: Some(10.0),
        active_prefill_tokens_threshold: Some(10),
        reject_when_overloaded: true,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    let mut spec = WorkerSpec::new(WorkerId(0));
    spec.max_num_batched_tokens = Some(100);
    r.add_worker(spec).unwrap();
    r.submit(request(1, &tokens(1, 40)), Time::ZERO).unwrap();
    assert_eq!(
        r.submit(request(2, &tokens(2, 8)), Time::ZERO),
        Err(RouteError::AllEligibleWorkersOverloaded)
    );
}
