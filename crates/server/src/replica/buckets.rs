//! The JetStream key-value side of replica sync: the buckets (made if missing), what a joining
//! replica reads from them, and the puts of the state it would read (plain publishes to
//! `$KV.<bucket>.<key>`, nothing awaited).

use super::link::{apply, local_ids};
use super::wire::{self, Names, PolicyField, SessionValue, WorkerPolicy};
use crate::replica_state::Link;
use crate::state::{AppState, Inner};
use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use kvrouter_core::ids::{WorkerId, WorkerRank};
use kvrouter_core::router::RemoteEvent;
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Opens a bucket, making it if it does not exist (`max_age` zero: entries never age out).
pub(super) async fn open(
    js: &jetstream::Context,
    name: &str,
    max_age: Duration,
) -> Result<kv::Store, String> {
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    // The bucket's stream as `create_key_value` would make it, made directly: that call first
    // reads the account info, whose format changed after nats-server 2.9 (Debian's).
    let made = js
        .create_stream(jetstream::stream::Config {
            name: format!("KV_{name}"),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: 1,
            max_age,
            storage: jetstream::stream::StorageType::Memory,
            discard: jetstream::stream::DiscardPolicy::New,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            num_replicas: 1,
            max_messages: -1,
            max_bytes: -1,
            ..Default::default()
        })
        .await;
    match made {
        Ok(_) => js
            .get_key_value(name)
            .await
            .map_err(|e| format!("bucket {name}: {e}")),
        // Another replica made it meanwhile.
        Err(e) => js
            .get_key_value(name)
            .await
            .map_err(|_| format!("bucket {name}: {e}")),
    }
}

/// The sessions bucket made by a replica with a shorter session TTL
/// (`--router-session-affinity-ttl-secs`) would drop this replica's bindings early: it keeps
/// the longest any replica asks for. (Not for the members and lease buckets: their age limit
/// is the replica TTL, which expires a dead replica's entries and lease.) Best effort.
async fn keep_longest_age(js: &jetstream::Context, name: &str, max_age: Duration) {
    let Ok(stream) = js.get_stream(format!("KV_{name}")).await else {
        return;
    };
    let current = stream.cached_info().config.max_age;
    let longer = current != Duration::ZERO && (max_age == Duration::ZERO || max_age > current);
    if !longer {
        return;
    }
    let mut config = stream.cached_info().config.clone();
    config.max_age = max_age;
    match js.update_stream(config).await {
        Ok(_) => tracing::info!(
            "replica sync: bucket {name} now keeps entries for {max_age:?} (was {current:?})"
        ),
        Err(e) => tracing::warn!("replica sync: bucket {name}: cannot lengthen its age limit: {e}"),
    }
}

/// The longest pause between two tries at the key-value buckets.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The four buckets: members, sessions, policy, lease.
pub(super) type Buckets = (kv::Store, kv::Store, kv::Store, kv::Store);

/// Opens the four buckets, making any that is missing. JetStream off (`nats-server` without
/// `-js`), not ready yet, or buckets that disagree: there is no shared state until it works, so
/// they are tried again (after 1 s, doubling to 30 s) rather than given up.
pub(super) async fn open_all(
    js: &jetstream::Context,
    names: &Names,
    ttl: Duration,
    session_ttl: Duration,
) -> Buckets {
    let all = || async {
        let sessions = open(js, &names.sessions(), session_ttl).await?;
        keep_longest_age(js, &names.sessions(), session_ttl).await;
        Ok::<_, String>((
            open(js, &names.members(), ttl).await?,
            sessions,
            open(js, &names.policy(), Duration::ZERO).await?,
            open(js, &names.lease(), ttl).await?,
        ))
    };
    let mut pause = Duration::from_secs(1);
    loop {
        match all().await {
            Ok(b) => return b,
            Err(e) => {
                tracing::error!(
                    "replica sync: key-value buckets: {e}; trying again in {} s",
                    pause.as_secs()
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RETRY_MAX);
            }
        }
    }
}

/// Every entry of a bucket (at most `max`, `--replica-join-max-keys`).
async fn entries(store: &kv::Store, max: usize) -> Vec<(String, bytes::Bytes)> {
    let mut out = Vec::new();
    let Ok(mut keys) = store.keys().await else {
        return out;
    };
    while let Some(Ok(key)) = keys.next().await {
        if out.len() >= max {
            break;
        }
        if let Ok(Some(v)) = store.get(&key).await {
            out.push((key, v));
        }
    }
    out
}

