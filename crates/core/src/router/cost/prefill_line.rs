//! Each rank's prefill in progress, as the `cost` policy sees it: the requests placed there that
//! have not sent their first token, oldest first, and since when the oldest has been prefilled.
//!
//! The ledger counts a request's uncached prompt tokens as queued prefill (`Q`) until its first
//! token arrives, whole. An engine works through its prefill in order, so a request that comes
//! while another's long prefill is half done waits for the half that is left, not for all of it.
//! The estimate therefore takes off `Q` what the engine has done since the oldest request's
//! prefill began ([`crate::policy::cost::prefill_done_tokens`]): at most that request's own tokens,
//! since past them its first token would have come. The oldest request's prefill begins when it
//! is placed on a rank with no prefill of this router's in progress, or when the request before
//! it sends its first token or ends. Only when the line holds all of the rank's queued prefill
//! (no other replica's request, nothing of a removed worker's past) is its clock read
//! ([`PrefillLines::head`]): otherwise the engine may be working on a prefill it does not know.
//!
//! The router's side, [`Router::prefill_done`] and [`Router::prefill_placed`], is here too.
//!
//! Bounded by the requests in prefill: an entry goes when its request's first token arrives or
//! the request ends, a line when it is empty, every line of a removed worker with it.

use crate::fast_map::FastMap;
use crate::ids::{RequestId, WorkerId, WorkerRank};
use crate::policy::cost::{prefill_done_tokens, WorkerPicture};
use crate::router::Router;
use crate::time::Time;
use crate::timing::TimingModel;
use std::collections::VecDeque;
use std::time::Duration;

/// One rank's requests in prefill, oldest first.
#[derive(Debug)]
struct Line {
    /// When the oldest one's prefill began.
    since: Time,
    /// Σ uncached tokens of the queue.
    tokens: u64,
    /// The requests and their uncached prompt tokens.
    queue: VecDeque<(RequestId, u64)>,
}

/// The prefill lines of every rank with a request in prefill.
#[derive(Debug, Default)]
pub(super) struct PrefillLines {
    lines: FastMap<WorkerRank, Line>,
}

impl PrefillLines {
    /// `id` was placed on `rank` with `tokens` uncached prompt tokens (none: nothing to do).
    pub(super) fn placed(&mut self, rank: WorkerRank, id: RequestId, tokens: u64, now: Time) {
        if tokens == 0 {
            return;
        }
        let line = self.lines.entry(rank).or_insert_with(|| Line {
            since: now,
            tokens: 0,
            queue: VecDeque::new(),
        });
        line.tokens += tokens;
        line.queue.push_back((id, tokens));
    }

    /// `id`, on `rank`, sent its first token or ended at `now`: the next request's prefill
    /// begins if `id` was the oldest.
    pub(super) fn left(&mut self, rank: WorkerRank, id: RequestId, now: Time) {
        let Some(line) = self.lines.get_mut(&rank) else {
            return;
        };
        let Some(at) = line.queue.iter().position(|&(r, _)| r == id) else {
            return;
        };
        if let Some((_, tokens)) = line.queue.remove(at) {
            line.tokens -= tokens;
        }
        if line.queue.is_empty() {
            self.lines.remove(&rank);
        } else if at == 0 {
            line.since = now;
        }
    }

    /// Forgets every line of a removed worker.
    pub(super) fn worker_removed(&mut self, worker: WorkerId) {
        self.lines.retain(|rank, _| rank.worker != worker);
    }

    /// The oldest request's uncached tokens on `rank` and how long its prefill has run by `now`,
    /// when the line holds all of the rank's `queued` prefill tokens (the ledger's).
    pub(super) fn head(&self, rank: WorkerRank, queued: u64, now: Time) -> Option<(u64, Duration)> {
        let line = self.lines.get(&rank).filter(|l| l.tokens == queued)?;
        let &(_, tokens) = line.queue.front()?;
        Some((tokens, now.since(line.since)))
    }

    /// Requests in every line (tests check the bound).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lines.values().map(|l| l.queue.len()).sum()
    }
}

