//! Replica sync when one replica's link to NATS fails on its own, through a TCP proxy the test
//! controls: a replica started before its link works, a link that silently stops carrying
//! messages, a replica that is last to reach a restarted server, a release or a version made
//! elsewhere while a replica was cut off, and NATS answers that come too late.

use super::{
    common, complete, connected, engines, joined, metric, nats, policy, replica, replica_at,
    replica_with_ttl, start_update, worker, Nats, ROUND_ROBIN_SESSIONS,
};
use common::proxy::Proxy;
use common::Proc;
use serde_json::{json, Value};
use std::time::Duration;

fn nats_url(proxy: &Proxy) -> String {
    format!("nats://{}", proxy.addr())
}

fn nats_port(nats: &Nats) -> u16 {
    nats.url.rsplit(':').next().unwrap().parse().unwrap()
}

/// Replica A straight to NATS and replica B through a proxy the test controls, in front of
/// `engines`, joined.
struct Pair {
    a: Proc,
    b: Proc,
    proxy: Proxy,
}

async fn pair(nats: &Nats, engines: &[Proc], extra: &[&str]) -> Pair {
    let a = replica(nats, 1, engines, extra).await;
    let mut proxy = Proxy::new(nats_port(nats));
    proxy.start().await;
    let b = replica_at(&nats_url(&proxy), 2, engines, extra).await;
    joined(&[&a, &b]).await;
    Pair { a, b, proxy }
}

async fn admin(c: &reqwest::Client, base: &str, path: &str, body: Value) {
    let r = c
        .post(format!("{base}/admin/workers/{path}"))
        .bearer_auth("t")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "{path}: {}",
        r.text().await.unwrap()
    );
}

/// Waits until replica `base` lists the worker at `url` as `state` at `version`.
async fn shows(c: &reqwest::Client, base: &str, url: &str, state: &str, version: u64, what: &str) {
    common::until(what, Duration::from_secs(20), || async {
        let (_, s, v) = worker(c, base, url).await;
        s == state && v == version
    })
    .await;
}

/// Found by probing: a replica started while its link to NATS did not work served at once
/// (as documented), but the pause and version an operator gave it meanwhile were overwritten
/// by the buckets' older values when it joined, and the others dropped its first events (its
/// first message had no worker table). Both now reach every replica and stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_made_before_a_replica_joins_reach_everyone_and_stay() {
    let nats = nats().await;
    let engines = engines(2, &[]).await;
    let a = replica(&nats, 1, &engines, &[]).await;
    connected(&a, 1, "A to join", Duration::from_secs(20)).await;
    let c = reqwest::Client::new();
    let (u0, u1) = (engines[0].http(), engines[1].http());
    // The buckets hold a version for both workers.
    for u in [&u0, &u1] {
        let id = worker(&c, &a.http(), u).await.0;
        admin(
            &c,
            &a.http(),
            &format!("{id}/policy-version"),
            json!({"version": 3}),
        )
        .await;
    }
    let mut proxy = Proxy::new(nats_port(&nats));
    let late = replica_at(&nats_url(&proxy), 3, &engines, &[]).await;
    let base = late.http();
    let (id0, id1) = (
        worker(&c, &base, &u0).await.0,
        worker(&c, &base, &u1).await.0,
    );
    admin(&c, &base, &format!("{id1}/pause"), json!({})).await;
    admin(
        &c,
        &base,
        &format!("{id0}/policy-version"),
        json!({"version": 7}),
    )
    .await;
    proxy.start().await;
    connected(
        &late,
        1,
        "the late replica to join",
        Duration::from_secs(30),
    )
    .await;
    joined(&[&a, &late]).await;
    shows(&c, &a.http(), &u1, "paused", 3, "A to learn the pause").await;
    shows(&c, &a.http(), &u0, "serving", 7, "A to learn the version").await;
    // Still so where they were made, a few heartbeats on.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(worker(&c, &base, &u1).await.1, "paused");
    assert_eq!(worker(&c, &base, &u0).await.2, 7);
}

