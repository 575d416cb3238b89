//! The gRPC health service on the ext_proc port (`grpc.health.v1.Health`): `SERVING` with
//! workers, `NOT_SERVING` without or while draining after SIGTERM (the port still answers), and
//! `NOT_FOUND` for a service it does not know.

use super::{
    connect, destination, request_body, request_headers, response_body, response_headers, Envoy,
    BUFFERED, SSE,
};
use std::time::Duration;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const EXT_PROC: &str = kvrouter_ext_proc::EXT_PROC_SERVICE;

async fn health(grpc: &str) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}"))
        .expect("a URI")
        .connect()
        .await
        .expect("connect");
    HealthClient::new(channel)
}

async fn check(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
) -> Result<ServingStatus, Code> {
    let request = HealthCheckRequest {
        service: service.to_owned(),
    };
    let answer = tokio::time::timeout(Duration::from_secs(20), client.check(request))
        .await
        .expect("a health answer in time");
    answer
        .map(|r| r.into_inner().status())
        .map_err(|s| s.code())
}

/// The statuses `Watch` sends for `service`.
async fn watch(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let request = HealthCheckRequest {
        service: service.to_owned(),
    };
    client.watch(request).await.expect("watch").into_inner()
}

async fn next(
    watching: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
) -> ServingStatus {
    tokio::time::timeout(Duration::from_secs(20), watching.message())
        .await
        .expect("a status in time")
        .expect("no stream error")
        .expect("a status")
        .status()
}

#[tokio::test]
async fn health_follows_the_workers_and_an_unknown_service_is_not_found() {
    let engine = crate::common::spawn(&["mock-engine", "--port", "0"]).await;
    let url = engine.http();
    let p = crate::common::spawn(&[
        "serve",
        "--port",
        "0",
        "--ext-proc-port",
        "0",
        "--worker",
        &url,
        "--admin-token",
        "t",
    ])
    .await;
    let (base, grpc) = (p.http(), p.field("ext_proc"));
    let mut client = health(&grpc).await;
    for name in ["", EXT_PROC] {
        assert_eq!(check(&mut client, name).await, Ok(ServingStatus::Serving));
    }
    assert_eq!(
        check(&mut client, "grpc.some.Other").await,
        Err(Code::NotFound)
    );
    let mut watching = watch(&mut client, EXT_PROC).await;
    assert_eq!(next(&mut watching).await, ServingStatus::Serving);
    let admin = reqwest::Client::new();
    let other = crate::common::spawn(&["mock-engine", "--port", "0"]).await;
    let add = |url: String| {
        let req = admin
            .post(format!("{base}/admin/workers"))
            .bearer_auth("t")
            .json(&serde_json::json!({ "url": url }));
        async move {
            let r = req.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 201);
            r.json::<serde_json::Value>().await.unwrap()["id"]
                .as_u64()
                .unwrap()
        }
    };
    let remove = |id: u64| {
        let req = admin
            .delete(format!("{base}/admin/workers/{id}"))
            .bearer_auth("t");
        async move {
            let r = req.send().await.unwrap();
            assert!(r.status().is_success(), "{}", r.status());
        }
    };
    // A second worker comes, the first leaves: still serving, and watchers hear nothing.
    let second = add(other.http()).await;
    remove(0).await;
    assert_eq!(check(&mut client, "").await, Ok(ServingStatus::Serving));
    // The last worker leaves: not serving (the next status watchers hear).
    remove(second).await;
    assert_eq!(next(&mut watching).await, ServingStatus::NotServing);
    for name in ["", EXT_PROC] {
        assert_eq!(
            check(&mut client, name).await,
            Ok(ServingStatus::NotServing)
        );
    }
    // One comes back: serving again.
    add(url).await;
    assert_eq!(next(&mut watching).await, ServingStatus::Serving);
    assert_eq!(check(&mut client, "").await, Ok(ServingStatus::Serving));
}

