//! The planner in the loop (`kvrouter sim --planner`): every tick the simulated router's signals
//! go through the same control law as `kvrouter serve --planner-advise`
//! ([`kvrouter_core::planner`]), and the fleet follows the recommendation. New workers serve
//! after the startup delay; removed ones first drain (no new requests) and are released when
//! their last request finished, so scale-down never drains in-flight requests. GPU time counts
//! from provisioning to release.

use super::{new_worker, profiles_of, Event, SimError, Simulation};
use crate::summary::{FleetSample, FleetSummary};
use kvrouter_core::ids::{WorkerId, WorkerRank};
use kvrouter_core::planner::{Planner, PlannerConfig, PoolSignals, Recommendation};
use kvrouter_core::time::Time;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;

/// The planner's settings in the simulator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerSim {
    /// The control law's bounds and targets.
    pub law: PlannerConfig,
    /// Time from provisioning a worker to it serving, ms.
    pub startup_ms: f64,
    /// Time between planner ticks, ms.
    pub tick_ms: f64,
    /// Tail consolidation: a worker drained in an RL step's tail that holds at most this many
    /// requests moves them to the serving workers and to the draining ones that hold more
    /// (each re-prefilled there, as a migration) when they fit, and is released at once (0:
    /// off; it drains in place).
    #[serde(default = "default_migrate_tail")]
    pub migrate_tail: u32,
    /// Tail consolidation's bound: no request (moved, or on a target) delayed by the moves of
    /// a tail past this fraction of its age, were it to generate every token it may.
    #[serde(default = "default_migrate_slowdown")]
    pub migrate_slowdown: f64,
}

fn default_migrate_tail() -> u32 {
    64
}

fn default_migrate_slowdown() -> f64 {
    0.1
}

/// Where a worker is in the planner's fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lifecycle {
    /// Provisioned, loading (not routable yet).
    Starting,
    /// Routable.
    Serving,
    /// Taking no new requests; released when its last one finished.
    Draining,
    /// Released.
    Removed,
}

/// TTFTs kept for the observed p99 (the live server's window).
const TTFT_WINDOW: Duration = Duration::from_secs(30);

/// The planner's state in a run.
pub(super) struct Fleet {
    planner: Planner,
    startup: Duration,
    tick: Duration,
    ttft: VecDeque<(Time, f64)>,
    samples: Vec<FleetSample>,
    pub(super) last: Option<Recommendation>,
    /// Tail consolidation's limit (0: off), fair share and KV usage target.
    pub(super) migrate_tail: u32,
    pub(super) requests_per_worker: u32,
    pub(super) kv_usage_target: f64,
    pub(super) migrate_slowdown: f64,
    /// Requests moved and not started on their target yet: request → (target, KV blocks).
    pub(super) incoming: std::collections::HashMap<usize, (usize, u64)>,
    /// Requests moved so far.
    pub(super) tail_moves: u64,
    /// Workers that took moved requests in this step's tail (they drain in place).
    pub(super) received: std::collections::HashSet<usize>,
    /// Requests slowed by this tail's moves → (delay committed by prefill stalls, decode step
    /// time added), ms.
    pub(super) committed: std::collections::HashMap<usize, (f64, f64)>,
}