/// Found by probing: a link that stops carrying messages without closing (a network that
/// drops them) was never noticed: NATS's own PING is not sent while a replica publishes every
/// heartbeat. The replica's own messages no longer coming back shows it; the replica reconnects
/// and repairs, so a pause made through it meanwhile reaches the others and one made elsewhere
/// reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_link_that_silently_drops_messages_is_noticed_and_repaired() {
    let nats = nats().await;
    let engines = engines(3, &[]).await;
    let Pair { a, b, mut proxy } = pair(&nats, &engines, &[]).await;
    let c = reqwest::Client::new();
    let (u0, u1) = (engines[0].http(), engines[1].http());
    // The policy bucket holds worker 0 as serving (paused and resumed through B): the repair
    // must not read that back over B's pause below.
    let id0 = worker(&c, &b.http(), &u0).await.0;
    admin(&c, &b.http(), &format!("{id0}/pause"), json!({})).await;
    admin(&c, &b.http(), &format!("{id0}/resume"), json!({})).await;
    shows(&c, &a.http(), &u0, "serving", 0, "A to see the resume").await;
    proxy.black_hole();
    admin(&c, &b.http(), &format!("{id0}/pause"), json!({})).await;
    let id1 = worker(&c, &a.http(), &u1).await.0;
    admin(&c, &a.http(), &format!("{id1}/pause"), json!({})).await;
    connected(
        &b,
        0,
        "B to notice its link is dead",
        Duration::from_secs(20),
    )
    .await;
    // The proxy forwards new connections again; B's reconnect goes through.
    proxy.stop().await;
    proxy.start().await;
    connected(&b, 1, "B to reconnect", Duration::from_secs(30)).await;
    shows(&c, &a.http(), &u0, "paused", 0, "A to learn B's pause").await;
    shows(&c, &b.http(), &u1, "paused", 0, "B to learn A's pause").await;
    assert!(metric(&b.http(), "kvrouter_replica_connected").await == 1);
}

/// Found by probing: a replica that joined a restarted NATS server before the others came
/// back read empty buckets, and never learned what they wrote into them when they did. A
/// replica's message after its repair now says so, and the others read the buckets again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_first_to_a_restarted_server_learns_what_the_others_refill() {
    let mut nats = nats().await;
    let engines = engines(2, &[]).await;
    let mut proxy = Proxy::new(nats_port(&nats));
    proxy.start().await;
    let a = replica_at(&nats_url(&proxy), 1, &engines, &[]).await;
    connected(&a, 1, "A to join", Duration::from_secs(20)).await;
    let c = reqwest::Client::new();
    let u1 = engines[1].http();
    let id1 = worker(&c, &a.http(), &u1).await.0;
    admin(&c, &a.http(), &format!("{id1}/pause"), json!({})).await;
    // Well published (and no longer among A's recent changes, which a repair sends again).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // A cannot reach the server while it restarts without its buckets.
    proxy.stop().await;
    nats.stop().await;
    nats.restart(true).await;
    let fresh = replica(&nats, 2, &engines, &[]).await;
    connected(
        &fresh,
        1,
        "the fresh replica to join",
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(worker(&c, &fresh.http(), &u1).await.1, "serving");
    proxy.start().await;
    shows(
        &c,
        &fresh.http(),
        &u1,
        "paused",
        0,
        "the fresh replica to learn A's pause",
    )
    .await;
}

/// Found by reading the code (probe): a replica cut off while another released a session kept
/// the binding (its read of the buckets only added bindings), pinned the next turn to the old
/// worker and sent the binding back to everyone. It now releases what the bucket shows
/// released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_released_while_a_replica_was_cut_off_is_released_there() {
    let nats = nats().await;
    let engines = engines(2, &[]).await;
    let Pair { a, b, mut proxy } = pair(&nats, &engines, &ROUND_ROBIN_SESSIONS).await;
    let c = reqwest::Client::new();
    let header = [("x-session-id", "s-1")];
    let bound = complete(&c, &b.http(), "a first turn", &header, 2).await;
    let sent = metric(&b.http(), "kvrouter_replica_events_published_total").await;
    common::until("A to hear B's binding", Duration::from_secs(10), || async {
        metric(&a.http(), "kvrouter_replica_events_received_total").await >= sent
    })
    .await;
    proxy.black_hole();
    let r = c
        .delete(format!("{}/v1/sessions/s-1", a.http()))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    connected(
        &b,
        0,
        "B to notice its link is dead",
        Duration::from_secs(20),
    )
    .await;
    proxy.stop().await;
    proxy.start().await;
    common::until("B to repair", Duration::from_secs(30), || async {
        metric(&b.http(), "kvrouter_replica_repairs_total").await >= 1
    })
    .await;
    // Round-robin alternates over the two workers: after one request lands on the bound
    // worker, the next goes to the other, unless a binding holds it.
    common::until(
        "B's cursor on the bound worker",
        Duration::from_secs(10),
        || async { complete(&c, &b.http(), "no session", &[], 2).await == bound },
    )
    .await;
    let next = complete(&c, &b.http(), "the next turn", &header, 2).await;
    assert_ne!(next, bound, "the released binding held at B");
}

