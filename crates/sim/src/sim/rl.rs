//! The RL controls in the simulation: first-N-of-M endings and the router's weight-update cycle
//! carried out on the simulated engines.

use super::{ms, Event, SimError, Simulation};
use kvrouter_core::ids::{RequestId, WorkerId};

impl Simulation<'_> {
    /// Ends every unfinished sample of a group that has enough (first-N-of-M).
    pub(super) fn end_group(&mut self, group: u64) {
        let members = self.group_members.get(&group).cloned().unwrap_or_default();
        for i in members {
            let rec = &self.records[i];
            if rec.finish.is_some() || rec.rejected || rec.arrival.is_none() {
                // Done, or not arrived yet (it is ended when it arrives).
                continue;
            }
            let (id, worker) = (RequestId(i as u64), rec.worker);
            if !self.router_of(i).cancel_queued(id) {
                if let Some(w) = worker {
                    let engine = &mut self.workers[w].engine;
                    let generated = engine.generated(id).unwrap_or(0);
                    engine.cancel(id);
                    self.records[i].output_tokens = self.records[i].carried + generated;
                }
                self.release(id);
            }
            self.end_early(i);
        }
    }

    /// Request `i` ends now without finishing its budget: its group has enough samples.
    pub(super) fn end_early(&mut self, i: usize) {
        let rec = &mut self.records[i];
        rec.arrival.get_or_insert(self.now);
        rec.finish = Some(self.now);
        rec.ended_early = true;
        self.done(i);
    }

    /// Starts the update to `version`, or queues it behind a running one.
    pub(super) fn begin_update(&mut self, version: u64) {
        let Some(u) = self.config.weight_update.clone() else {
            return;
        };
        let plan = kvrouter_core::router::UpdatePlan {
            version,
            mode: u.mode,
            batch: u.batch,
            workers: Some(
                (0..self.workers.len())
                    .filter(|w| !self.workers[*w].dead)
                    .map(|w| WorkerId(w as u64))
                    .collect(),
            ),
        };
        match self.router.begin_update(plan, self.now) {
            Ok(actions) => self.carry_out(actions),
            Err(kvrouter_core::router::UpdateError::InProgress(_)) => {
                self.pending_versions.push_back(version);
            }
            Err(_) => {}
        }
    }

    /// The engine side of the router's update actions.
    pub(super) fn carry_out(&mut self, actions: Vec<kvrouter_core::router::UpdateAction>) {
        use kvrouter_core::router::UpdateAction;
        let load_ms = self
            .config
            .weight_update
            .as_ref()
            .map_or(0.0, |u| u.load_ms);
        for action in actions {
            match action {
                UpdateAction::Abort(w) => {
                    let w = w.0 as usize;
                    if self.workers[w].pending.is_some() {
                        // Engines abort between steps.
                        self.workers[w].abort_after_step = true;
                    } else {
                        self.abort_for_update(w);
                    }
                }
                UpdateAction::Load { worker, .. } => {
                    let done = self.now + ms(load_ms);
                    self.update_spans.push((worker.0 as usize, self.now, done));
                    self.queue.push(done, Event::Loaded(worker.0 as usize));
                }
            }
        }
    }

    /// Aborts a worker's requests for a weight update: each keeps what it generated and is
    /// continued on the new policy (its context is computed again).
    pub(super) fn abort_for_update(&mut self, w: usize) {
        let aborted = self.workers[w].engine.abort_all();
        for f in aborted {
            let i = f.id.0 as usize;
            let rec = &mut self.records[i];
            rec.carried += f.output_tokens;
            rec.update_aborts += 1;
            rec.recomputed_tokens +=
                u64::from(self.workload.requests[i].input_tokens) + u64::from(rec.carried);
            self.queue.push(self.now, Event::Resume(i));
            self.release(f.id);
        }
    }

    /// A worker loaded new weights: its cache is flushed unless KV is retained, and it serves.
    pub(super) fn loaded(&mut self, w: usize) -> Result<(), SimError> {
        use kvrouter_core::router::KvRetention;
        if self.config.router.kv_retention == KvRetention::Flush {
            self.workers[w].engine.clear_cache();
            // The other replicas see the engine's cleared cache in its KV events.
            for r in &mut self.replicas {
                r.clear_worker_cache(WorkerId(w as u64));
            }
        }
        let actions = self
            .router
            .update_loaded(WorkerId(w as u64), true, self.now)
            .unwrap_or_default();
        self.carry_out(actions);
        if self
            .router
            .update_status()
            .is_some_and(|s| s.finished.is_some())
        {
            if let Some(v) = self.pending_versions.pop_front() {
                self.begin_update(v);
            }
        }
        self.poll_queue();
        if self.workers[w].pending.is_none() {
            self.start_step(w)?;
        }
        Ok(())
    }

    /// Request `i` of an RL step is over: the step's last one starts the update to the next
    /// policy version (the trainer turns step s into policy s + 1).
    pub(super) fn step_done(&mut self, i: usize) {
        let Some(step) = self.workload.requests[i].step else {
            return;
        };
        if let Some(left) = self.step_left.get_mut(&step) {
            *left = left.saturating_sub(1);
            if *left == 0 {
                self.begin_update(u64::from(step) + 1);
            }
        }
    }
}
