//! Exactly one replica drives a weight-update cycle at a time: the one holding the `update`
//! key of the lease bucket. It takes the key with a create (fails if present), renews it every
//! heartbeat with a revision-checked update (carrying its progress for the others), and deletes
//! it when the cycle ends. The bucket ages entries out after the replica TTL, so the lease of a
//! replica that died is free again within the TTL. The workers its cycle held out are released
//! by every other replica when it expires (the core drops its holds), and one of them, the one
//! that wins the free lease, rolls the cycle back on the engines: it resumes the workers the
//! dead replica had paused, which keep serving their previous weights until the next update.
//!
//! A lease call can run out of time and still go through (NATS took the write; its answer came
//! late). Where a call fails, the replica reads the lease: if it names this replica, the write
//! went through and the replica carries on with the revision it finds ([`own_revision`]),
//! rather than take its own lease for another's (or for lost) until the TTL ages it out.

use super::wire::LeaseValue;
use crate::error::ServeError;
use crate::replica_state::Link;
use crate::state::AppState;
use async_nats::jetstream::kv::Operation;
use kvrouter_core::ids::WorkerId;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The lease's key.
const KEY: &str = "update";

/// The longest a lease call waits. A call NATS cannot take (the client reconnecting, its
/// queue full) would otherwise wait without end, and with it the admin call that made it.
const CALL_LIMIT: Duration = Duration::from_secs(2);

/// `call` within [`CALL_LIMIT`]; a call past it is an error saying so.
async fn bounded<T, E: std::fmt::Display>(
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_LIMIT, call).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {CALL_LIMIT:?}")),
    }
}

/// The update lease, taken: its revision, and this replica's turn to start a cycle, held
/// until the caller has begun the cycle and handed the lease to [`hold`].
pub(crate) struct Taken<'a> {
    pub(crate) revision: u64,
    _starting: tokio::sync::MutexGuard<'a, ()>,
}

/// Takes the update lease (no-op without replica sync). Another replica's running update is a
/// conflict that names it.
pub(crate) async fn acquire(state: &AppState) -> Result<Option<Taken<'_>>, ServeError> {
    if state.inner.config.replica_sync.is_none() {
        return Ok(None);
    }
    let link = state.inner.replica.link().ok_or_else(|| {
        ServeError::Unavailable(
            "the update lease cannot be taken: replica sync has not joined NATS yet".into(),
        )
    })?;
    // A link known to be down answers at once.
    if !state
        .inner
        .replica
        .metrics
        .connected
        .load(Ordering::Relaxed)
    {
        return Err(ServeError::Unavailable(
            "the update lease cannot be taken: replica sync is not connected to NATS".into(),
        ));
    }
    // One start at a time here: the lease found naming this replica is then an earlier
    // take's, not that of a start running beside this one.
    let starting = link.starting.lock().await;
    let taken = |revision| {
        Ok(Some(Taken {
            revision,
            _starting: starting,
        }))
    };
    let value = LeaseValue {
        replica: state.inner.replica.id(),
        status: None,
    };
    let body = serde_json::to_vec(&value).unwrap_or_default();
    let created = tokio::time::timeout(CALL_LIMIT, link.lease.create(KEY, body.into())).await;
    let created = match created {
        Ok(created) => created,
        Err(_) => {
            return match own_revision(state, link).await {
                Some(revision) => taken(revision),
                None => Err(ServeError::Unavailable(format!(
                    "the update lease cannot be taken over replica sync (NATS did not answer \
                     within {CALL_LIMIT:?})"
                ))),
            };
        }
    };
    match created {
        Ok(revision) => taken(revision),
        Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
            // This replica's own lease with no cycle of its own running: a take whose answer
            // came too late, or a cycle's end whose delete did not go through.
            if !cycle_running(state) {
                if let Some(revision) = own_revision(state, link).await {
                    return taken(revision);
                }
            }
            let holder = holder(state)
                .await
                .map_or("another".to_owned(), |v| v.replica.to_string());
            Err(ServeError::Conflict(format!(
                "replica {holder} is driving a weight update (it holds the update lease)"
            )))
        }
        // NATS is down, or its lease bucket is gone: nobody holds the lease; retry later.
        Err(e) => Err(ServeError::Unavailable(format!(
            "the update lease cannot be taken over replica sync (NATS: {e})"
        ))),
    }
}

