//! The gap before the next step, from the steps seen: which trainer the history supports.
//!
//! Two trainers are told apart: one whose phase between rollouts is fixed (the gap repeats)
//! and one whose phase follows the rollout (the gap is the span times a fixed ratio, as a
//! synchronous RL trainer training on the rollout's samples; sheet §6.2). The next step is
//! expected at the *earliest* either model still consistent with the history allows: each
//! model predicts the shortest gap it saw (the smallest gap, or the smallest gap-to-span
//! ratio times the current span); a model is dropped once the history refutes it (a gap
//! more than [`TOLERANCE`] of it, plus the measuring slack, longer than its prediction), and
//! when both are refuted (an irregular trainer) both stay, the earlier wins. With a single
//! gap seen both fit, so the earlier is taken; it takes a second gap to tell them apart.
//!
//! A configured rollout share r (`--planner-rl-rollout-share`) says the trainer's phase after
//! a rollout span S lasts at least S × (1 − r) / r: it times the first gap, and after that it
//! bounds every expected gap from below for as long as no gap seen was shorter than it (less
//! the tolerance and the slack); the first that is refutes it, and the history alone decides.
//! Pure: the caller passes seconds.

/// Relative tolerance of a model's prediction of a gap it has seen.
pub(super) const TOLERANCE: f64 = 0.05;

/// One step seen in full and the gap after it, seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct SpanGap {
    /// The step's span (first request to its last end, as seen at ticks).
    pub span_s: f64,
    /// The idle time after it.
    pub gap_s: f64,
}

/// The shortest gap the next step may leave after a step of `span_s` (so far): `gaps` are
/// every gap seen (some without the span before them), `pairs` the steps seen with the gap
/// after them, `slack_s` what measuring at ticks may add to a gap (two tick intervals: its
/// start and end are each seen up to a tick late), `prior` the gap-to-span ratio a configured
/// rollout share r claims, (1 − r) / r. `None` when no gap was seen and there is no prior.
pub(super) fn expected_gap(
    gaps: &[f64],
    pairs: &[SpanGap],
    span_s: f64,
    slack_s: f64,
    prior: Option<f64>,
) -> Option<f64> {
    let prior = prior.filter(|k| {
        pairs
            .iter()
            .all(|p| p.gap_s + TOLERANCE * p.gap_s + slack_s >= k * p.span_s)
    });
    let seen = seen_gap(gaps, pairs, span_s, slack_s);
    match (seen, prior) {
        (Some(g), Some(k)) => Some(g.max(k * span_s)),
        (g, k) => g.or(k.map(|k| k * span_s)),
    }
}

