//! Worker health, the pure part: consecutive failed active checks (`GET /health`) and failed
//! requests (connection errors, 5xx, broken streams) make a worker unhealthy; consecutive passes
//! make it healthy again. [`Health::record`] says when a worker changes state; the server carries
//! the change out (`state/health.rs`: out of the eligible set, the index cleared after a grace
//! period). Health never touches load accounting.
//!
//! With replica sync, the other replicas' verdicts count too ([`Health::record_peer`],
//! [`Health::peer_list`]): a worker another replica ejected is out here as well, until that
//! replica says it recovered, stops listing it, or expires, or until this replica's own checks
//! pass as many times in a row as they would after its own ejection. A verdict is applied once
//! per replica and worker: repeating it (every heartbeat lists the sender's ejections) does not
//! undo a recovery seen here since.

use crate::config::HealthConfig;
use kvrouter_core::ids::WorkerId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

#[derive(Debug, Default)]
struct WorkerHealth {
    unhealthy: bool,
    failed_checks: u32,
    failed_requests: u32,
    passes: u32,
    /// Why this replica's own observations put (or keep) it out: `None` when it is out only on
    /// other replicas' word, or healthy.
    own: Option<Reason>,
    /// Replicas whose last verdict on it is "ejected".
    ejected_by: BTreeSet<u64>,
}

impl WorkerHealth {
    /// Whether it says nothing a missing entry would not: healthy, no failure counted, no
    /// replica's verdict held (the table keeps only such workers as have something to say).
    fn is_clean(&self) -> bool {
        !self.unhealthy
            && self.failed_checks == 0
            && self.failed_requests == 0
            && self.own.is_none()
            && self.ejected_by.is_empty()
    }

    /// Out on other replicas' word only, and none of them says so any more: back in.
    fn release_if_unheld(&mut self) -> Option<Transition> {
        (self.unhealthy && self.own.is_none() && self.ejected_by.is_empty()).then(|| {
            self.unhealthy = false;
            self.passes = 0;
            Transition::Healthy
        })
    }
}

/// Health of every worker: an entry for each worker with a failure counted, out of rotation,
/// or held out by a replica's verdict; none for a healthy one (so the table is bounded by the
/// workers in trouble, whatever ids come and go).
#[derive(Debug, Default)]
pub(crate) struct Health {
    workers: Mutex<HashMap<WorkerId, WorkerHealth>>,
}

/// Where an observation comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Check,
    Request,
}

/// Why a worker was ejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Reason {
    /// Failed active checks in a row (`--health-failure-threshold`).
    FailedChecks,
    /// Failed requests in a row (`--outlier-consecutive-failures`).
    FailedRequests,
}

impl Reason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::FailedChecks => "failed_checks",
            Reason::FailedRequests => "failed_requests",
        }
    }
}

/// A worker's change of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    /// It left the eligible set.
    Unhealthy(Reason),
    /// It came back.
    Healthy,
}

impl Health {
    /// Records one observation of `worker`; returns its change of state, if any.
    pub(crate) fn record(
        &self,
        worker: WorkerId,
        ok: bool,
        source: Source,
        config: &HealthConfig,
    ) -> Option<Transition> {
        let mut all = self.workers.lock().expect("health lock");
        if ok {
            // A pass of a worker with nothing counted changes nothing.
            let h = all.get_mut(&worker)?;
            h.failed_checks = 0;
            h.failed_requests = 0;
            h.passes += 1;
            let t = (h.unhealthy && h.passes >= config.recovery_threshold).then(|| {
                h.unhealthy = false;
                h.own = None;
                Transition::Healthy
            });
            if h.is_clean() {
                all.remove(&worker);
            }
            t
        } else {
            let h = all.entry(worker).or_default();
            h.passes = 0;
            match source {
                Source::Check => h.failed_checks += 1,
                Source::Request => h.failed_requests += 1,
            }
            let reason = if h.failed_checks >= config.failure_threshold {
                Reason::FailedChecks
            } else if h.failed_requests >= config.outlier_failures {
                Reason::FailedRequests
            } else {
                return None;
            };
            // Out on another replica's word already: now on this one's own too (listed in its
            // heartbeats, and a peer's recovery alone no longer brings it back).
            h.own = Some(reason);
            (!h.unhealthy).then(|| {
                h.unhealthy = true;
                Transition::Unhealthy(reason)
            })
        }
    }

