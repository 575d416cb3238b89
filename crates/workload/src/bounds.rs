//! The bounds of the generators' parameters (`--workload-args`), checked before a workload is
//! generated: a value out of range is an error naming the field, never a panic (a pause too
//! long for a duration), an endless loop or a workload that cannot fit in memory. Each
//! generator's parameters get their `validate` here.

use crate::generators::{AgenticParams, GrpoParams, Seed001Params};
use crate::seed002::Seed002Params;

/// Requests a generated workload may hold at most (before turns are counted: a session of up
/// to [`MAX_TURNS`] turns counts that many).
pub const MAX_REQUESTS: u64 = 10_000_000;
/// Turns of one agentic session at most (the generator clips the draw to 3..=100).
pub const MAX_TURNS: u64 = 100;
/// Tokens any one length parameter may give (a prompt part, an output, a cap).
pub const MAX_TOKENS: u32 = 1 << 20;
/// Seconds any one time parameter may give (a pause, a gap, a latency).
pub const MAX_SECONDS: f64 = 86_400.0;
/// The largest log-space standard deviation of a length or latency.
pub const MAX_SIGMA: f64 = 10.0;
/// Samples per group (task) at most.
pub const MAX_GROUP: u32 = 4096;
/// RL steps at most.
pub const MAX_STEPS: u32 = 10_000;
/// Steps rollouts may run ahead at most.
pub const MAX_STALENESS: u32 = 1000;

/// `v` in `lo..=hi`.
pub(crate) fn count(field: &str, v: u32, lo: u32, hi: u32) -> Result<(), String> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("{field} must be in {lo}..={hi}, got {v}"))
    }
}

/// `v` in `(0, hi]`.
pub(crate) fn positive(field: &str, v: f64, hi: f64) -> Result<(), String> {
    if v > 0.0 && v <= hi {
        Ok(())
    } else {
        Err(format!("{field} must be above 0 and at most {hi}, got {v}"))
    }
}

/// `v` in `[0, hi]`.
pub(crate) fn non_negative(field: &str, v: f64, hi: f64) -> Result<(), String> {
    if (0.0..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("{field} must be in 0..={hi}, got {v}"))
    }
}

/// A median length in tokens: above 0, at most [`MAX_TOKENS`].
pub(crate) fn tokens_median(field: &str, v: f64) -> Result<(), String> {
    positive(field, v, f64::from(MAX_TOKENS))
}

/// A log-space standard deviation: `[0, MAX_SIGMA]`.
pub(crate) fn sigma(field: &str, v: f64) -> Result<(), String> {
    non_negative(field, v, MAX_SIGMA)
}

/// A share of an RL step in rollout: `(0, 1]`.
pub(crate) fn share(field: &str, v: f64) -> Result<(), String> {
    positive(field, v, 1.0)
}

/// The requests `units` × `per_unit` would generate, at most [`MAX_REQUESTS`].
pub(crate) fn requests(what: &str, units: u64, per_unit: u64) -> Result<(), String> {
    let n = units.saturating_mul(per_unit);
    if n <= MAX_REQUESTS {
        Ok(())
    } else {
        Err(format!(
            "{what} would generate up to {n} requests, more than {MAX_REQUESTS}"
        ))
    }
}

impl GrpoParams {
    /// Checks every parameter's range; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        count("prompts", self.prompts, 1, u32::MAX)?;
        count("group_size", self.group_size, 1, MAX_GROUP)?;
        count("steps", self.steps, 1, MAX_STEPS)?;
        requests(
            "prompts × group_size × steps",
            u64::from(self.prompts) * u64::from(self.group_size),
            u64::from(self.steps),
        )?;
        count("template_tokens", self.template_tokens, 0, MAX_TOKENS)?;
        tokens_median("problem_median", self.problem_median)?;
        sigma("problem_sigma", self.problem_sigma)?;
        count("problem_cap", self.problem_cap, 1, MAX_TOKENS)?;
        tokens_median("output_median", self.output_median)?;
        sigma("output_sigma_between", self.output_sigma_between)?;
        sigma("output_sigma_within", self.output_sigma_within)?;
        count("output_cap", self.output_cap, 1, MAX_TOKENS)?;
        non_negative("sync_pause_s", self.sync_pause_s, MAX_SECONDS)?;
        share("rollout_share", self.rollout_share)?;
        count("staleness", self.staleness, 0, MAX_STALENESS)
    }
}

