//! A simulated worker: its engine, its busy time and samples, its place in the planner's fleet,
//! and how one is provisioned.

use super::fleet;
use super::SimError;
use crate::config::SimConfig;
use kvrouter_core::ids::{WorkerId, WorkerRank};
use kvrouter_core::router::WorkerSpec;
use kvrouter_core::time::Time;
use kvrouter_engine::{Engine, StepOutcome};

pub(super) struct WorkerState {
    pub(super) engine: Engine,
    pub(super) pending: Option<StepOutcome>,
    pub(super) busy_since: Option<Time>,
    pub(super) busy: Vec<(Time, Time)>,
    /// (time, running requests, KV usage) after each step.
    pub(super) samples: Vec<(Time, f32, f32)>,
    pub(super) dead: bool,
    /// A weight update aborts its requests when its current step ends.
    pub(super) abort_after_step: bool,
    /// The planner moves its requests elsewhere when its current step ends (tail
    /// consolidation).
    pub(super) move_after_step: bool,
    /// Its timing model (tail consolidation bounds a target's decode slowdown with it).
    pub(super) timing: std::sync::Arc<dyn kvrouter_engine::TimingModel>,
    /// Starting, serving, draining or removed (the planner's fleet; always serving without).
    pub(super) lifecycle: fleet::Lifecycle,
    /// When it was provisioned (GPU time counts from here) and released.
    pub(super) provisioned: (Time, Option<Time>),
}

pub(super) fn profiles_of(config: &SimConfig) -> Vec<String> {
    if config.profiles.is_empty() {
        vec!["dynamo-poly".to_owned()]
    } else {
        config.profiles.clone()
    }
}

/// Worker `w`'s engine and what the router learns about it, provisioned at `now`.
pub(super) fn new_worker(
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
        kv_events: true,
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
