//! The bounds of the generators' parameters (`--workload-args`), checked before a workload is
//! generated: a value out of range is an error naming the field, never a panic (a pause too
//! long for a duration), an endless loop or a workload that cannot fit in memory.

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
}