    /// Replica `peer` says it ejected `worker` (`Some(reason)`) or that it recovered (`None`);
    /// returns the change of state here, if any.
    pub(crate) fn record_peer(
        &self,
        worker: WorkerId,
        peer: u64,
        verdict: Option<Reason>,
    ) -> Option<Transition> {
        let mut all = self.workers.lock().expect("health lock");
        match verdict {
            Some(reason) => {
                let h = all.entry(worker).or_default();
                if !h.ejected_by.insert(peer) || h.unhealthy {
                    return None;
                }
                h.unhealthy = true;
                h.passes = 0;
                Some(Transition::Unhealthy(reason))
            }
            None => {
                let h = all.get_mut(&worker)?;
                h.ejected_by.remove(&peer);
                let t = h.release_if_unheld();
                if h.is_clean() {
                    all.remove(&worker);
                }
                t
            }
        }
    }

    /// Forgets a worker that left (its id is not used again).
    pub(crate) fn forget(&self, worker: WorkerId) {
        self.workers.lock().expect("health lock").remove(&worker);
    }

    /// Workers the table holds an entry for (tests).
    #[cfg(test)]
    fn entries(&self) -> usize {
        self.workers.lock().expect("health lock").len()
    }

    /// Replica `peer`'s full list of the workers it ejected (its heartbeat; empty when it
    /// expired): those new from it are ejected here, those it no longer lists are its
    /// recoveries. Returns the changes of state here.
    pub(crate) fn peer_list(
        &self,
        peer: u64,
        ejected: &[(WorkerId, Reason)],
    ) -> Vec<(WorkerId, Transition)> {
        let listed: HashMap<WorkerId, Reason> = ejected.iter().copied().collect();
        let dropped: Vec<WorkerId> = {
            let all = self.workers.lock().expect("health lock");
            all.iter()
                .filter(|(w, h)| h.ejected_by.contains(&peer) && !listed.contains_key(w))
                .map(|(w, _)| *w)
                .collect()
        };
        let verdicts = dropped
            .into_iter()
            .map(|w| (w, None))
            .chain(listed.into_iter().map(|(w, r)| (w, Some(r))));
        verdicts
            .filter_map(|(w, v)| self.record_peer(w, peer, v).map(|t| (w, t)))
            .collect()
    }

    /// The workers this replica's own observations keep out, with why (what its heartbeats
    /// list for the others).
    pub(crate) fn own_ejections(&self) -> Vec<(WorkerId, Reason)> {
        let all = self.workers.lock().expect("health lock");
        let mut out: Vec<(WorkerId, Reason)> = all
            .iter()
            .filter(|(_, h)| h.unhealthy)
            .filter_map(|(w, h)| Some((*w, h.own?)))
            .collect();
        out.sort_by_key(|(w, _)| *w);
        out
    }

