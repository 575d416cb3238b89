//! A request's line, written once when it ends: its provenance completed (status, worker,
//! timings, tokens) and handed to the provenance log (`--provenance-log`), the access log
//! (`--access-log`, when sampled) and the OTLP traces (when sampled).

use crate::provenance::Provenance;
use crate::state::AppState;
use kvrouter_core::ids::WorkerId;
use serde_json::Value;
use std::time::Instant;

/// Completes a provenance line and hands it to the log (with `--provenance-log`) and to the
/// access log (when it sampled the request).
pub(crate) fn log_line(
    state: &AppState,
    mut p: Box<Provenance>,
    status: &'static str,
    worker: Option<WorkerId>,
    arrival: Instant,
    first_at: Option<Instant>,
    usage: Option<&Value>,
) {
    let log = state.inner.config.provenance.as_ref();
    if log.is_none() && !p.access && !p.trace {
        return;
    }
    let now = Instant::now();
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    p.status = status;
    p.worker = worker.map(|w| w.0);
    p.ts_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    p.e2e_ms = ms(now.duration_since(arrival));
    p.ttft_ms = first_at.map(|f| ms(f.duration_since(arrival)));
    p.decode_ms = first_at.map(|f| ms(now.duration_since(f)));
    if let Some(u) = usage {
        // Tokens of earlier attempts (a continued request) are already in `output_tokens`.
        p.output_tokens += u["completion_tokens"].as_u64().unwrap_or(0);
        p.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
    }
    if p.access {
        crate::access::emit(&p);
    }
    if let (true, Some(otel)) = (p.trace, state.inner.config.otel.as_ref()) {
        otel.record(&p, arrival, first_at, now);
    }
    if let Some(log) = log {
        log.record(&p);
    }
}
