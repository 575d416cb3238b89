//! What a run reports. `summary.json` holds one [`Summary`] per configuration.

use kvrouter_core::time::Time;
use serde::{Deserialize, Serialize};

mod build;
pub(crate) use build::SummaryBuilder;
pub use build::{sent_only, summarize};

/// Per-request measurements (the simulator's, or a live bench's).
#[derive(Clone, Debug, Default)]
pub struct Record {
    /// When the request was sent.
    pub arrival: Option<Time>,
    /// When an engine admitted it (simulator only).
    pub admitted: Option<Time>,
    /// The worker that served it (simulator only).
    pub worker: Option<usize>,
    /// Prompt tokens the router expected to be cached.
    pub predicted_cached: u64,
    /// First output token.
    pub first_token: Option<Time>,
    /// Latest output token.
    pub last_token: Option<Time>,
    /// Sum of gaps between output tokens, ms.
    pub itl_sum_ms: f64,
    /// Number of those gaps.
    pub itl_count: u32,
    /// Completion.
    pub finish: Option<Time>,
    /// Prompt tokens served from cache.
    pub served_cached: u32,
    /// Output tokens generated.
    pub output_tokens: u32,
    /// Refused or failed.
    pub rejected: bool,
    /// Tokens generated before the current attempt (migrations carry them).
    pub carried: u32,
    /// Migrations.
    pub migrations: u32,
    /// Lost with a dead worker.
    pub failed: bool,
    /// Ended early because its group had enough samples (first-N-of-M); counts as finished.
    pub ended_early: bool,
    /// Times a weight update aborted it (it was continued on the new policy).
    pub update_aborts: u32,
    /// Context tokens computed again because a weight update aborted it.
    pub recomputed_tokens: u64,
    /// The policy version of the worker that served its last attempt (simulator only).
    pub policy_version: Option<u64>,
}

/// Mean and percentiles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

impl Stats {
    fn of(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize];
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Self {
            mean: round3(mean),
            p50: round3(at(0.5)),
            p90: round3(at(0.9)),
            p99: round3(at(0.99)),
        }
    }
}

/// Mean, median and maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// Maximum.
    pub max: f64,
}

impl Spread {
    fn of(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Self {
            mean: round3(mean),
            p50: round3(values[(values.len() - 1) / 2]),
            max: round3(values[values.len() - 1]),
        }
    }
}

/// One worker's share of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerSummary {
    /// Worker index.
    pub worker: usize,
    /// Requests routed to it.
    pub requests: usize,
    /// Fraction of the run it was computing.
    pub busy_fraction: f64,
}

/// RL figures: synchronous steps and GRPO groups.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RlSummary {
    /// Steps run.
    pub steps: usize,
    /// Step time (first dispatch to last sample), seconds.
    pub step_time_s: Spread,
    /// Group completion time (first dispatch to last sample), seconds.
    pub group_time_s: Spread,
    /// GPU-seconds per step (workers × step time), mean.
    pub gpu_seconds_per_step: f64,
    /// Share of GPU-seconds within steps that workers sat idle (the step tail).
    pub gpu_idle_fraction: f64,
    /// Samples ended early because their group had enough (first-N-of-M).
    #[serde(default)]
    pub ended_early: usize,
    /// Rollouts that never completed (refused or failed); weight updates must lose none.
    #[serde(default)]
    pub rollouts_lost: usize,
    /// In-flight requests a weight update aborted and continued on the new policy.
    #[serde(default)]
    pub update_aborts: usize,
    /// Context tokens computed again because of those aborts.
    #[serde(default)]
    pub tokens_recomputed: u64,
    /// Per-step lower bound on the step time, seconds: the longest sample alone or the step's
    /// work over the fleet's capacity, whichever is longer (see `bounds.rs`; simulator only).
    #[serde(default)]
    pub step_time_lower_bound_s: Option<Spread>,
}

/// The fleet at one planner tick.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetSample {
    /// Simulated time, seconds.
    pub t_s: f64,
    /// Workers serving.
    pub serving: u32,
    /// Workers provisioned (serving, starting or draining): what GPU time is paid for.
    pub provisioned: u32,
    /// The planner's recommendation.
    pub recommended: u32,
}

/// A planner run against a fleet of fixed size (the planner's peak), on the same workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetBaseline {
    /// Its workers.
    pub workers: usize,
    /// Its GPU-seconds.
    pub gpu_seconds: f64,
    /// Its mean RL step time, seconds (0 without steps).
    pub step_time_s: f64,
    /// 1 − planner GPU-seconds / its GPU-seconds.
    pub gpu_seconds_saved: f64,
    /// Planner mean step time / its mean step time.
    pub step_time_ratio: f64,
}

