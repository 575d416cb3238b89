//! Worker health verdicts between replicas. A replica that ejects a worker (failed checks or
//! requests in a row) or sees it recover publishes the change with its next message; every
//! heartbeat lists the workers its own observations keep out, and the same list is kept in the
//! members bucket (aged out with the replica) for a replica that joins. The receivers apply
//! them through [`crate::health::Health`], which decides what they change here; the server
//! carries that out as it does its own verdicts. Verdicts stay in the server (not the core):
//! health is the server's, the core only knows whether a worker is available.

use super::wire::Verdict;
use crate::health::Reason;
use crate::state::{AppState, Inner};
use kvrouter_core::ids::WorkerId;

fn sharing(inner: &Inner) -> bool {
    inner
        .config
        .replica_sync
        .as_ref()
        .is_some_and(|c| c.share_health)
}

/// This replica's verdict changes waiting to go out, by URL.
pub(super) fn outgoing(inner: &Inner) -> Vec<Verdict> {
    let changes = inner.replica.take_verdicts();
    if changes.is_empty() {
        return Vec::new();
    }
    let urls = super::link::local_urls(inner);
    changes
        .into_iter()
        .filter_map(|(w, ejected)| {
            Some(Verdict {
                url: urls.get(&w)?.clone(),
                ejected,
            })
        })
        .collect()
}

/// The workers this replica's own observations keep out now, by URL (`None` without sharing).
pub(super) fn own_ejections(inner: &Inner) -> Option<Vec<Verdict>> {
    if !sharing(inner) {
        return None;
    }
    let own = inner.health.own_ejections();
    let urls = super::link::local_urls(inner);
    Some(
        own.into_iter()
            .filter_map(|(w, reason)| {
                Some(Verdict {
                    url: urls.get(&w)?.clone(),
                    ejected: Some(reason),
                })
            })
            .collect(),
    )
}

/// Applies replica `peer`'s verdict changes, then its full list of ejections if it sent one.
pub(super) fn apply(
    state: &AppState,
    peer: u64,
    changes: Vec<Verdict>,
    list: Option<Vec<Verdict>>,
) {
    let inner = &state.inner;
    if !sharing(inner) || (changes.is_empty() && list.is_none()) {
        return;
    }
    let local = super::link::local_ids(inner);
    for v in changes {
        let Some(w) = local.get(&v.url) else { continue };
        if let Some(t) = inner.health.record_peer(w, peer, v.ejected) {
            state.apply_peer_health(peer, vec![(w, t)]);
        }
    }
    if let Some(list) = list {
        let listed: Vec<(WorkerId, Reason)> = list
            .into_iter()
            .filter_map(|v| Some((local.get(&v.url)?, v.ejected?)))
            .collect();
        let changed = inner.health.peer_list(peer, &listed);
        state.apply_peer_health(peer, changed);
    }
}

/// Replica `peer` is gone: the workers only its verdicts kept out come back.
pub(super) fn forget(state: &AppState, peer: u64) {
    if sharing(&state.inner) {
        let changed = state.inner.health.peer_list(peer, &[]);
        state.apply_peer_health(peer, changed);
    }
}