/// How a replica reads the buckets: which of its own changes the buckets must not overwrite
/// (made before it joined, or since its repair: perhaps not in the buckets yet), and whether
/// bindings it holds that the bucket has released are released here (after an outage: a
/// release it missed; a replica that just started holds none).
pub(super) struct Read<'a> {
    pub(super) skip: &'a HashSet<super::repair::Key>,
    pub(super) releases: bool,
}

/// What a joining replica reads: the others' worker tables and health ejections, live
/// sessions, policy versions and pauses.
pub(super) async fn join(
    state: &AppState,
    peers: &Mutex<super::peers::Peers>,
    (members, sessions, policy): (&kv::Store, &kv::Store, &kv::Store),
    read: Read<'_>,
) {
    let inner = &*state.inner;
    let own = inner.replica.id();
    let max = inner
        .config
        .replica_sync
        .as_ref()
        .map_or(1, |c| c.join_max_keys);
    for (key, value) in entries(members, max).await {
        if let Some(id) = wire::health_key_replica(&key) {
            if let (false, Ok(list)) = (id == own, serde_json::from_slice(&value)) {
                super::health::apply(state, id, Vec::new(), Some(list));
            }
            continue;
        }
        let Ok(id) = key.parse::<u64>() else { continue };
        if id == own {
            continue;
        }
        if let Ok(ws) = serde_json::from_slice::<Vec<(u64, String)>>(&value) {
            peers
                .lock()
                .expect("peers lock")
                .learn_workers(id, Instant::now(), ws);
        }
    }
    let local = local_ids(inner);
    let mut events = Vec::new();
    let mut listed = HashSet::new();
    for (key, value) in entries(sessions, max).await {
        let (Ok(session), Ok(v)) = (
            u64::from_str_radix(&key, 16),
            serde_json::from_slice::<SessionValue>(&value),
        ) else {
            continue;
        };
        listed.insert(session);
        let left = v.left_ms(wire::unix_ms(std::time::SystemTime::now()));
        if let (Some(w), true) = (local.get(&v.url), left > 0) {
            events.push(RemoteEvent::Session {
                session,
                rank: WorkerRank::new(w, v.dp_rank),
                ttl_ms: left,
            });
        }
    }
    if read.releases {
        events.extend(released(inner, sessions, &listed, max).await);
    }
    for (_, value) in entries(policy, max).await {
        let Ok(v) = serde_json::from_slice::<WorkerPolicy>(&value) else {
            continue;
        };
        let Some(w) = local.get(&v.url) else { continue };
        if let Some(version) = v.version {
            events.push(RemoteEvent::Version { worker: w, version });
        }
        if let Some(paused) = v.paused {
            events.push(RemoteEvent::Paused { worker: w, paused });
        }
    }
    events.retain(|e| super::repair::key(e).is_none_or(|k| !read.skip.contains(&k)));
    let n = events.len();
    apply(inner, events);
    tracing::info!("replica sync: read {n} shared entries from the buckets");
}

/// The sessions bound here that the bucket no longer lists because another replica released
/// them (a delete marker): released here too. One that is simply absent (a bucket lost with a
/// restarted server, not refilled yet) stays.
async fn released(
    inner: &Inner,
    sessions: &kv::Store,
    listed: &HashSet<u64>,
    max: usize,
) -> Vec<RemoteEvent> {
    let held: Vec<u64> = inner
        .lock_core()
        .session_bindings(inner.now(), max)
        .into_iter()
        .map(|(session, _, _)| session)
        .filter(|s| !listed.contains(s))
        .collect();
    let mut out = Vec::new();
    for session in held {
        if is_released(sessions, session).await {
            out.push(RemoteEvent::SessionReleased { session });
        }
    }
    out
}

/// Whether the sessions bucket's last word on `session` is a release (a delete marker).
async fn is_released(sessions: &kv::Store, session: u64) -> bool {
    matches!(
        sessions.entry(wire::session_key(session)).await,
        Ok(Some(entry)) if entry.operation != kv::Operation::Put
    )
}

/// `changes` without the session bindings the sessions bucket shows released (a delete
/// marker): a repair does not put them back.
pub(super) async fn not_released(
    sessions: &kv::Store,
    changes: Vec<RemoteEvent>,
) -> Vec<RemoteEvent> {
    let mut kept = Vec::with_capacity(changes.len());
    for e in changes {
        if let RemoteEvent::Session { session, .. } = &e {
            if is_released(sessions, *session).await {
                continue;
            }
        }
        kept.push(e);
    }
    kept
}

