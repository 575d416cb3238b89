//! Time as a value: the core never reads a clock, callers pass `now`.

use serde::{Deserialize, Serialize};
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time, in microseconds since an epoch the caller chooses (process start for the
/// server, 0 for the simulator).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Time(pub u64);

impl Time {
    /// The epoch.
    pub const ZERO: Time = Time(0);

    /// From microseconds.
    pub fn from_micros(us: u64) -> Self {
        Time(us)
    }

    /// From milliseconds.
    pub fn from_millis(ms: u64) -> Self {
        Time(ms.saturating_mul(1000))
    }

    /// From (fractional, non-negative) seconds.
    pub fn from_secs_f64(secs: f64) -> Self {
        Time((secs.max(0.0) * 1e6).round() as u64)
    }

    /// Microseconds since the epoch.
    pub fn as_micros(self) -> u64 {
        self.0
    }

    /// Seconds since the epoch.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// The time elapsed since `earlier` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

/// A duration of `ms` (fractional) milliseconds, as the simulator's and workloads' float
/// parameters give them: negative or NaN is zero, past what a [`Duration`] holds is
/// [`Duration::MAX`] (never a panic).
pub fn millis_f64(ms: f64) -> Duration {
    if ms.is_nan() || ms <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(ms / 1e3).unwrap_or(Duration::MAX)
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, rhs: Duration) -> Time {
        Time(self.0.saturating_add(rhs.as_micros() as u64))
    }
}

impl Sub<Duration> for Time {
    type Output = Time;
    fn sub(self, rhs: Duration) -> Time {
        Time(self.0.saturating_sub(rhs.as_micros() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_milliseconds_saturate_instead_of_panicking() {
        assert_eq!(millis_f64(1.5), Duration::from_micros(1500));
        assert_eq!(millis_f64(-3.0), Duration::ZERO);
        assert_eq!(millis_f64(f64::NAN), Duration::ZERO);
        assert_eq!(millis_f64(f64::INFINITY), Duration::MAX);
        assert_eq!(millis_f64(1e300), Duration::MAX);
    }

    #[test]
    fn arithmetic_saturates_and_converts() {
        let t = Time::from_millis(1500);
        assert_eq!(t.as_secs_f64(), 1.5);
        assert_eq!(t + Duration::from_millis(500), Time::from_secs_f64(2.0));
        assert_eq!(Time::ZERO - Duration::from_secs(1), Time::ZERO);
        assert_eq!(t.since(Time::from_millis(2000)), Duration::ZERO);
    }
}
