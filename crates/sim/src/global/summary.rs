//! What a global run reports: step times, per-datacenter busy/idle over time and in the step
//! tail, hit rates, and the error of the cache estimates (`summary.json`).

use super::config::GlobalSimConfig;
use super::dc::Dc;
use kvrouter_core::time::Time;
use kvrouter_workload::Workload;
use serde::Serialize;

/// Time buckets of the busy/idle timeline.
const TIMELINE_BUCKETS: usize = 120;

/// One request's fate.
#[derive(Clone, Debug, Default)]
pub(super) struct GlobalRecord {
    pub(super) arrival: Option<Time>,
    pub(super) dc: Option<usize>,
    pub(super) worker: Option<usize>,
    pub(super) moved: bool,
    pub(super) first_token: Option<Time>,
    pub(super) finish: Option<Time>,
    /// Its datacenter's router gave up on it (it waited past `--router-queue-max-wait-secs`),
    /// or the global router found no fresh summary for a day.
    pub(super) rejected: bool,
    /// Times it was sent back for want of a fresh summary (each a refresh period's wait).
    pub(super) summary_retries: u32,
    pub(super) cached_tokens: u64,
    pub(super) output_tokens: u64,
    /// The global router's estimate (from a possibly stale summary), blocks.
    pub(super) estimated_cached_blocks: u64,
    /// What the chosen datacenter's index held when the request reached it, blocks.
    pub(super) actual_cached_blocks: u64,
}

/// One check of a fresh sketch against its index.
#[derive(Clone, Copy, Debug)]
pub(super) struct SketchCheck {
    pub(super) prompt_blocks: u64,
    pub(super) exact_blocks: u64,
    pub(super) sketch_blocks: u64,
}

pub(super) struct Inputs<'a> {
    pub(super) config: &'a GlobalSimConfig,
    pub(super) workload: &'a Workload,
    pub(super) records: &'a [GlobalRecord],
    pub(super) dcs: &'a [Dc],
    pub(super) steps: Vec<(u32, Time, Time)>,
    pub(super) sketch_checks: &'a [SketchCheck],
    pub(super) summary_bytes: &'a [usize],
    pub(super) end: Time,
}

/// Percentiles of a sample.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Dist {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

fn dist(mut v: Vec<f64>) -> Dist {
    if v.is_empty() {
        return Dist::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Dist {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: at(0.5),
        p99: at(0.99),
    }
}

fn r3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// An estimate error: sketch (or decision) against the truth.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct EstimateError {
    /// Comparisons.
    pub checks: usize,
    /// Mean |estimate − truth|, blocks.
    pub mean_abs_blocks: f64,
    /// Mean |estimate − truth| / prompt blocks.
    pub mean_abs_fraction_of_prompt: f64,
    /// Share of estimates above the truth.
    pub over_share: f64,
    /// Share below.
    pub under_share: f64,
}

fn error(pairs: impl Iterator<Item = (u64, u64, u64)>) -> EstimateError {
    let (mut n, mut abs, mut frac, mut over, mut under) = (0usize, 0u64, 0.0, 0usize, 0usize);
    for (est, truth, len) in pairs {
        n += 1;
        abs += est.abs_diff(truth);
        frac += est.abs_diff(truth) as f64 / len.max(1) as f64;
        over += usize::from(est > truth);
        under += usize::from(est < truth);
    }
    let d = n.max(1) as f64;
    EstimateError {
        checks: n,
        mean_abs_blocks: r3(abs as f64 / d),
        mean_abs_fraction_of_prompt: r3(frac / d),
        over_share: r3(over as f64 / d),
        under_share: r3(under as f64 / d),
    }
}

/// One datacenter's figures.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ClusterReport {
    /// Name.
    pub name: String,
    /// Workers.
    pub workers: usize,
    /// Profile and speed factor.
    pub profile: String,
    /// Speed factor on the profile.
    pub speed: f64,
    /// Requests served.
    pub requests: usize,
    /// Cached share of the prompt tokens it served.
    pub hit_rate: f64,
    /// Busy share of its GPU time over the run.
    pub busy_fraction: f64,
    /// Mean over steps: idle share of its GPU time within the step.
    pub step_idle_fraction: f64,
    /// Mean over steps and workers: time from a worker's last work in the step to the step's
    /// end (the gray tail), seconds.
    pub tail_idle_s: f64,
    /// Busy share of its GPUs per timeline bucket (green = busy, gray = idle).
    pub timeline: Vec<f64>,
}

