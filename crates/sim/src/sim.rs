//! The simulation loop.

use crate::config::SimConfig;
use crate::queue::EventQueue;
use crate::summary::{Record, Summary, SummaryBuilder};
use kvrouter_core::event::KvEvent;
use kvrouter_core::ids::{ReplicaId, RequestId, WorkerId, WorkerRank};
use kvrouter_core::router::{RemoteEvent, Router, WorkerSpec};
use kvrouter_core::time::Time;
use kvrouter_engine::{Engine, EngineRequest, Prompt, StepOutcome};
use kvrouter_workload::replay::Replay;
use kvrouter_workload::Workload;
use std::time::Duration;

mod consolidate;
mod fleet;
pub use fleet::PlannerSim;
mod placement;
mod replicas;
mod rl;

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

struct WorkerState {
    engine: Engine,
    pending: Option<StepOutcome>,
    busy_since: Option<Time>,
    busy: Vec<(Time, Time)>,
    /// (time, running requests, KV usage) after each step.
    samples: Vec<(Time, f32, f32)>,
    dead: bool,
    /// A weight update aborts its requests when its current step ends.
    abort_after_step: bool,
    /// The planner moves its requests elsewhere when its current step ends (tail
    /// consolidation).
    move_after_step: bool,
    /// Its timing model (tail consolidation bounds a target's decode slowdown with it).
    timing: std::sync::Arc<dyn kvrouter_engine::TimingModel>,
    /// Starting, serving, draining or removed (the planner's fleet; always serving without).
    lifecycle: fleet::Lifecycle,
    /// When it was provisioned (GPU time counts from here) and released.
    provisioned: (Time, Option<Time>),
}

fn profiles_of(config: &SimConfig) -> Vec<String> {
    if config.profiles.is_empty() {
        vec!["dynamo-poly".to_owned()]
    } else {
        config.profiles.clone()
    }
}

/// Worker `w`'s engine and what the router learns about it, provisioned at `now`.
fn new_worker(
    config: &SimConfig,
    profiles: &[String],
    w: usize,
    now: Time,
) -> Result<
    (
        WorkerState,
        WorkerSpec,
        std::sync::Arc<dyn kvrouter_engine::TimingModel>,
    ),
    SimError,
> {
    let mut engine_config = config.engine.clone();
    engine_config.block_size = config.router.kv_cache_block_size;
    let speed = config
        .speed
        .iter()
        .find(|(x, _)| *x == w)
        .map_or(1.0, |(_, f)| *f);
    if !speed.is_finite() || speed <= 0.0 {
        return Err(SimError::Config(format!(
            "worker {w}: speed must be positive"
        )));
    }
    // One model, loaded once: the engine times its steps with it and the router's cost
    // policy its estimates.
    let model: std::sync::Arc<dyn kvrouter_engine::TimingModel> = std::sync::Arc::from(
        kvrouter_engine::timing::by_name(&profiles[w % profiles.len()], speed)
            .map_err(|e| SimError::Config(e.to_string()))?,
    );
    let rank = WorkerRank::new(WorkerId(w as u64), 0);
    let spec = WorkerSpec {
        id: WorkerId(w as u64),
        dp_size: 1,
        max_num_batched_tokens: Some(u64::from(engine_config.max_num_batched_tokens)),
        kv_capacity_blocks: Some(engine_config.num_gpu_blocks as u64),
        policy_version: 0,
    };
    engine_config.seed = engine_config.seed.wrapping_add(w as u64);
    let state = WorkerState {
        engine: Engine::new(engine_config, rank, Box::new(std::sync::Arc::clone(&model))),
        pending: None,
        busy_since: None,
        busy: Vec::new(),
        samples: Vec::new(),
        dead: false,
        abort_after_step: false,
        move_after_step: false,
        timing: std::sync::Arc::clone(&model),
        lifecycle: fleet::Lifecycle::Serving,
        provisioned: (now, None),
    };
    Ok((state, spec, model))
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

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v.max(0.0) / 1e3)
}

