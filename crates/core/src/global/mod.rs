//! Global routing across clusters (datacenters): the summary each cluster's local router
//! publishes and the global router that reads them.
//!
//! KV never leaves a cluster. Each local router publishes a [`ClusterSummary`] (built by
//! [`crate::Router::cluster_summary`]): a [`PrefixSketch`] of the prefix blocks its workers
//! hold plus its [`ClusterLoad`], in a versioned byte form of kilobytes. The [`GlobalRouter`]
//! keeps the latest summary per cluster, estimates per cluster what a request would cost there
//! ([`ClusterEstimate`]: round trip + queue + uncached prefill at that cluster's speed +
//! decode), and picks by its [`GlobalPolicy`]. Sessions keep their cluster unless another is
//! clearly cheaper (hysteresis), since their KV cannot follow them. A cluster whose summary is
//! older than [`GlobalConfig::max_summary_age`], or that the host marked down, is routed around.
//!
//! Pure like the rest of the core: summaries arrive as values with the time they arrived.
//!
//! Layout: `sketch.rs` (the blocked Bloom filter of checkpoints), `summary.rs` (summary, load,
//! byte form), `estimate.rs` (the per-cluster cost), `policy.rs` (policies, configuration),
//! `router.rs` (the global router), `error.rs` (its refusals), `tests.rs` (property tests against a
//! naive model) and the other `*_tests.rs`.

#[cfg(test)]
mod decode_tests;
mod error;
mod estimate;
#[cfg(test)]
mod model_tests;
mod policy;
mod router;
mod sketch;
#[cfg(test)]
mod split_tests;
mod summary;
#[cfg(test)]
mod tests;

pub use error::GlobalError;
pub use estimate::{estimate, ClusterEstimate, GlobalRequest, PendingLoad, MAX_PREFILL_SHARE};
pub use policy::{
    GlobalConfig, GlobalConfigError, GlobalPolicy, UnknownGlobalPolicy, DEFAULT_LOAD_WINDOW,
    DEFAULT_MAX_SUMMARY_AGE, DEFAULT_OUTPUT_TOKENS_HINT, DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_SESSION_MOVE_RATIO, DEFAULT_SESSION_TTL,
};
pub use router::{
    ClusterSpec, DecisionReason, GlobalDecision, GlobalRouter, MAX_CLUSTER_WEIGHT, MAX_RTT_MS,
};
pub use sketch::{
    PrefixSketch, SketchConfig, SketchError, DEFAULT_BITS_PER_KEY,
    DEFAULT_CHECKPOINT_INTERVAL_BLOCKS,
};
pub use summary::{
    ClusterLoad, ClusterSummary, SummaryError, MAX_STATED_DECODE_MS,
    MAX_STATED_PREFILL_TOKENS_PER_S, MAX_SUMMARY_BYTES, SUMMARY_FORMAT_VERSION,
};

use serde::{Deserialize, Serialize};
use std::fmt;

/// A cluster known to the global router (its position in the order clusters were added).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct ClusterId(pub u32);

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What the host adds to a summary that the router cannot know: the cluster's name and
/// publication counter, the sketch settings, and how fast its workers are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SummaryOptions {
    /// The cluster's name.
    pub name: String,
    /// Publication counter (increase per summary).
    pub sequence: u64,
    /// Sketch settings.
    pub sketch: SketchConfig,
    /// Prefill speed of one worker, tokens/s.
    pub prefill_tokens_per_s: f64,
    /// Current inter-token latency, ms.
    pub decode_ms_per_token: f64,
    /// Inter-token latency added per extra running request on one worker, ms (0 = unknown).
    pub decode_ms_per_token_per_seq: f64,
    /// Batch slots over all workers (0 = unknown).
    pub max_running_requests: u64,
}
