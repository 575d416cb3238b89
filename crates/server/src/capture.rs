//! A bounded capture of recent request timelines (`--trace-capture N`), served by
//! `GET /admin/trace` as Chrome trace event JSON for Perfetto: per worker, each attempt's queue,
//! prefill (to its first byte) and decode spans, and the weight loads of update cycles. Off by
//! default; when on, each finished attempt costs one short lock.

use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

/// One finished attempt.
#[derive(Clone, Debug)]
pub(crate) struct Span {
    pub(crate) request: u64,
    pub(crate) worker: u64,
    pub(crate) arrival: Instant,
    pub(crate) dispatched: Instant,
    pub(crate) first: Option<Instant>,
    pub(crate) end: Instant,
    pub(crate) status: &'static str,
}

/// The last `capacity` attempts and weight loads.
pub(crate) struct Capture {
    capacity: usize,
    spans: Mutex<VecDeque<Span>>,
    loads: Mutex<VecDeque<(u64, Instant, Instant)>>,
}

impl Capture {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            spans: Mutex::new(VecDeque::new()),
            loads: Mutex::new(VecDeque::new()),
        }
    }

    pub(crate) fn record(&self, span: Span) {
        let mut spans = self.spans.lock().expect("capture lock");
        if spans.len() == self.capacity {
            spans.pop_front();
        }
        spans.push_back(span);
    }

    pub(crate) fn record_load(&self, worker: u64, from: Instant, to: Instant) {
        let mut loads = self.loads.lock().expect("capture lock");
        if loads.len() == self.capacity {
            loads.pop_front();
        }
        loads.push_back((worker, from, to));
    }

    /// The capture as a Chrome trace document; times are µs since `epoch`.
    pub(crate) fn document(&self, epoch: Instant) -> Value {
        let us = |t: Instant| t.saturating_duration_since(epoch).as_micros() as u64;
        let span = |name: &str, pid: u64, tid: u64, a: Instant, b: Instant, args: Value| {
            (b > a).then(|| {
                json!({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": us(a), "dur": us(b) - us(a), "args": args})
            })
        };
        let spans: Vec<Span> = self
            .spans
            .lock()
            .expect("capture lock")
            .iter()
            .cloned()
            .collect();
        let loads: Vec<(u64, Instant, Instant)> = self
            .loads
            .lock()
            .expect("capture lock")
            .iter()
            .copied()
            .collect();
        let mut events = Vec::new();
        let mut workers = std::collections::BTreeSet::new();
        for s in &spans {
            workers.insert(s.worker);
            let args = json!({"request": s.request, "status": s.status});
            events.extend(span(
                "queue",
                s.worker,
                s.request,
                s.arrival,
                s.dispatched,
                json!({}),
            ));
            let first = s.first.unwrap_or(s.end);
            events.extend(span(
                "prefill",
                s.worker,
                s.request,
                s.dispatched,
                first,
                args,
            ));
            events.extend(span("decode", s.worker, s.request, first, s.end, json!({})));
        }
        for (w, a, b) in &loads {
            workers.insert(*w);
            events.extend(span("weight update", *w, u64::MAX >> 12, *a, *b, json!({})));
        }
        for w in workers {
            events.push(json!({"name": "process_name", "ph": "M", "pid": w, "args": {"name": format!("worker {w}")}}));
        }
        json!({"displayTimeUnit": "ms", "traceEvents": events, "otherData": {"attempts": spans.len(), "capacity": self.capacity}})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn keeps_the_last_attempts_and_renders_their_spans() {
        let c = Capture::new(2);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        for r in 0..3 {
            c.record(Span {
                request: r,
                worker: r % 2,
                arrival: at(r * 10),
                dispatched: at(r * 10 + 1),
                first: Some(at(r * 10 + 5)),
                end: at(r * 10 + 9),
                status: "ok",
            });
        }
        c.record_load(1, at(40), at(60));
        let doc = c.document(t0);
        let events = doc["traceEvents"].as_array().unwrap();
        let requests: std::collections::BTreeSet<u64> = events
            .iter()
            .filter(|e| e["name"] == "decode")
            .map(|e| e["tid"].as_u64().unwrap())
            .collect();
        assert_eq!(
            requests.into_iter().collect::<Vec<_>>(),
            vec![1, 2],
            "bounded"
        );
        let load = events
            .iter()
            .find(|e| e["name"] == "weight update")
            .unwrap();
        assert_eq!(
            (load["ts"].as_u64(), load["dur"].as_u64()),
            (Some(40_000), Some(20_000))
        );
    }
}
