//! The global simulation loop: clients and the global router in one place, each datacenter a
//! local router and engines behind a network delay; the global router sees each datacenter
//! only through the summaries it publishes every refresh period.

use super::config::GlobalSimConfig;
use super::dc::Dc;
use super::replay::StepReplay;
use super::summary::{GlobalRecord, GlobalSummary, SketchCheck};
use crate::queue::EventQueue;
use crate::sim::SimError;
use kvrouter_core::global::{ClusterId, ClusterSpec, ClusterSummary, GlobalRequest, GlobalRouter};
use kvrouter_core::ids::RequestId;
use kvrouter_core::router::{Admission, Decision, Effects, RouteRequest};
use kvrouter_core::time::millis_f64 as ms;
use kvrouter_core::time::Time;
use kvrouter_engine::{EngineRequest, Prompt};
use kvrouter_workload::Workload;
use std::time::Duration;

enum Event {
    /// Request i reaches the global router.
    Arrive(usize),
    /// Request i reaches datacenter d's local router.
    AtDc(usize, usize),
    /// A worker's step ends (datacenter, worker).
    StepEnd(usize, usize),
    /// KV events reach a datacenter's local router.
    Visible(usize, Vec<kvrouter_core::event::KvEvent>),
    /// A datacenter builds and sends its summary.
    Publish(usize),
    /// A summary reaches the global router.
    SummaryArrives(usize, Box<ClusterSummary>),
    /// Request i's last token reaches its client.
    Done(usize),
}

/// How long a request waits for a fresh summary before the client gives up on it, seconds.
const MAX_SUMMARY_WAIT_S: u64 = 86_400;

/// A global simulation in progress.
pub struct GlobalSimulation<'w> {
    config: GlobalSimConfig,
    workload: &'w Workload,
    global: GlobalRouter,
    dcs: Vec<Dc>,
    queue: EventQueue<Event>,
    now: Time,
    records: Vec<GlobalRecord>,
    replay: StepReplay,
    sketch_checks: Vec<SketchCheck>,
    summary_bytes: Vec<usize>,
    finished: usize,
    /// `Publish` and `SummaryArrives` events in `queue`: when they are all it holds, nothing
    /// can happen any more (see `publish`).
    summary_events: usize,
}

impl<'w> GlobalSimulation<'w> {
    /// Sets up datacenters, the global router and the first arrivals.
    pub fn new(config: GlobalSimConfig, workload: &'w Workload) -> Result<Self, SimError> {
        config.clusters.validate().map_err(SimError::Config)?;
        let bs = config.router.kv_cache_block_size;
        workload.validate(bs).map_err(SimError::Workload)?;
        let mut global = GlobalRouter::new(config.clusters.global_config(config.policy), bs as u32)
            .map_err(|e| SimError::Config(e.to_string()))?;
        let mut dcs = Vec::new();
        for entry in &config.clusters.clusters {
            global
                .add_cluster(ClusterSpec {
                    name: entry.name.clone(),
                    rtt_ms: 2.0 * entry.network_delay_ms,
                    weight: entry.weight.unwrap_or(entry.workers as f64),
                })
                .map_err(|e| SimError::Config(e.to_string()))?;
            dcs.push(Dc::new(entry, &config)?);
        }
        let (replay, starts) = StepReplay::new(workload, config.sessions_in_flight);
        let mut sim = Self {
            records: vec![GlobalRecord::default(); workload.requests.len()],
            config,
            workload,
            global,
            dcs,
            queue: EventQueue::new(),
            now: Time::ZERO,
            replay,
            sketch_checks: Vec::new(),
            summary_bytes: Vec::new(),
            finished: 0,
            summary_events: 0,
        };
        // Every datacenter publishes at t = 0 (its first summary arrives after its delay);
        // requests start 1 ms after every first summary has arrived.
        let mut first = Time::ZERO;
        for d in 0..sim.dcs.len() {
            sim.queue.push(Time::ZERO, Event::Publish(d));
            sim.summary_events += 1;
            first = first.max(Time::ZERO + sim.dcs[d].delay);
        }
        let first = first + Duration::from_millis(1);
        for (at, i) in starts {
            sim.queue
                .push(first + at.since(Time::ZERO), Event::Arrive(i));
        }
        Ok(sim)
    }

