//! The I/O part of discovery: one task that takes the source's events in order, asks
//! [`Membership`] what they change and carries it out through the registry, and purges drained
//! workers when their grace period is over.

use super::membership::{Action, Membership};
use super::SourceEvent;
use crate::registry;
use crate::state::AppState;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Applies `events` from source `name` until the channel closes.
pub(crate) async fn run(
    state: AppState,
    name: &'static str,
    grace: Duration,
    mut events: mpsc::Receiver<SourceEvent>,
) {
    let epoch = Instant::now();
    let mut members = Membership::new(grace);
    loop {
        let deadline = members.next_deadline().map(|d| epoch + d);
        let event = tokio::select! {
            event = events.recv() => match event {
                Some(e) => Some(e),
                None => return,
            },
            () = sleep_until(deadline) => None,
        };
        let actions = match event {
            Some(e) => members.apply(e, epoch.elapsed()),
            None => members.expire(epoch.elapsed()),
        };
        for action in actions {
            carry_out(&state, name, &mut members, action).await;
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn carry_out(state: &AppState, name: &str, members: &mut Membership, action: Action) {
    let count = |what: &str| {
        state
            .inner
            .metrics
            .discovery_changes
            .inc(&[("source", name), ("action", what)]);
    };
    match action {
        Action::Add { key, registration } => {
            let entry = registration.entry(name, &key);
            match registry::add_worker(state, entry).await {
                Ok(id) => {
                    tracing::info!(%key, url = %registration.url, worker = %id, "discovered worker added");
                    count("add");
                    // Removed while it was being registered: purged at once.
                    if let Some(Action::Purge(id)) = members.added(&key, Some(id)) {
                        if let Ok(entry) = registry::remove_worker(state, id) {
                            crate::update::worker_removed(state, id, &entry);
                        }
                        count("purge");
                    }
                }
                Err(e) => {
                    tracing::warn!(%key, url = %registration.url, "discovered worker refused: {e}");
                    count("refused");
                    members.added(&key, None);
                }
            }
        }
        Action::Drain(id) => {
            if registry::drain_worker(state, id) {
                tracing::info!(worker = %id, "discovered worker removed: draining");
                count("drain");
            }
        }
        Action::Revive(id) => {
            if registry::revive_worker(state, id) {
                tracing::info!(worker = %id, "discovered worker registered again: back in rotation");
                count("revive");
            }
        }
        Action::Purge(id) => {
            if let Ok(entry) = registry::remove_worker(state, id) {
                // A weight update's cycle goes on without it.
                crate::update::worker_removed(state, id, &entry);
                tracing::info!(worker = %id, "discovered worker purged");
                count("purge");
            }
        }
    }
}
