//! The continuation state machine of one answer: pure (no I/O, no clock). It is fed what the
//! upstream sends (chunks of a stream, or a whole body) and how the upstream ended, and answers
//! with actions: the bytes to forward, and whether the answer is finished, continues elsewhere
//! (after a worker failure or a weight update's abort), or ends with an error.
//!
//! A stream is either followed event by event (it may be continued: `--migration-limit` > 0, the
//! admin API can abort it for a weight update, or it is a first-N-of-M sample) or passed through
//! chunk by chunk (a continuation with limit 0 that can never continue: the bytes go out as the
//! engine sent them, its first event stamped with the policy version).
//!
//! Engines stream one token per content chunk (vLLM, SGLang and the mock engine do), which is how
//! tokens already sent are counted. Requests that cannot be continued faithfully (`n` > 1,
//! several prompts, structured output, logprobs) end with an error instead of a corrupted answer.

use axum::body::Bytes;
use choices::Choices;
use kvrouter_openai::continuation::{chunk_text, finished_by_abort, finishing, tool_call};
use kvrouter_openai::fingerprint::{fingerprint, stamp, stamp_event, stamp_first_event};
use kvrouter_openai::sse::{self, EventSplitter};
use kvrouter_openai::{first_n, Kind};
use serde_json::Value;

/// What a stream failing with migration off tells the client.
pub(crate) const MIGRATION_OFF: &str =
    "the worker failed mid-stream and migration is off (--migration-limit)";
/// What a passed-through SSE stream that ends inside an event tells the client.
const ENDED_MID_EVENT: &str = "the worker's stream ended in the middle of an event";
/// What a passed-through OpenAI stream that ends cleanly without `[DONE]` tells the client.
const ENDED_WITHOUT_DONE: &str = "the worker's stream ended without [DONE]";
/// The tool call a request is in: its continuation would lose it.
const IN_A_TOOL_CALL: &str = "a tool call in progress";
/// Bytes of what went out last kept to see an event break or `[DONE]` across chunks.
const TAIL_BYTES: usize = 32;

/// How the upstream's bytes are followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Follow {
    /// Chunk by chunk, unchanged (`stamp`: the first event gets the fingerprint). Never continued.
    Chunks { stamp: bool },
    /// Event by event; continued at most `migration_limit` times after worker failures (and
    /// after every weight update's abort).
    Events { migration_limit: u32 },
}

/// What to do once the upstream of the current attempt is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// The answer is whole: its load is released as finished.
    Finish,
    /// End this attempt and continue the answer elsewhere: after a weight update's abort
    /// (waiting for a worker of an accepted version), or after a failure of its worker.
    Continue { after_abort: bool },
    /// End the answer with this error; `worker_failed`: the worker is to blame (health).
    Fail {
        message: String,
        worker_failed: bool,
    },
}

/// What to do with a whole (non-streamed) answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Whole {
    /// The client's body, and the usage of the last attempt's own body (what the engine
    /// reported, before any folding; for the load guard, so the body is not parsed again).
    Done { body: Bytes, usage: Option<Value> },
    /// A weight update aborted it: continue on an updated worker.
    Continue,
    /// It cannot be continued faithfully.
    Fail(String),
}