    /// Requests finished so far, and the total.
    pub fn progress(&self) -> (usize, usize) {
        (self.finished, self.workload.requests.len())
    }

    /// Simulated time.
    pub fn now(&self) -> Time {
        self.now
    }

    /// Datacenter `d`'s local router (what it has learned so far), for inspection.
    pub fn local_router(&self, d: usize) -> Option<&kvrouter_core::router::Router> {
        self.dcs.get(d).map(|dc| &dc.router)
    }

    /// Processes the next event; false when none is left.
    pub fn step(&mut self) -> Result<bool, SimError> {
        let Some((at, event)) = self.queue.pop() else {
            return Ok(false);
        };
        self.now = at;
        if matches!(event, Event::Publish(_) | Event::SummaryArrives(..)) {
            self.summary_events -= 1;
        }
        match event {
            Event::Arrive(i) => self.arrive(i),
            Event::AtDc(i, d) => self.at_dc(i, d)?,
            Event::StepEnd(d, w) => self.step_end(d, w)?,
            Event::Visible(d, events) => {
                for e in &events {
                    let _ = self.dcs[d].router.apply_event(e);
                }
            }
            Event::Publish(d) => self.publish(d)?,
            Event::SummaryArrives(d, s) => {
                let _ = self
                    .global
                    .update_summary(ClusterId(d as u32), *s, self.now);
            }
            Event::Done(i) => self.done(i),
        }
        Ok(true)
    }

    /// Runs to completion and summarises; an error if requests are left that nothing can
    /// finish any more (a defect of the simulation, reported rather than run forever).
    pub fn run(mut self) -> Result<GlobalSummary, SimError> {
        while self.step()? {}
        let total = self.workload.requests.len();
        if self.finished < total {
            return Err(SimError::Workload(format!(
                "{} of {total} requests never finished: nothing was left to run at {:.3} s",
                total - self.finished,
                self.now.as_secs_f64()
            )));
        }
        Ok(self.summary())
    }

    fn blocks(&self, i: usize) -> kvrouter_core::hashing::BlockHashes {
        self.workload
            .router_blocks(i, self.config.router.kv_cache_block_size)
    }

    fn arrive(&mut self, i: usize) {
        let req = &self.workload.requests[i];
        let blocks = self.blocks(i);
        let request = GlobalRequest {
            session: req.session,
            blocks: &blocks.sequence,
            input_tokens: u64::from(req.input_tokens),
            // What the client tells the global router (`[global] output_hint`).
            output_tokens_hint: self
                .config
                .clusters
                .global
                .output_hint
                .for_request(req.output_tokens),
            // Every simulated cluster serves the workload's one model.
            model: None,
        };
        let rec = &mut self.records[i];
        // A retry keeps the first arrival: the wait for a fresh summary is the request's time.
        let arrival = *rec.arrival.get_or_insert(self.now);
        match self.global.route(&request, self.now) {
            Ok(decision) => {
                let d = decision.cluster.0 as usize;
                rec.dc = Some(d);
                rec.moved = decision.moved_from.is_some();
                rec.estimated_cached_blocks = decision.chosen().cached_blocks;
                self.dcs[d].recent.push(blocks.sequence);
                self.queue
                    .push(self.now + self.dcs[d].delay, Event::AtDc(i, d));
            }
            Err(_) => {
                // No datacenter has a fresh summary: the client retries after a refresh, for at
                // most a day, then gives up (refused, as a router's queue bound refuses).
                rec.summary_retries += 1;
                if self.now.since(arrival) >= std::time::Duration::from_secs(MAX_SUMMARY_WAIT_S) {
                    self.rejected(i);
                    return;
                }
                let retry = ms(self.config.clusters.global.summary_refresh_ms);
                self.queue.push(self.now + retry, Event::Arrive(i));
            }
        }
    }