/// Found by probing: the policy bucket held a worker's version and pause as one value, so a
/// replica that paused a worker while cut off wrote back its stale version with the pause, and
/// every replica took it up after its repair. Each is its own key now.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_made_while_cut_off_does_not_undo_a_version_set_meanwhile() {
    let nats = nats().await;
    let engines = engines(2, &[]).await;
    let Pair { a, b, mut proxy } = pair(&nats, &engines, &[]).await;
    let c = reqwest::Client::new();
    let u0 = engines[0].http();
    let id_a = worker(&c, &a.http(), &u0).await.0;
    let id_b = worker(&c, &b.http(), &u0).await.0;
    proxy.stop().await;
    connected(&b, 0, "B to be cut off", Duration::from_secs(20)).await;
    admin(
        &c,
        &a.http(),
        &format!("{id_a}/policy-version"),
        json!({"version": 7}),
    )
    .await;
    admin(&c, &b.http(), &format!("{id_b}/pause"), json!({})).await;
    proxy.start().await;
    common::until("B to repair", Duration::from_secs(30), || async {
        metric(&b.http(), "kvrouter_replica_repairs_total").await >= 1
            && metric(&a.http(), "kvrouter_replica_repairs_total").await >= 1
    })
    .await;
    for r in [&a, &b] {
        shows(
            &c,
            &r.http(),
            &u0,
            "paused",
            7,
            "both changes on every replica",
        )
        .await;
    }
}

/// Found by reading the code: a lease take that NATS carried out but answered after the call's
/// time limit (2 s) failed the update with 503, and the retry was refused 409, naming the
/// replica itself as the lease's holder, until the TTL aged the lease out. The replica now
/// reads the lease when a call fails, and carries on with a lease that names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_taken_but_answered_too_late_is_the_replicas_own() {
    // A TTL long enough that late answers do not end the link, nor age the lease out.
    const TTL_MS: u64 = 20_000;
    let nats = nats().await;
    let engines = engines(1, &[]).await;
    let mut proxy = Proxy::new(nats_port(&nats));
    proxy.start().await;
    let a = replica_with_ttl(&nats_url(&proxy), 1, &engines, TTL_MS, &[]).await;
    let b = replica_with_ttl(&nats.url, 2, &engines, TTL_MS, &[]).await;
    joined(&[&a, &b]).await;
    let c = reqwest::Client::new();
    proxy.delay_answers(Duration::from_millis(2_500));
    let first = start_update(&c, &a.http()).await;
    proxy.delay_answers(Duration::ZERO);
    // NATS took the lease for A.
    common::until("B to see A's lease", Duration::from_secs(10), || {
        let (c, base) = (c.clone(), b.http());
        async move { policy(&c, &base).await["update_lease"]["replica"] == 1 }
    })
    .await;
    if first == 503 {
        // A's answers come at once again: its retry finds its own lease and starts.
        common::until("A to answer at once again", Duration::from_secs(10), || {
            let (c, base) = (c.clone(), a.http());
            async move { policy(&c, &base).await["update_lease"]["replica"] == 1 }
        })
        .await;
        assert_eq!(start_update(&c, &a.http()).await, 202);
    } else {
        // The lease was read back within the first call's time.
        assert_eq!(first, 202);
    }
    // B still may not start one.
    assert_eq!(start_update(&c, &b.http()).await, 409);
    // The cycle ends, and A gives up the lease with the revision it adopted.
    common::until("the lease to be given up", Duration::from_secs(15), || {
        let (c, base) = (c.clone(), b.http());
        async move {
            let p = policy(&c, &base).await;
            p["update_lease"].is_null() && p["workers"][0]["policy_version"] == 7
        }
    })
    .await;
    assert_eq!(
        metric(&a.http(), "kvrouter_replica_update_lease_lost_total").await,
        0
    );
}