#[tokio::test]
async fn sigterm_turns_health_not_serving_while_a_stream_in_flight_drains() {
    let (mut p, _base, grpc) = super::picker("1", &["--shutdown-grace-secs", "120"]).await;
    let mut client = health(&grpc).await;
    for name in ["", EXT_PROC] {
        assert_eq!(check(&mut client, name).await, Ok(ServingStatus::Serving));
    }
    assert_eq!(check(&mut client, "nope").await, Err(Code::NotFound));
    let mut watching = watch(&mut client, "").await;
    assert_eq!(next(&mut watching).await, ServingStatus::Serving);
    // A request in flight through the gateway: placed, its answer begun.
    let mut picker = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut picker).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy
        .send(request_body(&super::completion(0, 0), true))
        .await;
    assert!(destination(&envoy.recv().await).0.is_some());
    envoy.send(response_headers(200)).await;
    envoy.recv().await;

    p.signal("-TERM");
    assert_eq!(next(&mut watching).await, ServingStatus::NotServing);
    // The port still answers while it drains, on new connections too.
    let mut fresh = health(&grpc).await;
    for name in ["", EXT_PROC] {
        assert_eq!(check(&mut fresh, name).await, Ok(ServingStatus::NotServing));
    }
    assert_eq!(check(&mut fresh, "nope").await, Err(Code::NotFound));
    // New requests are refused (the gateway's failure mode applies) ...
    let (_tx, rx) = tokio::sync::mpsc::channel::<
        kvrouter_ext_proc::pb::envoy::service::ext_proc::v3::ProcessingRequest,
    >(1);
    let refused = picker
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map(|_| ())
        .map_err(|s| s.code());
    assert_eq!(refused, Err(Code::Unavailable));
    // ... while the one in flight goes on to its end, which ends the drain.
    for (i, chunk) in SSE.iter().enumerate() {
        envoy.send(response_body(chunk, i == SSE.len() - 1)).await;
        envoy.recv().await;
    }
    drop(envoy);
    let exited = tokio::time::timeout(Duration::from_secs(30), p.child.wait())
        .await
        .expect("the drain ends with the last stream, long before the grace period")
        .expect("waitable");
    assert!(exited.success(), "{exited:?}");
}

#[tokio::test]
async fn a_stream_that_outlasts_the_grace_period_is_ended_unavailable() {
    let (mut p, _base, grpc) = super::picker("1", &["--shutdown-grace-secs", "1"]).await;
    let mut picker = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut picker).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy
        .send(request_body(&super::completion(1, 0), true))
        .await;
    assert!(destination(&envoy.recv().await).0.is_some());
    p.signal("-TERM");
    let ended = tokio::time::timeout(Duration::from_secs(20), envoy.rx.message())
        .await
        .expect("the stream ends in time");
    assert_eq!(ended.map_err(|s| s.code()).err(), Some(Code::Unavailable));
    let exited = tokio::time::timeout(Duration::from_secs(20), p.child.wait())
        .await
        .expect("the process exits after the grace period")
        .expect("waitable");
    assert!(exited.success(), "{exited:?}");
}

/// With nothing in flight the drain is over at once, and a watcher still hears `NOT_SERVING`
/// before its call ends `UNAVAILABLE` (found by probing: its call was reset, and it never
/// heard the status the docs promise).
#[tokio::test]
async fn a_watcher_hears_not_serving_when_a_drain_with_nothing_in_flight_ends_at_once() {
    let (mut p, _base, grpc) = super::picker("1", &[]).await;
    let mut client = health(&grpc).await;
    let mut watching = watch(&mut client, EXT_PROC).await;
    assert_eq!(next(&mut watching).await, ServingStatus::Serving);
    p.signal("-TERM");
    assert_eq!(next(&mut watching).await, ServingStatus::NotServing);
    let end = tokio::time::timeout(Duration::from_secs(20), watching.message())
        .await
        .expect("the call ends in time");
    assert_eq!(
        end.map(|_| ()).map_err(|s| s.code()),
        Err(Code::Unavailable)
    );
    let exited = tokio::time::timeout(Duration::from_secs(30), p.child.wait())
        .await
        .expect("exits")
        .expect("waitable");
    assert!(exited.success(), "{exited:?}");
}
