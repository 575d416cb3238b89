//! Selection policies: given the eligible ranks and what they carry, pick one.
//!
//! Policies are pure functions of a candidate snapshot and the policy's own seeded RNG; they never
//! touch live worker state. The router builds the snapshot, the policy picks, the router commits.
//!
//! Layout: `kv_cost.rs` (the KV cost model and temperature sampling), `balance.rs` (round-robin,
//! random, least-loaded, power-of-two), `cost.rs` (the `cost` policy: expected seconds from the
//! engine's timing model), `learn.rs` (what it learns online: output lengths, churn, line fits).

mod balance;
pub mod cost;
mod kv_cost;
pub mod learn;

pub use balance::{least_loaded, power_of_two, random_pick, round_robin};
pub use kv_cost::{kv_scores, pick_by_cost, KvCostParams};

use crate::ids::WorkerRank;
use crate::index::TierOverlap;
use crate::ledger::RankLoad;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How the router picks a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterMode {
    /// Cycle through eligible ranks.
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
    /// Fewest active requests (seeded tie-break).
    LeastLoaded,
    /// Two distinct random candidates; the one with fewer active requests wins.
    PowerOfTwo,
    /// Lowest KV cost: prefix reuse against prefill and decode load (Dynamo's cost model).
    Kv,
    /// Lowest expected time: TTFT plus decode slowdown in seconds, from the engine's timing
    /// model (docs/routing.md). The default.
    #[default]
    Cost,
    /// The request names its worker (an upstream picker already chose).
    Direct,
}

impl RouterMode {
    /// Every mode, in documentation order.
    pub const ALL: [RouterMode; 7] = [
        RouterMode::RoundRobin,
        RouterMode::Random,
        RouterMode::LeastLoaded,
        RouterMode::PowerOfTwo,
        RouterMode::Kv,
        RouterMode::Cost,
        RouterMode::Direct,
    ];

    /// The flag value (`round-robin`, `kv`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            RouterMode::RoundRobin => "round-robin",
            RouterMode::Random => "random",
            RouterMode::LeastLoaded => "least-loaded",
            RouterMode::PowerOfTwo => "power-of-two",
            RouterMode::Kv => "kv",
            RouterMode::Cost => "cost",
            RouterMode::Direct => "direct",
        }
    }
}

impl fmt::Display for RouterMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown mode name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown router mode {0:?} (expected one of: round-robin, random, least-loaded, power-of-two, kv, cost, direct)")]
pub struct UnknownMode(pub String);

impl FromStr for RouterMode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s || m.as_str().replace('-', "_") == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// What the policy sees of one eligible rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The rank.
    pub rank: WorkerRank,
    /// Its load before this request.
    pub load: RankLoad,
    /// How much of the request's prefix it holds.
    pub overlap: TierOverlap,
    /// The request's blocks it would newly hold (not already held by its active requests).
    pub new_blocks: u64,
}

impl Candidate {
    /// The request's blocks its engine would not compute again: those cached on its GPU, or
    /// held by its active requests (an engine computes a prefix in flight once).
    /// `request_blocks` is the request's whole block count.
    pub fn reused_blocks(&self, request_blocks: u64) -> u64 {
        u64::from(self.overlap.gpu_blocks).max(request_blocks - self.new_blocks)
    }
}

/// One candidate's score, returned with every decision as data.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    /// The rank.
    pub rank: WorkerRank,
    /// Its prefix overlap with the request.
    pub overlap: TierOverlap,
    /// Blocks of prefill credited for reuse.
    pub credit_blocks: f64,
    /// Projected prefill cost in blocks.
    pub prefill_blocks: f64,
    /// Projected decode cost in blocks.
    pub decode_blocks: f64,
    /// Active requests before this one.
    pub active_requests: u32,
    /// The total cost (lower is better).
    pub total: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_from_their_flag_values() {
        for mode in RouterMode::ALL {
            assert_eq!(mode.as_str().parse::<RouterMode>().unwrap(), mode);
        }
        assert_eq!(
            "round_robin".parse::<RouterMode>().unwrap(),
            RouterMode::RoundRobin
        );
        let err = "fastest".parse::<RouterMode>().unwrap_err();
        assert!(err.to_string().contains("fastest"));
        let json = serde_json::to_string(&RouterMode::PowerOfTwo).unwrap();
        assert_eq!(json, "\"power-of-two\"");
    }
}
