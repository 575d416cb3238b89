//! Tail consolidation (`--planner-migrate-tail N`): a worker the planner drains in an RL step's
//! tail hands its requests to the workers that stay instead of holding its GPU until its last
//! long sample ends. Each moved request is a migration as after a worker failure (its prompt and
//! the tokens generated so far are prefilled again on the target, placed by
//! `Router::route_continuation`), so it pays the same cost. The move waits for the worker's
//! current step to end (nothing it finishes is lost) and happens only when every request fits
//! on the serving workers within the fair share, the KV usage target and the decode slowdown
//! bound (`--planner-migrate-slowdown`; [`kvrouter_core::planner::migrate`]), and the worker
//! holds at most N requests.

use super::fleet::Lifecycle;
use super::{Event, Simulation};
use kvrouter_core::ids::{RequestId, WorkerId, WorkerRank};
use kvrouter_core::planner::migrate::{blocks_within, decode_ms, place_moves, Holding, Load};
use kvrouter_core::planner::StepPhase;

impl Simulation<'_> {
    /// At a planner tick in an RL tail: draining workers holding at most the limit are marked
    /// to move their requests when their current step ends.
    pub(super) fn mark_tail_moves(&mut self) {
        let Some(f) = self.fleet.as_mut() else {
            return;
        };
        if f.last.as_ref().is_some_and(|r| r.phase == StepPhase::Idle) {
            // A new step's tail starts with fresh references.
            f.reference.clear();
        }
        let in_tail = f.last.as_ref().is_some_and(|r| r.phase == StepPhase::Tail);
        if f.migrate_tail == 0 || !in_tail || self.router.queue_stats().pending_requests > 0 {
            return;
        }
        let limit = f.migrate_tail;
        for w in 0..self.workers.len() {
            let n = self.load_of(w);
            // A worker that took moved requests drains in place (a request moves once).
            let received = self
                .fleet
                .as_ref()
                .is_some_and(|f| f.reference.contains_key(&w));
            let worker = &mut self.workers[w];
            if worker.lifecycle == Lifecycle::Draining && n > 0 && n <= limit && !received {
                worker.move_after_step = true;
            }
        }
    }

    fn load_of(&self, w: usize) -> u32 {
        self.router
            .load(WorkerRank::new(WorkerId(w as u64), 0))
            .active_requests
    }

    /// KV blocks a request holds once continued: its prompt and the tokens generated so far.
    fn blocks_of(&self, i: usize, generated: u32) -> u64 {
        let bs = self.config.router.kv_cache_block_size as u64;
        let tokens = u64::from(self.workload.requests[i].input_tokens)
            + u64::from(self.records[i].carried)
            + u64::from(generated);
        tokens.div_ceil(bs.max(1))
    }

    /// After worker `w`'s step: its requests move if they all fit; otherwise it keeps draining.
    pub(super) fn move_off(&mut self, w: usize) {
        if self.workers[w].lifecycle != Lifecycle::Draining {
            return;
        }
        // Its requests as the router and the engine both know them (none on its way to it).
        let ids: Vec<usize> = self
            .router
            .ledger()
            .active_ids()
            .iter()
            .map(|id| id.0 as usize)
            .filter(|i| self.records[*i].worker == Some(w))
            .collect();
        let engine = &self.workers[w].engine;
        let stats = engine.stats();
        if ids.is_empty()
            || ids.len() != stats.running + stats.waiting
            || ids
                .iter()
                .any(|i| engine.generated(RequestId(*i as u64)).is_none())
        {
            return;
        }
        let moved: Vec<u64> = ids
            .iter()
            .map(|i| {
                let generated = engine.generated(RequestId(*i as u64)).unwrap_or(0);
                self.blocks_of(*i, generated)
            })
            .collect();
        let Some(f) = self.fleet.as_ref() else {
            return;
        };
        let e = &self.config.engine;
        let max_requests = f
            .requests_per_worker
            .min(u32::try_from(e.max_num_seqs).unwrap_or(u32::MAX));
        let capacity = e.num_gpu_blocks as u64;
        let kv_cap = (capacity as f64 * f.kv_usage_target).floor() as u64;
        let bs = self.config.router.kv_cache_block_size as u64;
        let source = Load {
            blocks: stats.used_blocks as u64,
            requests: ids.len() as u64,
        };
        let source_ms = decode_ms(self.workers[w].timing.as_ref(), bs, capacity, source);
        let targets: Vec<usize> = (0..self.workers.len())
            .filter(|t| self.workers[*t].lifecycle == Lifecycle::Serving)
            .collect();
        let (holding, holding_ms): (Vec<Holding>, Vec<f64>) = targets
            .iter()
            .map(|t| {
                let load = Load {
                    blocks: self.workers[*t].engine.stats().used_blocks as u64
                        + f.incoming
                            .values()
                            .filter(|(to, _)| to == t)
                            .map(|(_, b)| b)
                            .sum::<u64>(),
                    requests: u64::from(self.load_of(*t)),
                };
                let model = self.workers[*t].timing.as_ref();
                let own = decode_ms(model, bs, capacity, load);
                let reference = f.reference.get(t).copied().unwrap_or(own).max(source_ms);
                let max_blocks = blocks_within(
                    model,
                    bs,
                    capacity,
                    kv_cap,
                    load,
                    source.requests,
                    reference * (1.0 + f.migrate_slowdown),
                );
                let holding = Holding {
                    requests: load.requests as u32,
                    blocks: load.blocks,
                    max_blocks,
                };
                (holding, own)
            })
            .unzip();
        let Some(plan) = place_moves(&holding, &moved, max_requests) else {
            return;
        };
        // Each target's reference: its decode time before its first move, fixed for the tail.
        if let Some(f) = self.fleet.as_mut() {
            for k in &plan {
                f.reference.entry(targets[*k]).or_insert(holding_ms[*k]);
            }
        }
        // The worker is released now; its requests continue on their targets.
        let now = self.now;
        let worker = &mut self.workers[w];
        worker.pending = None;
        if let Some(since) = worker.busy_since.take() {
            worker.busy.push((since, now));
        }
        let drained = worker.engine.drain();
        worker.lifecycle = Lifecycle::Removed;
        worker.provisioned.1 = Some(now);
        worker.dead = true;
        for (id, generated) in drained {
            let i = id.0 as usize;
            let k = ids.iter().position(|x| *x == i).expect("planned");
            let blocks = self.blocks_of(i, generated);
            self.release(id);
            let rec = &mut self.records[i];
            rec.migrations += 1;
            rec.carried += generated;
            if let Some(f) = self.fleet.as_mut() {
                f.incoming.insert(i, (targets[plan[k]], blocks));
                f.tail_moves += 1;
            }
            self.queue.push(now, Event::Continue(i));
        }
    }

    /// The target a moved request was planned for (none: not moved by the planner).
    pub(super) fn planned_target(&self, i: usize) -> Option<WorkerId> {
        let f = self.fleet.as_ref()?;
        f.incoming.get(&i).map(|(t, _)| WorkerId(*t as u64))
    }

    /// A moved request started on its target (first token) or ended: no longer on its way.
    pub(super) fn arrived(&mut self, i: usize) {
        if let Some(f) = self.fleet.as_mut() {
            f.incoming.remove(&i);
        }
    }
}
