//! The planner's control law: from a snapshot of one model pool's live signals, the number of
//! workers the pool should have, with its reasons as data.
//!
//! One owner for the law: `kvrouter serve --planner-advise` feeds it the router's live state,
//! `kvrouter sim --planner` feeds it the simulated router's, so a simulated result is evidence
//! about the live advisor. Pure: the caller passes `now` and the signals; nothing here reads a
//! clock.
//!
//! The law (docs/planner.md writes it out):
//! - **demand** at a tick is the largest of the loads divided by what one worker should carry
//!   (requests in flight and queued; KV blocks in use against the usage target; prefill tokens
//!   waiting against a few engine steps), raised by one worker above the current count while
//!   the observed TTFT or ITL is over its target or requests wait in the router queue;
//! - **scale up** at once to the largest demand of the last `up_window` (~5 s);
//! - **scale down** only when every demand of the last `down_window` was below the current
//!   recommendation, to the largest of them (the tail is waited for, and the recommendation
//!   cannot reverse more often than once per window);
//! - **tail release**: in an RL step's tail (requests of RL groups, requests at most half the
//!   step's most, nothing queued, requests in flight not risen over the down window, the last
//!   rise at least a down window ago) the recommendation follows the up window's demand
//!   down at once: the step's requests only finish, so the fleet shrinks as they do;
//! - **predictive floor**: steps (busy spells between idle ones: an RL step's burst and tail)
//!   are remembered with their peak demand, span and the gap before them; the next is expected
//!   at the earliest it may come (the last step's end, or now while it runs, plus the shortest
//!   recent gap or its span × the smallest recent gap-to-span ratio: the one the history has
//!   not refuted, the earlier while both fit), and from the
//!   startup lead (the startup plus three tick intervals, at most the up window) before that
//!   until it comes (or the horizon, ~180 s, passes) the floor is the
//!   recent peak. RL steps (requests with group headers) use the configured rollout share r
//!   (gap ≥ span × (1 − r) / r, until a gap shorter than that refutes it) or, before a gap
//!   was seen and without one, are provisioned
//!   conservatively: the first step holds its peak, and the next is expected at once;
//! - **in-flight need**: never below the workers the requests in flight need at the engines'
//!   full capacity (scale-down never drains in-flight requests);
//! - clamped to `[min_workers, max_workers]`.
//!
//! # Layout
//! - this file: configuration, signals, the recommendation and its reasons;
//! - `law`: the [`Planner`] state (demand history, steps) and its `tick`;
//! - `gap`: the gap expected before the next step (a fixed trainer phase or one that follows
//!   the rollout, as the step history supports);
//! - `tests`, `rl_tests`: unit and property tests (RL steps in the second);
//! - `migrate`: tail consolidation (`sim --planner-migrate-tail`): where the requests of a
//!   worker released in an RL tail may move;
//! - `actuate`: acting on recommendations (`serve --planner-act`): the GPU budget's split
//!   between pools and the cool-down.

pub mod actuate;
mod gap;
mod law;
pub mod migrate;
#[cfg(test)]
mod rl_tests;
#[cfg(test)]
mod tests;

pub use law::Planner;

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Bounds and targets of the control law.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlannerConfig {
    /// Fewest workers recommended.
    pub min_workers: u32,
    /// Most workers recommended.
    pub max_workers: u32,
    /// Requests (in flight and queued) one worker should carry.
    pub requests_per_worker: u32,
    /// KV usage (fraction of a worker's blocks held by requests) to stay under.
    pub kv_usage_target: f64,
    /// Engine steps of waiting prefill tokens one worker should carry.
    pub prefill_steps: f64,
    /// TTFT p99 target, ms (none: not a signal).
    pub ttft_p99_target_ms: Option<f64>,
    /// Mean ITL target, ms (none: not a signal).
    pub itl_target_ms: Option<f64>,
    /// Scale-up reacts to the largest demand of this window.
    pub up_window: Duration,
    /// Scale-down waits until every demand of this window was lower.
    pub down_window: Duration,
    /// How far ahead a predicted step is provisioned for, and how long a predicted step that
    /// has not come keeps the floor.
    pub horizon: Duration,
    /// Time a new worker takes to serve: the floor rises this long (plus three tick intervals,
    /// at most the up window) before a predicted step.
    pub startup: Duration,
    /// Prior for RL steps: the share r of a synchronous step spent in rollout, so the trainer's
    /// phase after a rollout span S lasts at least S × (1 − r) / r. It times the first gap and
    /// bounds later ones from below until a gap shorter than it is seen (none: the next step
    /// may come at once, and the first step holds its peak). The sheet's §6.2 puts r at
    /// 0.45–0.9, 0.75 typical.
    #[serde(default)]
    pub rl_rollout_share: Option<f64>,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            min_workers: 1,
            max_workers: 64,
            requests_per_worker: 64,
            kv_usage_target: 0.8,
            prefill_steps: 4.0,
            ttft_p99_target_ms: None,
            itl_target_ms: None,
            up_window: Duration::from_secs(5),
            down_window: Duration::from_secs(30),
            horizon: Duration::from_secs(180),
            startup: Duration::from_secs(30),
            rl_rollout_share: None,
        }
    }
}

/// Why a configuration cannot be used.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("planner: {0}")]
pub struct PlannerConfigError(pub String);

