//! The global policies and their configuration.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// How the global router picks a cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GlobalPolicy {
    /// Each session goes to a fixed cluster chosen by its id, in proportion to the clusters'
    /// weights (today's practice: a fixed share of rollouts per datacenter).
    StaticSplit,
    /// Every request to the cluster with the fewest requests (active, queued and sent since its
    /// last summary) per batch slot; blind to cache, so sessions follow the load.
    LeastLoaded,
    /// Lowest estimated time (network round trip + queue + uncached prefill at the cluster's
    /// speed + decode), with the cached prefix read from each cluster's sketch; sessions stay
    /// in their cluster unless another is clearly cheaper.
    #[default]
    Kv,
}

impl GlobalPolicy {
    /// Every policy, in documentation order.
    pub const ALL: [GlobalPolicy; 3] = [
        GlobalPolicy::StaticSplit,
        GlobalPolicy::LeastLoaded,
        GlobalPolicy::Kv,
    ];

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            GlobalPolicy::StaticSplit => "static-split",
            GlobalPolicy::LeastLoaded => "least-loaded",
            GlobalPolicy::Kv => "kv",
        }
    }
}

impl fmt::Display for GlobalPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is not one of [`GlobalPolicy::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown global policy {0:?}: expected static-split, least-loaded or kv")]
pub struct UnknownGlobalPolicy(pub String);

impl FromStr for GlobalPolicy {
    type Err = UnknownGlobalPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GlobalPolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownGlobalPolicy(s.to_owned()))
    }
}

/// Default bound on a summary's age (time since it was received) before its cluster is routed
/// around: 10 s.
pub const DEFAULT_MAX_SUMMARY_AGE: Duration = Duration::from_secs(10);
/// Default hysteresis: a session moves only when another cluster's estimate is below this
/// fraction of its home cluster's.
pub const DEFAULT_SESSION_MOVE_RATIO: f64 = 0.5;
/// Default idle time after which a session's home is forgotten: 1 h.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(3600);
/// Prefill speed assumed for a summary that states none (0), tokens/s per worker.
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 10_000.0;
/// Output tokens assumed when a request gives no hint, for the decode part of the estimate.
pub const DEFAULT_OUTPUT_TOKENS_HINT: u64 = 256;
/// Default window over which the global router measures the prefill work it sends each
/// cluster (tokens/s): 5 s.
pub const DEFAULT_LOAD_WINDOW: Duration = Duration::from_secs(5);

/// The global router's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalConfig {
    /// The policy.
    pub policy: GlobalPolicy,
    /// A cluster whose last summary arrived longer ago than this is routed around.
    #[serde(with = "secs")]
    pub max_summary_age: Duration,
    /// Hysteresis for sessions (0 < ratio ≤ 1; 1 = no hysteresis).
    pub session_move_ratio: f64,
    /// Sessions idle this long lose their home.
    #[serde(with = "secs")]
    pub session_ttl: Duration,
    /// The prefill work sent to a cluster over this window (tokens/s, against its prefill
    /// capacity) is the share of its workers' time that prefill steps take from decode.
    #[serde(with = "secs")]
    pub load_window: Duration,
}

mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

impl Default for GlobalConfig {
    fn default() -> Self {
        Self {
            policy: GlobalPolicy::default(),
            max_summary_age: DEFAULT_MAX_SUMMARY_AGE,
            session_move_ratio: DEFAULT_SESSION_MOVE_RATIO,
            session_ttl: DEFAULT_SESSION_TTL,
            load_window: DEFAULT_LOAD_WINDOW,
        }
    }
}

/// A configuration that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GlobalConfigError {
    /// `session_move_ratio` outside (0, 1].
    #[error("session move ratio must be in (0, 1]")]
    MoveRatio,
    /// A zero age bound or session TTL.
    #[error("{0} must be positive")]
    ZeroDuration(&'static str),
}

impl GlobalConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), GlobalConfigError> {
        if !(self.session_move_ratio > 0.0 && self.session_move_ratio <= 1.0) {
            return Err(GlobalConfigError::MoveRatio);
        }
        if self.max_summary_age.is_zero() {
            return Err(GlobalConfigError::ZeroDuration("max summary age"));
        }
        if self.session_ttl.is_zero() {
            return Err(GlobalConfigError::ZeroDuration("session ttl"));
        }
        if self.load_window.is_zero() {
            return Err(GlobalConfigError::ZeroDuration("load window"));
        }
        Ok(())
    }
}
