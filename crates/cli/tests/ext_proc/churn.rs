//! Many gateway requests over two shared (multiplexed) connections, each ended at a different
//! point: the gateway going away after the headers' answer, after the placement, after the
//! response headers, mid-answer, or the answer completed. Every placement's load is released,
//! and the completed ones are counted finished.

use super::{
    await_metric, completion, connect, destination, metrics, request_body, request_headers,
    response_body, response_headers, sum, Envoy, ACTIVE, BUFFERED, SSE,
};
use std::time::Duration;

/// Requests, and how many run at once.
const REQUESTS: u64 = 240;
const AT_ONCE: usize = 32;

/// Where request `i` is ended: 0 after the headers' answer, 1 after the placement, 2 after the
/// response headers, 3 after the first body chunk, 4 completed.
fn stop_of(i: u64) -> u64 {
    // A fixed permutation, so neighbours (which run together) end at different points.
    (i * 7 + i / 5) % 5
}

async fn one(mut client: super::Client, i: u64) {
    let stop = stop_of(i);
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    if stop == 0 {
        return;
    }
    envoy.send(request_body(&completion(i, i % 3), true)).await;
    assert!(
        destination(&envoy.recv().await).0.is_some(),
        "request {i} placed"
    );
    if stop == 1 {
        return;
    }
    envoy.send(response_headers(200)).await;
    envoy.recv().await;
    if stop == 2 {
        return;
    }
    envoy.send(response_body(SSE[0], false)).await;
    envoy.recv().await;
    if stop == 3 {
        return;
    }
    for (k, chunk) in SSE.iter().enumerate().skip(1) {
        envoy.send(response_body(chunk, k == SSE.len() - 1)).await;
        envoy.recv().await;
    }
    let end = tokio::time::timeout(Duration::from_secs(20), envoy.rx.message()).await;
    assert!(matches!(end, Ok(Ok(None))), "request {i}: {end:?}");
}

#[tokio::test]
async fn requests_ended_at_every_point_over_shared_connections_release_their_load() {
    let (_p, base, grpc) = super::picker("2", &[]).await;
    let clients = [connect(&grpc).await, connect(&grpc).await];
    let mut running = tokio::task::JoinSet::new();
    for i in 0..REQUESTS {
        if running.len() == AT_ONCE {
            running
                .join_next()
                .await
                .expect("a task")
                .expect("no panic");
        }
        running.spawn(one(clients[(i % 2) as usize].clone(), i));
    }
    tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(r) = running.join_next().await {
            r.expect("no panic");
        }
    })
    .await
    .expect("every request in time");
    await_metric(&base, ACTIVE, 0.0).await;
    let completed = (0..REQUESTS).filter(|&i| stop_of(i) == 4).count() as f64;
    let m = metrics(&base).await;
    assert_eq!(
        sum(
            &m,
            "kvrouter_picks_total{source=\"ext_proc\",end=\"finished\"}"
        ),
        completed
    );
    let given_up = (0..REQUESTS)
        .filter(|&i| (1..=3).contains(&stop_of(i)))
        .count() as f64;
    assert_eq!(
        sum(
            &m,
            "kvrouter_picks_total{source=\"ext_proc\",end=\"cancelled\"}"
        ),
        given_up
    );
    assert_eq!(sum(&m, ACTIVE), 0.0);
}
