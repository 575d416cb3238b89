//! Shared state of the server: the routing core behind a short, await-free mutex, the worker
//! registry, the HTTP client, the tokenizer and the metrics.

use crate::config::{ServeConfig, WorkerEntry};
use crate::metrics::Metrics;
use axum::body::Bytes;
use kvrouter_core::ids::RequestId;
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::Router;
use kvrouter_core::router::{Decision, Effects, RouteError, UpdateAction};
use kvrouter_core::time::Time;
use kvrouter_tokenizer::CachedTokenizer;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;

/// A registered worker and its event subscribers.
#[derive(Debug)]
pub(crate) struct WorkerRecord {
    pub(crate) entry: WorkerEntry,
    pub(crate) subscribers: Vec<JoinHandle<()>>,
    /// Removed by its discovery source: out of rotation until purged (or registered again).
    pub(crate) draining: bool,
}

impl Drop for WorkerRecord {
    fn drop(&mut self) {
        for task in &self.subscribers {
            task.abort();
        }
    }
}

/// How a request's load is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// It completed.
    Finished,
    /// It was cancelled, failed, or continues in another attempt.
    Cancelled,
}

/// What a queued request's handler gets: its placement, or why it left the queue unplaced.
pub(crate) type PlacementResult = Result<Decision, RouteError>;
type Placement = oneshot::Sender<PlacementResult>;

/// The server's state, shared by every handler and background task.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: ServeConfig,
    /// The routing core. Read and change it through `lock_core`, except releases of load:
    /// those go through [`Inner::release`], which carries out their effects.
    core: Mutex<Router>,
    pub(crate) workers: Mutex<BTreeMap<WorkerId, WorkerRecord>>,
    pub(crate) next_worker: AtomicU64,
    pub(crate) next_request: AtomicU64,
    /// Makes the `x-request-id` of requests that come without one.
    pub(crate) request_ids: crate::access::RequestIds,
    pub(crate) epoch: Instant,
    pub(crate) http: reqwest::Client,
    /// Workers' answers over plain HTTP, read by the task that forwards them.
    pub(crate) upstream: Arc<crate::upstream::Client>,
    pub(crate) tokenizer: CachedTokenizer,
    pub(crate) tokenize_slots: Arc<Semaphore>,
    pub(crate) metrics: Metrics,
    /// The libzmq context of the KV event subscribers (no I/O until a socket is made).
    /// The KV event subscribers' libzmq contexts.
    pub(crate) zmq: crate::zmq_contexts::Contexts,
    pub(crate) models: RwLock<Vec<String>>,
    /// The models each worker serves (`pools.rs`): requests go to their model's pool.
    pub(crate) pools: RwLock<crate::pools::Pools>,
    /// Requests waiting in the router queue, by id: where to send their placement.
    waiters: Mutex<HashMap<RequestId, Placement>>,
    /// Wakes the queue driver when load or eligibility changes outside a release.
    queue_notify: Notify,
    /// The running weight-update cycle's driver: where the engine calls that releases ask
    /// for go. Set under the core lock when a cycle starts.
    update_actions: Mutex<Option<mpsc::UnboundedSender<Vec<UpdateAction>>>>,
    /// The engines weight updates call, and hold paused (`update_lanes.rs`).
    pub(crate) update_lanes: crate::update_lanes::UpdateLanes,
    /// Recent request timelines (`--trace-capture`).
    pub(crate) capture: Option<crate::capture::Capture>,
    /// First-N-of-M groups in flight: set to true when the group has its N samples.
    pub(crate) group_stops: Mutex<HashMap<u64, tokio::sync::watch::Sender<bool>>>,
    /// Worker health.
    pub(crate) health: crate::health::Health,
    /// Serving or draining for shutdown.
    pub(crate) lifecycle: kvrouter_http::Lifecycle,
    /// The number of registered workers, watched by readiness reports (`readiness.rs`).
    pub(crate) roster: tokio::sync::watch::Sender<usize>,
    /// Replica sync (`--replica-sync`): the publisher's wake-up, the NATS link, metrics.
    pub(crate) replica: crate::replica_state::ReplicaState,
    /// The planner's advisory mode (`--planner-advise`).
    pub(crate) planner: Option<crate::planner::Advisor>,
    /// The planner acting on Kubernetes (`--planner-act`).
    pub(crate) planner_act: Option<crate::planner_act::Actuator>,
}

