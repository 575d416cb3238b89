//! Seed 002's global-routing scenario: RL steps of multi-turn agentic rollouts (240 per step:
//! 60 tasks × 4 samples) of which the harness keeps 100 sessions in flight, run across
//! datacenters. Built on the agentic generator ([`crate::generators::agentic`]); the sessions
//! in flight are the simulator's `--concurrency` (see docs/global-routing.md).

use crate::generators::{agentic, AgenticParams};
use crate::Workload;
use serde::{Deserialize, Serialize};

/// Sessions the harness keeps in flight within a step (the seed's "100 concurrent multi-turn
/// sessions").
pub const SEED002_SESSIONS_IN_FLIGHT: usize = 100;

/// Parameters of the seed-002 scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Seed002Params {
    /// RL steps.
    pub steps: u32,
    /// Tasks per step.
    pub tasks: u32,
    /// Samples (rollouts) per task; tasks × samples = rollouts per step (240).
    pub group_size: u32,
    /// Harness prefix shared by every rollout, tokens.
    pub harness_tokens: u32,
    /// Turns per rollout, median (log-normal, σ 0.5, within 3..100).
    pub turns_median: f64,
    /// Log std of the turn count (a wide spread makes the longest rollout the step).
    pub turns_sigma: f64,
    /// Output per turn, median tokens.
    pub output_median: f64,
    /// Tool output per turn, median tokens.
    pub tool_tokens_median: f64,
    /// Tool latency between turns, median seconds.
    pub tool_latency_median_s: f64,
    /// Context cap, tokens.
    pub context_cap: u32,
    /// Weight-sync pause between steps, seconds.
    pub sync_pause_s: f64,
    /// Seed.
    pub seed: u64,
}

impl Default for Seed002Params {
    fn default() -> Self {
        Self {
            steps: 2,
            tasks: 60,
            group_size: 4,
            harness_tokens: 4000,
            turns_median: 10.0,
            turns_sigma: 0.5,
            output_median: 200.0,
            tool_tokens_median: 800.0,
            tool_latency_median_s: 1.0,
            context_cap: 32_768,
            sync_pause_s: 1.0,
            seed: 2,
        }
    }
}

/// The seed-002 workload.
pub fn seed002(p: &Seed002Params) -> Workload {
    let mut w = agentic(&AgenticParams {
        sessions: p.tasks,
        group_size: p.group_size,
        steps: p.steps.max(1),
        harness_tokens: p.harness_tokens,
        turns_median: p.turns_median,
        turns_sigma: p.turns_sigma,
        output_median: p.output_median,
        tool_tokens_median: p.tool_tokens_median,
        tool_latency_median_s: p.tool_latency_median_s,
        context_cap: p.context_cap,
        sync_pause_s: p.sync_pause_s,
        seed: p.seed,
        ..AgenticParams::default()
    });
    w.name = "seed002".into();
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_has_240_rollouts_of_several_turns() {
        let w = seed002(&Seed002Params::default());
        let first_turns = w
            .requests
            .iter()
            .filter(|r| r.after.is_none() && r.step == Some(0))
            .count();
        assert_eq!(first_turns, 240);
        assert!(w.requests.len() > 2 * 240 * 3);
        assert!(w.barrier.is_some());
        assert!(w.validate(16).is_ok());
    }
}
