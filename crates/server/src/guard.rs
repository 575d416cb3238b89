//! The load guard of one attempt at a request: it releases the request's load in the core exactly
//! once (finished, cancelled, aborted, or retired for a continuation), and records its metrics,
//! provenance line and captured timeline.

use crate::provenance::Provenance;
use crate::state::{AppState, Release};
use kvrouter_core::ids::{RequestId, WorkerId};
use kvrouter_core::policy::RouterMode;
use serde_json::Value;
use std::time::Instant;

mod record;

/// Releases the request's load in the core exactly once: at the end of the body, or when dropped.
/// Its state is its own: callers tell it what happened (a chunk, the end, a retirement) and read
/// what they need (its worker, its first byte) through methods.
pub(crate) struct LoadGuard {
    state: AppState,
    id: RequestId,
    mode: RouterMode,
    /// Its model's request-level histograms (and `model` label).
    model: std::sync::Arc<crate::metrics::ModelMetrics>,
    arrival: Instant,
    last_chunk: Option<Instant>,
    chunks: u64,
    tail: Vec<u8>,
    stream: bool,
    /// The load was released (by an end, a retirement, or the drop).
    done: bool,
    /// The worker serving this attempt.
    worker: WorkerId,
    /// When the first byte came back.
    first_at: Option<Instant>,
    /// The provenance line to complete and log (with `--provenance-log`).
    prov: Option<Box<Provenance>>,
    /// The RL group it is a sample of: its completion counts toward first-N-of-M.
    group: Option<u64>,
    /// When this attempt was placed.
    dispatched: Instant,
    /// A successful answer: its completion counts toward its group's first-N-of-M.
    counts_as_sample: bool,
    /// When this attempt produced its first byte (its prefill is over).
    attempt_first: Option<Instant>,
    /// Tokens produced by earlier attempts of a continued request (added to this one's usage).
    carried: u64,
    /// The router's own count of the prompt this attempt sent (`None`: a continuation, whose
    /// prompt the router extended, or an empty prompt).
    router_prompt_tokens: Option<std::num::NonZeroU64>,
    /// The worker's HTTP status, when it said one.
    status: Option<u16>,
    /// Counts it as an RL request for the planner (`--planner-advise`) until it drops.
    _rl: Option<crate::planner::RlToken>,
    /// Its answer is a completion or a chat, read as such: `false` for the pass-through
    /// endpoints (embeddings, `/tokenize`, `/detokenize`, `/v1/responses`), whose answers teach
    /// neither the latency histograms nor the cost model (a tokenize call is no 0-token
    /// completion; a Responses stream's first event is no token).
    generates: bool,
}

impl LoadGuard {
    pub(crate) fn new(
        state: AppState,
        id: RequestId,
        worker: WorkerId,
        arrival: Instant,
        stream: bool,
        (model, served): (&str, bool),
    ) -> Self {
        let mode = state.inner.config.router.router_mode;
        let model = state.inner.metrics.by_model.get(model, served);
        Self {
            state,
            id,
            mode,
            model,
            arrival,
            last_chunk: None,
            chunks: 0,
            tail: Vec::new(),
            stream,
            done: false,
            worker,
            first_at: None,
            prov: None,
            group: None,
            dispatched: Instant::now(),
            counts_as_sample: false,
            attempt_first: None,
            carried: 0,
            router_prompt_tokens: None,
            status: None,
            _rl: None,
            generates: true,
        }
    }

    /// Whether its answer is generated text (see the field).
    pub(crate) fn generating(mut self, generates: bool) -> Self {
        self.generates = generates;
        self
    }

    /// A continuation's guard: the request's first byte came earlier (`first_at`), and
    /// `carried` tokens were produced before this attempt.
    pub(crate) fn continuing(mut self, first_at: Option<Instant>, carried: u64) -> Self {
        self.first_at = first_at;
        self.carried = carried;
        self
    }

