//! The per-cluster estimate: what a request would cost in one cluster, from its summary, the
//! work sent there since that summary, and the network round trip.

use super::policy::{DEFAULT_OUTPUT_TOKENS_HINT, DEFAULT_PREFILL_TOKENS_PER_S};
use super::summary::ClusterSummary;
use super::ClusterId;
use crate::ids::SequenceHash;
use serde::{Deserialize, Serialize};

/// A request as the global router sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRequest<'a> {
    /// Session (trajectory) id, when the client sends one.
    pub session: Option<u64>,
    /// The prompt's sequence hashes at the clusters' block size.
    pub blocks: &'a [SequenceHash],
    /// Prompt length in tokens.
    pub input_tokens: u64,
    /// Expected output tokens (`None`: [`DEFAULT_OUTPUT_TOKENS_HINT`]).
    pub output_tokens_hint: Option<u64>,
    /// The model it names: only clusters that serve it (or whose models are not known) are
    /// eligible ([`super::GlobalRouter::set_models`]).
    pub model: Option<&'a str>,
}

/// The most of a worker's time that prefill steps are taken to hold: decode never slows by more
/// than 1 / (1 − this) from prefill interference.
pub const MAX_PREFILL_SHARE: f64 = 0.9;

/// What the global router knows about a cluster's load beyond its last summary: the work sent
/// there since, the sessions living there (they come back after each tool call), and the rate
/// of prefill work it has been sending there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingLoad {
    /// Requests sent since the summary.
    pub requests: u64,
    /// Their uncached prompt tokens (as estimated when they were sent).
    pub prefill_tokens: u64,
    /// Sessions whose home is the cluster (between turns they have no active request).
    pub resident_sessions: u64,
    /// Uncached prompt tokens per second sent to the cluster over the load window
    /// ([`super::GlobalConfig::load_window`]).
    pub sent_prefill_tokens_per_s: f64,
}

/// One cluster's estimate for one request. Times in ms.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterEstimate {
    /// The cluster.
    pub cluster: ClusterId,
    /// False when the cluster is routed around (stale or missing summary, marked down, no
    /// workers); its other figures are then zero.
    pub eligible: bool,
    /// Cached prefix from the sketch, blocks.
    pub cached_blocks: u64,
    /// Prompt tokens it would prefill.
    pub uncached_tokens: u64,
    /// Network round trip to the cluster.
    pub rtt_ms: f64,
    /// Waiting behind prefill backlog and for a batch slot (counting the slots the cluster's
    /// resident sessions will want back).
    pub queue_ms: f64,
    /// Prefill of the uncached tokens on one worker.
    pub prefill_ms: f64,
    /// Decode of the expected output at the inter-token latency the batch will have with the
    /// requests the summary does not show yet (see [`estimate`]).
    pub decode_ms: f64,
    /// Requests per batch slot (active + queued + pending) / slots, or per worker when slots
    /// are unknown: the least-loaded figure.
    pub load_ratio: f64,
}

impl ClusterEstimate {
    /// An estimate for a cluster that is routed around.
    pub fn ineligible(cluster: ClusterId) -> Self {
        Self {
            cluster,
            eligible: false,
            cached_blocks: 0,
            uncached_tokens: 0,
            rtt_ms: 0.0,
            queue_ms: 0.0,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            load_ratio: 0.0,
        }
    }

    /// Time to first token: round trip + queue + prefill.
    pub fn ttft_ms(&self) -> f64 {
        self.rtt_ms + self.queue_ms + self.prefill_ms
    }

    /// What the kv policy minimises: time to first token plus decode.
    pub fn cost_ms(&self) -> f64 {
        self.ttft_ms() + self.decode_ms
    }
}

/// The estimate for `request` in a cluster with this summary, pending work and round trip.
pub fn estimate(
    cluster: ClusterId,
    summary: &ClusterSummary,
    pending: PendingLoad,
    rtt_ms: f64,
    request: &GlobalRequest<'_>,
) -> ClusterEstimate {
    let l = &summary.load;
    if l.workers == 0 {
        return ClusterEstimate::ineligible(cluster);
    }
    let cached_blocks = summary.cached_prefix_blocks(request.blocks) as u64;
    let uncached_tokens = request
        .input_tokens
        .saturating_sub(cached_blocks * u64::from(summary.block_size));
    let speed = if l.prefill_tokens_per_s > 0.0 {
        l.prefill_tokens_per_s
    } else {
        DEFAULT_PREFILL_TOKENS_PER_S
    };
    let workers = l.workers as f64;
    let backlog =
        (l.active_prefill_tokens + l.queued_prefill_tokens + pending.prefill_tokens) as f64;
    let output = request
        .output_tokens_hint
        .unwrap_or(DEFAULT_OUTPUT_TOKENS_HINT) as f64;
    let in_flight = (l.active_requests + l.queue_depth + pending.requests) as f64;
    // Resident sessions return after their tool calls: the slots they will want.
    let expected = in_flight.max(pending.resident_sessions as f64);
    // Decode under load: the stated latency is what a request placed now would see; every
    // other request the summary does not show yet (sent since, sessions coming back) joins
    // some worker's batch and slows its steps by the stated per-request growth.
    let running = (l.active_requests as f64).min(match l.max_running_requests {
        0 => f64::INFINITY,
        slots => slots as f64,
    });
    let joining = (expected - running).max(0.0);
    let joining = match l.max_running_requests {
        0 => joining,
        slots => joining.min(slots as f64 - running),
    };
    // Contention: a worker's steps that carry prefill hold up every request decoding there, so
    // the prefill work arriving (the rate sent lately, against the cluster's prefill capacity)
    // takes that share of the workers' time from decode. A cluster that takes most new
    // sessions pays for it in every request's decode, not only once its backlog shows.
    let prefill_share =
        (pending.sent_prefill_tokens_per_s / (workers * speed)).clamp(0.0, MAX_PREFILL_SHARE);
    let itl_ms = (l.decode_ms_per_token + l.decode_ms_per_token_per_seq * joining / workers)
        / (1.0 - prefill_share);
    let decode_ms = output * itl_ms;
    let (slot_wait_ms, load_ratio) = if l.max_running_requests > 0 {
        let slots = l.max_running_requests as f64;
        // Beyond the batch slots a request waits for earlier ones to finish: each full round
        // of slots ahead of it costs about one request's decode.
        let overflow = (expected + 1.0 - slots).max(0.0);
        (overflow / slots * decode_ms, in_flight / slots)
    } else {
        (0.0, in_flight / workers)
    };
    ClusterEstimate {
        cluster,
        eligible: true,
        cached_blocks,
        uncached_tokens,
        rtt_ms,
        queue_ms: backlog / (workers * speed) * 1e3 + slot_wait_ms,
        prefill_ms: uncached_tokens as f64 / speed * 1e3,
        decode_ms,
        load_ratio,
    }
}