/// The state of one answer across its attempts.
#[derive(Debug)]
pub(crate) struct Continuation {
    kind: Kind,
    follow: Follow,
    /// Continuations after failures still allowed, of `limit`.
    left: u32,
    limit: u32,
    /// The body is SSE (a successful stream): checked to end at an event break.
    sse: bool,
    /// The body is an OpenAI stream: passed through, it must end with `[DONE]`.
    openai_stream: bool,
    /// What went to the client last ended an event (or nothing went yet).
    at_break: bool,
    /// The last bytes that went to the client (of an SSE body).
    tail: Vec<u8>,
    /// Why the request cannot be continued faithfully, if it cannot.
    unmigratable: Option<&'static str>,
    generated_text: String,
    generated_tokens: u64,
    /// Tokens produced before the current attempt (added to its usage).
    carried_tokens: u64,
    /// The upstream's SSE events, split whatever its chunk boundaries.
    events: EventSplitter,
    /// `[DONE]` went out: the answer is whole.
    done: bool,
    /// Which choices were seen and which finished: once every one did, the answer is whole
    /// even if `[DONE]` never comes.
    choices: Choices,
    /// The policy version serving the current attempt (the `system_fingerprint`).
    version: u64,
    /// The next event is the first of an attempt: it carries the fingerprint.
    stamp: bool,
    /// The engine aborted the attempt for a weight update: the rest of its stream is dropped.
    aborted: bool,
    /// Prompt tokens as the router counted them (the usage of an early end).
    prompt_tokens: u64,
    /// The original prompt's `prompt_tokens`, from the usage of an aborted first attempt.
    first_prompt_tokens: Option<u64>,
    /// The usage of the first part of a continued whole answer.
    original_usage: Option<Value>,
    /// The `id`, `model` and `created` of the answer's first event (or body) that stated them:
    /// an answer ended early keeps them.
    identity: Option<first_n::Identity>,
}

impl Continuation {
    /// An answer served first by `version`; `unmigratable` from the request body.
    pub(crate) fn new(
        kind: Kind,
        follow: Follow,
        version: u64,
        prompt_tokens: u64,
        unmigratable: Option<&'static str>,
    ) -> Self {
        let left = match follow {
            Follow::Chunks { .. } => 0,
            Follow::Events { migration_limit } => migration_limit,
        };
        let stamp = !matches!(follow, Follow::Chunks { stamp: false });
        Self {
            kind,
            follow,
            left,
            limit: left,
            sse: false,
            openai_stream: false,
            at_break: true,
            // The stream's start is a line start (`[DONE]` first is still `[DONE]`).
            tail: b"\n".to_vec(),
            unmigratable,
            generated_text: String::new(),
            generated_tokens: 0,
            carried_tokens: 0,
            events: EventSplitter::new(),
            done: false,
            choices: Choices::default(),
            version,
            stamp,
            aborted: false,
            prompt_tokens,
            first_prompt_tokens: None,
            original_usage: None,
            identity: None,
        }
    }

    /// The body is an SSE stream (a successful streamed answer): one that ends inside an event
    /// fails, and an error event after a cut event first ends it. `openai`: it is an OpenAI
    /// stream (completions, chat), which ends with `[DONE]`; passed through, one that ends
    /// without it fails too.
    pub(crate) fn with_sse(mut self, sse: bool, openai: bool) -> Self {
        self.sse = sse;
        self.openai_stream = sse && openai;
        self
    }

    /// The in-band error event that ends the answer: after a blank line when what went before
    /// stopped inside an event, so that the client can read it.
    pub(crate) fn error_event(&self, message: &str) -> Bytes {
        let event = sse::error_event(message);
        if self.at_break {
            return event;
        }
        let mut out = Vec::with_capacity(event.len() + 2);
        out.extend_from_slice(b"\n\n");
        out.extend_from_slice(&event);
        Bytes::from(out)
    }

    /// The request asks for `n` choices (`n` × prompts): the answer is whole only when that
    /// many finished.
    pub(crate) fn expecting_choices(mut self, n: u64) -> Self {
        self.choices.expected = n;
        self
    }

    /// Tokens produced so far, over all attempts.
    pub(crate) fn generated_tokens(&self) -> u64 {
        self.generated_tokens
    }

    /// The policy version serving the current attempt.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// Whether `[DONE]` went out (a first-N-of-M stop no longer applies).
    pub(crate) fn done(&self) -> bool {
        self.done
    }

    /// A chunk of the current attempt's stream: the bytes to forward (maybe none yet).
    /// `draining`: whether the worker is draining for a weight update (asked only when an event
    /// finished with `abort`).
    pub(crate) fn chunk(&mut self, chunk: Bytes, draining: impl Fn() -> bool) -> Bytes {
        let out = self.forwarded(chunk, draining);
        if self.sse && !out.is_empty() {
            if let (Follow::Chunks { .. }, false) = (self.follow, self.done) {
                // What follows `[DONE]` (comments, a cut) does not undo it.
                self.done = sse::done_line_in(&self.tail, &out);
            }
            self.note_tail(&out);
            self.at_break = sse::ends_event(&self.tail);
        }
        out
    }

