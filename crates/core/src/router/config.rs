//! The router's configuration: one validated tree, with field names that follow the flags of the
//! seeds' frontend (`--router-mode kv` is `router_mode`, and so on), so a configuration can be
//! written as `kv:router_predicted_ttl_secs=5` and mean what the flag means.

use crate::approx::ApproxConfig;
use crate::policy::{KvCostParams, RouterMode};
use crate::router::admission::QueuePolicy;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Every routing option. Defaults are in [`RouterConfig::default`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// The selection policy.
    pub router_mode: RouterMode,
    /// Tokens per KV block; must match the engines'.
    pub kv_cache_block_size: usize,
    /// Sampling temperature of the KV policy (0 = argmin).
    pub router_temperature: f64,
    /// Credit per GPU-cached block (0 = load-aware).
    pub router_kv_overlap_score_credit: f64,
    /// Decay of credit on candidates with excess prefill load.
    pub router_kv_overlap_score_credit_decay: f64,
    /// Weight of the prefill term.
    pub router_prefill_load_scale: f64,
    /// Block-equivalent cost per active request.
    pub router_decode_active_request_weight: f64,
    /// Credit per block found in host memory beyond the GPU prefix.
    pub router_host_cache_hit_weight: f64,
    /// Credit per block found on disk beyond the faster tiers.
    pub router_disk_cache_hit_weight: f64,
    /// Learn cache state from engine KV events (true) or predict it from decisions (false,
    /// `--no-router-kv-events`).
    pub router_kv_events: bool,
    /// Time-to-live of predicted blocks in approximate mode, seconds.
    pub router_ttl_secs: f64,
    /// Most (block, rank) entries kept by a predicted index.
    pub router_max_tree_size: usize,
    /// Most blocks the event-fed index keeps per (rank, tier) of a worker that declares no
    /// `kv_capacity_blocks` (a worker that declares one is bounded by it); beyond it the oldest
    /// leaves are evicted.
    pub router_index_max_blocks_per_worker: usize,
    /// Fraction of the cap that pruning brings a predicted index down to.
    pub router_prune_target_ratio: f64,
    /// With KV events: keep a predicted-placement window of this many seconds (`None` = off).
    pub router_predicted_ttl_secs: Option<f64>,
    /// A rank is busy when its active decode blocks exceed this fraction of its KV capacity.
    pub active_decode_blocks_threshold: Option<f64>,
    /// A rank is busy when its active prefill tokens exceed this many.
    pub active_prefill_tokens_threshold: Option<u64>,
    /// A rank is busy when its active prefill tokens exceed this fraction of its
    /// `max_num_batched_tokens`.
    pub active_prefill_tokens_threshold_frac: Option<f64>,
    /// Queue requests while every eligible rank's active prefill tokens exceed this fraction of
    /// its `max_num_batched_tokens` (`None` = no router queue).
    pub router_queue_threshold: Option<f64>,
    /// Order of the router queue.
    pub router_queue_policy: QueuePolicy,
    /// Most requests waiting in the queue (beyond it: `QueueFull`).
    pub router_queue_max_requests: Option<usize>,
    /// Most prompt tokens waiting in the queue.
    pub router_queue_max_tokens: Option<u64>,
    /// Longest a request waits in the router queue, seconds, whatever it waits for (load, a
    /// policy version no worker serves, a paused worker); then it fails with
    /// `QueueWaitExceeded`, naming what it waited for.
    pub router_queue_max_wait_secs: f64,
    /// Refuse (instead of failing over to the busy filter's error) when every eligible rank is
    /// over the busy thresholds.
    pub reject_when_overloaded: bool,
    /// Keep a session's turns on its worker for this long after each turn (`None` = off).
    pub router_session_affinity_ttl_secs: Option<f64>,
    /// RL groups (requests naming a group): siblings follow the group's worker while it carries
    /// at most this many more active requests than the least-loaded eligible one; beyond that
    /// they spill to the policy's choice, which becomes the group's worker. 0 (the default) turns
    /// it off: on decode-heavy GRPO steps keeping siblings together lengthens the step (sim).
    /// Groups of a known size use a fair share of running siblings, bounded by this skew when > 0.
    pub router_group_max_skew: u32,
    /// What happens to a worker's cache picture when it starts serving another policy version:
    /// `flush` (the default) forgets it, so blocks computed under old weights never attract a
    /// new-policy request; `retain` keeps it, for users who accept cross-version KV reuse.
    pub kv_retention: KvRetention,
    /// `cost` mode: weight λ of the decode term (own decode time plus the slowdown added to the
    /// batch) against TTFT, both in seconds (default 0.5: chosen over the routing suite from
    /// 0.5 and 1, one value for every workload; docs/routing.md).
    pub router_cost_decode_weight: f64,
    /// `cost` mode: weight γ of the prefill time the request adds to the worker's queue, beyond
    /// its TTFT: the work it puts in front of later arrivals (and the cache it duplicates).
    pub router_cost_prefill_weight: f64,
    /// `cost` mode: a session's next turn stays on the worker of its last turn unless another is
    /// cheaper by more than this fraction of the best cost (soft affinity).
    pub router_cost_session_margin: f64,
    /// `cost` mode: seconds a session between turns (its requests carry a session id) counts
    /// on the worker of its last turn: its context's KV is added there in the estimates of other
    /// requests, since its next turn will decode there. Default 20; 0 turns it off
    /// (docs/routing.md, "Sessions between turns").
    pub router_cost_session_window_secs: f64,
    /// `cost` mode: weight ρ of the replica credit: a worker lacking a hot prefix that others
    /// hold is credited ρ × (requests on the prefix in the last 30 s) × (how much cheaper the
    /// next one would be there, were it a holder) / (holders + 1). Default 1; 0 turns it off
    /// (docs/routing.md).
    pub router_cost_replica_weight: f64,
    /// `cost` mode: fit each worker's step times online from observed TTFT and inter-token
    /// latency (for engines given no timing profile) instead of assuming `dynamo-poly`.
    pub router_cost_fit: bool,
    /// `cost` mode: workers given no timing profile run `dynamo-poly` this many times faster
    /// (as a mock engine's `--speedup-ratio` does; 1 = as published). The simulator hands the
    /// router each engine's own model instead.
    pub router_cost_speedup_ratio: f64,
    /// Seed of the randomized policies.
    pub seed: u64,
}

