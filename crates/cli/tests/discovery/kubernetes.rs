//! `kvrouter serve --discovery kubernetes` against a fake API server (no cluster here): it
//! serves recorded EndpointSlice list and watch answers (the real `discovery.k8s.io/v1` shape,
//! JSON lines for watches) and pods with kvrouter's annotations. Scripted, step by step: the
//! first watch takes a pod's endpoint away mid-stream and ends (the client must watch again from
//! the last resourceVersion); the second answers `410 Gone` (the client must list again).

use super::{complete, poll, state_is, worker, TOKEN};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

const NS: &str = "test";

/// The engines behind the pods: (HTTP port, KV events port).
type Engines = [(u16, u16); 2];

struct Fake {
    engines: Engines,
    /// The test's script: each watch waits for its step.
    step: watch::Receiver<u32>,
    /// Query strings of every list and watch request, in order.
    requests: Mutex<Vec<HashMap<String, String>>>,
}

/// An EndpointSlice of one pod (`pod-N` at 127.0.0.1 on its engine's port).
fn slice(f: &Fake, n: usize, ready: bool, rv: &str) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("vllm-{n}"), "namespace": NS, "resourceVersion": rv,
            "labels": {"app": "vllm", "kubernetes.io/service-name": "vllm"},
        },
        "addressType": "IPv4",
        "endpoints": [{
            "addresses": ["127.0.0.1"],
            "conditions": {"ready": ready, "serving": ready, "terminating": !ready},
            "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("pod-{n}"), "uid": format!("uid-{n}")},
        }],
        "ports": [{"name": "http", "port": f.engines[n].0, "protocol": "TCP"}],
    })
}

async fn slices(State(f): State<Arc<Fake>>, Query(q): Query<HashMap<String, String>>) -> Response {
    assert_eq!(
        q.get("labelSelector").map(String::as_str),
        Some("app=vllm"),
        "the selector is sent"
    );
    let watches = {
        let mut r = f.requests.lock().unwrap();
        r.push(q.clone());
        r.iter()
            .filter(|q| q.get("watch").is_some_and(|w| w == "true"))
            .count()
    };
    if q.get("watch").is_none_or(|w| w != "true") {
        let list = json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": "100"},
            "items": [slice(&f, 0, true, "90"), slice(&f, 1, true, "91")],
        });
        return Json(list).into_response();
    }
    let mut step = f.step.clone();
    let line = match watches {
        // Pod 1's endpoint is no longer ready; then the watch ends.
        1 => json!({"type": "MODIFIED", "object": slice(&f, 1, false, "101")}),
        // Too old: the client must list again.
        2 => json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version: 101 (150)", "reason": "Expired", "code": 410,
        }}),
        // Open and quiet until the test ends.
        _ => {
            return Response::new(Body::from_stream(futures::stream::pending::<
                Result<Bytes, std::io::Error>,
            >()))
        }
    };
    let wanted = u32::try_from(watches).unwrap();
    let body = futures::stream::once(async move {
        let _ = step.wait_for(|s| *s >= wanted).await;
        Ok::<_, std::io::Error>(Bytes::from(format!("{line}\n")))
    });
    Response::new(Body::from_stream(body))
}

async fn pod(State(f): State<Arc<Fake>>, Path(name): Path<String>) -> Json<Value> {
    let n: usize = name.trim_start_matches("pod-").parse().unwrap();
    Json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NS, "uid": format!("uid-{n}"),
            "annotations": {
                "kvrouter.io/kv-events-port": f.engines[n].1.to_string(),
                "kvrouter.io/dp-size": "1",
                "kvrouter.io/model": "mock-model",
                "kvrouter.io/profile": "dynamo-poly",
            },
        },
    }))
}

/// Serves the fake API on a free loopback port; returns its URL.
async fn serve(fake: Arc<Fake>) -> String {
    let app = axum::Router::new()
        .route(
            &format!("/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"),
            get(slices),
        )
        .route(&format!("/api/v1/namespaces/{NS}/pods/{{name}}"), get(pod))
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

pub(super) fn kubeconfig(server: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "kvrouter-kubeconfig-{}-{}",
        std::process::id(),
        server.rsplit(':').next().unwrap()
    ));
    let config = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {server}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {NS}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
    );
    std::fs::write(&path, config).unwrap();
    path
}