/// A global run's summary.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GlobalSummary {
    /// The global policy.
    pub policy: String,
    /// The workload's name.
    pub workload: String,
    /// Requests.
    pub requests: usize,
    /// Requests a datacenter's router gave up on, or that found no fresh summary for a day
    /// (left out of the latencies and hit rate).
    pub rejected: usize,
    /// Times requests were sent back for want of a fresh summary, each a refresh period's wait
    /// (counted in their TTFT and E2E: a request's arrival is its first).
    pub summary_retries: u64,
    /// Time to first token, ms.
    pub ttft_ms: Dist,
    /// End to end, ms.
    pub e2e_ms: Dist,
    /// Cached share of all prompt tokens.
    pub hit_rate: f64,
    /// RL step times, seconds (start to last rollout).
    pub step_time_s: Vec<f64>,
    /// Their mean.
    pub step_time_mean_s: f64,
    /// Requests whose session moved to another datacenter (re-prefill).
    pub session_moves: usize,
    /// Follow-up turns that stayed in their session's datacenter but went to another engine
    /// there than the session's previous turn (the local router's choice).
    pub engine_changes_within_dc: usize,
    /// Prompt tokens the chosen datacenter held (its best engine's prefix when the request
    /// arrived) that the engine it was placed on did not: cache lost to the local choice.
    pub cache_lost_within_dc_tokens: u64,
    /// Per datacenter.
    pub clusters: Vec<ClusterReport>,
    /// Width of a timeline bucket, seconds.
    pub timeline_bucket_s: f64,
    /// Steps as (start, end) seconds, for the timeline.
    pub steps: Vec<(f64, f64)>,
    /// Per step, the rollout that ended it and where its time went.
    pub critical_rollouts: Vec<super::critical::CriticalRollout>,
    /// The sketch alone: each fresh summary against its own index, on recent prompts.
    pub sketch_error: EstimateError,
    /// The global decision's estimate (stale summary) against the chosen datacenter's index
    /// when the request reached it.
    pub decision_error: EstimateError,
    /// Encoded summary size, bytes: mean and max.
    pub summary_bytes_mean: f64,
    /// Largest.
    pub summary_bytes_max: usize,
    /// Simulated time, seconds.
    pub sim_end_s: f64,
    /// Wall time of the run, seconds (filled by the caller).
    pub sim_wall_s: f64,
}

/// Follow-up turns placed in the same datacenter as their session's previous turn but on
/// another engine.
fn engine_changes_within_dc(workload: &Workload, records: &[GlobalRecord]) -> usize {
    let mut turns: Vec<(u64, Time, usize)> = records
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((workload.requests[i].session?, r.arrival?, i)))
        .collect();
    turns.sort_unstable();
    turns
        .windows(2)
        .filter(|p| p[0].0 == p[1].0)
        .filter(|p| {
            let (a, b) = (&records[p[0].2], &records[p[1].2]);
            a.dc.is_some() && a.dc == b.dc && a.worker != b.worker
        })
        .count()
}

fn busy_in(busy: &[(Time, Time)], from: Time, to: Time) -> f64 {
    busy.iter()
        .map(|(a, b)| {
            let (a, b) = ((*a).max(from), (*b).min(to));
            if b > a {
                b.since(a).as_secs_f64()
            } else {
                0.0
            }
        })
        .sum()
}

