//! The [`Planner`]: demand history, step memory and the tick that turns signals into a
//! recommendation.

use super::gap::{self, SpanGap};
use super::{PlannerConfig, PlannerConfigError, PoolSignals, Reason, Recommendation, StepPhase};
use crate::time::Time;
use std::collections::VecDeque;
use std::time::Duration;

/// Steps remembered for the predictive floor.
const STEPS_KEPT: usize = 4;

/// A busy spell: from the first request after an idle spell to the next idle spell.
#[derive(Clone, Copy, Debug)]
struct Step {
    start: Time,
    end: Option<Time>,
    peak: u32,
    /// Most requests (in flight and queued) at once in it.
    peak_requests: u64,
    /// Idle time before it (none for the first).
    gap: Option<Duration>,
    /// Requests of RL groups were in it.
    rl: bool,
}

/// The control law's state for one pool.
#[derive(Debug)]
pub struct Planner {
    config: PlannerConfig,
    /// (time, demand, requests in flight and queued) of recent ticks, oldest first.
    demand: VecDeque<(Time, u32, u64)>,
    /// When the recommendation last rose.
    last_up: Option<Time>,
    /// When the first tick was (scale-down needs a full window of history).
    first_tick: Option<Time>,
    /// The last recommendation.
    current: Option<u32>,
    /// Recent steps, oldest first; the last may be running.
    steps: VecDeque<Step>,
    steps_seen: u64,
}

fn ceil_div(a: f64, b: f64) -> u32 {
    if a <= 0.0 || b <= 0.0 {
        0
    } else {
        (a / b).ceil().min(f64::from(u32::MAX)) as u32
    }
}

fn secs(from: Time, to: Time) -> f64 {
    to.as_secs_f64() - from.as_secs_f64()
}

impl Planner {
    /// A planner with no history.
    pub fn new(config: PlannerConfig) -> Result<Self, PlannerConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            demand: VecDeque::new(),
            last_up: None,
            first_tick: None,
            current: None,
            steps: VecDeque::new(),
            steps_seen: 0,
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// Demand at one snapshot, and the signals that set it.
    pub fn demand_of(&self, s: &PoolSignals) -> (u32, Vec<Reason>) {
        let c = &self.config;
        let mut reasons = Vec::new();
        let mut demand = 0;
        let requests = s.in_flight_requests + s.queued_requests;
        let by_requests = ceil_div(requests as f64, f64::from(c.requests_per_worker));
        if by_requests > 0 {
            reasons.push(Reason::Requests {
                requests,
                workers: by_requests,
            });
            demand = demand.max(by_requests);
        }
        if let Some(per) = s.kv_blocks_per_worker {
            let w = ceil_div(s.decode_blocks as f64, per as f64 * c.kv_usage_target);
            if w > 0 {
                reasons.push(Reason::KvUsage {
                    blocks: s.decode_blocks,
                    workers: w,
                });
                demand = demand.max(w);
            }
        }
        if let Some(per) = s.batched_tokens_per_worker {
            let w = ceil_div(s.prefill_tokens as f64, per as f64 * c.prefill_steps);
            if w > 0 {
                reasons.push(Reason::Prefill {
                    tokens: s.prefill_tokens,
                    workers: w,
                });
                demand = demand.max(w);
            }
        }
        let more = s.workers.saturating_add(1);
        if s.queued_requests > 0 {
            reasons.push(Reason::Queue {
                queued: s.queued_requests,
            });
            demand = demand.max(more);
        }
        let over = |observed: Option<f64>, target: Option<f64>| match (observed, target) {
            (Some(o), Some(t)) if o > t => Some((o, t)),
            _ => None,
        };
        if let Some((observed_ms, target_ms)) = over(s.ttft_p99_ms, c.ttft_p99_target_ms) {
            reasons.push(Reason::TtftOverTarget {
                observed_ms,
                target_ms,
            });
            demand = demand.max(more);
        }
        if let Some((observed_ms, target_ms)) = over(s.itl_ms, c.itl_target_ms) {
            reasons.push(Reason::ItlOverTarget {
                observed_ms,
                target_ms,
            });
            demand = demand.max(more);
        }
        (demand, reasons)
    }

    /// Workers the requests in flight need at the engines' full capacity.
    fn in_flight_need(s: &PoolSignals) -> u32 {
        let by_requests = s
            .max_requests_per_worker
            .map_or(0, |m| ceil_div(s.in_flight_requests as f64, f64::from(m)));
        let by_blocks = s
            .kv_blocks_per_worker
            .map_or(0, |b| ceil_div(s.decode_blocks as f64, b as f64));
        let any = u32::from(s.in_flight_requests > 0);
        by_requests.max(by_blocks).max(any)
    }