/// `kvrouter serve --discovery kubernetes` for the pods labelled `app=vllm` (port `http`) of the
/// API server `kubeconfig` names, with `extra` flags.
pub(super) async fn router(kubeconfig: &std::path::Path, extra: &[&str]) -> crate::common::Proc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--discovery",
        "kubernetes",
        "--selector",
        "app=vllm",
        "--port-name",
        "http",
        "--admin-token",
        TOKEN,
        "--health-check-interval-secs",
        "0",
    ];
    args.extend(extra);
    crate::common::spawn_with_env(&args, &[("KUBECONFIG", kubeconfig.to_str().unwrap())]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_slices_add_drain_and_bring_back_workers_across_watch_ends_and_relists() {
    let ports = [
        (super::free_port(), super::free_port()),
        (super::free_port(), super::free_port()),
    ];
    let mut engines = Vec::new();
    for (http, events) in ports {
        let (http, events) = (http.to_string(), format!("tcp://127.0.0.1:{events}"));
        engines.push(
            crate::common::spawn(&[
                "mock-engine",
                "--port",
                &http,
                "--kv-events-endpoint",
                &events,
                "--block-size",
                "16",
                "--speedup-ratio",
                "50",
            ])
            .await,
        );
    }
    let (step_tx, step) = watch::channel(0);
    let fake = Arc::new(Fake {
        engines: ports,
        step,
        requests: Mutex::new(Vec::new()),
    });
    let api = serve(fake.clone()).await;
    let config = kubeconfig(&api);
    let router = router(
        &config,
        &[
            "--router-mode",
            "round-robin",
            "--kv-cache-block-size",
            "16",
            "--model-name",
            "mock-model",
        ],
    )
    .await;
    let base = router.http();
    let http = reqwest::Client::new();
    let urls: Vec<String> = engines.iter().map(crate::common::Proc::http).collect();
    for url in &urls {
        poll("both pods discovered", Duration::from_secs(10), || {
            state_is(&http, &base, url, "serving")
        })
        .await;
    }
    let list: Value = http
        .get(format!("{base}/admin/workers"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let w1 = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == urls[1])
        .unwrap()
        .clone();
    assert_eq!(
        w1["kv_events_endpoint"],
        format!("tcp://127.0.0.1:{}", ports[1].1),
        "from the pod's annotation"
    );
    assert_eq!(w1["labels"]["discovery_key"], "test/pod-1");
    assert_eq!(w1["profile"], "dynamo-poly", "from the pod's annotation");
    let (id0, id1) = (
        worker(&http, &base, &urls[0]).await.unwrap().0,
        worker(&http, &base, &urls[1]).await.unwrap().0,
    );

    // Mid-stream, pod 1's endpoint goes; then the watch ends.
    step_tx.send(1).unwrap();
    poll("pod 1 drained", Duration::from_secs(5), || {
        state_is(&http, &base, &urls[1], "leaving")
    })
    .await;
    for i in 0..4 {
        assert_eq!(
            complete(&http, &base, &format!("k8s {i}")).await,
            id0,
            "only pod 0 gets requests"
        );
    }
    // The client watched again from the last resourceVersion it saw.
    poll("a second watch", Duration::from_secs(10), || async {
        fake.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|q| q.contains_key("watch"))
            .count()
            >= 2
    })
    .await;
    let second = fake
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|q| q.contains_key("watch"))
        .nth(1)
        .cloned()
        .unwrap();
    assert_eq!(
        second.get("resourceVersion").map(String::as_str),
        Some("101"),
        "resumed where the first ended"
    );

    // 410 Gone: listed again, where pod 1 is ready: back in rotation.
    step_tx.send(2).unwrap();
    poll(
        "pod 1 back after the re-list",
        Duration::from_secs(10),
        || state_is(&http, &base, &urls[1], "serving"),
    )
    .await;
    let lists = fake
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|q| !q.contains_key("watch"))
        .count();
    assert!(lists >= 2, "listed again after 410 Gone ({lists} lists)");
    let mut on1 = false;
    for i in 0..4 {
        on1 |= complete(&http, &base, &format!("k8s again {i}")).await == id1;
    }
    assert!(on1, "pod 1 gets requests again");
    let _ = std::fs::remove_file(config);
}
