use super::*;
use crate::time::Time;
use proptest::prelude::*;

pub(super) fn at(s: u64) -> Time {
    Time::from_millis(s * 1000)
}

pub(super) fn load(in_flight: u64, workers: u32) -> PoolSignals {
    PoolSignals {
        workers,
        in_flight_requests: in_flight,
        max_requests_per_worker: Some(256),
        ..PoolSignals::default()
    }
}

pub(super) fn planner() -> Planner {
    Planner::new(PlannerConfig::default()).unwrap()
}

#[test]
fn a_burst_scales_up_at_the_first_tick_and_the_tail_is_waited_for() {
    let mut p = planner();
    assert_eq!(p.tick(at(0), &load(0, 2)).workers, 2);
    // 512 requests at 64 per worker: 8 workers at once.
    let r = p.tick(at(1), &load(512, 2));
    assert_eq!(r.workers, 8);
    assert!(r.reasons.contains(&Reason::ScaleUp { workers: 8 }));
    // The tail: demand falls to 1, but the recommendation holds for the down window.
    for s in 2..31 {
        let r = p.tick(at(s), &load(10, 8));
        assert_eq!(r.workers, 8, "at {s} s: {r:?}");
        assert!(matches!(r.reasons.last(), Some(Reason::HoldForTail { .. })));
    }
    let r = p.tick(at(32), &load(10, 8));
    assert_eq!(r.workers, 1, "{r:?}");
    assert_eq!(r.phase, StepPhase::Tail);
}

#[test]
fn never_below_what_requests_in_flight_need() {
    let mut p = Planner::new(PlannerConfig {
        requests_per_worker: 1000,
        ..PlannerConfig::default()
    })
    .unwrap();
    // 600 in flight with engines of 256: 3 workers hold them, whatever the target says.
    let r = p.tick(at(0), &load(600, 1));
    assert_eq!(r.in_flight_need, 3);
    assert_eq!(r.workers, 3);
    assert!(r.reasons.contains(&Reason::InFlight { workers: 3 }));
}

#[test]
fn queue_and_latency_over_target_ask_for_one_more_worker() {
    let mut p = Planner::new(PlannerConfig {
        ttft_p99_target_ms: Some(500.0),
        ..PlannerConfig::default()
    })
    .unwrap();
    let mut s = load(10, 4);
    s.ttft_p99_ms = Some(900.0);
    let r = p.tick(at(0), &s);
    assert_eq!(r.workers, 5);
    assert!(matches!(r.reasons[1], Reason::TtftOverTarget { .. }));
    s.ttft_p99_ms = None;
    s.queued_requests = 3;
    s.workers = 5;
    assert_eq!(p.tick(at(1), &s).workers, 6);
}

#[test]
fn bounds_clamp_and_bad_configurations_are_refused() {
    let mut p = Planner::new(PlannerConfig {
        min_workers: 2,
        max_workers: 4,
        ..PlannerConfig::default()
    })
    .unwrap();
    let r = p.tick(at(0), &load(10_000, 1));
    assert_eq!(r.workers, 4);
    assert!(r.reasons.contains(&Reason::Bounds { min: 2, max: 4 }));
    for bad in [
        PlannerConfig {
            min_workers: 0,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            min_workers: 5,
            max_workers: 4,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            kv_usage_target: 1.5,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            ttft_p99_target_ms: Some(-1.0),
            ..PlannerConfig::default()
        },
        // Found by a probe: a down window shorter than the up window flapped (a scale-down
        // was undone by the up window's peak at the next tick).
        PlannerConfig {
            up_window: std::time::Duration::from_secs(5),
            down_window: std::time::Duration::from_secs(3),
            ..PlannerConfig::default()
        },
    ] {
        assert!(Planner::new(bad).is_err());
    }
}

/// Steps of 60 s every 130 s (70 s idle): the first idle spell goes down to one worker once
/// the down window passed; from the third step on, the floor is back up the startup plus
/// three tick intervals (33 s) before the predicted start (the last end plus the gap seen
/// before).
#[test]
fn the_predictive_floor_provisions_before_a_step_from_step_history() {
    let mut p = planner();
    for s in 0..330u64 {
        let busy = s % 130 < 60;
        let r = p.tick(at(s), &load(if busy { 512 } else { 0 }, 8));
        let expect = match s {
            90..=129 => Some(1),
            220..=226 => Some(1),
            227..=259 => Some(8),
            _ => None,
        };
        if let Some(w) = expect {
            assert_eq!(r.workers, w, "at {s}: {r:?}");
        }
        if s == 227 {
            assert_eq!(
                r.reasons.last(),
                Some(&Reason::PredictedStep {
                    workers: 8,
                    in_s: 33.0
                })
            );
            assert_eq!(r.phase, StepPhase::Idle);
        }
    }
}

