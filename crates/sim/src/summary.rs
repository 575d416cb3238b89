//! What a run reports. `summary.json` holds one [`Summary`] per configuration.

use crate::config::SimConfig;
use kvrouter_core::time::Time;
use kvrouter_workload::Workload;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

/// A summary of measured records (the live bench), in the simulator's format.
pub fn summarize(
    name: &str,
    mode: &str,
    workload: &Workload,
    records: &[Record],
    end: Time,
) -> Summary {
    let config = SimConfig {
        name: name.to_owned(),
        workers: 0,
        ..SimConfig::default()
    };
    let mut s = SummaryBuilder {
        config: &config,
        workload,
        records,
        busy: &[],
        samples: &[],
        provisioned: &[],
        end,
    }
    .build();
    s.router_mode = mode.to_owned();
    s
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
    /// The planner's fleet (`--planner` runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetSummary>,
    /// Time series for the report.
    #[serde(skip)]
    pub timeline: Timeline,
}

pub(crate) struct SummaryBuilder<'a> {
    pub(crate) config: &'a SimConfig,
    pub(crate) workload: &'a Workload,
    pub(crate) records: &'a [Record],
    pub(crate) busy: &'a [Vec<(Time, Time)>],
    pub(crate) samples: &'a [Vec<(Time, f32, f32)>],
    /// Per worker, when it was provisioned and released (empty: a fixed fleet of `busy.len()`
    /// for the whole run).
    pub(crate) provisioned: &'a [(Time, Time)],
    pub(crate) end: Time,
}

fn overlap(intervals: &[(Time, Time)], from: Time, to: Time) -> f64 {
    intervals
        .iter()
        .map(|(a, b)| (b.0.min(to.0) as f64 - a.0.max(from.0) as f64).max(0.0) / 1e6)
        .sum()
}

