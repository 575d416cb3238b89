//! The sessions bucket when replicas disagree on the session TTL.

use super::{common, complete, engines, joined, metric, nats, prompt, replica};
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
    let long = [
        "--router-session-affinity-ttl-secs",
        "60",
        "--router-mode",
        "round-robin",
    ];
    // The short-lived replica makes the bucket.
    let a = replica(&nats, 1, &engines, &short).await;
    let base = a.http();
    common::until("A to join", Duration::from_secs(20), || {
        let base = base.clone();
        async move { metric(&base, "kvrouter_replica_connected").await == 1 }
    })
    .await;
    let b = replica(&nats, 2, &engines, &long).await;
    joined(&[&a, &b]).await;
    let client = reqwest::Client::new();
    let mut bound = Vec::new();
    for s in 0..3 {
        let session = format!("session-{s}");
        let w = complete(
            &client,
            &b.http(),
            &prompt(s),
            &[("x-session-id", &session)],
            2,
        )
        .await;
        bound.push((session, w));
    }
    // Past the short TTL, a replica with the long one joins and reads B's bindings.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let c = replica(&nats, 3, &engines, &long).await;
    let base = c.http();
    common::until("C to join", Duration::from_secs(20), || {
        let base = base.clone();
        async move { metric(&base, "kvrouter_replica_connected").await == 1 }
    })
    .await;
    // In an order round-robin cannot give, so only the bindings send them there.
    complete(&client, &c.http(), "no session", &[], 2).await;
    bound.reverse();
    for (session, w) in &bound {
        let got = complete(
            &client,
            &c.http(),
            "a later turn",
            &[("x-session-id", session)],
            2,
        )
        .await;
        assert_eq!(got, *w, "{session} through replica C");
    }
}
