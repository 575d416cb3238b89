//! Router replicas sharing state over NATS (`kvrouter serve --replica-sync nats://HOST:PORT`).
//!
//! Several `kvrouter serve` processes with the same configuration form one logical router. Each
//! reads the engines' KV events itself; over NATS they share what one replica cannot see. The
//! core queues a [`kvrouter_core::router::RemoteEvent`] for every change to shared state and this
//! module carries them:
//! - core NATS publish/subscribe (`<cluster>.replica.<id>`) for the high-rate deltas: request
//!   begin / first token / finish, predicted placements, session bindings, group placements,
//!   versions, pauses, update holds, worker health verdicts (`health.rs`), and each heartbeat's
//!   list of active requests (with each one's worker, prompt tokens and blocks, at most
//!   `--replica-heartbeat-max-requests` a list). Best effort and in order per sender; the
//!   heartbeats' lists repair a lost finish, begin or first token.
//! - JetStream key-value buckets for what a joining replica must read on start: `members`
//!   (worker tables and each replica's own health ejections, aged out after the TTL), `sessions` (aged out after the session TTL),
//!   `policy` (versions, pauses), and `lease` (the weight-update lease, aged out after the TTL).
//!
//! Nothing here is on the request path: the request path only queues events in the core (a
//! bounded outbox) and wakes the publisher.
//!
//! Layout: `wire.rs` (names and message formats), `peers.rs` (who is alive, their worker
//! tables), `link.rs` (the NATS loops), `buckets.rs` (the key-value side), `repair.rs` (the
//! shared state after a reconnect), `lease.rs` (one replica drives a weight update). What the
//! rest of the server holds of it (the publisher's wake-up, the link, the metrics) is
//! `crate::replica_state`.

mod buckets;
mod health;
pub(crate) mod lease;
mod link;
mod peers;
mod repair;
mod wire;

use crate::state::AppState;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Starts replica sync if configured (connects in the background; the router serves meanwhile).
pub(crate) fn spawn(state: &AppState) {
    if let Some(config) = state.inner.config.replica_sync.clone() {
        tokio::spawn(link::run(state.clone(), config));
    }
}

/// Appends the sync metrics (only with `--replica-sync`).
pub(crate) fn render(state: &AppState, out: &mut String) {
    if state.inner.config.replica_sync.is_none() {
        return;
    }
    let m = &state.inner.replica.metrics;
    let connected = m.connected.load(Ordering::Relaxed);
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let counters = [
        (
            "kvrouter_replica_events_published_total",
            "Events this replica published to the others.",
            get(&m.published),
        ),
        (
            "kvrouter_replica_events_publish_errors_total",
            "Events not published: NATS down or the link dead (not sent), or a publish the client did not take within a heartbeat.",
            get(&m.publish_errors),
        ),
        (
            "kvrouter_replica_events_dropped_total",
            "Events dropped because the outgoing queue was full (--replica-outbox-max-events).",
            get(&m.dropped),
        ),
        (
            "kvrouter_replica_events_received_total",
            "Events received from the other replicas.",
            get(&m.received),
        ),
        (
            "kvrouter_replica_events_rejected_total",
            "Received events not applied (unknown request or worker, undecodable).",
            get(&m.rejected),
        ),
        (
            "kvrouter_replica_events_untranslated_total",
            "Received events naming a worker this replica does not know.",
            get(&m.untranslated),
        ),
        (
            "kvrouter_replica_messages_lost_total",
            "Gaps in the other replicas' message sequence numbers.",
            get(&m.lost_messages),
        ),
        (
            "kvrouter_replica_expired_total",
            "Replicas expired after no heartbeat within --replica-ttl-ms.",
            get(&m.expired),
        ),
        (
            "kvrouter_replica_update_lease_lost_total",
            "Weight-update lease renewals that failed.",
            get(&m.lease_lost),
        ),
        (
            "kvrouter_replica_id_conflicts_total",
            "Messages showing two processes under one --replica-id: under this replica's own id from another process, or under another replica's id alternating between two processes.",
            get(&m.id_conflicts),
        ),
        (
            "kvrouter_replica_repairs_total",
            "Repairs of the shared state: this replica's after it reconnected, and its reads of the buckets after another replica's.",
            get(&m.repairs),
        ),
        (
            "kvrouter_replica_update_rollbacks_total",
            "Weight updates of expired replicas this replica rolled back.",
            get(&m.rollbacks),
        ),
    ];
    for (name, help, v) in counters {
        crate::metrics::counter_header(out, name, help);
        let _ = writeln!(out, "{name} {v}");
    }
    let core = state.inner.lock_core();
    let remote: usize = core.remote_requests().values().sum();
    drop(core);
    let gauges = [
        (
            "kvrouter_replica_connected",
            "1 once connected to NATS and joined.",
            u64::from(connected),
        ),
        (
            "kvrouter_replica_peers_alive",
            "Other replicas heard from within the TTL.",
            get(&m.peers_alive),
        ),
        (
            "kvrouter_replica_sync_lag_ms",
            "Age of the last received message at receipt (clock skew included).",
            get(&m.lag_ms),
        ),
        (
            "kvrouter_replica_remote_active_requests",
            "Requests of other replicas counted in this replica's load.",
            remote as u64,
        ),
    ];
    for (name, help, v) in gauges {
        crate::metrics::gauge_header(out, name, help);
        let _ = writeln!(out, "{name} {v}");
    }
}
