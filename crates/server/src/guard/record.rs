//! What an ended attempt leaves behind besides its metrics: its captured timeline
//! (`--trace-capture`), its provenance line, and the check of the engine's prompt count against
//! the router's.

use super::LoadGuard;
use crate::request_line::log_line;
use serde_json::Value;
use std::time::Instant;

impl LoadGuard {
    /// Keeps this attempt's timeline (with `--trace-capture`).
    pub(super) fn capture(&self, status: &'static str) {
        if let Some(c) = &self.state.inner.capture {
            c.record(crate::capture::Span {
                request: self.id.0,
                worker: self.worker.0,
                arrival: self.arrival,
                dispatched: self.dispatched,
                first: self.attempt_first,
                end: Instant::now(),
                status,
            });
        }
    }

    /// Completes and logs the provenance line, if any.
    pub(super) fn log_provenance(&mut self, status: &'static str, usage: Option<&Value>) {
        let Some(mut p) = self.prov.take() else {
            return;
        };
        p.output_tokens = p.output_tokens.max(self.carried);
        log_line(
            &self.state,
            p,
            status,
            Some(self.worker),
            self.arrival,
            self.first_at,
            usage,
        );
    }

    /// Counts (and logs once per worker) an engine whose prompt token count differs from the
    /// router's: the two render or tokenize differently, so predicted overlaps are wrong.
    pub(super) fn check_prompt_tokens(&self, engine: u64) {
        let Some(router) = self.router_prompt_tokens else {
            return;
        };
        let router = router.get();
        if router == engine {
            return;
        }
        let worker = self.worker.to_string();
        let m = &self.state.inner.metrics;
        if m.prompt_token_mismatches.inc_get(&[("worker", &worker)]) == 1 {
            tracing::warn!(
                "worker {worker} counted {engine} prompt tokens where the router counted \
                 {router}: its chat template or tokenizer differs from the router's \
                 (--chat-template, --tokenizer), so KV-aware routing mispredicts its cache"
            );
        }
    }
}
