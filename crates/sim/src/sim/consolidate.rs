//! Tail consolidation (`--planner-migrate-tail N`): a worker the planner drains in an RL step's
//! tail hands its requests to the workers that stay instead of holding its GPU until its last
//! long sample ends. Each moved request is a migration as after a worker failure (its prompt and
//! the tokens generated so far are prefilled again on the target, placed by
//! `Router::route_continuation`), so it pays the same cost. The move waits for the worker's
//! current step to end (nothing it finishes is lost) and happens only when every request fits
//! on the serving workers (or the draining ones that hold more KV) within the fair share, the
//! KV usage target, the KV its requests could reach (no preemption) and the delay bound
//! (`--planner-migrate-slowdown`; [`kvrouter_core::planner::migrate`]), and the worker holds
//! at most N requests.

use super::fleet::Lifecycle;
use super::{Event, Simulation};
use kvrouter_core::ids::{RequestId, WorkerId, WorkerRank};
use kvrouter_core::planner::migrate::{
    blocks_within, decode_ms, delay_bound_ms, place_moves, Affected, Holding, Load,
};
use kvrouter_core::planner::StepPhase;

impl Simulation<'_> {
    /// At a planner tick in an RL tail: draining workers holding at most the limit are marked
    /// to move their requests when their current step ends.
    pub(super) fn mark_tail_moves(&mut self) {
        let Some(f) = self.fleet.as_mut() else {
            return;
        };
        if f.last.as_ref().is_some_and(|r| r.phase == StepPhase::Idle) {
            // A new step's tail starts afresh.
            f.received.clear();
            f.committed.clear();
        }
        let in_tail = f.last.as_ref().is_some_and(|r| r.phase == StepPhase::Tail);
        if f.migrate_tail == 0 || !in_tail || self.router.queue_stats().pending_requests > 0 {
            return;
        }
        let limit = f.migrate_tail;
        for w in 0..self.workers.len() {
            let n = self.load_of(w);
            // A worker that took moved requests drains in place (a request moves once).
            let received = self.fleet.as_ref().is_some_and(|f| f.received.contains(&w));
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

    /// The requests a worker holds as the router and its engine both know them (none on its way
    /// to it): (request, tokens generated on it); none when they disagree.
    fn held_by(&self, w: usize) -> Option<Vec<(usize, u32)>> {
        let engine = &self.workers[w].engine;
        let stats = engine.stats();
        let ids: Vec<usize> = self
            .router
            .ledger()
            .active_ids()
            .iter()
            .map(|id| id.0 as usize)
            .filter(|i| self.records[*i].worker == Some(w))
            .collect();
        if ids.len() != stats.running + stats.waiting {
            return None;
        }
        ids.into_iter()
            .map(|i| Some((i, engine.generated(RequestId(i as u64))?)))
            .collect()
    }

    /// KV blocks request `i` would hold at its last token, were it to generate `max_output`.
    fn worst_blocks(&self, i: usize, max_output: u32) -> u64 {
        let bs = self.config.router.kv_cache_block_size as u64;
        let tokens = u64::from(self.workload.requests[i].input_tokens)
            + u64::from(max_output.max(self.records[i].carried));
        tokens.div_ceil(bs.max(1))
    }

    /// What a move would delay: request `i` with `generated` tokens on its current worker.
    fn affected(&self, i: usize, generated: u32, max_output: u32) -> Affected {
        let has = self.records[i].carried + generated;
        let committed = self
            .fleet
            .as_ref()
            .and_then(|f| f.committed.get(&i).copied())
            .unwrap_or((0.0, 0.0));
        Affected {
            remaining_tokens: u64::from(max_output.saturating_sub(has)),
            age_ms: self.records[i]
                .arrival
                .map_or(0.0, |a| self.now.since(a).as_secs_f64() * 1e3),
            committed_ms: committed.0,
            committed_step_ms: committed.1,
        }
    }

    /// After worker `w`'s step: its requests move if they all fit; otherwise it keeps draining.
    ///
    /// Targets: the serving workers and the draining ones that hold more KV (so the lightest
    /// drain into the heaviest). Each target's room: the fair share, the KV usage target, and
    /// the delay bound ([`delay_bound_ms`]) of its own requests (slowed by the larger KV read
    /// and stalled by the moved requests' prefills) and of the moved ones (from the source's
    /// decode step to the target's), as if each generated the most tokens any request of the
    /// workload may (the stand-in for the `max_tokens` a trainer sets for all its samples).
    pub(super) fn move_off(&mut self, w: usize) {
        let received = self.fleet.as_ref().is_some_and(|f| f.received.contains(&w));
        if self.workers[w].lifecycle != Lifecycle::Draining || received {
            return;
        }
        let Some(held) = self.held_by(w).filter(|h| !h.is_empty()) else {
            return;
        };
        let max_output = self
            .workload
            .requests
            .iter()
            .map(|r| r.output_tokens)
            .max()
            .unwrap_or(0);
        let moved: Vec<u64> = held.iter().map(|(i, g)| self.blocks_of(*i, *g)).collect();
        let moving: Vec<Affected> = held
            .iter()
            .map(|(i, g)| self.affected(*i, *g, max_output))
            .collect();
        let worst_moved = held
            .iter()
            .map(|(i, _)| self.worst_blocks(*i, max_output))
            .max()
            .unwrap_or(0);
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
        let slowdown = f.migrate_slowdown;
        let own_blocks = self.workers[w].engine.stats().used_blocks as u64;
        let source_ms = decode_ms(
            self.workers[w].timing.as_ref(),
            bs,
            capacity,
            Load {
                blocks: own_blocks,
                requests: held.len() as u64,
            },
        );
        // Every moved request's prefill stalls a target's decodes (counted whole on each).
        let stall_ms: f64 = moved
            .iter()
            .map(|b| {
                self.workers[w]
                    .timing
                    .prefill_ms(b * bs)
                    .unwrap_or(f64::INFINITY)
            })
            .sum();
        let targets: Vec<usize> = (0..self.workers.len())
            .filter(|t| match self.workers[*t].lifecycle {
                Lifecycle::Serving => true,
                Lifecycle::Draining => {
                    let b = self.workers[*t].engine.stats().used_blocks as u64;
                    *t != w && (b, *t) > (own_blocks, w)
                }
                _ => false,
            })
            .collect();
        let mut plans = Vec::with_capacity(targets.len());
        for t in &targets {
            let Some(own) = self.held_by(*t) else {
                plans.push(None);
                continue;
            };
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
            let own_ms = decode_ms(model, bs, capacity, load);
            let affected: Vec<Affected> = own
                .iter()
                .map(|(i, g)| self.affected(*i, *g, max_output))
                .collect();
            let bound = delay_bound_ms(own_ms, &affected, stall_ms, slowdown)
                .min(delay_bound_ms(source_ms, &moving, stall_ms, slowdown));
            let max_blocks =
                blocks_within(model, bs, capacity, kv_cap, load, held.len() as u64, bound);
            // No move risks a preemption: the KV its requests would hold at their last tokens
            // (own, on their way, moved) stays within the capacity; the requests it may still
            // take are counted into its requests (the fair share's count then stops it).
            let on_way = f.incoming.values().filter(|(to, _)| to == t).count() as u64;
            let worst_own: u64 = own
                .iter()
                .map(|(i, _)| self.worst_blocks(*i, max_output))
                .sum::<u64>()
                + on_way * worst_moved;
            let slots = capacity.saturating_sub(worst_own) / worst_moved.max(1);
            let taken = u64::from(max_requests).saturating_sub(slots);
            plans.push(Some((
                Holding {
                    requests: (load.requests.max(taken)) as u32,
                    blocks: load.blocks,
                    max_blocks,
                },
                load,
                own,
            )));
        }
        // Targets that could not be read take nothing.
        let holding: Vec<Holding> = plans
            .iter()
            .map(|p| {
                p.as_ref().map_or(
                    Holding {
                        requests: u32::MAX,
                        blocks: u64::MAX,
                        max_blocks: 0,
                    },
                    |(h, _, _)| *h,
                )
            })
            .collect();
        let Some(plan) = place_moves(&holding, &moved, max_requests) else {
            return;
        };
        // Commit each affected request's stall and added decode step time: a target's own by
        // its slower step, a moved one by the step it goes to over its source's.
        let mut delays: Vec<(usize, f64)> = Vec::new();
        for (k, t) in targets.iter().enumerate() {
            let Some((_, load, own)) = &plans[k] else {
                continue;
            };
            let into: Vec<usize> = (0..held.len()).filter(|j| plan[*j] == k).collect();
            if into.is_empty() {
                continue;
            }
            let model = self.workers[*t].timing.as_ref();
            let before = decode_ms(model, bs, capacity, *load);
            let after = decode_ms(
                model,
                bs,
                capacity,
                Load {
                    blocks: load.blocks + into.iter().map(|j| moved[*j]).sum::<u64>(),
                    requests: load.requests + into.len() as u64,
                },
            );
            delays.extend(own.iter().map(|(i, _)| (*i, (after - before).max(0.0))));
            delays.extend(
                into.iter()
                    .map(|j| (held[*j].0, (after - source_ms).max(0.0))),
            );
        }
        if let Some(f) = self.fleet.as_mut() {
            for (i, step_ms) in delays {
                let c = f.committed.entry(i).or_insert((0.0, 0.0));
                c.0 += stall_ms;
                c.1 += step_ms;
            }
            for k in &plan {
                f.received.insert(targets[*k]);
            }
        }
        let ids: Vec<usize> = held.iter().map(|(i, _)| *i).collect();
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