/// Least [`RouterConfig::router_cost_speedup_ratio`] (the mock engine's least speed-up).
pub(crate) const MIN_COST_SPEEDUP_RATIO: f64 = 1e-3;

/// Default of [`RouterConfig::router_index_max_blocks_per_worker`]: 262,144 blocks, 16.7 M
/// tokens at 64-token blocks, more than one GPU's KV pool holds.
pub const DEFAULT_INDEX_MAX_BLOCKS_PER_WORKER: usize = 1 << 18;

/// Default of [`RouterConfig::router_queue_max_requests`].
pub const DEFAULT_QUEUE_MAX_REQUESTS: usize = 1024;

/// Default of [`RouterConfig::router_queue_max_wait_secs`].
pub const DEFAULT_QUEUE_MAX_WAIT_SECS: f64 = 60.0;

/// KV retention across policy (weight) versions; see [`RouterConfig::kv_retention`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvRetention {
    /// Forget a worker's cached blocks when its version changes.
    #[default]
    Flush,
    /// Keep them (cross-version prefix reuse).
    Retain,
}

impl KvRetention {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            KvRetention::Flush => "flush",
            KvRetention::Retain => "retain",
        }
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        let kv = KvCostParams::default();
        Self {
            router_mode: RouterMode::Kv,
            kv_cache_block_size: 64,
            router_temperature: kv.temperature,
            router_kv_overlap_score_credit: kv.overlap_credit,
            router_kv_overlap_score_credit_decay: kv.credit_decay,
            router_prefill_load_scale: kv.prefill_load_scale,
            router_decode_active_request_weight: kv.active_request_weight,
            router_host_cache_hit_weight: kv.host_weight,
            router_disk_cache_hit_weight: kv.disk_weight,
            router_kv_events: true,
            router_ttl_secs: 120.0,
            router_max_tree_size: 1 << 20,
            router_index_max_blocks_per_worker: DEFAULT_INDEX_MAX_BLOCKS_PER_WORKER,
            router_prune_target_ratio: 0.8,
            router_predicted_ttl_secs: None,
            active_decode_blocks_threshold: None,
            active_prefill_tokens_threshold: None,
            active_prefill_tokens_threshold_frac: None,
            router_queue_threshold: None,
            router_queue_policy: QueuePolicy::Fcfs,
            router_queue_max_requests: Some(DEFAULT_QUEUE_MAX_REQUESTS),
            router_queue_max_wait_secs: DEFAULT_QUEUE_MAX_WAIT_SECS,
            router_queue_max_tokens: None,
            reject_when_overloaded: false,
            router_session_affinity_ttl_secs: None,
            router_group_max_skew: 0,
            kv_retention: KvRetention::Flush,
            router_cost_decode_weight: 0.5,
            router_cost_prefill_weight: 1.0,
            router_cost_session_margin: 0.1,
            router_cost_session_window_secs: 20.0,
            router_cost_replica_weight: 1.0,
            router_cost_fit: false,
            router_cost_speedup_ratio: 1.0,
            seed: 0,
        }
    }
}