impl SummaryBuilder<'_> {
    /// Worker-seconds paid for between `from` and `to`.
    pub(crate) fn gpu_seconds(&self, from: Time, to: Time) -> f64 {
        if self.provisioned.is_empty() {
            self.busy.len() as f64 * to.since(from).as_secs_f64()
        } else {
            overlap(self.provisioned, from, to)
        }
    }

    pub(crate) fn build(&self) -> Summary {
        let done: Vec<(usize, &Record)> = self
            .records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.finish.is_some())
            .collect();
        let ms = |a: Time, b: Time| b.since(a).as_secs_f64() * 1e3;
        let mut ttft: Vec<f64> = done
            .iter()
            .filter_map(|(_, r)| Some(ms(r.arrival?, r.first_token?)))
            .collect();
        let mut e2e: Vec<f64> = done
            .iter()
            .filter_map(|(_, r)| Some(ms(r.arrival?, r.finish?)))
            .collect();
        let mut itl: Vec<f64> = done
            .iter()
            .filter(|(_, r)| r.itl_count > 0)
            .map(|(_, r)| r.itl_sum_ms / f64::from(r.itl_count))
            .collect();
        let mut queue: Vec<f64> = done
            .iter()
            .filter_map(|(_, r)| Some(ms(r.arrival?, r.admitted?)))
            .collect();
        let prompt: u64 = done
            .iter()
            .map(|(i, _)| u64::from(self.workload.requests[*i].input_tokens))
            .sum();
        let served: u64 = done.iter().map(|(_, r)| u64::from(r.served_cached)).sum();
        let predicted: u64 = done.iter().map(|(_, r)| r.predicted_cached).sum();
        let output: u64 = done.iter().map(|(_, r)| u64::from(r.output_tokens)).sum();
        let start = self
            .records
            .iter()
            .filter_map(|r| r.arrival)
            .min()
            .unwrap_or(Time::ZERO);
        let makespan = self.end.since(start).as_secs_f64().max(1e-9);
        let mut order: Vec<(Time, usize)> = self
            .records
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((r.arrival?, i)))
            .collect();
        order.sort();
        let order: Vec<usize> = order.into_iter().map(|(_, i)| i).collect();
        let workers: Vec<WorkerSummary> = (0..self.busy.len())
            .map(|w| WorkerSummary {
                worker: w,
                requests: self.records.iter().filter(|r| r.worker == Some(w)).count(),
                busy_fraction: round3(overlap(&self.busy[w], start, self.end) / makespan),
            })
            .collect();
        let ratio = |a: u64, b: u64| {
            if b == 0 {
                0.0
            } else {
                round3(a as f64 / b as f64)
            }
        };
        let finite = (self.config.workers > 0).then(|| {
            let engine = &self.config.engine;
            let capacity =
                self.config.workers as u64 * (engine.num_gpu_blocks + engine.num_cpu_blocks) as u64;
            kvrouter_workload::ceiling::finite_ceilings(
                self.workload,
                &order,
                self.config.router.kv_cache_block_size,
                capacity,
            )
        });
        let timeline = self.timeline(start, ttft.clone());
        let mut rl = self.rl();
        let step_times = rl
            .as_mut()
            .map(|(_, t)| std::mem::take(t))
            .unwrap_or_default();
        Summary {
            config: self.config.name.clone(),
            router_mode: self.config.router.router_mode.as_str().to_owned(),
            workload: self.workload.name.clone(),
            requests: self.records.len(),
            completed: done.len(),
            rejected: self
                .records
                .iter()
                .filter(|r| r.rejected && !r.failed)
                .count(),
            failed: self.records.iter().filter(|r| r.failed).count(),
            migrations: self.records.iter().map(|r| r.migrations as usize).sum(),
            ttft_ms: Stats::of(&mut ttft),
            itl_ms: Stats::of(&mut itl),
            e2e_ms: Stats::of(&mut e2e),
            queue_ms: Stats::of(&mut queue),
            hit_rate: ratio(served, prompt),
            predicted_hit_rate: ratio(predicted, prompt),
            hit_rate_ceiling: round3(kvrouter_workload::ceiling::unbounded_ceiling(
                self.workload,
                &order,
                self.config.router.kv_cache_block_size,
            )),
            hit_rate_ceiling_blocks: round3(self.workload.hit_rate_ceiling(&order)),
            hit_rate_ceiling_finite: finite.map(|f| round3(f.optimal)),
            hit_rate_lru_fleet: finite.map(|f| round3(f.lru)),
            output_tokens: output,
            output_tokens_per_s: round3(output as f64 / makespan),
            makespan_s: round3(makespan),
            sim_wall_s: 0.0,
            workers,
            rl: rl.map(|(r, _)| r),
            fleet: None,
            timeline: Timeline {
                step_times_s: step_times,
                ..timeline
            },
        }
    }

    fn timeline(&self, start: Time, mut ttft: Vec<f64>) -> Timeline {
        const BINS: usize = 120;
        let span = self.end.since(start).as_secs_f64().max(1e-6);
        let bin = span / BINS as f64;
        let edge = |k: usize| Time(start.0 + (k as f64 * bin * 1e6) as u64);
        let busy = self
            .busy
            .iter()
            .map(|iv| {
                (0..BINS)
                    .map(|k| (overlap(iv, edge(k), edge(k + 1)) / bin).min(1.0))
                    .collect()
            })
            .collect();
        let mut hits = vec![(0u64, 0u64); BINS];
        for (i, r) in self.records.iter().enumerate() {
            if let (Some(a), Some(_)) = (r.arrival, r.finish) {
                let k = ((a.since(start).as_secs_f64() / bin) as usize).min(BINS - 1);
                hits[k].0 += u64::from(r.served_cached);
                hits[k].1 += u64::from(self.workload.requests[i].input_tokens);
            }
        }
        ttft.sort_by(f64::total_cmp);
        let mut sums = vec![(0.0f64, 0.0f64, 0u64); BINS];
        for worker in self.samples {
            for (t, running, kv) in worker {
                let k = ((t.since(start).as_secs_f64() / bin) as usize).min(BINS - 1);
                sums[k].0 += f64::from(*running);
                sums[k].1 += f64::from(*kv);
                sums[k].2 += 1;
            }
        }
        let mean = |x: f64, n: u64| if n == 0 { 0.0 } else { x / n as f64 };
        Timeline {
            bin_s: bin,
            running: sums.iter().map(|s| mean(s.0, s.2)).collect(),
            kv_usage: sums.iter().map(|s| mean(s.1, s.2)).collect(),
            busy,
            hit_rate: hits
                .iter()
                .map(|(h, t)| (*t > 0).then(|| *h as f64 / *t as f64))
                .collect(),
            ttft_sorted_ms: ttft,
            step_times_s: Vec::new(),
        }
    }

    fn rl(&self) -> Option<(RlSummary, Vec<f64>)> {
        self.workload.barrier?;
        let mut steps: BTreeMap<u32, (Time, Time)> = BTreeMap::new();
        let mut groups: BTreeMap<u64, (Time, Time)> = BTreeMap::new();
        for (i, r) in self.records.iter().enumerate() {
            let (Some(a), Some(f)) = (r.arrival, r.finish) else {
                continue;
            };
            let req = &self.workload.requests[i];
            if let Some(k) = req.step {
                let e = steps.entry(k).or_insert((a, f));
                e.0 = e.0.min(a);
                e.1 = e.1.max(f);
            }
            if let Some(g) = req.group {
                let e = groups.entry(g).or_insert((a, f));
                e.0 = e.0.min(a);
                e.1 = e.1.max(f);
            }
        }
        if steps.is_empty() {
            return None;
        }
        let mut times: Vec<f64> = steps
            .values()
            .map(|(a, b)| b.since(*a).as_secs_f64())
            .collect();
        let step_times = times.clone();
        let (mut gpu, mut idle) = (0.0, 0.0);
        for (a, b) in steps.values() {
            let paid = self.gpu_seconds(*a, *b);
            let busy: f64 = self.busy.iter().map(|iv| overlap(iv, *a, *b)).sum();
            gpu += paid;
            idle += paid - busy;
        }
        let bounds = crate::bounds::step_lower_bounds(self.config, self.workload);
        let mut bound_times: Vec<f64> = steps
            .keys()
            .filter_map(|k| bounds.as_ref()?.get(k).copied())
            .collect();
        let mut group_times: Vec<f64> = groups
            .values()
            .map(|(a, b)| b.since(*a).as_secs_f64())
            .collect();
        Some((
            RlSummary {
                steps: steps.len(),
                step_time_s: Spread::of(&mut times),
                group_time_s: Spread::of(&mut group_times),
                gpu_seconds_per_step: round3(gpu / steps.len() as f64),
                gpu_idle_fraction: if gpu > 0.0 { round3(idle / gpu) } else { 0.0 },
                ended_early: self.records.iter().filter(|r| r.ended_early).count(),
                rollouts_lost: self
                    .records
                    .iter()
                    .enumerate()
                    .filter(|(i, r)| self.workload.requests[*i].step.is_some() && r.rejected)
                    .count(),
                update_aborts: self.records.iter().map(|r| r.update_aborts as usize).sum(),
                tokens_recomputed: self.records.iter().map(|r| r.recomputed_tokens).sum(),
                step_time_lower_bound_s: bounds.is_some().then(|| Spread::of(&mut bound_times)),
            },
            step_times,
        ))
    }
}