    fn at_dc(&mut self, i: usize, d: usize) -> Result<(), SimError> {
        let req = &self.workload.requests[i];
        let blocks = self.blocks(i);
        self.records[i].actual_cached_blocks = self.dcs[d].exact_prefix_blocks(&blocks.sequence);
        let mut route = RouteRequest::new(RequestId(i as u64), u64::from(req.input_tokens), blocks);
        // What a client sends as x-session-id and x-kvrouter-group-id, as in `kvrouter sim`.
        route.session = req.session;
        route.group = req.group;
        route.max_output_tokens = Some(u64::from(req.output_tokens));
        match self.dcs[d].router.submit(route, self.now) {
            Ok(Admission::Dispatched(decision)) => self.deliver(i, d, &decision),
            Ok(Admission::Queued) => Ok(()),
            Err(e) => Err(SimError::Config(format!("cluster {d}: {e}"))),
        }
    }

    fn deliver(&mut self, i: usize, d: usize, decision: &Decision) -> Result<(), SimError> {
        let w = decision.rank.worker.0 as usize;
        let req = &self.workload.requests[i];
        let er = EngineRequest {
            id: RequestId(i as u64),
            prompt: Prompt::Blocks {
                blocks: self.blocks(i),
                len_tokens: req.input_tokens,
            },
            max_output_tokens: req.output_tokens.max(1),
        };
        self.records[i].worker = Some(w);
        if self.dcs[d].workers[w].engine.add_request(er).is_err() {
            return Err(SimError::Workload(format!(
                "request {i} does not fit an engine"
            )));
        }
        if self.dcs[d].workers[w].pending.is_none() {
            self.start_step(d, w)?;
        }
        Ok(())
    }

    fn start_step(&mut self, d: usize, w: usize) -> Result<(), SimError> {
        let now = self.now;
        let worker = &mut self.dcs[d].workers[w];
        // One step at a time: a second would replace the first, whose requests would be lost.
        debug_assert!(
            worker.pending.is_none(),
            "datacenter {d} worker {w}: a step started over the one in progress"
        );
        match worker
            .engine
            .step(now)
            .map_err(|e| SimError::Timing(e.to_string()))?
        {
            Some(out) => {
                let end = out.end.max(Time(now.0 + 1));
                worker.busy_since.get_or_insert(now);
                worker.pending = Some(out);
                self.queue.push(end, Event::StepEnd(d, w));
            }
            None => {
                if let Some(since) = worker.busy_since.take() {
                    worker.busy.push((since, now));
                }
            }
        }
        Ok(())
    }

    fn step_end(&mut self, d: usize, w: usize) -> Result<(), SimError> {
        let Some(out) = self.dcs[d].workers[w].pending.take() else {
            return Ok(());
        };
        let back = self.now + self.dcs[d].delay;
        for t in &out.tokens {
            if t.index == 0 {
                self.records[t.id.0 as usize]
                    .first_token
                    .get_or_insert(back);
                let _ = self.dcs[d].router.first_token(t.id);
                // What `kvrouter serve` reports at the first token (the cost policy's fit);
                // the local router sits beside its engines.
                self.dcs[d].router.observe_first_token(t.id, self.now);
            }
        }
        for f in &out.finished {
            let i = f.id.0 as usize;
            self.records[i].cached_tokens = u64::from(f.cached_tokens);
            self.records[i].output_tokens = u64::from(f.output_tokens);
            // The response's usage, as `kvrouter serve` reports it before the finish.
            self.dcs[d]
                .router
                .observe_output(f.id, u64::from(f.output_tokens), self.now);
            if let Ok(effects) = self.dcs[d].router.finish(f.id, self.now) {
                self.apply(d, effects)?;
            }
            self.queue.push(back, Event::Done(i));
        }
        if !out.tokens.is_empty() {
            let placed = self.dcs[d].router.poll(self.now);
            self.apply(
                d,
                Effects {
                    placed,
                    update: Vec::new(),
                },
            )?;
        }
        if !out.events.is_empty() {
            let at = self.now + ms(self.config.kv_event_delay_ms);
            self.queue.push(at, Event::Visible(d, out.events));
        }
        // A request the releases above placed on this worker has started its next step
        // already (`deliver`); a second one would overwrite that step and lose its requests.
        if self.dcs[d].workers[w].pending.is_some() {
            return Ok(());
        }
        self.start_step(d, w)
    }