/// A configuration value out of range; names the option.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {option}: {reason}")]
pub struct ConfigError {
    /// The option, as its flag is spelled.
    pub option: &'static str,
    /// What is wrong.
    pub reason: String,
}

fn check(ok: bool, option: &'static str, reason: impl Into<String>) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError {
            option,
            reason: reason.into(),
        })
    }
}

/// The largest KV block size, in tokens (engines use 16 to 128): the router's own
/// `--kv-cache-block-size`, a worker's advertised one, and the mock engine's. The embedded
/// engines' block arithmetic is 32-bit (2^32 became 0 and panicked their step).
pub const MAX_BLOCK_SIZE_TOKENS: usize = 1 << 16;

/// The longest duration an option takes, seconds (a year): a duration is added to the clock,
/// and a larger one (`1e20`) does not fit a `Duration` or overflows the time it is added to.
pub(crate) const MAX_DURATION_SECS: f64 = 365.0 * 86_400.0;

/// A positive number of seconds, at most [`MAX_DURATION_SECS`].
fn seconds(value: f64, option: &'static str) -> Result<(), ConfigError> {
    check(
        value.is_finite() && value > 0.0 && value <= MAX_DURATION_SECS,
        option,
        format!("{value} is not a positive number of seconds up to {MAX_DURATION_SECS} (a year)"),
    )
}

/// The longest `--router-cost-session-window-secs` (a day).
const MAX_SESSION_WINDOW_SECS: f64 = 86_400.0;

fn finite_non_negative(value: f64, option: &'static str) -> Result<(), ConfigError> {
    check(
        value.is_finite() && value >= 0.0,
        option,
        format!("{value} is not a finite number ≥ 0"),
    )
}

impl RouterConfig {
    /// The load-aware preset: KV cost with no overlap credit and no cache tracking.
    pub fn load_aware() -> Self {
        Self {
            router_kv_overlap_score_credit: 0.0,
            ..Self::default()
        }
    }

