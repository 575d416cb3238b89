//! Router replicas sharing state over NATS (`kvrouter serve --replica-sync`), with real
//! processes on loopback: a `nats-server -js`, `kvrouter mock-engine` processes and several
//! `kvrouter serve` replicas in front of them. Needs `nats-server` (Debian package
//! `nats-server`); without it these tests fail, they do not skip.

mod common;
#[path = "replicas/outage.rs"]
mod outage;
#[path = "replicas/partition.rs"]
mod partition;
#[path = "replicas/sessions.rs"]
mod sessions;

use common::Proc;
use serde_json::{json, Value};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

const HEARTBEAT_MS: &str = "200";
const TTL_MS: u64 = 1500;

/// A `nats-server -js` on a free loopback port, killed on drop.
struct Nats {
    child: Child,
    url: String,
    _dir: TempDir,
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn nats_binary() -> String {
    for candidate in ["/usr/sbin/nats-server", "/usr/bin/nats-server"] {
        if std::path::Path::new(candidate).exists() {
            return candidate.into();
        }
    }
    let found = std::process::Command::new("which")
        .arg("nats-server")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    found.unwrap_or_else(|| {
        panic!(
            "nats-server is not installed (apt-get install nats-server): the replica tests need it"
        )
    })
}

impl Nats {
    fn port(&self) -> u16 {
        self.url.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Stops the server: its memory-stored buckets go with it.
    async fn stop(&mut self) {
        self.child.start_kill().unwrap();
        let _ = self.child.wait().await;
    }

    /// Starts it again on the same port, with JetStream or without.
    async fn restart(&mut self, jetstream: bool) {
        self.child = nats_process(self.port(), &self._dir.0, jetstream);
        let port = self.port();
        common::until("nats-server to listen", Duration::from_secs(20), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
    }
}

fn nats_process(port: u16, dir: &std::path::Path, jetstream: bool) -> Child {
    let port = port.to_string();
    let mut args = vec!["-a", "127.0.0.1", "-p", port.as_str()];
    if jetstream {
        args.push("-js");
    }
    Command::new(nats_binary())
        .args(&args)
        .arg("-sd")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start nats-server")
}

async fn nats() -> Nats {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("kvrouter-replicas-{}-{port}", std::process::id()));
    let child = nats_process(port, &dir, true);
    common::until("nats-server to listen", Duration::from_secs(20), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    Nats {
        child,
        url: format!("nats://127.0.0.1:{port}"),
        _dir: TempDir(dir),
    }
}

async fn engines(n: usize, extra: &[&str]) -> Vec<Proc> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut args = vec!["mock-engine", "--port", "0", "--speedup-ratio", "50"];
        args.extend(extra);
        out.push(common::spawn(&args).await);
    }
    out
}

/// Starts replica `id` in front of `engines`.
async fn replica(nats: &Nats, id: u64, engines: &[Proc], extra: &[&str]) -> Proc {
    replica_at(&nats.url, id, engines, extra).await
}

/// Starts replica `id` in front of `engines`, syncing over the NATS at `url`.
async fn replica_at(url: &str, id: u64, engines: &[Proc], extra: &[&str]) -> Proc {
    replica_with_ttl(url, id, engines, TTL_MS, extra).await
}

/// [`replica_at`] with a TTL of `ttl_ms`.
async fn replica_with_ttl(
    url: &str,
    id: u64,
    engines: &[Proc],
    ttl_ms: u64,
    extra: &[&str],
) -> Proc {
    let id = id.to_string();
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--no-router-kv-events",
        "--admin-token",
        "t",
        "--replica-sync",
        url,
        "--replica-id",
        id.as_str(),
        "--replica-heartbeat-ms",
        HEARTBEAT_MS,
        "--replica-ttl-ms",
    ];
    let ttl = ttl_ms.to_string();
    args.push(ttl.as_str());
    let urls: Vec<String> = engines.iter().map(Proc::http).collect();
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    args.extend(extra);
    common::spawn(&args).await
}

