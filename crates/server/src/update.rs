//! The router-run weight-update cycle (`POST /admin/policy/update`): the core decides which
//! workers leave rotation and when each may load; this task makes the engine calls
//! ([`crate::engines`]) and reports back. Requests aborted on an engine are continued by their
//! streams (see `migrate.rs`), so nothing that entered before the update is lost.

use crate::config::WorkerEntry;
use crate::engines::{Call, EngineKind, LoadSpec};
use crate::error::ServeError;
use crate::registry;
use crate::state::AppState;
use crate::weight_source::{Fetch, Source, SourceBody};
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::{KvRetention, UpdateAction, UpdateMode, UpdatePhase, UpdatePlan};
use serde::Deserialize;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// Longest wait for one engine call (weight loads of large models take minutes).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a worker aborted for an update may stay busy before it is aborted again.
const REABORT_AFTER: Duration = Duration::from_millis(500);

/// The body of `POST /admin/policy/update`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpdateBody {
    /// The policy version to serve.
    pub(crate) version: u64,
    /// `drain` (default), `abort` or `rolling`.
    #[serde(default)]
    pub(crate) mode: Option<String>,
    /// Workers at a time in `rolling` mode (default 1).
    #[serde(default)]
    pub(crate) batch: Option<usize>,
    /// Worker ids to update (default: all).
    #[serde(default)]
    pub(crate) workers: Option<Vec<u64>>,
    /// How the engines load the weights.
    #[serde(default)]
    pub(crate) load: LoadSpec,
    /// Where the router fetches the version for each worker first (its directory becomes the
    /// load call's `model_path`).
    #[serde(default)]
    pub(crate) source: Option<SourceBody>,
}

/// An update checked and ready to begin: [`prepare`] reads and checks it and changes nothing;
/// [`Prepared::begin`] starts it without awaiting anything, so the caller can take the
/// replicas' update lease between the two and hand it on at once (a request given up while the
/// source was checked leaves no lease held and no cycle half-started).
pub(crate) struct Prepared {
    body: UpdateBody,
    plan: UpdatePlan,
    source: Option<Source>,
}

/// Reads and checks an update. With a `source`, makes sure it has the version: an update to a
/// version no one has is refused before any worker leaves rotation.
pub(crate) async fn prepare(state: &AppState, body: UpdateBody) -> Result<Prepared, ServeError> {
    let mode: UpdateMode = body
        .mode
        .as_deref()
        .unwrap_or("drain")
        .parse()
        .map_err(|e: String| ServeError::invalid(e, Some("mode")))?;
    let plan = UpdatePlan {
        version: body.version,
        mode,
        batch: body.batch.unwrap_or(1),
        workers: body
            .workers
            .as_ref()
            .map(|ws| ws.iter().copied().map(WorkerId).collect()),
    };
    let source = body.source.as_ref().map(SourceBody::validate).transpose()?;
    let inner = &state.inner;
    if let (Some(spec), Some(source)) = (body.source.as_ref(), source.as_ref()) {
        let targets: Vec<WorkerId> = match &plan.workers {
            Some(ws) => ws.clone(),
            None => inner.lock_core().workers().map(|w| w.id).collect(),
        };
        spec.check(source, body.version, &targets).await?;
    }
    Ok(Prepared { body, plan, source })
}

impl Prepared {
    /// Starts the cycle and the task that carries it out.
    pub(crate) fn begin(self, state: &AppState) -> Result<(), ServeError> {
        let Prepared { body, plan, source } = self;
        let mode = plan.mode;
        let inner = &state.inner;
        let now = inner.now();
        let (actions, later) = inner
            .begin_update(|core| core.begin_update(plan, now))
            .map_err(|e| {
                let field = match e {
                    kvrouter_core::router::UpdateError::ZeroBatch => Some("batch"),
                    kvrouter_core::router::UpdateError::UnknownWorker(_) => Some("workers"),
                    _ => None,
                };
                match e {
                    kvrouter_core::router::UpdateError::InProgress(_) => {
                        ServeError::Conflict(e.to_string())
                    }
                    e => ServeError::invalid(e.to_string(), field),
                }
            })?;
        tracing::info!(
            "weight update to policy version {} ({}) started",
            body.version,
            mode.as_str()
        );
        let fetches = match (body.source.as_ref(), source) {
            (Some(spec), Some(source)) => {
                let targets: Vec<(WorkerId, u64)> = {
                    let core = inner.lock_core();
                    let ids: Vec<WorkerId> = core
                        .update_status()
                        .map(|s| s.phases.keys().copied().collect())
                        .unwrap_or_default();
                    let running: HashMap<WorkerId, u64> =
                        core.workers().map(|w| (w.id, w.policy_version)).collect();
                    ids.into_iter()
                        .map(|id| (id, running.get(&id).copied().unwrap_or(0)))
                        .collect()
                };
                spec.start(source, body.version, &targets)
            }
            _ => HashMap::new(),
        };
        tokio::spawn(drive(state.clone(), body.load, fetches, actions, later));
        Ok(())
    }
}