    /// Checks every value; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check(
            (1..=MAX_BLOCK_SIZE_TOKENS).contains(&self.kv_cache_block_size),
            "--kv-cache-block-size",
            format!("must be from 1 to {MAX_BLOCK_SIZE_TOKENS}"),
        )?;
        finite_non_negative(self.router_temperature, "--router-temperature")?;
        finite_non_negative(
            self.router_cost_decode_weight,
            "--router-cost-decode-weight",
        )?;
        finite_non_negative(
            self.router_cost_prefill_weight,
            "--router-cost-prefill-weight",
        )?;
        finite_non_negative(
            self.router_cost_session_margin,
            "--router-cost-session-margin",
        )?;
        let window = self.router_cost_session_window_secs;
        check(
            window.is_finite() && (0.0..=MAX_SESSION_WINDOW_SECS).contains(&window),
            "--router-cost-session-window-secs",
            format!(
                "{window} is not a number of seconds from 0 to {MAX_SESSION_WINDOW_SECS} (a day)"
            ),
        )?;
        finite_non_negative(
            self.router_cost_replica_weight,
            "--router-cost-replica-weight",
        )?;
        check(
            self.router_cost_speedup_ratio.is_finite()
                && self.router_cost_speedup_ratio >= MIN_COST_SPEEDUP_RATIO,
            "--router-cost-speedup-ratio",
            format!(
                "{} is not a finite number of at least {MIN_COST_SPEEDUP_RATIO}",
                self.router_cost_speedup_ratio
            ),
        )?;
        finite_non_negative(
            self.router_kv_overlap_score_credit,
            "--router-kv-overlap-score-credit",
        )?;
        finite_non_negative(
            self.router_kv_overlap_score_credit_decay,
            "--router-kv-overlap-score-credit-decay",
        )?;
        finite_non_negative(
            self.router_prefill_load_scale,
            "--router-prefill-load-scale",
        )?;
        finite_non_negative(
            self.router_decode_active_request_weight,
            "--router-decode-active-request-weight",
        )?;
        for (v, name) in [
            (
                self.router_host_cache_hit_weight,
                "--router-host-cache-hit-weight",
            ),
            (
                self.router_disk_cache_hit_weight,
                "--router-disk-cache-hit-weight",
            ),
        ] {
            check(
                (0.0..=1.0).contains(&v),
                name,
                format!("{v} is not in [0, 1]"),
            )?;
        }
        seconds(self.router_ttl_secs, "--router-ttl-secs")?;
        check(
            self.router_max_tree_size > 0,
            "--router-max-tree-size",
            "must be at least 1",
        )?;
        check(
            self.router_index_max_blocks_per_worker > 0,
            "--router-index-max-blocks-per-worker",
            "must be at least 1",
        )?;
        check(
            self.router_prune_target_ratio > 0.0 && self.router_prune_target_ratio < 1.0,
            "--router-prune-target-ratio",
            format!("{} is not in (0, 1)", self.router_prune_target_ratio),
        )?;
        if let Some(ttl) = self.router_predicted_ttl_secs {
            seconds(ttl, "--router-predicted-ttl-secs")?;
            check(
                self.router_kv_events,
                "--router-predicted-ttl-secs",
                "needs KV events, which --no-router-kv-events turns off (it is a side window next to the event-fed index)",
            )?;
        }
        if let Some(t) = self.active_decode_blocks_threshold {
            check(
                t.is_finite() && t >= 0.0,
                "--active-decode-blocks-threshold",
                format!("{t} is not a fraction ≥ 0"),
            )?;
        }
        if let Some(f) = self.active_prefill_tokens_threshold_frac {
            finite_non_negative(f, "--active-prefill-tokens-threshold-frac")?;
        }
        if let Some(f) = self.router_queue_threshold {
            finite_non_negative(f, "--router-queue-threshold")?;
        }
        seconds(
            self.router_queue_max_wait_secs,
            "--router-queue-max-wait-secs",
        )?;
        if let Some(ttl) = self.router_session_affinity_ttl_secs {
            seconds(ttl, "--router-session-affinity-ttl-secs")?;
        }
        Ok(())
    }

    /// The KV cost weights.
    pub fn kv_params(&self) -> KvCostParams {
        KvCostParams {
            overlap_credit: self.router_kv_overlap_score_credit,
            credit_decay: self.router_kv_overlap_score_credit_decay,
            prefill_load_scale: self.router_prefill_load_scale,
            active_request_weight: self.router_decode_active_request_weight,
            host_weight: self.router_host_cache_hit_weight,
            disk_weight: self.router_disk_cache_hit_weight,
            temperature: self.router_temperature,
        }
    }

    pub(crate) fn approx_config(&self, ttl_secs: f64) -> ApproxConfig {
        ApproxConfig {
            ttl: Duration::from_secs_f64(ttl_secs),
            max_entries: self.router_max_tree_size,
            prune_target_ratio: self.router_prune_target_ratio,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_the_documented_values() {
        let c = RouterConfig::default();
        c.validate().unwrap();
        assert_eq!(c.router_mode, RouterMode::Kv);
        assert_eq!(c.router_ttl_secs, 120.0);
        assert_eq!(c.router_max_tree_size, 1_048_576);
        assert_eq!(c.kv_params(), KvCostParams::default());
        RouterConfig::load_aware().validate().unwrap();
    }

    #[test]
    fn bad_values_name_their_flag() {
        let c = RouterConfig {
            router_temperature: -1.0,
            ..RouterConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().option, "--router-temperature");
        for size in [0, MAX_BLOCK_SIZE_TOKENS + 1, 1 << 32] {
            let c = RouterConfig {
                kv_cache_block_size: size,
                ..RouterConfig::default()
            };
            assert_eq!(c.validate().unwrap_err().option, "--kv-cache-block-size");
        }
        let c = RouterConfig {
            router_kv_events: false,
            router_predicted_ttl_secs: Some(5.0),
            ..RouterConfig::default()
        };
        assert_eq!(
            c.validate().unwrap_err().option,
            "--router-predicted-ttl-secs"
        );
    }

    #[test]
    fn configs_deserialize_from_flag_named_keys() {
        let c: RouterConfig =
            serde_json::from_str(r#"{"router_mode":"round-robin","router_predicted_ttl_secs":5}"#)
                .unwrap();
        assert_eq!(c.router_mode, RouterMode::RoundRobin);
        assert_eq!(c.router_predicted_ttl_secs, Some(5.0));
        assert!(serde_json::from_str::<RouterConfig>(r#"{"nope":1}"#).is_err());
    }

    #[test]
    fn durations_past_a_year_are_refused_naming_the_option() {
        // `1e20` s is no `Duration`: the first request with a session panicked under the
        // router's lock, and every request after it on the poisoned lock.
        type Set = fn(&mut RouterConfig, f64);
        let cases: [(&str, Set); 4] = [
            ("--router-ttl-secs", |c, v| c.router_ttl_secs = v),
            ("--router-queue-max-wait-secs", |c, v| {
                c.router_queue_max_wait_secs = v
            }),
            ("--router-session-affinity-ttl-secs", |c, v| {
                c.router_session_affinity_ttl_secs = Some(v)
            }),
            ("--router-predicted-ttl-secs", |c, v| {
                c.router_predicted_ttl_secs = Some(v)
            }),
        ];
        for (option, set) in cases {
            let mut c = RouterConfig::default();
            set(&mut c, MAX_DURATION_SECS);
            assert!(c.validate().is_ok(), "{option}: a year is accepted");
            set(&mut c, 1e20);
            assert_eq!(c.validate().unwrap_err().option, option);
        }
    }
}