impl GlobalSummary {
    pub(super) fn build(x: Inputs<'_>) -> Self {
        let end = x.end;
        let bucket = (end.as_secs_f64() / TIMELINE_BUCKETS as f64).max(1e-3);
        let closed: Vec<Vec<Vec<(Time, Time)>>> = x
            .dcs
            .iter()
            .map(|dc| {
                dc.workers
                    .iter()
                    .map(|w| {
                        let mut b = w.busy.clone();
                        if let Some(since) = w.busy_since {
                            b.push((since, end));
                        }
                        b
                    })
                    .collect()
            })
            .collect();
        let done: Vec<&super::summary::GlobalRecord> =
            x.records.iter().filter(|r| r.finish.is_some()).collect();
        let input = |i: usize| u64::from(x.workload.requests[i].input_tokens);
        let clusters = x
            .dcs
            .iter()
            .enumerate()
            .map(|(d, dc)| {
                let workers = &closed[d];
                let n = workers.len() as f64;
                // Served here: a refused request has no tokens to count.
                let mine: Vec<usize> = (0..x.records.len())
                    .filter(|&i| x.records[i].dc == Some(d) && !x.records[i].rejected)
                    .collect();
                let (cached, total) = mine.iter().fold((0u64, 0u64), |(c, t), &i| {
                    (c + x.records[i].cached_tokens, t + input(i))
                });
                let busy_total: f64 = workers.iter().map(|b| busy_in(b, Time::ZERO, end)).sum();
                let (mut idle, mut tail) = (0.0, 0.0);
                for (_, s, e) in &x.steps {
                    let len = e.since(*s).as_secs_f64().max(1e-9);
                    let busy: f64 = workers.iter().map(|b| busy_in(b, *s, *e)).sum();
                    idle += 1.0 - busy / (n * len);
                    for b in workers {
                        let last = b
                            .iter()
                            .filter(|(a, z)| *a < *e && *z > *s)
                            .map(|(_, z)| (*z).min(*e))
                            .max()
                            .unwrap_or(*s);
                        tail += e.since(last).as_secs_f64() / n;
                    }
                }
                let steps = x.steps.len().max(1) as f64;
                ClusterReport {
                    name: dc.entry.name.clone(),
                    workers: workers.len(),
                    profile: dc.entry.profile.clone(),
                    speed: dc.entry.speed,
                    requests: mine.len(),
                    hit_rate: r3(cached as f64 / total.max(1) as f64),
                    busy_fraction: r3(busy_total / (n * end.as_secs_f64().max(1e-9))),
                    step_idle_fraction: r3(idle / steps),
                    tail_idle_s: r3(tail / steps),
                    timeline: (0..TIMELINE_BUCKETS)
                        .map(|k| {
                            let a = Time::from_secs_f64(k as f64 * bucket);
                            let b = Time::from_secs_f64((k + 1) as f64 * bucket);
                            let busy: f64 = workers.iter().map(|w| busy_in(w, a, b)).sum();
                            r3(busy / (n * bucket))
                        })
                        .collect(),
                }
            })
            .collect();
        let (cached, total) = (0..x.records.len())
            .filter(|&i| !x.records[i].rejected)
            .fold((0u64, 0u64), |(c, t), i| {
                (c + x.records[i].cached_tokens, t + input(i))
            });
        let step_time_s: Vec<f64> = x
            .steps
            .iter()
            .map(|(_, s, e)| r3(e.since(*s).as_secs_f64()))
            .collect();
        let bs = x.config.router.kv_cache_block_size as u64;
        Self {
            policy: x.config.policy.as_str().to_owned(),
            workload: x.workload.name.clone(),
            requests: x.records.len(),
            rejected: x.records.iter().filter(|r| r.rejected).count(),
            summary_retries: x.records.iter().map(|r| u64::from(r.summary_retries)).sum(),
            ttft_ms: dist(
                done.iter()
                    .filter_map(|r| Some(r.first_token?.since(r.arrival?).as_secs_f64() * 1e3))
                    .collect(),
            ),
            e2e_ms: dist(
                done.iter()
                    .filter_map(|r| Some(r.finish?.since(r.arrival?).as_secs_f64() * 1e3))
                    .collect(),
            ),
            hit_rate: r3(cached as f64 / total.max(1) as f64),
            step_time_mean_s: r3(step_time_s.iter().sum::<f64>() / step_time_s.len().max(1) as f64),
            step_time_s,
            session_moves: x.records.iter().filter(|r| r.moved).count(),
            engine_changes_within_dc: engine_changes_within_dc(x.workload, x.records),
            cache_lost_within_dc_tokens: x
                .records
                .iter()
                .map(|r| (r.actual_cached_blocks * bs).saturating_sub(r.cached_tokens))
                .sum(),
            clusters,
            timeline_bucket_s: bucket,
            steps: x
                .steps
                .iter()
                .map(|(_, s, e)| (r3(s.as_secs_f64()), r3(e.as_secs_f64())))
                .collect(),
            critical_rollouts: super::critical::critical_rollouts(
                x.workload,
                x.records,
                &x.steps,
                x.dcs.len(),
            ),
            sketch_error: error(
                x.sketch_checks
                    .iter()
                    .map(|c| (c.sketch_blocks, c.exact_blocks, c.prompt_blocks)),
            ),
            decision_error: error(
                x.records
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.dc.is_some())
                    .map(|(i, r)| {
                        let len = u64::from(x.workload.requests[i].input_tokens) / bs.max(1);
                        (r.estimated_cached_blocks, r.actual_cached_blocks, len)
                    }),
            ),
            summary_bytes_mean: r3(
                x.summary_bytes.iter().sum::<usize>() as f64 / x.summary_bytes.len().max(1) as f64
            ),
            summary_bytes_max: x.summary_bytes.iter().copied().max().unwrap_or(0),
            sim_end_s: r3(end.as_secs_f64()),
            sim_wall_s: 0.0,
        }
    }
}
