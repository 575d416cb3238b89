//! The clusters file (`kvrouter sim --clusters FILE`, TOML) and the global simulation's
//! settings.

use kvrouter_core::global::{GlobalConfig, GlobalPolicy, SketchConfig, MAX_CLUSTER_WEIGHT};
use kvrouter_core::router::RouterConfig;
use kvrouter_engine::EngineConfig;
use serde::{Deserialize, Serialize};

/// Default period between a cluster's summaries, ms.
pub const DEFAULT_SUMMARY_REFRESH_MS: f64 = 1000.0;

/// The clusters file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClustersFile {
    /// Global router settings.
    #[serde(default)]
    pub global: GlobalSection,
    /// The clusters (datacenters), in order.
    #[serde(rename = "cluster")]
    pub clusters: Vec<ClusterEntry>,
}

/// `[global]`: the global router.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalSection {
    /// Default summary refresh period for clusters that do not set one, ms.
    pub summary_refresh_ms: f64,
    /// A summary older than this (since it arrived) is routed around, seconds.
    pub max_summary_age_s: f64,
    /// Session hysteresis (see `GlobalConfig::session_move_ratio`).
    pub session_move_ratio: f64,
    /// Checkpoint interval of the prefix sketch, blocks.
    pub checkpoint_interval_blocks: u32,
    /// Sketch bits per key.
    pub bits_per_key: u32,
    /// Window of the prefill work sent per cluster that the kv estimate charges to decode
    /// (see `GlobalConfig::load_window`), seconds.
    pub load_window_s: f64,
    /// The output length the global router is told per request.
    pub output_hint: OutputHint,
}

/// What the global router knows of a request's output length (`[global] output_hint`).
/// Read from its name only (`"learned"` or `"max-tokens"`): serde's derived form would also take
/// a table such as `{ learned = {} }`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputHint {
    /// Nothing: the global router's running mean of finished outputs (clients that send no
    /// `max_tokens`, or a cap far above what they generate).
    #[default]
    Learned,
    /// The request's own output length, as a client sending `max_tokens` equal to it (what
    /// `kvrouter bench` sends, with `min_tokens` and `ignore_eos`, and what `serve --global`
    /// reads as the request's hint).
    MaxTokens,
}

impl<'de> Deserialize<'de> for OutputHint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = OutputHint;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"learned\" or \"max-tokens\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OutputHint, E> {
                match v {
                    "learned" => Ok(OutputHint::Learned),
                    "max-tokens" => Ok(OutputHint::MaxTokens),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
        }
        d.deserialize_str(Name)
    }
}

impl OutputHint {
    /// The hint for a request of `output_tokens`.
    pub fn for_request(self, output_tokens: u32) -> Option<u64> {
        match self {
            Self::Learned => None,
            Self::MaxTokens => Some(u64::from(output_tokens.max(1))),
        }
    }
}

impl Default for GlobalSection {
    fn default() -> Self {
        let g = GlobalConfig::default();
        let s = SketchConfig::default();
        Self {
            summary_refresh_ms: DEFAULT_SUMMARY_REFRESH_MS,
            max_summary_age_s: g.max_summary_age.as_secs_f64(),
            session_move_ratio: g.session_move_ratio,
            checkpoint_interval_blocks: s.checkpoint_interval_blocks,
            bits_per_key: s.bits_per_key,
            load_window_s: g.load_window.as_secs_f64(),
            output_hint: OutputHint::default(),
        }
    }
}

/// `[[cluster]]`: one datacenter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterEntry {
    /// Name.
    pub name: String,
    /// Engine workers.
    pub workers: usize,
    /// Timing profile of its workers (`dynamo-poly`, a built-in profile or a JSON file).
    #[serde(default = "poly")]
    pub profile: String,
    /// Speed factor on the profile (< 1: older, slower GPUs).
    #[serde(default = "one")]
    pub speed: f64,
    /// One-way network delay between the global router (and clients) and this cluster, ms.
    #[serde(default)]
    pub network_delay_ms: f64,
    /// Summary refresh period, ms (default: `[global] summary_refresh_ms`).
    pub summary_refresh_ms: Option<f64>,
    /// Share of sessions under static-split (default: its worker count).
    pub weight: Option<f64>,
    /// Most requests running per engine here (default: `--max-num-seqs`).
    pub max_num_seqs: Option<usize>,
    /// KV capacity per engine here, blocks (default: `--num-gpu-blocks`).
    pub num_gpu_blocks: Option<usize>,
}

/// A day, in seconds: the bound of the file's times and periods.
const DAY_S: f64 = 86_400.0;

fn poly() -> String {
    "dynamo-poly".into()
}

fn one() -> f64 {
    1.0
}

