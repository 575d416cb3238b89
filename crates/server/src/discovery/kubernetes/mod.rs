//! The Kubernetes source: EndpointSlices matching a label selector, watched with `kube`'s
//! watcher (a list, then a watch from its resourceVersion; a watch that ends is resumed, one
//! answered `410 Gone` lists again). Each ready endpoint is a worker at `http://IP:PORT`; what
//! its pod's annotations say ([`slices::KV_EVENTS_PORT`], [`slices::REPLAY_PORT`],
//! [`slices::DP_SIZE`], [`slices::MODEL`]) completes its registration. The kube config comes
//! from `KUBECONFIG` / `~/.kube/config` or the pod's service account (kube's own inference).

mod client;
pub mod slices;

use super::backoff::Backoff;
use super::{Registration, SourceEvent};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use slices::Slices;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Pods whose annotations are kept (the cache is emptied at each list, and when full).
const POD_CACHE: usize = 65_536;

/// What the source needs besides the channel.
pub(crate) struct Settings {
    pub(crate) selector: String,
    pub(crate) namespace: Option<String>,
    pub(crate) port_name: Option<String>,
    pub(crate) backoff_max: Duration,
    /// The longest wait for a pod's annotations (`--discovery-call-timeout-ms`).
    pub(crate) call_timeout: Duration,
}

/// Annotations of pods by (name, uid).
type PodCache = HashMap<(String, Option<String>), BTreeMap<String, String>>;

/// Pods whose annotations are read at once.
const POD_READS_AT_ONCE: usize = 16;

/// A pod's annotations, read from the API (`None`: not read; warned).
async fn read_annotations(
    pods: &Api<Pod>,
    pod: &(String, Option<String>),
    timeout: Duration,
) -> Option<BTreeMap<String, String>> {
    match tokio::time::timeout(timeout, pods.get_opt(&pod.0)).await {
        Ok(Ok(Some(p))) => Some(p.annotations().clone()),
        Ok(Ok(None)) => Some(BTreeMap::new()),
        Ok(Err(e)) => {
            tracing::warn!(pod = %pod.0, "kubernetes discovery: reading the pod's annotations: {e}");
            None
        }
        Err(_) => {
            tracing::warn!(pod = %pod.0, "kubernetes discovery: the pod's annotations took over {timeout:?}");
            None
        }
    }
}

/// The registrations of `slice`'s ready endpoints. The annotations of pods not in the cache are
/// read [`POD_READS_AT_ONCE`] at a time: one after another, a slice of 100 pods whose reads hang
/// took 100 call timeouts, and held every change of the slice (a removal too) that long. A read
/// that fails leaves the pod without annotations until a later event reads it again.
async fn registrations(
    pods: &Api<Pod>,
    namespace: &str,
    slice: &EndpointSlice,
    port_name: Option<&str>,
    cache: &mut PodCache,
    timeout: Duration,
) -> BTreeMap<String, Registration> {
    let ready = slices::ready_endpoints(namespace, slice, port_name);
    // Collected first: a lazy iterator of closures over `ready` and `cache` held across the
    // awaits below would make the task's future not `Send` for every lifetime.
    let unread: Vec<_> = ready
        .iter()
        .filter_map(|r| r.pod.clone())
        .filter(|p| !cache.contains_key(p))
        .collect();
    let reads: Vec<_> = unread
        .into_iter()
        .map(|pod| {
            let pods = pods.clone();
            async move {
                let a = read_annotations(&pods, &pod, timeout).await;
                a.map(|a| (pod, a))
            }
        })
        .collect();
    let read: HashMap<_, _> = futures::stream::iter(reads)
        .buffer_unordered(POD_READS_AT_ONCE)
        .filter_map(std::future::ready)
        .collect()
        .await;
    let mut out = BTreeMap::new();
    for ready in ready {
        let a = ready
            .pod
            .as_ref()
            .and_then(|p| read.get(p).or_else(|| cache.get(p)));
        let (registration, warnings) = slices::registration(&ready, a.unwrap_or(&BTreeMap::new()));
        for w in warnings {
            tracing::warn!(key = %ready.key, "kubernetes discovery: annotation {w}");
        }
        out.insert(ready.key, registration);
    }
    for (pod, a) in read {
        if cache.len() >= POD_CACHE {
            cache.clear();
        }
        cache.insert(pod, a);
    }
    out
}

