//! Seeded workload generators. Defaults and parameter names follow the sourced sheet
//! `../shared/reference/rl-rollout-workloads.md`.

use crate::dist::{exponential, lognormal, lognormal_clip};
use crate::model::{Barrier, Workload, WorkloadRequest};
use kvrouter_core::rng::SeededRng;
use serde::{Deserialize, Serialize};

const BLOCK: usize = 64;

/// Block ids of a token stream: block `i` of `stream` is shared when it lies inside the first
/// `shared_tokens` of a shared prefix `shared_id`, else private to the stream.
fn stream_blocks(shared_id: u64, shared_tokens: u32, stream: u64, tokens: u32) -> Vec<u64> {
    let full_shared = shared_tokens as usize / BLOCK;
    (0..tokens as usize / BLOCK + usize::from(tokens as usize % BLOCK != 0))
        .map(|i| {
            if i < full_shared {
                shared_id << 48 | i as u64
            } else {
                (stream + 1) << 32 | i as u64
            }
        })
        .collect()
}

/// A 64-bit mix (SplitMix64's finalizer) for block ids of generated prompts.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Blocks of an RL trajectory's turn: the harness (shared by all), the task's issue (shared by
/// the group), then the trajectory's own history.
fn shared_then_own(harness: u32, issue: u32, group: u64, session: u64, tokens: u32) -> Vec<u64> {
    let full_harness = harness as usize / BLOCK;
    // The first turn is the task prompt whole (its partial last block too); later turns share
    // only its full blocks.
    let full_task = if tokens <= harness + issue {
        usize::MAX
    } else {
        (harness + issue) as usize / BLOCK
    };
    (0..tokens as usize / BLOCK + usize::from(tokens as usize % BLOCK != 0))
        .map(|i| {
            if i < full_harness {
                1 << 48 | i as u64
            } else if i < full_task {
                mix(0x7a5c_0000_0000_0000 ^ group.wrapping_mul(0x1_0001) ^ (i as u64) << 40)
            } else {
                mix(0x5e55_0000_0000_0000 ^ session.wrapping_mul(0x1_0001) ^ (i as u64) << 40)
            }
        })
        .collect()
}

/// GRPO: P prompts × G samples per step, a shared instruction template, two-level log-normal
/// output lengths (siblings vary around their prompt's median) with a cap, and a synchronous step
/// barrier with a weight-sync pause. Defaults: the sheet's GRPO-math column, scaled down in
/// prompts so a run takes seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoParams {
    /// Prompts per step.
    pub prompts: u32,
    /// Samples per prompt (group size G).
    pub group_size: u32,
    /// Steps.
    pub steps: u32,
    /// Shared instruction tokens before every problem.
    pub template_tokens: u32,
    /// Problem length: median tokens.
    pub problem_median: f64,
    /// Problem length: log-space std.
    pub problem_sigma: f64,
    /// Problem length cap.
    pub problem_cap: u32,
    /// Median of the per-prompt median output length.
    pub output_median: f64,
    /// Log-space std between prompts.
    pub output_sigma_between: f64,
    /// Log-space std between siblings.
    pub output_sigma_within: f64,
    /// Output cap.
    pub output_cap: u32,
    /// Weight-sync pause between steps, seconds.
    pub sync_pause_s: f64,
    /// Share of a synchronous step in rollout: the train phase after each step is its rollout
    /// span × (1 − r) / r (the sheet's §6.2: 0.75, sweep 0.45–0.9). 1 (the default): no train
    /// phase, the next step follows after `sync_pause_s` alone.
    pub rollout_share: f64,
    /// Steps rollouts may run ahead of training (0 = synchronous; the sheet's async runs use
    /// 1 to 4).
    pub staleness: u32,
    /// Seed.
    pub seed: u64,
}

/// The barrier's rollout share: none for 1 (no train phase); out-of-range values are kept for
/// [`Workload::validate`] to name.
fn rollout_share(r: f64) -> Option<f64> {
    (r != 1.0).then_some(r)
}

