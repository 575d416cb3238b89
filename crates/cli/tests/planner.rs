//! End to end: `kvrouter serve --mock-workers 2 --planner-advise` under a burst of requests.
//! The recommendation rises within 10 s of the burst, holds through the tail, and falls after
//! it; `GET /admin/planner` gives the reasons (behind the admin token) and the gauge agrees.
//! Polls with bounded deadlines; no fixed sleeps.

mod common;

use serde_json::{json, Value};
use std::time::{Duration, Instant};

const TOKEN: &str = "pl-t0k";
const BURST: usize = 24;

struct Server {
    _proc: common::Proc,
    base: String,
    client: reqwest::Client,
}

async fn serve(extra: &[&str]) -> Server {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--admin-token",
        TOKEN,
    ];
    args.extend(extra);
    let proc = common::spawn(&args).await;
    Server {
        base: proc.http(),
        _proc: proc,
        client: reqwest::Client::new(),
    }
}

async fn planner(s: &Server) -> (u16, Value) {
    let r = s
        .client
        .get(format!("{}/admin/planner", s.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// The one pool's recommendation (None before the first tick).
async fn recommended(s: &Server) -> Option<(u64, Value)> {
    let (_, v) = planner(s).await;
    let (_, pool) = v["pools"].as_object()?.iter().next()?;
    let rec = pool["recommendation"].clone();
    Some((rec["workers"].as_u64()?, rec))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_recommendation_rises_within_seconds_of_a_burst_and_falls_after_its_tail() {
    let s = serve(&[
        "--planner-advise",
        "--planner-tick-s",
        "0.2",
        "--planner-requests-per-worker",
        "4",
        "--planner-up-window-s",
        "1",
        "--planner-down-window-s",
        "2",
        // The first RL step's hold lasts this long after it.
        "--planner-horizon-s",
        "2",
    ])
    .await;
    // Idle: down to the minimum once the down window passed.
    common::until(
        "an idle recommendation of 1",
        Duration::from_secs(20),
        || async { recommended(&s).await.filter(|(w, _)| *w == 1) },
    )
    .await;
    let burst_at = Instant::now();
    let tasks: Vec<_> = (0..BURST)
        .map(|i| {
            let (client, url) = (s.client.clone(), format!("{}/v1/completions", s.base));
            tokio::spawn(async move {
                let body = json!({"model": "mock-model", "prompt": format!("burst {i} {}", "x ".repeat(200)), "max_tokens": 300, "ignore_eos": true});
                // RL samples: the planner counts them (`rl_requests`).
                let r = client
                    .post(url)
                    .header("x-kvrouter-group-id", format!("g{}", i / 4))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200);
                r.bytes().await.unwrap();
            })
        })
        .collect();
    // 24 requests at 4 per worker: 6 workers, within 10 s of the burst.
    let (risen, rec) = common::until(
        "the recommendation to rise",
        Duration::from_secs(10),
        || async { recommended(&s).await.filter(|(w, _)| *w >= 4) },
    )
    .await;
    let rise_s = burst_at.elapsed().as_secs_f64();
    assert!(rise_s < 10.0, "rose after {rise_s:.1} s");
    let (_, v) = planner(&s).await;
    let (_, pool) = v["pools"].as_object().unwrap().iter().next().unwrap();
    assert!(
        pool["signals"]["rl_requests"].as_u64().unwrap() > 0,
        "{pool}"
    );
    let reasons = rec["reasons"].to_string();
    assert!(
        reasons.contains("\"requests\"") && reasons.contains("scale_up"),
        "{rec}"
    );
    let g = common::until("the gauge", Duration::from_secs(5), || async {
        common::metric(&s.base, "kvrouter_planner_recommended_workers{pool=")
            .await
            .filter(|g| *g >= 4.0)
    })
    .await;
    assert!(g >= 4.0);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("the burst finishes")
            .unwrap();
    }
    let tail_end = Instant::now();
    // The tail was waited for: still up when the last answer came back.
    let (at_tail_end, rec) = recommended(&s).await.unwrap();
    assert!(at_tail_end >= 2, "fell during the tail: {rec}");
    // Then down again, after the down window.
    common::until(
        "the recommendation to fall",
        Duration::from_secs(20),
        || async { recommended(&s).await.filter(|(w, _)| *w == 1) },
    )
    .await;
    assert!(tail_end.elapsed() >= Duration::from_millis(500));
    println!(
        "rose to {risen} {rise_s:.2} s after the burst; fell {:.2} s after the tail",
        tail_end.elapsed().as_secs_f64()
    );
}

#[tokio::test]
async fn the_planner_endpoint_needs_the_token_and_the_flag_and_bad_bounds_name_the_flag() {
    let s = serve(&["--planner-advise"]).await;
    let r = s
        .client
        .get(format!("{}/admin/planner", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let (status, v) = common::until("a first tick", Duration::from_secs(10), || async {
        let (st, v) = planner(&s).await;
        (st == 200 && v["pools"].as_object().is_some_and(|p| !p.is_empty())).then_some((st, v))
    })
    .await;
    assert_eq!(status, 200);
    assert_eq!(v["mode"], "advisory");
    assert_eq!(v["config"]["horizon_s"], 180.0);
    let off = serve(&[]).await;
    let (status, v) = planner(&off).await;
    assert_eq!(status, 404);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--planner-advise"));
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args([
                "serve",
                "--port",
                "0",
                "--mock-workers",
                "1",
                "--planner-advise",
                "--planner-min-workers",
                "3",
                "--planner-max-workers",
                "2",
            ])
            .output(),
    )
    .await
    .expect("exits in time")
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--planner-max-workers"), "{err}");
    // Seconds past what a duration holds are refused naming the flag (they panicked).
    for flag in [
        "--planner-horizon-s",
        "--planner-startup-s",
        "--planner-tick-s",
    ] {
        let out = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
                .args(["serve", "--port", "0", "--mock-workers", "1"])
                .args(["--planner-advise", flag, "1e300"])
                .output(),
        )
        .await
        .expect("exits in time")
        .unwrap();
        assert_eq!(out.status.code(), Some(1), "{flag}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && !err.contains("panicked"), "{err}");
    }
    // A tick of nanoseconds spun a core (found by probing): refused naming its bound.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--port", "0", "--mock-workers", "1"])
        .args(["--planner-advise", "--planner-tick-s", "1e-9"])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("at least 0.01"),
        "{err}"
    );
}

/// `kvrouter sim --planner`: the planner run and the fixed fleet of its peak, both in
/// summary.json, the comparison on stdout and in report.html.
#[tokio::test]
async fn sim_with_the_planner_in_the_loop_reports_gpu_seconds_against_the_peak_fleet() {
    let out_dir = std::env::temp_dir().join(format!("kvrouter-planner-sim-{}", std::process::id()));
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args([
                "sim",
                "--workload",
                "grpo",
                "--workload-args",
                "prompts=8,group_size=8,steps=3,output_median=400,output_cap=2048,sync_pause_s=150,rollout_share=0.75,seed=7",
                "--workers",
                "4",
                "--planner",
                "--planner-requests-per-worker",
                "16",
                "--planner-startup-s",
                "10",
                "--planner-rl-rollout-share",
                "0.75",
                "--quiet",
                "--out",
            ])
            .arg(&out_dir)
            .output(),
    )
    .await
    .expect("exits in time")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("fewer GPU-seconds"), "{stdout}");
    let runs: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap())
            .unwrap();
    let b = &runs[0]["fleet"]["baseline"];
    assert_eq!(runs[1]["config"], "fixed-4");
    assert!(b["gpu_seconds_saved"].as_f64().unwrap() > 0.2, "{b}");
    assert!(b["step_time_ratio"].as_f64().unwrap() <= 1.10, "{b}");
    let html = std::fs::read_to_string(out_dir.join("report.html")).unwrap();
    assert!(html.contains("data-plot=\"planner fleet\""));
    let _ = std::fs::remove_dir_all(&out_dir);
    // The planner and --compare do not go together.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--planner",
            "--compare",
            "kv,round-robin",
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--compare"));
    // A rollout share outside (0, 1], as a flag or a workload argument, is named.
    for (args, name) in [
        (
            ["--planner-rl-rollout-share", "1.5"],
            "--planner-rl-rollout-share",
        ),
        (
            ["--workload-args", "steps=1,rollout_share=0"],
            "rollout_share",
        ),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["sim", "--workload", "grpo", "--planner", "--quiet"])
            .args(args)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(name), "{err}");
    }
}
