//! When requests start in the global simulation: RL steps behind a barrier, with at most N
//! sessions (trajectories) in flight within a step (the harness's sandbox limit), each next
//! turn after its previous one plus the tool delay. Workloads without a barrier start their
//! first turns at their arrival times (one pseudo-step 0).

use kvrouter_core::time::millis_f64 as ms;
use kvrouter_core::time::Time;
use kvrouter_workload::Workload;
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

#[derive(Default)]
struct StepState {
    waiting: VecDeque<usize>,
    in_flight: usize,
    left: usize,
    start: Option<Time>,
    end: Option<Time>,
}

/// What a finished request set off.
pub(super) struct Released {
    /// Requests to start, with when.
    pub(super) start: Vec<(Time, usize)>,
    /// The request was its session's last turn.
    pub(super) session_ended: bool,
}

pub(super) struct StepReplay {
    followers: Vec<Vec<usize>>,
    step_of: Vec<u32>,
    steps: BTreeMap<u32, StepState>,
    cap: usize,
    barrier: Option<kvrouter_workload::Barrier>,
}

impl StepReplay {
    /// The bookkeeping and the requests that start on their own.
    pub(super) fn new(
        w: &Workload,
        sessions_in_flight: Option<usize>,
    ) -> (Self, Vec<(Time, usize)>) {
        let n = w.requests.len();
        let mut r = Self {
            followers: vec![Vec::new(); n],
            step_of: vec![0; n],
            steps: BTreeMap::new(),
            cap: sessions_in_flight.unwrap_or(usize::MAX).max(1),
            barrier: w.barrier,
        };
        let mut start = Vec::new();
        for (i, q) in w.requests.iter().enumerate() {
            let step = if r.barrier.is_some() {
                q.step.unwrap_or(0)
            } else {
                0
            };
            r.step_of[i] = step;
            let s = r.steps.entry(step).or_default();
            s.left += 1;
            match (q.after, r.barrier) {
                (Some(a), _) => r.followers[a].push(i),
                (None, Some(_)) => s.waiting.push_back(i),
                (None, None) => {
                    let at = Time::ZERO + ms(q.arrival_ms.unwrap_or(0.0));
                    s.start = Some(s.start.map_or(at, |t| t.min(at)));
                    start.push((at, i));
                }
            }
        }
        if r.barrier.is_some() {
            if let Some(&first) = r.steps.keys().next() {
                r.release(first, Time::ZERO, &mut start);
            }
        }
        (r, start)
    }

    fn release(&mut self, step: u32, at: Time, start: &mut Vec<(Time, usize)>) {
        let cap = self.cap;
        if let Some(s) = self.steps.get_mut(&step) {
            s.start = Some(at);
            while s.in_flight < cap {
                let Some(i) = s.waiting.pop_front() else {
                    break;
                };
                s.in_flight += 1;
                start.push((at, i));
            }
        }
    }

    /// Request `i` finished (its last token reached the client) at `now`.
    pub(super) fn finished(&mut self, w: &Workload, i: usize, now: Time) -> Released {
        let mut out = Released {
            start: self.followers[i]
                .iter()
                .map(|&f| (now + ms(w.requests[f].delay_ms), f))
                .collect(),
            session_ended: self.followers[i].is_empty(),
        };
        let step = self.step_of[i];
        let Some(s) = self.steps.get_mut(&step) else {
            return out;
        };
        s.left = s.left.saturating_sub(1);
        if out.session_ended && self.barrier.is_some() {
            s.in_flight = s.in_flight.saturating_sub(1);
            if let Some(next) = s.waiting.pop_front() {
                s.in_flight += 1;
                out.start.push((now, next));
            }
        }
        if s.left == 0 {
            s.end = Some(now);
            if let Some(barrier) = self.barrier {
                // The trainer's phase (from the step's rollout span), then the pause.
                let span = s.start.map_or(Duration::ZERO, |a| now.since(a));
                let at = now + barrier.gap_after(span);
                if let Some(next) = self.steps.range(step + 1..).next().map(|(k, _)| *k) {
                    self.release(next, at, &mut out.start);
                }
            }
        }
        out
    }

    /// Finished steps: (step, start, end).
    pub(super) fn steps(&self) -> Vec<(u32, Time, Time)> {
        self.steps
            .iter()
            .filter_map(|(k, s)| Some((*k, s.start?, s.end?)))
            .collect()
    }
}
