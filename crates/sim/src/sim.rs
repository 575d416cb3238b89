//! The simulation loop: the event queue, its dispatch and the request bookkeeping.
//!
//! The rest lives beside it: `setup` (validation, workers, replicas, initial events), `worker`
//! (a simulated worker and how one is provisioned), `engines` (deliveries, engine steps, worker
//! deaths), `placement`, `replicas`, `rl`, `fleet` and `consolidate` (the planner in the loop),
//! and `results` (the summary).

use crate::config::SimConfig;
use crate::queue::EventQueue;
use crate::summary::{Record, Summary};
use kvrouter_core::event::KvEvent;
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::{RemoteEvent, Router};
use kvrouter_core::time::{millis_f64 as ms, Time};
use kvrouter_workload::replay::Replay;
use kvrouter_workload::Workload;

mod consolidate;
mod engines;
mod fleet;
pub use fleet::PlannerSim;
mod placement;
mod replicas;
mod results;
mod rl;
mod setup;
mod worker;
use worker::{new_worker, profiles_of, WorkerState};

/// Why a run could not start or continue.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The workload does not fit the configuration.
    #[error("invalid workload: {0}")]
    Workload(String),
    /// A timing model failed (outside its table).
    #[error("timing model: {0}")]
    Timing(String),
}

enum Event {
    /// A request reaches the router.
    Arrive(usize),
    /// A request the router has read (after its ingress time) is routed.
    Route(usize),
    /// A routed request reaches its engine.
    Deliver(usize, usize),
    /// A worker's step ends.
    StepEnd(usize),
    /// KV events become visible to the router.
    Visible(Vec<KvEvent>),
    /// A worker dies.
    WorkerDies(usize),
    /// A request whose worker died is continued elsewhere: placed now, on a worker it has not
    /// tried (the live server's rule for retries and migrations).
    Continue(usize),
    /// A request aborted for a weight update is continued: admitted again, waiting in the queue
    /// for a worker of an accepted version (as the live server does).
    Resume(usize),
    /// A worker finished loading new weights.
    Loaded(usize),
    /// Events of router replica `.0` reach the other replicas.
    Sync(usize, Vec<RemoteEvent>),
    /// The planner looks at the router's signals and resizes the fleet.
    PlannerTick,
    /// A worker the planner added finished starting.
    WorkerReady(usize),
}

/// A simulation in progress.
pub struct Simulation<'w> {
    config: SimConfig,
    workload: &'w Workload,
    /// Replica 0 (the only one without `--router-replicas`); it drives weight updates.
    router: Router,
    /// Replicas 1 to N - 1.
    replicas: Vec<Router>,
    workers: Vec<WorkerState>,
    queue: EventQueue<Event>,
    now: Time,
    records: Vec<Record>,
    /// When requests start (arrival times, turns, RL steps, closed loop).
    replay: Replay<'w>,
    finished: usize,
    /// Requests per RL group (what a client sends as `x-kvrouter-group-size`).
    group_sizes: std::collections::HashMap<u64, u32>,
    /// Requests of each RL group (first-N-of-M ends the rest).
    group_members: std::collections::HashMap<u64, Vec<usize>>,
    /// Unfinished requests per RL step (a finished step triggers a weight update).
    step_left: std::collections::BTreeMap<u32, usize>,
    /// Policy versions waiting for the running update to end.
    pending_versions: std::collections::VecDeque<u64>,
    /// Requests that are a trajectory's last turn (a sample is done when its last turn is).
    last_turn: Vec<bool>,
    /// Weight loads: (worker, start, end), for timelines.
    update_spans: Vec<crate::perfetto::UpdateSpan>,
    /// Workers each request was placed on, in order (a continuation after a failure avoids
    /// them).
    tried: Vec<Vec<WorkerId>>,
    /// The planner in the loop (`--planner`).
    fleet: Option<fleet::Fleet>,
}

impl<'w> Simulation<'w> {
    /// Simulated time.
    pub fn now(&self) -> Time {
        self.now
    }

    /// Requests finished or rejected so far, and the total.
    pub fn progress(&self) -> (usize, usize) {
        (self.finished, self.workload.requests.len())
    }

    /// Every request's record so far (for inspection).
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// Weight loads so far: (worker, start, end).
    pub fn update_spans(&self) -> &[crate::perfetto::UpdateSpan] {
        &self.update_spans
    }

    /// The workload.
    pub fn workload(&self) -> &Workload {
        self.workload
    }

    /// The router (for inspection).
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Processes the next event; false when none is left.
    pub fn step(&mut self) -> Result<bool, SimError> {
        let Some((at, event)) = self.queue.pop() else {
            return Ok(false);
        };
        if matches!(event, Event::Arrive(_)) && self.past_duration(at) {
            // Not sent, and the clock does not run on to it: the run ends with its last work.
            return Ok(true);
        }
        self.now = at;
        match event {
            Event::Arrive(i) => self.arrive(i),
            Event::Route(i) => self.route_request(i),
            Event::Deliver(i, w) => self.deliver(i, w)?,
            Event::StepEnd(w) => self.step_end(w)?,
            Event::Visible(events) => {
                for r in self.all_routers() {
                    for e in &events {
                        let _ = r.apply_event(e);
                    }
                }
            }
            Event::WorkerDies(w) => self.worker_dies(w),
            Event::Continue(i) => self.continue_request(i),
            Event::Resume(i) => self.route_request(i),
            Event::Loaded(w) => self.loaded(w)?,
            Event::Sync(from, events) => self.synced(from, events),
            Event::PlannerTick => self.planner_tick()?,
            Event::WorkerReady(w) => self.worker_ready(w)?,
        }
        self.send_sync();
        Ok(true)
    }

    /// Processes events up to and including `until`.
    pub fn step_until(&mut self, until: Time) -> Result<(), SimError> {
        while self.queue.peek_time().is_some_and(|t| t <= until) {
            self.step()?;
        }
        Ok(())
    }

    /// Runs to completion and summarises.
    pub fn run(mut self) -> Result<Summary, SimError> {
        while self.step()? {}
        Ok(self.summary())
    }

    /// Whether a request due at `at` is past the run's duration: not sent (no arrival), and its
    /// session ends there.
    fn past_duration(&self, at: Time) -> bool {
        self.config
            .duration_ms
            .is_some_and(|d| at > Time::ZERO + ms(d))
    }

    fn arrive(&mut self, i: usize) {
        self.records[i].arrival = Some(self.now);
        let per_token = self.config.ingress_us_per_token;
        if per_token > 0.0 {
            let tokens = f64::from(self.workload.requests[i].input_tokens);
            let at = self.now + ms(tokens * per_token / 1e3);
            self.queue.push(at, Event::Route(i));
        } else {
            self.route_request(i);
        }
    }

    /// Bookkeeping when request `i` leaves the system: next turns, step barriers, closed loop.
    fn done(&mut self, i: usize) {
        self.finished += 1;
        self.step_done(i);
        let ended = self.records[i].ended_early;
        let released = self
            .replay
            .finished(i, self.now, self.records[i].rejected || ended);
        // A session whose turn failed does not continue; one ended early (its group has enough
        // trajectories) ends with its later turns, now.
        for f in released.dropped {
            let rec = &mut self.records[f];
            if ended {
                rec.ended_early = true;
                rec.arrival.get_or_insert(self.now);
                rec.finish = Some(self.now);
            } else {
                rec.rejected = true;
            }
            self.finished += 1;
            self.step_done(f);
        }
        for (at, f) in released.start {
            self.queue.push(at, Event::Arrive(f));
        }
    }
}

#[cfg(test)]
mod continuation_tests;