impl<'w> Simulation<'w> {
    /// Sets up workers, router and initial arrivals.
    pub fn new(config: SimConfig, workload: &'w Workload) -> Result<Self, SimError> {
        let bs = config.router.kv_cache_block_size;
        workload.validate(bs).map_err(SimError::Workload)?;
        if config.workers == 0 {
            return Err(SimError::Config("at least one worker".into()));
        }
        if !config.arrival_speedup.is_finite() || config.arrival_speedup <= 0.0 {
            return Err(SimError::Config("arrival speed-up must be positive".into()));
        }
        if config.router_replicas == 0 {
            return Err(SimError::Config("at least one router replica".into()));
        }
        if !config.replica_sync_delay_ms.is_finite() || config.replica_sync_delay_ms < 0.0 {
            return Err(SimError::Config(
                "replica sync delay must be a non-negative number".into(),
            ));
        }
        let mut router =
            Router::new(config.router.clone()).map_err(|e| SimError::Config(e.to_string()))?;
        let profiles = profiles_of(&config);
        let mut workers = Vec::with_capacity(config.workers);
        let mut timings: Vec<std::sync::Arc<dyn kvrouter_engine::TimingModel>> =
            Vec::with_capacity(config.workers);
        for w in 0..config.workers {
            let (state, spec, model) = new_worker(&config, &profiles, w, Time::ZERO)?;
            workers.push(state);
            // The router's cost policy times its estimates with the engine's own model.
            router.set_worker_timing(WorkerId(w as u64), std::sync::Arc::clone(&model));
            timings.push(model);
            router
                .add_worker(spec)
                .map_err(|e| SimError::Config(e.to_string()))?;
        }
        let mut replicas = Vec::new();
        for r in 1..config.router_replicas {
            // Each replica draws its own random tie-breaks, as live replicas whose views of the
            // fleet differ do; one shared seed would make them agree by accident.
            let mut replica_config = config.router.clone();
            replica_config.seed = replica_config.seed.wrapping_add(r as u64);
            let mut replica =
                Router::new(replica_config).map_err(|e| SimError::Config(e.to_string()))?;
            for spec in router.workers() {
                replica
                    .add_worker(spec.clone())
                    .map_err(|e| SimError::Config(e.to_string()))?;
            }
            for (w, t) in timings.iter().enumerate() {
                replica.set_worker_timing(WorkerId(w as u64), std::sync::Arc::clone(t));
            }
            if config.replica_sync {
                replica.enable_replica_sync(ReplicaId(r as u64), usize::MAX);
            }
            replicas.push(replica);
        }
        if config.router_replicas > 1 && config.replica_sync {
            router.enable_replica_sync(ReplicaId(0), usize::MAX);
        }
        let n = workload.requests.len();
        let (replay, arrivals) = Replay::new(workload, config.concurrency, config.arrival_speedup);
        let mut sim = Self {
            config,
            workload,
            router,
            replicas,
            workers,
            queue: EventQueue::new(),
            now: Time::ZERO,
            records: (0..n).map(|_| Record::default()).collect(),
            replay,
            finished: 0,
            group_sizes: std::collections::HashMap::new(),
            group_members: std::collections::HashMap::new(),
            step_left: std::collections::BTreeMap::new(),
            pending_versions: std::collections::VecDeque::new(),
            last_turn: vec![true; n],
            update_spans: Vec::new(),
            tried: vec![Vec::new(); n],
            fleet: None,
        };
        if let Some(p) = &sim.config.planner {
            if sim.config.weight_update.is_some() || sim.config.router_replicas > 1 {
                return Err(SimError::Config(
                    "the planner runs without weight updates and with one router replica".into(),
                ));
            }
            sim.fleet = Some(fleet::Fleet::new(p)?);
            sim.queue.push(Time::ZERO, Event::PlannerTick);
        }
        for r in &workload.requests {
            if let Some(a) = r.after {
                sim.last_turn[a] = false;
            }
        }
        for (i, r) in workload.requests.iter().enumerate() {
            // A group's size counts its samples: single requests, or trajectories (first turns).
            if let (Some(g), true, None) = (r.group, sim.config.group_sizes, r.after) {
                *sim.group_sizes.entry(g).or_insert(0) += 1;
            }
            if let (Some(g), Some(_)) = (r.group, sim.config.group_need) {
                sim.group_members.entry(g).or_default().push(i);
            }
            if let Some(step) = r.step {
                *sim.step_left.entry(step).or_insert(0) += 1;
            }
        }
        if let Some(u) = &sim.config.weight_update {
            if u.batch == 0 || !u.load_ms.is_finite() || u.load_ms < 0.0 {
                return Err(SimError::Config(
                    "weight update: batch ≥ 1 and a non-negative load time".into(),
                ));
            }
        }
        for (w, at_ms) in sim.config.failures.clone() {
            if w >= sim.workers.len() {
                return Err(SimError::Config(format!(
                    "failure of worker {w}, but there are {}",
                    sim.workers.len()
                )));
            }
            sim.queue.push(Time::ZERO + ms(at_ms), Event::WorkerDies(w));
        }
        for (at, i) in arrivals {
            sim.queue.push(at, Event::Arrive(i));
        }
        Ok(sim)
    }

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
        self.now = at;
        match event {
            Event::Arrive(i) => self.arrive(i),
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

    fn arrive(&mut self, i: usize) {
        self.records[i].arrival = Some(self.now);
        self.route_request(i);
    }

    /// A worker dies: out of the eligible set at once; its requests migrate or fail.
    fn worker_dies(&mut self, w: usize) {
        let worker = &mut self.workers[w];
        if worker.dead {
            return;
        }
        worker.dead = true;
        worker.pending = None;
        if let Some(since) = worker.busy_since.take() {
            worker.busy.push((since, self.now));
        }
        let lost = worker.engine.drain();
        for r in self.all_routers() {
            r.set_available(WorkerId(w as u64), false);
        }
        for (id, generated) in lost {
            let i = id.0 as usize;
            self.release(id);
            let rec = &mut self.records[i];
            if rec.migrations < self.config.migration_limit {
                rec.migrations += 1;
                rec.carried += generated;
                self.queue.push(self.now, Event::Continue(i));
            } else {
                rec.failed = true;
                rec.rejected = true;
                self.done(i);
            }
        }
    }

    fn deliver(&mut self, i: usize, w: usize) -> Result<(), SimError> {
        if self.records[i].finish.is_some() {
            // Ended (its group had enough samples) on the way.
            return Ok(());
        }
        let req = &self.workload.requests[i];
        let carried = self.records[i].carried;
        let prompt = Prompt::Blocks {
            blocks: self
                .workload
                .router_blocks(i, self.config.router.kv_cache_block_size),
            len_tokens: req.input_tokens + carried,
        };
        let er = EngineRequest {
            id: RequestId(i as u64),
            prompt,
            max_output_tokens: req.output_tokens.saturating_sub(carried).max(1),
        };
        let aborting = self
            .config
            .weight_update
            .as_ref()
            .is_some_and(|u| u.mode == kvrouter_core::router::UpdateMode::Abort)
            && self.router.update_phase(WorkerId(w as u64))
                == Some(kvrouter_core::router::UpdatePhase::Draining);
        if aborting {
            // Reached an engine that is aborting for an update: continued on the new policy.
            self.records[i].update_aborts += 1;
            self.queue.push(self.now, Event::Resume(i));
            self.release(RequestId(i as u64));
            return Ok(());
        }
        if self.workers[w].dead {
            // Routed just before the death was known: continue elsewhere.
            self.release(RequestId(i as u64));
            self.queue.push(self.now, Event::Continue(i));
            return Ok(());
        }
        if self.workers[w].engine.add_request(er).is_err() {
            self.release(RequestId(i as u64));
            self.records[i].rejected = true;
            self.done(i);
            return Ok(());
        }
        if self.workers[w].pending.is_none() {
            self.start_step(w)?;
        }
        Ok(())
    }

    fn start_step(&mut self, w: usize) -> Result<(), SimError> {
        let now = self.now;
        let worker = &mut self.workers[w];
        if worker.dead {
            return Ok(());
        }
        match worker
            .engine
            .step(now)
            .map_err(|e| SimError::Timing(e.to_string()))?
        {
            Some(out) => {
                let end = out.end.max(Time(now.0 + 1));
                worker.busy_since.get_or_insert(now);
                worker.pending = Some(out);
                self.queue.push(end, Event::StepEnd(w));
            }
            None => {
                if let Some(since) = worker.busy_since.take() {
                    worker.busy.push((since, now));
                }
            }
        }
        Ok(())
    }

    fn step_end(&mut self, w: usize) -> Result<(), SimError> {
        let Some(out) = self.workers[w].pending.take() else {
            return Ok(());
        };
        let net = ms(self.config.network_delay_ms);
        if self.fleet.as_ref().is_some_and(|f| !f.incoming.is_empty()) {
            let started = out.tokens.iter().filter(|t| t.index == 0).map(|t| t.id);
            for id in started.chain(out.finished.iter().map(|f| f.id)) {
                self.arrived(id.0 as usize);
            }
        }
        for (id, _) in &out.admitted {
            self.records[id.0 as usize]
                .admitted
                .get_or_insert(out.start);
        }
        for t in &out.tokens {
            let i = t.id.0 as usize;
            let rec = &mut self.records[i];
            if rec.finish.is_some() {
                continue;
            }
            let at = self.now + net;
            if t.index == 0 {
                // A continuation's first token is not the request's first token.
                if rec.first_token.is_none() {
                    rec.first_token = Some(at);
                    if let (Some(f), Some(a)) = (self.fleet.as_mut(), rec.arrival) {
                        f.observe_ttft(at, at.since(a).as_secs_f64() * 1e3);
                    }
                }
                rec.last_token = Some(at);
                let _ = self.router_of(i).first_token(t.id);
                self.router_of(i).observe_first_token(t.id, at);
                continue;
            } else if let Some(prev) = rec.last_token {
                rec.itl_sum_ms += at.since(prev).as_secs_f64() * 1e3;
                rec.itl_count += 1;
            }
            rec.last_token = Some(at);
        }
        for f in &out.finished {
            let i = f.id.0 as usize;
            let rec = &mut self.records[i];
            if rec.finish.is_some() {
                continue;
            }
            rec.finish = Some(self.now + net);
            if rec.migrations == 0 {
                rec.served_cached = f.cached_tokens;
            }
            rec.output_tokens = rec.carried + f.output_tokens;
            let (out, now) = (u64::from(rec.output_tokens), self.now);
            self.router_of(i).observe_output(f.id, out, now);
            self.release(f.id);
            self.done(i);
            if let (Some(g), true) = (self.workload.requests[i].group, self.last_turn[i]) {
                let now = self.now;
                if self.router_of(i).group_sample_finished(g, now) {
                    self.end_group(g);
                }
            }
        }
        if std::mem::take(&mut self.workers[w].abort_after_step) {
            self.abort_for_update(w);
        }
        if std::mem::take(&mut self.workers[w].move_after_step) {
            self.move_off(w);
        }
        if !out.tokens.is_empty() || !out.finished.is_empty() {
            self.poll_queue();
        }
        if !out.events.is_empty() && self.config.router.router_kv_events {
            if self.config.kv_event_delay_ms <= 0.0 {
                for r in self.all_routers() {
                    for e in &out.events {
                        let _ = r.apply_event(e);
                    }
                }
            } else {
                let at = self.now + ms(self.config.kv_event_delay_ms);
                self.queue.push(at, Event::Visible(out.events));
            }
        }
        let stats = self.workers[w].engine.stats();
        let kv = stats.used_blocks as f32 / stats.capacity_blocks.max(1) as f32;
        self.workers[w]
            .samples
            .push((self.now, stats.running as f32, kv));
        self.start_step(w)?;
        self.release_if_drained(w);
        Ok(())
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

    /// When the run ends: the last step's train phase and pause when the workload has a train
    /// phase (whole RL steps), else now.
    fn end(&self) -> Time {
        self.replay.steps_end().unwrap_or(self.now)
    }

    fn summary(&self) -> Summary {
        let end = self.end();
        let busy: Vec<Vec<(Time, Time)>> = self
            .workers
            .iter()
            .map(|w| {
                let mut b = w.busy.clone();
                if let Some(since) = w.busy_since {
                    b.push((since, end));
                }
                b
            })
            .collect();
        let samples: Vec<Vec<(Time, f32, f32)>> =
            self.workers.iter().map(|w| w.samples.clone()).collect();
        let provisioned: Vec<(Time, Time)> = match self.fleet {
            Some(_) => self
                .workers
                .iter()
                .map(|w| (w.provisioned.0, w.provisioned.1.unwrap_or(end)))
                .collect(),
            None => Vec::new(),
        };
        let builder = SummaryBuilder {
            config: &self.config,
            workload: self.workload,
            records: &self.records,
            busy: &busy,
            samples: &samples,
            provisioned: &provisioned,
            end,
        };
        let mut summary = builder.build();
        if let Some(mut fleet) = self.fleet_summary() {
            let start = self
                .records
                .iter()
                .filter_map(|r| r.arrival)
                .min()
                .unwrap_or(Time::ZERO);
            fleet.gpu_seconds = (builder.gpu_seconds(start, end) * 1e3).round() / 1e3;
            let span = end.since(start).as_secs_f64().max(1e-9);
            fleet.mean_workers = (fleet.gpu_seconds / span * 1e3).round() / 1e3;
            summary.fleet = Some(fleet);
        }
        summary
    }
}

#[cfg(test)]
mod continuation_tests;
