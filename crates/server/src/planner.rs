//! The planner's advisory mode (`--planner-advise`): every tick, each model pool's live signals
//! from the router (requests in flight and queued, active prefill tokens and decode blocks
//! against the workers' capacity, windowed TTFT p99 and mean ITL against their targets) go
//! through the core's control law ([`kvrouter_core::planner`], the one `kvrouter sim
//! --planner` runs), and the recommendation is shown at `GET /admin/planner` (with its reasons)
//! and as `kvrouter_planner_recommended_workers{pool=...}`. Nothing is scaled: advice only.

use crate::config::PlannerAdvice;
use kvrouter_core::ids::WorkerId;
use kvrouter_core::planner::{Planner, PoolSignals, Recommendation};
use kvrouter_core::router::ConfigError;
use kvrouter_core::time::Time;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The pool of workers whose models are unknown, or of every worker when none is known.
pub(crate) const DEFAULT_POOL: &str = "default";

/// Latencies are observed over this window.
const LATENCY_WINDOW: Duration = Duration::from_secs(30);

/// Pools advised at most (one per model; beyond it the rest are not advised).
const MAX_POOLS: usize = 64;

/// A histogram's counts at one tick: (time, per-bucket counts, sum, count).
type Snapshot = (Time, Vec<u64>, f64, u64);

struct PoolState {
    planner: Planner,
    last: Option<(Recommendation, PoolSignals, f64)>,
    ttft: VecDeque<Snapshot>,
    itl: VecDeque<Snapshot>,
}

/// The advisor: one control law per pool.
pub(crate) struct Advisor {
    config: PlannerAdvice,
    pools: Mutex<BTreeMap<String, PoolState>>,
    /// Requests in flight with an RL group header, per worker.
    rl: Arc<Mutex<BTreeMap<WorkerId, u64>>>,
}

/// One RL request in flight on a worker (held by its load guard; counted until it drops).
pub(crate) struct RlToken {
    rl: Arc<Mutex<BTreeMap<WorkerId, u64>>>,
    worker: WorkerId,
}

impl Drop for RlToken {
    fn drop(&mut self) {
        let mut rl = self.rl.lock().expect("planner rl lock");
        if let Some(n) = rl.get_mut(&self.worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                rl.remove(&self.worker);
            }
        }
    }
}

impl Advisor {
    pub(crate) fn new(config: PlannerAdvice) -> Result<Self, ConfigError> {
        let bad = |reason: String| ConfigError {
            option: "--planner-advise",
            reason,
        };
        config.law.validate().map_err(|e| bad(e.to_string()))?;
        if config.tick.is_zero() {
            return Err(bad("the tick must be positive".into()));
        }
        Ok(Self {
            config,
            pools: Mutex::new(BTreeMap::new()),
            rl: Arc::default(),
        })
    }

    /// Counts a request of an RL group on `worker` while the token lives.
    pub(crate) fn rl_request(&self, worker: WorkerId) -> RlToken {
        *self
            .rl
            .lock()
            .expect("planner rl lock")
            .entry(worker)
            .or_insert(0) += 1;
        RlToken {
            rl: self.rl.clone(),
            worker,
        }
    }

    pub(crate) fn tick(
        &self,
        now: Time,
        pool: &str,
        mut signals: PoolSignals,
        metrics: Option<Hists>,
    ) {
        let mut pools = self.pools.lock().expect("planner lock");
        if !pools.contains_key(pool) && pools.len() >= MAX_POOLS {
            return;
        }
        let state = pools.entry(pool.to_owned()).or_insert_with(|| PoolState {
            planner: Planner::new(self.config.law.clone()).expect("validated at start"),
            last: None,
            ttft: VecDeque::new(),
            itl: VecDeque::new(),
        });
        if let Some((ttft, itl)) = metrics {
            signals.ttft_p99_ms = windowed(&mut state.ttft, now, ttft, Stat::P99);
            signals.itl_ms = windowed(&mut state.itl, now, itl, Stat::Mean);
        }
        let rec = state.planner.tick(now, &signals);
        state.last = Some((rec, signals, now.as_secs_f64()));
    }

    /// The control law's bounds.
    /// Requests in flight with an RL group header, per worker.
    pub(crate) fn rl_requests(&self) -> BTreeMap<WorkerId, u64> {
        self.rl.lock().expect("planner rl lock").clone()
    }

    pub(crate) fn law(&self) -> &kvrouter_core::planner::PlannerConfig {
        &self.config.law
    }

    /// Time between ticks.
    pub(crate) fn tick_interval(&self) -> Duration {
        self.config.tick
    }

