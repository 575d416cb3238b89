//! A gateway connection's sign of life. A gateway that goes away without closing its
//! connection (its host lost, a network path dropped) sends no FIN, and the connection's
//! streams would hold their placements' load for good. So a connection that sends nothing for
//! the keepalive period is sent a PING, which a live HTTP/2 peer answers at once; one that
//! then sends nothing for as long again is given up. Any bytes read count as a sign of life.
//!
//! Pure: the caller keeps one timer and tells this what it read and when the timer fired.

use std::time::Duration;
use tokio::time::Instant;

/// What to do when the timer fires.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Due {
    /// Nothing yet: fire again at this time.
    At(Instant),
    /// Send a PING, and fire again at this time.
    Ping(Instant),
    /// Silent through a PING: close the connection.
    Dead,
}

#[derive(Debug)]
pub(super) struct Keepalive {
    every: Duration,
    last_read: Instant,
    /// Reads so far.
    reads: u64,
    /// The reads before the PING in flight, if one is.
    pinged_after: Option<u64>,
}

impl Keepalive {
    pub(super) fn new(every: Duration, now: Instant) -> Self {
        Self {
            every,
            last_read: now,
            reads: 0,
            pinged_after: None,
        }
    }

    /// When the timer first fires.
    pub(super) fn first(&self) -> Instant {
        self.last_read + self.every
    }

    /// The peer sent something at `now`.
    pub(super) fn on_read(&mut self, now: Instant) {
        self.last_read = now;
        self.reads += 1;
    }

    /// The timer fired at `now`.
    pub(super) fn on_timer(&mut self, now: Instant) -> Due {
        if let Some(reads) = self.pinged_after.take() {
            if reads == self.reads {
                return Due::Dead;
            }
        }
        let quiet_until = self.last_read + self.every;
        if now < quiet_until {
            return Due::At(quiet_until);
        }
        self.pinged_after = Some(self.reads);
        Due::Ping(now + self.every)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(30);

    #[test]
    fn a_silent_peer_is_pinged_then_given_up_and_an_answer_keeps_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut k = Keepalive::new(EVERY, t0);
        assert_eq!(k.first(), t0 + EVERY);
        // Silent for the period: a PING.
        assert_eq!(k.on_timer(t0 + EVERY), Due::Ping(t0 + s(60)));
        // Silent for as long again: dead.
        assert_eq!(k.on_timer(t0 + s(60)), Due::Dead);

        // The PING answered: quiet again, and the next silence counts from the answer.
        let mut k = Keepalive::new(EVERY, t0);
        assert_eq!(k.on_timer(t0 + EVERY), Due::Ping(t0 + s(60)));
        k.on_read(t0 + s(31));
        assert_eq!(k.on_timer(t0 + s(60)), Due::At(t0 + s(61)));
        assert_eq!(k.on_timer(t0 + s(61)), Due::Ping(t0 + s(91)));
        assert_eq!(k.on_timer(t0 + s(91)), Due::Dead);

        // The answer comes at once after the PING, and the timer fires a little late: the
        // silence since the answer is a whole period, but the PING was answered.
        let ms = Duration::from_millis;
        let mut k = Keepalive::new(EVERY, t0);
        assert_eq!(k.on_timer(t0 + EVERY), Due::Ping(t0 + s(60)));
        k.on_read(t0 + EVERY + ms(1));
        assert_eq!(
            k.on_timer(t0 + s(60) + ms(2)),
            Due::Ping(t0 + s(90) + ms(2))
        );
        assert_eq!(k.on_timer(t0 + s(90) + ms(2)), Due::Dead);
    }

    #[test]
    fn a_peer_that_keeps_sending_is_never_pinged() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(EVERY, t0);
        let mut now = t0;
        let mut due = k.first();
        for step in 1..100u64 {
            now = t0 + Duration::from_secs(step * 7);
            k.on_read(now);
            if now >= due {
                match k.on_timer(due) {
                    Due::At(next) => due = next,
                    other => panic!("{other:?} at {step}"),
                }
            }
        }
        assert!(due > now);
    }
}