    /// A sample of RL group `group` (first-N-of-M), if any.
    pub(crate) fn in_group(mut self, group: Option<u64>) -> Self {
        self.group = group;
        if let (Some(_), Some(planner)) = (group, &self.state.inner.planner) {
            self._rl = Some(planner.rl_request(self.worker));
        }
        self
    }

    /// The router counted `tokens` prompt tokens (checked against the engine's usage).
    pub(crate) fn router_prompt(mut self, tokens: u64) -> Self {
        self.router_prompt_tokens = std::num::NonZeroU64::new(tokens);
        self
    }

    /// The provenance line to complete (with `--provenance-log`).
    pub(crate) fn with_provenance(mut self, prov: Option<Box<Provenance>>) -> Self {
        self.prov = prov;
        self
    }

    /// The worker answered with `success`: a successful answer's completion counts toward
    /// its group's first-N-of-M.
    pub(crate) fn answered(&mut self, success: bool) {
        self.counts_as_sample = success;
    }

    /// A pick (`api`, `ext_proc`): its caller sends the request (for the access line and trace).
    pub(crate) fn picked_by(&mut self, source: &'static str) {
        if let Some(p) = self.prov.as_mut() {
            p.pick = Some(source);
        }
    }

    /// The worker answered with HTTP status `status` (the access line; [`LoadGuard::refused`]).
    pub(crate) fn answered_status(&mut self, status: u16) {
        self.status = Some(status);
        if let Some(p) = self.prov.as_mut() {
            p.http_status = Some(status);
        }
    }

