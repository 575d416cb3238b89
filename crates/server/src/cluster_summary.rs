//! `GET /admin/cluster-summary`: this router's [`ClusterSummary`] (cache sketch + load) in the
//! core's versioned byte form, for a global router (`kvrouter serve --global`) to poll.
//!
//! Built from the core under its lock when asked for and kept for `refresh`: the summary served
//! is never older than `--cluster-summary-refresh-ms`, and however many global routers poll,
//! the core is walked at most once per period. Its sequence is the wall clock in µs (at least
//! one more than the last), so a restarted router's summaries still count as newer.

use crate::error::ServeError;
use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use kvrouter_core::global::{SketchConfig, SummaryOptions};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Content type of the summary bytes.
pub(crate) const SUMMARY_CONTENT_TYPE: &str = "application/x-kvrouter-cluster-summary";

/// The summary cache of one router.
#[derive(Clone)]
pub(crate) struct Publisher {
    state: AppState,
    last: Arc<Mutex<Last>>,
}

#[derive(Default)]
struct Last {
    sequence: u64,
    built: Option<(Instant, Arc<Vec<u8>>)>,
}

impl Publisher {
    pub(crate) fn new(state: AppState) -> Self {
        Self {
            state,
            last: Arc::default(),
        }
    }

    /// The summary's bytes: the cached ones while younger than the refresh period, else new.
    fn bytes(&self) -> Result<Arc<Vec<u8>>, ServeError> {
        let config = &self.state.inner.config.cluster_summary;
        let mut last = self.last.lock().expect("summary lock");
        if let Some((at, bytes)) = &last.built {
            if at.elapsed() < config.refresh {
                return Ok(bytes.clone());
            }
        }
        let wall_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let sequence = wall_us.max(last.sequence + 1);
        let options = SummaryOptions {
            name: config.name.clone(),
            sequence,
            sketch: SketchConfig::default(),
            prefill_tokens_per_s: config.prefill_tokens_per_s,
            decode_ms_per_token: config.decode_ms_per_token,
            decode_ms_per_token_per_seq: config.decode_ms_per_token_per_seq,
            max_running_requests: config.max_running_requests,
        };
        let now = self.state.inner.now();
        let mut summary = self
            .state
            .inner
            .lock_core()
            .cluster_summary(&options, now)
            .map_err(|e| ServeError::Upstream(format!("cluster summary: {e}")))?;
        let block_size = summary.block_size;
        state_decode_under_load(
            &mut summary.load,
            block_size,
            config.decode_ms_per_token_per_kv_block,
        );
        let bytes = Arc::new(summary.to_bytes());
        last.sequence = sequence;
        last.built = Some((Instant::now(), bytes.clone()));
        Ok(bytes)
    }
}

/// The configured latency is one request's alone: states the one at the running batch and
/// the KV it holds (`per_kv_block` ms per block per worker), and the growth one more request
/// brings as what its batch slot and its context (the running requests' mean, else 1,024
/// tokens) add.
fn state_decode_under_load(
    l: &mut kvrouter_core::global::ClusterLoad,
    block_size: u32,
    per_kv_block: f64,
) {
    if l.workers == 0 {
        return;
    }
    let workers = l.workers as f64;
    let per_request_blocks = if l.active_requests > 0 {
        l.active_decode_blocks as f64 / l.active_requests as f64
    } else {
        1024.0 / f64::from(block_size.max(1))
    };
    l.decode_ms_per_token += l.decode_ms_per_token_per_seq * l.active_requests as f64 / workers
        + per_kv_block * l.active_decode_blocks as f64 / workers;
    l.decode_ms_per_token_per_seq += per_kv_block * per_request_blocks;
}

/// `GET /admin/cluster-summary` (behind the admin token).
pub(crate) async fn get(State(p): State<Publisher>) -> Response {
    match p.bytes() {
        Ok(bytes) => (
            [(header::CONTENT_TYPE, SUMMARY_CONTENT_TYPE)],
            bytes.as_ref().clone(),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}
