//! Routing flags shared by `serve` and `sim`, named as in the seeds' frontend.

use crate::headings as H;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{KvRetention, RouterConfig};

/// `--router-mode` when not given.
const DEFAULT_MODE: &str = "cost";

/// The routing flags.
#[derive(Debug, Args)]
pub(crate) struct RoutingArgs {
    /// Selection policy: round-robin, random, least-loaded, power-of-two, kv (Dynamo's block
    /// cost model), cost (expected seconds from the engines' timing model, docs/routing.md),
    /// direct.
    #[arg(help_heading = H::ROUTING, long, default_value = DEFAULT_MODE)]
    pub(crate) router_mode: String,
    /// `kv` mode: sampling temperature (0 = lowest cost).
    #[arg(help_heading = H::ROUTING, long, default_value_t = 0.0)]
    router_temperature: f64,
    /// `kv` mode: credit per GPU-cached block.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 1.0)]
    router_kv_overlap_score_credit: f64,
    /// `kv` mode: decay of the credit on workers with excess prefill load.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 0.0)]
    router_kv_overlap_score_credit_decay: f64,
    /// `kv` mode: weight of the prefill term.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 1.0)]
    router_prefill_load_scale: f64,
    /// `kv` mode: block-equivalent cost per active request.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 0.0)]
    router_decode_active_request_weight: f64,
    /// `kv` mode without cache credit (load only); replaces --router-mode.
    #[arg(help_heading = H::ROUTING, long)]
    load_aware: bool,
    /// Predict cache state from routing decisions instead of engine KV events.
    #[arg(help_heading = H::KV_EVENTS, long)]
    no_router_kv_events: bool,
    /// Predicted-placement window next to the event-fed index, seconds.
    #[arg(help_heading = H::KV_EVENTS, long)]
    router_predicted_ttl_secs: Option<f64>,
    /// Time-to-live of predicted blocks without KV events, seconds.
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 120.0)]
    router_ttl_secs: f64,
    /// Most (block, rank) entries of predicted cache state (no KV events); past it the oldest
    /// are pruned.
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 1 << 20)]
    router_max_tree_size: usize,
    /// What pruning past --router-max-tree-size brings the predicted entries down to, as a
    /// fraction of it (0 < ratio < 1).
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 0.8)]
    router_prune_target_ratio: f64,
    /// A worker is busy above this fraction of its KV capacity in active decode blocks.
    #[arg(help_heading = H::ADMISSION, long)]
    active_decode_blocks_threshold: Option<f64>,
    /// A worker is busy above this many active prefill tokens.
    #[arg(help_heading = H::ADMISSION, long)]
    active_prefill_tokens_threshold: Option<u64>,
    /// A worker is busy above this fraction of its max_num_batched_tokens in prefill tokens.
    #[arg(help_heading = H::ADMISSION, long)]
    active_prefill_tokens_threshold_frac: Option<f64>,
    /// Queue requests while every eligible worker's active prefill tokens exceed this fraction
    /// of its max_num_batched_tokens (unset = no router queue).
    #[arg(help_heading = H::ADMISSION, long)]
    router_queue_threshold: Option<f64>,
    /// Order of the router queue: fcfs, wspt, priority or group-tail (RL groups closest to done
    /// first).
    #[arg(help_heading = H::ADMISSION, long, default_value = "fcfs")]
    router_queue_policy: String,
    /// Most requests waiting in the router queue (beyond: HTTP 529).
    #[arg(help_heading = H::ADMISSION, long, default_value_t = kvrouter_core::router::DEFAULT_QUEUE_MAX_REQUESTS)]
    router_queue_max_requests: usize,
    /// Longest a request waits in the router queue, for load, a policy version or a paused
    /// worker; then it fails (HTTP 503 naming what it waited for).
    #[arg(help_heading = H::ADMISSION, long, default_value_t = kvrouter_core::router::DEFAULT_QUEUE_MAX_WAIT_SECS)]
    router_queue_max_wait_secs: f64,
    /// Most prompt tokens waiting in the router queue (beyond: HTTP 529).
    #[arg(help_heading = H::ADMISSION, long)]
    router_queue_max_tokens: Option<u64>,
    /// Answer HTTP 529 (instead of 503) when every eligible worker is over the busy thresholds.
    #[arg(help_heading = H::ADMISSION, long)]
    reject_when_overloaded: bool,
    /// Keep a session's turns (x-session-id) on its worker for this long after each turn.
    #[arg(help_heading = H::SESSIONS, long)]
    router_session_affinity_ttl_secs: Option<f64>,
    /// RL groups (x-kvrouter-group-id): siblings follow their group's worker while it carries at
    /// most this many more active requests than the least-loaded one (0 = off)
    #[arg(help_heading = H::RL, long, default_value_t = 0)]
    router_group_max_skew: u32,
    /// KV retention across policy versions: flush (forget a worker's cached blocks when it loads
    /// new weights) or retain (keep cross-version prefix reuse).
    #[arg(help_heading = H::RL, long, default_value = "flush")]
    kv_retention: String,
    /// Most blocks the index keeps per worker rank and tier when the worker declares no
    /// kv_capacity_blocks (a declared capacity bounds it instead); beyond it the oldest leaves
    /// are evicted (kvrouter_index_evictions_total).
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = kvrouter_core::router::DEFAULT_INDEX_MAX_BLOCKS_PER_WORKER)]
    router_index_max_blocks_per_worker: usize,
    /// `cost` mode: weight of the decode term (own decode time plus the slowdown added to the
    /// batch, seconds) against TTFT.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 0.5)]
    router_cost_decode_weight: f64,
    /// `cost` mode: weight of the prefill time the request adds to the worker's queue, beyond
    /// its TTFT (the work it puts in front of later arrivals).
    #[arg(help_heading = H::ROUTING, long, default_value_t = 1.0)]
    router_cost_prefill_weight: f64,
    /// `cost` mode: a session (x-session-id) moves off the worker of its last turn only when
    /// another is cheaper by more than this fraction.
    #[arg(help_heading = H::SESSIONS, long, default_value_t = 0.1)]
    router_cost_session_margin: f64,
    /// `cost` mode: seconds a session between turns counts on the worker of its last turn (its
    /// context's KV, which its next turn will decode beside), in the placement of other requests
    /// (0: off; at most 86400).
    #[arg(help_heading = H::SESSIONS, long, default_value_t = 20.0)]
    router_cost_session_window_secs: f64,
    /// `cost` mode: weight of the replica credit, which lets a worker copy a hot prefix that
    /// other workers hold when the next requests on it would be served sooner there (0: off).
    #[arg(help_heading = H::ROUTING, long, default_value_t = 1.0)]
    router_cost_replica_weight: f64,
    /// `cost` mode: fit each worker's step times online from the TTFT and inter-token latency
    /// the router observes, instead of assuming the dynamo-poly profile.
    #[arg(help_heading = H::ROUTING, long)]
    router_cost_fit: bool,
    /// `cost` mode in `serve`: the workers run dynamo-poly this many times faster (as
    /// `kvrouter mock-engine --speedup-ratio` does). `serve --mock-workers` sets it to
    /// --mock-speedup-ratio unless given; `sim` gives the router each engine's own model.
    #[arg(help_heading = H::ROUTING, long)]
    pub(crate) router_cost_speedup_ratio: Option<f64>,
    /// KV block size in tokens; must match the engines.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 64)]
    pub(crate) kv_cache_block_size: usize,
    /// Seed of the randomized policies.
    #[arg(help_heading = H::ROUTING, long, default_value_t = 0)]
    pub(crate) seed: u64,
}

