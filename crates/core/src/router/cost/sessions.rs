//! Sessions as the `cost` policy sees them: where each session's last turn went (its home, for
//! soft affinity) and the KV of sessions between turns.
//!
//! A session between turns holds no request, so the ledger counts none of its load; but its
//! context stays cached on its home worker, and its next turn will decode there, reading that KV
//! again. Within `router_cost_session_window_secs` (default 20) of its last turn ending, a session counts as
//! *resident*: its context's tokens are added to its home's KV in the cost estimates of other
//! requests (the decode speed they will see there), not of its own next turn. A new session is
//! then placed beside fewer returning ones, and a busy agent's home is not given the next cold
//! prompt that happens to share its system prompt. After the window the session no longer
//! counts (its home is kept for affinity).

use crate::fast_map::FastMap;
use crate::ids::WorkerRank;
use crate::time::Time;
use std::collections::VecDeque;
use std::time::Duration;

/// Sessions remembered before the oldest half is forgotten.
const MAX_SESSIONS: usize = 65_536;

/// One session's home and state.
#[derive(Clone, Copy, Debug)]
struct Home {
    rank: WorkerRank,
    /// When its last turn was placed.
    placed: Time,
    /// Its context's tokens as of its last turn (prompt, then output once known).
    kv_tokens: u64,
    /// Its requests in flight.
    active: u32,
    /// When its last request ended, while it counts as resident.
    resident_since: Option<Time>,
}

/// The sessions' homes and the resident KV per rank.
#[derive(Debug, Default)]
pub(super) struct Sessions {
    homes: FastMap<u64, Home>,
    /// Σ KV tokens of the sessions resident on each rank.
    resident: FastMap<WorkerRank, u64>,
    /// (time it became resident, session), oldest first; stale entries are skipped.
    queue: VecDeque<(Time, u64)>,
}

impl Sessions {
    /// Where the session's last turn went.
    pub(super) fn home(&self, session: u64) -> Option<WorkerRank> {
        self.homes.get(&session).map(|h| h.rank)
    }

    /// KV tokens of the sessions resident on `rank`, but for `session`'s own.
    pub(super) fn resident_kv(&self, rank: WorkerRank, session: Option<u64>) -> u64 {
        let all = self.resident.get(&rank).copied().unwrap_or(0);
        let own = session
            .and_then(|s| self.homes.get(&s))
            .filter(|h| h.rank == rank && h.resident_since.is_some())
            .map_or(0, |h| h.kv_tokens);
        all.saturating_sub(own)
    }

    /// A turn of `session` was placed on `rank` with a `kv_tokens`-token context.
    pub(super) fn placed(&mut self, session: u64, rank: WorkerRank, kv_tokens: u64, now: Time) {
        if let Some(h) = self.homes.get(&session).copied() {
            self.unresident(session, h);
        }
        let h = self.homes.entry(session).or_insert(Home {
            rank,
            placed: now,
            kv_tokens: 0,
            active: 0,
            resident_since: None,
        });
        h.rank = rank;
        h.placed = now;
        h.kv_tokens = kv_tokens;
        h.active = h.active.saturating_add(1);
        if self.homes.len() > MAX_SESSIONS {
            self.forget_oldest_half();
        }
    }

    /// A request of `session` on `rank` ended, having written `output_tokens`: when it was the
    /// session's last in flight on its home, the session is resident there for `window`.
    pub(super) fn ended(
        &mut self,
        session: u64,
        rank: WorkerRank,
        output_tokens: u64,
        window: Duration,
        now: Time,
    ) {
        let Some(h) = self.homes.get_mut(&session) else {
            return;
        };
        h.active = h.active.saturating_sub(1);
        if h.rank != rank || h.resident_since.is_some() {
            return;
        }
        h.kv_tokens = h.kv_tokens.saturating_add(output_tokens);
        if h.active > 0 || window.is_zero() {
            return;
        }
        h.resident_since = Some(now);
        *self.resident.entry(rank).or_default() += h.kv_tokens;
        self.queue.push_back((now, session));
        if self.queue.len() > 2 * self.homes.len() + 1024 {
            let homes = &self.homes;
            self.queue
                .retain(|(t, s)| homes.get(s).is_some_and(|h| h.resident_since == Some(*t)));
        }
    }