    /// Keeps the last [`TAIL_BYTES`] that went out.
    fn note_tail(&mut self, out: &[u8]) {
        if out.len() >= TAIL_BYTES {
            self.tail.clear();
            self.tail.extend_from_slice(&out[out.len() - TAIL_BYTES..]);
        } else {
            self.tail.extend_from_slice(out);
            let cut = self.tail.len().saturating_sub(TAIL_BYTES);
            self.tail.drain(..cut);
        }
    }

    fn forwarded(&mut self, chunk: Bytes, draining: impl Fn() -> bool) -> Bytes {
        match self.follow {
            Follow::Chunks { .. } => {
                if self.stamp && chunk.starts_with(b"data:") {
                    self.stamp = false;
                    return stamp_first_event(chunk, &fingerprint(self.version));
                }
                chunk
            }
            Follow::Events { .. } => Bytes::from(self.events(&chunk, draining)),
        }
    }

    /// Splits complete SSE events out of `chunk`, tracking what was generated; rewrites the
    /// usage of a continued stream so the client sees one usage for the whole answer.
    fn events(&mut self, chunk: &[u8], draining: impl Fn() -> bool) -> Vec<u8> {
        self.events.push(chunk);
        let mut out = Vec::with_capacity(chunk.len());
        while let Some(event) = self.events.next_event() {
            let data = sse::data(&event).unwrap_or_default();
            if sse::is_done(data) {
                if !self.aborted {
                    self.done = true;
                    out.extend_from_slice(&event);
                }
                continue;
            }
            let Ok(mut v) = serde_json::from_slice::<Value>(data) else {
                out.extend_from_slice(&event);
                continue;
            };
            if self.identity.is_none() {
                self.identity = first_n::Identity::of(&v);
            }
            let prompt_in_usage =
                kvrouter_openai::usage::of(&v).and_then(|u| u["prompt_tokens"].as_u64());
            if self.aborted {
                // What the aborted attempt still sends (its usage) is not the client's; its
                // prompt count is the original prompt's.
                self.note_first_prompt(prompt_in_usage);
                continue;
            }
            if self.unmigratable.is_none() && tool_call(&v) {
                self.unmigratable = Some(IN_A_TOOL_CALL);
            }
            let content = chunk_text(self.kind, &v).filter(|c| !c.is_empty());
            if let Some(c) = content {
                self.generated_text.push_str(c);
                self.generated_tokens += 1;
            }
            let fp = fingerprint(self.version);
            if finished_by_abort(&v) && draining() {
                self.aborted = true;
                self.note_first_prompt(prompt_in_usage);
                if content.is_some() {
                    // Its text reaches the client; the abort does not.
                    v["choices"][0]["finish_reason"] = Value::Null;
                    stamp(&mut v, &fp);
                    out.extend_from_slice(&sse::data_event(&v));
                }
                continue;
            }
            self.choices.note(&v);
            let has_usage = kvrouter_openai::usage::of(&v).is_some();
            let fold = self.carried_tokens > 0 && has_usage;
            if !(self.stamp || has_usage || finishing(&v)) {
                out.extend_from_slice(&event);
                continue;
            }
            self.stamp = false;
            // Stamped in the engine's text unless the usage is folded (key order, numbers and
            // line ends stay the engine's).
            if let Some(stamped) = (!fold).then(|| stamp_event(&event, &fp)).flatten() {
                out.extend_from_slice(&stamped);
                continue;
            }
            stamp(&mut v, &fp);
            if fold {
                kvrouter_openai::usage::fold_continued(
                    &mut v["usage"],
                    self.carried_tokens,
                    self.first_prompt_tokens,
                );
            }
            out.extend_from_slice(&sse::data_event(&v));
        }
        if self.events.over_limit() {
            // Not SSE (no event break in 16 MiB): passed on as it came, not held in memory.
            out.extend_from_slice(self.events.pending());
            self.events.clear();
        }
        out
    }

