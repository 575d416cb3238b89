//! `kvrouter bench` as a real process against `kvrouter serve --mock-workers` over loopback.

mod common;

use serde_json::Value;
use std::time::Duration;
use tokio::process::Command;

async fn bench(args: &[&str], out: &std::path::Path) -> (std::process::Output, Option<Value>) {
    let output = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .arg("bench")
        .args(args)
        .args(["--quiet", "--out"])
        .arg(out)
        .output()
        .await
        .expect("run kvrouter bench");
    let summary = std::fs::read_to_string(out.join("summary.json"))
        .ok()
        .map(|s| serde_json::from_str::<Value>(&s).expect("summary.json is JSON")[0].clone());
    (output, summary)
}

/// `kvrouter serve` with `workers` embedded mock engines at speed-up `speedup`, plus `extra`.
async fn mock_serve(workers: &str, speedup: &str, extra: &[&str]) -> common::Proc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        workers,
        "--mock-speedup-ratio",
        speedup,
    ];
    args.extend_from_slice(extra);
    common::spawn(&args).await
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvrouter-bench-{name}-{}", std::process::id()))
}

#[tokio::test]
async fn grpo_groups_replay_live_and_share_their_prompts() {
    let server = mock_serve("2", "50", &["--expose-decisions"]).await;
    let out = temp("grpo");
    std::fs::create_dir_all(&out).unwrap();
    let trace = out.join("trace.json");
    let (output, summary) = bench(
        &[
            "--url",
            &server.http(),
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=3,group_size=4,steps=2,output_median=40,output_cap=64",
            "--perfetto",
            trace.to_str().unwrap(),
        ],
        &out,
    )
    .await;
    // The timeline: a prefill and a decode span per request, on the worker that served it.
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let count = |name: &str| events.iter().filter(|e| e["name"] == name).count();
    assert_eq!((count("prefill"), count("decode")), (24, 24));
    let workers: std::collections::BTreeSet<u64> = events
        .iter()
        .filter(|e| e["name"] == "decode")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    // Each span sits on a worker of the two (which ones `cost` chooses for a burst of short
    // prompts depends on timing: all on one worker is a valid placement).
    assert!(
        !workers.is_empty() && workers.iter().all(|w| *w < 2),
        "{workers:?}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("| bench |"), "{stdout}");
    let s = summary.expect("summary.json");
    assert_eq!(s["requests"], 24);
    assert_eq!(s["completed"], 24, "{s}");
    assert_eq!(s["rejected"], 0);
    // Samples of a group share their prompt: after the first, the engine serves it from cache.
    let hit = s["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.3, "hit rate {hit}");
    assert!(s["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(s["output_tokens"].as_u64().unwrap() >= 24);
    // Step barriers were followed: two RL steps with measured step times.
    assert_eq!(s["rl"]["steps"], 2, "{s}");
    assert!(s["rl"]["step_time_s"]["mean"].as_f64().unwrap() > 0.0);
    // A line per request sent, in workload order, adding up to the summary's hit rate.
    let lines: Vec<Value> = std::fs::read_to_string(out.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let indexes: Vec<u64> = lines.iter().map(|l| l["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, (0..24).collect::<Vec<u64>>());
    assert!(lines
        .iter()
        .all(|l| l["status"] == "ok" && l["ttft_ms"].as_f64().unwrap() > 0.0));
    // Each names its worker and, with --expose-decisions, the router's scores behind it.
    for l in &lines {
        assert!(l["sent_ms"].as_f64().unwrap() >= 0.0, "{l}");
        assert_eq!(l["decision"]["worker"], l["worker"], "{l}");
        assert_eq!(
            l["decision"]["candidates"].as_array().unwrap().len(),
            2,
            "{l}"
        );
    }
    let sum = |k: &str| lines.iter().map(|l| l[k].as_f64().unwrap()).sum::<f64>();
    let rate = sum("cached_tokens") / sum("input_tokens");
    assert!((rate - hit).abs() < 1e-3, "{rate} vs {hit}");
    let _ = std::fs::remove_dir_all(&out);

    // Text prompts (for endpoints that take no token ids) share prefixes the same way.
    let (output, summary) = bench(
        &[
            "--url",
            &server.http(),
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=3,group_size=4,steps=1,output_median=40,output_cap=64",
            "--prompt-format",
            "text",
        ],
        &out,
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let s = summary.expect("summary.json");
    assert_eq!(s["completed"], 12, "{s}");
    let hit = s["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.3, "text prompts: hit rate {hit}");
    let _ = std::fs::remove_dir_all(out);
}

#[tokio::test]
async fn a_trace_slice_replays_with_its_arrival_times() {
    let server = mock_serve("2", "100", &[]).await;
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/mooncake_conversation/conversation_trace.jsonl"
    );
    let out = temp("trace");
    let (output, summary) = bench(
        &[
            "--url",
            &server.http(),
            "--trace",
            trace,
            "--max-requests",
            "20",
            "--arrival-speedup",
            "200",
        ],
        &out,
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let s = summary.expect("summary.json");
    assert_eq!(
        (s["requests"].as_u64(), s["completed"].as_u64()),
        (Some(20), Some(20))
    );
    assert!(s["hit_rate_ceiling"].as_f64().unwrap() > 0.0);
    let _ = std::fs::remove_dir_all(out);
}

#[tokio::test]
async fn bad_flags_and_dead_endpoints_name_the_flag() {
    let out = temp("bad");
    let (output, _) = bench(&["--url", "localhost:1", "--workload", "grpo"], &out).await;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--url"));

    // Nothing listens on this port (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let (output, _) = bench(&["--url", &url, "--workload", "grpo"], &out).await;
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("--url") && err.contains("/v1/models"), "{err}");

    let (output, _) = bench(&["--url", &url, "--model", "m"], &out).await;
    assert!(String::from_utf8_lossy(&output.stderr).contains("--trace"));
    // A URL bench would append its paths to wrongly: /v1/v1/models, /?x=1/v1/models.
    for bad in [format!("{url}/v1"), format!("{url}/?x=1")] {
        let (output, _) = bench(&["--url", &bad, "--workload", "grpo"], &out).await;
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && err.contains("--url"),
            "{bad}: {err}"
        );
    }
    // Both a trace and a generator: refused, as `sim` refuses them (the generator was ignored).
    let (output, _) = bench(
        &["--url", &url, "--trace", "t.jsonl", "--workload", "grpo"],
        &out,
    )
    .await;
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && err.contains("--trace") && err.contains("--workload"),
        "{err}"
    );

    // An endpoint that accepts and never answers: `GET /v1/models` hung for ever.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let (output, _) = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        bench(
            &[
                "--url",
                &silent_url,
                "--workload",
                "grpo",
                "--request-timeout-s",
                "1",
            ],
            &out,
        ),
    )
    .await
    .expect("bench gives up on a silent endpoint");
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && err.contains("/v1/models"),
        "{err}"
    );
    drop(silent);

    // An --out that cannot be written is refused before the run, not after it.
    let file = out.with_extension("file");
    std::fs::write(&file, b"x").unwrap();
    let (output, _) = bench(
        &["--url", &url, "--model", "m", "--workload", "grpo"],
        &file,
    )
    .await;
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && err.contains("--out"), "{err}");
    let _ = std::fs::remove_file(&file);

    // Values that overflowed a duration (a panic).
    for (flag, value) in [
        ("--arrival-speedup", "1e-300"),
        ("--request-timeout-s", "1e20"),
    ] {
        let (output, _) = bench(
            &[
                "--url",
                &url,
                "--model",
                "m",
                "--workload",
                "grpo",
                flag,
                value,
            ],
            &out,
        )
        .await;
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && err.contains(flag) && !err.contains("panicked"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(out);
}

/// An endpoint whose streams carry no token (only `[DONE]`) served nothing: every request
/// fails, none counts as completed with a TTFT of 0.
#[tokio::test]
async fn a_stream_without_a_token_is_a_failure() {
    let empty = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(|| async {
            ([("content-type", "text/event-stream")], "data: [DONE]\n\n")
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, empty).await.unwrap() });
    let out = temp("empty");
    let (output, summary) = bench(
        &[
            "--url",
            &url,
            "--model",
            "m",
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=2,group_size=2,steps=1,output_median=8,output_cap=16",
        ],
        &out,
    )
    .await;
    assert!(!output.status.success());
    let s = summary.expect("summary.json");
    assert_eq!(
        (s["completed"].as_u64(), s["failed"].as_u64()),
        (Some(0), Some(4)),
        "{s}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Ctrl-C ends a run as --duration-s would: nothing new is sent, what is in flight finishes,
/// and the summary of what was sent is written (it was lost before).
#[tokio::test]
async fn an_interrupted_run_still_writes_the_summary_of_what_was_sent() {
    let server = mock_serve("2", "5", &[]).await;
    let out = temp("interrupt");
    let mut run = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["bench", "--url", &server.http(), "--quiet", "--out"])
        .arg(&out)
        .args(["--workload", "grpo", "--workload-args"])
        .arg("prompts=8,group_size=4,steps=4,output_median=64,output_cap=128")
        .args(["--concurrency", "2"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let base = server.http();
    common::until("two requests to finish", Duration::from_secs(60), || {
        let base = base.clone();
        async move {
            common::metric(&base, "kvrouter_request_duration_seconds_count")
                .await
                .unwrap_or(0.0)
                >= 2.0
        }
    })
    .await;
    let pid = run.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(Duration::from_secs(60), run.wait())
        .await
        .expect("the run ends after Ctrl-C")
        .unwrap();
    assert!(status.success(), "{status}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let s = &summary[0];
    let (completed, requests) = (
        s["completed"].as_u64().unwrap(),
        s["requests"].as_u64().unwrap(),
    );
    assert!(completed >= 2 && requests < 128, "{s}");
    assert_eq!(s["failed"].as_u64(), Some(0), "{s}");
    let _ = std::fs::remove_dir_all(&out);
}

#[tokio::test]
async fn first_n_of_m_live_ends_the_rest_of_each_group() {
    let server = mock_serve("2", "20", &[]).await;
    let out = temp("need");
    let (output, summary) = bench(
        &[
            "--url",
            &server.http(),
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=3,group_size=4,steps=2,output_median=100,output_sigma_within=1.5,output_cap=3000,seed=4",
            "--group-need",
            "2",
        ],
        &out,
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let s = summary.expect("summary.json");
    assert_eq!(
        (s["completed"].as_u64(), s["rejected"].as_u64()),
        (Some(24), Some(0)),
        "{s}"
    );
    let early = s["rl"]["ended_early"].as_u64().unwrap();
    assert!(
        (1..=12).contains(&early),
        "at most M - N = 2 per group end early: {early}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Sum of `kvrouter_requests_total` over its labels.
async fn served(base: &str) -> u64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("kvrouter_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn a_repeated_url_spreads_requests_round_robin() {
    let mut routers = Vec::new();
    for _ in 0..2 {
        routers.push(mock_serve("1", "50", &[]).await);
    }
    let out = temp("urls");
    let (a, b) = (routers[0].http(), routers[1].http());
    let (output, summary) = bench(
        &[
            "--url",
            &a,
            "--url",
            &b,
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=2,group_size=4,steps=1,output_median=8,output_cap=16",
        ],
        &out,
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(summary.unwrap()["completed"], 8);
    assert_eq!((served(&a).await, served(&b).await), (4, 4));
    let _ = std::fs::remove_dir_all(&out);
}

/// `--header` reaches the router on every call (the model list, picks, reports): a router with
/// `--pick-auth admin` serves the run with the token and refuses it without.
#[tokio::test]
async fn headers_reach_the_router_on_picks_and_reports() {
    let server = mock_serve(
        "2",
        "50",
        &["--pick-auth", "admin", "--admin-token", "b3nch"],
    )
    .await;
    let out = temp("header");
    std::fs::create_dir_all(&out).unwrap();
    let run = |extra: &'static [&'static str]| {
        let url = server.http();
        let out = out.clone();
        async move {
            let mut args = vec![
                "--url".to_owned(),
                url,
                "--model".to_owned(),
                "mock-model".to_owned(),
                "--workload".to_owned(),
                "grpo".to_owned(),
                "--workload-args".to_owned(),
                "prompts=2,group_size=2,steps=1,output_median=8,output_cap=16".to_owned(),
                "--pick".to_owned(),
            ];
            args.extend(extra.iter().map(|s| s.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            bench(&args, &out).await
        }
    };
    let (output, summary) = run(&["--header", "Authorization: Bearer b3nch"]).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(summary.expect("summary.json")["completed"], 4);
    let picks = common::metric(
        &server.http(),
        "kvrouter_picks_total{source=\"api\",end=\"finished\"}",
    )
    .await
    .unwrap_or(0.0);
    assert_eq!(picks, 4.0, "every report reached the router");
    // Without the token every pick is a 401: failed, not refused, and the run fails.
    let (output, summary) = run(&[]).await;
    assert!(!output.status.success());
    let s = summary.expect("summary.json");
    assert_eq!(
        (
            s["completed"].as_u64(),
            s["rejected"].as_u64(),
            s["failed"].as_u64()
        ),
        (Some(0), Some(0), Some(4)),
        "{s}"
    );
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("4 request(s) failed, 0 refused"), "{err}");
    let (output, _) = run(&["--header", "no colon"]).await;
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && err.contains("--header"),
        "{err}"
    );
    // The request's own framing is not the user's to set (a given length cut every body).
    const FRAMING: [&[&str]; 3] = [
        &["--header", "Content-Length: 5"],
        &["--header", "transfer-encoding: chunked"],
        &["--header", "Host: evil"],
    ];
    for args in FRAMING {
        let framing = args[1];
        let (output, _) = run(args).await;
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && err.contains("is set by the request itself"),
            "{framing}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[tokio::test]
async fn pick_mode_asks_the_router_and_sends_to_the_worker_directly() {
    let server = mock_serve("2", "50", &[]).await;
    let out = temp("pick");
    std::fs::create_dir_all(&out).unwrap();
    let (output, summary) = bench(
        &[
            "--url",
            &server.http(),
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=3,group_size=4,steps=2,output_median=40,output_cap=64",
            "--group-sizes",
            "--pick",
        ],
        &out,
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let s = summary.expect("summary.json");
    assert_eq!(s["completed"], 24, "{s}");
    assert!(s["hit_rate"].as_f64().unwrap() > 0.3, "{s}");
    // Every request was a pick, reported finished; none went through the proxy.
    let metrics = reqwest::get(format!("{}/metrics", server.http()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        value("kvrouter_picks_total{source=\"api\",end=\"finished\"}"),
        24.0
    );
    assert_eq!(value("kvrouter_picks_outstanding"), 0.0);
    assert_eq!(value("kvrouter_worker_active_requests{"), 0.0);
    let _ = std::fs::remove_dir_all(out);
}

/// `--end-sessions` ends each session after its last turn: the router that pinned every session
/// holds none of them afterwards, where the same run without the flag leaves them pinned.
#[tokio::test]
async fn end_sessions_releases_every_session_the_run_pinned() {
    let http = reqwest::Client::new();
    let mut still_pinned = Vec::new();
    for end in [false, true] {
        let server = mock_serve("2", "50", &["--router-session-affinity-ttl-secs", "300"]).await;
        let out = temp(&format!("end-sessions-{end}"));
        std::fs::create_dir_all(&out).unwrap();
        let url = server.http();
        let mut args = vec![
            "--url",
            &url,
            "--workload",
            "agentic",
            "--workload-args",
            "sessions=3,turns_median=3,output_median=8,tool_latency_median_s=0.01",
            "--session-header",
        ];
        if end {
            args.push("--end-sessions");
        }
        let (output, summary) = bench(&args, &out).await;
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let s = summary.expect("summary.json");
        assert_eq!(s["completed"], s["requests"], "{s}");
        // A release answers whether the router still held the session.
        let mut pinned = 0;
        for session in 0..3 {
            let v: Value = http
                .delete(format!("{url}/v1/sessions/{session}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            pinned += usize::from(v["released"] == true);
        }
        still_pinned.push(pinned);
    }
    assert_eq!(still_pinned, vec![3, 0]);
}
