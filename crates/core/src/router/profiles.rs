//! The step-time models the router supplies itself to the `cost` policy: the online fit of a
//! worker given no profile, and [`Timing`], how a decision calls whichever profile a worker has.

use crate::policy::learn::LineFit;
use crate::timing::{DynamoPoly, StepShape, TimingError, TimingModel};

/// A step-time model fitted from what the router observes of one worker: prefill ms ≈ a + b·T
/// from (tokens to prefill ahead and including a request, its TTFT), decode ms ≈ c + d·p from
/// (KV fraction in use, mean inter-token latency). Used for workers given no profile when
/// `router_cost_fit` is on; until each line has two distinct points it answers as `DynamoPoly`.
#[derive(Clone, Copy, Debug)]
pub struct FittedProfile {
    /// TTFT against tokens to prefill.
    pub prefill: LineFit,
    /// Mean ITL against the KV fraction in use.
    pub decode: LineFit,
}

impl Default for FittedProfile {
    fn default() -> Self {
        Self {
            prefill: LineFit::new(512.0),
            decode: LineFit::new(512.0),
        }
    }
}

impl TimingModel for FittedProfile {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError> {
        match self.prefill.line() {
            Some((a, b)) if tokens > 0 => Ok(a + b * tokens as f64),
            _ => DynamoPoly.prefill_ms(tokens),
        }
    }

    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        match self.decode.line() {
            Some((c, d)) => {
                let p = shape.active_kv_tokens as f64 / shape.kv_capacity_tokens.max(1) as f64;
                Ok((c + d * p).max(0.1))
            }
            None => DynamoPoly.decode_ms(shape),
        }
    }
}

/// A candidate's step-time model: the built-in polynomial called directly (inlined into the
/// estimate), any other profile through its trait object.
#[derive(Clone, Copy, Debug)]
pub(super) enum Timing<'a> {
    /// [`DynamoPoly`] divided by a speed-up ratio, inlined.
    Poly(f64),
    /// Any other profile.
    Model(&'a dyn TimingModel),
}

impl TimingModel for Timing<'_> {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError> {
        match self {
            Timing::Poly(ratio) => Ok(DynamoPoly.prefill_ms(tokens)? / ratio),
            Timing::Model(m) => m.prefill_ms(tokens),
        }
    }

    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        match self {
            Timing::Poly(ratio) => Ok(DynamoPoly.decode_ms(shape)? / ratio),
            Timing::Model(m) => m.decode_ms(shape),
        }
    }
}