    /// Whether `worker` is marked unhealthy.
    pub(crate) fn is_unhealthy(&self, worker: WorkerId) -> bool {
        let all = self.workers.lock().expect("health lock");
        all.get(&worker).is_some_and(|h| h.unhealthy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_mark_unhealthy_and_passes_in_a_row_bring_back() {
        let config = HealthConfig::default();
        let h = Health::default();
        let w = WorkerId(1);
        let fail = |s| h.record(w, false, s, &config);
        assert_eq!(fail(Source::Request), None);
        assert_eq!(
            h.record(w, true, Source::Request, &config),
            None,
            "a pass resets"
        );
        assert_eq!((fail(Source::Request), fail(Source::Request)), (None, None));
        assert_eq!(
            fail(Source::Request),
            Some(Transition::Unhealthy(Reason::FailedRequests))
        );
        assert!(h.is_unhealthy(w) && !h.is_unhealthy(WorkerId(2)));
        assert_eq!(fail(Source::Check), None, "already unhealthy");
        assert_eq!(h.record(w, true, Source::Check, &config), None);
        assert_eq!(
            h.record(w, true, Source::Check, &config),
            Some(Transition::Healthy)
        );
        assert_eq!(h.entries(), 0, "healthy again: nothing kept");
    }

    #[test]
    fn the_table_holds_only_workers_with_something_to_say() {
        // Workers come and go under new ids (discovery): a healthy one takes no entry, and one
        // that left is forgotten.
        let config = HealthConfig::default();
        let h = Health::default();
        for w in 0..10_000 {
            assert_eq!(h.record(WorkerId(w), true, Source::Request, &config), None);
        }
        assert_eq!(h.record(WorkerId(1), false, Source::Request, &config), None);
        assert_eq!(h.record_peer(WorkerId(2), 7, None), None);
        assert_eq!(h.entries(), 1);
        assert_eq!(h.record(WorkerId(1), true, Source::Request, &config), None);
        assert_eq!(h.entries(), 0, "a pass resets the count");
        for _ in 0..config.failure_threshold {
            h.record(WorkerId(3), false, Source::Check, &config);
        }
        assert!(h.is_unhealthy(WorkerId(3)));
        h.forget(WorkerId(3));
        assert_eq!((h.entries(), h.is_unhealthy(WorkerId(3))), (0, false));
    }
}

#[cfg(test)]
mod peer_tests {
    use super::*;

    const W: WorkerId = WorkerId(1);
    const REASON: Reason = Reason::FailedRequests;

    #[test]
    fn a_peer_verdict_ejects_until_it_recovers_and_is_applied_once() {
        let h = Health::default();
        assert_eq!(
            h.record_peer(W, 7, Some(REASON)),
            Some(Transition::Unhealthy(REASON))
        );
        assert!(h.is_unhealthy(W));
        assert!(
            h.own_ejections().is_empty(),
            "not this replica's own verdict"
        );
        assert_eq!(h.record_peer(W, 7, Some(REASON)), None, "once");
        assert_eq!(h.record_peer(W, 8, None), None, "peer 7 still ejects it");
        assert_eq!(h.record_peer(W, 7, None), Some(Transition::Healthy));
        assert!(!h.is_unhealthy(W));
    }

    #[test]
    fn own_passes_bring_it_back_and_a_repeated_list_does_not_undo_that() {
        let config = HealthConfig::default();
        let h = Health::default();
        assert_eq!(h.peer_list(7, &[(W, REASON)]).len(), 1);
        assert_eq!(h.record(W, true, Source::Check, &config), None);
        assert_eq!(
            h.record(W, true, Source::Check, &config),
            Some(Transition::Healthy),
            "its own checks count as after its own ejection"
        );
        assert!(h.peer_list(7, &[(W, REASON)]).is_empty(), "applied once");
        assert!(!h.is_unhealthy(W));
        // Peer 7 recovers it (stops listing it) and ejects it again: a new verdict.
        assert!(h.peer_list(7, &[]).is_empty());
        assert_eq!(
            h.peer_list(7, &[(W, REASON)]),
            vec![(W, Transition::Unhealthy(REASON))]
        );
        // The peer expires: its verdicts go with it.
        assert_eq!(h.peer_list(7, &[]), vec![(W, Transition::Healthy)]);
    }

    #[test]
    fn own_failures_keep_it_out_after_the_peer_recovers() {
        let config = HealthConfig::default();
        let h = Health::default();
        let _ = h.record_peer(W, 7, Some(REASON));
        for _ in 0..config.failure_threshold {
            assert_eq!(h.record(W, false, Source::Check, &config), None);
        }
        assert_eq!(h.own_ejections(), vec![(W, Reason::FailedChecks)]);
        assert_eq!(h.record_peer(W, 7, None), None, "still failing here");
        assert!(h.is_unhealthy(W));
    }
}
