//! Shared state after NATS comes back. While NATS is away the client buffers what this replica
//! publishes and sends it on reconnecting, but a replica that had not reconnected yet misses
//! those deltas, and a NATS server restarted without its memory-stored buckets has lost what a
//! joining replica reads. So on every reconnect (the client's connect count going up) a replica:
//! 1. opens the buckets again, making any that are missing (1 s doubling to 30 s until it works);
//! 2. puts its own changes to the stored state again, with their current values: the session
//!    bindings, versions and pauses it set while NATS was away, or within the last
//!    [`Retained`] window before it noticed ([`Retained`] keeps them);
//! 3. writes every other binding, version and pause it knows where the key is missing (a
//!    bucket that was lost is refilled; a newer value is not overwritten);
//! 4. publishes the changes of step 2 to the others again (after its puts, so a replica that
//!    missed both reads them in step 5);
//! 5. after a heartbeat, reads the buckets as a joining replica does: the changes others made
//!    while it was away.

use super::wire::Names;
use crate::replica_state::Link;
use crate::state::AppState;
use async_nats::jetstream::{self, kv};
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::RemoteEvent;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The key a retained change is kept under: a session's binding, a worker's version, a
/// worker's pause. A later change to the same key replaces the earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Key {
    Session(u64),
    Version(WorkerId),
    Paused(WorkerId),
}

pub(super) fn key(event: &RemoteEvent) -> Option<Key> {
    match event {
        RemoteEvent::Session { session, .. } | RemoteEvent::SessionReleased { session } => {
            Some(Key::Session(*session))
        }
        RemoteEvent::Version { worker, .. } => Some(Key::Version(*worker)),
        RemoteEvent::Paused { worker, .. } => Some(Key::Paused(*worker)),
        _ => None,
    }
}

/// This replica's recent changes to the stored state, one per key, at most `max` keys. While
/// connected, a change is kept for `window` (the client may have been cut off before the
/// publisher noticed); from a reconnect until [`Retained::take`] nothing ages out.
#[derive(Debug)]
pub(super) struct Retained {
    window: Duration,
    max: usize,
    frozen: bool,
    /// Each key's latest change: when, its place in the order of changes, the change.
    changes: HashMap<Key, (Instant, u64, RemoteEvent)>,
    next: u64,
    dropped: u64,
}

impl Retained {
    pub(super) fn new(window: Duration, max: usize) -> Self {
        Self {
            window,
            max,
            frozen: false,
            changes: HashMap::new(),
            next: 0,
            dropped: 0,
        }
    }

    /// Records the stored-state changes among `events`, published at `now`; while `connected`
    /// (and not since a reconnect), changes older than the window go.
    pub(super) fn record(&mut self, now: Instant, events: &[RemoteEvent], connected: bool) {
        if connected && !self.frozen {
            let window = self.window;
            self.changes
                .retain(|_, (at, _, _)| now.saturating_duration_since(*at) <= window);
        }
        for e in events {
            let Some(k) = key(e) else { continue };
            if self.changes.len() >= self.max && !self.changes.contains_key(&k) {
                self.dropped += 1;
                continue;
            }
            self.changes.insert(k, (now, self.next, e.clone()));
            self.next += 1;
        }
    }

    /// A reconnect: keep everything until it is taken.
    pub(super) fn freeze(&mut self) {
        self.frozen = true;
    }

    /// Every change kept, in the order they were made; the record starts again.
    pub(super) fn take(&mut self) -> Vec<RemoteEvent> {
        self.frozen = false;
        let mut all: Vec<_> = self.changes.drain().map(|(_, v)| v).collect();
        all.sort_by_key(|(_, order, _)| *order);
        all.into_iter().map(|(_, _, e)| e).collect()
    }

    /// Changes not kept because `max` keys were kept already (since the start).
    pub(super) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The keys of the changes kept.
    pub(super) fn keys(&self) -> HashSet<Key> {
        self.changes.keys().copied().collect()
    }
}

/// The keys of `events`' stored-state changes.
pub(super) fn keys(events: &[RemoteEvent]) -> HashSet<Key> {
    events.iter().filter_map(key).collect()
}

