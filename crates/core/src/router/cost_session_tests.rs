//! The `cost` policy's sessions: soft affinity to the session's worker, and sessions between
//! turns counted on it (`cost/sessions.rs`).

use super::tests::{request, router, router_with, store_event, tokens};
use super::*;
use std::time::Duration;

fn at(ms: u64) -> Time {
    Time::ZERO + Duration::from_millis(ms)
}

#[test]
fn a_session_stays_home_unless_moving_is_clearly_cheaper() {
    let mut r = router(RouterMode::Cost, 2);
    let mut turn = request(1, &tokens(5, 40));
    turn.session = Some(9);
    let home = r.route(&turn, at(0)).unwrap().rank;
    let _ = r.finish(RequestId(1), at(10)).unwrap();
    // A little load at home, one request decoding (queued prefill would not do: a turn joining
    // it shares its steps): the other worker is cheaper, but not by the margin.
    let mut small = request(50, &tokens(50, 8));
    small.pin = Some(Pin {
        worker: home.worker,
        dp_rank: None,
    });
    r.route(&small, at(11)).unwrap();
    r.first_token(RequestId(50)).unwrap();
    let mut next = request(2, &tokens(6, 40));
    next.session = Some(9);
    let d = r.route(&next, at(12)).unwrap();
    let totals: Vec<f64> = d.candidates.iter().map(|c| c.total).collect();
    assert!(totals
        .iter()
        .any(|t| *t < d.candidates.iter().find(|c| c.rank == home).unwrap().total));
    assert_eq!(d.rank, home, "{totals:?}");
    let _ = r.finish(RequestId(2), at(13)).unwrap();
    // A long prefill queued at home: moving is clearly cheaper.
    let mut big = request(51, &tokens(51, 40_000));
    big.pin = Some(Pin {
        worker: home.worker,
        dp_rank: None,
    });
    r.route(&big, at(14)).unwrap();
    let mut third = request(3, &tokens(7, 40));
    third.session = Some(9);
    assert_ne!(r.route(&third, at(15)).unwrap().rank, home);
}

#[test]
fn a_session_between_turns_keeps_new_work_off_its_worker_for_the_window() {
    let sys = tokens(1, 2_048);
    let with = |rest: Vec<u32>| [sys.clone(), rest].concat();
    let place_new = |window: f64, new_at: u64| {
        let mut r = router_with(
            RouterConfig {
                router_mode: RouterMode::Cost,
                router_cost_session_window_secs: window,
                ..Default::default()
            },
            2,
        );
        // Worker 0 holds the shared system prompt, and a session's long context.
        r.apply_event(&store_event(0, &sys)).unwrap();
        let mut turn = request(1, &with(tokens(2, 300_000)));
        turn.session = Some(9);
        turn.pin = Some(Pin {
            worker: WorkerId(0),
            dp_rank: None,
        });
        r.route(&turn, at(0)).unwrap();
        r.observe_output(RequestId(1), 100, at(1_000));
        let _ = r.finish(RequestId(1), at(1_000)).unwrap();
        // A new prompt sharing only the system prompt.
        let fresh = r
            .route(&request(2, &with(tokens(3, 500))), at(new_at))
            .unwrap();
        // The session's own next turn still goes home.
        let mut next = request(3, &with(tokens(2, 300_100)));
        next.session = Some(9);
        (
            fresh.rank.worker,
            r.route(&next, at(new_at + 1)).unwrap().rank.worker,
        )
    };
    assert_eq!(
        place_new(0.0, 2_000),
        (WorkerId(0), WorkerId(0)),
        "off: the cached system prompt wins"
    );
    assert_eq!(
        place_new(30.0, 2_000),
        (WorkerId(1), WorkerId(0)),
        "the session will decode on worker 0 again"
    );
    assert_eq!(
        place_new(30.0, 31_001),
        (WorkerId(0), WorkerId(0)),
        "after the window it no longer counts"
    );
}

