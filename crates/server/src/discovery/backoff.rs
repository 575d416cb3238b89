//! Reconnect delays of a discovery source: doubling from [`Backoff::INITIAL`] up to a bound
//! (`--discovery-backoff-max-secs`), back to the start after a success, or once the source ran
//! [`Backoff::WORKED`] without an error. Pure.

use std::time::Duration;

/// Delays between attempts to reach a source.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// The first delay.
    pub(crate) const INITIAL: Duration = Duration::from_millis(100);
    /// A source that ran this long without an error had been working.
    pub(crate) const WORKED: Duration = Duration::from_secs(10);

    /// Starts at [`Backoff::INITIAL`], never over `max`.
    pub(crate) fn new(max: Duration) -> Self {
        Self {
            next: Self::INITIAL.min(max),
            max,
        }
    }

    /// The delay before the next attempt (each failure doubles the one after).
    pub(crate) fn failed(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    /// The source answered: the next failure waits [`Backoff::INITIAL`] again.
    pub(crate) fn succeeded(&mut self) {
        self.next = Self::INITIAL.min(self.max);
    }

    /// The source ran `lasted` without an error: past [`Backoff::WORKED`] it had been working,
    /// so the next failure waits [`Backoff::INITIAL`] again.
    pub(crate) fn ran(&mut self, lasted: Duration) {
        if lasted >= Self::WORKED {
            self.succeeded();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_bound_and_reset_on_success() {
        let mut b = Backoff::new(Duration::from_millis(500));
        let ms: Vec<u128> = (0..5).map(|_| b.failed().as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 400, 500, 500]);
        b.succeeded();
        assert_eq!(b.failed(), Backoff::INITIAL);
        b.ran(Backoff::WORKED - Duration::from_millis(1));
        assert_eq!(b.failed(), Duration::from_millis(200), "not yet working");
        b.ran(Backoff::WORKED);
        assert_eq!(b.failed(), Backoff::INITIAL);
        assert_eq!(Backoff::new(Duration::ZERO).failed(), Duration::ZERO);
    }
}