    /// How an answer the worker gave with an error status counts (`None`: a success, or none
    /// said); no TTFT, ITL or output length is learnt from its body, the worker's error.
    fn refused(&self) -> Option<&'static str> {
        match self.status? {
            200..=299 => None,
            429 => Some("rejected"),
            400..=499 => Some("client_error"),
            _ => Some("upstream_error"),
        }
    }

    /// The answer produced `tokens` so far, over all attempts (for an early end's line).
    pub(crate) fn produced(&mut self, tokens: u64) {
        if let Some(p) = self.prov.as_mut() {
            p.output_tokens = tokens;
        }
    }

    /// Takes the provenance line (it moves to the request's next attempt).
    pub(crate) fn take_provenance(&mut self) -> Option<Box<Provenance>> {
        self.prov.take()
    }

    /// The worker serving this attempt.
    pub(crate) fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Whether the answer is an event stream (for a pick placed without the request's body,
    /// which learns it from the answer's headers).
    pub(crate) fn set_stream(&mut self, stream: bool) {
        self.stream = stream;
    }

    /// Whether the client asked for a stream.
    pub(crate) fn is_stream(&self) -> bool {
        self.stream
    }

    /// Ends this attempt because the request continues in another one: its load is released,
    /// and it is counted as neither finished nor cancelled.
    pub(crate) fn retire(mut self) {
        self.done = true;
        self.state.inner.release(self.id, Release::Cancelled);
        self.capture("continued");
    }

    /// Ends the request early because its group has enough samples (first-N-of-M): its load is
    /// released and it is counted as aborted.
    pub(crate) fn end_aborted(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let inner = &self.state.inner;
        inner.release(self.id, Release::Cancelled);
        inner.metrics.requests.inc(&self.labels("aborted"));
        self.capture("aborted");
        if let Some(p) = self.prov.as_mut() {
            p.abort_reason = Some("group-satisfied");
        }
        self.log_provenance("aborted", None);
    }

    /// [`LoadGuard::end_failed`], counted as `failed` (a stream that ended with an in-band
    /// error, a pick whose answer was reported failed).
    pub(crate) fn fail(&mut self) {
        if !self.done {
            let inner = &self.state.inner;
            inner.metrics.requests.inc(&self.labels("failed"));
        }
        self.end_failed();
    }

    /// Ends the request because its answer failed after it began (the stream or the body ended
    /// in an error): its load is released and its provenance line logged as failed. Not counted:
    /// a whole answer refused with an error is counted by the caller as that error's status
    /// ([`LoadGuard::fail`] counts it as `failed`).
    pub(crate) fn end_failed(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        self.state.inner.release(self.id, Release::Cancelled);
        self.capture("failed");
        self.log_provenance("failed", None);
    }

    /// The labels of `kvrouter_requests_total` for an end with `status`.
    fn labels(&self, status: &'static str) -> [(&'static str, &str); 3] {
        [
            ("status", status),
            ("mode", self.mode.as_str()),
            ("model", self.model.model()),
        ]
    }

    /// When the first byte of this attempt came back.
    pub(crate) fn first_at(&self) -> Option<Instant> {
        self.first_at
    }

    /// One chunk of the answer came back.
    pub(crate) fn on_chunk(&mut self, chunk: &[u8]) {
        self.on_chunks(chunk, 1);
    }

    /// `chunks` chunks of the answer came back together as `bytes` (one clock read, one
    /// inter-token latency sample for them all).
    pub(crate) fn on_chunks(&mut self, chunk: &[u8], chunks: u64) {
        let now = Instant::now();
        if self.attempt_first.is_none() {
            self.attempt_first = Some(now);
            let at = self.state.inner.now();
            {
                let mut core = self.state.inner.lock_core();
                let _ = core.first_token(self.id);
                // The cost policy's online fit (router_cost_fit) learns from the TTFT.
                if self.refused().is_none() && self.generates {
                    core.observe_first_token(self.id, at);
                }
            }
            self.state.inner.wake_queue();
        }
        let answer = self.refused().is_none() && self.generates;
        if self.first_at.is_none() {
            self.first_at = Some(now);
            if answer {
                self.model
                    .ttft
                    .observe(now.duration_since(self.arrival).as_secs_f64());
            }
        } else if let Some(prev) = self.last_chunk {
            if self.stream && answer {
                self.model
                    .itl
                    .observe(now.duration_since(prev).as_secs_f64());
            }
        }
        self.last_chunk = Some(now);
        self.chunks += chunks;
        // Keep the tail (non-streamed bodies are small; streams end with their usage chunk).
        if !self.stream || has_usage(chunk) {
            if self.stream {
                self.tail.clear();
            }
            if self.tail.len() + chunk.len() <= 1 << 20 {
                self.tail.extend_from_slice(chunk);
            }
        }
    }

    /// The answer ended: its usage is read from the tail of the body.
    pub(crate) fn finish(&mut self) {
        if self.done {
            return;
        }
        let usage = kvrouter_openai::usage::find(&self.tail, self.stream);
        self.finish_with(usage);
    }

    /// A whole (non-streamed) answer ended, and its reader found its usage: the body is not
    /// parsed again.
    pub(crate) fn finish_read(&mut self, usage: Option<Value>) {
        if self.done {
            return;
        }
        self.finish_with(usage);
    }

    /// The answer ended, its body unseen (an endpoint picker told the gateway not to send it):
    /// the load is released as finished, and no output length is learnt or observed.
    pub(crate) fn finish_unmeasured(&mut self) {
        if self.done {
            return;
        }
        self.finish_as(None, Learn::Never);
    }

    /// The caller of a pick reported the first token (the pick API and ext_proc, where the
    /// answer does not pass through the router).
    pub(crate) fn first_token(&mut self) {
        if self.attempt_first.is_none() {
            self.on_chunks(&[], 1);
        }
    }

    /// The caller of a pick reported the end, with the answer's usage when it knows it (an
    /// OpenAI `usage` object: `completion_tokens`, `prompt_tokens`, ...). Without
    /// `completion_tokens` the output's length is unknown: not learnt, not in the histogram.
    pub(crate) fn finish_reported(&mut self, usage: Option<Value>) {
        if self.done {
            return;
        }
        self.counts_as_sample = true;
        self.finish_as(usage, Learn::IfReported);
    }

    fn finish_with(&mut self, usage: Option<Value>) {
        self.finish_as(usage, Learn::Always);
    }

    /// Ends the request as finished; `learn`: whether its output length is known and learnt
    /// (see [`Learn`]).
    fn finish_as(&mut self, usage: Option<Value>, learn: Learn) {
        self.done = true;
        let inner = &self.state.inner;
        let reported = usage.as_ref().and_then(|u| u["completion_tokens"].as_u64());
        let counted = if self.stream {
            self.chunks.saturating_sub(1)
        } else {
            0
        };
        let output = self.carried + reported.unwrap_or(counted);
        let refused = self.refused();
        let measured = refused.is_none()
            && self.generates
            && match learn {
                Learn::Always => true,
                Learn::IfReported => reported.is_some(),
                Learn::Never => false,
            };
        let status = refused.unwrap_or("ok");
        // The cost policy learns output lengths (per RL group, prompt and overall).
        inner.release_observed(self.id, Release::Finished, measured.then_some(output));
        if let (Some(group), true) = (self.group, self.counts_as_sample) {
            inner.group_sample_finished(group);
        }
        let m = &inner.metrics;
        if self.generates {
            let elapsed = self.arrival.elapsed().as_secs_f64();
            self.model.duration.observe(elapsed);
        }
        m.requests.inc(&self.labels(status));
        if measured {
            m.osl.observe(output as f64);
        }
        let engine = usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64());
        if let Some(engine) = engine {
            self.check_prompt_tokens(engine);
        }
        let cached = usage
            .as_ref()
            .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64());
        if let (Some(cached), Some(engine)) = (cached, engine) {
            // The served hit rate: cached over prompt tokens of the same answers.
            m.cached_tokens.observe(cached as f64);
            m.usage_prompt_tokens.observe(engine as f64);
        }
        self.capture(status);
        // A stream the client asked no usage of (`stream_options.include_usage`): the line
        // carries the tokens counted, over all attempts (it said 0, or a migrated stream's
        // tokens before its move only: found by probing).
        if let (None, Some(p)) = (reported, self.prov.as_mut()) {
            p.output_tokens = p.output_tokens.max(output);
        }
        self.log_provenance(status, usage.as_ref());
    }
}