impl FleetBaseline {
    /// The fixed run `fixed` against a planner run's GPU-seconds and RL figures.
    pub fn against(
        fixed: &Summary,
        planner_gpu_seconds: f64,
        planner_rl: Option<&RlSummary>,
    ) -> Self {
        let gpu_seconds = round3(fixed.workers.len() as f64 * fixed.makespan_s);
        let step = |rl: Option<&RlSummary>| rl.map_or(0.0, |x| x.step_time_s.mean);
        let step_time_s = step(fixed.rl.as_ref());
        let ratio = |a: f64, b: f64| if b > 0.0 { round3(a / b) } else { 0.0 };
        Self {
            workers: fixed.workers.len(),
            gpu_seconds,
            step_time_s,
            gpu_seconds_saved: round3(1.0 - ratio(planner_gpu_seconds, gpu_seconds)),
            step_time_ratio: ratio(step(planner_rl), step_time_s),
        }
    }
}

/// The planner's fleet in a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetSummary {
    /// Worker-seconds provisioned between the first arrival and the last completion.
    pub gpu_seconds: f64,
    /// Mean workers provisioned over that span.
    pub mean_workers: f64,
    /// Most workers serving at once.
    pub peak_workers: u32,
    /// Startup delay of a new worker, seconds.
    pub startup_s: f64,
    /// The last recommendation, with its reasons.
    pub last: Option<kvrouter_core::planner::Recommendation>,
    /// The fixed fleet sized for the peak, when it was run too.
    pub baseline: Option<FleetBaseline>,
    /// The fleet at the ticks where it changed.
    pub samples: Vec<FleetSample>,
    /// Requests moved off workers released in RL tails (`--planner-migrate-tail`).
    #[serde(default)]
    pub tail_moves: u64,
}

/// Time series for the report (not serialized).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// Width of a bin, seconds.
    pub bin_s: f64,
    /// Per worker, busy fraction per bin.
    pub busy: Vec<Vec<f64>>,
    /// Served hit rate of the requests arriving in each bin.
    pub hit_rate: Vec<Option<f64>>,
    /// Mean running requests per worker in each bin (averaged over workers).
    pub running: Vec<f64>,
    /// Mean KV usage (fraction of blocks in use) in each bin (averaged over workers).
    pub kv_usage: Vec<f64>,
    /// Sorted TTFTs, ms (for CDFs).
    pub ttft_sorted_ms: Vec<f64>,
    /// Step times, seconds.
    pub step_times_s: Vec<f64>,
}

/// The result of one configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Configuration label.
    pub config: String,
    /// Routing mode.
    pub router_mode: String,
    /// Workload name.
    pub workload: String,
    /// Requests in the workload.
    pub requests: usize,
    /// Requests completed.
    pub completed: usize,
    /// Requests refused (by the router or the engine).
    pub rejected: usize,
    /// Requests lost with a dead worker (not migrated).
    pub failed: usize,
    /// Continuations of requests whose worker died.
    pub migrations: usize,
    /// Time to first token, ms.
    pub ttft_ms: Stats,
    /// Inter-token latency (per-request mean), ms.
    pub itl_ms: Stats,
    /// End-to-end latency, ms.
    pub e2e_ms: Stats,
    /// Wait from arrival to the engine admitting the request, ms.
    pub queue_ms: Stats,
    /// Prompt tokens the engines served from cache / all prompt tokens.
    pub hit_rate: f64,
    /// Prompt tokens the router expected to be cached / all prompt tokens.
    pub predicted_hit_rate: f64,
    /// The hit rate one unbounded cache would reach on this workload, in the units of
    /// `hit_rate` (router blocks, token-weighted, the last prompt token never cached): no
    /// routing serves more.
    pub hit_rate_ceiling: f64,
    /// The same over the workload's own blocks, block-weighted (a partial last block counts as
    /// a whole hit): the figure `../shared/traces/README.md` quotes. Not comparable with
    /// `hit_rate` where prompts are short or blocks large.
    #[serde(default)]
    pub hit_rate_ceiling_blocks: f64,
    /// The hit rate no routing can exceed with the fleet's combined KV capacity: one
    /// Belady-optimal cache of that size, token-weighted like `hit_rate` (simulator only).
    #[serde(default)]
    pub hit_rate_ceiling_finite: Option<f64>,
    /// What one LRU prefix cache of the fleet's combined capacity serves: a reference, not a
    /// bound (simulator only).
    #[serde(default)]
    pub hit_rate_lru_fleet: Option<f64>,
    /// Output tokens generated for completed requests.
    pub output_tokens: u64,
    /// Output tokens per second of simulated time.
    pub output_tokens_per_s: f64,
    /// Simulated time from first arrival to last completion, seconds.
    pub makespan_s: f64,
    /// Wall-clock seconds the run took (set by the host; 0 in golden files).
    pub sim_wall_s: f64,
    /// Per-worker figures.
    pub workers: Vec<WorkerSummary>,
    /// RL figures, for workloads with steps.
    pub rl: Option<RlSummary>,
    /// Whether the router saw the workload's RL group ids; written only when it did not
    /// (`sim --no-group-ids`: siblings known by their prompt alone).
    #[serde(default = "seen", skip_serializing_if = "is_seen")]
    pub group_ids: bool,
    /// The planner's fleet (`--planner` runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetSummary>,
    /// Time series for the report.
    #[serde(skip)]
    pub timeline: Timeline,
}

fn seen() -> bool {
    true
}

fn is_seen(group_ids: &bool) -> bool {
    *group_ids
}
