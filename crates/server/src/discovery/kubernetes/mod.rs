//! The Kubernetes source: EndpointSlices matching a label selector, watched with `kube`'s
//! watcher (a list, then a watch from its resourceVersion; a watch that ends is resumed, one
//! answered `410 Gone` lists again). Each ready endpoint is a worker at `http://IP:PORT`; what
//! its pod's annotations say ([`slices::KV_EVENTS_PORT`], [`slices::REPLAY_PORT`],
//! [`slices::DP_SIZE`], [`slices::MODEL`]) completes its registration. The kube config comes
//! from `KUBECONFIG` / `~/.kube/config` or the pod's service account (kube's own inference).

pub mod slices;

use super::backoff::Backoff;
use super::{Registration, SourceEvent};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
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

async fn annotations(
    pods: &Api<Pod>,
    pod: &(String, Option<String>),
    cache: &mut PodCache,
    timeout: Duration,
) -> BTreeMap<String, String> {
    if let Some(a) = cache.get(pod) {
        return a.clone();
    }
    match tokio::time::timeout(timeout, pods.get_opt(&pod.0)).await {
        Ok(Ok(Some(p))) => {
            if cache.len() >= POD_CACHE {
                cache.clear();
            }
            let a = p.annotations().clone();
            cache.insert(pod.clone(), a.clone());
            a
        }
        Ok(Ok(None)) => BTreeMap::new(),
        Ok(Err(e)) => {
            tracing::warn!(pod = %pod.0, "kubernetes discovery: reading the pod's annotations: {e}");
            BTreeMap::new()
        }
        Err(_) => {
            tracing::warn!(pod = %pod.0, "kubernetes discovery: the pod's annotations took over {timeout:?}");
            BTreeMap::new()
        }
    }
}

async fn registrations(
    pods: &Api<Pod>,
    namespace: &str,
    slice: &EndpointSlice,
    port_name: Option<&str>,
    cache: &mut PodCache,
    timeout: Duration,
) -> BTreeMap<String, Registration> {
    let mut out = BTreeMap::new();
    for ready in slices::ready_endpoints(namespace, slice, port_name) {
        let a = match &ready.pod {
            Some(pod) => annotations(pods, pod, cache, timeout).await,
            None => BTreeMap::new(),
        };
        let (registration, warnings) = slices::registration(&ready, &a);
        for w in warnings {
            tracing::warn!(key = %ready.key, "kubernetes discovery: annotation {w}");
        }
        out.insert(ready.key, registration);
    }
    out
}

/// Feeds `tx` from the API server until the receiver is gone.
pub(crate) async fn run(
    settings: Settings,
    reconnected: Arc<dyn Fn() + Send + Sync>,
    tx: mpsc::Sender<SourceEvent>,
) {
    let mut backoff = Backoff::new(settings.backoff_max);
    let client = loop {
        match Client::try_default().await {
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
    let mut stream = watcher::watcher(api, config).boxed();
    let port_name = settings.port_name.as_deref();
    let mut state = Slices::default();
    let mut cache = PodCache::new();
    loop {
        let item = tokio::select! {
            item = stream.next() => item,
            () = tx.closed() => return,
        };
        let event = match item {
            None => return,
            Some(Err(e)) => {
                // The watcher lists or watches again when polled next.
                tracing::warn!("kubernetes discovery: EndpointSlice watch: {e}");
                reconnected();
                tokio::time::sleep(backoff.failed()).await;
                continue;
            }
            Some(Ok(event)) => event,
        };
        backoff.succeeded();
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
