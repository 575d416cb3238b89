//! Adding and removing workers: discovery of their KV event endpoints, registration with the core,
//! and their event subscribers.

use crate::config::WorkerEntry;
use crate::error::ServeError;
use crate::ingest::{self, Source};
use crate::pools::ModelCard;
use crate::state::{AppState, WorkerRecord};
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::{RouteError, WorkerSpec};
use kvrouter_core::timing::TimingModel;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

mod discover;
mod models;
use discover::discover;
use models::{learn_models, set_models, spawn_model_learning};

/// `tcp://host:port` + `offset` on the port.
fn shift_port(endpoint: &str, offset: u32) -> String {
    match endpoint.rsplit_once(':') {
        Some((head, port)) => match port.parse::<u32>() {
            Ok(p) => format!("{head}:{}", p.saturating_add(offset)),
            Err(_) => endpoint.to_owned(),
        },
        None => endpoint.to_owned(),
    }
}

/// How long a worker's `/server_info` or `/v1/models` may take, headers and body.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest `/server_info` or `/v1/models` body read.
const PROBE_MAX_BYTES: usize = 1 << 20;

/// `GET url` as JSON: headers and body within [`PROBE_TIMEOUT`], at most [`PROBE_MAX_BYTES`];
/// `None` otherwise (a worker still starting, or one that stalls mid-body).
pub(super) async fn get_json(state: &AppState, url: &str) -> Option<Value> {
    let fetch = async {
        let mut resp = state.inner.http.get(url).send().await.ok()?;
        if matches!(resp.status().as_u16(), 401 | 403) {
            tracing::warn!(
                "{url} answered {}: the worker wants an API key the router did not send or has \
                 wrong (--worker-api-key)",
                resp.status()
            );
            return None;
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.ok()? {
            if body.len() + chunk.len() > PROBE_MAX_BYTES {
                return None;
            }
            body.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&body).ok()
    };
    tokio::time::timeout(PROBE_TIMEOUT, fetch)
        .await
        .ok()
        .flatten()
}

/// A worker id given with a registration is one not registered yet: else a 409 naming `id`,
/// as a URL registered twice is.
fn check_new_id(
    workers: &std::collections::BTreeMap<WorkerId, WorkerRecord>,
    id: Option<u64>,
) -> Result<(), ServeError> {
    match id {
        Some(id) if workers.contains_key(&WorkerId(id)) => Err(taken_id(id)),
        _ => Ok(()),
    }
}

fn taken_id(id: u64) -> ServeError {
    ServeError::Exists {
        message: format!("worker {id} is already registered"),
        param: "id",
    }
}

/// A `url` is registered once: a second registration is a 409 naming it (compared as URLs:
/// [`same_worker_url`](crate::validate::same_worker_url)).
fn check_new_url(
    workers: &std::collections::BTreeMap<WorkerId, WorkerRecord>,
    url: &str,
) -> Result<(), ServeError> {
    match workers
        .iter()
        .find(|(_, r)| crate::validate::same_worker_url(&r.entry.url, url))
    {
        Some((id, _)) => Err(ServeError::Exists {
            message: format!("{url} is already registered as worker {id}"),
            param: "url",
        }),
        None => Ok(()),
    }
}

/// The step-time model `entry` is priced with: its own profile, else `--router-cost-profile`
/// (unless the online fit is on). Only the `cost` mode reads one, so no other mode reads a file
/// for it. One that cannot be read refuses the registration, except for a discovered worker,
/// which is then priced as if it named none (a warning says why): a pod whose annotation names
/// a file the router lacks still serves.
async fn worker_profile(
    state: &AppState,
    entry: &mut WorkerEntry,
) -> Result<Option<Arc<dyn TimingModel>>, ServeError> {
    let config = &state.inner.config;
    if config.router.router_mode != kvrouter_core::policy::RouterMode::Cost {
        return Ok(None);
    }
    let default_applies = !config.router.router_cost_fit;
    if entry.profile.is_none() && !(default_applies && config.profiles.default.is_some()) {
        return Ok(None);
    }
    let profiles = config.profiles.clone();
    let own = entry.profile.clone();
    let discovered = entry.labels.contains_key("discovery");
    let url = entry.url.clone();
    // A profile may be a file (read, parsed and checked): off the runtime's threads.
    let (timing, dropped) =
        tokio::task::spawn_blocking(move || match profiles.of(own.as_deref(), default_applies) {
            Ok(timing) => Ok((timing, false)),
            Err(e) if discovered && own.is_some() => {
                tracing::warn!(url = %url, "discovered worker's profile not used: {e}");
                Ok((profiles.of(None, default_applies)?, true))
            }
            Err(e) => Err(e),
        })
        .await
        .map_err(|e| ServeError::Upstream(format!("reading a profile failed: {e}")))?
        .map_err(|e| ServeError::invalid(e, Some("profile")))?;
    if dropped {
        // Shown as it is priced: without one of its own.
        entry.profile = None;
    }
    Ok(timing)
}

/// Registers a worker; returns its id. A worker whose URL does not answer yet is accepted (an
/// engine may still be loading): health checks mark it unhealthy until it answers.
pub(crate) async fn add_worker(
    state: &AppState,
    mut entry: WorkerEntry,
) -> Result<WorkerId, ServeError> {
    entry.validate()?;
    let inner = &state.inner;
    // Before the profile is read or the worker asked for its sizes.
    {
        let workers = inner.workers.lock().expect("workers lock");
        check_new_id(&workers, entry.id)?;
        check_new_url(&workers, &entry.url)?;
    }
    let timing = worker_profile(state, &mut entry).await?;
    let missing_events = inner.config.router.router_kv_events && entry.kv_events_endpoint.is_none();
    if missing_events
        || entry.block_size.is_none()
        || entry.max_num_batched_tokens.is_none()
        || entry.kv_capacity_blocks.is_none()
    {
        discover(state, &mut entry).await;
        entry.validate().map_err(|e| {
            ServeError::invalid(
                format!("{e} (as advertised by {}/server_info)", entry.url),
                Some(e.field),
            )
        })?;
    }
    let router_bs = inner.config.router.kv_cache_block_size;
    if let Some(bs) = entry.block_size {
        if bs != router_bs {
            return Err(ServeError::invalid(
                format!("worker {} uses KV block size {bs}, the router {router_bs} (--kv-cache-block-size must match the engines)", entry.url),
                Some("block_size"),
            ));
        }
    }
    // The models it serves: as configured, else from its `/v1/models` (with its adapters).
    // Asked before anything is registered: from the core's registration to the record's insert
    // below nothing awaits, so a registration given up meanwhile (its client gone, a shutdown
    // cutting it) leaves no worker the registry does not list, nor its subscribers running.
    let cards = if entry.models.is_empty() {
        learn_models(state, &entry.url).await
    } else {
        entry
            .models
            .iter()
            .map(|m| ModelCard {
                id: m.clone(),
                parent: None,
                max_model_len: None,
                created: None,
            })
            .collect()
    };
    let dp_size = entry.dp_size.unwrap_or(1);
    let id = match entry.id {
        Some(id) => WorkerId(id),
        None => {
            let workers = inner.workers.lock().expect("workers lock");
            let mut id = inner.next_worker.fetch_add(1, Ordering::Relaxed);
            while workers.contains_key(&WorkerId(id)) {
                id = inner.next_worker.fetch_add(1, Ordering::Relaxed);
            }
            WorkerId(id)
        }
    };
    entry.id = Some(id.0);
    entry.dp_size = Some(dp_size);
    let spec = WorkerSpec {
        id,
        dp_size,
        max_num_batched_tokens: entry.max_num_batched_tokens,
        kv_capacity_blocks: entry.kv_capacity_blocks,
        policy_version: entry.policy_version.unwrap_or(0),
        // Without an event endpoint its cache is predicted from what is routed to it.
        kv_events: entry.kv_events_endpoint.is_some(),
    };
    {
        let mut core = inner.lock_core();
        core.add_worker(spec).map_err(|e| match e {
            // Registered meanwhile under this id.
            RouteError::DuplicateWorker(id) => taken_id(id.0),
            e => ServeError::Route(e),
        })?;
        if let Some(timing) = timing {
            core.set_worker_timing(id, timing);
        }
    }
    let mut subscribers = Vec::new();
    if inner.config.router.router_kv_events {
        if let Some(endpoint) = &entry.kv_events_endpoint {
            for rank in 0..dp_size {
                let source = Source {
                    worker: id,
                    dp_rank: rank,
                    endpoint: shift_port(endpoint, rank),
                    replay: entry
                        .replay_endpoint
                        .as_deref()
                        .map(|r| shift_port(r, rank)),
                };
                subscribers.push(ingest::spawn(inner.clone(), source));
            }
        }
    }
    if let Some(checks) = state.spawn_health_checks(id, entry.url.clone()) {
        subscribers.push(checks);
    }
    if entry.models.is_empty() && cards.is_empty() {
        // Not answering yet (vLLM loads its weights for minutes before it serves
        // `/v1/models`): asked again until it lists its models.
        subscribers.push(spawn_model_learning(state.clone(), id, entry.url.clone()));
    }
    let mut workers = inner.workers.lock().expect("workers lock");
    // Checked again: another registration of the URL may have finished meanwhile.
    if let Err(e) = check_new_url(&workers, &entry.url) {
        drop(workers);
        for task in &subscribers {
            task.abort();
        }
        let _ = inner.lock_core().remove_worker(id);
        return Err(e);
    }
    workers.insert(
        id,
        WorkerRecord {
            entry,
            subscribers,
            draining: false,
        },
    );
    drop(workers);
    set_models(state, id, Some(cards));
    Ok(id)
}

/// Unregisters a worker: stops its subscribers and drops its blocks.
pub(crate) fn remove_worker(state: &AppState, id: WorkerId) -> Result<WorkerEntry, ServeError> {
    let record = state
        .inner
        .workers
        .lock()
        .expect("workers lock")
        .remove(&id);
    let Some(record) = record else {
        return Err(ServeError::NotFound(format!(
            "worker {id} is not registered"
        )));
    };
    let entry = record.entry.clone();
    // Its subscribers and health checks stop here (the record's drop), before what they
    // count is forgotten.
    drop(record);
    let _ = state.inner.lock_core().remove_worker(id);
    set_models(state, id, None);
    // Ids are not used again: what was kept under this one goes with it.
    state.inner.health.forget(id);
    state.inner.metrics.forget_worker(&id.to_string());
    Ok(entry)
}

/// Takes a worker out of rotation because its discovery source removed it: no new requests,
/// requests in flight go on (failed streams migrate per `--migration-limit`), its subscribers and
/// index entries stay until [`remove_worker`] purges it. Returns whether it is registered.
pub(crate) fn drain_worker(state: &AppState, id: WorkerId) -> bool {
    let mut workers = state.inner.workers.lock().expect("workers lock");
    let Some(record) = workers.get_mut(&id) else {
        return false;
    };
    record.draining = true;
    state.inner.lock_core().set_available(id, false);
    true
}

/// Puts a draining worker back into rotation (it registered again, unchanged), unless health
/// checks hold it out. Its subscribers were kept: they re-sync the index when its KV event
/// publisher comes back. Returns whether it is registered.
pub(crate) fn revive_worker(state: &AppState, id: WorkerId) -> bool {
    let mut workers = state.inner.workers.lock().expect("workers lock");
    let Some(record) = workers.get_mut(&id) else {
        return false;
    };
    record.draining = false;
    if !state.inner.health.is_unhealthy(id) {
        state.inner.lock_core().set_available(id, true);
    }
    drop(workers);
    state.inner.wake_queue();
    true
}

/// Reads a registered worker's entry.
fn with_entry<T>(
    state: &AppState,
    id: WorkerId,
    read: impl FnOnce(&WorkerEntry) -> T,
) -> Option<T> {
    let workers = state.inner.workers.lock().expect("workers lock");
    workers.get(&id).map(|r| read(&r.entry))
}

/// The base URL of a worker.
pub(crate) fn url_of(state: &AppState, id: WorkerId) -> Option<String> {
    with_entry(state, id, |e| e.url.trim_end_matches('/').to_owned())
}

/// The engine kind a worker was registered with, if given.
pub(crate) fn engine_of(state: &AppState, id: WorkerId) -> Option<crate::engines::EngineKind> {
    with_entry(state, id, |e| e.engine).flatten()
}

/// Records the engine kind learned for a worker.
pub(crate) fn set_engine(state: &AppState, id: WorkerId, kind: crate::engines::EngineKind) {
    let mut workers = state.inner.workers.lock().expect("workers lock");
    if let Some(r) = workers.get_mut(&id) {
        r.entry.engine = Some(kind);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_cost_reads_profiles_and_a_discovered_workers_bad_one_falls_back() {
        use crate::config::{Profiles, ServeConfig};
        use kvrouter_core::policy::RouterMode;
        let lookup = |name: &str| match name {
            "poly" => Ok(std::sync::Arc::new(kvrouter_core::timing::DynamoPoly) as _),
            _ => Err(format!("no profile {name}")),
        };
        let state = |mode: RouterMode, fit: bool| {
            let mut config = ServeConfig {
                profiles: Profiles {
                    default: Some("poly".into()),
                    lookup: Some(std::sync::Arc::new(lookup)),
                },
                ..ServeConfig::default()
            };
            config.router.router_mode = mode;
            config.router.router_cost_fit = fit;
            AppState::new(config).unwrap()
        };
        let entry = |profile: Option<&str>, discovered: bool| {
            let mut e = WorkerEntry {
                url: "http://127.0.0.1:9".into(),
                profile: profile.map(str::to_owned),
                ..WorkerEntry::default()
            };
            if discovered {
                e.labels.insert("discovery".into(), "etcd".into());
            }
            e
        };
        let cost = state(RouterMode::Cost, false);
        assert!(worker_profile(&cost, &mut entry(None, false))
            .await
            .unwrap()
            .is_some());
        let err = worker_profile(&cost, &mut entry(Some("bad"), false))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("no profile bad"), "{err}");
        let mut discovered = entry(Some("bad"), true);
        assert!(worker_profile(&cost, &mut discovered)
            .await
            .unwrap()
            .is_some());
        assert_eq!(discovered.profile, None, "shown as priced: the default");
        let kv = state(RouterMode::Kv, false);
        assert!(worker_profile(&kv, &mut entry(Some("bad"), false))
            .await
            .unwrap()
            .is_none());
        let fit = state(RouterMode::Cost, true);
        assert!(worker_profile(&fit, &mut entry(None, false))
            .await
            .unwrap()
            .is_none());
        assert!(worker_profile(&fit, &mut entry(Some("poly"), false))
            .await
            .unwrap()
            .is_some());
    }

    #[test]
    fn rank_endpoints_add_the_rank_to_the_port() {
        assert_eq!(shift_port("tcp://10.0.0.1:5557", 2), "tcp://10.0.0.1:5559");
        assert_eq!(shift_port("ipc:///tmp/x", 1), "ipc:///tmp/x");
    }
}