/// Whether a finished request's output length is learnt (and in the histogram).
#[derive(Clone, Copy)]
enum Learn {
    /// Known: from its usage, else counted from the chunks the router forwarded.
    Always,
    /// Only when its usage says (a pick's report: the router saw no chunk).
    IfReported,
    /// Not known (ext_proc with response bodies unobserved).
    Never,
}

/// Whether a stream's chunk holds a `"usage"` key (a memchr search, not a byte-by-byte scan).
fn has_usage(chunk: &[u8]) -> bool {
    static USAGE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\""));
    USAGE.find(chunk).is_some()
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            self.state.inner.release(self.id, Release::Cancelled);
            self.state
                .inner
                .metrics
                .requests
                .inc(&self.labels("cancelled"));
            self.capture("cancelled");
            self.log_provenance("cancelled", None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::has_usage;

    #[test]
    fn the_usage_key_is_found_anywhere_in_a_chunk_and_only_as_a_key() {
        assert!(has_usage(
            b"data: {\"usage\":{\"completion_tokens\":3}}\n\n"
        ));
        let mut long = b"data: {\"choices\":[]}\n\n".repeat(500);
        assert!(!has_usage(&long));
        long.extend_from_slice(b"data: {\"choices\":[],\"usage\":null}\n\n");
        assert!(has_usage(&long));
        assert!(!has_usage(b"data: {\"text\":\"\\\"usag\"}"));
        assert!(!has_usage(b"usage"));
        assert!(!has_usage(b""));
    }
}