/// Whether a watch was refused with `410 Gone`: its resourceVersion expired.
fn gone(e: &watcher::Error) -> bool {
    use watcher::Error::{WatchFailed, WatchStartFailed};
    // kube reads a refused watch's Status body as an item of its stream (`WatchFailed`).
    matches!(e, WatchStartFailed(kube::Error::Api(r)) | WatchFailed(kube::Error::Api(r)) if r.code == 410)
}

/// Feeds `tx` from the API server until the receiver is gone.
pub(crate) async fn run(
    settings: Settings,
    reconnected: Arc<dyn Fn() + Send + Sync>,
    tx: mpsc::Sender<SourceEvent>,
) {
    let mut backoff = Backoff::new(settings.backoff_max);
    let client = loop {
        match client::client(settings.call_timeout).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!("kubernetes discovery: no usable kube config: {e}");
                tokio::time::sleep(backoff.failed()).await;
            }
        }
    };
    let namespace = settings
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let config = watcher::Config::default().labels(&settings.selector);
    let mut stream = watcher::watcher(api.clone(), config.clone()).boxed();
    let port_name = settings.port_name.as_deref();
    let mut state = Slices::default();
    let mut cache = PodCache::new();
    let mut last_error = tokio::time::Instant::now();
    loop {
        let item = tokio::select! {
            item = stream.next() => item,
            () = tx.closed() => return,
        };
        let event = match item {
            None => return,
            Some(Err(e)) => {
                // The watcher lists or watches again when polled next; but a watch refused with
                // `410 Gone` as its HTTP status (an API server or proxy that answers so, not
                // with an ERROR event) it would ask again from the same expired
                // resourceVersion for ever: a new watcher lists first.
                if gone(&e) {
                    stream = watcher::watcher(api.clone(), config.clone()).boxed();
                }
                tracing::warn!("kubernetes discovery: EndpointSlice watch: {e}");
                reconnected();
                backoff.ran(last_error.elapsed());
                tokio::time::sleep(backoff.failed()).await;
                last_error = tokio::time::Instant::now();
                continue;
            }
            Some(Ok(event)) => event,
        };
        // The watch works again once it delivers a change, or has run `Backoff::WORKED` without
        // an error (as the etcd source counts it). A list's events prove nothing: `Init` comes
        // before the list is even asked for, and a list whose later page fails, or whose watch
        // is refused every time, succeeds in part on every try (each was retried every 0.1 s,
        // every pod read again).
        if matches!(event, Event::Apply(_) | Event::Delete(_)) {
            backoff.succeeded();
        }
        let events = match event {
            Event::Init => {
                cache.clear();
                state.list_begin();
                vec![]
            }
            Event::InitApply(s) => {
                let r = registrations(
                    &pods,
                    &namespace,
                    &s,
                    port_name,
                    &mut cache,
                    settings.call_timeout,
                )
                .await;
                state.list_item(&s.name_any(), r);
                vec![]
            }
            Event::InitDone => vec![state.list_done()],
            Event::Apply(s) => {
                let r = registrations(
                    &pods,
                    &namespace,
                    &s,
                    port_name,
                    &mut cache,
                    settings.call_timeout,
                )
                .await;
                state.apply(&s.name_any(), r)
            }
            Event::Delete(s) => state.delete(&s.name_any()),
        };
        for e in events {
            if tx.send(e).await.is_err() {
                return;
            }
        }
    }
}
