//! `kvrouter serve --global` with real processes on loopback: two local `kvrouter serve
//! --mock-workers 4` (one with slower mock engines) publishing `/admin/cluster-summary`, a
//! third cluster whose router is not there, and the global router in front of them.

mod common;

use common::Proc;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "cluster-secret";

async fn local(name: &str, speedup: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "4",
        "--mock-speedup-ratio",
        speedup,
        "--admin-token",
        TOKEN,
        "--cluster-name",
        name,
        "--cluster-summary-refresh-ms",
        "100",
    ];
    args.extend_from_slice(extra);
    common::spawn(&args).await
}

/// A loopback URL where nothing listens (the port was free a moment ago).
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

struct Setup {
    fast: Proc,
    slow: Proc,
    global: Proc,
    http: reqwest::Client,
}

async fn setup() -> Setup {
    setup_with(&[]).await
}

/// A global router over `clusters` (`NAME=URL[,...]` each), refreshing every 100 ms, with
/// `extra` flags.
async fn global_over(clusters: &[String], extra: &[&str]) -> Proc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--global",
        "--global-refresh-ms",
        "100",
    ];
    for c in clusters {
        args.extend(["--cluster", c.as_str()]);
    }
    args.extend_from_slice(extra);
    common::spawn_with_env(&args, &[("KVROUTER_CLUSTER_TOKEN", TOKEN)]).await
}