impl Inner {
    /// Now, as the core counts time: microseconds since the server started.
    pub(crate) fn now(&self) -> Time {
        Time::from_micros(self.epoch.elapsed().as_micros() as u64)
    }

    /// Releases a request's load in the core (it finished, or was cancelled, failed or retired)
    /// and carries out what that set in motion: queued requests placed on the freed capacity,
    /// loads of a weight update's workers that went idle. The only place the server releases
    /// load, so no caller can forget the follow-up.
    pub(crate) fn release(&self, id: RequestId, how: Release) {
        self.release_observed(id, how, None);
    }

    /// [`Inner::release`], after telling the cost policy the request's output length
    /// (`Router::observe_output`) under the same lock, so no decision sees it learnt but not
    /// yet released.
    #[allow(clippy::disallowed_methods)] // the one place allowed to call Router::finish/cancel
    pub(crate) fn release_observed(&self, id: RequestId, how: Release, output: Option<u64>) {
        let now = self.now();
        let released = {
            let mut core = self.lock_core();
            if let Some(output) = output {
                core.observe_output(id, output, now);
            }
            match how {
                Release::Finished => core.finish(id, now),
                Release::Cancelled => core.cancel(id, now),
            }
        };
        // Unknown: released already (or never placed): nothing was freed.
        if let Ok(effects) = released {
            self.apply(effects);
        }
    }

    /// Hands a weight-update cycle's driver its next engine calls, even none: it wakes and sees
    /// whether its cycle ended (a worker left it).
    pub(crate) fn send_update_actions(&self, actions: Vec<UpdateAction>) {
        let driver = self.update_actions.lock().expect("update lock").clone();
        if let Some(tx) = driver {
            let _ = tx.send(actions);
        }
    }

    /// Carries out effects of the core: each placement goes to its waiting handler (one whose
    /// handler has gone is released again), update loads go to the cycle's driver.
    #[allow(clippy::disallowed_methods)] // releases an undeliverable placement, applying its effects
    pub(crate) fn apply(&self, effects: Effects) {
        let mut pending = vec![effects];
        // Bounded: each round releases requests the round before took out of the queue.
        while let Some(Effects { placed, update }) = pending.pop() {
            if !update.is_empty() {
                let driver = self.update_actions.lock().expect("update lock").clone();
                match driver {
                    Some(tx) if tx.send(update).is_ok() => {}
                    _ => tracing::warn!("weight update: no cycle driver for its next calls"),
                }
            }
            for (id, result) in placed {
                let waiter = self.waiters.lock().expect("waiters lock").remove(&id);
                let delivered = waiter.is_some_and(|tx| tx.send(result.clone()).is_ok());
                if !delivered && result.is_ok() {
                    let again = self.lock_core().cancel(id, self.now());
                    pending.extend(again.ok());
                }
            }
        }
    }

    /// Wakes the queue driver: load or eligibility changed outside a release (a first token, a
    /// worker back, an update's worker loaded).
    pub(crate) fn wake_queue(&self) {
        self.queue_notify.notify_one();
    }

    /// Resolves when [`Inner::wake_queue`] is called.
    pub(crate) async fn queue_woken(&self) {
        self.queue_notify.notified().await;
    }

    /// Registers the handler of request `id` before it is submitted, so a placement made by the
    /// queue driver always finds it.
    pub(crate) fn await_placement(&self, id: RequestId) -> oneshot::Receiver<PlacementResult> {
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().expect("waiters lock").insert(id, tx);
        rx
    }

    /// The handler of request `id` no longer waits for a placement (placed at once, refused,
    /// or gone). Returns whether it was still waiting.
    pub(crate) fn forget_placement(&self, id: RequestId) -> bool {
        self.waiters
            .lock()
            .expect("waiters lock")
            .remove(&id)
            .is_some()
    }

