//! The NATS side of replica sync: connect, make the buckets, read what a joining replica needs,
//! then three loops: publish this replica's events (and its heartbeat), apply the others'
//! events, and expire replicas that went silent. None of them is on the request path: the core
//! queues outgoing events and [`super::ReplicaState`] wakes the publisher.

use super::wire::{self, Message, Names};
use crate::config::ReplicaSyncConfig;
use crate::replica_state::Link;
use crate::state::{AppState, Inner};
use crate::validate::worker_url_key;
use async_nats::jetstream;
use futures::StreamExt;
use kvrouter_core::ids::{ReplicaId, WorkerId};
use kvrouter_core::router::RemoteEvent;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Connects (retrying until NATS answers), joins and runs the loops until the process ends.
pub(crate) async fn run(state: AppState, config: ReplicaSyncConfig) {
    let inner = state.inner.clone();
    let names = Names::new(&config.cluster);
    let client = match async_nats::ConnectOptions::new()
        .name(format!("kvrouter-replica-{}", config.replica_id))
        .retry_on_initial_connect()
        .connect(config.url.as_str())
        .await
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("replica sync: cannot connect to {}: {e}", config.url);
            return;
        }
    };
    let js = jetstream::new(client.clone());
    let session_ttl = inner
        .config
        .router
        .router_session_affinity_ttl_secs
        .map_or(Duration::from_secs(3600), Duration::from_secs_f64);
    let (members, sessions, policy, lease) =
        super::buckets::open_all(&js, &names, config.ttl, session_ttl).await;
    let peers = Arc::new(Mutex::new(super::peers::Peers::default()));
    let link = Arc::new(Link {
        client: client.clone(),
        lease,
        config: config.clone(),
        starting: tokio::sync::Mutex::new(()),
    });
    inner.replica.set_link(link.clone());
    // Subscribe before reading the buckets, so nothing published meanwhile is missed.
    let sub = match client.subscribe(names.all_deltas()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("replica sync: subscribe: {e}");
            return;
        }
    };
    // Changes made here before joining (an operator's pause while NATS was down): the
    // buckets' older values must not overwrite them, and the others get them first.
    let early = inner.lock_core().take_outgoing();
    let read = super::buckets::Read {
        skip: &super::repair::keys(&early),
        releases: false,
    };
    super::buckets::join(&state, &peers, (&members, &sessions, &policy), read).await;
    inner
        .replica
        .metrics
        .connected
        .store(true, Ordering::Relaxed);
    tracing::info!(
        "replica sync: replica {} joined {} at {}",
        config.replica_id,
        config.cluster,
        config.url
    );
    // A change is kept, while the link counts as up, for as long as a dead link can go
    // unnoticed: the TTL (no echo of its own messages), and a heartbeat either side.
    let outage = Arc::new(super::repair::Outage::new(super::repair::Retained::new(
        config.ttl + config.heartbeat * 2,
        config.join_max_keys,
    )));
    outage.resend(early);
    outage.echoed();
    let stores = super::repair::Stores {
        js,
        session_ttl,
        open: (members, sessions, policy),
    };
    tokio::spawn(receive(state.clone(), sub, peers.clone(), outage.clone()));
    tokio::spawn(expire(state.clone(), peers.clone()));
    tokio::spawn(super::repair::run(
        state.clone(),
        link.clone(),
        stores,
        peers,
        outage.clone(),
    ));
    publish(state, link, outage).await;
}

/// This replica's workers by URL, found by a URL another replica spelled
/// ([`worker_url_key`]: `http://h:8000/` there is `HTTP://h:8000` here).
pub(super) struct LocalWorkers(HashMap<String, WorkerId>);

impl LocalWorkers {
    /// The worker registered here at `url`.
    pub(super) fn get(&self, url: &str) -> Option<WorkerId> {
        self.0.get(&worker_url_key(url)).copied()
    }
}

/// This replica's workers by URL.
pub(super) fn local_ids(inner: &Inner) -> LocalWorkers {
    LocalWorkers(
        inner
            .workers
            .lock()
            .expect("workers lock")
            .iter()
            .map(|(id, r)| (worker_url_key(&r.entry.url), *id))
            .collect(),
    )
}

/// This replica's workers: id → URL (the reverse of [`local_ids`]).
pub(super) fn local_urls(inner: &Inner) -> HashMap<WorkerId, String> {
    inner
        .workers
        .lock()
        .expect("workers lock")
        .iter()
        .map(|(id, r)| (*id, r.entry.url.clone()))
        .collect()
}