    fn apply(&mut self, d: usize, effects: Effects) -> Result<(), SimError> {
        for (id, placed) in effects.placed {
            match placed {
                Ok(decision) => self.deliver(id.0 as usize, d, &decision)?,
                // Given up in the queue: its client gets the error, and the rollout goes on
                // (as `kvrouter sim` counts a rejected request done).
                Err(_) => self.rejected(id.0 as usize),
            }
        }
        Ok(())
    }

    /// Request `i` was refused by its datacenter's router: no tokens, no finish time.
    fn rejected(&mut self, i: usize) {
        self.records[i].rejected = true;
        self.ended(i);
    }

    fn publish(&mut self, d: usize) -> Result<(), SimError> {
        let summary = self.dcs[d].summary(self.now)?;
        self.summary_bytes.push(summary.encoded_len());
        // The error the sketch alone causes: this summary against this index, on the prompts
        // routed here since the last one.
        for blocks in std::mem::take(&mut self.dcs[d].recent) {
            self.sketch_checks.push(SketchCheck {
                prompt_blocks: blocks.len() as u64,
                exact_blocks: self.dcs[d].exact_prefix_blocks(&blocks),
                sketch_blocks: summary.cached_prefix_blocks(&blocks) as u64,
            });
        }
        let dc = &self.dcs[d];
        self.queue.push(
            self.now + dc.delay,
            Event::SummaryArrives(d, Box::new(summary)),
        );
        self.summary_events += 1;
        // Summaries go on while anything else can still happen: with only summaries left, no
        // request can arrive, run or finish any more, and publishing forever would never end.
        let others = self.queue.len() - self.summary_events;
        if self.finished < self.workload.requests.len() && others > 0 {
            self.queue.push(self.now + dc.refresh, Event::Publish(d));
            self.summary_events += 1;
        }
        Ok(())
    }

    fn done(&mut self, i: usize) {
        self.records[i].finish = Some(self.now);
        // The response's usage: the global router learns the output length per cluster.
        if let Some(d) = self.records[i].dc {
            let _ = self
                .global
                .record_output(ClusterId(d as u32), self.records[i].output_tokens);
        }
        self.ended(i);
    }

    /// Request `i` ended (served or refused): the rollout's next turn or the step's next
    /// rollouts start.
    fn ended(&mut self, i: usize) {
        self.finished += 1;
        let out = self.replay.finished(self.workload, i, self.now);
        if let (true, Some(s)) = (out.session_ended, self.workload.requests[i].session) {
            self.global.end_session(s);
        }
        for (at, f) in out.start {
            self.queue.push(at, Event::Arrive(f));
        }
    }

    fn summary(&self) -> GlobalSummary {
        GlobalSummary::build(super::summary::Inputs {
            config: &self.config,
            workload: self.workload,
            records: &self.records,
            dcs: &self.dcs,
            steps: self.replay.steps(),
            sketch_checks: &self.sketch_checks,
            summary_bytes: &self.summary_bytes,
            end: self.now,
        })
    }
}