impl RoutingArgs {
    /// Flags that `--load-aware` overrides (it is `kv` mode with no cache credit).
    fn load_aware_warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.load_aware {
            return out;
        }
        if self.router_mode != DEFAULT_MODE {
            out.push(format!(
                "--router-mode {} is replaced by --load-aware (kv mode without cache credit)",
                self.router_mode
            ));
        }
        if self.router_kv_overlap_score_credit != 1.0 {
            out.push(
                "--router-kv-overlap-score-credit is set but --load-aware replaces it with 0"
                    .to_owned(),
            );
        }
        out
    }

    /// Warnings for the routing flags a command running the router `modes` does not read:
    /// what `--load-aware` replaces, and settings no mode of `modes` reads.
    pub(crate) fn mode_warnings(&self, modes: &[RouterMode]) -> anyhow::Result<Vec<String>> {
        let mut out = self.load_aware_warnings();
        out.extend(unread_warnings(&self.given()?, modes));
        Ok(out)
    }

    /// Warnings for the routing flags `serve --global` does not read: `--global-policy`
    /// places requests, and each cluster's own router routes within it.
    pub(crate) fn global_warnings(&self) -> anyhow::Result<Vec<String>> {
        let mut flags = self.given()?.moved_mode_settings();
        if self.router_mode != DEFAULT_MODE {
            flags.insert(0, "--router-mode");
        }
        if self.load_aware {
            flags.insert(0, "--load-aware");
        }
        Ok(flags
            .into_iter()
            .map(|f| {
                format!("{f} is not read by serve --global: --global-policy places requests, each cluster's own router routes within it")
            })
            .collect())
    }

    /// The configuration as the flags give it: [`RoutingArgs::config`] with `--load-aware`'s
    /// zero credit undone (what the unread-flag warnings compare with the defaults, so the
    /// credit is named only when a user set it).
    fn given(&self) -> anyhow::Result<RouterConfig> {
        let mut c = self.config()?;
        c.router_kv_overlap_score_credit = self.router_kv_overlap_score_credit;
        Ok(c)
    }

    pub(crate) fn config(&self) -> anyhow::Result<RouterConfig> {
        let mode: RouterMode = self.router_mode.parse().context("--router-mode")?;
        let mut router = RouterConfig {
            router_mode: mode,
            kv_cache_block_size: self.kv_cache_block_size,
            router_temperature: self.router_temperature,
            router_kv_overlap_score_credit: self.router_kv_overlap_score_credit,
            router_kv_overlap_score_credit_decay: self.router_kv_overlap_score_credit_decay,
            router_prefill_load_scale: self.router_prefill_load_scale,
            router_decode_active_request_weight: self.router_decode_active_request_weight,
            router_kv_events: !self.no_router_kv_events,
            router_ttl_secs: self.router_ttl_secs,
            router_max_tree_size: self.router_max_tree_size,
            router_prune_target_ratio: self.router_prune_target_ratio,
            router_index_max_blocks_per_worker: self.router_index_max_blocks_per_worker,
            router_predicted_ttl_secs: self.router_predicted_ttl_secs,
            active_decode_blocks_threshold: self.active_decode_blocks_threshold,
            active_prefill_tokens_threshold: self.active_prefill_tokens_threshold,
            active_prefill_tokens_threshold_frac: self.active_prefill_tokens_threshold_frac,
            router_queue_threshold: self.router_queue_threshold,
            router_queue_policy: self
                .router_queue_policy
                .parse()
                .context("--router-queue-policy")?,
            router_queue_max_requests: Some(self.router_queue_max_requests),
            router_queue_max_wait_secs: self.router_queue_max_wait_secs,
            router_queue_max_tokens: self.router_queue_max_tokens,
            reject_when_overloaded: self.reject_when_overloaded,
            router_session_affinity_ttl_secs: self.router_session_affinity_ttl_secs,
            router_group_max_skew: self.router_group_max_skew,
            kv_retention: match self.kv_retention.as_str() {
                "flush" => KvRetention::Flush,
                "retain" => KvRetention::Retain,
                other => anyhow::bail!("--kv-retention: `{other}` is not flush or retain"),
            },
            router_cost_decode_weight: self.router_cost_decode_weight,
            router_cost_prefill_weight: self.router_cost_prefill_weight,
            router_cost_session_margin: self.router_cost_session_margin,
            router_cost_session_window_secs: self.router_cost_session_window_secs,
            router_cost_replica_weight: self.router_cost_replica_weight,
            router_cost_fit: self.router_cost_fit,
            router_cost_speedup_ratio: self.router_cost_speedup_ratio.unwrap_or(1.0),
            seed: self.seed,
            ..RouterConfig::default()
        };
        if self.load_aware {
            router.router_mode = RouterMode::Kv;
            router.router_kv_overlap_score_credit = 0.0;
        }
        router.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(router)
    }
}