    /// Remembers busy and idle spells; returns the phase.
    fn track_steps(&mut self, now: Time, rl: bool, demand: u32, requests: u64) -> StepPhase {
        let busy = requests > 0;
        let running = self.steps.back().is_some_and(|s| s.end.is_none());
        match (busy, running) {
            (true, false) => {
                let gap = self.steps.back().and_then(|s| s.end).map(|e| now.since(e));
                self.steps.push_back(Step {
                    start: now,
                    end: None,
                    peak: demand,
                    peak_requests: requests,
                    gap,
                    rl,
                });
                self.steps_seen += 1;
                while self.steps.len() > STEPS_KEPT {
                    self.steps.pop_front();
                }
            }
            (false, true) => {
                if let Some(s) = self.steps.back_mut() {
                    s.end = Some(now);
                }
            }
            _ => {}
        }
        match self.steps.back_mut() {
            Some(s) if busy => {
                s.peak = s.peak.max(demand);
                s.peak_requests = s.peak_requests.max(requests);
                s.rl |= rl;
                if demand.saturating_mul(2) > s.peak {
                    StepPhase::Burst
                } else {
                    StepPhase::Tail
                }
            }
            _ => StepPhase::Idle,
        }
    }

    /// The shortest gap the next step may leave after the last one (`gap::expected_gap`: the
    /// shortest recent gap or the last step's span (so far) times the smallest recent
    /// gap-to-span ratio, whichever the history has not refuted, the earlier when both fit);
    /// before any gap was seen, for an RL step with a configured rollout share r, its span
    /// (so far) × (1 − r) / r.
    fn expected_gap(&self, now: Time) -> Option<f64> {
        let last = self.steps.back()?;
        let span = secs(last.start, last.end.unwrap_or(now)).max(0.0);
        let gaps: Vec<f64> = self
            .steps
            .iter()
            .filter_map(|s| Some(s.gap?.as_secs_f64()))
            .collect();
        let pairs: Vec<SpanGap> = self
            .steps
            .iter()
            .zip(self.steps.iter().skip(1))
            .filter_map(|(a, b)| {
                Some(SpanGap {
                    span_s: secs(a.start, a.end?),
                    gap_s: b.gap?.as_secs_f64(),
                })
            })
            .collect();
        let slack = 2.0 * self.tick_interval().unwrap_or_default().as_secs_f64();
        let prior = self
            .config
            .rl_rollout_share
            .filter(|_| last.rl)
            .map(|r| (1.0 - r) / r);
        gap::expected_gap(&gaps, &pairs, span, slack, prior)
    }

    /// When the next step may start, at the earliest: after a step, its end plus the expected
    /// gap; during a step, now (it may end at any moment) plus the expected gap. Before a gap
    /// is known (no rollout share configured), an RL step's successor is expected at once (the
    /// floor holds its peak).
    fn predicted_start(&self, now: Time) -> Option<Time> {
        let last = self.steps.back()?;
        let from = last.end.unwrap_or(now);
        match self.expected_gap(now) {
            Some(gap) => Some(from + Duration::from_secs_f64(gap)),
            // An RL step with no gap seen yet: the next may come at once.
            None => last.rl.then_some(from),
        }
    }

    /// The margin of a wake over the startup: three of the longest recent tick intervals (a
    /// step's end is seen up to a tick late, a gap is measured between two ticks, and the wake
    /// is decided at a tick), at most the up window (the up window before two ticks were
    /// seen).
    fn wake_margin(&self) -> Duration {
        let c = &self.config;
        self.tick_interval()
            .map_or(c.up_window, |d| (d * 3).min(c.up_window))
    }

    /// The longest recent interval between two ticks (none before two ticks).
    fn tick_interval(&self) -> Option<Duration> {
        self.demand
            .iter()
            .zip(self.demand.iter().skip(1))
            .map(|((a, _, _), (b, _, _))| b.since(*a))
            .max()
    }

    /// The predictive floor at `now`: recent steps' peak when the next step is due within the
    /// startup lead (the startup plus the wake margin) and not overdue by more than the
    /// horizon.
    fn floor(&self, now: Time) -> Option<(u32, f64)> {
        let at = self.predicted_start(now)?;
        let c = &self.config;
        let lead = (c.startup + self.wake_margin())
            .min(c.horizon)
            .as_secs_f64();
        let in_s = secs(now, at);
        let first_rl_step = self.steps.len() == 1
            && self.steps[0].rl
            && self.steps[0].end.is_none()
            && c.rl_rollout_share.is_none();
        if first_rl_step {
            // Held for as long as it runs.
            return Some((self.steps[0].peak, 0.0));
        }
        if in_s > lead || -in_s > c.horizon.as_secs_f64() {
            return None;
        }
        let peak = self.steps.iter().rev().take(2).map(|s| s.peak).max()?;
        Some((peak, in_s))
    }