    /// Sessions resident for longer than `window` no longer count.
    pub(super) fn expire(&mut self, window: Duration, now: Time) {
        while let Some(&(since, session)) = self.queue.front() {
            if now.since(since) <= window {
                return;
            }
            self.queue.pop_front();
            if let Some(h) = self.homes.get(&session).copied() {
                if h.resident_since == Some(since) {
                    self.unresident(session, h);
                }
            }
        }
    }

    /// A removed worker's ranks hold no resident sessions (their homes stay, for affinity
    /// should it come back under the same id; their next turns go where the estimates say).
    pub(super) fn worker_removed(&mut self, worker: crate::ids::WorkerId) {
        self.resident.retain(|rank, _| rank.worker != worker);
        for h in self.homes.values_mut() {
            if h.rank.worker == worker {
                h.resident_since = None;
            }
        }
    }

    /// Takes `session` (whose entry is `h`) out of its rank's resident KV, if it was there.
    fn unresident(&mut self, session: u64, h: Home) {
        if h.resident_since.is_none() {
            return;
        }
        if let Some(kv) = self.resident.get_mut(&h.rank) {
            *kv = kv.saturating_sub(h.kv_tokens);
            if *kv == 0 {
                self.resident.remove(&h.rank);
            }
        }
        if let Some(h) = self.homes.get_mut(&session) {
            h.resident_since = None;
        }
    }

    /// Forgets the older half of the sessions with nothing in flight (one in flight keeps its
    /// entry, so its end is counted against the right one).
    fn forget_oldest_half(&mut self) {
        let mut t: Vec<Time> = self
            .homes
            .values()
            .filter(|h| h.active == 0)
            .map(|h| h.placed)
            .collect();
        if t.is_empty() {
            return;
        }
        t.sort_unstable();
        let cut = t[t.len() / 2];
        let old: Vec<(u64, Home)> = self
            .homes
            .iter()
            .filter(|(_, h)| h.active == 0 && h.placed <= cut)
            .map(|(s, h)| (*s, *h))
            .collect();
        for (s, h) in old {
            self.unresident(s, h);
            self.homes.remove(&s);
        }
    }