impl ClustersFile {
    /// Checks ranges; the message names the field and cluster.
    pub fn validate(&self) -> Result<(), String> {
        if self.clusters.is_empty() {
            return Err("no [[cluster]] entries".into());
        }
        let g = &self.global;
        let pos = |v: f64| v.is_finite() && v > 0.0;
        // Periods from 1 ms (a shorter one would stall the run on summaries) to a day; times in
        // seconds up to a day: past that a value is a typo, and overflows a duration.
        let period_ms = |v: f64| v.is_finite() && (1.0..=DAY_S * 1e3).contains(&v);
        let secs = |v: f64| pos(v) && v <= DAY_S;
        if !period_ms(g.summary_refresh_ms) {
            return Err("[global] summary_refresh_ms must be from 1 to 86400000".into());
        }
        if !secs(g.max_summary_age_s) {
            return Err("[global] max_summary_age_s must be positive, at most 86400".into());
        }
        if !secs(g.load_window_s) {
            return Err("[global] load_window_s must be positive, at most 86400".into());
        }
        if !(g.session_move_ratio > 0.0 && g.session_move_ratio <= 1.0) {
            return Err("[global] session_move_ratio must be in (0, 1]".into());
        }
        if g.checkpoint_interval_blocks == 0 || g.bits_per_key == 0 || g.bits_per_key > 64 {
            return Err(
                "[global] checkpoint_interval_blocks ≥ 1 and bits_per_key in 1..=64".into(),
            );
        }
        for (i, c) in self.clusters.iter().enumerate() {
            let at = format!("[[cluster]] {i} ({:?})", c.name);
            if c.workers == 0 || c.workers > crate::MAX_WORKERS {
                return Err(format!(
                    "{at}: workers must be from 1 to {}",
                    crate::MAX_WORKERS
                ));
            }
            if !(c.speed.is_finite() && (1e-3..=1e3).contains(&c.speed)) {
                return Err(format!("{at}: speed must be from 0.001 to 1000"));
            }
            if !(c.network_delay_ms.is_finite()
                && (0.0..=DAY_S * 1e3).contains(&c.network_delay_ms))
            {
                return Err(format!("{at}: network_delay_ms must be from 0 to 86400000"));
            }
            if c.summary_refresh_ms.is_some_and(|v| !period_ms(v)) {
                return Err(format!(
                    "{at}: summary_refresh_ms must be from 1 to 86400000"
                ));
            }
            if c.max_num_seqs == Some(0)
                || c.num_gpu_blocks == Some(0)
                || c.num_gpu_blocks > Some(kvrouter_engine::MAX_NUM_GPU_BLOCKS)
            {
                return Err(format!(
                    "{at}: max_num_seqs and num_gpu_blocks must be at least 1"
                ));
            }
            if c.weight
                .is_some_and(|v| !(v > 0.0 && v <= MAX_CLUSTER_WEIGHT))
            {
                return Err(format!(
                    "{at}: weight must be above 0 and at most {MAX_CLUSTER_WEIGHT}"
                ));
            }
            // As `serve --cluster` takes them: names tell the report's rows apart.
            let ok_name = |ch: char| ch.is_ascii_alphanumeric() || "_-.".contains(ch);
            if c.name.is_empty() || c.name.len() > 64 || !c.name.chars().all(ok_name) {
                return Err(format!(
                    "{at}: name must be 1 to 64 letters, digits, `_`, `-` or `.`"
                ));
            }

            if self.clusters[..i].iter().any(|o| o.name == c.name) {
                return Err(format!("{at}: duplicate name"));
            }
        }
        // A summary is taken fresh for max_summary_age_s after it arrives: a cluster refreshed
        // less often goes stale between summaries (a scenario worth simulating), but with every
        // cluster so, requests find none fresh most of the time and wait for one.
        let age_ms = g.max_summary_age_s * 1e3;
        if self
            .clusters
            .iter()
            .all(|c| c.summary_refresh_ms.unwrap_or(g.summary_refresh_ms) >= age_ms)
        {
            return Err(format!(
                "every cluster's summary_refresh_ms (default [global] summary_refresh_ms, {} ms) \
                 is at least [global] max_summary_age_s ({} s): every cluster would go stale \
                 between its summaries; refresh one more often or raise max_summary_age_s",
                g.summary_refresh_ms, g.max_summary_age_s
            ));
        }
        Ok(())
    }

    /// The global router's configuration for a policy.
    pub fn global_config(&self, policy: GlobalPolicy) -> GlobalConfig {
        GlobalConfig {
            policy,
            max_summary_age: std::time::Duration::from_secs_f64(self.global.max_summary_age_s),
            session_move_ratio: self.global.session_move_ratio,
            load_window: std::time::Duration::from_secs_f64(self.global.load_window_s),
            ..GlobalConfig::default()
        }
    }

    /// The sketch settings.
    pub fn sketch(&self) -> SketchConfig {
        SketchConfig {
            checkpoint_interval_blocks: self.global.checkpoint_interval_blocks,
            bits_per_key: self.global.bits_per_key,
            ..SketchConfig::default()
        }
    }
}

/// Everything a global run needs besides the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalSimConfig {
    /// The clusters.
    pub clusters: ClustersFile,
    /// The global policy.
    pub policy: GlobalPolicy,
    /// Each cluster's local router (the same tree `kvrouter serve` uses).
    pub router: RouterConfig,
    /// Engine sizes and limits.
    pub engine: EngineConfig,
    /// Delay from a block being cached to its local router seeing it, ms.
    pub kv_event_delay_ms: f64,
    /// Sessions in flight within an RL step (`None`: all at once).
    pub sessions_in_flight: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::OutputHint;

    #[derive(Debug, serde::Deserialize)]
    struct Section {
        output_hint: OutputHint,
    }

    fn read(text: &str) -> Result<OutputHint, String> {
        serde_json::from_str::<Section>(text)
            .map(|s| s.output_hint)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn an_output_hint_is_one_of_two_names_and_a_bad_one_lists_them() {
        let hint = |v: &str| read(&format!("{{\"output_hint\": {v}}}"));
        assert_eq!(hint("\"learned\""), Ok(OutputHint::Learned));
        assert_eq!(hint("\"max-tokens\""), Ok(OutputHint::MaxTokens));
        // The derived reading took `{ learned = {} }` (TOML) as "learned".
        for bad in [
            "{\"learned\": {}}",
            "{\"learned\": null}",
            "\"max_tokens\"",
            "1",
        ] {
            let e = hint(bad).expect_err(bad);
            assert!(e.contains("\"learned\" or \"max-tokens\""), "{bad}: {e}");
        }
    }
}