/// Carries out the cycle: engine calls as the core asks for them, until every target is done.
/// A worker's calls run one at a time (an abort never lands after the load's resume), and an
/// abort is only sent to a worker still draining. `later`: the calls that releases of load ask
/// for (a draining worker's last request ended).
async fn drive(
    state: AppState,
    load: LoadSpec,
    fetches: HashMap<WorkerId, Fetch>,
    mut actions: Vec<UpdateAction>,
    mut later: mpsc::UnboundedReceiver<Vec<UpdateAction>>,
) {
    let inner = &state.inner;
    let (loaded_tx, mut loaded_rx) = mpsc::unbounded_channel::<(WorkerId, bool)>();
    let mut reabort_at = tokio::time::Instant::now() + REABORT_AFTER;
    loop {
        for action in actions.drain(..) {
            let worker = match &action {
                UpdateAction::Abort(w) | UpdateAction::Load { worker: w, .. } => *w,
            };
            let lane = inner.update_lanes.lane(worker);
            let state = state.clone();
            match action {
                UpdateAction::Abort(worker) => {
                    tokio::spawn(async move {
                        // Another pause of this worker is under way (an abort, or its load's):
                        // this one is not needed.
                        let Ok(held) = lane.try_lock() else {
                            return;
                        };
                        let draining = state.inner.lock_core().update_phase(worker)
                            == Some(UpdatePhase::Draining);
                        let Some(url) = registry::url_of(&state, worker).filter(|_| draining)
                        else {
                            return;
                        };
                        let control = engine_kind(&state, worker).await.control();
                        if let Err(e) = pause(&state, held, &url, control, true).await {
                            tracing::warn!("worker {worker}: aborting in-flight requests: {e}");
                        }
                    });
                }
                UpdateAction::Load { worker, version } => {
                    let mut load = load.clone();
                    let fetch = fetches.get(&worker).cloned();
                    let tx = loaded_tx.clone();
                    tokio::spawn(async move {
                        let started = std::time::Instant::now();
                        let result = match fetch {
                            Some(f) => match f.await {
                                Ok(path) => {
                                    load.body.insert("model_path".into(), path.into());
                                    load_weights(&state, worker, version, &load).await
                                }
                                Err(e) => Err(e),
                            },
                            None => load_weights(&state, worker, version, &load).await,
                        };
                        if let Some(c) = &state.inner.capture {
                            c.record_load(worker.0, started, std::time::Instant::now());
                        }
                        let ok = match result {
                            Ok(()) => true,
                            Err(e) => {
                                tracing::warn!("worker {worker}: weight update failed: {e}");
                                false
                            }
                        };
                        let _ = tx.send((worker, ok));
                    });
                }
            }
        }
        let status = inner.lock_core().update_status();
        let Some(status) = status.filter(|s| s.finished.is_none()) else {
            tracing::info!("weight update finished");
            return;
        };
        // In abort mode a request that reached an engine after its abort call waits there,
        // paused: abort again, every REABORT_AFTER, until the worker is idle.
        let stragglers: Vec<WorkerId> = match status.plan.mode {
            UpdateMode::Abort => status
                .phases
                .iter()
                .filter(|(_, p)| **p == UpdatePhase::Draining)
                .map(|(w, _)| *w)
                .collect(),
            _ => Vec::new(),
        };
        let reabort = async {
            if stragglers.is_empty() {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep_until(reabort_at).await;
        };
        tokio::select! {
            _ = reabort => {
                reabort_at = tokio::time::Instant::now() + REABORT_AFTER;
                actions = stragglers.into_iter().map(UpdateAction::Abort).collect();
            }
            Some((worker, ok)) = loaded_rx.recv() => {
                let mut core = inner.lock_core();
                actions = core.update_loaded(worker, ok, inner.now()).unwrap_or_default();
                if ok {
                    let version = core.update_status().map_or(0, |s| s.plan.version);
                    tracing::info!("worker {worker} loaded policy version {version}");
                }
                // This driver's cycle is over once its last load is in: a cycle started after
                // it gets its own driver.
                let finished = core.update_status().is_none_or(|s| s.finished.is_some());
                drop(core);
                // Requests waiting for a worker (or for the new version) may go now.
                inner.wake_queue();
                if finished {
                    tracing::info!("weight update finished");
                    return;
                }
            }
            Some(more) = later.recv() => {
                actions = more;
            }
        }
    }
}

/// The engine kind of a worker: as registered, or read once from its `/server_info` and kept.
async fn engine_kind(state: &AppState, worker: WorkerId) -> EngineKind {
    if let Some(kind) = registry::engine_of(state, worker) {
        return kind;
    }
    let Some(url) = registry::url_of(state, worker) else {
        return EngineKind::Vllm;
    };
    let (kind, known) = kind_at(state, &url).await;
    if known {
        registry::set_engine(state, worker, kind);
    }
    kind
}

/// The engine kind the engine at `url` states (`/server_info`), and whether it answered.
async fn kind_at(state: &AppState, url: &str) -> (EngineKind, bool) {
    let answer = state
        .inner
        .http
        .get(format!("{url}/server_info"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    let info = match answer {
        Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
        // An answer without it (vLLM has no /server_info) says as much as one with it.
        Ok(_) => None,
        // No answer: guess, and ask again next time.
        Err(_) => return (EngineKind::from_server_info(None), false),
    };
    (EngineKind::from_server_info(info.as_ref()), true)
}

/// Pause (nothing is in flight any more), load, resume. Every call goes to the URL the worker
/// had when its load began: a worker removed meanwhile is still resumed.
async fn load_weights(
    state: &AppState,
    worker: WorkerId,
    version: u64,
    load: &LoadSpec,
) -> Result<(), String> {
    let url = registry::url_of(state, worker).ok_or("the worker was removed")?;
    let control = engine_kind(state, worker).await.control();
    let flush = state.inner.config.router.kv_retention == KvRetention::Flush;
    let lanes = &state.inner.update_lanes;
    let lane = lanes.lane(worker);
    let loaded = async {
        pause(state, lane.lock().await, &url, control, false).await?;
        for c in control.load(version, load, flush) {
            if lanes.stopped() {
                // The stopping router resumed it (or will): no more calls.
                return Err("the router is stopping".to_owned());
            }
            call_at(state, &url, &c).await?;
        }
        Ok::<(), String>(())
    }
    .await;
    if lanes.stopped() {
        // The stopping router resumes what this update holds (the lane); an engine this load
        // never paused is not resumed (found by a probe: it could be another's to hold).
        return loaded.and(Err("the router is stopping".to_owned()));
    }
    // Resume even after a failed pause or load (an abort may have paused it already): the
    // engine keeps serving its old weights, and the router keeps it out of rotation until an
    // operator looks.
    let resumed = call_at(state, &url, &control.resume()).await;
    if resumed.is_ok() {
        *lane.lock().await = None;
    }
    loaded.and(resumed)
}

/// Pauses the engine at `url` (`abort`: its requests in flight too) under its worker's lane:
/// the lane holds the URL from then on, until a resume. A stopping router pauses nothing; one
/// that began stopping during the pause gets the engine resumed at once.
async fn pause(
    state: &AppState,
    mut held: tokio::sync::MutexGuard<'_, Option<String>>,
    url: &str,
    control: &dyn crate::engines::EngineControl,
    abort: bool,
) -> Result<(), String> {
    let lanes = &state.inner.update_lanes;
    if lanes.stopped() {
        return Err("the router is stopping".to_owned());
    }
    *held = Some(url.to_owned());
    let paused = call_at(state, url, &control.pause(abort)).await;
    if lanes.stopped() && call_at(state, url, &control.resume()).await.is_ok() {
        *held = None;
    }
    paused
}

/// A worker left the fleet (`DELETE /admin/workers/{id}`, discovery): it leaves the running
/// cycle, so the workers loaded beside it come back and the cycle can end without it. An
/// engine an abort paused (and no load took over) is resumed: it is no longer the router's,
/// but it must not be left paused. (One loading is resumed by its load's own end.)
pub(crate) fn worker_removed(state: &AppState, worker: WorkerId, entry: &WorkerEntry) {
    let inner = &state.inner;
    let (actions, aborted) = {
        let mut core = inner.lock_core();
        let aborted = core.update_phase(worker) == Some(UpdatePhase::Draining)
            && core
                .update_status()
                .is_some_and(|s| s.plan.mode == UpdateMode::Abort);
        (core.update_worker_removed(worker, inner.now()), aborted)
    };
    inner.send_update_actions(actions);
    inner.wake_queue();
    if aborted {
        let (state, known) = (state.clone(), entry.engine);
        tokio::spawn(async move {
            // Its abort's pause is done (the lane), and nothing else holds it.
            let lane = state.inner.update_lanes.lane(worker);
            let mut held = lane.lock().await;
            if let Err(e) = resume_held(&state, &mut held, known).await {
                tracing::warn!("removed worker {worker}: resuming its engine: {e}")
            }
        });
    }
}

/// Resumes the engine a lane holds paused (`held`: its URL), if it holds one, and clears it;
/// `known`: the engine's kind if known, else asked at the URL. Whether there was one.
async fn resume_held(
    state: &AppState,
    held: &mut Option<String>,
    known: Option<EngineKind>,
) -> Result<bool, String> {
    let Some(url) = held.clone() else {
        return Ok(false);
    };
    let kind = match known {
        Some(kind) => kind,
        None => kind_at(state, &url).await.0,
    };
    call_at(state, &url, &kind.control().resume())
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    *held = None;
    Ok(true)
}

/// How long a stopping router waits for an engine's pause already in flight before it resumes
/// it (a resume sent before the pause lands would be undone by it).
const PAUSE_WAIT_AT_STOP: Duration = Duration::from_secs(10);

/// At shutdown: no engine is paused from now on, and every engine a weight update holds paused
/// (an abort's, a load's, a removed worker's) is resumed at its URL, each resume given
/// `within`, after waiting (at most [`PAUSE_WAIT_AT_STOP`]) for a pause in flight. The router's
/// exit must not leave them paused with nobody to resume them.
pub(crate) async fn release_held_engines(state: &AppState, within: Duration) {
    let lanes = state.inner.update_lanes.stop();
    let resume = lanes.into_iter().map(|(worker, lane)| async move {
        let Ok(mut held) = tokio::time::timeout(PAUSE_WAIT_AT_STOP, lane.lock()).await else {
            tracing::warn!(
                "shutdown: worker {worker}'s pause did not end within {PAUSE_WAIT_AT_STOP:?}; \
                 its engine may stay paused (resume it by hand)"
            );
            return;
        };
        let resumed = resume_held(state, &mut held, registry::engine_of(state, worker));
        match tokio::time::timeout(within, resumed).await {
            Ok(Ok(false)) => {}
            Ok(Ok(true)) => tracing::info!("shutdown: resumed worker {worker}, held by the update"),
            Ok(Err(e)) => tracing::warn!("shutdown: resuming worker {worker}: {e}"),
            Err(_) => tracing::warn!(
                "shutdown: worker {worker} did not answer its resume within {within:?}; its \
                 engine may stay paused (resume it by hand)"
            ),
        }
    });
    futures::future::join_all(resume).await;
}

/// Resumes a worker's engine (a weight update that paused it was abandoned: its replica died).
/// The engine answers once any load under way is over; if it reports the version it serves
/// (`/server_info`'s `policy_version`), the router adopts it: a load that completed counts.
pub(crate) async fn resume_engine(state: &AppState, worker: WorkerId) -> Result<(), String> {
    let control = engine_kind(state, worker).await.control();
    call(state, worker, &control.resume()).await?;
    let url = registry::url_of(state, worker).ok_or("the worker was removed")?;
    let info = state
        .inner
        .http
        .get(format!("{url}/server_info"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok();
    let version = match info {
        Some(r) if r.status().is_success() => r
            .json::<serde_json::Value>()
            .await
            .ok()
            .and_then(|v| v["policy_version"].as_u64()),
        _ => None,
    };
    if let Some(v) = version {
        state.inner.lock_core().set_policy_version(worker, v);
        state.inner.wake_queue();
    }
    Ok(())
}

async fn call(state: &AppState, worker: WorkerId, c: &Call) -> Result<(), String> {
    let url = registry::url_of(state, worker).ok_or("the worker was removed")?;
    call_at(state, &url, c).await
}

/// One engine call to the engine at `url`.
async fn call_at(state: &AppState, url: &str, c: &Call) -> Result<(), String> {
    let response = state
        .inner
        .http
        .post(format!("{url}{}", c.path))
        .json(&c.body)
        .timeout(CALL_TIMEOUT)
        .send()
        .await
        .map_err(|e| format!("POST {}: {e}", c.path))?;
    if response.status().is_success() {
        Ok(())
    } else {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        Err(format!("POST {} answered {status}: {text}", c.path))
    }
}