/// One warning per routing flag given a value that none of the router configurations a command
/// runs reads (`base` is the configuration of the flags alone, `runs` the modes the command runs:
/// a `kv` weight under the default `cost` mode, a `cost` weight under `--router-mode kv`).
fn unread_warnings(base: &RouterConfig, runs: &[RouterMode]) -> Vec<String> {
    let mut modes: Vec<String> = Vec::new();
    for m in runs {
        if !modes.contains(&m.to_string()) {
            modes.push(m.to_string());
        }
    }
    base.moved_mode_settings()
        .into_iter()
        .filter(|flag| runs.iter().all(|m| !RouterConfig::mode_reads(*m, flag)))
        .map(|flag| {
            format!(
                "{flag} is set but the router mode in effect ({}) does not read it",
                modes.join(", ")
            )
        })
        .collect()
}

/// Applies a `--compare` item: `MODE[:key=value[:key=value...]]`, keys named like the flags in
/// snake case (`kv:router_predicted_ttl_secs=5`).
pub(crate) fn apply_compare_item(base: &RouterConfig, item: &str) -> anyhow::Result<RouterConfig> {
    let mut parts = item.split(':');
    let mode = parts.next().unwrap_or_default();
    let mut value = serde_json::to_value(base)?;
    let mode: RouterMode = mode
        .parse()
        .with_context(|| format!("--compare item {item:?}"))?;
    value["router_mode"] = serde_json::to_value(mode)?;
    let mut seen: Vec<&str> = Vec::new();
    for kv in parts {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--compare item {item:?}: {kv:?} is not key=value"))?;
        if seen.contains(&k) {
            bail!("--compare item {item:?}: {k} is given twice");
        }
        seen.push(k);
        if k == "router_mode" {
            // The mode is the item's head; a second one would run under the first's label.
            bail!(
                "--compare item {item:?}: the mode is the item's first part (`{v}:...`), not a key"
            );
        }
        let parsed: serde_json::Value =
            serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_owned()));
        value[k] = parsed;
    }
    let config: RouterConfig =
        serde_json::from_value(value).with_context(|| format!("--compare item {item:?}"))?;
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("--compare item {item:?}: {e}"))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_is_reported_only_when_no_run_reads_it() {
        let base = RouterConfig {
            router_mode: RouterMode::Cost,
            router_kv_overlap_score_credit: 2.0,
            ..RouterConfig::default()
        };
        assert_eq!(
            unread_warnings(&base, &[RouterMode::Cost, RouterMode::Cost]),
            ["--router-kv-overlap-score-credit is set but the router mode in effect (cost) does not read it"]
        );
        assert!(unread_warnings(&base, &[RouterMode::Cost, RouterMode::Kv]).is_empty());
        // The runs decide, not the base mode (`sim --compare`): kv reads it, round-robin not.
        let kv = RouterConfig {
            router_mode: RouterMode::Kv,
            ..base.clone()
        };
        assert_eq!(
            unread_warnings(&kv, &[RouterMode::RoundRobin, RouterMode::Cost]),
            ["--router-kv-overlap-score-credit is set but the router mode in effect (round-robin, cost) does not read it"]
        );
        // A value the command derived (not given as a flag) is not the user's to hear about.
        let flags = RouterConfig {
            router_mode: RouterMode::Kv,
            ..RouterConfig::default()
        };
        assert!(unread_warnings(&flags, &[RouterMode::Kv]).is_empty());
    }

    fn args(flags: &[&str]) -> RoutingArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            routing: RoutingArgs,
        }
        let argv = std::iter::once("kvrouter").chain(flags.iter().copied());
        <Cli as clap::Parser>::parse_from(argv).routing
    }

    #[test]
    fn the_predicted_index_bounds_are_flags_and_bad_values_name_them() {
        let c = args(&[
            "--router-max-tree-size",
            "5000",
            "--router-prune-target-ratio",
            "0.5",
        ])
        .config()
        .unwrap();
        assert_eq!(
            (c.router_max_tree_size, c.router_prune_target_ratio),
            (5000, 0.5)
        );
        let defaults = args(&[]).config().unwrap();
        assert_eq!(
            defaults.router_max_tree_size,
            RouterConfig::default().router_max_tree_size
        );
        for (flag, value) in [
            ("--router-max-tree-size", "0"),
            ("--router-prune-target-ratio", "1"),
            ("--router-prune-target-ratio", "0"),
        ] {
            let e = args(&[flag, value]).config().unwrap_err().to_string();
            assert!(e.contains(flag), "{flag} {value}: {e}");
        }
    }

    #[test]
    fn load_aware_names_what_it_replaces() {
        assert!(args(&["--load-aware"]).load_aware_warnings().is_empty());
        assert!(args(&["--router-kv-overlap-score-credit", "3"])
            .load_aware_warnings()
            .is_empty());
        let w = args(&[
            "--load-aware",
            "--router-kv-overlap-score-credit",
            "3",
            "--router-mode",
            "round-robin",
        ])
        .load_aware_warnings();
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("--router-mode round-robin is replaced by --load-aware"));
        assert!(w[1].starts_with("--router-kv-overlap-score-credit is set but --load-aware"));
    }

    #[test]
    fn serve_global_names_the_routing_flags_it_does_not_read() {
        assert!(args(&[]).global_warnings().unwrap().is_empty());
        // --load-aware's own zero credit is not a flag the user set.
        assert_eq!(
            args(&["--load-aware"]).global_warnings().unwrap().len(),
            1,
            "only --load-aware itself"
        );
        let w = args(&[
            "--router-mode",
            "kv",
            "--router-temperature",
            "0.5",
            "--router-cost-fit",
        ])
        .global_warnings()
        .unwrap();
        let flags: Vec<&str> = w.iter().map(|m| m.split(' ').next().unwrap()).collect();
        assert_eq!(
            flags,
            ["--router-mode", "--router-temperature", "--router-cost-fit"]
        );
        assert!(w[0].ends_with("each cluster's own router routes within it"));
    }
}