    /// The first attempt's usage carries the original prompt's count.
    fn note_first_prompt(&mut self, prompt_in_usage: Option<u64>) {
        if let (Some(p), 0) = (prompt_in_usage, self.carried_tokens) {
            self.first_prompt_tokens.get_or_insert(p);
        }
    }

    /// The current attempt's upstream is over: `clean` (it ended) or not (an error, or silence
    /// past the idle timeout).
    pub(crate) fn upstream_over(&mut self, clean: bool) -> Next {
        if let Follow::Chunks { .. } = self.follow {
            return match (clean, self.at_break) {
                _ if self.done => Next::Finish,
                (true, true) if !self.openai_stream => Next::Finish,
                (true, true) => fail(ENDED_WITHOUT_DONE.into(), true),
                (true, false) => fail(ENDED_MID_EVENT.into(), true),
                (false, _) => fail(MIGRATION_OFF.into(), true),
            };
        }
        // An answer that finished is not continued (that would repeat it), `[DONE]` or not.
        if self.done || self.choices.all_finished() {
            return Next::Finish;
        }
        if self.aborted {
            if let Some(reason) = self.unmigratable {
                return fail(format!("the request was aborted by a weight update and cannot be continued faithfully ({reason})"), false);
            }
            self.aborted = false;
            return Next::Continue { after_abort: true };
        }
        // A failure: an error, silence, or an end without [DONE].
        if self.left == 0 {
            let message = match self.limit {
                0 => MIGRATION_OFF.into(),
                n => format!("the worker failed mid-stream and the answer was continued {n} time(s) already (--migration-limit)"),
            };
            return fail(message, true);
        }
        if let Some(reason) = self.unmigratable {
            return fail(format!("the worker failed mid-stream and the request cannot be continued faithfully ({reason})"), true);
        }
        self.left -= 1;
        Next::Continue { after_abort: false }
    }

    /// The current attempt ends and the answer continues in another: what it produced so far is
    /// carried into the next attempt's usage.
    pub(crate) fn continuing(&mut self) {
        self.carried_tokens = self.generated_tokens;
        self.events.clear();
    }

    /// The next attempt started on a worker serving `version`.
    pub(crate) fn started(&mut self, version: u64) {
        self.version = version;
        self.stamp = true;
    }

    /// The continuation request: the original plus what was generated, with the remaining
    /// token budget (`encode` re-tokenizes generated text for token-id prompts).
    pub(crate) fn body(&self, original: &Value, encode: impl FnOnce(&str) -> Vec<u32>) -> Value {
        kvrouter_openai::continuation::body(
            self.kind,
            original,
            &self.generated_text,
            self.generated_tokens,
            encode,
        )
    }

    /// The prompt count a continued answer reports: the original prompt's, from the first
    /// attempt's usage, else the router's own count.
    fn reported_prompt(&self) -> u64 {
        self.first_prompt_tokens.unwrap_or(self.prompt_tokens)
    }

    /// The identity the answer showed, else a fresh one for `model` (the request's).
    fn identity(&self, model: &str) -> first_n::Identity {
        self.identity
            .clone()
            .unwrap_or_else(|| first_n::Identity::fresh(model, unix_now()))
    }

    /// The last events of a stream ended because its group has enough samples (`model`: the
    /// request's, for an answer that showed none).
    pub(crate) fn stopped_events(&self, model: &str) -> Bytes {
        first_n::events(
            self.kind,
            &self.identity(model),
            self.reported_prompt(),
            self.generated_tokens,
            Some(&fingerprint(self.version)),
        )
    }

    /// A whole answer ended because its group has enough samples: what it produced so far,
    /// with finish reason `abort`.
    pub(crate) fn stopped_body(&self, model: &str) -> Bytes {
        let body = first_n::body(
            self.kind,
            &self.identity(model),
            &self.generated_text,
            self.reported_prompt(),
            self.generated_tokens,
            Some(&fingerprint(self.version)),
        );
        Bytes::from(body.to_string())
    }
}

/// Now, in Unix seconds (an answer's `created`).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn fail(message: String, worker_failed: bool) -> Next {
    Next::Fail {
        message,
        worker_failed,
    }
}

mod choices;
mod whole;

#[cfg(test)]
mod end_tests;
#[cfg(test)]
mod tests;