impl AgenticParams {
    /// Checks every parameter's range; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        count("sessions", self.sessions, 1, u32::MAX)?;
        count("group_size", self.group_size, 1, MAX_GROUP)?;
        count("steps", self.steps, 0, MAX_STEPS)?;
        requests(
            "sessions × group_size × steps × turns",
            u64::from(self.sessions) * u64::from(self.group_size) * u64::from(self.steps.max(1)),
            MAX_TURNS,
        )?;
        non_negative("session_gap_s", self.session_gap_s, MAX_SECONDS)?;
        count("harness_tokens", self.harness_tokens, 0, MAX_TOKENS)?;
        tokens_median("issue_median", self.issue_median)?;
        sigma("issue_sigma", self.issue_sigma)?;
        positive("turns_median", self.turns_median, MAX_TURNS as f64)?;
        sigma("turns_sigma", self.turns_sigma)?;
        tokens_median("output_median", self.output_median)?;
        sigma("output_sigma", self.output_sigma)?;
        tokens_median("tool_tokens_median", self.tool_tokens_median)?;
        sigma("tool_tokens_sigma", self.tool_tokens_sigma)?;
        positive(
            "tool_latency_median_s",
            self.tool_latency_median_s,
            MAX_SECONDS,
        )?;
        sigma("tool_latency_sigma", self.tool_latency_sigma)?;
        count("context_cap", self.context_cap, 1, MAX_TOKENS)?;
        non_negative("sync_pause_s", self.sync_pause_s, MAX_SECONDS)?;
        share("rollout_share", self.rollout_share)?;
        count("staleness", self.staleness, 0, MAX_STALENESS)
    }
}

impl Seed001Params {
    /// Checks every parameter's range; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        count("requests", self.requests, 1, MAX_REQUESTS as u32)?;
        positive("rate_per_s", self.rate_per_s, 1e6)?;
        // Arrivals past a year (the trace readers' bound) saturate the clock: every request
        // then lands at one instant.
        if f64::from(self.requests) / self.rate_per_s > 365.0 * 86_400.0 {
            return Err(format!(
                "rate_per_s {}: {} requests would arrive over more than a year",
                self.rate_per_s, self.requests
            ));
        }
        non_negative("shared_fraction", self.shared_fraction, 1.0)?;
        count("shared_tokens", self.shared_tokens, 0, MAX_TOKENS)?;
        count("question_tokens", self.question_tokens, 0, MAX_TOKENS)?;
        count("document_tokens", self.document_tokens, 0, MAX_TOKENS)?;
        count("output_tokens", self.output_tokens, 1, MAX_TOKENS)
    }
}

impl Seed002Params {
    /// Checks every parameter's range; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        count("steps", self.steps, 1, MAX_STEPS)?;
        count("tasks", self.tasks, 1, u32::MAX)?;
        count("group_size", self.group_size, 1, MAX_GROUP)?;
        requests(
            "tasks × group_size × steps × turns",
            u64::from(self.tasks) * u64::from(self.group_size) * u64::from(self.steps),
            MAX_TURNS,
        )?;
        count("harness_tokens", self.harness_tokens, 0, MAX_TOKENS)?;
        positive("turns_median", self.turns_median, MAX_TURNS as f64)?;
        sigma("turns_sigma", self.turns_sigma)?;
        tokens_median("output_median", self.output_median)?;
        tokens_median("tool_tokens_median", self.tool_tokens_median)?;
        positive(
            "tool_latency_median_s",
            self.tool_latency_median_s,
            MAX_SECONDS,
        )?;
        count("context_cap", self.context_cap, 1, MAX_TOKENS)?;
        non_negative("sync_pause_s", self.sync_pause_s, MAX_SECONDS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_name_the_field_and_refuse_nan() {
        assert!(count("prompts", 0, 1, 10).unwrap_err().contains("prompts"));
        assert!(positive("x", f64::NAN, 1.0).is_err());
        assert!(non_negative("x", f64::INFINITY, 1.0).is_err());
        assert!(non_negative("x", 0.0, 1.0).is_ok());
        assert!(positive("x", 0.0, 1.0).is_err());
        assert!(requests("steps × prompts", u64::MAX, 2).is_err());
    }

    #[test]
    fn seed001_arrivals_stay_within_a_year() {
        let p = |rate_per_s: f64, requests: u32| Seed001Params {
            rate_per_s,
            requests,
            ..Seed001Params::default()
        };
        assert!(p(1.0, 100).validate().is_ok());
        let e = p(1e-300, 5).validate().unwrap_err();
        assert!(e.contains("rate_per_s") && e.contains("a year"), "{e}");
        assert!(p(1e-6, 100).validate().is_err());
    }
}