/// Waits (bounded) until `global` has a summary of `n` clusters.
async fn until_available(http: &reqwest::Client, global: &Proc, n: u64) {
    let health = format!("{}/health", global.http());
    common::poll(Duration::from_secs(20), || async {
        let h: Value = match http.get(&health).send().await {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        h["available_clusters"] == n
    })
    .await
    .expect("the clusters are available");
}

/// A streamed completion of `body` at `global`, answered 200 (bounded by `timeout`).
async fn stream_at(
    http: &reqwest::Client,
    global: &Proc,
    body: Value,
    timeout: Duration,
) -> reqwest::Response {
    let r = http
        .post(format!("{}/v1/completions", global.http()))
        .json(&body)
        .timeout(timeout)
        .send()
        .await
        .expect("the global router answers");
    assert_eq!(r.status(), 200);
    r
}

/// The rest of a stream as text; it must end cleanly (bounded by its request's timeout).
async fn rest_of(mut r: reqwest::Response) -> String {
    let mut rest = Vec::new();
    while let Some(chunk) = r.chunk().await.expect("the stream ends cleanly") {
        rest.extend_from_slice(&chunk);
    }
    String::from_utf8_lossy(&rest).into_owned()
}

/// Two clusters (their routers started with `local_args` too) and a dead one.
async fn setup_with(local_args: &[&str]) -> Setup {
    let fast = local("fast", "20", local_args).await;
    let slow = local("slow", "5", local_args).await;
    let clusters = [
        format!("fast={}", fast.http()),
        format!("slow={},rtt_ms=2", slow.http()),
        format!("dead={}", dead_url()),
    ];
    let global = global_over(
        &clusters,
        &[
            "--global-summary-timeout-ms",
            "500",
            "--global-max-summary-age-secs",
            "2",
        ],
    )
    .await;
    let s = Setup {
        fast,
        slow,
        global,
        http: reqwest::Client::new(),
    };
    // Bounded: both live clusters have a summary.
    let health = format!("{}/health", s.global.http());
    let available = common::poll(Duration::from_secs(20), || async {
        s.get_json(&health).await["available_clusters"] == 2
    })
    .await;
    assert!(
        available.is_some(),
        "clusters not available: {}",
        s.get_json(&health).await
    );
    s
}

impl Setup {
    /// Kills the local router of cluster `name` (`fast` or `slow`) and waits for it to exit.
    async fn kill(&mut self, name: &str) {
        let victim = if name == "fast" {
            &mut self.fast
        } else {
            &mut self.slow
        };
        victim.child.start_kill().unwrap();
        victim.child.wait().await.unwrap();
    }

    async fn get_json(&self, url: &str) -> Value {
        match self.http.get(url).send().await {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        }
    }

    async fn metrics(&self) -> String {
        common::metrics(&self.global.http()).await
    }

    /// One completion of `tokens` prompt ids in `session`: (status, x-kvrouter-cluster).
    async fn turn(&self, session: &str, tokens: &[u32], stream: bool) -> (u16, String) {
        let r = self
            .http
            .post(format!("{}/v1/completions", self.global.http()))
            .header("x-session-id", session)
            .json(
                &json!({"model": "mock-model", "prompt": tokens, "max_tokens": 4,
                "stream": stream}),
            )
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("the global router answers");
        let status = r.status().as_u16();
        let cluster = r
            .headers()
            .get("x-kvrouter-cluster")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let body = r.text().await.unwrap();
        if stream && status == 200 {
            assert!(body.contains("data: [DONE]"), "a whole stream: {body}");
        }
        (status, cluster)
    }
}

/// Session `s`'s prompt at turn `k`: its history grows by 160 tokens a turn.
fn prompt(s: u32, k: u32) -> Vec<u32> {
    (0..160 * (k + 1))
        .map(|i| 1 + (s * 7919 + i) % 30_000)
        .collect()
}

/// The value of a metric line `name{labels} v`, 0 when absent.
fn metric(text: &str, series: &str) -> f64 {
    common::metric_in(text, series).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_stay_in_one_cluster_and_answers_name_it() {
    let s = setup().await;
    let mut homes = Vec::new();
    for session in 0..8u32 {
        let id = format!("session-{session}");
        let mut seen = Vec::new();
        for turn in 0..4 {
            let (status, cluster) = s.turn(&id, &prompt(session, turn), turn % 2 == 1).await;
            assert_eq!(status, 200, "{id} turn {turn}");
            seen.push(cluster);
        }
        assert!(
            seen.iter().all(|c| c == &seen[0]),
            "{id} changed cluster: {seen:?}"
        );
        assert!(["fast", "slow"].contains(&seen[0].as_str()), "{seen:?}");
        homes.push(seen[0].clone());
    }
    let m = s.metrics().await;
    // The unreachable cluster is reported and never chosen.
    assert_eq!(
        metric(&m, "kvrouter_global_cluster_eligible{cluster=\"dead\"}"),
        0.0
    );
    assert!(
        metric(
            &m,
            "kvrouter_global_summary_fetch_errors_total{cluster=\"dead\",kind=\"connect\"}"
        ) >= 1.0,
        "{m}"
    );
    assert!(
        !m.contains("kvrouter_global_requests_total{cluster=\"dead\""),
        "{m}"
    );
    assert!(!homes.contains(&"dead".to_owned()));
    // Every later turn kept its home: 8 sessions × 3 turns.
    let kept: f64 = ["fast", "slow"]
        .iter()
        .map(|c| {
            metric(
                &m,
                &format!(
                    "kvrouter_global_requests_total{{cluster=\"{c}\",reason=\"session_home\"}}"
                ),
            )
        })
        .sum();
    assert_eq!(kept, 24.0, "{m}");
    assert!(
        m.contains("kvrouter_global_summary_age_seconds{cluster=\"fast\"}"),
        "{m}"
    ); // A body that is not JSON is the global router's own 400, OpenAI-shaped.
    let r = s
        .http
        .post(format!("{}/v1/completions", s.global.http()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.headers().get("x-kvrouter-cluster").is_none());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_cluster_router_loses_its_traffic_and_sessions_within_a_deadline() {
    let mut s = setup().await;
    let (status, home) = s.turn("moving", &prompt(1, 0), false).await;
    assert_eq!(status, 200);
    let other = if home == "fast" { "slow" } else { "fast" };
    s.kill(&home).await;
    // Bounded: the session's next turns are answered by the other cluster.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut turn = 1;
    loop {
        let (status, cluster) = s.turn("moving", &prompt(1, turn), turn % 2 == 0).await;
        turn += 1;
        if status == 200 && cluster == other {
            break;
        }
        assert!(Instant::now() < deadline, "still {status} from {cluster:?}");
    }
    // New sessions too, and the metrics say what happened.
    for k in 0..4 {
        let (status, cluster) = s.turn(&format!("new-{k}"), &prompt(50 + k, 0), false).await;
        assert_eq!((status, cluster.as_str()), (200, other));
    }
    let (s, home) = (&s, home.as_str());
    let reported = common::poll(Duration::from_secs(10), || async move {
        let m = s.metrics().await;
        let eligible = metric(
            &m,
            &format!("kvrouter_global_cluster_eligible{{cluster=\"{home}\"}}"),
        );
        let moved = metric(
            &m,
            &format!("kvrouter_global_session_moves_total{{from=\"{home}\",to=\"{other}\"}}"),
        );
        let fetch = metric(
            &m,
            &format!(
                "kvrouter_global_summary_fetch_errors_total{{cluster=\"{home}\",kind=\"connect\"}}"
            ),
        );
        eligible == 0.0 && moved >= 1.0 && fetch >= 1.0
    })
    .await;
    assert!(reported.is_some(), "metrics: {}", s.metrics().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_its_cluster_breaks_off_ends_with_an_error_event() {
    let mut s = setup().await;
    let body = json!({"model": "mock-model", "prompt": prompt(7, 0), "max_tokens": 20000,
        "stream": true});
    let mut r = stream_at(&s.http, &s.global, body, Duration::from_secs(30)).await;
    let home = r.headers()["x-kvrouter-cluster"]
        .to_str()
        .unwrap()
        .to_owned();
    let first = r.chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    s.kill(&home).await;
    // The rest of the stream: the in-band error and [DONE] last.
    let rest = rest_of(r).await;
    assert!(
        rest.ends_with("data: [DONE]\n\n") && rest.contains("broke off the stream"),
        "{}",
        &rest[rest.len().saturating_sub(400)..]
    );
    let m = s.metrics().await;
    assert_eq!(
        metric(
            &m,
            &format!("kvrouter_global_errors_total{{cluster=\"{home}\",kind=\"broken\"}}")
        ),
        1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_its_cluster_stops_sending_ends_after_the_idle_timeout() {
    let fast = local("fast", "20", &[]).await;
    let global = global_over(
        &[format!("fast={}", fast.http())],
        &["--stream-idle-timeout-secs", "1"],
    )
    .await;
    let http = reqwest::Client::new();
    until_available(&http, &global, 1).await;
    let body = json!({"model": "mock-model", "prompt": prompt(3, 0), "max_tokens": 20000,
        "stream": true});
    let mut r = stream_at(&http, &global, body, Duration::from_secs(30)).await;
    assert!(r.chunk().await.unwrap().is_some());
    // The cluster's router freezes: its connection stays open and sends nothing.
    fast.signal("-STOP");
    let started = Instant::now();
    let rest = rest_of(r).await;
    let waited = started.elapsed();
    fast.signal("-CONT");
    assert!(
        rest.ends_with("data: [DONE]\n\n") && rest.contains("--stream-idle-timeout-secs"),
        "{}",
        &rest[rest.len().saturating_sub(400)..]
    );
    assert!(waited < Duration::from_secs(15), "ended after {waited:?}");
    let m = common::metrics(&global.http()).await;
    assert_eq!(
        metric(
            &m,
            "kvrouter_global_errors_total{cluster=\"fast\",kind=\"broken\"}"
        ),
        1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_its_cluster_moves_off_a_stalled_engine_is_not_cut_at_the_global_router() {
    // A cluster of two separate mock engines whose router moves a stalled stream
    // (--migration-limit), the global router run with the same idle bound.
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "10"]).await);
    }
    let urls: Vec<String> = engines.iter().map(|e| e.http()).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let (cluster, dir) = common::serve_workers(
        &urls,
        "global-migrate",
        &[
            "--migration-limit",
            "2",
            "--stream-idle-timeout-secs",
            "2",
            "--admin-token",
            TOKEN,
            "--cluster-name",
            "m",
            "--cluster-summary-refresh-ms",
            "100",
        ],
    )
    .await;
    let global = global_over(
        &[format!("m={}", cluster.http())],
        &["--stream-idle-timeout-secs", "2"],
    )
    .await;
    let http = reqwest::Client::new();
    until_available(&http, &global, 1).await;
    let body = json!({"model": "mock-model", "prompt": prompt(5, 0), "max_tokens": 3000,
        "stream": true, "ignore_eos": true});
    let mut r = stream_at(&http, &global, body, Duration::from_secs(60)).await;
    let worker: usize = r.headers()["x-kvrouter-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    engines[worker].signal("-STOP");
    let rest = rest_of(r).await;
    engines[worker].signal("-CONT");
    assert!(
        rest.ends_with("data: [DONE]\n\n") && rest.contains("\"finish_reason\":\"length\""),
        "{}",
        &rest[rest.len().saturating_sub(400)..]
    );
    assert!(!rest.contains("broke off"), "cut at the global router");
    let _ = std::fs::remove_dir_all(dir);
}

/// A fake cluster router whose `/admin/cluster-summary` answers a body of `stated` bytes
/// (`Content-Length`, or none when `None`) and sends spaces without end (bounded: 512 MiB a
/// connection, the test's own limit).
async fn flooding_cluster(stated: Option<u64>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = [0u8; 4096];
                let _ = sock.read(&mut head).await;
                let length = stated.map_or(String::new(), |n| format!("content-length: {n}\r\n"));
                let reply = format!("HTTP/1.1 200 OK\r\n{length}connection: close\r\n\r\n");
                if sock.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b' '; 1 << 20];
                for _ in 0..512 {
                    if sock.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_summary_is_refused_without_being_read_whole() {
    let stated = flooding_cluster(Some(1 << 40)).await;
    let endless = flooding_cluster(None).await;
    let global = global_over(
        &[format!("stated={stated}"), format!("endless={endless}")],
        &["--global-summary-timeout-ms", "5000"],
    )
    .await;
    let url = global.http();
    let refused = |m: &str, c: &str| {
        metric(
            m,
            &format!(
                "kvrouter_global_summary_fetch_errors_total{{cluster=\"{c}\",kind=\"invalid\"}}"
            ),
        )
    };
    let seen = common::poll(Duration::from_secs(30), || async {
        let m = common::metrics(&url).await;
        (refused(&m, "stated") >= 2.0 && refused(&m, "endless") >= 2.0).then_some(())
    })
    .await;
    let m = common::metrics(&url).await;
    assert!(seen.is_some(), "{m}");
    // The router kept its memory: its resident set stays far below one summary's worth.
    let pid = global.child.id().expect("running");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap();
    let bound_kib = (kvrouter_core::global::MAX_SUMMARY_BYTES as u64 * 3) / 1024;
    assert!(peak_kib < bound_kib, "peak {peak_kib} KiB");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_local_summary_is_behind_the_admin_token_and_decodes() {
    let fast = local("fast", "20", &[]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/admin/cluster-summary", fast.http());
    let denied = http.get(&url).send().await.unwrap();
    assert_eq!(denied.status(), 401);
    // A long prompt puts blocks in the index; the summary shows them within its refresh bound.
    let r = http
        .post(format!("{}/v1/completions", fast.http()))
        .json(&json!({"model": "mock-model", "prompt": prompt(3, 7), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = http.get(&url).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["content-type"],
            "application/x-kvrouter-cluster-summary"
        );
        let bytes = r.bytes().await.unwrap();
        let summary = kvrouter_core::global::ClusterSummary::from_bytes(&bytes).unwrap();
        assert_eq!(summary.name, "fast");
        assert_eq!(summary.load.workers, 4);
        assert!(
            summary.load.prefill_tokens_per_s > 0.0,
            "derived from the mocks"
        );
        // Batch slots (4 mocks × their max-num-seqs) and the batch's effect on decode, from
        // the mocks' configuration and timing model.
        let slots = summary.load.max_running_requests;
        assert!(slots > 0 && slots % 4 == 0, "slots {slots}");
        assert!(summary.load.decode_ms_per_token_per_seq > 0.0);
        if summary.sketch.keys() > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no blocks in the summary");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The mocks' steps slow with the KV they hold (dynamo-poly), so a long request running in a
/// cluster must raise the latency its summary states by its blocks, not by one request of
/// 1,024 tokens (the earlier statement, which let the fast cluster look idle under load).
#[tokio::test(flavor = "multi_thread")]
async fn the_summary_prices_decode_by_the_kv_its_requests_hold() {
    let dc = local("kv-use", "1", &[]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/admin/cluster-summary", dc.http());
    let read = || async {
        let r = http.get(&url).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(r.status(), 200);
        kvrouter_core::global::ClusterSummary::from_bytes(&r.bytes().await.unwrap()).unwrap()
    };
    let idle = read().await;
    assert_eq!(idle.load.active_requests, 0);
    let per_request = idle.load.decode_ms_per_token_per_seq;
    assert!(per_request > 0.0, "growth of one 1,024-token request");
    // 8,192 tokens: the KV of eight 1,024-token requests, on one of 4 workers.
    let long: Vec<u32> = (0..8192).map(|i| 1 + (i * 7) % 30_000).collect();
    let post = http.post(format!("{}/v1/completions", dc.http())).json(
        &json!({"model": "mock-model", "prompt": long, "max_tokens": 400,
            "ignore_eos": true}),
    );
    let running = tokio::spawn(post.send());
    let deadline = Instant::now() + Duration::from_secs(10);
    let busy = loop {
        let s = read().await;
        if s.load.active_requests == 1
            && s.load.active_decode_blocks >= 8192 / u64::from(s.block_size)
        {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the request never showed: {:?}",
            s.load
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // 8,192 tokens over 4 workers: twice one 1,024-token request's growth (the earlier
    // statement added a quarter of it), and one more such request would add eight.
    let growth = busy.load.decode_ms_per_token - idle.load.decode_ms_per_token;
    assert!(
        growth >= 1.5 * per_request,
        "stated latency grew {growth} ms, one 1,024-token request adds {per_request}"
    );
    assert!(busy.load.decode_ms_per_token_per_seq >= 4.0 * per_request);
    assert_eq!(running.await.unwrap().unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_global_flags_are_refused_naming_the_flag() {
    for (args, says) in [
        (vec!["--global"], "--cluster"),
        (
            vec!["--global", "--cluster", "nonsense"],
            "--cluster \"nonsense\"",
        ),
        (vec!["--global", "--cluster", "a=ftp://x"], "--cluster"),
        (
            vec!["--global", "--cluster", "a=http://x,weight=0"],
            "weight",
        ),
        (
            vec![
                "--global",
                "--cluster",
                "a=http://x",
                "--cluster",
                "a=http://y",
            ],
            "given twice",
        ),
        (
            vec![
                "--global",
                "--cluster",
                "a=http://x",
                "--global-policy",
                "best",
            ],
            "--global-policy",
        ),
        (
            vec![
                "--global",
                "--cluster",
                "a=http://x",
                "--global-refresh-ms",
                "0",
            ],
            "--global-refresh-ms",
        ),
        (
            vec!["--global", "--cluster", "a=http://x", "--mock-workers", "2"],
            "--global",
        ),
        (
            vec!["--global", "--cluster", "a=http://x,rtt_ms=1e300"],
            "rtt_ms",
        ),
        // Refreshed less often than a summary stays fresh: every cluster would go stale.
        (
            vec![
                "--global",
                "--cluster",
                "a=http://x",
                "--global-refresh-ms",
                "10000",
            ],
            "must be shorter than --global-max-summary-age-secs",
        ),
        // What only a cluster's own router runs was silently left off.
        (
            vec![
                "--global",
                "--cluster",
                "a=http://x",
                "--ext-proc-port",
                "0",
                "--replica-sync",
                "nats://127.0.0.1:4222",
            ],
            "--ext-proc-port, --replica-sync belong to those routers",
        ),
        (
            vec!["--mock-workers", "1", "--cluster", "a=http://x"],
            "--cluster needs --global",
        ),
        // Without workers too: the forgotten `--global` is named, not the missing workers.
        (vec!["--cluster", "a=http://x"], "--cluster needs --global"),
        (
            vec!["--mock-workers", "1", "--cluster-name", "a b"],
            "--cluster-name",
        ),
        // A stated latency past any engine's overflowed the global estimate into NaN.
        (
            vec![
                "--mock-workers",
                "1",
                "--cluster-decode-ms-per-token",
                "1e308",
            ],
            "--cluster-decode-ms-per-token",
        ),
        (
            vec!["--global", "--cluster", "a=http://x,rtt_ms=1,rtt_ms=2"],
            "rtt_ms given twice",
        ),
        // Two of these summed to infinity.
        (
            vec!["--global", "--cluster", "a=http://x,weight=1e308"],
            "weight",
        ),
    ] {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"));
        cmd.arg("serve")
            .args(["--port", "0"])
            .args(&args)
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
            .await
            .expect("exits in time")
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// A session released at the global router is forgotten there (its gauge drops, a second
/// release finds nothing) and released by the cluster router that pinned it; the dead cluster
/// is reported as not answering. Both release routes of `serve` are served.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_released_at_the_global_router_is_released_everywhere() {
    let s = setup_with(&["--router-session-affinity-ttl-secs", "300"]).await;
    let mut home = String::new();
    for turn in 0..2 {
        let (status, cluster) = s.turn("held", &prompt(1, turn), false).await;
        assert_eq!(status, 200);
        home = cluster;
    }
    let sessions = |m: &str| metric(m, "kvrouter_global_sessions");
    assert_eq!(sessions(&s.metrics().await), 1.0);
    let release = || async {
        let r = s
            .http
            .delete(format!("{}/v1/sessions/held", s.global.http()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    };
    let first = release().await;
    assert_eq!(first["released"], true, "{first}");
    assert_eq!(first["clusters"][&home], true, "{first}");
    assert_eq!(first["clusters"]["dead"], Value::Null, "{first}");
    let other = if home == "fast" { "slow" } else { "fast" };
    assert_eq!(first["clusters"][other], false, "{first}");
    assert_eq!(sessions(&s.metrics().await), 0.0);
    let again = release().await;
    assert_eq!(again["released"], false, "{again}");
    assert_eq!(again["clusters"][&home], false, "{again}");

    let (status, home2) = s.turn("held-2", &prompt(2, 0), true).await;
    assert_eq!(status, 200);
    let finish = |body: Value| {
        let ask = s
            .http
            .post(format!("{}/finish_session", s.global.http()))
            .json(&body);
        async move { ask.send().await.unwrap() }
    };
    let r = finish(json!({"session_id": "held-2"})).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["released"], true, "{v}");
    assert_eq!(v["clusters"][&home2], true, "{v}");
    let r = finish(json!({"session": "held-2"})).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "session_id", "{v}");
}

/// Clusters that serve different models (found by probing: requests went to any cluster, and
/// `GET /v1/models` answered one cluster's list): a request goes only to a cluster that serves
/// its model, a model none serves is a 404 naming `model`, and the global router lists every
/// available cluster's models itself (not counted as routed requests).
#[tokio::test(flavor = "multi_thread")]
async fn requests_go_only_to_clusters_that_serve_their_model() {
    let a = local("a", "20", &["--model-name", "m"]).await;
    let b = local("b", "20", &["--model-name", "other"]).await;
    let clusters = [format!("a={}", a.http()), format!("b={}", b.http())];
    let global = global_over(&clusters, &[]).await;
    let http = reqwest::Client::new();
    let base = global.http();
    let get = |path: String| {
        let http = http.clone();
        async move {
            let r = http.get(path).send().await.expect("answers");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // Bounded: both clusters' lists are known and answered together.
    let listed = common::poll(Duration::from_secs(20), || async {
        let (_, v) = get(format!("{base}/v1/models")).await;
        let mut ids: Vec<String> = v["data"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter_map(|c| c["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids == ["m", "other"]
    })
    .await;
    assert!(
        listed.is_some(),
        "{:?}",
        get(format!("{base}/v1/models")).await
    );
    for (model, cluster) in [("other", "b"), ("m", "a")] {
        for i in 0..6 {
            let r = http
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": model, "prompt": format!("question {i}"), "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            let at = r.headers().get("x-kvrouter-cluster").cloned();
            let status = r.status().as_u16();
            assert_eq!(status, 200, "{model}: {}", r.text().await.unwrap());
            assert_eq!(at.unwrap().to_str().unwrap(), cluster, "{model}");
        }
    }
    let r = http
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "nope", "prompt": "q", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "model", "{v}");
    let (status, card) = get(format!("{base}/v1/models/other")).await;
    assert_eq!((status, card["id"].clone()), (200, json!("other")));
    let (status, v) = get(format!("{base}/v1/models/nope")).await;
    assert_eq!((status, v["error"]["param"].clone()), (404, json!("model")));
    let sent = metric(
        &common::metrics(&base).await,
        "kvrouter_global_requests_total",
    );
    assert_eq!(sent, 12.0, "only the completions were routed");
}

/// `--api-key` on the global router guards its data plane; the client's key goes on to the
/// clusters (started with the same key), and the model lists are read with the cluster token.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_key_at_the_global_router_goes_on_to_the_clusters() {
    let a = local("a", "20", &["--api-key", "ck", "--model-name", "m"]).await;
    let global = global_over(
        &[format!("a={}", a.http())],
        &["--api-key", "ck", "--admin-token", "global-admin"],
    )
    .await;
    let http = reqwest::Client::new();
    let base = global.http();
    let send = |key: Option<&'static str>| {
        let mut r = http
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "m", "prompt": "hello", "max_tokens": 2}));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let served = common::poll(Duration::from_secs(20), || async {
        send(Some("ck")).await.unwrap().status().as_u16() == 200
    })
    .await;
    assert!(served.is_some(), "a request with the key is served");
    assert_eq!(send(None).await.unwrap().status().as_u16(), 401);
    assert_eq!(send(Some("nope")).await.unwrap().status().as_u16(), 401);
    // Its own admin token is no key here: it would go on to the cluster (found by probing).
    let admin = send(Some("global-admin")).await.unwrap();
    assert_eq!(admin.status().as_u16(), 401);
    assert!(admin.headers().get("x-kvrouter-cluster").is_none());
    // The edge's head checks hold here too: a coded body is refused before it is forwarded.
    let coded = http
        .post(format!("{base}/v1/completions"))
        .bearer_auth("ck")
        .header("content-encoding", "gzip")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(coded.status().as_u16(), 415);
    assert!(coded.headers().get("x-kvrouter-cluster").is_none());
    // The list of cluster a was read with the cluster token: answered at the global router.
    let listed = common::poll(Duration::from_secs(20), || async {
        let r = http
            .get(format!("{base}/v1/models"))
            .bearer_auth("ck")
            .send()
            .await
            .unwrap();
        r.headers().get("x-kvrouter-cluster").is_none()
            && r.json::<Value>().await.unwrap()["data"][0]["id"] == "m"
    })
    .await;
    assert!(listed.is_some());
    assert_eq!(
        http.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
}

/// A fake cluster router whose `POST /finish_session` answers after 600 ms: `held` becomes 1
/// when the asker kept the connection that long, 2 when it went away first. Other paths: 404.
async fn slow_releasing_cluster() -> (String, Arc<AtomicU8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let held = Arc::new(AtomicU8::new(0));
    let seen = held.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = [0u8; 4096];
                let n = sock.read(&mut head).await.unwrap_or(0);
                if !head[..n].starts_with(b"POST /finish_session") {
                    let _ = sock
                        .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                        .await;
                    return;
                }
                let mut rest = [0u8; 4096];
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(600)) => {
                        seen.store(1, Ordering::SeqCst);
                        let body = br#"{"session_id":"gone","released":true}"#;
                        let reply = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            body.len()
                        );
                        let _ = sock.write_all(reply.as_bytes()).await;
                        let _ = sock.write_all(body).await;
                    }
                    // The asker closed the connection (or sent more, which it does not).
                    _ = sock.read(&mut rest) => seen.store(2, Ordering::SeqCst),
                }
            });
        }
    });
    (url, held)
}

/// A client that leaves before the global router's answer does not take the clusters'
/// releases with it: they run on to their end (before, the asks were dropped with the
/// request, and a cluster kept its pin until the session TTL).
#[tokio::test(flavor = "multi_thread")]
async fn a_release_goes_on_to_the_clusters_when_its_client_leaves() {
    let (url, held) = slow_releasing_cluster().await;
    let global = global_over(
        &[format!("slow={url}")],
        &["--global-summary-timeout-ms", "5000"],
    )
    .await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let r = impatient
        .delete(format!("{}/v1/sessions/gone", global.http()))
        .send()
        .await;
    assert!(r.is_err(), "the client gives up before the cluster answers");
    let outcome = common::poll(Duration::from_secs(10), || async {
        let v = held.load(Ordering::SeqCst);
        (v != 0).then_some(v)
    })
    .await;
    assert_eq!(
        outcome,
        Some(1),
        "the cluster's release was held to its answer"
    );
}
