//! Shared state of the server: the routing core behind a short, await-free mutex, the worker
//! registry, the HTTP client, the tokenizer and the metrics.

use crate::config::{ServeConfig, WorkerEntry};
use crate::metrics::Metrics;
use kvrouter_core::ids::RequestId;
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::Router;
use kvrouter_core::router::{Decision, RouteError};
use kvrouter_core::time::Time;
use kvrouter_tokenizer::CachedTokenizer;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;

/// A registered worker and its event subscribers.
#[derive(Debug)]
pub(crate) struct WorkerRecord {
    pub(crate) entry: WorkerEntry,
    pub(crate) subscribers: Vec<JoinHandle<()>>,
}

impl Drop for WorkerRecord {
    fn drop(&mut self) {
        for task in &self.subscribers {
            task.abort();
        }
    }
}

/// The server's state, shared by every handler and background task.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: ServeConfig,
    pub(crate) core: Mutex<Router>,
    pub(crate) workers: Mutex<BTreeMap<WorkerId, WorkerRecord>>,
    pub(crate) next_worker: AtomicU64,
    pub(crate) next_request: AtomicU64,
    pub(crate) epoch: Instant,
    pub(crate) http: reqwest::Client,
    pub(crate) tokenizer: CachedTokenizer,
    pub(crate) tokenize_slots: Semaphore,
    pub(crate) metrics: Metrics,
    /// The libzmq context of the KV event subscribers (no I/O until a socket is made).
    pub(crate) zmq: zmq::Context,
    pub(crate) models: RwLock<Vec<String>>,
    /// Requests waiting in the router queue, by id: where to send their placement.
    pub(crate) waiters: Mutex<HashMap<RequestId, oneshot::Sender<Result<Decision, RouteError>>>>,
    /// Wakes the queue driver when load changes.
    pub(crate) queue_notify: Notify,
    /// Wakes a running weight-update cycle when a request ends (a draining worker may be idle).
    pub(crate) update_notify: Notify,
    /// Recent request timelines (`--trace-capture`).
    pub(crate) capture: Option<crate::capture::Capture>,
    /// First-N-of-M groups in flight: set to true when the group has its N samples.
    pub(crate) group_stops: Mutex<HashMap<u64, tokio::sync::watch::Sender<bool>>>,
    /// Worker health.
    pub(crate) health: crate::health::Health,
    /// Serving or draining for shutdown.
    pub(crate) lifecycle: kvrouter_http::Lifecycle,
}

impl Inner {
    /// Now, as the core counts time: microseconds since the server started.
    pub(crate) fn now(&self) -> Time {
        Time::from_micros(self.epoch.elapsed().as_micros() as u64)
    }

    /// A request's load was released: queued requests and a draining update may go on.
    pub(crate) fn load_released(&self) {
        self.queue_notify.notify_one();
        self.update_notify.notify_one();
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
        request: reqwest::RequestBuilder,
        stream: bool,
    ) -> Result<reqwest::Response, String> {
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
        match tokio::time::timeout(limit, request.send()).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(e.to_string()),
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

    pub(crate) fn lock_core(&self) -> std::sync::MutexGuard<'_, Router> {
        self.core.lock().expect("router lock")
    }
}

impl AppState {
    /// Number of registered workers.
    pub fn worker_count(&self) -> usize {
        self.inner.workers.lock().expect("workers lock").len()
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
        let router = Router::new(config.router.clone())?;
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(4096)
            .connect_timeout(config.upstream_connect_timeout)
            .build()
            .expect("HTTP client");
        let tokenizer =
            CachedTokenizer::new(config.tokenizer.clone(), config.tokenizer_cache_tokens);
        let slots = config.tokenize_concurrency.max(1);
        let models = config.model_names.clone();
        let capture =
            (config.trace_capture > 0).then(|| crate::capture::Capture::new(config.trace_capture));
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                core: Mutex::new(router),
                workers: Mutex::new(BTreeMap::new()),
                next_worker: AtomicU64::new(0),
                next_request: AtomicU64::new(1),
                epoch: Instant::now(),
                http,
                tokenizer,
                tokenize_slots: Semaphore::new(slots),
                metrics: Metrics::new(),
                zmq: zmq::Context::new(),
                models: RwLock::new(models),
                waiters: Mutex::new(HashMap::new()),
                queue_notify: Notify::new(),
                update_notify: Notify::new(),
                group_stops: Mutex::new(HashMap::new()),
                capture,
                health: crate::health::Health::default(),
                lifecycle: Default::default(),
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
