//! Setting a simulation up: validation, workers, router replicas, and the initial events
//! (arrivals, failures, the first planner tick).

use super::worker::{new_worker, profiles_of};
use super::{fleet, ms, Event, SimError, Simulation};
use crate::config::SimConfig;
use crate::queue::EventQueue;
use crate::summary::Record;
use kvrouter_core::ids::{ReplicaId, WorkerId};
use kvrouter_core::router::Router;
use kvrouter_core::time::Time;
use kvrouter_workload::replay::Replay;
use kvrouter_workload::Workload;

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
            if sim.config.duration_ms.is_some() {
                // Its ticks run until every request is done; a cut one never is.
                return Err(SimError::Config(
                    "the planner runs the whole workload: no --duration-s".into(),
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
}
