//! When each request of a workload starts: the arrival rules the simulator and the live bench
//! share. Open loop at arrival times (scaled by a speed-up), a previous turn plus its delay, RL
//! steps behind a barrier (with staleness), or a closed loop keeping N sessions in flight.
//! Sans-IO: callers say when a request finished and get back what starts, and when.

use crate::Workload;
use kvrouter_core::time::millis_f64 as ms;
use kvrouter_core::time::Time;
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// What a finished request set off.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Requests to start, with when, in the order they were released.
    pub start: Vec<(Time, usize)>,
    /// Requests that will never start (later turns of a failed session), in order.
    pub dropped: Vec<usize>,
}

/// The arrival bookkeeping of one replay.
#[derive(Clone, Debug)]
pub struct Replay<'w> {
    workload: &'w Workload,
    /// Requests that start when request i finishes.
    followers: Vec<Vec<usize>>,
    /// Per RL step: its first requests, and how many of its requests are unfinished.
    steps: BTreeMap<u32, (Vec<usize>, usize)>,
    /// When each RL step was released (its rollout span starts there).
    released: BTreeMap<u32, Time>,
    /// With a train phase: when the last step's train phase and pause end.
    steps_end: Option<Time>,
    /// Closed loop: requests not yet started, in order.
    backlog: VecDeque<usize>,
    closed_loop: bool,
}

impl<'w> Replay<'w> {
    /// The bookkeeping, and the requests that start on their own (with when). `concurrency`
    /// selects the closed loop; `arrival_speedup` divides open-loop arrival times.
    pub fn new(
        workload: &'w Workload,
        concurrency: Option<usize>,
        arrival_speedup: f64,
    ) -> (Self, Vec<(Time, usize)>) {
        let n = workload.requests.len();
        let mut r = Replay {
            workload,
            followers: vec![Vec::new(); n],
            steps: BTreeMap::new(),
            released: BTreeMap::new(),
            steps_end: None,
            backlog: VecDeque::new(),
            closed_loop: concurrency.is_some(),
        };
        for (i, q) in workload.requests.iter().enumerate() {
            if let Some(a) = q.after {
                r.followers[a].push(i);
            }
            if let (Some(step), Some(_)) = (q.step, workload.barrier) {
                let e = r.steps.entry(step).or_default();
                if q.after.is_none() {
                    e.0.push(i);
                }
                e.1 += 1;
            }
        }
        let mut start = Vec::new();
        if let Some(c) = concurrency {
            r.backlog = (0..n)
                .filter(|i| workload.requests[*i].after.is_none())
                .collect();
            // At most the backlog: a huge --concurrency spun here long after it was empty.
            let first = c.max(1).min(r.backlog.len());
            start.extend(r.backlog.drain(..first).map(|i| (Time::ZERO, i)));
        } else if let (Some(barrier), false) = (workload.barrier, r.steps.is_empty()) {
            // Steps 0..=staleness start at once; each finished step releases the one
            // `staleness + 1` after it.
            let first: Vec<u32> = r
                .steps
                .keys()
                .take(barrier.staleness as usize + 1)
                .copied()
                .collect();
            for k in first {
                r.release(k, Time::ZERO, &mut start);
            }
        } else {
            for (i, q) in workload.requests.iter().enumerate() {
                if let (Some(a), None) = (q.arrival_ms, q.after) {
                    start.push((Time::ZERO + ms(a / arrival_speedup), i));
                }
            }
        }
        (r, start)
    }

    fn release(&mut self, step: u32, at: Time, start: &mut Vec<(Time, usize)>) {
        if let Some((first, _)) = self.steps.get(&step) {
            start.extend(first.iter().map(|&i| (at, i)));
            self.released.insert(step, at);
        }
    }

    /// With a train phase (`Barrier::rollout_share`), once the last step finished: when its
    /// train phase and pause end, i.e. when the step after it would be released. A run of N
    /// steps lasts until then (N whole steps: rollout, train, sync).
    pub fn steps_end(&self) -> Option<Time> {
        self.steps_end
    }

    /// Whether a later request waits for request `i` (the next turn of its session).
    pub fn has_followers(&self, i: usize) -> bool {
        !self.followers[i].is_empty()
    }

