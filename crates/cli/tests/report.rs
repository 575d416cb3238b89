//! `kvrouter sim --compare ... --out DIR` writes summary.json and a report.html that a real browser
//! (headless Chromium, installed by `.ci/run`) loads with every plot present.

use std::path::PathBuf;
use std::process::Command;

fn chromium() -> PathBuf {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect(
        "headless Chromium is needed for this test; .ci/run installs Debian's `chromium` package",
    )
}

#[test]
fn sim_writes_a_summary_and_a_report_that_renders() {
    let dir = std::env::temp_dir().join(format!("kvrouter-report-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=4,group_size=4,steps=2,output_median=200,output_cap=1024",
        ])
        .args([
            "--workers",
            "3",
            "--compare",
            "round-robin,kv,kv:router_predicted_ttl_secs=5",
            "--quiet",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("| kv:router_predicted_ttl_secs=5 |"),
        "{table}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let runs = summary.as_array().unwrap();
    assert_eq!(runs.len(), 3);
    for r in runs {
        for key in [
            "config",
            "requests",
            "ttft_ms",
            "itl_ms",
            "e2e_ms",
            "queue_ms",
            "hit_rate",
            "hit_rate_ceiling",
            "output_tokens_per_s",
            "sim_wall_s",
        ] {
            assert!(r.get(key).is_some(), "summary lacks {key}");
        }
        for stat in ["mean", "p50", "p90", "p99"] {
            assert!(r["ttft_ms"][stat].is_number());
        }
        assert!(r["rl"]["step_time_s"]["max"].is_number());
        assert!(r["rl"]["gpu_idle_fraction"].is_number());
    }

    let profile = dir.join("chromium-profile");
    let dom = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
        ])
        .args([
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("file://{}", dir.join("report.html").display()))
        .output()
        .unwrap();
    assert!(
        dom.status.success(),
        "{}",
        String::from_utf8_lossy(&dom.stderr)
    );
    let dom = String::from_utf8_lossy(&dom.stdout);
    for plot in [
        "TTFT CDF",
        "Served prefix hit rate over time",
        "Running requests per worker over time",
        "KV usage over time",
        "RL step time",
        "busy timeline kv",
    ] {
        assert!(
            dom.contains(&format!("data-plot=\"{plot}")),
            "plot {plot:?} missing from the rendered page"
        );
    }
    assert!(
        dom.matches("class=\"series\"").count() >= 12,
        "CDF, hit-rate, running and KV lines per configuration"
    );
    assert!(
        dom.matches("class=\"cell\"").count() >= 3 * 120,
        "a busy/idle cell per worker and time bin"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_traces_and_flags_are_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--trace", "/nonexistent.jsonl", "--quiet"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.jsonl"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--workload", "grpo", "--workload-args", "nope=1"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--workload-args"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--compare",
            "kv:router_bogus=1",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--compare"));
}

#[test]
fn sim_writes_a_perfetto_timeline_with_weight_updates() {
    let dir = std::env::temp_dir().join(format!("kvrouter-perfetto-{}", std::process::id()));
    let trace = dir.join("t.json");
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=2,group_size=4,steps=2,output_median=50,output_cap=200",
            "--workers",
            "2",
            "--weight-update",
            "abort",
            "--weight-load-ms",
            "300",
            "--group-need",
            "3",
            "--quiet",
            "--perfetto",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("samples ended early (first-N-of-M), 0 rollouts lost"),
        "{stdout}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let count = |name: &str| events.iter().filter(|e| e["name"] == name).count();
    assert_eq!(count("decode"), 16, "every request decoded");
    assert_eq!(count("weight update"), 4, "two workers, two updates each");
    assert_eq!(count("process_name"), 2);
    assert!(events
        .iter()
        .all(|e| e["ph"] != "X" || e["dur"].as_u64().unwrap() > 0));
    let bad = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--weight-update",
            "yolo",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--weight-update"));
    let _ = std::fs::remove_dir_all(&dir);
}
