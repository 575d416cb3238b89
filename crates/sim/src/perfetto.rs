//! Request timelines as Chrome trace event JSON, which Perfetto (ui.perfetto.dev) and
//! `chrome://tracing` open: one process per worker, one track per request, with its queue,
//! prefill and decode spans, the tool wait before each later turn of a session, and the weight
//! updates of each worker. A rollout step's tail is then visible at a glance.
//!
//! Written by `kvrouter sim --perfetto` and `kvrouter bench --perfetto` from the same records.

use crate::summary::Record;
use kvrouter_core::time::Time;
use kvrouter_workload::Workload;
use serde_json::{json, Value};
use std::io::Write;

/// Most spans written; later ones are dropped (the file says how many).
pub const MAX_EVENTS: usize = 2_000_000;

/// Process id of requests whose worker is unknown (a live endpoint that does not say).
const UNKNOWN_WORKER: u64 = 1_000_000;

/// One worker's weight update: (worker, load start, load end).
pub type UpdateSpan = (usize, Time, Time);

fn span(name: &str, pid: u64, tid: u64, from: Time, to: Time, args: Value) -> Option<Value> {
    (to > from).then(|| {
        json!({
            "name": name, "cat": "request", "ph": "X", "pid": pid, "tid": tid,
            "ts": from.as_micros(), "dur": to.0 - from.0, "args": args,
        })
    })
}

/// The trace events of a run.
pub fn events(workload: &Workload, records: &[Record], updates: &[UpdateSpan]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut workers = std::collections::BTreeSet::new();
    for (i, r) in records.iter().enumerate() {
        let Some(arrival) = r.arrival else { continue };
        let req = &workload.requests[i];
        let pid = r.worker.map_or(UNKNOWN_WORKER, |w| w as u64);
        workers.insert(pid);
        let tid = i as u64;
        let args = json!({
            "request": i, "session": req.session, "group": req.group, "step": req.step,
            "prompt_tokens": req.input_tokens, "output_tokens": r.output_tokens,
            "cached_tokens": r.served_cached, "migrations": r.migrations,
            "ended_early": r.ended_early, "policy_version": r.policy_version,
        });
        let first = r.first_token;
        let end = r.finish;
        let admitted = r.admitted.unwrap_or(arrival);
        out.extend(span("queue", pid, tid, arrival, admitted, json!({})));
        if let Some(f) = first {
            out.extend(span("prefill", pid, tid, admitted, f, args.clone()));
        }
        if let (Some(f), Some(e)) = (first, end) {
            out.extend(span("decode", pid, tid, f, e, json!({})));
        }
        if let Some(prev) = req.after.and_then(|p| records.get(p)?.finish) {
            out.extend(span("tool wait", pid, tid, prev, arrival, json!({})));
        }
        if r.rejected {
            out.push(json!({"name": "rejected", "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": arrival.as_micros()}));
        }
    }
    for (w, from, to) in updates {
        workers.insert(*w as u64);
        out.extend(span(
            "weight update",
            *w as u64,
            u64::MAX >> 12,
            *from,
            *to,
            json!({}),
        ));
    }
    for w in workers {
        let name = if w == UNKNOWN_WORKER {
            "endpoint".to_owned()
        } else {
            format!("worker {w}")
        };
        out.push(json!({"name": "process_name", "ph": "M", "pid": w, "args": {"name": name}}));
    }
    out
}

/// Writes the trace (bounded by [`MAX_EVENTS`]).
pub fn write(
    mut to: impl Write,
    workload: &Workload,
    records: &[Record],
    updates: &[UpdateSpan],
) -> std::io::Result<()> {
    let mut events = events(workload, records, updates);
    let dropped = events.len().saturating_sub(MAX_EVENTS);
    events.truncate(MAX_EVENTS);
    let doc = json!({
        "displayTimeUnit": "ms",
        "otherData": {"workload": workload.name, "dropped_events": dropped},
        "traceEvents": events,
    });
    serde_json::to_writer(&mut to, &doc)?;
    to.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_workload::WorkloadRequest;

    fn request(after: Option<usize>) -> WorkloadRequest {
        WorkloadRequest {
            arrival_ms: Some(0.0),
            after,
            delay_ms: 0.0,
            session: Some(1),
            blocks: vec![1],
            input_tokens: 64,
            output_tokens: 4,
            group: None,
            step: None,
            policy_version: None,
        }
    }

    #[test]
    fn spans_cover_queue_prefill_decode_tool_waits_and_updates() {
        let w = Workload {
            name: "t".into(),
            block_size: 64,
            requests: vec![request(None), request(Some(0))],
            barrier: None,
        };
        let t = Time::from_millis;
        let records = vec![
            Record {
                arrival: Some(t(0)),
                admitted: Some(t(2)),
                first_token: Some(t(10)),
                finish: Some(t(50)),
                worker: Some(3),
                ..Record::default()
            },
            Record {
                arrival: Some(t(80)),
                first_token: Some(t(85)),
                finish: Some(t(90)),
                worker: Some(3),
                ..Record::default()
            },
        ];
        let ev = events(&w, &records, &[(3, t(100), t(200))]);
        let names: Vec<&str> = ev.iter().filter_map(|e| e["name"].as_str()).collect();
        assert_eq!(
            names,
            vec![
                "queue",
                "prefill",
                "decode",
                "prefill",
                "decode",
                "tool wait",
                "weight update",
                "process_name"
            ]
        );
        let tool = &ev[5];
        assert_eq!(
            (tool["ts"].as_u64(), tool["dur"].as_u64()),
            (Some(50_000), Some(30_000))
        );
        let mut buf = Vec::new();
        write(&mut buf, &w, &records, &[]).unwrap();
        let doc: Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(doc["traceEvents"].as_array().unwrap().len(), 7);
        assert_eq!(doc["otherData"]["dropped_events"], 0);
    }
}