    /// Request `i` finished at `now` (`failed`: its session does not continue).
    pub fn finished(&mut self, i: usize, now: Time, failed: bool) -> Released {
        let mut out = Released::default();
        self.finish_into(i, now, failed, &mut out);
        out
    }

    fn finish_into(&mut self, i: usize, now: Time, failed: bool, out: &mut Released) {
        for f in self.followers[i].clone() {
            if failed {
                out.dropped.push(f);
                self.finish_into(f, now, true, out);
            } else {
                out.start
                    .push((now + ms(self.workload.requests[f].delay_ms), f));
            }
        }
        let req = &self.workload.requests[i];
        if let (Some(barrier), Some(step), false) =
            (self.workload.barrier, req.step, self.closed_loop)
        {
            if let Some(s) = self.steps.get_mut(&step) {
                s.1 = s.1.saturating_sub(1);
                if s.1 == 0 {
                    // The trainer's phase (from this step's rollout span), then the pause.
                    let span = self
                        .released
                        .get(&step)
                        .map_or(Duration::ZERO, |a| now.since(*a));
                    let at = now + barrier.gap_after(span);
                    let ahead = barrier.staleness as usize;
                    // The last step (u32::MAX) has none after it: `step + 1` wrapped to 0
                    // and released the same step again, without end.
                    let next = step
                        .checked_add(1)
                        .and_then(|after| self.steps.range(after..).nth(ahead).map(|(k, _)| *k));
                    match next {
                        Some(next) => self.release(next, at, &mut out.start),
                        None if barrier.has_train_phase() => {
                            self.steps_end = Some(self.steps_end.map_or(at, |e| e.max(at)));
                        }
                        None => {}
                    }
                }
            }
        }
        if self.closed_loop && req.after.is_none() {
            if let Some(next) = self.backlog.pop_front() {
                out.start.push((now, next));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Barrier, WorkloadRequest};

    fn req() -> WorkloadRequest {
        WorkloadRequest {
            arrival_ms: Some(0.0),
            after: None,
            delay_ms: 0.0,
            session: None,
            blocks: vec![1],
            input_tokens: 4,
            output_tokens: 4,
            group: None,
            step: None,
            policy_version: None,
        }
    }

    fn workload(requests: Vec<WorkloadRequest>, barrier: Option<Barrier>) -> Workload {
        Workload {
            name: "t".into(),
            block_size: 4,
            requests,
            barrier,
        }
    }

    #[test]
    fn turns_follow_their_previous_turn_and_failures_drop_the_session() {
        let mut second = req();
        second.arrival_ms = None;
        second.after = Some(0);
        second.delay_ms = 5.0;
        let mut third = second.clone();
        third.after = Some(1);
        let w = workload(vec![req(), second, third], None);
        let (mut r, start) = Replay::new(&w, None, 2.0);
        assert_eq!(start, vec![(Time::ZERO, 0)]);
        let out = r.finished(0, Time::from_millis(100), false);
        assert_eq!(out.start, vec![(Time::from_millis(105), 1)]);
        let (mut r, _) = Replay::new(&w, None, 1.0);
        let out = r.finished(0, Time::ZERO, true);
        assert_eq!((out.start, out.dropped), (vec![], vec![1, 2]));
    }

    #[test]
    fn open_loop_arrivals_scale_with_the_speedup() {
        let mut late = req();
        late.arrival_ms = Some(1000.0);
        let w = workload(vec![req(), late], None);
        let (_, start) = Replay::new(&w, None, 4.0);
        assert_eq!(start, vec![(Time::ZERO, 0), (Time::from_millis(250), 1)]);
    }

    #[test]
    fn closed_loop_keeps_the_concurrency() {
        let w = workload(vec![req(), req(), req()], None);
        let (mut r, start) = Replay::new(&w, Some(2), 1.0);
        assert_eq!(start, vec![(Time::ZERO, 0), (Time::ZERO, 1)]);
        assert_eq!(
            r.finished(1, Time::from_millis(7), false).start,
            vec![(Time::from_millis(7), 2)]
        );
        assert_eq!(
            r.finished(0, Time::from_millis(9), false),
            Released::default()
        );
    }

    #[test]
    fn a_concurrency_past_the_requests_starts_each_once_at_once() {
        let w = workload(vec![req(), req()], None);
        let (_, start) = Replay::new(&w, Some(usize::MAX), 1.0);
        assert_eq!(start, vec![(Time::ZERO, 0), (Time::ZERO, 1)]);
    }

    #[test]
    fn the_last_possible_step_ends_the_run_instead_of_starting_again() {
        let mut only = req();
        only.arrival_ms = None;
        only.step = Some(u32::MAX);
        let w = workload(
            vec![only],
            Some(Barrier {
                pause_ms: 0.0,
                staleness: 0,
                rollout_share: None,
            }),
        );
        let (mut r, start) = Replay::new(&w, None, 1.0);
        assert_eq!(start, vec![(Time::ZERO, 0)]);
        assert!(r.finished(0, Time::from_millis(5), false).start.is_empty());
    }

    /// The sheet's §8: train phase = rollout span × (1 − r) / r, then the pause; the run's
    /// steps end after the last step's train phase.
    #[test]
    fn a_train_phase_follows_each_step_in_proportion_to_its_rollout_span() {
        let mut requests: Vec<WorkloadRequest> = (0..4).map(|_| req()).collect();
        for (i, q) in requests.iter_mut().enumerate() {
            q.arrival_ms = None;
            q.step = Some(i as u32 / 2);
        }
        let w = workload(
            requests,
            Some(Barrier {
                pause_ms: 1000.0,
                staleness: 0,
                rollout_share: Some(0.75),
            }),
        );
        let (mut r, _) = Replay::new(&w, None, 1.0);
        r.finished(0, Time::from_millis(30_000), false);
        // Rollout span 60 s: train 20 s, pause 1 s.
        let out = r.finished(1, Time::from_millis(60_000), false);
        assert_eq!(
            out.start,
            vec![
                (Time::from_millis(81_000), 2),
                (Time::from_millis(81_000), 3)
            ]
        );
        assert_eq!(r.steps_end(), None);
        r.finished(2, Time::from_millis(90_000), false);
        r.finished(3, Time::from_millis(111_000), false);
        // Second span 30 s: train 10 s, pause 1 s.
        assert_eq!(r.steps_end(), Some(Time::from_millis(122_000)));
        // Without a rollout share, nothing changes: no steps end is reported.
        let mut plain = w.clone();
        plain.barrier = plain.barrier.map(|b| Barrier {
            rollout_share: None,
            ..b
        });
        let (mut r, _) = Replay::new(&plain, None, 1.0);
        r.finished(0, Time::ZERO, false);
        let out = r.finished(1, Time::from_millis(60_000), false);
        assert_eq!(out.start[0].0, Time::from_millis(61_000));
        assert!(plain.validate(4).is_ok());
        let mut bad = w.clone();
        bad.barrier = bad.barrier.map(|b| Barrier {
            rollout_share: Some(1.5),
            ..b
        });
        assert!(bad.validate(4).unwrap_err().contains("rollout_share"));
    }

    #[test]
    fn steps_wait_for_the_previous_step_and_the_pause() {
        let mut requests: Vec<WorkloadRequest> = (0..6).map(|_| req()).collect();
        for (i, q) in requests.iter_mut().enumerate() {
            q.arrival_ms = None;
            q.step = Some(i as u32 / 2);
        }
        let w = workload(
            requests.clone(),
            Some(Barrier {
                pause_ms: 50.0,
                staleness: 0,
                rollout_share: None,
            }),
        );
        let (mut r, start) = Replay::new(&w, None, 1.0);
        assert_eq!(start, vec![(Time::ZERO, 0), (Time::ZERO, 1)]);
        assert!(r.finished(0, Time::from_millis(10), false).start.is_empty());
        let out = r.finished(1, Time::from_millis(20), false);
        assert_eq!(
            out.start,
            vec![(Time::from_millis(70), 2), (Time::from_millis(70), 3)]
        );
        // Staleness 1: two steps run at once; finishing step 0 releases step 2.
        let w = workload(
            requests,
            Some(Barrier {
                pause_ms: 0.0,
                staleness: 1,
                rollout_share: None,
            }),
        );
        let (mut r, start) = Replay::new(&w, None, 1.0);
        assert_eq!(
            start.iter().map(|s| s.1).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        r.finished(0, Time::ZERO, false);
        assert_eq!(
            r.finished(1, Time::ZERO, false).start,
            vec![(Time::ZERO, 4), (Time::ZERO, 5)]
        );
    }
}