impl PlannerConfig {
    /// Checks bounds and targets.
    pub fn validate(&self) -> Result<(), PlannerConfigError> {
        let err = |m: &str| Err(PlannerConfigError(m.to_owned()));
        if self.min_workers == 0 {
            return err("min workers must be at least 1");
        }
        if self.max_workers < self.min_workers {
            return err("max workers must be at least min workers");
        }
        if self.requests_per_worker == 0 {
            return err("requests per worker must be at least 1");
        }
        if !(self.kv_usage_target > 0.0 && self.kv_usage_target <= 1.0) {
            return err("KV usage target must be in (0, 1]");
        }
        if !(self.prefill_steps.is_finite() && self.prefill_steps > 0.0) {
            return err("prefill steps must be positive");
        }
        for t in [self.ttft_p99_target_ms, self.itl_target_ms]
            .into_iter()
            .flatten()
        {
            if !(t.is_finite() && t > 0.0) {
                return err("latency targets must be positive");
            }
        }
        if self
            .rl_rollout_share
            .is_some_and(|r| !(r > 0.0 && r <= 1.0))
        {
            return err("RL rollout share must be in (0, 1]");
        }
        if self.up_window.is_zero() || self.down_window.is_zero() || self.horizon.is_zero() {
            return err("windows and horizon must be positive");
        }
        if self.down_window < self.up_window {
            // A scale-down would be undone by the up window's peak at the next tick.
            return err("the down window must be at least the up window");
        }
        Ok(())
    }
}

/// One model pool's live signals at a tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolSignals {
    /// Workers serving now (not draining, not starting).
    pub workers: u32,
    /// Requests in flight (routed, not finished).
    pub in_flight_requests: u64,
    /// Requests waiting in the router queue.
    pub queued_requests: u64,
    /// Uncached prompt tokens not yet past their first token.
    pub prefill_tokens: u64,
    /// KV blocks held by requests in flight.
    pub decode_blocks: u64,
    /// One worker's token budget per engine step, when known.
    pub batched_tokens_per_worker: Option<u64>,
    /// One worker's KV capacity, blocks, when known.
    pub kv_blocks_per_worker: Option<u64>,
    /// Most requests one engine runs at once, when known (the in-flight need).
    pub max_requests_per_worker: Option<u32>,
    /// Observed TTFT p99 over the recent window, ms.
    pub ttft_p99_ms: Option<f64>,
    /// Observed mean ITL over the recent window, ms.
    pub itl_ms: Option<f64>,
    /// Requests in flight that belong to an RL group (`x-kvrouter-group-id`): their busy
    /// spells are RL steps.
    pub rl_requests: u64,
}

/// Why the recommendation is what it is (one entry per signal that set or bounded it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Reason {
    /// Requests in flight and queued against what one worker should carry.
    Requests {
        /// In flight plus queued.
        requests: u64,
        /// Workers they need.
        workers: u32,
    },
    /// KV blocks in use against the usage target.
    KvUsage {
        /// Blocks held.
        blocks: u64,
        /// Workers they need.
        workers: u32,
    },
    /// Prefill tokens waiting against a few engine steps.
    Prefill {
        /// Tokens waiting.
        tokens: u64,
        /// Workers they need.
        workers: u32,
    },
    /// Requests wait in the router queue: one more worker than now.
    Queue {
        /// Requests waiting.
        queued: u64,
    },
    /// Observed TTFT p99 over its target: one more worker than now.
    TtftOverTarget {
        /// Observed, ms.
        observed_ms: f64,
        /// Target, ms.
        target_ms: f64,
    },
    /// Observed ITL over its target: one more worker than now.
    ItlOverTarget {
        /// Observed, ms.
        observed_ms: f64,
        /// Target, ms.
        target_ms: f64,
    },
    /// Scale-up: the largest demand of the up window.
    ScaleUp {
        /// Workers.
        workers: u32,
    },
    /// Scale-down is held: some demand of the down window was not lower (the tail).
    HoldForTail {
        /// The largest demand of the window.
        window_peak: u32,
        /// Seconds until the window can allow a scale-down, if demand stays lower.
        for_s: f64,
    },
    /// Scale-down to the largest demand of the down window.
    ScaleDown {
        /// Workers.
        workers: u32,
    },
    /// An RL step's tail: its requests only finish (none queued, none started over the down
    /// window, the last scale-up a window ago or more), so the fleet follows the demand of the
    /// up window down at once; removed workers drain and are released as their requests end.
    TailRelease {
        /// Workers.
        workers: u32,
    },
    /// The predictive floor: a step is expected soon, provisioned at recent steps' peak.
    PredictedStep {
        /// Floor, workers.
        workers: u32,
        /// Seconds until the predicted start (negative: overdue).
        in_s: f64,
    },
    /// Requests in flight need this many workers at full engine capacity (never drained).
    InFlight {
        /// Workers.
        workers: u32,
    },
    /// Clamped to the configured bounds.
    Bounds {
        /// Min workers.
        min: u32,
        /// Max workers.
        max: u32,
    },
}

/// The phase of the pool's current step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepPhase {
    /// Nothing in flight or queued.
    Idle,
    /// A step in progress, demand at or near its peak.
    Burst,
    /// A step in progress, demand down to half its peak or less.
    Tail,
}

/// What the law recommends at a tick.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    /// Recommended workers.
    pub workers: u32,
    /// Workers serving when it was computed.
    pub current_workers: u32,
    /// Demand at this tick (before windows, floor and bounds).
    pub demand: u32,
    /// The predictive floor (0: none).
    pub floor: u32,
    /// Workers the requests in flight need at full engine capacity.
    pub in_flight_need: u32,
    /// The step phase.
    pub phase: StepPhase,
    /// Steps remembered (busy spells).
    pub steps_seen: u64,
    /// Reasons, in the order they applied.
    pub reasons: Vec<Reason>,
}
