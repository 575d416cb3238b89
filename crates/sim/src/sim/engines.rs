//! The engine side of the event loop: deliveries, engine steps and what their outcomes mean
//! for records, the router and the queue, and worker deaths.

use super::{ms, Event, SimError, Simulation};
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::time::Time;
use kvrouter_engine::{EngineRequest, Prompt};

impl Simulation<'_> {
    /// A worker dies: out of the eligible set at once; its requests migrate or fail.
    pub(super) fn worker_dies(&mut self, w: usize) {
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

    pub(super) fn deliver(&mut self, i: usize, w: usize) -> Result<(), SimError> {
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

    pub(super) fn start_step(&mut self, w: usize) -> Result<(), SimError> {
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

    pub(super) fn step_end(&mut self, w: usize) -> Result<(), SimError> {
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
}