/// The lease's revision when it names this replica; `None` when it names another, is free,
/// or cannot be read.
async fn own_revision(state: &AppState, link: &Link) -> Option<u64> {
    let entry = bounded(link.lease.entry(KEY)).await.ok()??;
    if entry.operation != Operation::Put {
        return None;
    }
    let value: LeaseValue = serde_json::from_slice(&entry.value).ok()?;
    (value.replica == state.inner.replica.id()).then_some(entry.revision)
}

/// Whether this replica's weight-update cycle is running.
fn cycle_running(state: &AppState) -> bool {
    state
        .inner
        .lock_core()
        .update_status()
        .is_some_and(|s| s.finished.is_none())
}

/// Who holds the lease, with its progress.
pub(crate) async fn holder(state: &AppState) -> Option<LeaseValue> {
    let link = state.inner.replica.link()?;
    if !state
        .inner
        .replica
        .metrics
        .connected
        .load(Ordering::Relaxed)
    {
        return None;
    }
    let bytes = bounded(link.lease.get(KEY)).await.ok()??;
    serde_json::from_slice(&bytes).ok()
}

/// Keeps the lease while this replica's cycle runs (renewing it with the cycle's progress),
/// then gives it up.
pub(crate) fn hold(
    state: AppState,
    mut revision: u64,
    status: fn(&AppState) -> Option<serde_json::Value>,
) {
    tokio::spawn(async move {
        let Some(link) = state.inner.replica.link().cloned() else {
            return;
        };
        let mut tick = tokio::time::interval(link.config.heartbeat);
        loop {
            tick.tick().await;
            if !cycle_running(&state) {
                let _ = bounded(link.lease.delete_expect_revision(KEY, Some(revision))).await;
                return;
            }
            let value = LeaseValue {
                replica: state.inner.replica.id(),
                status: status(&state),
            };
            let body = serde_json::to_vec(&value).unwrap_or_default();
            match bounded(link.lease.update(KEY, body.into(), revision)).await {
                Ok(r) => revision = r,
                Err(e) => {
                    // The renewal went through, and its answer came late.
                    if let Some(r) = own_revision(&state, &link).await {
                        revision = r;
                        continue;
                    }
                    state
                        .inner
                        .replica
                        .metrics
                        .lease_lost
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("weight update: renewing the update lease: {e}");
                }
            }
        }
    });
}

/// Replica `dead` expired while its update held `workers` out. Whoever wins the free lease
/// resumes them on the engines (bounded: tries for twice the TTL).
pub(crate) async fn roll_back(state: AppState, dead: u64, workers: Vec<WorkerId>) {
    let Some(link) = state.inner.replica.link().cloned() else {
        return;
    };
    let value = LeaseValue {
        replica: state.inner.replica.id(),
        status: None,
    };
    let body = serde_json::to_vec(&value).unwrap_or_default();
    let deadline = tokio::time::Instant::now() + link.config.ttl * 2;
    let revision = loop {
        match bounded(link.lease.create(KEY, body.clone().into())).await {
            Ok(r) => break r,
            Err(_) => {
                if let Some(r) = own_revision(&state, &link).await {
                    break r;
                }
                let other = holder(&state).await.map(|v| v.replica);
                if other.is_some_and(|r| r != dead) || tokio::time::Instant::now() > deadline {
                    // Another replica rolls back (or drives a new update that covers them).
                    return;
                }
                tokio::time::sleep(link.config.heartbeat.min(Duration::from_millis(200))).await;
            }
        }
    };
    tracing::warn!(
        "weight update of expired replica {dead}: rolling back on workers {workers:?} (they keep their previous weights)"
    );
    for w in workers {
        if let Err(e) = crate::update::resume_engine(&state, w).await {
            tracing::warn!("worker {w}: resuming after an abandoned update: {e}");
        }
    }
    state
        .inner
        .replica
        .metrics
        .rollbacks
        .fetch_add(1, Ordering::Relaxed);
    let _ = bounded(link.lease.delete_expect_revision(KEY, Some(revision))).await;
}