/// Puts the state a joining replica reads (session bindings, versions, pauses) into the
/// buckets, with plain publishes.
pub(super) async fn store_shared(
    inner: &Inner,
    link: &Link,
    names: &Names,
    events: &[RemoteEvent],
) {
    if !events.iter().any(RemoteEvent::is_lasting) {
        return;
    }
    let urls = super::link::local_urls(inner);
    for e in events {
        let (bucket, key, body) = match e {
            RemoteEvent::Session {
                session,
                rank,
                ttl_ms,
            } => {
                let Some(url) = urls.get(&rank.worker) else {
                    continue;
                };
                let v = SessionValue::new(
                    url.clone(),
                    rank.dp_rank,
                    *ttl_ms,
                    wire::unix_ms(std::time::SystemTime::now()),
                );
                (
                    names.sessions(),
                    wire::session_key(*session),
                    serde_json::to_vec(&v).unwrap_or_default(),
                )
            }
            RemoteEvent::SessionReleased { session } => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("KV-Operation", "DEL");
                let subject = Names::kv_subject(&names.sessions(), &wire::session_key(*session));
                link.send(subject, Some(headers), bytes::Bytes::new()).await;
                continue;
            }
            RemoteEvent::Version { worker, .. } | RemoteEvent::Paused { worker, .. } => {
                let Some(url) = urls.get(worker) else {
                    continue;
                };
                // The field this event changed, as it is now; the other is not written.
                let field = match e {
                    RemoteEvent::Version { .. } => PolicyField::Version,
                    _ => PolicyField::Paused,
                };
                let v = policy_of(inner, *worker, url, field);
                (
                    names.policy(),
                    wire::policy_key(url, field),
                    serde_json::to_vec(&v).unwrap_or_default(),
                )
            }
            _ => continue,
        };
        link.send(Names::kv_subject(&bucket, &key), None, body.into())
            .await;
    }
}

/// Worker `worker`'s `field` (its version or its pause) as it is now, for the policy bucket.
fn policy_of(inner: &Inner, worker: WorkerId, url: &str, field: PolicyField) -> WorkerPolicy {
    let core = inner.lock_core();
    let (version, paused) = match field {
        PolicyField::Version => (
            core.workers()
                .find(|w| w.id == worker)
                .map(|w| w.policy_version),
            None,
        ),
        PolicyField::Paused => (None, Some(core.is_paused(worker))),
    };
    WorkerPolicy {
        url: url.to_owned(),
        version,
        paused,
    }
}

/// Writes every session binding (at most `max`), version and pause this replica knows into
/// the buckets where the key is missing: a bucket lost with a restarted NATS server is filled
/// again, and a key another replica wrote meanwhile is not overwritten (JetStream refuses a
/// write that expects the key to have no entry yet). Plain publishes; returns how many.
pub(super) async fn refill(inner: &Inner, link: &Link, names: &Names, max: usize) -> usize {
    let urls = super::link::local_urls(inner);
    let now_unix = wire::unix_ms(std::time::SystemTime::now());
    let mut writes: Vec<(String, String, Vec<u8>)> = Vec::new();
    {
        let core = inner.lock_core();
        for w in core.workers() {
            let Some(url) = urls.get(&w.id) else { continue };
            for (field, v) in [
                (
                    PolicyField::Version,
                    WorkerPolicy {
                        url: url.clone(),
                        version: Some(w.policy_version),
                        paused: None,
                    },
                ),
                (
                    PolicyField::Paused,
                    WorkerPolicy {
                        url: url.clone(),
                        version: None,
                        paused: Some(core.is_paused(w.id)),
                    },
                ),
            ] {
                writes.push((
                    names.policy(),
                    wire::policy_key(url, field),
                    serde_json::to_vec(&v).unwrap_or_default(),
                ));
            }
        }
        for (session, rank, ttl_ms) in core.session_bindings(inner.now(), max) {
            let Some(url) = urls.get(&rank.worker) else {
                continue;
            };
            let v = SessionValue::new(url.clone(), rank.dp_rank, ttl_ms, now_unix);
            writes.push((
                names.sessions(),
                wire::session_key(session),
                serde_json::to_vec(&v).unwrap_or_default(),
            ));
        }
    }
    let n = writes.len();
    for (bucket, key, body) in writes {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Expected-Last-Subject-Sequence", "0");
        link.send(Names::kv_subject(&bucket, &key), Some(headers), body.into())
            .await;
    }
    n
}