/// Applies events to the core and carries out what they set in motion.
pub(super) fn apply(inner: &Inner, events: Vec<RemoteEvent>) {
    let m = &inner.replica.metrics;
    let mut effects = kvrouter_core::router::Effects::default();
    {
        let now = inner.now();
        let mut core = inner.lock_core();
        for e in events {
            match core.apply_remote(e, now) {
                Ok(more) => effects.extend(more),
                Err(_) => {
                    m.rejected.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    if !effects.is_empty() {
        inner.apply(effects);
    }
    inner.wake_queue();
}

/// Applies the other replicas' messages.
async fn receive(
    state: AppState,
    mut sub: async_nats::Subscriber,
    peers: Arc<Mutex<super::peers::Peers>>,
    outage: Arc<super::repair::Outage>,
) {
    let inner = &state.inner;
    let m = &inner.replica.metrics;
    // This replica's workers by URL: rebuilt with every heartbeat and after a miss, not per
    // message.
    let mut local = local_ids(inner);
    while let Some(msg) = sub.next().await {
        let Ok(message) = serde_json::from_slice::<Message>(&msg.payload) else {
            m.rejected.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if check_sender(inner, &peers, &message) {
            if message.instance == inner.replica.instance() {
                outage.echoed();
            }
            continue;
        }
        if message.rejoined {
            outage.peer_rejoined();
        }
        let lag = wire::unix_ms(SystemTime::now()).saturating_sub(message.sent_unix_ms);
        m.lag_ms.store(lag, Ordering::Relaxed);
        let mut n = message.events.len() as u64;
        m.received.fetch_add(n, Ordering::Relaxed);
        // Verdicts name workers by URL: applied whether or not the worker table is known yet.
        super::health::apply(&state, message.replica, message.verdicts, message.ejected);
        if message.workers.is_some() {
            local = local_ids(inner);
        }
        let events: Vec<RemoteEvent> = {
            let mut peers = peers.lock().expect("peers lock");
            let lost = peers.seen(
                message.replica,
                message.seq,
                Instant::now(),
                message.workers,
            );
            m.lost_messages.fetch_add(lost, Ordering::Relaxed);
            let from = message.replica;
            if !peers.knows_workers(from) {
                // Its first messages since it started, or since it was expired here: applied
                // once its next heartbeat brings the table.
                let over = peers.hold(from, message.events);
                m.untranslated.fetch_add(over, Ordering::Relaxed);
                continue;
            }
            let mut all = peers.take_held(from);
            all.extend(message.events);
            n = all.len() as u64;
            let map = |w: WorkerId| peers.worker_url(from, w.0).and_then(|url| local.get(url));
            all.into_iter().filter_map(|e| e.map_workers(map)).collect()
        };
        let missed = n - events.len() as u64;
        if missed > 0 {
            m.untranslated.fetch_add(missed, Ordering::Relaxed);
            local = local_ids(inner);
        }
        apply(inner, events);
        m.peers_alive.store(
            peers.lock().expect("peers lock").alive() as u64,
            Ordering::Relaxed,
        );
    }
    tracing::warn!("replica sync: subscription ended");
}

/// Checks who sent `message`: true when it is this replica's own id (its echo, or a twin's,
/// counted as a conflict), else records its process and counts one that alternates.
fn check_sender(inner: &Inner, peers: &Mutex<super::peers::Peers>, message: &Message) -> bool {
    let conflicts = &inner.replica.metrics.id_conflicts;
    if message.replica == inner.replica.id() {
        if message.instance != 0 && message.instance != inner.replica.instance() {
            id_conflict(conflicts, message.replica);
        }
        return true;
    }
    let alternates = peers
        .lock()
        .expect("peers lock")
        .sent_by(message.replica, message.instance);
    if alternates {
        id_conflict(conflicts, message.replica);
    }
    false
}

/// Two processes publish under replica id `id` (this replica's own, or another's seen
/// alternating between two senders): the twins ignore each other's messages as their own
/// echo, and the others merge them into one peer (their sequence numbers and worker tables
/// overwrite each other's). Counted, and logged on the first message and every 1,000th after.
fn id_conflict(count: &AtomicU64, id: u64) {
    let n = count.fetch_add(1, Ordering::Relaxed);
    if n % 1000 == 0 {
        tracing::error!(
            "replica sync: two processes send as replica {id}: give each replica its own \
             --replica-id (or none: a random one is chosen); until then their state is not \
             shared correctly"
        );
    }
}

/// Expires replicas not heard from within the TTL: their load and holds go, and a hold left by
/// an update they drove is rolled back (see [`super::lease`]).
async fn expire(state: AppState, peers: Arc<Mutex<super::peers::Peers>>) {
    let inner = &state.inner;
    let config = inner.config.replica_sync.clone().expect("replica sync on");
    let mut tick = tokio::time::interval(config.heartbeat.min(config.ttl / 4));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (gone, alive) = {
            let mut p = peers.lock().expect("peers lock");
            (p.expire(Instant::now(), config.ttl), p.alive())
        };
        inner
            .replica
            .metrics
            .peers_alive
            .store(alive as u64, Ordering::Relaxed);
        for id in gone {
            let held = inner.lock_core().held_by(ReplicaId(id));
            tracing::warn!(
                "replica sync: replica {id} expired (no heartbeat for {:?})",
                config.ttl
            );
            inner
                .replica
                .metrics
                .expired
                .fetch_add(1, Ordering::Relaxed);
            apply(
                inner,
                vec![RemoteEvent::ReplicaExpired {
                    replica: ReplicaId(id),
                }],
            );
            super::health::forget(&state, id);
            if !held.is_empty() {
                tokio::spawn(super::lease::roll_back(state.clone(), id, held));
            }
        }
    }
}

/// Publishes this replica's events as they are queued, and a heartbeat (with its active
/// requests and worker table) every heartbeat interval. Keeps its recent changes to the stored
/// state and starts a repair when the client has connected again (see [`super::repair`]).
async fn publish(state: AppState, link: Arc<Link>, outage: Arc<super::repair::Outage>) {
    let inner = &state.inner;
    let config = &link.config;
    let names = Names::new(&config.cluster);
    let subject = names.deltas(config.replica_id);
    let m = &inner.replica.metrics;
    let mut tick = tokio::time::interval(config.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let stats = link.client.statistics();
    let mut connects = stats.connects.load(Ordering::Relaxed);
    // The first message carries the worker table, so the others can read its events at once.
    let mut first = true;
    // When a reconnect was last asked for because the connection stopped carrying messages.
    let mut forced: Option<Instant> = None;
    loop {
        let first_pass = std::mem::take(&mut first);
        let heartbeat = tokio::select! {
            _ = tick.tick() => true,
            _ = inner.replica.notify.notified() => {
                // Let the request tasks that are running queue theirs too: fewer, larger
                // messages.
                tokio::task::yield_now().await;
                false
            }
        } || first_pass;
        let (mut events, dropped) = {
            let mut core = inner.lock_core();
            if heartbeat {
                core.replica_active();
            }
            (core.take_outgoing(), core.outgoing_dropped())
        };
        m.dropped.store(dropped, Ordering::Relaxed);
        // The client buffers publishes while NATS is away, so their success says nothing about
        // the link: its state does (checked every heartbeat at least), and so does hearing this
        // replica's own messages back within the TTL.
        let now_connects = stats.connects.load(Ordering::Relaxed);
        if now_connects != connects {
            // (Its own messages come back over the new connection: the echo clock restarts.)
            connects = now_connects;
            forced = None;
            outage.reconnected();
        }
        let state_up = link.client.connection_state() == async_nats::connection::State::Connected;
        let connected = state_up && outage.since_echo() <= config.ttl;
        if state_up && !connected && forced.is_none_or(|at| at.elapsed() > config.ttl) {
            forced = Some(Instant::now());
            tracing::warn!(
                "replica sync: none of this replica's messages came back for {:?}: the NATS \
                 connection carries nothing; reconnecting",
                outage.since_echo()
            );
            let client = link.client.clone();
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), client.force_reconnect()).await;
            });
        }
        m.connected.store(connected, Ordering::Relaxed);
        outage
            .retained
            .lock()
            .expect("retained lock")
            .record(Instant::now(), &events, connected);
        // Nothing is sent while the link is down: the client would only queue it (and block
        // once its queue is full, holding up everything behind it). The stored-state changes
        // are kept for the repair (and what is to be sent again stays), load is repaired by the
        // heartbeats after it.
        if !connected {
            // Not sent: counted as a publish that failed (the stored-state changes among them
            // are kept for the repair).
            m.publish_errors
                .fetch_add(events.len() as u64, Ordering::Relaxed);
            continue;
        }
        let resend = outage.take_resend();
        if !resend.is_empty() {
            events.splice(0..0, resend);
        }
        let verdicts = super::health::outgoing(inner);
        if events.is_empty() && verdicts.is_empty() {
            continue;
        }
        let ejected = heartbeat
            .then(|| super::health::own_ejections(inner))
            .flatten();
        let workers = heartbeat.then(|| {
            let mut table: Vec<(u64, String)> = local_urls(inner)
                .into_iter()
                .map(|(id, url)| (id.0, url))
                .collect();
            table.sort();
            table
        });
        if let Some(table) = &workers {
            let key = Names::kv_subject(&names.members(), &config.replica_id.to_string());
            let body = serde_json::to_vec(table).unwrap_or_default();
            link.send(key, None, body.into()).await;
        }
        if let Some(list) = &ejected {
            let key = Names::kv_subject(&names.members(), &wire::health_key(config.replica_id));
            let body = serde_json::to_vec(list).unwrap_or_default();
            link.send(key, None, body.into()).await;
        }
        super::buckets::store_shared(inner, &link, &names, &events).await;
        let n = events.len() as u64;
        let message = Message {
            replica: config.replica_id,
            instance: inner.replica.instance(),
            seq,
            sent_unix_ms: wire::unix_ms(SystemTime::now()),
            workers,
            events,
            verdicts,
            ejected,
            rejoined: outage.take_rejoined(),
        };
        seq += 1;
        let body = serde_json::to_vec(&message).unwrap_or_default();
        if link.send(subject.clone(), None, body.into()).await {
            m.published.fetch_add(n, Ordering::Relaxed);
        } else {
            m.publish_errors.fetch_add(n, Ordering::Relaxed);
            tracing::warn!("replica sync: a publish was not taken within a heartbeat");
        }
    }
}