/// The history's expected gap (no prior).
fn seen_gap(gaps: &[f64], pairs: &[SpanGap], span_s: f64, slack_s: f64) -> Option<f64> {
    let shortest = gaps.iter().copied().reduce(f64::min)?;
    let ratio = pairs
        .iter()
        .filter(|p| p.span_s > 0.0)
        .map(|p| p.gap_s / p.span_s)
        .reduce(f64::min);
    let Some(ratio) = ratio else {
        return Some(shortest);
    };
    let fits = |predicted: f64, seen: f64| seen <= predicted + TOLERANCE * seen + slack_s;
    let fixed = gaps.iter().all(|g| fits(shortest, *g));
    let proportional = pairs.iter().all(|p| fits(ratio * p.span_s, p.gap_s));
    let (by_gap, by_span) = (shortest, ratio * span_s);
    Some(match (fixed, proportional) {
        (true, false) => by_gap,
        (false, true) => by_span,
        _ => by_gap.min(by_span),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pair(span_s: f64, gap_s: f64) -> SpanGap {
        SpanGap { span_s, gap_s }
    }

    #[test]
    fn one_gap_fits_both_models_and_the_earlier_is_taken() {
        // A 180 s step, then 60 s: a fixed phase says 60 s after the next, the ratio 1/3 of
        // its span.
        let p = [pair(180.0, 60.0)];
        assert_eq!(expected_gap(&[60.0], &p, 210.0, 2.0, None), Some(60.0));
        assert_eq!(expected_gap(&[60.0], &p, 150.0, 2.0, None), Some(50.0));
        // No gap seen: no prediction; a gap without its span: the gap.
        assert_eq!(expected_gap(&[], &[], 100.0, 2.0, None), None);
        assert_eq!(expected_gap(&[40.0], &[], 100.0, 2.0, None), Some(40.0));
    }

    #[test]
    fn gaps_that_follow_the_span_refute_the_fixed_phase() {
        // The trainer of docs/planner.md (r = 0.75, 1 s sync): gaps of 59.8 s and 69.7 s
        // after spans of 176.6 s and 206.2 s. The fixed phase would have woken 10 s early.
        let p = [pair(176.6, 59.8), pair(206.2, 69.7)];
        let g = expected_gap(&[59.8, 69.7], &p, 229.9, 2.0, None).unwrap();
        assert!((g - 229.9 * 69.7 / 206.2).abs() < 1e-9, "{g}");
        // Within the measuring slack both still fit: the earlier.
        let p = [pair(176.0, 60.0), pair(182.0, 62.0)];
        let g = expected_gap(&[60.0, 62.0], &p, 240.0, 2.0, None).unwrap();
        assert_eq!(g, 60.0);
    }

    #[test]
    fn a_fixed_phase_refutes_the_ratio() {
        // 60 s after every step, whatever its span: the ratio model would wait 60 × 240/120.
        let p = [pair(120.0, 60.0), pair(200.0, 60.0)];
        assert_eq!(
            expected_gap(&[60.0, 60.0], &p, 240.0, 2.0, None),
            Some(60.0)
        );
    }

    #[test]
    fn an_irregular_trainer_keeps_the_earlier_of_both() {
        let p = [pair(100.0, 60.0), pair(200.0, 30.0), pair(150.0, 90.0)];
        let g = expected_gap(&[60.0, 30.0, 90.0], &p, 300.0, 2.0, None).unwrap();
        assert_eq!(g, 30.0_f64.min(300.0 * 0.15));
    }

    #[test]
    fn a_prior_the_gaps_respect_bounds_every_gap_from_below() {
        let third = Some(1.0 / 3.0);
        // No gap seen: the prior times the first.
        assert_eq!(expected_gap(&[], &[], 150.0, 2.0, third), Some(50.0));
        // The first gap (59.8 s after 176.6 s) respects r = 0.75: the next, after a span of
        // 206.2 s, is expected no earlier than 206.2 / 3 (the history alone: 59.8 s).
        let p = [pair(176.6, 59.8)];
        let g = expected_gap(&[59.8], &p, 206.2, 2.0, third).unwrap();
        assert!((g - 206.2 / 3.0).abs() < 1e-9, "{g}");
        // A trainer at r = 0.9 (20 s after 180 s) refutes r = 0.75: the history decides.
        let p = [pair(180.0, 20.0)];
        assert_eq!(expected_gap(&[20.0], &p, 240.0, 2.0, third), Some(20.0));
        // A longer gap than the prior's keeps it (and the history's earlier model).
        let p = [pair(180.0, 120.0)];
        assert_eq!(expected_gap(&[120.0], &p, 150.0, 2.0, third), Some(100.0));
    }

    proptest! {
        /// Never later than the shortest gap seen and than the smallest ratio's gap unless
        /// the history refutes that model; never earlier than both.
        #[test]
        fn the_prediction_is_the_earliest_unrefuted_model(
            seen in prop::collection::vec((10.0f64..300.0, 1.0f64..200.0), 1..5),
            span in 0.0f64..400.0,
        ) {
            let pairs: Vec<SpanGap> = seen.iter().map(|(s, g)| pair(*s, *g)).collect();
            let gaps: Vec<f64> = seen.iter().map(|(_, g)| *g).collect();
            let g = expected_gap(&gaps, &pairs, span, 2.0, None).unwrap();
            let shortest = gaps.iter().copied().fold(f64::INFINITY, f64::min);
            let ratio = seen.iter().map(|(s, g)| g / s).fold(f64::INFINITY, f64::min);
            prop_assert!(g >= shortest.min(ratio * span) - 1e-9);
            prop_assert!(g <= shortest.max(ratio * span) + 1e-9);
            let refutes = |pred: &dyn Fn(f64) -> f64| {
                seen.iter().any(|(s, x)| *x > pred(*s) + TOLERANCE * x + 2.0)
            };
            if g > shortest + 1e-9 {
                prop_assert!(refutes(&|_| shortest));
            }
            if g > ratio * span + 1e-9 {
                prop_assert!(refutes(&|s| ratio * s));
            }
            // Each gap seen is predicted at least as early by a model that fits it: a
            // trainer that repeats its history is never expected late.
            if seen.len() == 1 {
                prop_assert!(g <= shortest.min(ratio * span) + 1e-9);
            }
        }

        /// With a prior ratio k: never earlier than the history alone, and at least k × span
        /// unless some gap seen was shorter than k times its span (beyond the tolerance).
        #[test]
        fn a_prior_bounds_the_gap_until_a_gap_refutes_it(
            seen in prop::collection::vec((10.0f64..300.0, 1.0f64..200.0), 0..5),
            span in 0.0f64..400.0,
            k in 0.05f64..2.0,
        ) {
            let pairs: Vec<SpanGap> = seen.iter().map(|(s, g)| pair(*s, *g)).collect();
            let gaps: Vec<f64> = seen.iter().map(|(_, g)| *g).collect();
            let with = expected_gap(&gaps, &pairs, span, 2.0, Some(k)).unwrap();
            if let Some(without) = expected_gap(&gaps, &pairs, span, 2.0, None) {
                prop_assert!(with >= without - 1e-9);
                prop_assert!(with <= without.max(k * span) + 1e-9);
            }
            let refuted = seen.iter().any(|(s, g)| g * (1.0 + TOLERANCE) + 2.0 < k * s);
            if !refuted {
                prop_assert!(with >= k * span - 1e-9);
            }
        }
    }
}
