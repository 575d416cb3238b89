//! The control law on RL steps: the tail release, the earliest-start prediction and the
//! rollout-share prior, with property tests of RL tails against a naive model.

use super::tests::{at, load, planner};
use super::*;
use proptest::prelude::*;

fn rl(in_flight: u64, workers: u32) -> PoolSignals {
    PoolSignals {
        rl_requests: in_flight,
        ..load(in_flight, workers)
    }
}

fn with_prior(r: f64) -> Planner {
    Planner::new(PlannerConfig {
        rl_rollout_share: Some(r),
        ..PlannerConfig::default()
    })
    .unwrap()
}

/// An RL step's tail (its requests only finish): the fleet follows the demand of the up window
/// down at once, instead of holding the peak for the down window after demand fell. A prior
/// that puts the next step far away (r = 0.2: the trainer takes 4 × the rollout) keeps the
/// predictive floor out of the way.
#[test]
fn an_rl_steps_tail_is_released_as_its_requests_finish() {
    let mut p = with_prior(0.2);
    let n = |t: u64| 512u64.saturating_sub(16 * t);
    for t in 0..29 {
        let r = p.tick(at(t), &rl(n(t), 8));
        assert_eq!(r.workers, 8, "at {t}: {r:?}");
    }
    // A full down window of falling requests, below half the peak: the up window's demand.
    let r = p.tick(at(30), &rl(n(30), 8));
    assert_eq!(r.workers, 2, "{r:?}");
    assert!(r.reasons.contains(&Reason::TailRelease { workers: 2 }));
    // Requests rise (a new turn): no release for a down window, the recommendation holds.
    let r = p.tick(at(31), &rl(40, 2));
    assert_eq!(r.workers, 2);
    for t in 32..40 {
        let r = p.tick(at(t), &rl(10, 2));
        assert!(
            !r.reasons
                .iter()
                .any(|x| matches!(x, Reason::TailRelease { .. })),
            "{r:?}"
        );
    }
    // Without RL group headers, the same tail holds for the down window (the old rule).
    let mut q = with_prior(0.2);
    for t in 0..=30 {
        let r = q.tick(at(t), &load(n(t), 8));
        assert_eq!(r.workers, 8, "at {t}: {r:?}");
    }
    // Requests waiting in the queue: no release.
    let mut q = with_prior(0.2);
    for t in 0..=30 {
        let mut s = rl(n(t), 8);
        s.queued_requests = 1;
        s.in_flight_requests -= 1;
        assert!(q.tick(at(t), &s).workers >= 8);
    }
}

/// During a step that runs longer than the recent period, the next step is not expected
/// before this one ends plus the gap: the floor stays down through its tail.
#[test]
fn a_long_step_does_not_raise_the_floor_before_it_could_end() {
    let mut p = planner();
    // Steps of 60 s every 130 s (gaps of 70 s), then a step of 150 s from 260 s.
    for t in 0..260u64 {
        let busy = t % 130 < 60;
        p.tick(at(t), &load(if busy { 512 } else { 0 }, 8));
    }
    for t in 260..410u64 {
        let n = if t < 300 { 512 } else { 10 };
        let r = p.tick(at(t), &load(n, 8));
        if t >= 340 {
            // The old rule expected the next step at 260 + 130 = 390 and rose at 355.
            assert_eq!(r.workers, 1, "at {t}: {r:?}");
            assert_eq!(r.floor, 0, "at {t}: {r:?}");
        }
    }
    // It ends at 410: the next is expected at 480, the floor rises at 447 (the startup and
    // three 1 s ticks before).
    for t in 410..447u64 {
        assert_eq!(p.tick(at(t), &load(0, 1)).workers, 1, "at {t}");
    }
    assert_eq!(p.tick(at(447), &load(0, 1)).workers, 8);
}

/// With a rollout-share prior, the gap after the first RL step is expected to be its
/// rollout span × (1 − r) / r: the first step's peak is not held through that gap, and the
/// floor is back the startup plus three ticks before it ends.
#[test]
fn a_rollout_share_prior_times_the_first_gap() {
    let mut p = with_prior(0.75);
    // A first step of 150 s: the trainer's phase is then expected to take 50 s.
    for t in 0..150u64 {
        let n = if t < 20 { 512 } else { 4 };
        p.tick(at(t), &rl(n, 8));
    }
    for t in 150..167u64 {
        assert_eq!(p.tick(at(t), &rl(0, 1)).workers, 1, "at {t}");
    }
    let r = p.tick(at(167), &rl(0, 1));
    assert_eq!(r.workers, 8, "{r:?}");
    assert_eq!(
        r.reasons.last(),
        Some(&Reason::PredictedStep {
            workers: 8,
            in_s: 33.0
        })
    );
    let bad = PlannerConfig {
        rl_rollout_share: Some(0.0),
        ..PlannerConfig::default()
    };
    assert!(Planner::new(bad).is_err());
}

