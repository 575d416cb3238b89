//! `kvrouter serve --discovery kubernetes` against a fake API server that misbehaves the ways
//! real ones (and proxies before them) do: a list that fails every time is retried with the
//! documented doubling backoff, not every 0.1 s; a list that is taken and never answered fails
//! after `--discovery-call-timeout-ms` instead of kube's 295 s, and so does a watch refused with
//! a body that stalls; watches that end at once are started again at most once a second; a
//! watch refused with the HTTP status 410 lists again.

use super::{poll, state_is};
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use futures::StreamExt;
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const NS: &str = "test";

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Every list answers 500.
    ListFails,
    /// The first list is taken and never answered; the rest are answered.
    FirstListHangs,
    /// Lists are answered; every watch answers 200 and ends at once, with no event.
    WatchEndsAtOnce,
    /// Lists are answered; the first watch answers 503, sends a few bytes and stalls.
    WatchRefusedThenStalls,
    /// Lists are answered; every watch is refused with the HTTP status `410 Gone`.
    WatchGoneStatus,
}

struct Fake {
    fault: Fault,
    engine_port: u16,
    lists: AtomicUsize,
    watches: AtomicUsize,
}

async fn slices(State(f): State<Arc<Fake>>, Query(q): Query<HashMap<String, String>>) -> Response {
    if q.get("watch").is_some_and(|w| w == "true") {
        let n = f.watches.fetch_add(1, Ordering::SeqCst);
        if f.fault == Fault::WatchEndsAtOnce {
            return Response::new(Body::empty());
        }
        if f.fault == Fault::WatchGoneStatus {
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "reason": "Expired", "code": 410,
                "message": "too old resource version"});
            return (StatusCode::GONE, Json(status)).into_response();
        }
        if f.fault == Fault::WatchRefusedThenStalls && n == 0 {
            let stalled = futures::stream::once(async { Ok(Bytes::from_static(b"{\"ki")) })
                .chain(futures::stream::pending::<Result<Bytes, std::io::Error>>());
            let mut r = Response::new(Body::from_stream(stalled));
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            return r;
        }
        return Response::new(Body::from_stream(futures::stream::pending::<
            Result<Bytes, std::io::Error>,
        >()));
    }
    let n = f.lists.fetch_add(1, Ordering::SeqCst);
    match f.fault {
        Fault::ListFails => return (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response(),
        Fault::FirstListHangs if n == 0 => std::future::pending::<()>().await,
        _ => {}
    }
    Json(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
        "metadata": {"resourceVersion": "100"},
        "items": [{
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "vllm-0", "namespace": NS, "resourceVersion": "90",
                         "labels": {"app": "vllm"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": f.engine_port, "protocol": "TCP"}],
        }],
    }))
    .into_response()
}

/// The fake API and a router watching it (its URL, the fake, the processes to keep alive).
async fn start(
    fault: Fault,
    extra: &[&str],
) -> (String, Arc<Fake>, Vec<crate::common::Proc>, String) {
    let engine = crate::common::spawn(&["mock-engine", "--port", "0"]).await;
    let engine_url = engine.http();
    let engine_port = engine_url.rsplit(':').next().unwrap().parse().unwrap();
    let fake = Arc::new(Fake {
        fault,
        engine_port,
        lists: AtomicUsize::new(0),
        watches: AtomicUsize::new(0),
    });
    let app = axum::Router::new()
        .route(
            &format!("/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"),
            get(slices),
        )
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = super::kubernetes::kubeconfig(&api);
    let router = super::kubernetes::router(&config, extra).await;
    let base = router.http();
    (base, fake, vec![engine, router], engine_url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_failing_every_time_is_retried_with_a_doubling_backoff() {
    let (_base, fake, _procs, _) = start(Fault::ListFails, &[]).await;
    poll("a first list", Duration::from_secs(10), || async {
        fake.lists.load(Ordering::SeqCst) >= 1
    })
    .await;
    let first = fake.lists.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // 0.1, 0.2, 0.4, 0.8, 1.6 s: about five more in 3 s (it was one every 0.1 s: ~30).
    let more = fake.lists.load(Ordering::SeqCst) - first;
    assert!((2..=8).contains(&more), "{more} lists in 3 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_never_answered_fails_after_the_call_timeout() {
    let (base, fake, _procs, engine) = start(
        Fault::FirstListHangs,
        &["--discovery-call-timeout-ms", "500"],
    )
    .await;
    let http = reqwest::Client::new();
    // kube alone waited 295 s on the first list.
    poll(
        "the worker, after a second list",
        Duration::from_secs(10),
        || state_is(&http, &base, &engine, "serving"),
    )
    .await;
    assert!(fake.lists.load(Ordering::SeqCst) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_that_end_at_once_are_started_again_at_most_once_a_second() {
    let (base, fake, _procs, engine) = start(Fault::WatchEndsAtOnce, &[]).await;
    let http = reqwest::Client::new();
    poll("the worker", Duration::from_secs(10), || {
        state_is(&http, &base, &engine, "serving")
    })
    .await;
    let first = fake.watches.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let more = fake.watches.load(Ordering::SeqCst) - first;
    // One a second (it was as fast as the server answered: ~40 a second here).
    assert!(more <= 5, "{more} watches in 3 s");
    assert!(more >= 1, "it keeps watching");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_refused_with_a_stalled_body_is_given_up_after_the_call_timeout() {
    let (_base, fake, _procs, _) = start(
        Fault::WatchRefusedThenStalls,
        &["--discovery-call-timeout-ms", "500"],
    )
    .await;
    // The 503's body pauses past the call timeout: the watch fails and another is started (it
    // waited on kube's 295 s read timeout, with every change unseen).
    poll("a second watch", Duration::from_secs(10), || async {
        fake.watches.load(Ordering::SeqCst) >= 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_refused_with_the_status_410_lists_again() {
    let (_base, fake, _procs, _) = start(Fault::WatchGoneStatus, &[]).await;
    // kube's watcher asked again from the same expired resourceVersion for ever.
    poll("a second list", Duration::from_secs(10), || async {
        fake.lists.load(Ordering::SeqCst) >= 2
    })
    .await;
}
