//! Timing models: how long an engine step takes, in milliseconds.
//!
//! The one source of truth for step times: the engine model (`kvrouter-engine`) times its steps
//! with these, and the `cost` routing policy ([`crate::policy::cost`]) estimates TTFT and decode
//! slowdown with the same model, so a simulated fleet and the router's picture of it agree.
//! Table-driven profiles live in the engine crate (they read files) and implement the same trait.

use std::fmt::Debug;

/// What a step computes, as the timing model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// New (uncached) prompt tokens computed in the step.
    pub prefill_tokens: u64,
    /// Requests decoding one token in the step.
    pub decode_seqs: u64,
    /// Mean context length (tokens) of the decoding requests.
    pub decode_mean_context: f64,
    /// KV tokens in use by active requests.
    pub active_kv_tokens: u64,
    /// KV capacity in tokens.
    pub kv_capacity_tokens: u64,
}

/// A timing query outside what a profile can answer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "profile {profile}: {what} = {value} is outside the table and the profile does not extrapolate"
)]
pub struct TimingError {
    /// The profile's name.
    pub profile: String,
    /// Which axis.
    pub what: &'static str,
    /// The value asked for.
    pub value: f64,
}

/// How long steps take, in milliseconds.
pub trait TimingModel: Debug + Send + Sync {
    /// Time to compute `tokens` new prompt tokens in one step (0 tokens take 0 ms).
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError>;
    /// Time of one decode step for the given batch.
    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError>;
    /// Time of a whole step: prefill part plus decode part (each only when present).
    fn step_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        let prefill = if shape.prefill_tokens > 0 {
            self.prefill_ms(shape.prefill_tokens)?
        } else {
            0.0
        };
        let decode = if shape.decode_seqs > 0 {
            self.decode_ms(shape)?
        } else {
            0.0
        };
        Ok(prefill + decode)
    }
}

/// A shared model times like the model it shares (one profile loaded once, read by an engine
/// and by the router's cost policy).
impl<T: TimingModel + ?Sized> TimingModel for std::sync::Arc<T> {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError> {
        (**self).prefill_ms(tokens)
    }
    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        (**self).decode_ms(shape)
    }
    fn step_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        (**self).step_ms(shape)
    }
}

/// Dynamo mocker's polynomial model.
///
/// Prefill ms = 4.209989e-7·T² + 0.01518344·T + 16.50142 with T the new prefill tokens of the
/// step. Decode step ms = −25.74·p² + 54.01·p + 5.74 with p the fraction of KV capacity in use,
/// floored at 1 ms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DynamoPoly;

impl TimingModel for DynamoPoly {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError> {
        if tokens == 0 {
            return Ok(0.0);
        }
        let t = tokens as f64;
        Ok((4.209989e-7 * t * t + 0.01518344 * t + 16.50142).max(0.0))
    }

    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        let p = if shape.kv_capacity_tokens == 0 {
            1.0
        } else {
            shape.active_kv_tokens as f64 / shape.kv_capacity_tokens as f64
        };
        Ok((-25.74 * p * p + 54.01 * p + 5.74).max(1.0))
    }
}
