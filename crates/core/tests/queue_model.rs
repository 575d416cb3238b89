//! Property test of the router queue against a naive model: with one busy worker that frees one
//! slot at a time, requests leave in the policy's order, and expired ones leave with
//! `DeadlineExceeded` exactly when their deadline passes.

use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{
    Admission, QueuePolicy, RouteError, RouteRequest, Router, RouterConfig, WorkerSpec,
};
use kvrouter_core::time::Time;
use proptest::prelude::*;

fn request(id: u64, tokens: u32, priority: u8, deadline_s: Option<u32>) -> RouteRequest {
    let toks: Vec<u32> = (0..tokens).map(|t| id as u32 * 1000 + t).collect();
    let mut r = RouteRequest::new(
        RequestId(id),
        u64::from(tokens),
        BlockHasher::new(4, &HashNamespace::none()).hash_blocks(&toks),
    );
    r.priority = priority;
    r.deadline = deadline_s.map(|s| Time::from_secs_f64(f64::from(s)));
    r
}

proptest! {
    #[test]
    fn the_queue_releases_in_policy_order(
        items in prop::collection::vec((1u32..40, 0u8..4, prop::option::weighted(0.2, 1u32..30)), 1..20),
        policy in prop_oneof![Just(QueuePolicy::Fcfs), Just(QueuePolicy::Priority)],
    ) {
        let config = RouterConfig {
            router_mode: RouterMode::RoundRobin,
            kv_cache_block_size: 4,
            router_queue_threshold: Some(0.0),
            router_queue_policy: policy,
            ..RouterConfig::default()
        };
        let mut r = Router::new(config).unwrap();
        let mut spec = WorkerSpec::new(WorkerId(0));
        spec.max_num_batched_tokens = Some(1000);
        r.add_worker(spec).unwrap();
        // Request 0 occupies the worker; the rest arrive one second apart and queue.
        prop_assert!(matches!(r.submit(request(0, 8, 0, None), Time::ZERO), Ok(Admission::Dispatched(_))));
        let mut model: Vec<(i64, u8, u64, Option<u32>)> = Vec::new();
        for (i, (tokens, priority, deadline)) in items.iter().enumerate() {
            let id = i as u64 + 1;
            let arrival = i as i64;
            let deadline = deadline.map(|d| d + i as u32);
            prop_assert_eq!(r.submit(request(id, *tokens, *priority, deadline), Time::from_secs_f64(arrival as f64)), Ok(Admission::Queued));
            model.push((arrival, *priority, id, deadline));
        }
        let mut running = RequestId(0);
        let mut now_s = items.len() as u32;
        while !model.is_empty() {
            now_s += 1;
            let now = Time::from_secs_f64(f64::from(now_s));
            r.first_token(running).unwrap();
            let out = r.poll(now);
            // Model: expire, then release the best by policy.
            let (expired, live): (Vec<_>, Vec<_>) = model.iter().copied().partition(|m| m.3.is_some_and(|d| d <= now_s));
            model = live;
            let mut want: Vec<(RequestId, bool)> = expired.iter().map(|m| (RequestId(m.2), false)).collect();
            let best = match policy {
                QueuePolicy::Fcfs => model.iter().min_by_key(|m| (m.0 - i64::from(m.1), m.2)),
                _ => model.iter().min_by_key(|m| (std::cmp::Reverse(m.1), m.0, m.2)),
            }
            .copied();
            if let Some(b) = best {
                model.retain(|m| m.2 != b.2);
                want.push((RequestId(b.2), true));
                running = RequestId(b.2);
            }
            let got: Vec<(RequestId, bool)> = out.iter().map(|(id, d)| (*id, d.is_ok())).collect();
            prop_assert_eq!(&got, &want);
            for (_, d) in &out {
                if let Err(e) = d {
                    prop_assert_eq!(e, &RouteError::DeadlineExceeded);
                }
            }
        }
        prop_assert_eq!(r.queue_stats().pending_requests, 0);
    }
}