impl Router {
    /// Tokens of a rank's queued prefill the engine has done by `now`: 0 unless this router's line
    /// holds all of it. `ledger` is the rank's picture from the ledger alone
    /// ([`Router::ledger_picture`]): the step is priced with the requests in flight there, not
    /// sessions between turns (they decode nothing now).
    pub(super) fn prefill_done<T: TimingModel + ?Sized>(
        &self,
        rank: WorkerRank,
        ledger: &WorkerPicture,
        timing: &T,
        now: Time,
    ) -> u64 {
        let queued = ledger.prefill_queue_tokens;
        let Some((head, elapsed)) = self.cost.prefill.head(rank, queued, now) else {
            return 0;
        };
        prefill_done_tokens(timing, ledger, head, elapsed.as_secs_f64() * 1e3)
    }

    /// Puts a request the ledger has just recorded on `rank` in that rank's line; answers the
    /// tokens its worker has to prefill up to and including it (what is left of a prefill under
    /// way there, as the estimate counts it): its TTFT is fitted against them.
    pub(super) fn prefill_placed(&mut self, id: RequestId, rank: WorkerRank, now: Time) -> u64 {
        let load = self.ledger.load(rank);
        let own = self.ledger.request_load(id).map_or(0, |l| l.prefill_tokens);
        self.cost.prefill.placed(rank, id, own, now);
        let Some(spec) = self.workers.get(&rank.worker) else {
            return load.active_prefill_tokens;
        };
        let ledger = self.ledger_picture(&load, spec);
        let (timing, _) = self.timing_of(rank.worker);
        ledger.prefill_queue_tokens - self.prefill_done(rank, &ledger, &timing, now)
    }

    /// The prefill a request's TTFT is fitted against, if it is active (tests).
    #[cfg(test)]
    pub(in crate::router) fn prefill_work(&self, id: RequestId) -> Option<f64> {
        self.cost.active.get(&id).map(|a| a.prefill_work)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(w: u64) -> WorkerRank {
        WorkerRank::new(WorkerId(w), 0)
    }

    fn at(ms: u64) -> Time {
        Time::ZERO + Duration::from_millis(ms)
    }

    #[test]
    fn the_oldest_request_sets_the_clock_and_the_next_starts_when_it_leaves() {
        let mut l = PrefillLines::default();
        l.placed(rank(1), RequestId(1), 1000, at(10));
        l.placed(rank(1), RequestId(2), 500, at(20));
        l.placed(rank(1), RequestId(3), 0, at(25));
        assert_eq!(
            l.head(rank(1), 1500, at(30)),
            Some((1000, Duration::from_millis(20)))
        );
        // A later request leaving does not restart the clock.
        l.left(rank(1), RequestId(3), at(35));
        l.placed(rank(1), RequestId(4), 200, at(36));
        l.left(rank(1), RequestId(4), at(40));
        assert_eq!(
            l.head(rank(1), 1500, at(50)),
            Some((1000, Duration::from_millis(40)))
        );
        l.left(rank(1), RequestId(1), at(60));
        assert_eq!(
            l.head(rank(1), 500, at(70)),
            Some((500, Duration::from_millis(10)))
        );
        l.left(rank(1), RequestId(2), at(80));
        assert_eq!((l.head(rank(1), 0, at(90)), l.len()), (None, 0));
        // An empty rank's next request starts at once.
        l.placed(rank(1), RequestId(5), 100, at(100));
        assert_eq!(l.head(rank(1), 100, at(100)), Some((100, Duration::ZERO)));
    }

    #[test]
    fn ranks_are_apart_and_a_removed_worker_takes_its_lines() {
        let mut l = PrefillLines::default();
        l.placed(rank(1), RequestId(1), 10, at(0));
        l.placed(WorkerRank::new(WorkerId(1), 1), RequestId(2), 20, at(5));
        l.placed(rank(2), RequestId(3), 30, at(7));
        l.left(rank(2), RequestId(1), at(8));
        assert_eq!(l.len(), 3);
        l.worker_removed(WorkerId(1));
        assert_eq!(
            (l.head(rank(1), 10, at(9)), l.head(rank(2), 30, at(9))),
            (None, Some((30, Duration::from_millis(2))))
        );
        // Prefill the line does not hold (another replica's request): its clock is not read.
        assert_eq!(l.head(rank(2), 31, at(9)), None);
    }
}