    /// Checks the resident sums against the homes (tests).
    #[cfg(test)]
    pub(super) fn check(&self) -> Result<(), String> {
        let mut sums: FastMap<WorkerRank, u64> = FastMap::default();
        for h in self.homes.values() {
            if h.resident_since.is_some() {
                *sums.entry(h.rank).or_default() += h.kv_tokens;
            }
        }
        sums.retain(|_, v| *v > 0);
        let mut have = self.resident.clone();
        have.retain(|_, v| *v > 0);
        if sums != have {
            return Err(format!("resident {have:?}, homes say {sums:?}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::WorkerId;

    fn rank(w: u64) -> WorkerRank {
        WorkerRank::new(WorkerId(w), 0)
    }

    #[test]
    fn a_session_between_turns_counts_on_its_home_for_the_window_but_not_for_itself() {
        let window = Duration::from_secs(30);
        let mut s = Sessions::default();
        s.placed(7, rank(1), 1_000, Time::from_millis(0));
        assert_eq!(
            s.resident_kv(rank(1), None),
            0,
            "in flight: the ledger counts it"
        );
        s.ended(7, rank(1), 200, window, Time::from_millis(5_000));
        assert_eq!(s.resident_kv(rank(1), None), 1_200);
        assert_eq!(
            s.resident_kv(rank(1), Some(7)),
            0,
            "not against its own next turn"
        );
        assert_eq!(s.resident_kv(rank(2), None), 0);
        s.expire(window, Time::from_millis(35_000));
        assert_eq!(
            s.resident_kv(rank(1), None),
            1_200,
            "still within the window"
        );
        s.expire(window, Time::from_millis(35_001));
        assert_eq!(s.resident_kv(rank(1), None), 0);
        assert_eq!(s.home(7), Some(rank(1)), "the home stays for affinity");
        s.check().unwrap();
    }

    #[test]
    fn the_next_turn_takes_the_session_out_wherever_it_goes() {
        let window = Duration::from_secs(30);
        let mut s = Sessions::default();
        s.placed(7, rank(1), 1_000, Time::from_millis(0));
        s.ended(7, rank(1), 0, window, Time::from_millis(1_000));
        s.placed(7, rank(2), 1_500, Time::from_millis(2_000));
        assert_eq!(s.resident_kv(rank(1), None), 0);
        assert_eq!(s.resident_kv(rank(2), None), 0);
        // Its old queue entry is stale: expiring it changes nothing.
        s.ended(7, rank(2), 0, window, Time::from_millis(3_000));
        s.expire(window, Time::from_millis(31_500));
        assert_eq!(s.resident_kv(rank(2), None), 1_500);
        s.check().unwrap();
    }

    #[test]
    fn a_session_with_a_request_still_in_flight_or_ended_elsewhere_is_not_resident() {
        let window = Duration::from_secs(30);
        let mut s = Sessions::default();
        s.placed(7, rank(1), 1_000, Time::from_millis(0));
        s.placed(7, rank(1), 1_100, Time::from_millis(10));
        s.ended(7, rank(1), 0, window, Time::from_millis(20));
        assert_eq!(s.resident_kv(rank(1), None), 0, "one still in flight");
        s.ended(7, rank(1), 0, window, Time::from_millis(30));
        assert_eq!(s.resident_kv(rank(1), None), 1_100);
        // A window of zero: never resident.
        let mut off = Sessions::default();
        off.placed(8, rank(1), 1_000, Time::from_millis(0));
        off.ended(8, rank(1), 0, Duration::ZERO, Time::from_millis(1));
        assert_eq!(off.resident_kv(rank(1), None), 0);
        // A turn that moved: the old rank's end is not the session's home.
        let mut moved = Sessions::default();
        moved.placed(9, rank(1), 1_000, Time::from_millis(0));
        moved.placed(9, rank(2), 1_000, Time::from_millis(1));
        moved.ended(9, rank(1), 0, window, Time::from_millis(2));
        assert_eq!(moved.resident_kv(rank(1), None), 0);
        moved.check().unwrap();
    }

    #[test]
    fn a_late_end_of_a_resident_session_adds_nothing_and_busy_homes_are_not_forgotten() {
        let window = Duration::from_secs(30);
        let mut s = Sessions::default();
        s.placed(7, rank(1), 1_000, Time::from_millis(0));
        s.ended(7, rank(1), 10, window, Time::from_millis(1));
        // An end counted against a session already resident (its entry was recreated while a
        // request was in flight): the sums stay right.
        s.ended(7, rank(1), 500, window, Time::from_millis(2));
        assert_eq!(s.resident_kv(rank(1), None), 1_010);
        s.check().unwrap();
        s.expire(window, Time::from_millis(40_000));
        assert_eq!(s.resident_kv(rank(1), None), 0);
        s.check().unwrap();
        // A session with a request in flight keeps its entry through the forgetting.
        let mut s = Sessions::default();
        s.placed(1, rank(0), 10, Time::from_millis(0));
        for i in 2..(MAX_SESSIONS as u64 + 10) {
            s.placed(i, rank(0), 10, Time::from_millis(i));
            s.ended(i, rank(0), 0, window, Time::from_millis(i));
        }
        assert!(s.homes.get(&1).is_some_and(|h| h.active == 1));
        s.ended(
            1,
            rank(0),
            0,
            window,
            Time::from_millis(MAX_SESSIONS as u64 + 20),
        );
        s.check().unwrap();
    }

    #[test]
    fn removed_workers_and_forgotten_sessions_leave_no_resident_kv() {
        let window = Duration::from_secs(3_600);
        let mut s = Sessions::default();
        for i in 0..(MAX_SESSIONS as u64 + 10) {
            let r = rank(i % 4);
            s.placed(i, r, 10, Time::from_millis(i));
            s.ended(i, r, 0, window, Time::from_millis(i));
        }
        assert!(s.homes.len() <= MAX_SESSIONS);
        assert!(s.queue.len() <= 2 * s.homes.len() + 1024);
        s.check().unwrap();
        s.worker_removed(WorkerId(1));
        assert_eq!(s.resident_kv(rank(1), None), 0);
        s.check().unwrap();
    }
}
