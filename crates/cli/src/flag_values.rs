//! Checks of `kvrouter serve`'s numeric flag values; errors name the flag.

use anyhow::bail;
use std::time::Duration;

/// A number of seconds ≥ 0 (`None` stays `None`).
pub(crate) fn secs(v: Option<f64>, flag: &str) -> anyhow::Result<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => bail!("{flag} must be a number of seconds ≥ 0, got {s}"),
    }
}

/// A number of seconds > 0.
pub(crate) fn positive(v: f64, flag: &str) -> anyhow::Result<Duration> {
    match secs(Some(v), flag)? {
        Some(d) if !d.is_zero() => Ok(d),
        _ => bail!("{flag} must be a number of seconds > 0, got {v}"),
    }
}

/// `v`, unless it is above `max`.
pub(crate) fn at_most<T: PartialOrd + std::fmt::Display>(
    v: T,
    max: T,
    flag: &str,
) -> anyhow::Result<T> {
    if v > max {
        bail!("{flag}: {v} is above {max}");
    }
    Ok(v)
}