/// What the publisher, the receiver and the repair task share.
#[derive(Debug)]
pub(super) struct Outage {
    pub(super) retained: Mutex<Retained>,
    /// Changes the repair task has put again, for the publisher to send to the others.
    resend: Mutex<Vec<RemoteEvent>>,
    /// A reconnect: repair.
    wake: Notify,
    /// Another replica repaired (its message said `rejoined`): read the buckets again.
    reread: Notify,
    /// This replica repaired: its next message says so.
    rejoined: AtomicBool,
    /// When this replica last heard its own message back, in ms since `base`.
    last_echo_ms: AtomicU64,
    base: Instant,
}

impl Outage {
    pub(super) fn new(retained: Retained) -> Self {
        Self {
            retained: Mutex::new(retained),
            resend: Mutex::new(Vec::new()),
            wake: Notify::new(),
            reread: Notify::new(),
            rejoined: AtomicBool::new(false),
            last_echo_ms: AtomicU64::new(0),
            base: Instant::now(),
        }
    }

    /// The publisher saw a reconnect: keep what it retained and start a repair.
    pub(super) fn reconnected(&self) {
        self.retained.lock().expect("retained lock").freeze();
        self.echoed();
        self.wake.notify_one();
    }

    /// Changes to publish again (the repair's, or those made before joining).
    pub(super) fn resend(&self, events: Vec<RemoteEvent>) {
        self.resend.lock().expect("resend lock").extend(events);
    }

    /// What the repair task handed back to be published again.
    pub(super) fn take_resend(&self) -> Vec<RemoteEvent> {
        std::mem::take(&mut *self.resend.lock().expect("resend lock"))
    }

    /// Another replica says it repaired: what it wrote may be news here.
    pub(super) fn peer_rejoined(&self) {
        self.reread.notify_one();
    }

    /// Whether this replica's next message says it repaired (once).
    pub(super) fn take_rejoined(&self) -> bool {
        self.rejoined.swap(false, Ordering::Relaxed)
    }

    /// This replica's own message came back: the connection carries messages.
    pub(super) fn echoed(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last_echo_ms.store(ms, Ordering::Relaxed);
    }

    /// How long since this replica last heard its own message back. NATS's own liveness
    /// check (a PING when nothing was sent for a while) never runs while a replica publishes
    /// every heartbeat, so a connection that silently stopped carrying messages (a network
    /// that drops them, a half-open socket) is noticed by this instead.
    pub(super) fn since_echo(&self) -> Duration {
        let last = Duration::from_millis(self.last_echo_ms.load(Ordering::Relaxed));
        self.base.elapsed().saturating_sub(last)
    }
}

/// The buckets a repair opens again and reads.
pub(super) struct Stores {
    pub(super) js: jetstream::Context,
    pub(super) session_ttl: Duration,
    /// The members, sessions and policy buckets as last opened.
    pub(super) open: (kv::Store, kv::Store, kv::Store),
}