impl Fleet {
    pub(super) fn new(p: &PlannerSim) -> Result<Self, SimError> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok(p.startup_ms) && ok(p.tick_ms) && p.tick_ms > 0.0) {
            return Err(SimError::Config(
                "planner: startup ≥ 0 and tick > 0 ms".into(),
            ));
        }
        if !ok(p.migrate_slowdown) {
            return Err(SimError::Config(
                "planner: the migration slowdown must be ≥ 0".into(),
            ));
        }
        let mut law = p.law.clone();
        law.startup = Duration::from_secs_f64(p.startup_ms / 1e3);
        Ok(Self {
            planner: Planner::new(law).map_err(|e| SimError::Config(e.to_string()))?,
            startup: Duration::from_secs_f64(p.startup_ms / 1e3),
            tick: Duration::from_secs_f64(p.tick_ms / 1e3),
            ttft: VecDeque::new(),
            samples: Vec::new(),
            last: None,
            migrate_tail: p.migrate_tail,
            requests_per_worker: p.law.requests_per_worker,
            kv_usage_target: p.law.kv_usage_target,
            migrate_slowdown: p.migrate_slowdown,
            incoming: std::collections::HashMap::new(),
            tail_moves: 0,
            received: std::collections::HashSet::new(),
            committed: std::collections::HashMap::new(),
        })
    }

    /// A first token: its TTFT joins the observed window.
    pub(super) fn observe_ttft(&mut self, at: Time, ttft_ms: f64) {
        self.ttft.push_back((at, ttft_ms));
    }

    fn ttft_p99(&mut self, now: Time) -> Option<f64> {
        while self
            .ttft
            .front()
            .is_some_and(|(t, _)| now.since(*t) > TTFT_WINDOW)
        {
            self.ttft.pop_front();
        }
        let mut v: Vec<f64> = self.ttft.iter().map(|(_, x)| *x).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[((v.len() - 1) as f64 * 0.99).round() as usize])
    }
}