impl Default for GrpoParams {
    fn default() -> Self {
        Self {
            prompts: 32,
            group_size: 16,
            steps: 2,
            template_tokens: 53,
            problem_median: 81.0,
            problem_sigma: 0.75,
            problem_cap: 2048,
            output_median: 3000.0,
            output_sigma_between: 0.7,
            output_sigma_within: 0.7,
            output_cap: 20_480,
            sync_pause_s: 1.0,
            rollout_share: 1.0,
            staleness: 0,
            seed: 0,
        }
    }
}

/// The GRPO workload.
pub fn grpo(p: &GrpoParams) -> Workload {
    let mut rng = SeededRng::new(p.seed);
    let mut requests = Vec::new();
    for step in 0..p.steps {
        for prompt in 0..p.prompts {
            let problem = lognormal_clip(
                &mut rng,
                p.problem_median,
                p.problem_sigma,
                1.0,
                f64::from(p.problem_cap),
            );
            let tokens = p.template_tokens + problem;
            let group = u64::from(step) * 1_000_000 + u64::from(prompt);
            let blocks = stream_blocks(0, p.template_tokens, group, tokens);
            let median = lognormal(&mut rng, p.output_median, p.output_sigma_between);
            for _ in 0..p.group_size {
                let output = lognormal_clip(
                    &mut rng,
                    median,
                    p.output_sigma_within,
                    1.0,
                    f64::from(p.output_cap),
                );
                requests.push(WorkloadRequest {
                    arrival_ms: None,
                    after: None,
                    delay_ms: 0.0,
                    session: None,
                    blocks: blocks.clone(),
                    input_tokens: tokens,
                    output_tokens: output,
                    group: Some(group),
                    step: Some(step),
                    policy_version: Some(step),
                });
            }
        }
    }
    Workload {
        name: "grpo".into(),
        block_size: BLOCK,
        requests,
        barrier: Some(Barrier {
            pause_ms: p.sync_pause_s * 1000.0,
            staleness: p.staleness,
            rollout_share: rollout_share(p.rollout_share),
        }),
    }
}

/// Multi-turn agentic sessions: each turn resends the whole history plus the new tool output,
/// with tool latencies between turns. Defaults: the sheet's agentic-SWE column with fewer
/// sessions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgenticParams {
    /// Sessions (trajectories).
    pub sessions: u32,
    /// Mean gap between session starts, seconds.
    pub session_gap_s: f64,
    /// Shared harness prefix tokens.
    pub harness_tokens: u32,
    /// First user message: median tokens, log std.
    pub issue_median: f64,
    /// Log std of the first message.
    pub issue_sigma: f64,
    /// Turns per session: median, log std, clipped to [3, 100].
    pub turns_median: f64,
    /// Log std of the turn count.
    pub turns_sigma: f64,
    /// Output per turn: median, log std, cap 4,096.
    pub output_median: f64,
    /// Log std of the output per turn.
    pub output_sigma: f64,
    /// Tool output added per turn: median, log std, cap 2,500.
    pub tool_tokens_median: f64,
    /// Log std of the tool output.
    pub tool_tokens_sigma: f64,
    /// Tool latency: median seconds, log std, cap 180 s.
    pub tool_latency_median_s: f64,
    /// Log std of the tool latency.
    pub tool_latency_sigma: f64,
    /// Context cap in tokens (a session ends when it would exceed it).
    pub context_cap: u32,
    /// RL steps (0: serving, sessions arrive with `session_gap_s`). With steps, each step runs
    /// `sessions` tasks × `group_size` trajectories from the step's start, behind a barrier.
    pub steps: u32,
    /// Trajectories per task in RL steps (a GRPO group sharing the task's prompt).
    pub group_size: u32,
    /// Weight-sync pause between RL steps, seconds.
    pub sync_pause_s: f64,
    /// Share of an RL step in rollout (train phase = rollout span × (1 − r) / r); 1 (the
    /// default): none.
    pub rollout_share: f64,
    /// Steps that may run ahead of the slowest unfinished one.
    pub staleness: u32,
    /// Seed.
    pub seed: u64,
}