    /// Each pool's latest recommendation.
    pub(crate) fn recommendations(&self) -> BTreeMap<String, Recommendation> {
        let pools = self.pools.lock().expect("planner lock");
        pools
            .iter()
            .filter_map(|(name, p)| Some((name.clone(), p.last.as_ref()?.0.clone())))
            .collect()
    }

    /// `GET /admin/planner`.
    pub(crate) fn status(&self) -> Value {
        let pools = self.pools.lock().expect("planner lock");
        let pools: BTreeMap<&String, Value> = pools
            .iter()
            .filter_map(|(name, p)| {
                let (rec, signals, at) = p.last.as_ref()?;
                Some((
                    name,
                    json!({"recommendation": rec, "signals": signals, "at_s": at}),
                ))
            })
            .collect();
        json!({
            "mode": "advisory",
            "tick_s": self.config.tick.as_secs_f64(),
            "config": law_json(&self.config.law),
            "pools": pools,
        })
    }

    /// The gauge on `/metrics`.
    pub(crate) fn render(&self, out: &mut String, prefix: &str) {
        let name = format!("{prefix}planner_recommended_workers");
        let _ = writeln!(
            out,
            "# HELP {name} Workers the planner recommends for a model pool (advisory).\n# TYPE {name} gauge"
        );
        let pools = self.pools.lock().expect("planner lock");
        for (pool, p) in pools.iter() {
            if let Some((rec, _, _)) = &p.last {
                let pool = crate::metrics::escape(pool);
                let _ = writeln!(out, "{name}{{pool=\"{pool}\"}} {}", rec.workers);
            }
        }
    }
}

fn law_json(law: &kvrouter_core::planner::PlannerConfig) -> Value {
    json!({
        "min_workers": law.min_workers,
        "max_workers": law.max_workers,
        "requests_per_worker": law.requests_per_worker,
        "kv_usage_target": law.kv_usage_target,
        "ttft_p99_target_ms": law.ttft_p99_target_ms,
        "itl_target_ms": law.itl_target_ms,
        "up_window_s": law.up_window.as_secs_f64(),
        "down_window_s": law.down_window.as_secs_f64(),
        "horizon_s": law.horizon.as_secs_f64(),
        "startup_s": law.startup.as_secs_f64(),
    })
}

/// A pool's TTFT and ITL histograms now.
type Hists = (
    (&'static [f64], Vec<u64>, f64, u64),
    (&'static [f64], Vec<u64>, f64, u64),
);

enum Stat {
    P99,
    Mean,
}

/// The statistic over the last [`LATENCY_WINDOW`], from the difference between the histogram
/// now and its oldest snapshot in the window, in ms (`None`: nothing observed in it). The p99 is
/// its bucket's upper bound.
fn windowed(
    history: &mut VecDeque<Snapshot>,
    now: Time,
    (bounds, counts, sum, count): (&'static [f64], Vec<u64>, f64, u64),
    stat: Stat,
) -> Option<f64> {
    history.push_back((now, counts, sum, count));
    while history.len() > 2
        && history
            .get(1)
            .is_some_and(|(t, ..)| now.since(*t) >= LATENCY_WINDOW)
    {
        history.pop_front();
    }
    let (first, last) = (history.front()?, history.back()?);
    let n = last.3.checked_sub(first.3).filter(|n| *n > 0)?;
    match stat {
        Stat::Mean => Some((last.2 - first.2) / n as f64 * 1e3),
        Stat::P99 => {
            let want = (n as f64 * 0.99).ceil() as u64;
            let mut seen = 0;
            for (i, b) in bounds.iter().enumerate() {
                seen += last.1[i].saturating_sub(first.1[i]);
                if seen >= want {
                    return Some(b * 1e3);
                }
            }
            // Beyond the last bucket.
            bounds.last().map(|b| b * 1e3)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_name_is_escaped_as_a_label_value() {
        let advisor = Advisor::new(PlannerAdvice {
            law: kvrouter_core::planner::PlannerConfig::default(),
            tick: Duration::from_secs(1),
        })
        .unwrap();
        advisor.tick(Time::ZERO, "evil\nmo\"del\\x", PoolSignals::default(), None);
        let mut out = String::new();
        advisor.render(&mut out, "kvrouter_");
        assert!(
            out.contains("{pool=\"evil\\nmo\\\"del\\\\x\"}"),
            "one line per series: {out}"
        );
        assert!(
            out.lines()
                .all(|l| l.starts_with('#') || l.starts_with("kvrouter_")),
            "{out}"
        );
    }
}