impl Simulation<'_> {
    fn count(&self, l: Lifecycle) -> usize {
        self.workers.iter().filter(|w| w.lifecycle == l).count()
    }

    /// The router's signals for the pool (every worker is one pool in the simulator).
    fn signals(&mut self) -> PoolSignals {
        let now = self.now;
        let engine = &self.config.engine;
        let mut s = PoolSignals {
            workers: self.count(Lifecycle::Serving) as u32,
            in_flight_requests: self.router.ledger().active_requests() as u64,
            queued_requests: self.router.queue_stats().pending_requests as u64,
            batched_tokens_per_worker: Some(u64::from(engine.max_num_batched_tokens)),
            kv_blocks_per_worker: Some(engine.num_gpu_blocks as u64),
            max_requests_per_worker: Some(engine.max_num_seqs as u32),
            ..PoolSignals::default()
        };
        for w in 0..self.workers.len() {
            let load = self.router.load(WorkerRank::new(WorkerId(w as u64), 0));
            s.prefill_tokens += load.active_prefill_tokens;
            s.decode_blocks += load.active_decode_blocks;
        }
        s.rl_requests = self
            .router
            .ledger()
            .active_ids()
            .iter()
            .filter(|id| self.workload.requests[id.0 as usize].group.is_some())
            .count() as u64;
        s.ttft_p99_ms = self.fleet.as_mut().and_then(|f| f.ttft_p99(now));
        s
    }

    /// A planner tick: the law's recommendation, carried out; the next tick while requests
    /// are left.
    pub(super) fn planner_tick(&mut self) -> Result<(), SimError> {
        let signals = self.signals();
        let now = self.now;
        let Some(fleet) = self.fleet.as_mut() else {
            return Ok(());
        };
        let rec = fleet.planner.tick(now, &signals);
        let target = rec.workers as usize;
        fleet.last = Some(rec);
        let tick = fleet.tick;
        let (serving, starting) = (
            self.count(Lifecycle::Serving),
            self.count(Lifecycle::Starting),
        );
        if target > serving + starting {
            self.grow(target - serving - starting)?;
        } else if target < serving + starting {
            self.shrink(serving + starting - target);
        }
        self.mark_tail_moves();
        for w in 0..self.workers.len() {
            self.release_if_drained(w);
        }
        let sample = FleetSample {
            t_s: now.as_secs_f64(),
            serving: self.count(Lifecycle::Serving) as u32,
            provisioned: (self.count(Lifecycle::Serving)
                + self.count(Lifecycle::Starting)
                + self.count(Lifecycle::Draining)) as u32,
            recommended: target as u32,
        };
        if let Some(f) = self.fleet.as_mut() {
            f.samples.push(sample);
        }
        // Until the last request, and through the last step's train phase when there is one.
        if self.finished < self.workload.requests.len()
            || self.replay.steps_end().is_some_and(|e| now < e)
        {
            self.queue.push(now + tick, Event::PlannerTick);
        }
        Ok(())
    }

    /// Adds `n` workers: draining ones first (serving again at once), then new ones that serve
    /// after the startup delay.
    fn grow(&mut self, mut n: usize) -> Result<(), SimError> {
        for w in 0..self.workers.len() {
            if n == 0 {
                return Ok(());
            }
            if self.workers[w].lifecycle == Lifecycle::Draining {
                self.workers[w].lifecycle = Lifecycle::Serving;
                self.router.set_available(WorkerId(w as u64), true);
                n -= 1;
            }
        }
        let startup = self.fleet.as_ref().map_or(Duration::ZERO, |f| f.startup);
        let profiles = profiles_of(&self.config);
        for _ in 0..n {
            let w = self.workers.len();
            let (mut state, spec, model) = new_worker(&self.config, &profiles, w, self.now)?;
            state.lifecycle = Lifecycle::Starting;
            self.workers.push(state);
            self.router
                .add_worker(spec)
                .map_err(|e| SimError::Config(e.to_string()))?;
            self.router.set_worker_timing(WorkerId(w as u64), model);
            self.router.set_available(WorkerId(w as u64), false);
            self.queue.push(self.now + startup, Event::WorkerReady(w));
        }
        Ok(())
    }

    /// Removes `n` workers: starting ones first (newest first), then the serving ones with the
    /// fewest requests in flight, which drain.
    fn shrink(&mut self, mut n: usize) {
        for w in (0..self.workers.len()).rev() {
            if n > 0 && self.workers[w].lifecycle == Lifecycle::Starting {
                // Never served: released at once.
                let worker = &mut self.workers[w];
                worker.lifecycle = Lifecycle::Removed;
                worker.provisioned.1 = Some(self.now);
                worker.dead = true;
                n -= 1;
            }
        }
        let mut serving: Vec<(u32, usize)> = (0..self.workers.len())
            .filter(|w| self.workers[*w].lifecycle == Lifecycle::Serving)
            .map(|w| {
                let load = self.router.load(WorkerRank::new(WorkerId(w as u64), 0));
                (load.active_requests, w)
            })
            .collect();
        serving.sort();
        for (_, w) in serving.into_iter().take(n) {
            self.workers[w].lifecycle = Lifecycle::Draining;
            self.router.set_available(WorkerId(w as u64), false);
        }
    }

    /// A starting worker serves (unless it was removed while loading).
    pub(super) fn worker_ready(&mut self, w: usize) -> Result<(), SimError> {
        if self.workers[w].lifecycle != Lifecycle::Starting {
            return Ok(());
        }
        self.workers[w].lifecycle = Lifecycle::Serving;
        self.router.set_available(WorkerId(w as u64), true);
        self.poll_queue();
        Ok(())
    }

    /// Releases a draining worker whose last request finished (router and engine agree).
    pub(super) fn release_if_drained(&mut self, w: usize) {
        let worker = &self.workers[w];
        if worker.lifecycle != Lifecycle::Draining
            || worker.engine.has_work()
            || worker.pending.is_some()
            || self
                .router
                .load(WorkerRank::new(WorkerId(w as u64), 0))
                .active_requests
                > 0
        {
            return;
        }
        let now = self.now;
        let worker = &mut self.workers[w];
        worker.lifecycle = Lifecycle::Removed;
        worker.provisioned.1 = Some(now);
        worker.dead = true;
        if let Some(since) = worker.busy_since.take() {
            worker.busy.push((since, now));
        }
    }

    /// The fleet's part of the summary.
    pub(super) fn fleet_summary(&self) -> Option<FleetSummary> {
        let f = self.fleet.as_ref()?;
        Some(FleetSummary {
            peak_workers: f.samples.iter().map(|s| s.serving).max().unwrap_or(0),
            startup_s: f.startup.as_secs_f64(),
            last: f.last.clone(),
            tail_moves: f.tail_moves,
            samples: f
                .samples
                .iter()
                .enumerate()
                .filter(|(i, s)| {
                    *i == 0 || {
                        let p = &f.samples[i - 1];
                        (p.serving, p.provisioned, p.recommended)
                            != (s.serving, s.provisioned, s.recommended)
                    }
                })
                .map(|(_, s)| *s)
                .collect(),
            ..FleetSummary::default()
        })
    }
}