impl Default for AgenticParams {
    fn default() -> Self {
        Self {
            sessions: 32,
            session_gap_s: 2.0,
            harness_tokens: 2000,
            issue_median: 200.0,
            issue_sigma: 0.8,
            turns_median: 29.0,
            turns_sigma: 0.5,
            output_median: 250.0,
            output_sigma: 0.85,
            tool_tokens_median: 300.0,
            tool_tokens_sigma: 1.4,
            tool_latency_median_s: 2.0,
            tool_latency_sigma: 1.2,
            context_cap: 65_536,
            steps: 0,
            group_size: 1,
            sync_pause_s: 1.0,
            rollout_share: 1.0,
            staleness: 0,
            seed: 0,
        }
    }
}

/// The agentic workload.
pub fn agentic(p: &AgenticParams) -> Workload {
    let mut rng = SeededRng::new(p.seed);
    let mut requests: Vec<WorkloadRequest> = Vec::new();
    let mut start = 0.0;
    let rl = p.steps > 0;
    let mut session = 0u64;
    for step in 0..p.steps.max(1) {
        for task in 0..p.sessions {
            let issue = lognormal_clip(&mut rng, p.issue_median, p.issue_sigma, 1.0, 4096.0);
            let group = u64::from(step) * 1_000_000 + u64::from(task);
            for _ in 0..if rl { p.group_size.max(1) } else { 1 } {
                let turns = lognormal_clip(&mut rng, p.turns_median, p.turns_sigma, 3.0, 100.0);
                let mut context = p.harness_tokens + issue;
                let mut prev: Option<usize> = None;
                let mut delay = 0.0;
                for _ in 0..turns {
                    let output =
                        lognormal_clip(&mut rng, p.output_median, p.output_sigma, 1.0, 4096.0);
                    if context + output > p.context_cap {
                        break;
                    }
                    let i = requests.len();
                    // Trajectories of a task share the harness and the issue; each then
                    // diverges with its own outputs and tool results.
                    requests.push(WorkloadRequest {
                        arrival_ms: match (prev, rl) {
                            (None, false) => Some(start),
                            _ => None,
                        },
                        after: prev,
                        delay_ms: delay,
                        session: Some(session),
                        blocks: if rl {
                            shared_then_own(p.harness_tokens, issue, group, session, context)
                        } else {
                            stream_blocks(1, p.harness_tokens, session, context)
                        },
                        input_tokens: context,
                        output_tokens: output,
                        group: rl.then_some(group),
                        step: rl.then_some(step),
                        policy_version: rl.then_some(step),
                    });
                    prev = Some(i);
                    let tool = lognormal_clip(
                        &mut rng,
                        p.tool_tokens_median,
                        p.tool_tokens_sigma,
                        1.0,
                        2500.0,
                    );
                    context += output + tool;
                    delay = (lognormal(&mut rng, p.tool_latency_median_s, p.tool_latency_sigma)
                        .min(180.0))
                        * 1000.0;
                }
                session += 1;
                if !rl {
                    start += exponential(&mut rng, p.session_gap_s * 1000.0);
                }
            }
        }
    }
    Workload {
        name: "agentic".into(),
        block_size: BLOCK,
        requests,
        barrier: rl.then_some(Barrier {
            pause_ms: p.sync_pause_s * 1000.0,
            staleness: p.staleness,
            rollout_share: rollout_share(p.rollout_share),
        }),
    }
}

