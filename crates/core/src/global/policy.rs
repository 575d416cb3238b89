//! The global policies and their configuration.

use super::estimate::ClusterEstimate;
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
        Ok(())
    }
}

/// Whether a session leaves its eligible `home` for `best`, the cheapest eligible cluster
/// (whose estimate already includes prefilling the session's whole context again there).
///
/// * While `best` has no free batch slot (every cluster full, the busy part of an RL step):
///   only when `best` costs less than `ratio` × the home's whole cost. A move then only trades
///   one queue for another, and the re-prefill it costs is work taken from full clusters.
/// * When `best` has a free slot (idle capacity, the step's tail): when the move saves more
///   than `1 − ratio` of the home's time to first token, `home.cost − best.cost > (1 − ratio) ×
///   home.ttft`. The margin covers the part of the estimate that comes from a summary up to
///   one refresh old (round trip, queue, prefill); the decode the session saves on an idle or
///   faster cluster is not discounted, so sessions follow idle capacity.
pub fn session_moves(home: &ClusterEstimate, best: &ClusterEstimate, ratio: f64) -> bool {
    if best.slot_wait_ms > 0.0 {
        best.cost_ms() < ratio * home.cost_ms()
    } else {
        home.cost_ms() - best.cost_ms() > (1.0 - ratio) * home.ttft_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::global::ClusterId;
    use proptest::prelude::*;

    fn at(rtt_ms: f64, queue_ms: f64, prefill_ms: f64, decode_ms: f64) -> ClusterEstimate {
        ClusterEstimate {
            rtt_ms,
            queue_ms,
            prefill_ms,
            decode_ms,
            eligible: true,
            ..ClusterEstimate::ineligible(ClusterId(0))
        }
    }

    fn full(mut e: ClusterEstimate) -> ClusterEstimate {
        e.slot_wait_ms = e.queue_ms.max(1.0);
        e
    }

    /// A session on a half-speed cluster 80 ms away, 200 output tokens at 40 ms a token, while
    /// a full-speed cluster 5 ms away has free slots: re-prefilling its 8k context there
    /// (0.4 s) costs far less than the 4 s of decode it saves. The earlier rule
    /// (`best.cost < ratio × home.cost`: 4,410 ms against 0.5 × 8,170 ms) kept it home.
    #[test]
    fn a_session_follows_idle_capacity_when_decode_saves_more_than_the_re_prefill() {
        let home = at(160.0, 0.0, 10.0, 8_000.0);
        let idle = at(10.0, 0.0, 400.0, 4_000.0);
        assert!(idle.cost_ms() >= DEFAULT_SESSION_MOVE_RATIO * home.cost_ms());
        assert!(session_moves(&home, &idle, DEFAULT_SESSION_MOVE_RATIO));
        // The same cluster without a free slot: only the whole-cost ratio moves it.
        assert!(!session_moves(
            &home,
            &full(idle),
            DEFAULT_SESSION_MOVE_RATIO
        ));
        // Same speed: an idle cluster saves the round trip, less than the re-prefill: stay.
        let same = at(10.0, 0.0, 400.0, 8_000.0);
        assert!(!session_moves(&home, &same, DEFAULT_SESSION_MOVE_RATIO));
    }

    /// A queued home and an idle cluster of the same speed: the move must save more than
    /// half the home's time to first token.
    #[test]
    fn a_queue_alone_moves_a_session_to_idle_capacity_only_past_the_margin() {
        let idle = at(10.0, 0.0, 400.0, 4_000.0);
        // Home waits 0.7 s: saving 300 ms < 0.5 × 710 ms.
        assert!(!session_moves(&at(10.0, 700.0, 0.0, 4_000.0), &idle, 0.5));
        // Home waits 2 s: saving 1,600 ms > 0.5 × 2,010 ms.
        assert!(session_moves(&at(10.0, 2_000.0, 0.0, 4_000.0), &idle, 0.5));
    }

    proptest! {
        /// A move never makes the turn dearer; ratio 1 moves whenever cheaper; a slower home
        /// (more decode, all else equal) never keeps a session a faster one would lose.
        #[test]
        fn moves_save_time_and_grow_with_the_home_decode(
            h in (0.0f64..200.0, 0.0f64..20_000.0, 0.0f64..5_000.0, 0.0f64..20_000.0),
            b in (0.0f64..200.0, 0.0f64..20_000.0, 0.0f64..5_000.0, 0.0f64..20_000.0),
            best_full in any::<bool>(),
            ratio in 0.01f64..=1.0,
            extra in 0.0f64..10_000.0,
        ) {
            let home = at(h.0, h.1, h.2, h.3);
            let best = if best_full { full(at(b.0, b.1, b.2, b.3)) } else { at(b.0, b.1, b.2, b.3) };
            let moves = session_moves(&home, &best, ratio);
            prop_assert!(!moves || best.cost_ms() < home.cost_ms());
            prop_assert_eq!(session_moves(&home, &best, 1.0), best.cost_ms() < home.cost_ms());
            let slower = at(h.0, h.1, h.2, h.3 + extra);
            prop_assert!(!moves || session_moves(&slower, &best, ratio));
            // Idle capacity never holds a session back that a full cluster would take.
            let mut idle = best;
            idle.slot_wait_ms = 0.0;
            prop_assert!(!moves || !best_full || session_moves(&home, &idle, ratio));
        }
    }
}