/// Runs the repair after each reconnect, and a read of the buckets after another replica's,
/// one at a time, until the process ends.
pub(super) async fn run(
    state: AppState,
    link: Arc<Link>,
    mut stores: Stores,
    peers: Arc<Mutex<super::peers::Peers>>,
    outage: Arc<Outage>,
) {
    let inner = &state.inner;
    let config = &link.config;
    let names = Names::new(&config.cluster);
    loop {
        let reconnected = tokio::select! {
            () = outage.wake.notified() => true,
            () = outage.reread.notified() => false,
        };
        let mut summary = String::from("read the buckets again after another replica's repair");
        if reconnected {
            tracing::info!("replica sync: reconnected to NATS; repairing the shared state");
            let (members, sessions, policy, _) =
                super::buckets::open_all(&stores.js, &names, config.ttl, stores.session_ttl).await;
            stores.open = (members, sessions, policy);
            let (changes, dropped) = {
                let mut retained = outage.retained.lock().expect("retained lock");
                (retained.take(), retained.dropped())
            };
            if dropped > 0 {
                tracing::warn!(
                    "replica sync: {dropped} changes since the start were not kept for a repair \
                     (more than --replica-join-max-keys at once); the others may miss them"
                );
            }
            // A binding this replica made that another released meanwhile stays released:
            // the release is the later word (a binding is only a cache hint).
            let changes = super::buckets::not_released(&stores.open.1, changes).await;
            super::buckets::store_shared(inner, &link, &names, &changes).await;
            let written = super::buckets::refill(inner, &link, &names, config.join_max_keys).await;
            summary = format!(
                "repaired after a reconnect: {} changes sent again, {written} entries written \
                 where missing",
                changes.len()
            );
            outage.resend(changes);
            // The others read what was written (a replica that joined the restarted server
            // first read nothing).
            outage.rejoined.store(true, Ordering::Relaxed);
            inner.replica.notify.notify_one();
        }
        // Let the others' puts land, then read what they changed meanwhile; this replica's own
        // changes since (not yet in the buckets, perhaps) stay as they are.
        tokio::time::sleep(config.heartbeat).await;
        let own = outage.retained.lock().expect("retained lock").keys();
        let (members, sessions, policy) = &stores.open;
        let read = super::buckets::Read {
            skip: &own,
            releases: true,
        };
        super::buckets::join(&state, &peers, (members, sessions, policy), read).await;
        inner
            .replica
            .metrics
            .repairs
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!("replica sync: {summary}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::ids::WorkerRank;

    fn paused(w: u64, paused: bool) -> RemoteEvent {
        RemoteEvent::Paused {
            worker: WorkerId(w),
            paused,
        }
    }

    fn session(s: u64, w: u64) -> RemoteEvent {
        RemoteEvent::Session {
            session: s,
            rank: WorkerRank::new(WorkerId(w), 0),
            ttl_ms: 1000,
        }
    }

    const WINDOW: Duration = Duration::from_secs(2);

    #[test]
    fn changes_age_out_only_while_connected_and_not_after_a_reconnect() {
        let t0 = Instant::now();
        let later = |s: u64| t0 + Duration::from_secs(s);
        let mut r = Retained::new(WINDOW, 10);
        r.record(t0, &[paused(1, true)], true);
        r.record(later(3), &[], true);
        assert_eq!(r.take(), vec![], "aged out while connected");
        // Cut off: nothing ages out, however long the outage.
        r.record(later(4), &[paused(1, true)], false);
        r.record(later(60), &[session(7, 2)], false);
        // Back: the reconnect freezes the record until the repair takes it.
        r.freeze();
        r.record(later(100), &[], true);
        assert_eq!(r.take(), vec![paused(1, true), session(7, 2)]);
        r.record(later(200), &[], true);
        assert_eq!(r.take(), vec![], "taken, and the record starts again");
    }

    #[test]
    fn one_change_per_key_the_latest_and_other_events_are_not_kept() {
        let t0 = Instant::now();
        let mut r = Retained::new(WINDOW, 10);
        let released = RemoteEvent::SessionReleased { session: 7 };
        let version = RemoteEvent::Version {
            worker: WorkerId(1),
            version: 3,
        };
        r.record(t0, &[paused(1, true), session(7, 2), version.clone()], true);
        r.record(
            t0 + Duration::from_millis(1),
            &[
                paused(1, false),
                released.clone(),
                RemoteEvent::ReplicaExpired {
                    replica: kvrouter_core::ids::ReplicaId(4),
                },
            ],
            true,
        );
        assert_eq!(r.take(), vec![version, paused(1, false), released]);
    }

    #[test]
    fn at_most_max_keys_are_kept_and_the_rest_counted() {
        let t0 = Instant::now();
        let mut r = Retained::new(WINDOW, 2);
        r.record(t0, &[session(1, 0), session(2, 0), session(3, 0)], false);
        // A kept key still takes its newer change.
        r.record(t0, &[session(1, 1)], false);
        assert_eq!(r.dropped(), 1);
        assert_eq!(r.take(), vec![session(2, 0), session(1, 1)]);
    }
}
