//! Which choices of an answer were seen and finished.

use serde_json::Value;

/// The choices of an answer seen so far, and those that carried a finish reason.
#[derive(Debug, Default)]
pub(super) struct Choices {
    /// How many the request asks for (`n` × prompts; 0 taken as 1).
    pub(super) expected: u64,
    seen: Vec<u64>,
    finished: Vec<u64>,
}

impl Choices {
    /// Notes the choices of an event.
    pub(super) fn note(&mut self, v: &Value) {
        for c in v["choices"].as_array().into_iter().flatten() {
            let index = c["index"].as_u64().unwrap_or(0);
            // Bounded by the answer's choices (`n`), which the engine sized.
            if !self.seen.contains(&index) {
                self.seen.push(index);
            }
            if !c["finish_reason"].is_null() && !self.finished.contains(&index) {
                self.finished.push(index);
            }
        }
    }

    /// Every choice seen has finished, and as many as the request asks for (a choice that
    /// never showed has not finished).
    pub(super) fn all_finished(&self) -> bool {
        let expected = self.expected.max(1) as usize;
        self.seen.len() == self.finished.len() && self.finished.len() >= expected
    }
}