    /// Whether the pool is in an RL step's tail whose requests only finish: requests of RL
    /// groups in flight, at most half the step's most requests, nothing queued, requests in
    /// flight and queued never rising over the down window (of which there is a full one), and
    /// the last rise of the recommendation at least a down window ago (so the flapping bound of
    /// the scale-down holds for this rule too). Every condition but the last reads request
    /// counts only, so more load (the same requests, more blocks) meets them alike.
    fn in_rl_tail(&self, now: Time, first: Time, s: &PoolSignals) -> bool {
        let c = &self.config;
        let window: Vec<u64> = self
            .demand
            .iter()
            .filter(|(t, _, _)| now.since(*t) <= c.down_window)
            .map(|(_, _, r)| *r)
            .collect();
        let requests = s.in_flight_requests + s.queued_requests;
        let half_of_peak = self
            .steps
            .back()
            .is_some_and(|st| st.end.is_none() && requests.saturating_mul(2) <= st.peak_requests);
        s.rl_requests > 0
            && half_of_peak
            && s.queued_requests == 0
            && now.since(first) >= c.down_window
            && self.last_up.is_none_or(|u| now.since(u) >= c.down_window)
            && window.windows(2).all(|w| w[1] <= w[0])
    }

    /// One tick: the recommendation at `now` from the pool's signals.
    pub fn tick(&mut self, now: Time, s: &PoolSignals) -> Recommendation {
        let c = self.config.clone();
        let (demand, mut reasons) = self.demand_of(s);
        let first = *self.first_tick.get_or_insert(now);
        let requests = s.in_flight_requests + s.queued_requests;
        self.demand.push_back((now, demand, requests));
        let keep = c.up_window.max(c.down_window);
        while self
            .demand
            .front()
            .is_some_and(|(t, _, _)| now.since(*t) > keep)
        {
            self.demand.pop_front();
        }
        let phase = self.track_steps(now, s.rl_requests > 0, demand, requests);
        let peak_since = |window: Duration| {
            self.demand
                .iter()
                .filter(|(t, _, _)| now.since(*t) <= window)
                .map(|(_, d, _)| *d)
                .max()
                .unwrap_or(0)
        };
        let (up, down) = (peak_since(c.up_window), peak_since(c.down_window));
        let prev = self
            .current
            .unwrap_or_else(|| s.workers.clamp(c.min_workers, c.max_workers));
        let mut workers = prev;
        if up > prev {
            workers = up;
            reasons.push(Reason::ScaleUp { workers });
        } else if up < prev && self.in_rl_tail(now, first, s) {
            workers = up;
            reasons.push(Reason::TailRelease { workers });
        } else if down < prev && now.since(first) >= c.down_window {
            workers = down;
            reasons.push(Reason::ScaleDown { workers });
        } else if demand < prev {
            // The last tick whose demand kept the recommendation, plus the window.
            let held_by = self
                .demand
                .iter()
                .rev()
                .find(|(_, d, _)| *d >= prev)
                .map_or(first, |(t, _, _)| *t);
            let until = held_by.max(first) + c.down_window;
            reasons.push(Reason::HoldForTail {
                window_peak: down,
                for_s: secs(now, until).max(0.0),
            });
        }
        let mut floor = 0;
        if let Some((f, in_s)) = self.floor(now) {
            floor = f;
            if f > workers {
                workers = f;
                reasons.push(Reason::PredictedStep { workers: f, in_s });
            }
        }
        let in_flight_need = Self::in_flight_need(s);
        if in_flight_need > workers {
            workers = in_flight_need;
            reasons.push(Reason::InFlight { workers });
        }
        let clamped = workers.clamp(c.min_workers, c.max_workers);
        if clamped != workers {
            reasons.push(Reason::Bounds {
                min: c.min_workers,
                max: c.max_workers,
            });
        }
        if clamped > prev {
            self.last_up = Some(now);
        }
        self.current = Some(clamped);
        Recommendation {
            workers: clamped,
            current_workers: s.workers,
            demand,
            floor,
            in_flight_need,
            phase,
            steps_seen: self.steps_seen,
            reasons,
        }
    }
}