    /// Starts the driver side of a weight-update cycle: `begin` starts it in the core (under
    /// the core lock, so no release can ask for a call before the driver listens). Returns the
    /// first calls and the channel of the calls that releases ask for later.
    pub(crate) fn begin_update<E>(
        &self,
        begin: impl FnOnce(&mut Router) -> Result<Vec<UpdateAction>, E>,
    ) -> Result<
        (
            Vec<UpdateAction>,
            mpsc::UnboundedReceiver<Vec<UpdateAction>>,
        ),
        E,
    > {
        let mut core = self.lock_core();
        let first = begin(&mut core)?;
        let (tx, rx) = mpsc::unbounded_channel();
        *self.update_actions.lock().expect("update lock") = Some(tx);
        drop(core);
        Ok((first, rx))
    }

    /// A receiver that turns true when `group` has its N samples.
    pub(crate) fn group_stop(&self, group: u64) -> tokio::sync::watch::Receiver<bool> {
        let mut stops = self.group_stops.lock().expect("group stops lock");
        if stops.len() > 65_536 {
            // Groups with nobody in flight any more.
            stops.retain(|_, tx| tx.receiver_count() > 0);
        }
        stops
            .entry(group)
            .or_insert_with(|| tokio::sync::watch::channel(false).0)
            .subscribe()
    }

    /// A sample of `group` completed: if it was the N-th, the group's other requests end.
    pub(crate) fn group_sample_finished(&self, group: u64) {
        let satisfied = self.lock_core().group_sample_finished(group, self.now());
        if satisfied {
            let tx = self
                .group_stops
                .lock()
                .expect("group stops lock")
                .remove(&group);
            if let Some(tx) = tx {
                tx.send_replace(true);
            }
        }
    }

    /// Sends a request to a worker, bounding the wait for its response headers: a frozen
    /// engine accepts connections and reads requests but never answers. `stream`: the client
    /// asked for a stream (engines send a non-streamed answer's headers with the whole answer).
    pub(crate) async fn send_upstream(
        &self,
        url: &str,
        request_id: &axum::http::HeaderValue,
        body: &Bytes,
        stream: bool,
    ) -> Result<crate::upstream::Response, String> {
        let (limit, flag) = if stream {
            (
                self.config.upstream_first_byte_timeout,
                "--upstream-first-byte-timeout-secs",
            )
        } else {
            (
                self.config.upstream_response_timeout,
                "--upstream-response-timeout-secs",
            )
        };
        // Plain HTTP workers: the forwarding task reads the answer (`upstream/`); others
        // (https, or any behind a proxy set in the environment) through reqwest.
        let send = self.upstream.post(url, request_id, body);
        match tokio::time::timeout(limit, send).await {
            Ok(r) => r,
            Err(_) => {
                self.metrics
                    .upstream_timeouts
                    .inc(&[("kind", if stream { "stream" } else { "unary" })]);
                Err(format!(
                    "no response headers within {:.3}s ({flag})",
                    limit.as_secs_f64()
                ))
            }
        }
    }

    /// Places a request that continues after a failure (a retry, a migration): now, outside the
    /// router queue, on a worker it has not tried. The core's rule, which the simulator's
    /// continuations follow too.
    pub(crate) fn place_continuation(
        &self,
        request: &kvrouter_core::router::RouteRequest,
        tried: &[WorkerId],
    ) -> Result<Decision, RouteError> {
        self.lock_core()
            .route_continuation(request, tried, self.now())
    }

    /// Whether `worker` is draining for a weight update (its engine aborts requests on purpose).
    /// With replica sync, another replica's update counts too.
    pub(crate) fn draining_for_update(&self, worker: WorkerId) -> bool {
        let core = self.lock_core();
        core.update_phase(worker) == Some(kvrouter_core::router::UpdatePhase::Draining)
            || core.held_elsewhere(worker)
    }

    /// The core, locked. When the guard goes, events the core queued for the other replicas
    /// wake their publisher.
    pub(crate) fn lock_core(&self) -> CoreGuard<'_> {
        CoreGuard {
            core: self.core.lock().expect("router lock"),
            notify: &self.replica.notify,
        }
    }
}

/// The locked core (see [`Inner::lock_core`]).
pub(crate) struct CoreGuard<'a> {
    core: std::sync::MutexGuard<'a, Router>,
    notify: &'a Notify,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Router;
    fn deref(&self) -> &Router {
        &self.core
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Router {
        &mut self.core
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        if self.core.has_outgoing() {
            self.notify.notify_one();
        }
    }
}

