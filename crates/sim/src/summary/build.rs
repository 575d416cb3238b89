//! How a run's records, busy intervals and samples become its [`Summary`]
//! (also for the live bench's measured records, [`summarize`]).

use super::{round3, Record, RlSummary, Spread, Stats, Summary, Timeline, WorkerSummary};
use crate::config::SimConfig;
use kvrouter_core::time::Time;
use kvrouter_workload::Workload;
use std::collections::BTreeMap;

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

/// The requests that were sent (they have an arrival) and their records, in order: what a run
/// cut by a duration summarises, live (`kvrouter bench --duration-s`) or simulated (`sim
/// --duration-s`). `after` links no longer index the cut workload; the summary reads none.
pub fn sent_only(workload: &Workload, records: &[Record]) -> (Workload, Vec<Record>) {
    let sent: Vec<usize> = (0..records.len())
        .filter(|&i| records[i].arrival.is_some())
        .collect();
    let mut cut = workload.clone();
    cut.requests = sent.iter().map(|&i| workload.requests[i].clone()).collect();
    (cut, sent.iter().map(|&i| records[i].clone()).collect())
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
            group_ids: self.config.group_ids,
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