/// Seed 001's scenario: 80 % of requests share a 6,000-token prefix, 20 % carry unrelated
/// 12,000-token documents; Poisson arrivals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Seed001Params {
    /// Requests.
    pub requests: u32,
    /// Arrival rate, requests per second.
    pub rate_per_s: f64,
    /// Share of requests on the shared prefix.
    pub shared_fraction: f64,
    /// Shared prefix tokens.
    pub shared_tokens: u32,
    /// Question tokens after the shared prefix.
    pub question_tokens: u32,
    /// Unrelated document tokens.
    pub document_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// Seed.
    pub seed: u64,
}

impl Default for Seed001Params {
    fn default() -> Self {
        Self {
            requests: 400,
            rate_per_s: 2.0,
            shared_fraction: 0.8,
            shared_tokens: 6000,
            question_tokens: 200,
            document_tokens: 12_000,
            output_tokens: 200,
            seed: 0,
        }
    }
}

/// The seed-001 workload.
pub fn seed001(p: &Seed001Params) -> Workload {
    let mut rng = SeededRng::new(p.seed);
    let mut t = 0.0;
    let requests = (0..p.requests)
        .map(|i| {
            t += exponential(&mut rng, 1000.0 / p.rate_per_s);
            let shared = rng.unit() < p.shared_fraction;
            let tokens = if shared {
                p.shared_tokens + p.question_tokens
            } else {
                p.document_tokens
            };
            let blocks = if shared {
                stream_blocks(2, p.shared_tokens, u64::from(i), tokens)
            } else {
                stream_blocks(3, 0, u64::from(i), tokens)
            };
            WorkloadRequest {
                arrival_ms: Some(t),
                after: None,
                delay_ms: 0.0,
                session: None,
                blocks,
                input_tokens: tokens,
                output_tokens: p.output_tokens,
                group: None,
                step: None,
                policy_version: None,
            }
        })
        .collect();
    Workload {
        name: "seed001".into(),
        block_size: BLOCK,
        requests,
        barrier: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpo_groups_share_their_prompt_and_same_seed_same_workload() {
        let w = grpo(&GrpoParams {
            prompts: 4,
            group_size: 8,
            steps: 2,
            ..GrpoParams::default()
        });
        assert_eq!(w.requests.len(), 64);
        assert!(w.requests[..8]
            .iter()
            .all(|r| r.blocks == w.requests[0].blocks));
        assert_ne!(w.requests[0].blocks, w.requests[8].blocks);
        assert!(w.requests.iter().all(|r| r.output_tokens <= 20_480));
        assert_eq!(
            w,
            grpo(&GrpoParams {
                prompts: 4,
                group_size: 8,
                steps: 2,
                ..GrpoParams::default()
            })
        );
        w.validate(64).unwrap();
    }

    #[test]
    fn agentic_turns_extend_their_history() {
        let w = agentic(&AgenticParams {
            sessions: 3,
            ..AgenticParams::default()
        });
        w.validate(64).unwrap();
        for (i, r) in w.requests.iter().enumerate() {
            if let Some(prev) = r.after {
                let p = &w.requests[prev];
                let full = p.input_tokens as usize / 64;
                assert_eq!(
                    r.blocks[..full],
                    p.blocks[..full],
                    "turn {i} resends the history"
                );
                assert!(r.input_tokens > p.input_tokens);
            }
        }
        // Sessions share the harness prefix.
        let firsts: Vec<&WorkloadRequest> =
            w.requests.iter().filter(|r| r.after.is_none()).collect();
        assert_eq!(firsts[0].blocks[..31], firsts[1].blocks[..31]);
    }

    #[test]
    fn seed001_mixes_shared_and_unrelated_prompts() {
        let w = seed001(&Seed001Params::default());
        let shared = w.requests.iter().filter(|r| r.input_tokens == 6200).count() as f64
            / w.requests.len() as f64;
        assert!((shared - 0.8).abs() < 0.06, "{shared}");
        assert!(w.hit_rate_ceiling(&(0..w.requests.len()).collect::<Vec<_>>()) > 0.5);
    }
}