impl AppState {
    /// Number of registered workers.
    pub fn worker_count(&self) -> usize {
        self.inner.workers.lock().expect("workers lock").len()
    }

    /// The registered workers' entries as registered (with what `/server_info` advertised
    /// filled in), by id.
    pub fn worker_entries(&self) -> Vec<WorkerEntry> {
        let workers = self.inner.workers.lock().expect("workers lock");
        workers.values().map(|r| r.entry.clone()).collect()
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &ServeConfig {
        &self.inner.config
    }

    /// The model names served (`--model-name`, or learned from the first worker).
    pub fn model_names(&self) -> Vec<String> {
        self.inner.models.read().expect("models lock").clone()
    }

    /// Blocks the index believes `worker` holds on its GPU, over all its ranks.
    pub fn cached_gpu_blocks(&self, worker: WorkerId) -> usize {
        self.inner
            .lock_core()
            .index()
            .holder_counts()
            .iter()
            .filter(|(r, m, _)| r.worker == worker && *m == kvrouter_core::event::Medium::Gpu)
            .map(|(_, _, n)| n)
            .sum()
    }

    /// State for `config`, with no workers yet. Does no I/O.
    pub fn new(config: ServeConfig) -> Result<Self, kvrouter_core::router::ConfigError> {
        let mut router = Router::new(config.router.clone())?;
        if let Some(sync) = &config.replica_sync {
            router.enable_replica_sync(
                kvrouter_core::ids::ReplicaId(sync.replica_id),
                sync.outbox_max_events,
            );
            router.set_active_list_max(sync.active_list_max);
        }
        let replica = crate::replica_state::ReplicaState::new(config.replica_sync.as_ref());
        let metrics = Metrics::new(config.router.router_mode.as_str());
        // Both talk to workers only (probes, `/server_info`, control calls; requests), so both
        // carry the workers' key.
        let worker_auth = crate::upstream::bearer(config.worker_api_key.as_deref());
        let http = reqwest::Client::builder()
            .default_headers(crate::upstream::authorization_headers(worker_auth.as_ref()))
            .tcp_nodelay(true)
            .pool_max_idle_per_host(4096)
            .connect_timeout(config.upstream_connect_timeout)
            .build()
            .expect("HTTP client");
        let upstream = crate::upstream::Client::with_authorization(
            config.upstream_connect_timeout,
            crate::upstream::proxy_in_environment(),
            worker_auth,
        );
        let tokenizer =
            CachedTokenizer::new(config.tokenizer.clone(), config.tokenizer_cache_tokens);
        let slots = config.tokenize_concurrency.max(1);
        let models = config.model_names.clone();
        let capture =
            (config.trace_capture > 0).then(|| crate::capture::Capture::new(config.trace_capture));
        let planner = match &config.planner {
            Some(p) => Some(crate::planner::Advisor::new(p.clone())?),
            None => None,
        };
        let planner_act = config
            .planner_act
            .clone()
            .map(crate::planner_act::Actuator::new);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                core: Mutex::new(router),
                workers: Mutex::new(BTreeMap::new()),
                next_worker: AtomicU64::new(0),
                next_request: AtomicU64::new(1),
                request_ids: crate::access::RequestIds::new(),
                epoch: Instant::now(),
                http,
                upstream,
                tokenizer,
                tokenize_slots: Arc::new(Semaphore::new(slots)),
                metrics,
                zmq: crate::zmq_contexts::Contexts::default(),
                models: RwLock::new(models),
                pools: RwLock::default(),
                waiters: Mutex::new(HashMap::new()),
                queue_notify: Notify::new(),
                update_actions: Mutex::new(None),
                update_lanes: Default::default(),
                group_stops: Mutex::new(HashMap::new()),
                capture,
                health: crate::health::Health::default(),
                lifecycle: Default::default(),
                roster: tokio::sync::watch::channel(0).0,
                replica,
                planner,
                planner_act,
            }),
        })
    }
}

/// Resolves when `stop` turns true (never without one).
pub(crate) async fn stopped(stop: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    let Some(rx) = stop else {
        return std::future::pending().await;
    };
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            if *rx.borrow() {
                return;
            }
            return std::future::pending().await;
        }
    }
}

mod health;
#[cfg(test)]
mod tests;