#[test]
fn a_session_whose_worker_was_removed_is_resident_nowhere() {
    let mut r = router(RouterMode::Cost, 2);
    let mut turn = request(1, &tokens(2, 4_000));
    turn.session = Some(9);
    let rank = r.route(&turn, at(0)).unwrap().rank;
    r.remove_worker(rank.worker).unwrap();
    r.observe_output(RequestId(1), 100, at(10));
    let _ = r.finish(RequestId(1), at(10));
    assert_eq!(r.resident_kv(rank), 0);
    // The same id registered again starts with nothing resident either.
    r.add_worker(WorkerSpec::new(rank.worker)).unwrap();
    assert_eq!(r.resident_kv(rank), 0);
    // A live worker's session is resident once its turn ends (outputs capped as learnt).
    let mut turn = request(2, &tokens(3, 4_000));
    turn.session = Some(10);
    turn.max_output_tokens = Some(50);
    let home = r.route(&turn, at(20)).unwrap().rank;
    r.observe_output(RequestId(2), 1_000_000, at(30));
    let _ = r.finish(RequestId(2), at(30)).unwrap();
    assert_eq!(r.resident_kv(home), 4_050);
}

#[test]
fn a_turn_waits_for_what_is_left_of_a_prefill_in_progress_not_all_of_it() {
    use crate::policy::cost::chunked_prefill_ms;
    use crate::timing::DynamoPoly;
    let context = tokens(1, 100_000);
    let cold = tokens(2, 200_000);
    // Worker 0 holds a 100k-token context, and took a cold 200k-token prompt at 0 ms; the
    // context's next turn comes `after` ms later, before that prompt's first token.
    let next_turn_at = |after: u64, first_token_of_cold: bool| {
        let mut r = router(RouterMode::Cost, 2);
        r.apply_event(&store_event(0, &context)).unwrap();
        let mut big = request(1, &cold);
        big.pin = Some(Pin {
            worker: WorkerId(0),
            dp_rank: None,
        });
        r.route(&big, at(0)).unwrap();
        if first_token_of_cold {
            r.first_token(RequestId(1)).unwrap();
            r.observe_first_token(RequestId(1), at(after));
        }
        let turn = request(2, &[context.clone(), tokens(3, 100)].concat());
        let d = r.route(&turn, at(after)).unwrap();
        let totals: Vec<f64> = d.candidates.iter().map(|c| c.total).collect();
        (d.rank.worker, totals)
    };
    let prefill_ms = chunked_prefill_ms(&DynamoPoly, 200_000, 8_192, 0.0);
    let (early, totals) = next_turn_at(1, false);
    assert_eq!(early, WorkerId(1), "the whole prefill is ahead: {totals:?}");
    let late = (prefill_ms * 0.95) as u64;
    let (worker, totals) = next_turn_at(late, false);
    assert_eq!(worker, WorkerId(0), "5 % of it is left: {totals:?}");
    // Its first token came: nothing is queued, and nothing is taken off twice.
    let (worker, totals) = next_turn_at(late, true);
    assert_eq!(worker, WorkerId(0), "{totals:?}");
}

#[test]
fn a_request_placed_during_a_prefill_is_fitted_against_what_was_left_of_it() {
    use crate::policy::cost::chunked_prefill_ms;
    use crate::timing::DynamoPoly;
    let mut r = router(RouterMode::Cost, 1);
    let pinned = |id: u64, prefix: u32, len: u32| {
        let mut q = request(id, &tokens(prefix, len));
        q.pin = Some(Pin {
            worker: WorkerId(0),
            dp_rank: None,
        });
        q
    };
    r.route(&pinned(1, 1, 200_000), at(0)).unwrap();
    assert_eq!(r.prefill_work(RequestId(1)), Some(200_000.0));
    // Nine tenths of the first prompt's prefill later, a second one comes: whole steps of
    // 8,192 tokens of the first are done.
    let late = (chunked_prefill_ms(&DynamoPoly, 200_000, 8_192, 0.0) * 0.9) as u64;
    r.route(&pinned(2, 2, 1_000), at(late)).unwrap();
    let left = r.prefill_work(RequestId(2)).unwrap();
    assert!((20_000.0..=40_000.0).contains(&left), "{left}");
    assert_eq!(left % 8_192.0, (201_000 % 8_192) as f64);
    // Once the first sends its first token, the second's prefill begins: a third placed at
    // that moment waits for all of the second's.
    r.first_token(RequestId(1)).unwrap();
    r.observe_first_token(RequestId(1), at(late + 1));
    r.route(&pinned(3, 3, 500), at(late + 1)).unwrap();
    assert_eq!(r.prefill_work(RequestId(3)), Some(1_500.0));
}
