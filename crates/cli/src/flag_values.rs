//! Checks of `kvrouter serve`'s numeric flag values; errors name the flag.

use anyhow::bail;
use std::time::Duration;

/// A number of seconds ≥ 0 (`None` stays `None`).
pub(crate) fn secs(v: Option<f64>, flag: &str) -> anyhow::Result<Option<Duration>> {
    match v {
        None => Ok(None),
        // `try_from`: a value past what a duration holds (1e300) is an error, not a panic.
        Some(s) if s.is_finite() && s >= 0.0 => match Duration::try_from_secs_f64(s) {
            Ok(d) => Ok(Some(d)),
            Err(_) => bail!("{flag}: {s} seconds is too long"),
        },
        Some(s) => bail!("{flag} must be a number of seconds ≥ 0, got {s}"),
    }
}

/// A number of seconds > 0.
pub(crate) fn positive(v: f64, flag: &str) -> anyhow::Result<Duration> {
    match non_negative(v, flag)? {
        d if !d.is_zero() => Ok(d),
        _ => bail!("{flag} must be a number of seconds > 0, got {v}"),
    }
}

/// A number of seconds ≥ 0.
pub(crate) fn non_negative(v: f64, flag: &str) -> anyhow::Result<Duration> {
    Ok(secs(Some(v), flag)?.unwrap_or_default())
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

/// The slowest replay of a trace's arrival times (`--arrival-speedup` of `sim` and `bench`): a
/// thousand times slower.
pub(crate) const MIN_ARRIVAL_SPEEDUP: f64 = 1e-3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_past_what_a_duration_holds_are_an_error_naming_the_flag() {
        assert_eq!(
            secs(Some(1.5), "--x").unwrap(),
            Some(Duration::from_millis(1500))
        );
        for bad in [1e300, f64::INFINITY, f64::NAN, -1.0] {
            let e = secs(Some(bad), "--grace").unwrap_err().to_string();
            assert!(e.contains("--grace"), "{bad}: {e}");
        }
        assert!(positive(0.0, "--t").is_err());
    }
}
