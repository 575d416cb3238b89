//! The workload model.

use kvrouter_core::hashing::BlockHashes;
use kvrouter_core::ids::ContentHash;
use kvrouter_core::rng::mix64 as mix;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// One request to replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkloadRequest {
    /// Arrival time in ms for open-loop requests (`None` when another rule starts it).
    pub arrival_ms: Option<f64>,
    /// Index of the request that must finish first (previous turn of a session).
    pub after: Option<usize>,
    /// Delay after `after` finishes (tool call, think time), ms.
    pub delay_ms: f64,
    /// Session or trajectory the request belongs to.
    pub session: Option<u64>,
    /// Prompt blocks as workload block ids (namespaced: equal ids mean equal content and prefix).
    pub blocks: Vec<u64>,
    /// Prompt length in tokens (may end inside the last block).
    pub input_tokens: u32,
    /// Tokens to generate.
    pub output_tokens: u32,
    /// RL group (samples sharing a prompt).
    pub group: Option<u64>,
    /// RL step; with a [`Barrier`], step k+1 starts when step k has finished.
    pub step: Option<u32>,
    /// Policy version the request was generated under.
    pub policy_version: Option<u32>,
}

/// A step barrier (GRPO): step k + 1 + `staleness` starts when every request of step k finished,
/// plus the trainer's phase and a weight-sync pause. Staleness 0 is synchronous on-policy
/// training; staleness s lets rollouts run up to s steps ahead of the policy being trained
/// (asynchronous RL).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Barrier {
    /// Weight-sync pause between steps, ms.
    pub pause_ms: f64,
    /// How many steps rollouts may run ahead (0 = synchronous).
    #[serde(default)]
    pub staleness: u32,
    /// Share r of a synchronous step spent in rollout (none: no train phase). The trainer's
    /// phase after a step is its measured rollout span × (1 − r) / r, before the pause
    /// (../shared/reference/rl-rollout-workloads.md §6.2, §8: r = 0.75, sweep 0.45–0.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_share: Option<f64>,
}

impl Barrier {
    /// Time from a step's last request to the next step's release: the train phase for a
    /// rollout span of `span`, then the pause.
    pub fn gap_after(&self, span: std::time::Duration) -> std::time::Duration {
        let pause = std::time::Duration::from_secs_f64(self.pause_ms.max(0.0) / 1e3);
        match self.rollout_share {
            Some(r) if r > 0.0 && r < 1.0 => span.mul_f64((1.0 - r) / r) + pause,
            _ => pause,
        }
    }

    /// Whether a step is followed by a train phase.
    pub fn has_train_phase(&self) -> bool {
        self.rollout_share.is_some_and(|r| r > 0.0 && r < 1.0)
    }
}

/// A workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Name for reports.
    pub name: String,
    /// Tokens per workload block id.
    pub block_size: usize,
    /// The requests, in the order they were read or generated.
    pub requests: Vec<WorkloadRequest>,
    /// Step barrier, for synchronous RL workloads.
    pub barrier: Option<Barrier>,
}

impl Workload {
    /// Router blocks of request `i` for routers with `router_block_size`-token blocks (which must
    /// divide the workload's block size): each workload block becomes `block_size / router
    /// block size` router blocks with content hashes derived from (block id, sub-block), and only
    /// router blocks fully inside the prompt are kept.
    pub fn router_blocks(&self, i: usize, router_block_size: usize) -> BlockHashes {
        let req = &self.requests[i];
        let sub = (self.block_size / router_block_size.max(1)).max(1) as u64;
        let full = (req.input_tokens as usize) / router_block_size.max(1);
        let content: Vec<ContentHash> = req
            .blocks
            .iter()
            .flat_map(|b| (0..sub).map(move |j| ContentHash(mix(mix(*b) ^ j))))
            .take(full)
            .collect();
        BlockHashes::from_content(content)
    }

    /// The share of prompt blocks (workload blocks, prompt order) that one unbounded cache would
    /// already hold: the best hit rate any routing can reach.
    pub fn hit_rate_ceiling(&self, order: &[usize]) -> f64 {
        let mut seen: HashSet<u64> = HashSet::new();
        let (mut hits, mut total) = (0u64, 0u64);
        for &i in order {
            // Prefix semantics: a block counts only while every block before it was seen too.
            let mut prefix = true;
            for b in &self.requests[i].blocks {
                total += 1;
                if prefix && seen.contains(b) {
                    hits += 1;
                } else {
                    prefix = false;
                }
                seen.insert(*b);
            }
        }
        if total == 0 {
            0.0
        } else {
            hits as f64 / total as f64
        }
    }

    /// Checks references and block sizes; names the first offending request.
    pub fn validate(&self, router_block_size: usize) -> Result<(), String> {
        if router_block_size == 0 || self.block_size % router_block_size != 0 {
            return Err(format!(
                "the router block size {router_block_size} must divide the workload block size {}",
                self.block_size
            ));
        }
        if let Some(r) = self.barrier.and_then(|b| b.rollout_share) {
            if !(r > 0.0 && r <= 1.0) {
                return Err(format!(
                    "rollout_share {r} must be in (0, 1] (the share of an RL step in rollout)"
                ));
            }
        }
        for (i, r) in self.requests.iter().enumerate() {
            if let Some(a) = r.after {
                if a >= i {
                    return Err(format!(
                        "request {i} waits for request {a}, which is not before it"
                    ));
                }
            }
            if r.arrival_ms.is_none() && r.after.is_none() && r.step.is_none() {
                return Err(format!(
                    "request {i} has no arrival time, previous turn or step"
                ));
            }
            if r.output_tokens == 0 {
                return Err(format!("request {i} asks for 0 output tokens"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(blocks: Vec<u64>, input_tokens: u32) -> WorkloadRequest {
        WorkloadRequest {
            arrival_ms: Some(0.0),
            after: None,
            delay_ms: 0.0,
            session: None,
            blocks,
            input_tokens,
            output_tokens: 1,
            group: None,
            step: None,
            policy_version: None,
        }
    }

    #[test]
    fn trace_blocks_expand_to_router_blocks_and_partial_tails_are_cut() {
        let w = Workload {
            name: "t".into(),
            block_size: 512,
            requests: vec![req(vec![7, 8], 700), req(vec![7, 9], 1024)],
            barrier: None,
        };
        let a = w.router_blocks(0, 64);
        let b = w.router_blocks(1, 64);
        assert_eq!(a.len(), 10, "700 tokens = 10 full 64-token blocks");
        assert_eq!(b.len(), 16);
        assert_eq!(a.sequence[..8], b.sequence[..8], "shared first trace block");
        assert_ne!(a.sequence[8], b.sequence[8]);
        assert_eq!(w.router_blocks(0, 512).len(), 1);
    }

    #[test]
    fn the_ceiling_counts_prefix_hits_in_order() {
        let w = Workload {
            name: "t".into(),
            block_size: 512,
            requests: vec![
                req(vec![1, 2], 1024),
                req(vec![1, 3], 1024),
                req(vec![4, 2], 1024),
            ],
            barrier: None,
        };
        // Second request hits block 1; third hits nothing (block 2 follows a miss).
        assert!((w.hit_rate_ceiling(&[0, 1, 2]) - 1.0 / 6.0).abs() < 1e-12);
    }
}
