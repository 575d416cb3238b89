//! The rollout that ends each RL step (its critical path) and where its time went: the step
//! waits for it, so this says whether routing could have shortened the step.

use super::summary::GlobalRecord;
use kvrouter_core::time::Time;
use kvrouter_workload::Workload;
use serde::Serialize;

/// The last rollout of one step.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CriticalRollout {
    /// The step.
    pub step: u32,
    /// Its session id.
    pub session: u64,
    /// Turns (requests).
    pub turns: usize,
    /// Output tokens over its turns.
    pub output_tokens: u64,
    /// First turn's arrival and last turn's end, seconds since the step started.
    pub start_s: f64,
    /// End, seconds since the step started.
    pub end_s: f64,
    /// Σ arrival → first token (network, queue for a batch slot, prefill), seconds.
    pub to_first_token_s: f64,
    /// Σ first token → last token (decode), seconds.
    pub decode_s: f64,
    /// Decode per output token, ms (the batches it shared).
    pub decode_ms_per_token: f64,
    /// Σ time between a turn's end and the next turn's arrival (tool calls), seconds.
    pub between_turns_s: f64,
    /// Turns that went to another datacenter than the previous turn.
    pub datacenter_changes: usize,
    /// Turns that stayed in the datacenter but went to another engine.
    pub engine_changes: usize,
    /// Requests per datacenter (in datacenter order).
    pub turns_per_datacenter: Vec<usize>,
}

fn s(t: Time) -> f64 {
    t.as_secs_f64()
}

/// Per step (as `(step, start, end)`), the session whose last turn ended last.
pub(super) fn critical_rollouts(
    workload: &Workload,
    records: &[GlobalRecord],
    steps: &[(u32, Time, Time)],
    datacenters: usize,
) -> Vec<CriticalRollout> {
    steps
        .iter()
        .filter_map(|(step, start, _)| {
            let in_step = |i: &usize| workload.requests[*i].step.unwrap_or(0) == *step;
            let last = (0..records.len())
                .filter(in_step)
                .filter(|i| workload.requests[*i].session.is_some())
                .max_by_key(|i| records[*i].finish)?;
            let session = workload.requests[last].session?;
            let mut turns: Vec<usize> = (0..records.len())
                .filter(in_step)
                .filter(|i| workload.requests[*i].session == Some(session))
                .filter(|i| records[*i].arrival.is_some())
                .collect();
            turns.sort_by_key(|i| records[*i].arrival);
            let mut c = CriticalRollout {
                step: *step,
                session,
                turns: turns.len(),
                turns_per_datacenter: vec![0; datacenters],
                ..CriticalRollout::default()
            };
            let mut prev: Option<&GlobalRecord> = None;
            for &i in &turns {
                let r = &records[i];
                let (Some(a), Some(f), Some(e)) = (r.arrival, r.first_token, r.finish) else {
                    continue;
                };
                c.output_tokens += r.output_tokens;
                c.to_first_token_s += s(f) - s(a);
                c.decode_s += s(e) - s(f);
                if let Some(d) = r.dc {
                    c.turns_per_datacenter[d] += 1;
                }
                if let Some(p) = prev {
                    if let Some(pe) = p.finish {
                        c.between_turns_s += (s(a) - s(pe)).max(0.0);
                    }
                    if p.dc != r.dc {
                        c.datacenter_changes += 1;
                    } else if p.worker != r.worker {
                        c.engine_changes += 1;
                    }
                }
                prev = Some(r);
            }
            let first = turns.first().and_then(|i| records[*i].arrival)?;
            let end = records[last].finish?;
            c.start_s = s(first) - s(*start);
            c.end_s = s(end) - s(*start);
            c.decode_ms_per_token = c.decode_s * 1e3 / c.output_tokens.max(1) as f64;
            for v in [
                &mut c.start_s,
                &mut c.end_s,
                &mut c.to_first_token_s,
                &mut c.decode_s,
                &mut c.decode_ms_per_token,
                &mut c.between_turns_s,
            ] {
                *v = (*v * 1000.0).round() / 1000.0;
            }
            Some(c)
        })
        .collect()
}
