//! The sessions bucket when replicas disagree on the session TTL.

use super::{
    assert_sessions_kept, bind_sessions, complete, connected, engines, joined, nats, replica,
};
use std::time::Duration;

/// Found by reading the code: the sessions bucket's age limit was set by whichever replica
/// made it, so a replica with a longer session TTL lost its bindings from the bucket early, and
/// a replica joining later did not know them. The bucket now keeps the longest TTL asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sessions_bucket_keeps_the_longest_session_ttl_of_its_replicas() {
    let nats = nats().await;
    let engines = engines(3, &[]).await;
    let short = [
        "--router-session-affinity-ttl-secs",
        "1",
        "--router-mode",
        "round-robin",
    ];
    let long = super::ROUND_ROBIN_SESSIONS;
    // The short-lived replica makes the bucket.
    let a = replica(&nats, 1, &engines, &short).await;
    connected(&a, 1, "A to join", Duration::from_secs(20)).await;
    let b = replica(&nats, 2, &engines, &long).await;
    joined(&[&a, &b]).await;
    let client = reqwest::Client::new();
    let mut bound = bind_sessions(&client, &b.http(), 3).await;
    // Past the short TTL, a replica with the long one joins and reads B's bindings.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let c = replica(&nats, 3, &engines, &long).await;
    connected(&c, 1, "C to join", Duration::from_secs(20)).await;
    // In an order round-robin cannot give, so only the bindings send them there.
    complete(&client, &c.http(), "no session", &[], 2).await;
    bound.reverse();
    assert_sessions_kept(&client, &c.http(), &bound, "replica C").await;
}
