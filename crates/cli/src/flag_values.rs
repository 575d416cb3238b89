//! Checks of `kvrouter serve`'s numeric flag values; errors name the flag.

use anyhow::bail;
use std::time::Duration;

/// The longest duration any flag takes: a year. A duration is added to the clock (a lease's
/// expiry, a stream's idle deadline), and the clock panics past what it holds, so a longer
/// value (`1e19` seconds, `u64::MAX` ms) is refused at start instead of panicking at the
/// first request that uses it.
pub(crate) const MAX_FLAG_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// `d` unless it is longer than [`MAX_FLAG_DURATION`]; `shown` is the value as given.
pub(crate) fn bounded(d: Duration, shown: &str, flag: &str) -> anyhow::Result<Duration> {
    if d > MAX_FLAG_DURATION {
        bail!(
            "{flag}: {shown} is too long (at most {} seconds, a year)",
            MAX_FLAG_DURATION.as_secs()
        );
    }
    Ok(d)
}

/// A number of milliseconds given as an integer, at least 1 and at most a year.
pub(crate) fn millis(v: u64, flag: &str) -> anyhow::Result<Duration> {
    if v == 0 {
        bail!("{flag} must be at least 1");
    }
    bounded(Duration::from_millis(v), &format!("{v} ms"), flag)
}

/// `v` of `unit` (`seconds_per_unit` seconds each) ≥ 0 as a duration, at most a year; errors
/// speak in the flag's own unit.
fn float_duration(
    v: f64,
    seconds_per_unit: f64,
    unit: &str,
    flag: &str,
) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("{flag} must be a number of {unit} ≥ 0, got {v}");
    }
    // `try_from`: a value past what a duration holds (1e300) is an error, not a panic.
    match Duration::try_from_secs_f64(v * seconds_per_unit) {
        Ok(d) => bounded(d, &format!("{v} {unit}"), flag),
        Err(_) => bail!("{flag}: {v} {unit} is too long"),
    }
}

/// A number of seconds ≥ 0, at most a year (`None` stays `None`).
pub(crate) fn secs(v: Option<f64>, flag: &str) -> anyhow::Result<Option<Duration>> {
    v.map(|s| float_duration(s, 1.0, "seconds", flag))
        .transpose()
}

/// A number of milliseconds ≥ 0 given as a float (`--weight-load-ms`), at most a year; errors
/// speak in milliseconds, as the flag does.
pub(crate) fn non_negative_ms(ms: f64, flag: &str) -> anyhow::Result<Duration> {
    float_duration(ms, 1e-3, "ms", flag)
}

/// The items of a comma list flag, trimmed, none of them empty (two commas in a row, or one at
/// an end); `none` ends the message for a list without any.
pub(crate) fn comma_items<'a>(
    list: &'a str,
    flag: &str,
    none: &str,
) -> anyhow::Result<Vec<&'a str>> {
    let items: Vec<&str> = list.split(',').map(str::trim).collect();
    if items.iter().all(|s| s.is_empty()) {
        bail!("{flag} {list:?} {none}");
    }
    if items.iter().any(|s| s.is_empty()) {
        bail!("{flag} {list:?} has an empty item (two commas in a row, or one at an end)");
    }
    Ok(items)
}

/// A number of seconds > 0.
pub(crate) fn positive(v: f64, flag: &str) -> anyhow::Result<Duration> {
    // A negative value is told the bound it misses (not "≥ 0", which 0 would not meet either).
    if v <= 0.0 {
        bail!("{flag} must be a number of seconds > 0, got {v}");
    }
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
        // 1e19 s is a duration, but one the clock cannot hold added to now (a stream's idle
        // deadline panicked at the first streamed request).
        for bad in [
            1e300,
            1e19,
            365.0 * 86_400.0 + 1.0,
            f64::INFINITY,
            f64::NAN,
            -1.0,
        ] {
            let e = secs(Some(bad), "--grace").unwrap_err().to_string();
            assert!(e.contains("--grace"), "{bad}: {e}");
        }
        assert!(positive(0.0, "--t").is_err());
        assert_eq!(
            secs(Some(365.0 * 86_400.0), "--x").unwrap(),
            Some(MAX_FLAG_DURATION)
        );
        assert_eq!(millis(5, "--m").unwrap(), Duration::from_millis(5));
        assert_eq!(
            non_negative_ms(1500.0, "--w").unwrap(),
            Duration::from_millis(1500)
        );
        for bad in [-1.0, f64::NAN, 1e30, 1e300] {
            let e = non_negative_ms(bad, "--w").unwrap_err().to_string();
            assert!(e.contains("--w") && !e.contains("seconds is"), "{bad}: {e}");
        }
        for bad in [0, u64::MAX] {
            let e = millis(bad, "--m").unwrap_err().to_string();
            assert!(e.contains("--m"), "{bad}: {e}");
        }
    }
}
