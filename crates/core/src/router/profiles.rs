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

#[cfg(test)]
mod tests {
    use crate::ids::WorkerId;
    use crate::policy::RouterMode;
    use crate::router::tests::{request, router_with, tokens};
    use crate::router::{Pin, RouterConfig};
    use crate::time::Time;

    #[test]
    fn a_speedup_ratio_divides_every_estimate_of_a_worker_without_a_profile() {
        let totals = |ratio: f64| {
            let mut r = router_with(
                RouterConfig {
                    router_mode: RouterMode::Cost,
                    router_cost_speedup_ratio: ratio,
                    ..Default::default()
                },
                3,
            );
            let mut busy = request(50, &tokens(50, 3000));
            busy.pin = Some(Pin {
                worker: WorkerId(1),
                dp_rank: None,
            });
            r.route(&busy, Time::ZERO).unwrap();
            let d = r
                .route(
                    &request(1, &tokens(1, 900)),
                    Time::ZERO + std::time::Duration::from_millis(1),
                )
                .unwrap();
            d.candidates.iter().map(|c| c.total).collect::<Vec<f64>>()
        };
        let (plain, fast) = (totals(1.0), totals(10.0));
        for (p, f) in plain.iter().zip(&fast) {
            assert!(
                *p > 0.0 && (p / f - 10.0).abs() < 1e-9,
                "{plain:?} {fast:?}"
            );
        }
        assert!(RouterConfig {
            router_cost_speedup_ratio: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
