//! Replica sync through a NATS outage: the gauge, a replica that starts before JetStream, and
//! the state changed while NATS was away or lost with a restarted server.

use super::{
    assert_sessions_kept, bind_sessions, common, connected, engines, joined, metric, nats, replica,
    worker, ROUND_ROBIN_SESSIONS,
};
use std::time::Duration;

/// NATS going away shows in `kvrouter_replica_connected` within a heartbeat (the client buffers
/// publishes meanwhile, so their success says nothing), and the gauge comes back with NATS.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nats_outage_shows_in_the_connected_gauge() {
    let mut nats = nats().await;
    let engines = engines(1, &[]).await;
    let r = replica(&nats, 1, &engines, &[]).await;
    connected(&r, 1, "the replica to join", Duration::from_secs(20)).await;
    nats.stop().await;
    connected(&r, 0, "the outage to show", Duration::from_secs(20)).await;
    nats.restart(true).await;
    connected(&r, 1, "the replica to reconnect", Duration::from_secs(30)).await;
}

/// Found by probing: a replica whose first bucket call failed (JetStream off, or not ready yet)
/// gave up on replica sync for good. It now tries again and joins once JetStream answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_started_before_jetstream_joins_once_it_is_there() {
    let mut nats = nats().await;
    // The same port, JetStream off.
    nats.stop().await;
    nats.restart(false).await;
    let engines = engines(1, &[]).await;
    let r = replica(&nats, 1, &engines, &[]).await;
    // It serves meanwhile, unsynced.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(metric(&r.http(), "kvrouter_replica_connected").await, 0);
    nats.stop().await;
    nats.restart(true).await;
    connected(&r, 1, "the replica to join", Duration::from_secs(60)).await;
}

/// Found by probing: a pause made while NATS was away reached no replica that missed it, and
/// a NATS server restarted without its memory-stored buckets left them empty, so a replica
/// that joined later knew neither the pause nor the session bindings made before the outage.
/// After the reconnect, the replicas put their changes again, refill the lost buckets and read
/// what the others changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_nats_restart_every_replica_knows_the_pauses_and_sessions() {
    let mut nats = nats().await;
    let engines = engines(3, &[]).await;
    let extra = ROUND_ROBIN_SESSIONS;
    let a = replica(&nats, 1, &engines, &extra).await;
    let b = replica(&nats, 2, &engines, &extra).await;
    let client = reqwest::Client::new();
    joined(&[&a, &b]).await;
    // Sessions bound before the outage, spread by round-robin over the three workers.
    let bound = bind_sessions(&client, &a.http(), 6).await;
    let paused_url = engines[2].http();
    let (paused_id, state, _) = worker(&client, &a.http(), &paused_url).await;
    assert_eq!(state, "serving");
    nats.stop().await;
    for r in [&a, &b] {
        connected(r, 0, "the outage to show", Duration::from_secs(20)).await;
    }
    // Paused through A while NATS is away.
    let r = client
        .post(format!("{}/admin/workers/{paused_id}/pause", a.http()))
        .bearer_auth("t")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Back without the buckets, which were in memory.
    nats.restart(true).await;
    for r in [&a, &b] {
        connected(r, 1, "the replica to reconnect", Duration::from_secs(30)).await;
    }
    common::until("B to learn A's pause", Duration::from_secs(20), || {
        let (client, base, url) = (client.clone(), b.http(), paused_url.clone());
        async move { worker(&client, &base, &url).await.1 == "paused" }
    })
    .await;
    // A replica that joins now reads both from the refilled buckets.
    let c = replica(&nats, 3, &engines, &extra).await;
    connected(&c, 1, "replica C to join", Duration::from_secs(20)).await;
    assert_eq!(worker(&client, &c.http(), &paused_url).await.1, "paused");
    // The sessions on the serving workers, in an order round-robin cannot give (two on one
    // worker in a row): only their bindings send them there.
    let mut serving: Vec<&(String, u64)> = bound.iter().filter(|(_, w)| *w != paused_id).collect();
    serving.sort_by_key(|(_, w)| *w);
    assert!(serving.len() >= 2, "{bound:?}");
    assert_sessions_kept(
        &client,
        &c.http(),
        serving,
        "replica C, joined after the restart",
    )
    .await;
}
