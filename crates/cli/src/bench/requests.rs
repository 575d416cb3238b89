//! `requests.jsonl`: a line per request `kvrouter bench` sent, beside `summary.json`.

use anyhow::Context;
use kvrouter_core::time::Time;
use kvrouter_sim::Record;
use kvrouter_workload::Workload;
use std::path::Path;

/// One sent request's line in `requests.jsonl`: where it sits in the workload (the same
/// `index` in every run of that workload, so runs can be compared on the requests they all
/// completed), what it was and how it was served.
#[derive(serde::Serialize)]
pub(super) struct Line {
    index: usize,
    session: Option<u64>,
    input_tokens: u32,
    /// `ok`, `refused` (under overload) or `failed`.
    status: &'static str,
    cached_tokens: u32,
    output_tokens: u32,
    /// The worker that served it, when the endpoint names it (`x-kvrouter-worker`).
    worker: Option<usize>,
    /// When it was sent, ms since the run started.
    sent_ms: f64,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    /// The router's decision with every candidate's score, when it gives it
    /// (`x-kvrouter-decision`: `kvrouter serve --expose-decisions`).
    #[serde(skip_serializing_if = "Option::is_none")]
    decision: Option<serde_json::Value>,
}

/// The lines of the requests that were sent, in workload order.
pub(super) fn lines(
    workload: &Workload,
    records: &[Record],
    mut decisions: Vec<Option<serde_json::Value>>,
) -> Vec<Line> {
    let ms =
        |from: Option<Time>, to: Option<Time>| Some(to?.0.saturating_sub(from?.0) as f64 / 1e3);
    records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.arrival.is_some())
        .map(|(index, r)| {
            let ok = !r.rejected;
            Line {
                index,
                session: workload.requests[index].session,
                input_tokens: workload.requests[index].input_tokens,
                status: match (r.rejected, r.failed) {
                    (false, _) => "ok",
                    (true, false) => "refused",
                    (true, true) => "failed",
                },
                cached_tokens: r.served_cached,
                output_tokens: r.output_tokens,
                worker: r.worker,
                sent_ms: r.arrival.map_or(0.0, |t| t.0 as f64 / 1e3),
                ttft_ms: ok.then(|| ms(r.arrival, r.first_token)).flatten(),
                e2e_ms: ok.then(|| ms(r.arrival, r.finish)).flatten(),
                decision: decisions.get_mut(index).and_then(Option::take),
            }
        })
        .collect()
}

/// Writes `lines` to `out/requests.jsonl`, one JSON object a line.
pub(super) fn write(out: &Path, lines: &[Line]) -> anyhow::Result<()> {
    let mut jsonl = Vec::new();
    for line in lines {
        serde_json::to_writer(&mut jsonl, line)?;
        jsonl.push(b'\n');
    }
    let path = out.join("requests.jsonl");
    std::fs::write(&path, jsonl).with_context(|| format!("--out: cannot write {}", path.display()))
}