/// A trainer whose phase follows the rollout (gaps of a third of the span before them): the
/// prior r = 0.75, which the first gap respects, keeps the second gap from being expected
/// shorter than it; once two gaps told the models apart, the fleet is woken for the
/// rollout-proportional gap, not the shortest gap seen (the fixed-phase model the second gap
/// refuted).
#[test]
fn gaps_that_follow_the_span_wake_the_fleet_for_the_proportional_gap() {
    let mut p = with_prior(0.75);
    // Steps of 150, 180 and 210 s with gaps of 50 and 60 s: [0, 150), [200, 380), [440, 650).
    let busy = |t: u64| {
        [(0, 150), (200, 380), (440, 650)]
            .iter()
            .find(|(a, b)| (*a..*b).contains(&t))
            .map(|(a, _)| if t < a + 20 { 512 } else { 4 })
    };
    for t in 0..650u64 {
        let r = p.tick(at(t), &rl(busy(t).unwrap_or(0), 8));
        // After the second step (one gap seen, the prior r = 0.75 not refuted by it) the next
        // is expected no earlier than 380 + 180 / 3 = 440: up at 407, not at 397 (50 s).
        if (397..407).contains(&t) {
            assert_eq!(r.workers, 1, "at {t}: {r:?}");
        }
        if t == 407 {
            assert_eq!(r.workers, 8, "at {t}: {r:?}");
        }
    }
    // The next is expected at 650 + 210 / 3 = 720: the floor rises at 687 (startup and three
    // ticks). The shortest gap (50 s) would have raised it at 667.
    for t in 650..687u64 {
        assert_eq!(p.tick(at(t), &rl(0, 1)).workers, 1, "at {t}");
    }
    let r = p.tick(at(687), &rl(0, 1));
    assert_eq!(r.workers, 8, "{r:?}");
    assert_eq!(
        r.reasons.last(),
        Some(&Reason::PredictedStep {
            workers: 8,
            in_s: 33.0
        })
    );
}

/// A naive model of an RL step's tail: the most of `⌈requests / per worker⌉` and
/// `⌈blocks / (capacity × usage)⌉` over the up window (5 ticks and this one), never below the
/// in-flight need at full engine capacity.
fn naive_tail(history: &[(u64, u64)], t: usize) -> u32 {
    let per_tick = |(n, b): (u64, u64)| {
        let by_requests = n.div_ceil(64);
        let by_blocks = ((b as f64) / (16_384.0 * 0.8)).ceil() as u64;
        by_requests.max(by_blocks)
    };
    let up = history[t.saturating_sub(5)..=t]
        .iter()
        .map(|x| per_tick(*x))
        .max()
        .unwrap_or(0);
    let (n, b) = history[t];
    let need = n
        .div_ceil(256)
        .max(b.div_ceil(16_384))
        .max(u64::from(n > 0));
    up.max(need) as u32
}

fn rl_signals((n, b): (u64, u64), scale: u64) -> PoolSignals {
    PoolSignals {
        workers: 8,
        in_flight_requests: n * scale,
        decode_blocks: b * scale,
        kv_blocks_per_worker: Some(16_384),
        max_requests_per_worker: Some(256),
        rl_requests: n * scale,
        ..PoolSignals::default()
    }
}

/// An RL step: a burst of `peak` requests for a few ticks, then requests that only finish
/// (random decrements), with KV blocks that move at random.
fn rl_step_strategy() -> impl Strategy<Value = Vec<(u64, u64)>> {
    (
        256u64..2000,
        3usize..10,
        prop::collection::vec((0u64..40, 0u64..120_000), 40..120),
    )
        .prop_map(|(peak, burst, tail)| {
            let mut v = vec![(peak, 60_000); burst];
            let mut n = peak;
            for (d, b) in tail {
                n = n.saturating_sub(d);
                v.push((n, if n == 0 { 0 } else { b }));
            }
            v
        })
}

proptest! {
    /// The tail rule against the naive model: once a down window of only-finishing requests
    /// below half the peak was seen (and no rise for a window), the recommendation is the naive
    /// tail demand; at every tick it is at least that.
    #[test]
    fn the_rl_tail_follows_the_naive_model(seq in rl_step_strategy()) {
        let mut p = with_prior(0.1);
        let peak = seq[0].0;
        let mut last_up: Option<usize> = None;
        let mut prev: Option<u32> = Some(8);
        for t in 0..seq.len() {
            let r = p.tick(at(t as u64), &rl_signals(seq[t], 1));
            let naive = naive_tail(&seq, t).clamp(1, 64);
            prop_assert!(r.workers >= naive, "tick {t}: {r:?} below naive {naive}");
            if prev.is_some_and(|w| r.workers > w) {
                last_up = Some(t);
            }
            let window = &seq[t.saturating_sub(30)..=t];
            let falling = window.windows(2).all(|w| w[1].0 <= w[0].0);
            let quiet = last_up.is_none_or(|u| t - u >= 30);
            if t >= 30 && falling && quiet && seq[t].0 > 0 && seq[t].0 * 2 <= peak
                && prev.is_some_and(|w| w > naive)
            {
                prop_assert_eq!(r.workers, naive, "tick {}: {:?}", t, r);
            }
            prev = Some(r.workers);
        }
    }

    /// RL tails: more load (every count scaled) never gets fewer workers, the in-flight need is
    /// kept, and a scale-down never follows a rise by less than the down window.
    #[test]
    fn rl_tails_are_monotonic_in_load_and_do_not_flap(seq in rl_step_strategy(), scale in 1u64..4) {
        let (mut a, mut b) = (with_prior(0.1), with_prior(0.1));
        let mut last_up: Option<u64> = None;
        let mut prev: Option<u32> = Some(8);
        for (t, x) in seq.iter().enumerate() {
            let t = t as u64;
            let ra = a.tick(at(t), &rl_signals(*x, 1));
            let rb = b.tick(at(t), &rl_signals(*x, scale));
            prop_assert!(rb.workers >= ra.workers, "tick {t}: {ra:?} vs {rb:?}");
            prop_assert!(ra.workers >= ra.in_flight_need.min(64), "{ra:?}");
            if let Some(prev) = prev {
                if ra.workers > prev {
                    last_up = Some(t);
                }
                if ra.workers < prev {
                    if let Some(u) = last_up {
                        prop_assert!(t - u >= 30, "up at {u}, down at {t}");
                    }
                }
            }
            prev = Some(ra.workers);
        }
    }
}
