//! What a finished run reports: its end time and its summary.

use super::Simulation;
use crate::summary::{sent_only, Summary, SummaryBuilder};
use kvrouter_core::time::Time;

impl Simulation<'_> {
    /// When the run ends: the last step's train phase and pause when the workload has a train
    /// phase (whole RL steps), else now.
    /// The workload's end: its RL steps', else its last request's (KV events and replica
    /// messages still in flight after it are bookkeeping: counted, a long --kv-event-delay-ms
    /// made the makespan and throughput its own), else the last event's when none finished.
    pub(super) fn end(&self) -> Time {
        self.replay.steps_end().unwrap_or_else(|| {
            self.records
                .iter()
                .filter_map(|r| r.finish)
                .max()
                .unwrap_or(self.now)
        })
    }

    pub(super) fn summary(&self) -> Summary {
        let end = self.end();
        let busy: Vec<Vec<(Time, Time)>> = self
            .workers
            .iter()
            .map(|w| {
                let mut b = w.busy.clone();
                if let Some(since) = w.busy_since {
                    b.push((since, end));
                }
                b
            })
            .collect();
        let samples: Vec<Vec<(Time, f32, f32)>> =
            self.workers.iter().map(|w| w.samples.clone()).collect();
        let provisioned: Vec<(Time, Time)> = match self.fleet {
            Some(_) => self
                .workers
                .iter()
                .map(|w| (w.provisioned.0, w.provisioned.1.unwrap_or(end)))
                .collect(),
            None => Vec::new(),
        };
        // Under a duration only what was sent counts, as in `kvrouter bench` (a cut session's
        // later turns are neither served nor refused).
        let cut;
        let (workload, records) = if self.config.duration_ms.is_some() {
            cut = sent_only(self.workload, &self.records);
            (&cut.0, &cut.1[..])
        } else {
            (self.workload, &self.records[..])
        };
        let builder = SummaryBuilder {
            config: &self.config,
            workload,
            records,
            busy: &busy,
            samples: &samples,
            provisioned: &provisioned,
            end,
        };
        let mut summary = builder.build();
        if let Some(mut fleet) = self.fleet_summary() {
            let start = self
                .records
                .iter()
                .filter_map(|r| r.arrival)
                .min()
                .unwrap_or(Time::ZERO);
            fleet.gpu_seconds = (builder.gpu_seconds(start, end) * 1e3).round() / 1e3;
            let span = end.since(start).as_secs_f64().max(1e-9);
            fleet.mean_workers = (fleet.gpu_seconds / span * 1e3).round() / 1e3;
            summary.fleet = Some(fleet);
        }
        summary
    }
}