/// The value of an unlabelled metric (panics when it is missing).
async fn metric(base: &str, name: &str) -> u64 {
    let value = common::metric(base, &format!("{name} ")).await;
    value.unwrap_or_else(|| panic!("{name} missing")) as u64
}

/// Sum of a per-worker metric over all workers.
async fn worker_sum(base: &str, name: &str) -> u64 {
    common::metric(base, &format!("{name}{{"))
        .await
        .unwrap_or(0.0) as u64
}

/// Waits until every replica hears from all the others.
async fn joined(replicas: &[&Proc]) {
    for r in replicas {
        let base = r.http();
        let peers = replicas.len() as u64 - 1;
        common::until(
            "replicas to see each other",
            Duration::from_secs(20),
            || {
                let b = base.clone();
                async move { metric(&b, "kvrouter_replica_peers_alive").await == peers }
            },
        )
        .await;
    }
}

/// Sends a completion and returns the worker that served it.
async fn complete(
    client: &reqwest::Client,
    base: &str,
    prompt: &str,
    headers: &[(&str, &str)],
    max_tokens: u64,
) -> u64 {
    let mut req = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{base}: {prompt:.20}");
    let worker = r.headers()["x-kvrouter-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let _ = r.bytes().await.unwrap();
    worker
}

fn prompt(k: usize) -> String {
    // A distinct first word, then a long shared body: a prefix of many blocks per k.
    let body: Vec<String> = (0..400).map(|i| format!("w{i}")).collect();
    format!("prefix{k} {}", body.join(" "))
}

/// Sessions bound for a minute, placed round-robin: a session reaches its worker only by its
/// binding, not by a shared preference.
const ROUND_ROBIN_SESSIONS: [&str; 4] = [
    "--router-session-affinity-ttl-secs",
    "60",
    "--router-mode",
    "round-robin",
];

/// The worker at `url` as replica `base` lists it: (id, state, policy version).
async fn worker(c: &reqwest::Client, base: &str, url: &str) -> (u64, String, u64) {
    let list: Value = c
        .get(format!("{base}/admin/workers"))
        .bearer_auth("t")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let w = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url)
        .unwrap_or_else(|| panic!("{base}: no {url}: {list}"))
        .clone();
    (
        w["id"].as_u64().unwrap(),
        w["state"].as_str().unwrap().to_owned(),
        w["policy_version"].as_u64().unwrap(),
    )
}

/// Waits until `kvrouter_replica_connected` on `r` reads `want`.
async fn connected(r: &Proc, want: u64, what: &str, within: Duration) {
    let base = r.http();
    common::until(what, within, || {
        let base = base.clone();
        async move { metric(&base, "kvrouter_replica_connected").await == want }
    })
    .await;
}

/// Binds sessions `session-0` … `session-{n-1}` through the replica at `base` (each with its
/// own prompt) and returns each with the worker it was bound to.
async fn bind_sessions(client: &reqwest::Client, base: &str, n: usize) -> Vec<(String, u64)> {
    let mut bound = Vec::new();
    for s in 0..n {
        let session = format!("session-{s}");
        let w = complete(client, base, &prompt(s), &[("x-session-id", &session)], 2).await;
        bound.push((session, w));
    }
    bound
}