/// The wake's margin over the startup is three tick intervals, at most the up window: the
/// steps of 60 s every 130 s ticked every 0.5 s rise 31.5 s before the predicted start (30 s +
/// 3 × 0.5 s), ticked every 1 s 33 s before, ticked every 5 s 35 s before (the up window).
/// Under the old margin (the up window at every tick rate) the first two fail.
#[test]
fn the_wake_margin_is_three_ticks_at_most_the_up_window() {
    for (tick_ms, lead_ms) in [(500u64, 31_500u64), (1000, 33_000), (5000, 35_000)] {
        let mut p = planner();
        let (mut low, mut rose) = (false, None);
        let mut t = 0;
        while t < 260_000 {
            let busy = t % 130_000 < 60_000;
            let r = p.tick(Time::from_millis(t), &load(if busy { 512 } else { 0 }, 8));
            if t >= 190_000 {
                low |= r.workers == 1;
                if low && rose.is_none() && r.workers == 8 {
                    rose = Some(t);
                }
            }
            t += tick_ms;
        }
        // The third step is expected at 260 s: the first tick at or after 260 s − lead.
        let want = (260_000 - lead_ms).div_ceil(tick_ms) * tick_ms;
        assert_eq!(rose, Some(want), "tick {tick_ms} ms");
    }
}

/// RL steps (group headers) before their rhythm is learned: the first holds its peak through
/// its tail and, after it, for the horizon (the next may come at once).
#[test]
fn the_first_rl_step_holds_its_peak_until_the_rhythm_is_known() {
    let mut p = planner();
    let rl = |n: u64| PoolSignals {
        rl_requests: n,
        ..load(n, 8)
    };
    for s in 0..100u64 {
        let n = if s < 60 { 512 - 8 * s } else { 0 };
        let r = p.tick(at(s), &rl(n));
        assert_eq!(r.workers, 8, "at {s}: {r:?}");
    }
    // 180 s after the step's end, nothing is predicted any more.
    assert_eq!(p.tick(at(241), &rl(0)).workers, 1);
}

fn signals_strategy() -> impl Strategy<Value = Vec<(u64, u64, u64, u64)>> {
    prop::collection::vec((0u64..2000, 0u64..50, 0u64..200_000, 0u64..100_000), 1..120)
}

fn signals((in_flight, queued, blocks, prefill): (u64, u64, u64, u64), scale: u64) -> PoolSignals {
    PoolSignals {
        workers: 4,
        in_flight_requests: in_flight * scale,
        queued_requests: queued * scale,
        decode_blocks: blocks * scale,
        prefill_tokens: prefill * scale,
        batched_tokens_per_worker: Some(8192),
        kv_blocks_per_worker: Some(16_384),
        max_requests_per_worker: Some(256),
        ..PoolSignals::default()
    }
}

proptest! {
    /// More load (same busy and idle spells) never gets fewer workers, at any tick.
    #[test]
    fn monotonic_in_load(seq in signals_strategy(), scale in 1u64..4) {
        let (mut a, mut b) = (planner(), planner());
        for (t, s) in seq.iter().enumerate() {
            let ra = a.tick(at(t as u64), &signals(*s, 1));
            let rb = b.tick(at(t as u64), &signals(*s, scale));
            prop_assert!(rb.workers >= ra.workers, "tick {t}: {ra:?} vs {rb:?}");
        }
    }

    /// The recommendation never falls below what the requests in flight need.
    #[test]
    fn never_below_in_flight_need(seq in signals_strategy()) {
        let mut p = planner();
        for (t, s) in seq.iter().enumerate() {
            let r = p.tick(at(t as u64), &signals(*s, 1));
            prop_assert!(r.workers >= r.in_flight_need.min(64), "{r:?}");
        }
    }

    /// Hysteresis: while busy (no predicted steps), a scale-down never comes sooner than the
    /// down window after a scale-up, so the recommendation flaps at most once per window.
    #[test]
    fn hysteresis_bounds_flapping(seq in prop::collection::vec(1u64..2000, 1..200)) {
        let mut p = planner();
        let mut last_up: Option<u64> = None;
        let mut prev = None;
        for (t, n) in seq.iter().enumerate() {
            let t = t as u64;
            let r = p.tick(at(t), &load(*n, 4));
            if let Some(prev) = prev {
                if r.workers > prev {
                    last_up = Some(t);
                }
                if r.workers < prev {
                    if let Some(u) = last_up {
                        prop_assert!(t - u > 30, "up at {u}, down at {t}");
                    }
                }
            }
            prev = Some(r.workers);
        }
    }
}