/// Sends one more turn of each session through the replica at `base`, in the order given, and
/// checks that it reaches the session's worker.
async fn assert_sessions_kept<'a>(
    client: &reqwest::Client,
    base: &str,
    sessions: impl IntoIterator<Item = &'a (String, u64)>,
    through: &str,
) {
    for (session, w) in sessions {
        let got = complete(
            client,
            base,
            "another turn",
            &[("x-session-id", session)],
            2,
        )
        .await;
        assert_eq!(got, *w, "{session} through {through}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn same_prefix_through_different_replicas_lands_on_the_same_engine() {
    let nats = nats().await;
    let engines = engines(4, &[]).await;
    // Approximate mode: the predicted cache picture is all a replica knows of where a prefix
    // went, so only shared placements make replicas agree.
    let extra = [];
    let rs = [
        replica(&nats, 1, &engines, &extra).await,
        replica(&nats, 2, &engines, &extra).await,
        replica(&nats, 3, &engines, &extra).await,
    ];
    let client = reqwest::Client::new();
    joined(&rs.iter().collect::<Vec<_>>()).await;
    let mut agree = 0;
    for k in 0..8 {
        let first = complete(&client, &rs[k % 3].http(), &prompt(k), &[], 2).await;
        // The placement reaches the others within the sync lag: wait for it (bounded).
        let second = &rs[(k + 1) % 3];
        let mut again = 0;
        for _ in 0..50 {
            again = complete(&client, &second.http(), &prompt(k), &[], 2).await;
            if again == first {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agree += usize::from(again == first);
    }
    assert_eq!(agree, 8, "every prefix followed through another replica");
    let received = metric(&rs[0].http(), "kvrouter_replica_events_received_total").await;
    assert!(received > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_pinned_through_one_replica_keeps_its_worker_through_others() {
    let nats = nats().await;
    let engines = engines(4, &[]).await;
    let extra = ROUND_ROBIN_SESSIONS;
    let a = replica(&nats, 1, &engines, &extra).await;
    let b = replica(&nats, 2, &engines, &extra).await;
    let client = reqwest::Client::new();
    joined(&[&a, &b]).await;
    let bound = bind_sessions(&client, &a.http(), 6).await;
    // Round-robin spreads them: the binding is what keeps them, not a shared preference.
    assert!(bound.iter().any(|(_, w)| *w != bound[0].1));
    // B has everything A sent (B hears from A only).
    let sent = metric(&a.http(), "kvrouter_replica_events_published_total").await;
    common::until("B to receive A's events", Duration::from_secs(10), || {
        let base = b.http();
        async move { metric(&base, "kvrouter_replica_events_received_total").await >= sent }
    })
    .await;
    // B's own round-robin cursor is somewhere else than A's was.
    complete(&client, &b.http(), "no session", &[], 2).await;
    assert_sessions_kept(&client, &b.http(), &bound, "replica B").await;
    // A replica that joins later reads the bindings from the sessions bucket.
    let c = replica(&nats, 3, &engines, &extra).await;
    connected(&c, 1, "replica C to join", Duration::from_secs(20)).await;
    complete(&client, &c.http(), "no session", &[], 2).await;
    assert_sessions_kept(&client, &c.http(), &bound, "replica C, joined later").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_given_one_replica_id_are_told_apart() {
    let nats = nats().await;
    let engines = engines(1, &[]).await;
    let twin_a = replica(&nats, 5, &engines, &[]).await;
    let twin_b = replica(&nats, 5, &engines, &[]).await;
    let other = replica(&nats, 6, &engines, &[]).await;
    for twin in [&twin_a, &twin_b] {
        let base = twin.http();
        common::until(
            "the shared id to be noticed",
            Duration::from_secs(20),
            || {
                let b = base.clone();
                async move { metric(&b, "kvrouter_replica_id_conflicts_total").await > 0 }
            },
        )
        .await;
    }
    // A replica with an id of its own hears the twins' messages alternate under one id.
    let base = other.http();
    common::until(
        "the twins to be noticed by a third replica",
        Duration::from_secs(20),
        || {
            let b = base.clone();
            async move { metric(&b, "kvrouter_replica_id_conflicts_total").await > 0 }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_replica_leaves_no_phantom_load() {
    let nats = nats().await;
    // Slow engines: long streams keep load on them while the replica dies.
    let engines = engines(3, &[]).await;
    let mut rs = vec![
        replica(&nats, 1, &engines, &[]).await,
        replica(&nats, 2, &engines, &[]).await,
        replica(&nats, 3, &engines, &[]).await,
    ];
    let client = reqwest::Client::new();
    joined(&rs.iter().collect::<Vec<_>>()).await;
    // Load through replica 3 that will not finish before it dies.
    let victim = rs[2].http();
    let mut doomed = Vec::new();
    for i in 0..12 {
        let (c, base) = (client.clone(), victim.clone());
        doomed.push(tokio::spawn(async move {
            let body = json!({"model": "mock-model", "prompt": format!("long {i}"), "max_tokens": 100000, "stream": true});
            c.post(format!("{base}/v1/completions")).json(&body).send().await
        }));
    }
    let (a, b) = (rs[0].http(), rs[1].http());
    common::until(
        "replica 1 to count replica 3's load",
        Duration::from_secs(20),
        || {
            let base = a.clone();
            async move { metric(&base, "kvrouter_replica_remote_active_requests").await >= 12 }
        },
    )
    .await;
    // Requests on the surviving replicas while it dies.
    let mut traffic = Vec::new();
    for i in 0..30 {
        let (c, base) = (
            client.clone(),
            if i % 2 == 0 { a.clone() } else { b.clone() },
        );
        traffic.push(tokio::spawn(async move {
            complete(&c, &base, &format!("short {i}"), &[], 4).await
        }));
    }
    let mut victim_proc = rs.remove(2);
    victim_proc.child.start_kill().unwrap(); // SIGKILL
    let _ = victim_proc.child.wait().await;
    let killed = Instant::now();
    for t in traffic {
        t.await
            .expect("requests on the other replicas are unaffected");
    }
    for base in [&a, &b] {
        common::until(
            "phantom load to go",
            Duration::from_millis(TTL_MS + 3000),
            || {
                let base = base.clone();
                async move {
                    metric(&base, "kvrouter_replica_remote_active_requests").await == 0
                        && worker_sum(&base, "kvrouter_worker_active_requests").await == 0
                }
            },
        )
        .await;
    }
    let gone_after = killed.elapsed();
    assert!(
        gone_after >= Duration::from_millis(TTL_MS / 2),
        "expired by TTL, not at once: {gone_after:?}"
    );
    assert_eq!(metric(&a, "kvrouter_replica_expired_total").await, 1);
    drop(doomed);
}

async fn engine_paused(client: &reqwest::Client, engine: &str) -> bool {
    let info: Value = client
        .get(format!("{engine}/server_info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    info["paused"].as_bool().unwrap_or(false)
}

/// `POST /admin/policy/update` of version 7 on worker 0: the answer's status.
async fn start_update(client: &reqwest::Client, base: &str) -> u16 {
    client
        .post(format!("{base}/admin/policy/update"))
        .bearer_auth("t")
        .json(&json!({"version": 7, "workers": [0]}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn policy(client: &reqwest::Client, base: &str) -> Value {
    client
        .get(format!("{base}/admin/policy"))
        .bearer_auth("t")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_drives_an_update_and_its_death_leaves_no_worker_paused() {
    let nats = nats().await;
    // Weight loads take 5 s (250 s / speed-up 50): long enough to die in.
    let engines = engines(2, &["--weight-load-ms", "250000"]).await;
    let a = replica(&nats, 1, &engines, &[]).await;
    let b = replica(&nats, 2, &engines, &[]).await;
    let client = reqwest::Client::new();
    joined(&[&a, &b]).await;
    assert_eq!(start_update(&client, &a.http()).await, 202);
    // Only one replica drives an update at a time.
    assert_eq!(start_update(&client, &b.http()).await, 409);
    // B honours A's hold and sees its progress; the engine is paused for its load.
    let engine0 = engines[0].http();
    common::until(
        "B to hold worker 0 for A's update",
        Duration::from_secs(10),
        || {
            let (c, base, e) = (client.clone(), b.http(), engine0.clone());
            async move {
                let p = policy(&c, &base).await;
                p["workers"][0]["state"] == "updating"
                    && p["update_lease"]["replica"] == 1
                    && engine_paused(&c, &e).await
            }
        },
    )
    .await;
    drop(a); // SIGKILL mid-load
             // Held out until A expires; then B wins the free lease, resumes the engine (which answers
             // once its load is over) and adopts the version it reports: the cycle is finished.
    common::until("worker 0 back in service", Duration::from_secs(20), || {
        let (c, base, e) = (client.clone(), b.http(), engine0.clone());
        async move {
            let p = policy(&c, &base).await;
            p["workers"][0]["state"] == "serving"
                && p["workers"][0]["policy_version"] == 7
                && !engine_paused(&c, &e).await
        }
    })
    .await;
    assert_eq!(
        metric(&b.http(), "kvrouter_replica_update_rollbacks_total").await,
        1
    );
    // It serves through B (pinned to it), and B may drive the next update.
    let w = complete(
        &client,
        &b.http(),
        "after",
        &[("x-kvrouter-worker-id", "0")],
        2,
    )
    .await;
    assert_eq!(w, 0);
    common::until("the lease to be free", Duration::from_secs(10), || {
        let (c, base) = (client.clone(), b.http());
        async move { policy(&c, &base).await["update_lease"].is_null() }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_update_given_up_while_its_source_is_checked_holds_no_lease() {
    // Found by a cancellation audit: the lease was taken before the source was asked whether
    // it has the version (up to a minute); a client giving up meanwhile left the lease held,
    // and every replica refused updates with 409 until it aged out.
    let nats = nats().await;
    let engines = engines(1, &[]).await;
    let a = replica(&nats, 1, &engines, &[]).await;
    let b = replica(&nats, 2, &engines, &[]).await;
    joined(&[&a, &b]).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dir = std::env::temp_dir().join(format!("kvr-lease-{}", std::process::id()));
    let client = reqwest::Client::new();
    let given_up = client
        .post(format!("{}/admin/policy/update", a.http()))
        .bearer_auth("t")
        .timeout(Duration::from_millis(500))
        .json(&json!({"version": 7, "workers": [0], "source": {
            "peer": format!("http://{}", silent.local_addr().unwrap()),
            "dir": dir.to_string_lossy(), "check_timeout_secs": 60}}))
        .send()
        .await;
    assert!(
        given_up.is_err(),
        "the check was still waiting: {given_up:?}"
    );
    // At once, not after the lease's TTL: no replica holds it.
    assert_eq!(start_update(&client, &b.http()).await, 202);
}

/// The value of one labelled sample (`name{labels}`), 0 while it is absent.
/// The value of one sample (`name{labels}`), 0 when absent.
async fn sample(base: &str, sample: &str) -> u64 {
    common::metric(base, &format!("{sample} "))
        .await
        .unwrap_or(0.0) as u64
}

const UNHEALTHY: &str = r#"kvrouter_worker_health_transitions_total{to="unhealthy"}"#;
const HEALTHY: &str = r#"kvrouter_worker_health_transitions_total{to="healthy"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_one_replica_ejects_is_avoided_by_the_others_until_it_recovers() {
    let nats = nats().await;
    let engines = engines(2, &[]).await;
    let extra = [
        "--router-mode",
        "round-robin",
        "--health-check-interval-secs",
        "0.3",
        // Checks never eject here (they fail while the engine is frozen): only failed requests
        // do, and requests go through replica A only until it has.
        "--health-failure-threshold",
        "1000000",
        "--health-recovery-threshold",
        "2",
        "--outlier-consecutive-failures",
        "2",
        "--upstream-response-timeout-secs",
        "0.5",
    ];
    let a = replica(&nats, 1, &engines, &extra).await;
    let b = replica(&nats, 2, &engines, &extra).await;
    let client = reqwest::Client::new();
    joined(&[&a, &b]).await;
    let (ab, bb) = (a.http(), b.http());
    engines[1].signal("-STOP");
    // Through A only: requests on the frozen engine time out (and are retried on the other)
    // until A ejects it.
    let mut i = 0;
    common::until(
        "A to eject the frozen engine",
        Duration::from_secs(30),
        || {
            i += 1;
            let (c, base, k) = (client.clone(), ab.clone(), i);
            async move {
                complete(&c, &base, &format!("through a {k}"), &[], 2).await;
                sample(&base, UNHEALTHY).await >= 1
            }
        },
    )
    .await;
    assert_eq!(worker_sum(&bb, "kvrouter_upstream_retries_total").await, 0);
    // B has seen no failed request; A's verdict reaches it within the sync lag.
    common::until("B to apply A's verdict", Duration::from_secs(10), || {
        let base = bb.clone();
        async move { sample(&base, UNHEALTHY).await >= 1 }
    })
    .await;
    for k in 0..6 {
        let w = complete(&client, &bb, &format!("through b {k}"), &[], 2).await;
        assert_eq!(w, 0, "request {k} through B avoids the ejected engine");
    }
    assert_eq!(
        worker_sum(&bb, "kvrouter_upstream_retries_total").await,
        0,
        "no request through B tried the frozen engine"
    );
    // A replica that joins now reads A's current ejections (members bucket, heartbeats).
    let c = replica(&nats, 3, &engines, &extra).await;
    common::until(
        "C, joined later, to eject it",
        Duration::from_secs(20),
        || {
            let base = c.http();
            async move { sample(&base, UNHEALTHY).await >= 1 }
        },
    )
    .await;
    // It recovers: A's checks pass, and both replicas use it again.
    engines[1].signal("-CONT");
    for base in [&ab, &bb] {
        let mut k = 0;
        common::until(
            "the engine back in rotation",
            Duration::from_secs(20),
            || {
                k += 1;
                let (c, base, k) = (client.clone(), base.clone(), k);
                async move { complete(&c, &base, &format!("after {k}"), &[], 2).await == 1 }
            },
        )
        .await;
        assert!(sample(base, HEALTHY).await >= 1);
    }
}

#[tokio::test]
async fn bad_replica_flags_are_a_clear_error_naming_the_flag() {
    for (flags, named) in [
        (
            vec!["--replica-sync", "http://127.0.0.1:4222"],
            "--replica-sync",
        ),
        // Accepted, then retried forever in the background.
        (
            vec!["--replica-sync", "nats://127.0.0.1:99999"],
            "invalid port number",
        ),
        (vec!["--replica-sync", "nats://"], "names no host"),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-ttl-ms",
                "18446744073709551615",
            ],
            "--replica-ttl-ms",
        ),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-cluster",
                "a.b",
            ],
            "--replica-cluster",
        ),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-heartbeat-ms",
                "0",
            ],
            "--replica-heartbeat-ms",
        ),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-ttl-ms",
                "1500",
            ],
            "--replica-ttl-ms",
        ),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-outbox-max-events",
                "0",
            ],
            "--replica-outbox-max-events",
        ),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-heartbeat-max-requests",
                "0",
            ],
            "--replica-heartbeat-max-requests",
        ),
        (
            vec![
                "--replica-sync",
                "nats://127.0.0.1:4222",
                "--replica-join-max-keys",
                "0",
            ],
            "--replica-join-max-keys",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--port", "0", "--mock-workers", "1"])
            .args(&flags)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{flags:?} is refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
    }
    for (flag, value) in [
        ("--router-replicas", "0"),
        // Each replica is a whole routing core: 16,000 took 15 GB.
        ("--router-replicas", "65"),
        ("--replica-sync-delay-ms", "-1"),
        ("--replica-sync-delay-ms", "1e300"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["sim", "--workload", "grpo", "--quiet"])
            .arg(format!("{flag}={value}"))
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "sim {flag} {value} is refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }
}
